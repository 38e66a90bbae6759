"""The data behind ``attnlab serve``: studies, trials, training curves and results, read into plain dicts.

Everything here reads; nothing writes, starts or stops anything. The study layout is
:class:`attnlab.study.folder.StudyFolder`'s, read back typed (each run's status as a
:class:`~attnlab.study.folder.TrialRecord`, the saved study as a :class:`~attnlab.study.folder.SavedStudy`; each
run's ``metrics.jsonl`` through :func:`attnlab.runfolder.read_metrics`); the results are :class:`attnlab.results.ResultsStore`'s rows, and the
Table-4 layout, its cells and the best configuration come from :mod:`attnlab.results.reports`, the code of
``attnlab results table|best`` (nothing is recomputed here). Locations are :class:`attnlab.location.Location`
(a local folder or an object-store URI alike); ``pathlib`` never sees one.

Bad input raises :class:`NotFound` (a store, runs folder or study that does not exist: the page answers 404) or
another :class:`attnlab.errors.UserError` (400), each one sentence. Every value returned is JSON-safe (NaN and
infinities become None). No Ray, no HTTP here: the web layer is :mod:`attnlab.serve.app`.
"""

from __future__ import annotations

import math
import os
import re
import socket
import threading
import time
from dataclasses import dataclass

from attnlab.errors import UserError
from attnlab.location import Location
from attnlab.names import STUDY_NAME
from attnlab.results import COMPLETE_METRIC, LAW_METRIC, METRICS, ResultsStore, StudyRows, reports
from attnlab.study.folder import STATUSES, STUDY_FILE, SavedStudy, StudyFolder, TrialRecord
from attnlab.runfolder import METRICS_FILE, VAL_LOSS_AT, latest_losses, read_metrics
from attnlab.states import TrialStatus

DEFAULT_RAY_DASHBOARD = "http://127.0.0.1:8265"
_HTTP_URL = re.compile(r"https?://[^\s\"'<>]+")
# The evaluation settings the extrapolation figure lets a reader pick (the other varying columns name the lines).
SELECTABLE = ("p_eval", "rope_scaling")
PER_PAGE = 50  # trials per page of a study's trial list
# Whose training curves a page of trials carries (``curves=``): the trials whose status is running (the default),
# all of them, or none.
CURVES = (TrialStatus.RUNNING.value, "all", "none")


class NotFound(UserError):
    """A store, runs folder or study that does not exist (the page answers HTTP 404 with this sentence)."""


@dataclass(frozen=True)
class Sources:
    """Where the page reads: the results store and the studies' runs folder (each a path or a URI), and the Ray
    dashboard the user named (``--ray-dashboard``; None: each study's recorded one, see :func:`ray_dashboard`)."""

    store: ResultsStore
    runs: Location
    ray_dashboard: str | None = None


def open_sources(store: str | Location, runs: str | Location, ray_dashboard: str | None = None) -> Sources:
    """The sources named by ``--store`` and ``--runs``; UserError (one line naming the flag) when a value is
    not a location, or when neither it nor the folder (or bucket) it would be created in exists: a typo, since
    a study creates both where it is told. A location that does not exist *yet* is fine: a study just started
    writes it, and the page says so until it does."""
    store_loc = Location.parse(store, field="--store")
    runs_loc = Location.parse(runs, field="--runs")
    if ray_dashboard is not None and not _HTTP_URL.fullmatch(ray_dashboard):
        raise UserError(f"--ray-dashboard {ray_dashboard!r}: give an http:// or https:// URL, e.g. "
                        f"{DEFAULT_RAY_DASHBOARD}")
    for flag, loc in (("--store", store_loc), ("--runs", runs_loc)):
        if not _reachable(loc):
            where = "bucket" if not loc.is_local and "/" not in loc.path else "folder it would be created in"
            raise NotFound(f"{flag} {loc.uri}: neither it nor the {where} exists; give the {flag} that "
                           "`attnlab study run` was given")
    return Sources(ResultsStore(store_loc), runs_loc, ray_dashboard)


def _reachable(loc: Location) -> bool:
    try:
        if loc.exists():
            return True
        if not loc.is_local and "/" not in loc.path:  # a bucket that does not exist
            return False
        return loc.parent.exists()
    except OSError as exc:
        raise UserError(f"{loc.uri} cannot be read: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


# ------------------------------------------------------------------------------------------------ helpers
def clean(value):
    """A JSON-safe copy: NaN and infinities become None, numpy scalars plain numbers, tuples lists."""
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy / pandas scalars
        try:
            value = value.item()
        except (ValueError, AttributeError):
            pass
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is not None and not isinstance(value, (str, int, float, bool)):
        try:
            import pandas as pd

            if pd.isna(value):
                return None
        except (TypeError, ValueError):
            pass
        return str(value)
    return value


def point_label(point: dict | None) -> str:
    """``{"attention": "lssar", "seed": 0}`` -> ``"attention=lssar, seed=0"``."""
    if not point:
        return "(no point)"
    return ", ".join(f"{k}={'none' if v is None else (f'{v:g}' if isinstance(v, float) else v)}"
                     for k, v in point.items())


def check_study_name(name: str) -> str:
    if not isinstance(name, str) or not STUDY_NAME.match(name):
        raise NotFound(f"study {name!r}: not a study name (letters, digits and . _ + -)")
    return name


# ------------------------------------------------------------------------------------------------ studies
def study_names(sources: Sources) -> dict[str, dict]:
    """Every study: the folders in the runs folder holding a ``study.json`` and the studies the store has rows
    of, as ``{name: {"has_state": bool, "has_results": bool}}`` sorted by name."""
    found: dict[str, dict] = {}
    for name in sources.runs.list_names(hidden=False):
        if STUDY_NAME.match(name) and sources.runs.is_file(f"{name}/{STUDY_FILE}"):
            found[name] = {"has_state": True, "has_results": False}
    for name in sources.store.studies():
        found.setdefault(name, {"has_state": False, "has_results": False})["has_results"] = True
    return dict(sorted(found.items()))


def ray_dashboard(sources: Sources, recorded: dict | None) -> dict:
    """The Ray dashboard a study's page links to, ``{"url": URL or None, "source": ..., "note": ...}``: the one
    ``--ray-dashboard`` named (``source`` "flag": the user reaches it their own way, e.g. an SSH tunnel, so it
    always wins); else the dashboard of the cluster the study runs on, as its ``study.json`` records it
    (``recorded``, :attr:`SavedStudy.ray`; "study", or ``url`` None when that cluster has none, or when it was
    the study's own embedded cluster and has stopped: then ``stopped`` is True); else
    :data:`DEFAULT_RAY_DASHBOARD` ("default": nothing recorded, e.g. a study written by an older attnlab)."""
    if sources.ray_dashboard:
        return {"url": sources.ray_dashboard, "source": "flag", "note": "--ray-dashboard"}
    if recorded is not None and recorded.get("embedded") and _cluster_stopped(recorded):
        return {"url": None, "source": "study", "stopped": True,
                "note": "the study ran on a Ray cluster of its own, which ended with it"}
    if recorded is not None:
        url = recorded.get("dashboard")
        if isinstance(url, str) and _HTTP_URL.fullmatch(url):
            return {"url": url, "source": "study", "note": "the cluster the study runs on"}
        if url is None:
            return {"url": None, "source": "study", "note": str(recorded.get("note") or "the cluster has none")}
    return {"url": DEFAULT_RAY_DASHBOARD, "source": "default", "note": "nothing recorded: Ray's default port"}


def _cluster_stopped(recorded: dict) -> bool:
    """Whether the embedded cluster a study recorded has stopped: the study said so as it ended (``stopped``), or
    the process that started it, on this machine, is gone (a study killed before it could say so)."""
    if recorded.get("stopped"):
        return True
    pid, host = recorded.get("pid"), recorded.get("host")
    if not isinstance(pid, int) or pid <= 0 or host != socket.gethostname():
        return False  # another machine's process: not ours to look at
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except OSError:  # it exists (another user's process)
        return False
    return False


def header_dashboard(sources: Sources, studies: list[dict] | None = None) -> str | None:
    """The header's "Ray dashboard" link outside a study page: ``--ray-dashboard`` when given, else the
    dashboard the most recently started of ``studies`` (:func:`study_info` dicts) recorded, else the default."""
    if sources.ray_dashboard:
        return sources.ray_dashboard
    recorded = [s["ray"] for s in studies or []
                if (s.get("ray") or {}).get("source") == "study" and s["ray"].get("url")]
    if recorded:
        return max(recorded, key=lambda r: r.get("recorded") or 0)["url"]
    return DEFAULT_RAY_DASHBOARD


def study_info(sources: Sources, name: str) -> dict:
    """What a study is: its saved study's search engine and objective, where its state lives, and the commands
    and links that watch it elsewhere (Ray dashboard, TensorBoard, optuna-dashboard). NotFound when neither the
    runs folder nor the store knows it."""
    check_study_name(name)
    state = StudyFolder(sources.runs, name)
    saved: SavedStudy | None = state.saved_study() if _exists(state.loc) else None
    has_results = _has_results(sources.store, name)
    if saved is None and not has_results:
        known = ", ".join(study_names(sources)) or "none"
        raise NotFound(f"no study {name!r} under --runs {sources.runs.uri} or in --store "
                       f"{sources.store.uri}; studies: {known}")
    recorded = saved.ray if saved else None
    board = ray_dashboard(sources, recorded)
    links = {"ray_dashboard": board["url"],
             "tensorboard": f"tensorboard --logdir {state.tune.uri}" if saved else None,
             "optuna_dashboard": None}
    if saved and saved.engine == "optuna":
        links["optuna_dashboard"] = f"optuna-dashboard {state.optuna_url(saved.optuna_storage)}"
    return clean({"name": name, "has_state": saved is not None, "has_results": has_results,
                  "state": state.loc.uri, "store": sources.store.uri, "engine": saved.engine if saved else None,
                  "description": saved.description if saved else None,
                  "objective": saved.objectives[0].parts.as_dict() if saved and saved.objectives else None,
                  "objectives": [o.metric for o in saved.objectives] if saved else [], "links": links,
                  "ray": {"stopped": False, **board, "recorded": (recorded or {}).get("recorded")}})


def _has_results(store: ResultsStore, name: str) -> bool:
    try:
        return store.has_study(name)
    except OSError as exc:
        raise UserError(f"--store {store.uri} cannot be read: {_first_line(exc)}") from None


def _exists(loc: Location) -> bool:
    try:
        return loc.exists()
    except OSError as exc:
        raise UserError(f"{loc.uri} cannot be read: {_first_line(exc)}") from None


def overview(sources: Sources) -> dict:
    """The index page: every study with its trial counts by status and when it last changed."""
    if not _exists(sources.runs) and not sources.store.exists():
        raise NotFound(f"--runs {sources.runs.uri} does not exist (yet) and neither does --store "
                       f"{sources.store.uri}: no study has run there. Start one with `attnlab study run STUDY.yaml "
                       f"--runs {sources.runs.uri} --store {sources.store.uri}`; this page picks it up.")
    studies = []
    for name, where in study_names(sources).items():
        info = study_info(sources, name)
        runs = StudyFolder(sources.runs, name).trials() if where["has_state"] else []
        studies.append({**info, "trials": len(runs), "counts": _status_counts(runs),
                        "updated": max((r.updated or 0 for r in runs), default=None)})
    return clean({"runs": sources.runs.uri, "store": sources.store.uri,
                  "runs_exists": _exists(sources.runs), "store_exists": sources.store.exists(),
                  "studies": studies, "now": time.time()})


# ------------------------------------------------------------------------------------------------ trials
def _curve(lines: list[dict]) -> dict:
    """Train and validation loss against the training step, from a run's metrics lines; ``val_at``: the validation
    loss at each longer length the run measured while training (``val_loss_at``, a study's
    ``eval.during_training``), one series per length, shortest first: ``[{"length", "step", "val_loss"}]``."""
    train = [(m["step"], m["train_loss"]) for m in lines if "step" in m and m.get("train_loss") is not None]
    val = [(m["step"], m["val_loss"]) for m in lines if "step" in m and m.get("val_loss") is not None]
    at: dict[int, list] = {}
    for m in lines:
        if "step" in m and isinstance(m.get(VAL_LOSS_AT), dict):
            for length, loss in m[VAL_LOSS_AT].items():
                if str(length).isdigit() and loss is not None:
                    at.setdefault(int(length), []).append((m["step"], loss))
    return clean({"step": [s for s, _ in train], "train_loss": [v for _, v in train],
                  "val_step": [s for s, _ in val], "val_loss": [v for _, v in val],
                  "val_at": [{"length": length, "step": [s for s, _ in at[length]],
                              "val_loss": [v for _, v in at[length]]} for length in sorted(at)]})


_FINISHED_LOSSES: dict[tuple, dict] = {}  # (run, status, updated) -> latest_losses of a run that stopped training
_FINISHED_LOSSES_SIZE = 4096
_FINISHED_LOCK = threading.Lock()


def _finished_losses(run: Location, trial: TrialRecord) -> dict:
    """The last train and validation loss of a run that no longer trains (complete, cached, diverged, pruned,
    failed), from its ``metrics.jsonl``: read once per status record (a finished run's metrics do not change,
    and a status change rewrites the record), so a page of finished trials re-reads none of them."""
    key = (run.uri, trial.status, trial.updated)
    with _FINISHED_LOCK:
        hit = _FINISHED_LOSSES.get(key)
    if hit is not None:
        return hit
    losses = latest_losses(read_metrics(run))
    with _FINISHED_LOCK:
        _FINISHED_LOSSES[key] = losses
        while len(_FINISHED_LOSSES) > _FINISHED_LOSSES_SIZE:
            _FINISHED_LOSSES.pop(next(iter(_FINISHED_LOSSES)))
    return losses


def _trial(state: StudyFolder, trial: TrialRecord, with_curve: bool, now: float) -> dict:
    key, status, steps, step, updated = trial.train_key or "?", trial.status, trial.steps, trial.step, trial.updated
    losses: dict = {}  # the run's latest losses (a finished run's last), from its metrics.jsonl
    curve = None
    # a run found trained in another study of the runs folder is read where it is (its status names it)
    run = Location.parse(trial.run_dir) if trial.run_dir else (state.run(key) if key != "?" else None)
    if run is not None and (with_curve or status is TrialStatus.RUNNING):
        lines = read_metrics(run)
        if lines and status is TrialStatus.RUNNING:
            # a live run's last report is newer than its status record
            written = run.fs.get_file_info(run.join(METRICS_FILE)).mtime
            if written is not None:
                updated = max(updated or 0.0, written.timestamp())
            step = lines[-1].get("step", step)
        elif lines and step is None:
            step = lines[-1].get("step")
        losses = latest_losses(lines)
        if with_curve:
            curve = _curve(lines)
    elif run is not None:
        losses = _finished_losses(run, trial)
    progress = None
    if isinstance(steps, (int, float)) and steps > 0 and isinstance(step, (int, float)):
        progress = max(0.0, min(1.0, float(step) / float(steps)))
    if status.succeeded and steps:
        step, progress = steps, 1.0
    return clean({
        "key": key, "status": status, "reason": trial.reason, "point": trial.point,
        "label": point_label(trial.point), "trial": trial.trial, "run_dir": trial.run_dir,
        "stage": trial.stage, "parent": trial.parent,
        "step": step, "steps": steps, "progress": progress, "objectives": trial.objectives,
        "train_loss": losses.get("train_loss"), "val_loss": losses.get("val_loss"),
        "started": trial.started, "updated": updated,
        "age": (now - updated) if isinstance(updated, (int, float)) else None, "curve": curve,
    })


def page_number(value) -> int:
    """The ``page`` a request names (1 when not given); UserError naming it when it is not a whole number >= 1."""
    if value in (None, ""):
        return 1
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise UserError(f"page={value!r}: give a whole number >= 1")
    return number


def trials(sources: Sources, name: str, curves: str = CURVES[0], page: int = 1, per_page: int = PER_PAGE) -> dict:
    """A study's trials, ordered running first, then by start time, one page at a time: ``per_page`` of them
    from page ``page`` (a page past the last shows the last), each with its status, reason, point, progress
    (step / steps) and latest losses (a finished run's last train and validation loss). ``counts`` (by status)
    and ``total`` cover every trial; ``page``, ``pages``, ``first`` and ``last`` (1-based positions) say which
    ones this is. ``curves``: whose training curves to include (:data:`CURVES`): the running trials' (read from
    each run's ``metrics.jsonl``), all or none, among this page's trials. ``signature`` changes whenever
    the study's results in the store change (so a page knows when to fetch them again)."""
    if curves not in CURVES:
        raise UserError(f"curves={curves!r}: allowed: {', '.join(CURVES)}")
    if not isinstance(page, int) or page < 1:
        raise UserError(f"page={page!r}: give a whole number >= 1")
    info = study_info(sources, name)
    state = StudyFolder(sources.runs, name)
    now = time.time()
    runs = state.trials() if info["has_state"] else []
    runs.sort(key=lambda r: (r.status is not TrialStatus.RUNNING, r.started or 0, r.train_key or "?"))
    pages = max(1, math.ceil(len(runs) / per_page))
    page = min(page, pages)
    shown = runs[(page - 1) * per_page: page * per_page]
    running = TrialStatus.RUNNING
    items = [_trial(state, r, curves == "all" or (curves == running and r.status is running), now) for r in shown]
    counts = _status_counts(runs)
    first = (page - 1) * per_page + 1 if shown else 0
    return clean({"study": name, "trials": items, "counts": counts,
                  "running": counts.get(TrialStatus.RUNNING.value, 0), "total": len(runs), "page": page, "pages": pages,
                  "per_page": per_page, "first": first, "last": first + len(shown) - 1 if shown else 0,
                  "signature": results_signature(sources, name), "now": now})


def _status_counts(runs: list[TrialRecord]) -> dict[str, int]:
    """How many trials have each status a trial writes, those with none left out (keyed by the status string)."""
    counts = {s.value: sum(1 for r in runs if r.status is s) for s in STATUSES}
    return {s: n for s, n in counts.items() if n}


def results_signature(sources: Sources, name: str) -> str:
    """A short hash of the study's results files (:meth:`ResultsStore.signature`: one listing, no file read): it
    changes when rows are written, replaced or compacted; "" when the store cannot be listed."""
    try:
        return sources.store.signature(name)
    except OSError:
        return ""


# ------------------------------------------------------------------------------------------------ results
def _markdown_cells(text: str) -> tuple[list[str], list[list[str]]]:
    """(header, body) of the markdown table in ``text`` (the lines starting with ``|``), cells unescaped."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if all(set(c) <= set("-: ") for c in cells):
            continue  # the |---|---| line
        rows.append(cells)
    return (rows[0], rows[1:]) if rows else ([], [])


def _default_at(info: dict, lengths: list[int], train_len: int | None) -> str | None:
    objective = info.get("objective") or {}
    if objective.get("multiple") is not None:
        at = f"{objective['multiple']:g}x"
        if train_len and round(objective["multiple"] * train_len) in lengths:
            return at
    if objective.get("length") is not None and int(objective["length"]) in lengths:
        return str(int(objective["length"]))
    return str(max(lengths)) if lengths else None


def results(sources: Sources, name: str, metric: str | None = None, at: str | None = None,
            rows: StudyRows | None = None) -> dict:
    """A study's results as the page shows them: the metrics present, the Table-4 layout (``reports.table``
    and its formatted cells), the best configurations at one length (``reports.best``), and the extrapolation
    curves (the same ``reports.table`` numbers: one series per configuration, mean and std per length).

    ``rows``: the study's rows as :meth:`ResultsStore.read_since` last read them (a page that refreshes keeps
    them and re-reads only what changed, :class:`attnlab.serve.app.ResultsCache`); None reads them here.

    ``metric`` defaults to the study's objective metric (``acc`` for a probe, ``val_loss`` otherwise) and ``at``
    to the objective's length. ``message`` says why there is nothing to show (no store, no rows yet)."""
    info = study_info(sources, name)
    out = {"study": name, "store": sources.store.uri, "metrics": [], "metric": None, "at": None, "at_length": None,
           "lengths": [], "at_options": [],
           "table": None, "best": None, "curves": None, "laws": None, "message": None,
           "signature": rows.signature if rows is not None else None}
    if not sources.store.exists():
        out["message"] = (f"The results store {sources.store.uri} does not exist yet: nothing has been written "
                          "there. Results appear here once a trial has been evaluated (is --store right?).")
        out["signature"] = ""
        return clean(out)
    if rows is None:
        rows = sources.store.read_since(name)
    out["signature"] = rows.signature
    df = rows.frame()
    present = sorted(set(df["metric"]) - {COMPLETE_METRIC}) if len(df) else []
    out["metrics"] = present
    if not present:
        out["message"] = (f"No results for study {name!r} in {sources.store.uri} yet: rows appear as trials "
                          "finish their evaluation.")
        return clean(out)
    wanted = (info.get("objective") or {}).get("metric")
    if metric is None:
        metric = wanted if wanted in present else ("val_loss" if "val_loss" in present else present[0])
    elif metric not in present:
        raise UserError(f"metric={metric!r}: study {name!r} has no rows of it; metrics present: {', '.join(present)}")
    out["metric"] = metric
    if LAW_METRIC in present:  # an orbit study: the law each trial's force probe recovered
        text = reports.laws_to_markdown(reports.laws(df))
        l_header, l_body = _markdown_cells(text)
        out["laws"] = {"header": l_header, "body": [[c.strip("`") for c in row] for row in l_body],
                       "summary": [line for line in text.splitlines() if line and not line.startswith("|")],
                       "markdown": text}
    try:
        result = reports.table(df, metric=metric)
    except UserError as exc:  # reports' own sentence (e.g. only marker rows): the page shows it
        out["message"] = str(exc)
        return clean(out)
    header, body = reports.formatted_cells(result)
    lengths = [int(x) for x in result.attrs["lengths"]]
    train_len = result.attrs.get("train_len")
    out["lengths"] = lengths
    out["at_options"] = [{"value": L, "label": reports.length_label(L) + (f" ({L / train_len:g}x)" if train_len else "")}
                         for L in lengths]
    out["table"] = {"caption": reports.caption(result), "header": header, "body": body,
                    "markdown": reports.to_markdown(result)}
    out["curves"] = _curves(result, metric, info)
    at = at or _default_at(info, lengths, train_len)
    out["at"] = at
    if at:
        try:
            ranking = reports.best(df, at=at, metric=metric)
        except UserError as exc:
            out["best"] = {"error": str(exc), "title": None, "header": [], "body": [], "markdown": None, "top": None,
                           "label_columns": []}
        else:
            out["at_length"] = int(ranking["eval_len"].iloc[0]) if len(ranking) else None
            text = reports.best_to_markdown(ranking)
            b_header, b_body = _markdown_cells(text)
            out["best"] = {"error": None, "title": text.splitlines()[0], "header": b_header, "body": b_body, "markdown": text,
                           "top": dict(zip(b_header, b_body[0])) if b_body else None,
                           "label_columns": list(ranking.attrs.get("label_columns", []))}
    return clean(out)


def _curves(result, metric: str, info: dict) -> dict:
    """The extrapolation figure's data from a ``reports.table`` result: one series per configuration (its
    label cells), with the mean, std and n at each evaluation length; p_eval and RoPE scaling selectable when
    they vary, defaulting to the study objective's own setting."""
    label_columns = list(result.attrs["label_columns"])
    lengths = [int(x) for x in result.attrs["lengths"]]
    selectors = {c: [] for c in SELECTABLE if c in label_columns}
    line_columns = [c for c in label_columns if c not in selectors]
    series = []
    # rows as plain values: a frame's row (iloc) carries a deep copy of the frame's attrs (every cell's seeds)
    position = {c: j for j, c in enumerate(result.columns)}
    for values_row in result.to_numpy(dtype=object):
        row = {c: values_row[j] for c, j in position.items()}
        labels = {c: reports.format_value(row[c]) for c in label_columns}
        for c, values in selectors.items():
            if labels[c] not in values:
                values.append(labels[c])
        if len(line_columns) == 1:
            name = labels[line_columns[0]]
        else:
            name = ", ".join(f"{c}={labels[c]}" for c in line_columns) or metric
        series.append({"name": name, "labels": labels, "x": lengths,
                       "mean": [row[f"mean@{L}"] for L in lengths], "std": [row[f"std@{L}"] for L in lengths],
                       "n": [int(row[f"n@{L}"]) for L in lengths]})
    objective = info.get("objective") or {}
    wanted = {"p_eval": reports.format_value(objective.get("p_eval")), "rope_scaling": objective.get("rope")}
    defaults = {c: (wanted[c] if wanted.get(c) in values else values[0]) for c, values in selectors.items()}
    return {"metric": metric, "lengths": lengths, "train_len": result.attrs.get("train_len"),
            "higher_is_better": bool(METRICS[metric].higher_is_better) if metric in METRICS else False,
            "label_columns": label_columns, "line_columns": line_columns, "selectors": selectors,
            "defaults": defaults, "constants": {k: reports.format_value(v) for k, v in
                                                result.attrs.get("constants", {}).items()},
            "length_labels": [reports.length_label(L) for L in lengths], "series": series}


__all__ = ["DEFAULT_RAY_DASHBOARD", "NotFound", "Sources", "clean", "header_dashboard", "open_sources", "overview",
           "point_label", "ray_dashboard", "results", "results_signature", "study_info", "study_names", "trials"]
