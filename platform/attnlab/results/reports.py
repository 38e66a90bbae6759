"""Reports over results rows: the paper's Table 4 layout, extrapolation curves, rankings, export.

Every function takes a pandas DataFrame of results rows (``ResultsStore.read``) and is pure: no Ray,
no store access, no network (the HTML page embeds its PNG). The rules shared by all reports:

- Rows are first narrowed to one ``metric`` and, by default, to each trial's **final step** for that
  metric (``step="final"``; an int keeps that step; ``"all"`` keeps every step). The
  ``metric="complete"`` marker rows are never reported.
- A **configuration** is a distinct combination of :data:`attnlab.results.schema.CONFIG_COLUMNS`
  (attention, scale, p_train, p_eval, rope_scaling, train_len, preset, data, window_mode, layer,
  bucket; plus study when rows span several). Columns constant over the selection are dropped from
  the label and stated once in the caption.
- Cells aggregate over the rows of a configuration at one eval length (seeds, or repeated trials):
  mean, **sample** standard deviation (ddof=1; none when n = 1), n and the 95% **Student t interval of
  the mean** (``mean ± t(0.975, n-1) · std / sqrt(n)``, :func:`attnlab.results.stats.t_interval`; none
  when n < 2). NaN values (diverged runs) are kept, so a diverged seed makes the mean NaN rather than
  silently vanishing. A cell with n = 1 is a single run and every table and figure marks it ("1 seed").
- A **bounded metric** (accuracies in [0, 1]: :func:`attnlab.results.schema.metric_bounds`) never reads outside
  its range: a cell of 2..3 runs (:data:`attnlab.results.stats.SMALL_N`) shows the runs' values instead of a
  t interval ("0.501 (n=2: 0.879, 0.122)"; figures draw each run as a small dot), larger cells have their
  interval and std error bars clipped to the range (:mod:`attnlab.results.stats`).
- :func:`laws` lists, per trial (variant and seed), the force law recovered by the orbit study's force probe:
  the expression, its exponents in r, m1, m2, its distance from Newton's and the errors of the probe and fit.
- :func:`compare` tests the difference of two configurations at one length (Welch's t and an exact
  permutation test, :mod:`attnlab.results.stats`) and says plainly when it is not significant or when
  n < 2 leaves nothing to test.

Reports never import Ray, never read a store and never touch the network; they take rows and return
frames, text or files written where the caller says.
"""

from __future__ import annotations

import base64
import html
import io
import math
import textwrap
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from attnlab.errors import UserError
from attnlab.names import is_missing, parse_at  # noqa: F401 - parse_at is part of this module's API
import attnlab.results.stats as _stats_mod
from attnlab.results.schema import COMPLETE_METRIC, CONFIG_COLUMNS, METRICS, metric_bounds

MISSING_CELL = "–"
SINGLE_RUN = "1 seed"  # how tables and figures mark a cell measured on a single run
CONFIDENCE = _stats_mod.CONFIDENCE

# docs/reference-numbers.md#table-4: the paper's Table 4 (validation loss, GPT-2 124M trained at 1K, FineWeb).
# (attention, p, [loss at 1K, 2K, 4K, 8K]); p is the sharpening power (None = no sharpening).
PAPER_TABLE4: tuple[tuple[str, float | None, tuple[float, float, float, float]], ...] = (
    ("softmax", None, (3.1911, 4.1662, 5.4513, 6.2823)),
    ("lssa", None, (3.1905, 4.1301, 5.2960, 5.9403)),
    ("sigmoid_ramapuram", None, (3.1935, 7.4554, 11.8355, 14.4995)),
    ("sigmoid_ramapuram_b", None, (3.1930, 6.5830, 8.4679, 9.5939)),
    ("sigmoid_ramapuram_b_l1", None, (3.1849, 4.3470, 5.5544, 6.1846)),
    ("sigmoid_l1", None, (3.2000, 4.3811, 5.8465, 6.5701)),
    ("relu_wortsman", None, (3.2143, 6.2662, 8.4982, 10.3460)),
    ("relu_l1", None, (3.2006, 4.5192, 5.6924, 6.4561)),
    ("relu_shen", None, (3.2155, 6.5573, 8.9072, 10.7266)),
    ("softmax", 3.0, (3.1879, 4.0277, 5.2842, 6.2339)),
    ("sigmoid_l1", 3.0, (3.1841, 3.7387, 4.9286, 5.7450)),
    ("lssar", 3.0, (3.1782, 4.2383, 5.4056, 6.3007)),
    ("softmax", 15.0, (5.3878, 5.9491, 6.5276, 7.0183)),
    ("sigmoid_l1", 15.0, (3.2171, 3.3499, 3.6108, 3.8587)),
    ("lssar", 15.0, (3.1905, 3.1930, 3.2291, 3.3171)),
)
PAPER_TABLE4_LENGTHS = (1024, 2048, 4096, 8192)


# ---------------------------------------------------------------------------------------- helpers
def length_label(length: int) -> str:
    """1024 -> "1K", 1536 -> "1.5K", 100 -> "100"."""
    length = int(length)
    if length >= 1024 and length % 512 == 0:
        return f"{length / 1024:g}K"
    return str(length)


def format_value(value) -> str:
    """A label cell: null -> "none", 3.0 -> "3", other values as text."""
    if is_missing(value):
        return "none"
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return str(int(value))
    return str(value)


def select(df: pd.DataFrame, metric: str = "val_loss", step="final") -> pd.DataFrame:
    """Rows of one metric, at each trial's final step (``step="final"``), a given step, or all steps."""
    if df is None or len(df) == 0:
        raise UserError("no results rows to report (is the store or the --study/--where selection right?)")
    if metric == COMPLETE_METRIC:
        raise UserError(f"metric {COMPLETE_METRIC!r} is a marker, not a result; pick another --metric")
    rows = df[df["metric"] == metric]
    if len(rows) == 0:
        present = sorted(set(df["metric"]) - {COMPLETE_METRIC})
        raise UserError(f"--metric {metric!r} has no rows; metrics present: {', '.join(present) or 'none'}")
    if step == "final":
        final = rows.groupby(["study", "trial"], dropna=False)["step"].transform("max")
        rows = rows[rows["step"] == final]
    elif step == "all" or step is None:
        pass
    else:
        try:
            step = int(step)
        except (TypeError, ValueError):
            raise UserError(f"--step {step!r}: use 'final', 'all' or a step number") from None
        rows = rows[rows["step"] == step]
        if len(rows) == 0:
            raise UserError(f"--step {step}: no {metric!r} rows at that step")
    rows = rows.reset_index(drop=True)
    for column in CONFIG_COLUMNS:  # one spelling of "missing" per column (None/NaN/NA mix after concat)
        if column in rows.columns and rows[column].dtype == object:
            rows[column] = rows[column].astype(object).where(rows[column].notna(), None)
    return rows


def _config_columns(rows: pd.DataFrame) -> tuple[list[str], list[str]]:
    """(all configuration columns present, the ones that vary = the label columns)."""
    columns = [c for c in CONFIG_COLUMNS if c in rows.columns]
    if "study" in rows.columns and rows["study"].nunique(dropna=False) > 1:
        columns = ["study", *columns]
    varying = [c for c in columns if rows[c].nunique(dropna=False) > 1]
    if not varying:
        varying = ["attention"] if "attention" in columns else columns[:1]
    return columns, varying


def _constants(rows: pd.DataFrame, columns: list[str], varying: list[str]) -> dict:
    out = {}
    for c in columns:
        if c in varying:
            continue
        value = rows[c].iloc[0]
        if c in ("layer", "bucket", "preset", "data", "knobs", "task") and is_missing(value):
            continue  # an all-null optional column says nothing
        out[c] = value
    return out


# Position buckets read in window order, not alphabetically.
_BUCKET_ORDER = {"early": 0, "middle": 1, "late": 2}


def _sort_key(value):
    """Sort nulls first, numbers numerically, position buckets in window order, other text alphabetically."""
    if is_missing(value):
        return (0, 0.0, "")
    if isinstance(value, (int, float, np.integer, np.floating)):
        return (1, float(value), "")
    if value in _BUCKET_ORDER:
        return (2, float(_BUCKET_ORDER[value]), "")
    return (3, 0.0, str(value))


def _stats(values: np.ndarray, bounds: tuple[float, float] | None = None) -> tuple[float, float, int, float, float]:
    """(mean, sample std, n, CI low, CI high) of one cell; std and the interval are NaN when n = 1; the
    interval is clipped to ``bounds`` (the metric's range, None = unbounded)."""
    values = np.asarray(values, dtype=float)
    n = len(values)
    mean = float(np.mean(values))
    std = float(np.std(values, ddof=1)) if n > 1 else float("nan")
    low, high = _stats_mod.bounded_interval(values, CONFIDENCE, bounds)
    return mean, std, n, low, high


def _rows_bounds(rows: pd.DataFrame) -> tuple[float, float] | None:
    """The range of the one metric of ``rows`` (None: unbounded, or rows of several metrics)."""
    if "metric" not in rows.columns or rows["metric"].nunique() != 1:
        return None
    return metric_bounds(rows["metric"].iloc[0])


def _seed_values(group: pd.DataFrame) -> tuple:
    """((seed, value), ...) of one cell, by seed (the per-seed values a table can show)."""
    seeds = group["seed"].tolist() if "seed" in group.columns else [None] * len(group)
    pairs = [(None if is_missing(s) else int(s), float(v)) for s, v in zip(seeds, group["value"].tolist())]
    return tuple(sorted(pairs, key=lambda p: (p[0] is None, p[0] if p[0] is not None else 0)))


def aggregate(rows: pd.DataFrame, group_columns: list[str], keep_values: bool = False) -> pd.DataFrame:
    """Long statistics: one row per (group, eval_len) with mean, std (ddof=1), n, ci_low, ci_high (the 95%
    Student t interval of the mean; NaN when n < 2; clipped to the range of a bounded metric), sorted.
    ``keep_values`` adds ``values``: the cell's ((seed, value), ...) pairs."""
    records = []
    bounds = _rows_bounds(rows)
    for keys, group in rows.groupby([*group_columns, "eval_len"], dropna=False, sort=False):
        keys = keys if isinstance(keys, tuple) else (keys,)
        mean, std, n, low, high = _stats(group["value"].to_numpy(), bounds)
        record = dict(zip([*group_columns, "eval_len"], keys))
        record.update(mean=mean, std=std, n=n, ci_low=low, ci_high=high)
        if keep_values:
            record["values"] = _seed_values(group)
        records.append(record)
    columns = [*group_columns, "eval_len", "mean", "std", "n", "ci_low", "ci_high"]
    out = pd.DataFrame.from_records(records, columns=[*columns, "values"] if keep_values else columns)
    order = sorted(range(len(out)), key=lambda i: tuple(_sort_key(out.iloc[i][c]) for c in [*group_columns, "eval_len"]))
    return out.iloc[order].reset_index(drop=True)


def _train_len(rows: pd.DataFrame) -> int | None:
    if "train_len" in rows.columns and rows["train_len"].nunique() == 1:
        return int(rows["train_len"].iloc[0])
    return None


# ---------------------------------------------------------------------------------------- table
def _same(column: pd.Series, value) -> pd.Series:
    """Rows of ``column`` equal to ``value`` (null matches null)."""
    return column.isna() if _sort_key(value)[0] == 0 else column == value


def table(df: pd.DataFrame, metric: str = "val_loss", step="final", lengths: list[int] | None = None) -> pd.DataFrame:
    """The paper's Table 4 layout: one row per configuration, one column group per eval length.

    Returns a DataFrame whose columns are the label columns (configuration columns that vary), then
    ``mean@L``, ``std@L``, ``n@L``, ``ci_low@L``, ``ci_high@L`` for each eval length ``L`` ascending: mean,
    sample std (NaN when n = 1), number of runs, and the 95% Student t interval of the mean over runs
    (seeds) (NaN when n < 2). Cells with no rows are NaN with n = 0. ``attrs`` carries ``metric``,
    ``lengths``, ``label_columns``, ``constants`` (the dropped constant columns and their value),
    ``train_len``, ``step``, ``confidence`` (0.95) and ``seed_values`` (``{(row, L): ((seed, value), ...)}``,
    what ``to_markdown(per_seed=True)`` prints), ``capped`` (``{(row, L): seeds}``: cells with a run that hit
    its step cap before its stopping rule, marked with :data:`CAP_MARK`) and ``cap_note`` (their footnote).
    """
    rows = select(df, metric, step)
    columns, label_columns = _config_columns(rows)
    constants = _constants(rows, columns, label_columns)
    stats = aggregate(rows, label_columns, keep_values=True)
    all_lengths = sorted(int(x) for x in stats["eval_len"].unique())
    lengths = all_lengths if lengths is None else sorted(int(x) for x in lengths)
    configs = stats[label_columns].drop_duplicates().reset_index(drop=True)
    result = configs.copy()
    seed_values: dict[tuple[int, int], tuple] = {}
    for length in lengths:
        cells = {name: [] for name in ("mean", "std", "n", "ci_low", "ci_high")}
        at_length = stats[stats["eval_len"] == length]
        for i in range(len(configs)):
            match = at_length
            for c in label_columns:
                match = match[_same(match[c], configs.iloc[i][c])]
            if len(match):
                first = match.iloc[0]
                for name in cells:
                    cells[name].append(int(first[name]) if name == "n" else float(first[name]))
                seed_values[(i, length)] = first["values"]
            else:
                for name in cells:
                    cells[name].append(0 if name == "n" else float("nan"))
        for name, values in cells.items():
            result[f"{name}@{length}"] = values
    result.attrs.update(
        metric=metric, lengths=lengths, label_columns=label_columns, constants=constants,
        train_len=_train_len(rows), step=step, confidence=CONFIDENCE, seed_values=seed_values,
    )
    result.attrs["capped"], result.attrs["cap_note"] = _capped_cells(rows, configs, label_columns, lengths)
    return result


# Cells of trials whose training hit its step cap before its stopping rule (rows' stopped = cap) carry this mark
# and the table a footnote naming the rule (train.stop_when, docs/protocol.md#stopping-rule).
CAP_MARK = "†"
_EVAL_ONLY_COLUMNS = ("p_eval", "rope_scaling", "window_mode", "layer", "bucket", "task")


def _capped_cells(rows: pd.DataFrame, configs: pd.DataFrame, label_columns: list[str],
                  lengths: list[int]) -> tuple[dict, str | None]:
    """``({(row, L): capped seeds}, footnote)`` of a table: the cells with a seed whose training hit the step cap
    before its stopping rule, and one line saying so (None when no cell has one)."""
    if "stopped" not in rows.columns:
        return {}, None
    capped = rows[rows["stopped"].astype(object).eq("cap").fillna(False).astype(bool)]
    if not len(capped):
        return {}, None
    cells = {}
    for i in range(len(configs)):
        match = capped
        for c in label_columns:
            match = match[_same(match[c], configs.iloc[i][c])]
        for length in lengths:
            at = match[match["eval_len"] == length]
            if len(at):
                cells[(i, length)] = tuple(sorted({int(s) for s in at["seed"] if not is_missing(s)}))
    rules = sorted({str(r) for r in capped.get("stop_rule", pd.Series(dtype=object)) if not is_missing(r)})
    who = [c for c in label_columns if c not in _EVAL_ONLY_COLUMNS]
    trials = sorted({(" ".join(format_value(r[c]) for c in who) + " " if who else "") + f"seed {format_value(r['seed'])}"
                     for _, r in capped.iterrows()})
    note = (f"{CAP_MARK} training hit the step cap before {' / '.join(rules) or 'its stopping rule'}: "
            f"{', '.join(trials)} (a marked cell includes such a run)")
    return cells, note


def _number(value: float, digits: int) -> str:
    return "nan" if math.isnan(value) else f"{value:.{digits}f}"


def _format_cell(mean: float, std: float, n: int, digits: int, low: float = math.nan, high: float = math.nan,
                 values: tuple | None = None, bounds: tuple[float, float] | None = None,
                 seeds: tuple | None = None) -> str:
    """``mean ± std (n=k) [low, high]``; ``mean (1 seed)`` for a single run; "–" for none; with ``values``,
    the per-seed values after a semicolon. A bounded metric (``bounds``) with 2..SMALL_N runs and its
    ``seeds`` ((seed, value), ...) reads ``mean (n=k: v1, v2)``: the runs, not a t interval wider than its range."""
    if n == 0:
        return MISSING_CELL
    text = _number(mean, digits)
    if n == 1:
        text += f" ({SINGLE_RUN})"
    elif seeds and _stats_mod.shows_seed_values(n, bounds):
        text += f" (n={n}: " + ", ".join(_number(v, digits) for _, v in seeds) + ")"
    else:
        text += f" ± {_number(std, digits)} (n={n})"
        if not (math.isnan(low) or math.isnan(high)):
            text += f" [{_number(low, digits)}, {_number(high, digits)}]"
    if values and n > 1:
        text += "; " + ", ".join(f"{'?' if s is None else s}: {_number(v, digits)}" for s, v in values)
    return text


def _length_headers(lengths: list[int], train_len: int | None) -> list[str]:
    if train_len:
        return [f"{length_label(L)} ({L / train_len:g}x)" for L in lengths]
    return [length_label(L) for L in lengths]


def caption(result: pd.DataFrame) -> str:
    """One line: metric, step selection, how cells read, and the constant configuration columns."""
    attrs = result.attrs
    step = attrs.get("step", "final")
    step_text = "final step of each trial" if step == "final" else ("all steps" if step in ("all", None) else f"step {step}")
    percent = f"{100 * attrs.get('confidence', CONFIDENCE):g}%"
    parts = [f"{attrs.get('metric', 'value')} ({step_text}; mean ± sample std over n seeds, [{percent} Student t "
             f"interval of the mean] when n > 1; '{SINGLE_RUN}' = a single run, no spread or interval)"]
    bounds = metric_bounds(attrs.get("metric"))
    if bounds is not None:
        parts.append(f"{attrs.get('metric')} lies in [{bounds[0]:g}, {bounds[1]:g}]: 'mean (n=k: values)' lists the "
                     f"runs when n <= {_stats_mod.SMALL_N}, larger n has its interval clipped to that range")
    constants = attrs.get("constants") or {}
    if constants:
        parts.append("constant: " + ", ".join(f"{k}={format_value(v)}" for k, v in constants.items()))
    return "; ".join(parts)


def formatted_cells(result: pd.DataFrame, digits: int = 4, per_seed: bool = False) -> tuple[list[str], list[list[str]]]:
    """(header, body) of a table() result as display strings (``per_seed``: cells also list seed: value)."""
    label_columns = result.attrs["label_columns"]
    lengths = result.attrs["lengths"]
    seed_values = result.attrs.get("seed_values") or {}
    bounds = metric_bounds(result.attrs.get("metric"))
    header = [*label_columns, *_length_headers(lengths, result.attrs.get("train_len"))]
    body = []
    for i in range(len(result)):
        row = result.iloc[i]
        cells = [format_value(row[c]) for c in label_columns]
        for L in lengths:
            low = row[f"ci_low@{L}"] if f"ci_low@{L}" in result.columns else math.nan
            high = row[f"ci_high@{L}"] if f"ci_high@{L}" in result.columns else math.nan
            cells.append(_format_cell(row[f"mean@{L}"], row[f"std@{L}"], int(row[f"n@{L}"]), digits, low, high,
                                      seed_values.get((i, L)) if per_seed else None, bounds=bounds,
                                      seeds=seed_values.get((i, L))))
        for j, L in enumerate(lengths):
            if (i, L) in (result.attrs.get("capped") or {}):
                cells[len(label_columns) + j] += CAP_MARK
        body.append(cells)
    return header, body


def _markdown(header: list[str], body: list[list[str]]) -> str:
    def esc(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(esc(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in cells) + " |" for cells in body]
    return "\n".join(lines)


def to_markdown(result: pd.DataFrame, digits: int = 4, with_caption: bool = True, per_seed: bool = False) -> str:
    """A table() result as a markdown table: cells "mean ± std (n=k) [CI low, CI high]", "mean (1 seed)" for a
    single run, "–" where nothing was measured; ``per_seed`` appends "; seed: value, ..." to cells with n > 1."""
    header, body = formatted_cells(result, digits, per_seed=per_seed)
    text = _markdown(header, body)
    if result.attrs.get("cap_note"):
        text += "\n\n" + result.attrs["cap_note"]
    return (caption(result) + "\n\n" + text) if with_caption else text


def to_csv(result: pd.DataFrame) -> str:
    """A table() result as CSV: label columns, then per length mean@L, std@L, n@L, ci_low@L, ci_high@L and
    note@L ("1 seed" for a single run, "step cap: seed ..." for runs that hit their step cap before their
    stopping rule, else empty)."""
    out = result.copy()
    for L in result.attrs.get("lengths", []):
        if f"n@{L}" in out.columns:
            position = out.columns.get_loc(f"ci_high@{L}") + 1 if f"ci_high@{L}" in out.columns else \
                out.columns.get_loc(f"n@{L}") + 1
            capped = result.attrs.get("capped") or {}
            out.insert(position, f"note@{L}", [
                "; ".join(filter(None, [SINGLE_RUN if n == 1 else "",
                                        "step cap: seed " + ", ".join(map(str, capped[(i, L)])) if (i, L) in capped else ""]))
                for i, n in enumerate(out[f"n@{L}"])])
    return out.to_csv(index=False, lineterminator="\n")


# ---------------------------------------------------------------------------------------- reference
def reference_table() -> pd.DataFrame:
    """The paper's Table 4 (docs/reference-numbers.md#table-4) as a DataFrame: attention, p, loss@1024..8192."""
    records = [
        {"attention": name, "p": p, **{f"mean@{L}": v for L, v in zip(PAPER_TABLE4_LENGTHS, values)}}
        for name, p, values in PAPER_TABLE4
    ]
    return pd.DataFrame.from_records(records)


def format_reference_table() -> str:
    """The paper's Table 4 as markdown, to print next to ours (``attnlab results table --reference``)."""
    header = ["attention", "p", *(f"{length_label(L)} ({L // 1024}x)" for L in PAPER_TABLE4_LENGTHS)]
    body = [[name, format_value(p), *(f"{v:.4f}" for v in values)] for name, p, values in PAPER_TABLE4]
    return ("Paper (Gao & Spratling, Table 4): val_loss, GPT-2 124M trained at 1K on FineWeb\n\n"
            + _markdown(header, body))


# ---------------------------------------------------------------------------------------- best
def _rows_at(rows: pd.DataFrame, at, metric: str) -> pd.DataFrame:
    """The rows at one eval length (``at``: ``16384``, ``"16k"`` or ``"16x"`` the training length)."""
    kind, amount = parse_at(at)
    if kind == "length":
        picked = rows[rows["eval_len"] == amount]
    else:
        picked = rows[np.isclose(rows["eval_len"].to_numpy(float), amount * rows["train_len"].to_numpy(float))]
    if len(picked) == 0:
        available = ", ".join(str(int(x)) for x in sorted(rows["eval_len"].unique()))
        raise UserError(f"--at {at!r}: no {metric!r} rows at that length; eval lengths present: {available}")
    return picked


def best(df: pd.DataFrame, at, metric: str = "val_loss", step="final") -> pd.DataFrame:
    """Rank configurations by ``metric`` at one eval length (``at``: ``16384``, ``"16k"`` or ``"16x"``).

    Lower is better unless the metric is registered as higher-is-better (accuracies). NaN ranks last.
    Returns columns: rank (1 = best), the label columns, eval_len, mean, std, n, ci_low, ci_high (the 95%
    Student t interval of the mean; NaN when n < 2). A ranking is not a test: use :func:`compare` to ask
    whether two ranks really differ.
    """
    rows = select(df, metric, step)
    picked = _rows_at(rows, at, metric)
    _, label_columns = _config_columns(rows)
    stats = aggregate(picked, label_columns)
    higher = METRICS[metric].higher_is_better if metric in METRICS else False
    ordering = stats["mean"].fillna(-math.inf if higher else math.inf)
    stats = stats.assign(_order=ordering).sort_values("_order", ascending=not higher, kind="stable")
    stats = stats.drop(columns="_order").reset_index(drop=True)
    stats.insert(0, "rank", range(1, len(stats) + 1))
    stats.attrs.update(metric=metric, at=str(at), label_columns=label_columns,
                       higher_is_better=higher, constants=_constants(rows, _config_columns(rows)[0], label_columns))
    return stats


def best_to_markdown(ranking: pd.DataFrame, digits: int = 4) -> str:
    label_columns = ranking.attrs.get("label_columns", [])
    header = ["rank", *label_columns, "eval_len", ranking.attrs.get("metric", "value")]
    body = []
    for i in range(len(ranking)):
        row = ranking.iloc[i]
        body.append([str(int(row["rank"])), *(format_value(row[c]) for c in label_columns),
                     str(int(row["eval_len"])),
                     _format_cell(row["mean"], row["std"], int(row["n"]), digits,
                                  row.get("ci_low", math.nan), row.get("ci_high", math.nan))])
    direction = "higher is better" if ranking.attrs.get("higher_is_better") else "lower is better"
    percent = f"{100 * CONFIDENCE:g}%"
    return (f"ranking at {ranking.attrs.get('at')} ({direction}; mean ± sample std (n), [{percent} Student t "
            f"interval]; '{SINGLE_RUN}' = a single run; a rank is not a test: see `attnlab results compare`)\n\n"
            + _markdown(header, body))


def best_to_csv(ranking: pd.DataFrame) -> str:
    """A best() ranking as CSV, with a ``note`` column ("1 seed" for a single run)."""
    out = ranking.copy()
    out["note"] = [SINGLE_RUN if int(n) == 1 else "" for n in out["n"]]
    return out.to_csv(index=False, lineterminator="\n")


# ---------------------------------------------------------------------------------------- compare
@dataclass
class Comparison:
    """The difference ``b - a`` of one metric at one eval length between two configurations, with its test.

    ``a_values``/``b_values`` are the per-run ``(seed, value)`` pairs used (NaN values, diverged runs, are left
    out and listed in ``notes``). ``test`` is None when either side has fewer than 2 runs. ``significant`` is
    Welch's two-sided p < ``alpha``; when Welch's t is undefined (no spread on either side) the permutation
    test decides; None when there is no test.
    """

    metric: str
    eval_len: int
    train_len: int | None
    step: object
    a: str                              # the --a text as given
    b: str
    a_config: dict                      # the configuration columns of each side that differ between them
    b_config: dict
    constants: dict                     # the configuration columns both sides share
    a_values: list
    b_values: list
    higher_is_better: bool
    confidence: float
    alpha: float
    test: _stats_mod.TestResult | None
    significant: bool | None
    verdict: str
    notes: list = field(default_factory=list)

    @property
    def n_a(self) -> int:
        return len(self.a_values)

    @property
    def n_b(self) -> int:
        return len(self.b_values)

    @property
    def mean_a(self) -> float:
        return float(np.mean([v for _, v in self.a_values])) if self.a_values else math.nan

    @property
    def mean_b(self) -> float:
        return float(np.mean([v for _, v in self.b_values])) if self.b_values else math.nan

    @property
    def diff(self) -> float:
        """mean(b) - mean(a)."""
        return self.mean_b - self.mean_a

    @property
    def ci(self) -> tuple[float, float]:
        """The Welch interval of ``diff`` (NaN, NaN without a test)."""
        return self.test.ci if self.test else (math.nan, math.nan)

    @property
    def p_value(self) -> float:
        """Welch's two-sided p (NaN without a test or when Welch's t is undefined)."""
        return self.test.p_welch if self.test else math.nan

    def to_text(self, digits: int = 4) -> str:
        return format_comparison(self, digits)


def _parse_side(text: str, flag: str) -> tuple[str, dict[str, str]]:
    """``ATTENTION[,COLUMN=VALUE...]`` -> (attention, {column: normalised value text})."""
    parts = [p.strip() for p in str(text).split(",")]
    if not parts[0] or "=" in parts[0]:
        raise UserError(f"{flag} {text!r}: start with the attention variant, e.g. {flag} lssar or "
                        f"{flag} lssar,p_eval=15")
    pins: dict[str, str] = {}
    for part in parts[1:]:
        name, sep, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise UserError(f"{flag} {text!r}: qualifiers are COLUMN=VALUE, e.g. {flag} {parts[0]},p_eval=15")
        if name not in CONFIG_COLUMNS and name != "study":
            raise UserError(f"{flag} {text!r}: {name!r} is not a configuration column; allowed: "
                            f"{', '.join(['study', *CONFIG_COLUMNS])}")
        pins[name] = _normalise(value)
    return parts[0], pins


def _normalise(text) -> str:
    """A value as the text reports show for it ("none", "15", "ntk"), so user text and stored values compare."""
    if isinstance(text, str):
        if text.strip().lower() == "none":
            return "none"
        try:
            return format_value(float(text))
        except ValueError:
            return text.strip()
    return format_value(text)


def _side_rows(picked: pd.DataFrame, all_rows: pd.DataFrame, spec: str, flag: str, metric: str,
               at, config_columns: list[str]) -> pd.DataFrame:
    attention, pins = _parse_side(spec, flag)
    where = f"at {at}"
    mine = picked[picked["attention"] == attention]
    if len(mine) == 0:
        elsewhere = all_rows[all_rows["attention"] == attention]
        if len(elsewhere):
            lengths = ", ".join(str(int(x)) for x in sorted(elsewhere["eval_len"].unique()))
            raise UserError(f"{flag} {attention!r}: no {metric!r} rows {where}; it has rows at eval lengths {lengths}")
        present = ", ".join(sorted(str(x) for x in all_rows["attention"].unique()))
        raise UserError(f"{flag} {attention!r}: no {metric!r} rows for that attention variant; variants present: "
                        f"{present}")
    for name, value in pins.items():
        if name not in mine.columns:
            raise UserError(f"{flag} {spec!r}: the rows have no {name!r} column")
        kept = mine[[_normalise(v) == value for v in mine[name].tolist()]]
        if len(kept) == 0:
            values = ", ".join(sorted({_normalise(v) for v in mine[name].tolist()}, key=str))
            raise UserError(f"{flag} {spec!r}: no rows with {name}={value} {where}; {name} values for "
                            f"{attention}: {values}")
        mine = kept
    varying = [c for c in config_columns if c in mine.columns and mine[c].nunique(dropna=False) > 1]
    if varying:
        configs = mine[varying].drop_duplicates()
        configs = configs.iloc[sorted(range(len(configs)),
                                      key=lambda i: tuple(_sort_key(configs.iloc[i][c]) for c in varying))]
        listed = "; ".join(", ".join(f"{c}={format_value(r[c])}" for c in varying) for _, r in configs.iterrows())
        first = configs.iloc[0]
        hint = ",".join(f"{c}={format_value(first[c])}" for c in varying)
        pins_flags = " ".join(f"--where {c}=VALUE" for c in varying)
        raise UserError(f"{flag} {spec!r} matches {len(configs)} configurations {where} ({listed}): pick one with "
                        f"{flag} {attention},{hint} (or {pins_flags} for both sides)")
    return mine


def _plain(value):
    """None for every spelling of missing; numpy scalars as Python numbers."""
    return None if is_missing(value) else (value.item() if isinstance(value, np.generic) else value)


def compare(df: pd.DataFrame, a: str, b: str, at, metric: str = "val_loss", step="final",
            confidence: float = CONFIDENCE, alpha: float = _stats_mod.ALPHA) -> Comparison:
    """Compare configuration ``b`` with configuration ``a`` on ``metric`` at one eval length ``at``.

    ``a`` and ``b`` name an attention variant, optionally pinned further with configuration columns:
    ``"lssar"``, ``"softmax,p_eval=15"``, ``"lssa,rope_scaling=none"``. Each must pick exactly one
    configuration among the rows (narrow ``df`` first, e.g. ``--where rope_scaling=none``); otherwise a
    one-line :class:`UserError` lists the configurations and how to pick one. ``at`` is a length
    (``1024``, ``"1k"``) or a multiple of the training length (``"16x"``).

    The difference is **b - a** (mean over runs, i.e. seeds). With at least 2 runs on each side it carries
    the Welch interval and Welch's two-sided t test, plus an exact permutation test
    (:func:`attnlab.results.stats.two_sample_test`); the verdict says plainly whether the difference is
    significant at ``alpha`` and when n is too small to test at all.
    """
    rows = select(df, metric, step)
    picked = _rows_at(rows, at, metric)
    config_columns, _ = _config_columns(rows)
    side_a = _side_rows(picked, rows, a, "--a", metric, at, config_columns)
    side_b = _side_rows(picked, rows, b, "--b", metric, at, config_columns)
    if set(side_a.index) == set(side_b.index):
        raise UserError(f"--a {a!r} and --b {b!r} pick the same configuration; compare two different ones")
    present = [c for c in config_columns if c in rows.columns]
    differing = [c for c in present if _normalise(side_a[c].iloc[0]) != _normalise(side_b[c].iloc[0])]
    a_config = {c: _plain(side_a[c].iloc[0]) for c in differing}
    b_config = {c: _plain(side_b[c].iloc[0]) for c in differing}
    constants = {c: _plain(side_a[c].iloc[0]) for c in present if c not in differing
                 and not (c in ("layer", "bucket", "preset", "data", "knobs") and is_missing(side_a[c].iloc[0]))}

    notes: list[str] = []
    values = {}
    for name, side in (("a", side_a), ("b", side_b)):
        pairs = list(_seed_values(side))
        bad = [s for s, v in pairs if not math.isfinite(v)]
        if bad:
            notes.append(f"{name}: left out {len(bad)} run(s) with a non-finite value (diverged): seed(s) "
                         f"{', '.join(str(s) for s in bad)}")
        values[name] = [(s, v) for s, v in pairs if math.isfinite(v)]
    higher = METRICS[metric].higher_is_better if metric in METRICS else False
    eval_len = int(side_a["eval_len"].iloc[0])
    train_len = _train_len(pd.concat([side_a, side_b]))

    test, significant = None, None
    n_a, n_b = len(values["a"]), len(values["b"])
    if n_a < 2 or n_b < 2:
        few = [f"{name} has n={n}" for name, n in (("a", n_a), ("b", n_b)) if n < 2]
        verdict = (f"no test: {' and '.join(few)}; a test needs at least 2 runs (seeds) on each side, so this "
                   f"difference cannot be told from run-to-run noise")
    else:
        test = _stats_mod.two_sample_test([v for _, v in values["a"]], [v for _, v in values["b"]], confidence,
                                          bounds=metric_bounds(metric))
        notes.extend(test.notes)
        if math.isnan(test.p_welch):
            if test.diff == 0:
                verdict = "no difference: every run on both sides gave the same value"
                significant = False
            else:
                significant = test.p_permutation < alpha
                verdict = (f"{'significant' if significant else 'not significant'} at the {100 * alpha:g}% level "
                           f"by the permutation test (p = {test.p_permutation:.3g}); Welch's t is undefined "
                           f"(no spread within either side)")
        else:
            significant = test.p_welch < alpha
            if significant:
                better = (test.diff > 0) == higher
                verdict = (f"significant at the {100 * alpha:g}% level (Welch p = {test.p_welch:.3g}): b is "
                           f"{'higher' if test.diff > 0 else 'lower'} than a ({'better' if better else 'worse'}"
                           f" for {metric}, {'higher' if higher else 'lower'} is better)")
            else:
                interval = (f"; the {100 * confidence:g}% interval includes 0"
                            if math.isclose(confidence, 1 - alpha) else "")
                verdict = (f"not significant at the {100 * alpha:g}% level (Welch p = {test.p_welch:.3g}{interval}): "
                           f"these runs cannot tell a from b")
        if test.min_p_permutation >= alpha:
            notes.append(f"with {n_a} vs {n_b} runs the exact permutation test cannot go below p = "
                         f"{test.min_p_permutation:.3g}, so on its own it can never reach the "
                         f"{100 * alpha:g}% level; more seeds are needed for a distribution-free test")
    return Comparison(metric=metric, eval_len=eval_len, train_len=train_len, step=step, a=str(a), b=str(b),
                      a_config=a_config, b_config=b_config, constants=constants, a_values=values["a"],
                      b_values=values["b"], higher_is_better=higher, confidence=confidence, alpha=alpha,
                      test=test, significant=significant, verdict=verdict, notes=notes)


def _signed(value: float, digits: int) -> str:
    return "nan" if math.isnan(value) else f"{value:+.{digits}f}"


def format_comparison(result: Comparison, digits: int = 4) -> str:
    """The comparison as a few lines of text: each side's runs, b - a with its interval, the tests, the verdict."""
    length = length_label(result.eval_len)
    if result.train_len:
        length += f" ({result.eval_len / result.train_len:g}x)"
    step = result.step
    step_text = "final step of each trial" if step == "final" else ("all steps" if step in ("all", None) else f"step {step}")
    lines = [f"compare {result.metric} at {length} ({step_text}); difference = b - a "
             f"({'higher' if result.higher_is_better else 'lower'} is better)"]
    if result.constants:
        lines.append("constant: " + ", ".join(f"{k}={format_value(v)}" for k, v in result.constants.items()))
    percent = f"{100 * result.confidence:g}%"
    bounds = metric_bounds(result.metric)
    for name, spec, config, pairs in (("a", result.a, result.a_config, result.a_values),
                                      ("b", result.b, result.b_config, result.b_values)):
        label = ", ".join(f"{k}={format_value(v)}" for k, v in config.items()) or spec
        vals = np.array([v for _, v in pairs], dtype=float)
        if len(vals) == 0:
            summary = "no finite values"
        elif len(vals) == 1:
            summary = f"{_number(float(vals[0]), digits)} ({SINGLE_RUN})"
        elif _stats_mod.shows_seed_values(len(vals), bounds):  # too few runs for an interval inside the range
            summary = f"{_number(float(vals.mean()), digits)} (n={len(vals)}; no interval, see per seed)"
        else:
            low, high = _stats_mod.bounded_interval(vals, result.confidence, bounds)
            summary = (f"{_number(float(vals.mean()), digits)} ± {_number(float(vals.std(ddof=1)), digits)} "
                       f"(n={len(vals)}) [{percent} CI {_number(low, digits)}, {_number(high, digits)}]")
        seeds = ", ".join(f"{'?' if s is None else s}: {_number(v, digits)}" for s, v in pairs)
        lines.append(f"{name}: {label}: {summary}; per seed {seeds or '-'}")
    test = result.test
    if test is None:
        lines.append(f"b - a = {_signed(result.diff, digits)} (no interval, no test)")
    else:
        if math.isnan(test.p_welch):
            lines.append(f"b - a = {_signed(test.diff, digits)}; Welch's t undefined")
        else:
            lines.append(f"b - a = {_signed(test.diff, digits)}, {percent} CI [{_signed(test.ci[0], digits)}, "
                         f"{_signed(test.ci[1], digits)}] (Welch's t = {test.t:.3g}, df = {test.df:.3g}, "
                         f"p = {test.p_welch:.3g})")
        how = "exact over" if test.exact else "sampled,"
        lines.append(f"permutation test ({how} {test.permutation_splits} splits of the pooled runs): "
                     f"p = {test.p_permutation:.3g}")
    lines.append(f"verdict: {result.verdict}")
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- curves
# ---------------------------------------------------------------------------------------- recovered laws
# (column, metric): what `attnlab results laws` shows of each trial's force probe, in this order.
LAW_COLUMNS = (("exp_r", "force_exp_r"), ("exp_m1", "force_exp_m1"), ("exp_m2", "force_exp_m2"),
               ("newton_dist", "force_newton_dist"), ("newton", "force_is_newton"), ("sr_err", "force_sr_err"),
               ("probe_err", "force_probe_err"), ("probe_r2", "force_probe_r2"), ("pl_exp_r", "force_pl_exp_r"),
               ("pl_exp_m1", "force_pl_exp_m1"), ("pl_exp_m2", "force_pl_exp_m2"))
LAW_KEYS = ("attention", "scale", "p_train", "knobs", "seed", "window_mode", "trial")


def laws(df: pd.DataFrame, step="final") -> pd.DataFrame:
    """One row per trial and force probe: ``attention, scale, p_train, knobs, seed, probe`` (finetune or linear),
    ``expression`` (the recovered law, in r, m1, m2), then :data:`LAW_COLUMNS` (``newton``: 1 when the law is
    Newton's within the probe's tolerance). Sorted by attention, p_train, seed."""
    rows = select(df, "force_newton_dist", step)
    if len(rows) == 0:
        raise UserError("no force-probe rows: evaluate an orbit model with eval.force_probe (studies/orbits.yaml)")
    # every force metric of each probe, keyed like the law rows (which ``select`` already put at the right step)
    probes = df[df["window_mode"].astype(str).str.startswith("force_")]
    keys = ["study", "trial", "window_mode", "step"]
    by_probe = {key: dict(zip(group["metric"], group["value"])) for key, group in probes.groupby(keys)}
    out = []
    for _, law_row in rows.iterrows():
        values = by_probe.get(tuple(law_row[k] for k in keys), {})
        record = {k: (None if is_missing(law_row.get(k)) else law_row.get(k)) for k in LAW_KEYS}
        record["probe"] = str(record.pop("window_mode")).removeprefix("force_")
        expression = law_row.get("expression")
        record["expression"] = None if is_missing(expression) else str(expression)
        for column, metric in LAW_COLUMNS:
            record[column] = float(values.get(metric, math.nan))
        out.append(record)
    result = pd.DataFrame(out)
    result = result.sort_values(["attention", "p_train", "knobs", "seed", "probe"], key=lambda c: c.map(_sort_key),
                                kind="stable").reset_index(drop=True)
    varying = [k for k in ("scale", "p_train", "knobs") if result[k].nunique(dropna=False) > 1]
    return result.drop(columns=[k for k in ("scale", "p_train", "knobs") if k not in varying])


def laws_to_markdown(result: pd.DataFrame, digits: int = 3) -> str:
    """The recovered laws as a markdown table, with a line per variant: how many seeds recovered Newton's law."""
    shown = [c for c in result.columns if c != "trial"]
    body = []
    for _, row in result.iterrows():
        cells = []
        for column in shown:
            value = row[column]
            if column == "newton":
                cells.append(MISSING_CELL if not np.isfinite(value) else ("yes" if value >= 0.5 else "no"))
            elif column == "expression":
                cells.append(f"`{value}`" if value else MISSING_CELL)
            elif column == "p_train":  # null = no sharpening, as every other table prints it
                cells.append(format_value(value))
            elif column in LAW_KEYS or column == "probe":
                cells.append(MISSING_CELL if is_missing(value) else format_value(value))
            else:
                cells.append(_number(float(value), digits) if np.isfinite(value) else MISSING_CELL)
        body.append(cells)
    text = _markdown(shown, body)
    summary = []
    for attention, group in result.groupby("attention", sort=False):
        hits = int((group["newton"] >= 0.5).sum())
        summary.append(f"{attention}: Newton's law (exponents -2, 1, 1 within tolerance) recovered in {hits} of "
                       f"{len(group)} probe(s)")
    return text + "\n\n" + "\n".join(summary)


def laws_to_csv(result: pd.DataFrame) -> str:
    return result.to_csv(index=False)


def _config_label(row, columns: list[str]) -> str:
    return ", ".join(f"{c}={format_value(row[c])}" for c in columns)


def _p_column(rows: pd.DataFrame) -> str:
    for name in ("p_eval", "p_train"):
        if name in rows.columns and rows[name].nunique(dropna=False) > 1:
            return name
    raise UserError("--by p needs rows with several p_eval (or p_train) values; this selection has one")


def _html_page(title: str, caption_text: str, png_bytes: bytes, header: list[str], body: list[list[str]]) -> str:
    encoded = base64.b64encode(png_bytes).decode("ascii")
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    rows = "\n".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>" for cells in body)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #bbb;padding:4px 8px;text-align:right}} th{{background:#eee}}</style></head>
<body><h1>{html.escape(title)}</h1><p>{html.escape(caption_text)}</p>
<img alt="{html.escape(title)}" src="data:image/png;base64,{encoded}">
<table><thead><tr>{head}</tr></thead><tbody>
{rows}
</tbody></table></body></html>
"""


# Lines of one figure never share a style: colour, line style and marker all change from line to line, so two
# lines that coincide (p_eval none vs 15 of a p = 15 model) still show as two.
_LINE_STYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _plot_line(axes, xs: np.ndarray, ys: np.ndarray, errs: np.ndarray, ns: np.ndarray, label: str,
               index: int = 0, bounds: tuple[float, float] | None = None, seeds: list | None = None) -> bool:
    """One line with std error bars; points with n = 1 hollow, "(1 seed)" in the label when all are.
    A bounded metric (``bounds``, the metric's range) keeps its error bars inside the range, and a point of
    2..SMALL_N runs with its ``seeds`` (per point: ((seed, value), ...)) shows each run as a small dot instead of
    an error bar. Returns whether any single-run point was drawn."""
    ns = np.asarray(ns)
    single = ns == 1
    if len(single) and single.all():
        label = f"{label} ({SINGLE_RUN})"
    marker = _MARKERS[index % len(_MARKERS)]
    color = f"C{index % 10}"
    errs = np.nan_to_num(np.asarray(errs, dtype=float))
    few = np.array([bool(seeds) and bool(seeds[k]) and _stats_mod.shows_seed_values(n, bounds)
                    for k, n in enumerate(ns)], dtype=bool)
    errs = np.where(few, 0.0, errs)
    yerr = None
    if errs.any():
        yerr = errs if bounds is None else \
            np.array([_stats_mod.clipped_bar(float(y), float(e), bounds) for y, e in zip(ys, errs)]).T
    line = axes.errorbar(xs, ys, yerr=yerr, marker=marker, capsize=3, label=label,
                         linestyle=_LINE_STYLES[index % len(_LINE_STYLES)], color=color, alpha=0.9)
    if few.any():
        points = [(x, v) for x, cell, shown in zip(xs, seeds, few) if shown for _, v in cell]
        axes.plot([x for x, _ in points], [v for _, v in points], linestyle="none", marker=".", markersize=5,
                  color=color, alpha=0.8, zorder=3)
    if single.any():
        color = line.lines[0].get_color()
        axes.plot(xs[single], ys[single], linestyle="none", marker=marker, markersize=7, markerfacecolor="white",
                  markeredgecolor=color, markeredgewidth=1.5, zorder=3)
    return bool(single.any())


def _wrap_inside(figure, text_artist, text: str, lay_out) -> None:
    """Set ``text_artist`` to ``text`` wrapped at spaces (never inside a word) so that, after ``lay_out()``, it
    lies inside the figure's width; the text itself stays whole (joining the lines gives it back)."""
    renderer = figure.canvas.get_renderer()
    text_artist.set_text(text)
    lay_out()
    extent = text_artist.get_window_extent(renderer)
    width = len(text)
    for _ in range(8):  # each round narrows to what the last drawing says fits; two rounds are the rule
        inside = extent.x0 >= figure.bbox.x0 and extent.x1 <= figure.bbox.x1
        if inside or width <= 20:
            return
        # the text is centred at its anchor: each half of the widest line must fit on its own side
        anchor = (extent.x0 + extent.x1) / 2
        room = 2 * min(anchor - figure.bbox.x0, figure.bbox.x1 - anchor) - 12  # a few pixels of margin
        longest = max(len(line) for line in text_artist.get_text().split("\n"))
        width = max(20, min(width - 1, int(longest * room / extent.width)))
        text_artist.set_text(textwrap.fill(text, width, break_long_words=False, break_on_hyphens=False))
        lay_out()
        extent = text_artist.get_window_extent(renderer)


def metric_axis_label(metric: str) -> str:
    """The y axis of a figure: what the metric is and its unit (losses are natural-log cross-entropies)."""
    if metric in ("val_loss", "loss") or metric.endswith("_loss"):
        return f"{metric} (nats per token)"
    if metric == "acc":
        return "acc (fraction of target tokens right)"
    return metric


def _length_tick(length: int, train_len) -> str:
    """``1K`` over ``1x``: the length and, when every row was trained at one length, its multiple."""
    if train_len:
        multiple = length / float(train_len)
        return f"{length_label(length)}\n{multiple:g}x"
    return length_label(length)


def _figure_title(df: pd.DataFrame, metric: str, by: str, p_column: str | None = None) -> str:
    """The metric against what, for which study (the settings every line shares go under it)."""
    studies = sorted({str(s) for s in df["study"].dropna().unique()}) if "study" in df.columns else []
    against = "evaluation length" if by == "length" else f"{p_column or 'p'}"
    return f"{metric} vs {against}" + (f" — study {', '.join(studies)}" if studies else "")


def curve_figure(df: pd.DataFrame, metric: str = "val_loss", by: str = "length", step="final", digits: int = 4):
    """The figure :func:`curves` saves, and what its page shows: ``(figure, title, caption, header, body)``.

    The title names the metric and the study; the line under it the settings every line shares. Every line has
    its own colour, line style and marker (lines that coincide stay visible). Length figures mark the training
    length and label each tick with its multiple (1x..16x); the y axis says the unit (nats per token for
    losses). In ``by="p"`` figures ``p_eval`` none reads "as trained" (the model's own p_train). Both titles are
    wrapped at spaces to the figure's width (the figure grows in height), so no text reaches past its edges."""
    if by not in ("length", "p"):
        raise UserError(f"--by {by!r}: allowed: length, p")
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = select(df, metric, step)
    result = table(df, metric=metric, step=step)
    label_columns = result.attrs["label_columns"]
    train_len = result.attrs.get("train_len")
    bounds = metric_bounds(metric)
    seed_values = result.attrs.get("seed_values") or {}
    figure = Figure(figsize=(9, 5.5), dpi=100)
    FigureCanvasAgg(figure)  # a renderer to measure the titles with (they are wrapped to the figure's width)
    axes = figure.add_subplot(1, 1, 1)
    single_runs = False
    p_column = None

    if by == "length":
        lengths = result.attrs["lengths"]
        for i in range(len(result)):
            row = result.iloc[i]
            n = np.array([row[f"n@{L}"] for L in lengths])
            xs = np.array(lengths, dtype=float)[n > 0]
            ys = np.array([row[f"mean@{L}"] for L in lengths])[n > 0]
            errs = np.nan_to_num(np.array([row[f"std@{L}"] for L in lengths])[n > 0])
            seeds = [seed_values.get((i, L)) for L, k in zip(lengths, n) if k > 0]
            single_runs |= _plot_line(axes, xs, ys, errs, n[n > 0], _config_label(row, label_columns), index=i,
                                      bounds=bounds, seeds=seeds)
        axes.set_xscale("log", base=2)
        axes.set_xticks(lengths)
        axes.set_xticklabels([_length_tick(L, train_len) for L in lengths])
        axes.minorticks_off()
        if train_len:
            axes.axvline(float(train_len), color="0.4", linestyle=(0, (1, 3)), linewidth=1.2,
                         label=f"training length ({length_label(train_len)})")
            axes.set_xlabel("evaluation length (tokens, log2 scale; below: multiple of the training length)")
        else:
            axes.set_xlabel("evaluation length (tokens, log2 scale; the rows were trained at several lengths)")
        header, body = formatted_cells(result, digits)
    else:
        p_column = _p_column(rows)
        group_columns = [c for c in label_columns if c != p_column]
        stats = aggregate(rows, [*group_columns, p_column], keep_values=True)
        p_values = sorted(stats[p_column].drop_duplicates().tolist(), key=_sort_key)
        positions = {format_value(p): i for i, p in enumerate(p_values)}
        line_columns = [*group_columns, "eval_len"]
        for index, (_, line) in enumerate(stats.groupby(line_columns, dropna=False, sort=False)):
            first = line.iloc[0]
            length = length_label(first["eval_len"])
            if train_len:
                length += f" ({int(first['eval_len']) / float(train_len):g}x)"
            label = ", ".join([*(f"{c}={format_value(first[c])}" for c in group_columns), f"L={length}"])
            xs = [positions[format_value(p)] for p in line[p_column]]
            errs = np.nan_to_num(line["std"].to_numpy(float))
            single_runs |= _plot_line(axes, np.array(xs, dtype=float), line["mean"].to_numpy(float), errs,
                                      line["n"].to_numpy(int), label, index=index, bounds=bounds,
                                      seeds=line["values"].tolist())
        axes.set_xticks(range(len(p_values)))
        if p_column == "p_eval":  # p_eval none: the model evaluated as it was trained (its own p_train)
            axes.set_xticklabels(["as trained" if is_missing(p) else format_value(p) for p in p_values])
            axes.set_xlabel("p_eval (sharpening power at evaluation; as trained = the model's own p_train)")
        else:
            axes.set_xticklabels(["none" if is_missing(p) else format_value(p) for p in p_values])
            axes.set_xlabel("p_train (sharpening power in training; none = no sharpening)")
        header = [*group_columns, p_column, "eval_len", metric]
        body = [[*(format_value(r[c]) for c in group_columns), format_value(r[p_column]), str(int(r["eval_len"])),
                 _format_cell(r["mean"], r["std"], int(r["n"]), digits, r["ci_low"], r["ci_high"], bounds=bounds,
                              seeds=r["values"])]
                for _, r in stats.iterrows()]

    axes.set_ylabel(metric_axis_label(metric))
    title = _figure_title(df, metric, by, p_column)
    constants = {k: v for k, v in (result.attrs.get("constants") or {}).items() if k not in ("study",)}
    subtitle = ", ".join(f"{k}={format_value(v)}" for k, v in constants.items())
    bars = "error bars: sample std over seeds"
    if bounds is not None:
        bars += (f", kept inside [{bounds[0]:g}, {bounds[1]:g}]; small dots: each seed's value where n <= "
                 f"{_stats_mod.SMALL_N}")
    subtitle = (f"fixed: {subtitle}; " if subtitle else "") + bars
    suptitle = figure.suptitle(title, fontsize="medium")
    subtitle_text = axes.set_title(subtitle, fontsize="small", color="0.3")
    axes.grid(True, alpha=0.3)
    handles, labels = axes.get_legend_handles_labels()
    if single_runs:
        from matplotlib.lines import Line2D

        handles.append(Line2D([], [], linestyle="none", marker="o", markerfacecolor="white", markeredgecolor="0.3",
                              label=f"hollow marker: {SINGLE_RUN} (no spread)"))
        labels.append(handles[-1].get_label())
    # The legend sits under the plot, never on a line; the figure grows with it.
    figure.set_size_inches(9, 5.5 + 0.2 * len(labels))
    axes.legend(handles, labels, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1,
                frameon=False)

    def lay_out():
        # The figure also grows with the title lines (the plot keeps its height), then the layout makes room.
        extra = suptitle.get_text().count("\n") * 0.2 + subtitle_text.get_text().count("\n") * 0.16
        figure.set_size_inches(9, 5.5 + 0.2 * len(labels) + extra)
        figure.tight_layout()

    # A title wider than the figure would be cut at both edges of the PNG: wrap both to the figure's width.
    _wrap_inside(figure, suptitle, title, lay_out)
    _wrap_inside(figure, subtitle_text, subtitle, lay_out)
    return figure, title, caption(result), header, body


def curves(df: pd.DataFrame, out_dir: str, metric: str = "val_loss", by: str = "length", step="final",
           digits: int = 4) -> dict[str, str]:
    """Plot ``metric`` against eval length (log2 x axis, one line per configuration; the paper's
    Figure 1) or, with ``by="p"``, against the sharpening power p (one line per eval length and
    configuration; its Figure 2); see :func:`curve_figure`. Error bars show the sample std when n > 1 (kept
    inside the range of a bounded metric such as acc, whose points of 2..3 runs show each run as a small dot
    instead); a point measured on a single run is drawn hollow, a line made only of single runs says "(1 seed)" in its legend
    label, and the legend explains the hollow marker whenever one is drawn.

    Writes ``<metric>_vs_<by>.png`` and a self-contained ``<metric>_vs_<by>.html`` (the PNG inlined as
    base64 plus the numbers as a table) into ``out_dir``; returns ``{"png": path, "html": path}``.
    """
    from attnlab.location import Location

    figure, title, caption_text, header, body = curve_figure(df, metric, by, step, digits)
    out = Location.parse(out_dir, field="--out")
    stem = f"{metric}_vs_{by}"
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    png_bytes = buffer.getvalue()
    out.write_bytes(stem + ".png", png_bytes)
    out.write_text(stem + ".html", _html_page(title, caption_text, png_bytes, header, body))
    return {"png": out.child(stem + ".png").uri, "html": out.child(stem + ".html").uri}


# ---------------------------------------------------------------------------------------- export
def export(df: pd.DataFrame, path: str, format: str | None = None) -> str:
    """Write rows to ``path`` (a local path or an ``s3://`` / ``gs://`` URI) as Parquet or CSV (``format``
    defaults to the file suffix). Returns the location written."""
    from attnlab.location import Location

    if format is None:
        format = "csv" if str(path).lower().endswith(".csv") else "parquet"
    if format not in ("parquet", "csv"):
        raise UserError(f"--format {format!r}: allowed: parquet, csv")
    target = Location.parse(path, field="--out")
    if format == "csv":
        data = df.to_csv(index=False).encode("utf-8")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        buffer = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pandas(df, preserve_index=False), buffer)
        data = buffer.getvalue()
    target.parent.write_bytes(target.name, data)
    return target.uri