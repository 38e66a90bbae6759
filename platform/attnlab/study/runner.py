"""Run a study as a Ray Tune search: the only Tune and Optuna code of attnlab.

``run_study(spec)`` turns a :class:`~attnlab.study.spec.StudySpec` into a ``tune.Tuner`` over a function
trainable, ``study_trial``. Each trial is a cheap driver (``resources.trial_cpus``) that:

1. resolves its ``TrainConfig`` and a config hash over that config (the data by its content fingerprint) plus
   the evaluation settings. If the results store already holds a complete trial with that hash (in this
   study), it reports the stored objective and returns: a finished study re-run trains nothing;
2. trains with Ray Train (``run_training``), forwarding every report but the last to Tune through a
   ``TuneReportCallback``, so ASHA sees ``val_loss`` along the way (its time axis is the training ``step``).
   A trial ASHA stops is killed there (recorded as ``pruned`` at the end of the study);
3. evaluates the final checkpoint at every length x p_eval x rope setting (``evaluate_checkpoint``),
   writes the rows under the key ``("eval", hash)`` (a retry replaces, never duplicates), writes the
   ``complete`` marker, and reports the objective(s) to Tune.

A diverged trial (NaN loss) is recorded as NaN ``val_loss`` rows plus its marker (so tables show it, and a
deterministic failure is not retried) and a status file with the reason; a trial that raises gets a status
file and Tune's ERROR state; the study goes on either way.

Layout under ``<storage>/<study>/``: ``tune/`` (the Tune experiment: trial logs, TensorBoard event files,
searcher state), ``runs/<hash>/`` (the Train runs: metrics.jsonl, checkpoints), ``trials/<hash>.json``
(each trial's status and reason), ``optuna.db`` (SQLite Optuna storage unless ``storage:`` names a URL),
``events.jsonl`` (one line per training started: a counter for humans and tests), ``study.json`` (the spec),
``curves/``. Running the study again restores the Tune experiment (``Tuner.restore``) when it exists.

Never imports torch at module level; never deletes results or Tune state (``fresh`` moves the old Tune
experiment aside).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from attnlab.errors import UserError
from attnlab.study.spec import StudySpec

DEFAULT_STORAGE = "runs"
TUNE_DIR, RUNS_DIR, TRIALS_DIR, EVENTS_FILE, SPEC_FILE = "tune", "runs", "trials", "events.jsonl", "study.json"


# ------------------------------------------------------------------------------------------------ paths
def _absolute_uri(uri: str) -> str:
    return uri if "://" in uri else os.path.abspath(os.path.expanduser(uri))


def study_dir(spec: StudySpec, storage: str | None = None) -> Path:
    return Path(_absolute_uri(storage or DEFAULT_STORAGE)) / spec.name


def optuna_url(spec: StudySpec, storage: str | None = None) -> str:
    return spec.storage or f"sqlite:///{study_dir(spec, storage) / 'optuna.db'}"


def demo_data_dir() -> Path:
    """The demo corpus prepared once into the attnlab cache (``ATTNLAB_CACHE_DIR`` or ``~/.cache/attnlab``)."""
    from attnlab.data.demo import cache_dir

    return cache_dir() / "prepared" / "demo-v1"


def resolve_data(data: str | dict) -> str | dict:
    """``demo`` -> the prepared demo folder (built on first use); a folder -> its absolute path; a probe: as is."""
    if isinstance(data, dict):
        return data
    if data == "demo":
        out = demo_data_dir()
        if not (out / "manifest.json").exists():
            from attnlab.data import prepare

            print(f"attnlab: building the demo corpus into {out} (once)", flush=True)
            prepare("demo", out=str(out), val_tokens=200_000, seed=0, workers=1, progress=False)
        return str(out)
    if "://" in data:
        return data
    path = Path(data).expanduser().resolve()
    if not (path / "manifest.json").exists():
        raise UserError(f"data: {data!r} is not a folder made by `attnlab data prepare` (no manifest.json there); "
                        "use demo, a prepared folder or {synthetic: TASK}")
    return str(path)


def data_identity(data: str | dict) -> tuple[str, str]:
    """(content fingerprint for the config hash, a short label for the results' ``data`` column)."""
    from attnlab.data.source import open_data

    source = open_data(data)
    if isinstance(data, dict):
        return str(source.fingerprint), f"synthetic:{data['synthetic']}"
    return str(source.fingerprint), Path(str(data)).name


# ------------------------------------------------------------------------------------------------ objective
def _missing(value) -> bool:
    """``reports.is_missing`` (None, NaN or pandas' NA), plus NA already turned into the text "<NA>"."""
    from attnlab.results.reports import is_missing

    return is_missing(value) or str(value) == "<NA>"


def _same_p(a, b) -> bool:
    a_none, b_none = _missing(a), _missing(b)
    return (a_none and b_none) or (not a_none and not b_none and float(a) == float(b))


def objective_values(spec: StudySpec, rows: list[dict], train_len: int) -> dict[str, float]:
    """Each objective's value from a trial's rows (NaN when the rows lack it)."""
    out = {}
    for obj in spec.objective:
        parts = obj.parts
        length = parts["length"] or int(round(parts["multiple"] * train_len))
        rope = parts["rope"] or spec.eval.rope_scaling[0]
        values = [r["value"] for r in rows
                  if r.get("metric") == parts["metric"] and int(r.get("eval_len", -1)) == length
                  and r.get("rope_scaling") == rope and _same_p(r.get("p_eval"), parts["p_eval"])
                  and r.get("window_mode", "nonoverlap") in ("nonoverlap", "passkey")
                  and _missing(r.get("bucket")) and _missing(r.get("layer"))]
        out[obj.key] = float(values[0]) if values else float("nan")
    return out


def diverged_rows(spec: StudySpec, cfg, context: dict, step: int, lengths: list[int]) -> list[dict]:
    """NaN ``val_loss`` rows for every length x p_eval x rope of a diverged trial (so tables show it)."""
    gpt = cfg.gpt_config()
    rows = []
    for length in lengths:
        for rope in spec.eval.rope_scaling:
            for p in spec.eval.p_eval:
                rows.append({**context, "attention": gpt.attention, "scale": gpt.attention_spec().scale_label,
                             "p_train": gpt.attention_spec().p, "p_eval": p, "rope_scaling": rope, "step": int(step),
                             "tokens": int(step) * cfg.tokens_per_step, "eval_len": int(length),
                             "train_len": cfg.seq_length, "window_mode": "nonoverlap", "metric": "val_loss",
                             "value": float("nan"), "preset": cfg.preset})
    return rows


def trial_hash(cfg, spec: StudySpec, data_fingerprint: str) -> str:
    """The trial's identity: the resolved training config (data by content) plus the evaluation settings."""
    import hashlib

    train = cfg.model_dump(mode="json")
    train["data"] = data_fingerprint
    payload = {"train": train, "eval": spec.eval.model_dump(mode="json")}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------ trial
def _write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(tmp, path)


def _append_event(state: Path, event: dict) -> None:
    with open(state / EVENTS_FILE, "a") as handle:
        handle.write(json.dumps({**event, "time": time.time()}) + "\n")


def _point_of(config: dict) -> dict:
    if "point" in config:
        return dict(config["point"])
    return {k: v for k, v in config.items() if not k.startswith("__")}


def _report_callback(final_step: int, config_hash: str):
    """A ``TuneReportCallback`` that tags reports with the trial hash and holds back the last one (the trial
    reports its objective after the evaluation instead, so ASHA never stops a trial at its final step)."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class StudyReportCallback(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if metrics and int(metrics[0].get("step", 0)) >= final_step:
                return
            metrics = [{**metrics[0], "config_hash": config_hash}, *metrics[1:]]
            super().after_report(run_context, metrics, checkpoint)

    return StudyReportCallback()


def failure_reason(exc: BaseException) -> str:
    """One line: the exception's first line plus, for wrapped worker errors (whose first line is only
    "Training failed due to worker errors:"), the root cause, the last ``SomeError: message`` line."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    reason = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    causes = [line for line in lines[1:] if line.split(":", 1)[0].endswith(("Error", "Exception"))]
    if causes:
        reason += f" ... {causes[-1]}"
    return reason[:500]


def knob_label(spec: StudySpec, point: dict) -> str | None:
    """The trial's searched settings other than attention, scale, p_train, seed and RoPE, as one sortable
    string: reports group by it, so trials differing only in e.g. ``lr`` are never averaged as seeds."""
    extra = [k for k in (spec.space.model_extra or {}) if k in point]
    return ",".join(f"{k}={point[k]:g}" if isinstance(point[k], float) else f"{k}={point[k]}"
                    for k in sorted(extra)) or None


def study_trial(config: dict, context: dict) -> None:
    """One Tune trial: skip if complete, else train, evaluate, store, and report the objective(s)."""
    from ray import tune

    from attnlab.results import ResultsStore
    from attnlab.study.spec import StudySpec

    os.environ.update(context.get("env", {}))
    spec = StudySpec.model_validate(context["spec"])
    state = Path(context["state_dir"])
    store = ResultsStore(context["store"])
    point = _point_of(config)
    cfg = spec.train_config(point, data=context["data"])
    h = trial_hash(cfg, spec, context["data_fingerprint"])
    status_path = state / TRIALS_DIR / f"{h}.json"
    lengths = spec.eval.eval_lengths(cfg.seq_length)
    status = {"config_hash": h, "point": point, "trial": tune.get_context().get_trial_name(),
              "run_dir": str(state / RUNS_DIR / h)}
    base = {"config_hash": h, "step": cfg.steps}

    if store.has_complete(h, study=spec.name):
        rows = store.read(study=spec.name, config_hash=h).to_dict("records")
        objectives = objective_values(spec, rows, cfg.seq_length)
        final = [r for r in rows if r["metric"] == "val_loss" and int(r["eval_len"]) == cfg.seq_length]
        tune.report({**base, **objectives, "cached": 1,
                     **({"val_loss": float(final[0]["value"])} if final else {})})
        return

    from attnlab.train.ray_train import run_training

    from attnlab.provenance import git_info

    context_row = {"study": spec.name, "trial": h, "seed": cfg.seed, "config_hash": h, "git_sha": git_info()["sha"],
                   "data": context["data_label"], "knobs": knob_label(spec, point)}
    _write_json(status_path, {**status, "status": "running", "started": time.time()})
    _append_event(state, {"event": "train", "config_hash": h, "point": point})
    try:
        result = run_training(cfg, state / RUNS_DIR / h, callbacks=[_report_callback(cfg.steps, h)], run_name=h)
        if result.status == "diverged":
            step = int(result.final.get("step", 0))
            rows = diverged_rows(spec, cfg, context_row, step, lengths)
            store.write(rows, key=("eval", h))
            store.mark_complete(rows[0], len(rows))
            _write_json(status_path, {**status, "status": "diverged", "reason": result.failure, "step": step})
            tune.report({**base, **{o.key: float("nan") for o in spec.objective}, "diverged": 1, "cached": 0})
            return
        from attnlab.evaluate import evaluate_checkpoint

        if cfg.threads_per_worker:  # evaluation runs here, in the trial driver: give it the workers' threads
            import torch

            torch.set_num_threads(cfg.threads_per_worker)
        rows = evaluate_checkpoint(
            result.checkpoint, data=context["data"], lengths=lengths, p_evals=tuple(spec.eval.p_eval),
            rope_scalings=tuple(spec.eval.rope_scaling), max_tokens=spec.eval.max_tokens,
            long_docs=spec.eval.long_docs, passkey=spec.eval.passkey, diagnostics=spec.eval.diagnostics,
            context=context_row, store=store, key=("eval", h))
        store.mark_complete(rows[0], len(rows))
        objectives = objective_values(spec, rows, cfg.seq_length)
        _write_json(status_path, {**status, "status": "complete", "objectives": objectives, "rows": len(rows)})
        final = result.final
        tune.report({**base, **objectives, "cached": 0, "diverged": 0,
                     **({"val_loss": final["val_loss"]} if "val_loss" in final else {})})
    except Exception as exc:
        _write_json(status_path, {**status, "status": "failed", "reason": failure_reason(exc)})
        raise


# ------------------------------------------------------------------------------------------------ search
class DefineByRunSpace:
    """Optuna's define-by-run space for a study (picklable: Tune saves the searcher with it)."""

    def __init__(self, spec: StudySpec):
        self.spec_json = spec.model_dump(mode="json")

    def __call__(self, trial):
        spec = StudySpec.model_validate(self.spec_json)
        name = spec.attentions()[0]
        if spec.space.attention:
            name = trial.suggest_categorical("attention", list(spec.space.attention))
        for key, axis in spec.space.knobs().items():
            if not axis.applies_to(name):
                continue
            if not axis.is_range:
                trial.suggest_categorical(key, list(axis.values))
            elif axis.is_int_range:
                trial.suggest_int(key, int(axis.low), int(axis.high), step=int(axis.step or 1), log=axis.log)
            else:
                trial.suggest_float(key, float(axis.low), float(axis.high), step=axis.step, log=axis.log)
        if spec.space.seeds:
            trial.suggest_categorical("seed", list(spec.space.seeds))
        return None


def _optuna_search(spec: StudySpec, url: str):
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    class StudyOptunaSearch(OptunaSearch):
        """OptunaSearch that ignores intermediate results without the objective (the training reports)."""

        def on_trial_result(self, trial_id, result):
            if isinstance(self.metric, str) and self.metric not in result:
                return
            super().on_trial_result(trial_id, result)

        def on_trial_complete(self, trial_id, result=None, error=False):
            # A trial the scheduler stopped ends without its objective(s): record it as PRUNED, not RUNNING.
            metrics = self.metric if isinstance(self.metric, list) else [self.metric]
            if result and any(m not in result for m in metrics):
                result = None
            super().on_trial_complete(trial_id, result=result, error=error)

    seed = spec.search.seed
    samplers = {"tpe": lambda: optuna.samplers.TPESampler(seed=seed),
                "random": lambda: optuna.samplers.RandomSampler(seed=seed),
                "nsgaii": lambda: optuna.samplers.NSGAIISampler(seed=seed)}
    sampler = samplers[spec.search.sampler or "tpe"]()
    keys = [o.key for o in spec.objective]
    modes = [o.mode for o in spec.objective]
    try:
        storage = optuna.storages.RDBStorage(url)
    except Exception as exc:  # noqa: BLE001 - any driver/URL problem is the user's to fix
        raise UserError(f"storage: {url!r} is not a usable Optuna RDB storage ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:200]})") from None
    return StudyOptunaSearch(DefineByRunSpace(spec), metric=keys if len(keys) > 1 else keys[0],
                             mode=modes if len(modes) > 1 else modes[0], sampler=sampler,
                             study_name=spec.name, storage=storage)


def _scheduler(spec: StudySpec):
    if spec.scheduler.type == "none":
        return None
    from ray.tune.schedulers import ASHAScheduler

    return ASHAScheduler(time_attr="step", metric=spec.scheduler.metric,
                         mode="max" if spec.scheduler.metric == "val_acc" else "min",
                         max_t=spec.scheduler_max_steps(), grace_period=spec.scheduler.grace_period,
                         reduction_factor=spec.scheduler.reduction_factor, stop_last_trials=False)


# ------------------------------------------------------------------------------------------------ study
@dataclass
class StudySummary:
    name: str
    state_dir: str
    store: str
    optuna_url: str | None
    trials: list[dict] = field(default_factory=list)  # status file of each trial of this study
    trained: int = 0  # trainings started by this call
    table: str = ""
    curves: dict = field(default_factory=dict)
    tensorboard_dir: str | None = None
    restored: bool = False

    def count(self, status: str) -> int:
        return sum(1 for t in self.trials if t.get("status") == status)


def _check_state(spec: StudySpec, state: Path, resume: bool | None) -> bool:
    """Whether to restore the Tune experiment; refuse to resume a study whose spec changed."""
    from ray import tune

    exp = state / TUNE_DIR
    exists = exp.exists() and tune.Tuner.can_restore(str(exp))
    if resume is True and not exists:
        raise UserError(f"--resume: no Tune state for study {spec.name!r} at {exp}; run without --resume to start")
    if resume is False and exp.exists():
        aside = exp.with_name(f"{TUNE_DIR}.{time.strftime('%Y%m%d-%H%M%S')}")
        exp.rename(aside)
        print(f"attnlab: previous Tune state moved to {aside}", flush=True)
        return False
    if exists and (state / SPEC_FILE).exists():
        saved = json.loads((state / SPEC_FILE).read_text()).get("fingerprint")
        if saved != spec.fingerprint():
            raise UserError(f"study {spec.name!r} changed since its Tune state at {exp} was written; run with "
                            "--fresh to start a new search (complete trials are reused from the store) or rename it")
    return exists


def run_study(spec: StudySpec, store: str | None = None, storage: str | None = None, resume: bool | None = None,
              curves_dir: str | None = None, verbose: int = 1) -> StudySummary:
    """Run ``spec`` on the current Ray cluster (``ensure_ray``: ``RAY_ADDRESS`` or an embedded one).

    ``store``: results store URI (default ``spec.store`` or ``results``); ``storage``: the folder for Tune state,
    runs and the default Optuna SQLite file (default ``runs``). ``resume``: None = restore the Tune experiment
    when it exists, True = it must exist, False = start a fresh search (the old state is moved aside).
    """
    from ray import tune

    from attnlab.raycluster import ensure_ray
    from attnlab.results import DEFAULT_STORE_URI, ResultsStore

    store_uri = _absolute_uri(store or spec.store or DEFAULT_STORE_URI)
    ResultsStore(store_uri)  # a bad URI fails here, before any trial
    state = study_dir(spec, storage)
    data = resolve_data(spec.data)
    fingerprint, label = data_identity(data)
    state.mkdir(parents=True, exist_ok=True)
    restore = _check_state(spec, state, resume)
    _write_json(state / SPEC_FILE, {"fingerprint": spec.fingerprint(), "spec": spec.model_dump(mode="json")})
    events_before = _count_events(state)

    os.environ.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")  # training reports lack the objective
    ensure_ray()
    context = {"spec": spec.model_dump(mode="json"), "state_dir": str(state), "store": store_uri, "data": data,
               "data_fingerprint": fingerprint, "data_label": label,
               # attnlab's own settings (cache dir, test-only fault injection) reach the trial processes too
               "env": {k: v for k, v in os.environ.items() if k.startswith("ATTNLAB_")}}
    trainable = tune.with_resources(tune.with_parameters(study_trial, context=context),
                                    {"cpu": spec.resources.trial_cpus})
    url = optuna_url(spec, storage) if spec.search.engine == "optuna" else None
    exp = state / TUNE_DIR
    if restore:
        print(f"attnlab: resuming study {spec.name!r} from {exp}", flush=True)
        tuner = tune.Tuner.restore(str(exp), trainable=trainable, resume_unfinished=True, resume_errored=True,
                                   restart_errored=False)
    else:
        if spec.search.engine == "optuna":
            search_alg, param_space, num_samples = _optuna_search(spec, url), None, spec.search.num_samples
        else:
            points = spec.grid_points() if spec.search.engine == "grid" else spec.random_points()
            search_alg, param_space, num_samples = None, {"point": tune.grid_search(points)}, 1
        tuner = tune.Tuner(
            trainable, param_space=param_space,
            tune_config=tune.TuneConfig(search_alg=search_alg, scheduler=_scheduler(spec), num_samples=num_samples,
                                        max_concurrent_trials=spec.resources.max_concurrent_trials),
            run_config=tune.RunConfig(name=TUNE_DIR, storage_path=str(state), verbose=verbose,
                                      failure_config=tune.FailureConfig(max_failures=0)))
    if url:
        print(f"attnlab: Optuna study {spec.name!r} in {url}\n  watch it: optuna-dashboard {url}", flush=True)
    print(f"attnlab: TensorBoard: tensorboard --logdir {exp}", flush=True)
    grid = tuner.fit()
    summary = StudySummary(spec.name, str(state), store_uri, url, restored=restore, tensorboard_dir=str(exp))
    summary.trained = _count_events(state) - events_before
    _record_pruned(spec, state, grid)
    summary.trials = [json.loads(p.read_text()) for p in sorted((state / TRIALS_DIR).glob("*.json"))]
    _report(spec, summary, curves_dir or str(state / "curves"))
    return summary


def _count_events(state: Path) -> int:
    path = state / EVENTS_FILE
    return len(path.read_text().splitlines()) if path.exists() else 0


def _record_pruned(spec: StudySpec, state: Path, grid) -> None:
    """Trials the scheduler stopped never wrote their own status: say so, with the step they reached."""
    objective = spec.objective[0].key
    for result in grid:
        metrics = result.metrics or {}
        h = metrics.get("config_hash")
        if not h or result.error is not None or objective in metrics:
            continue
        path = state / TRIALS_DIR / f"{h}.json"
        current = json.loads(path.read_text()) if path.exists() else {}
        # "failed" too: stopping a trial kills its Train controller, which the trial sees as an error.
        if current.get("status") in (None, "running", "failed"):
            _write_json(path, {**current, "config_hash": h, "status": "pruned",
                               "reason": f"stopped by {spec.scheduler.type} at step {metrics.get('step')} "
                                         f"({spec.scheduler.metric}={metrics.get(spec.scheduler.metric)})"})


def _report(spec: StudySpec, summary: StudySummary, curves_dir: str) -> None:
    """Print the results table, the trials that did not complete, and write the curves."""
    from attnlab.results import ResultsStore, reports

    df = ResultsStore(summary.store).read(study=spec.name)
    statuses = {}
    for t in summary.trials:
        statuses[t.get("status")] = statuses.get(t.get("status"), 0) + 1
    print(f"\nstudy {spec.name}: {len(summary.trials)} trial(s) "
          + ", ".join(f"{n} {s}" for s, n in sorted(statuses.items())) + f"; {summary.trained} trained this run")
    for t in summary.trials:
        if t.get("status") in ("diverged", "failed", "pruned"):
            print(f"  {t['status']}: {t.get('config_hash')} {t.get('point')}: {t.get('reason')}")
    metric = spec.objective[0].parts["metric"]  # the study's own measure: val_loss, or acc for a probe
    if len(df) == 0 or not (df["metric"] == metric).any():
        print("no results in the store yet")
        return
    try:
        summary.table = reports.to_markdown(reports.table(df, metric=metric))
        print("\n" + summary.table + "\n")
        summary.curves = reports.curves(df, curves_dir, metric=metric, by="length")
        if len({str(p) for p in df["p_eval"]}) > 1:
            summary.curves["by_p"] = reports.curves(df, curves_dir, metric=metric, by="p")["png"]
        print(f"curves: {summary.curves['png']} (and {summary.curves['html']})")
    except UserError as exc:
        print(f"attnlab: could not report: {exc}", file=sys.stderr)
    print(f"results store: {summary.store}  (attnlab results table --store {summary.store} --study {spec.name})")


__all__ = ["StudySummary", "run_study", "study_trial", "objective_values", "trial_hash", "resolve_data"]
