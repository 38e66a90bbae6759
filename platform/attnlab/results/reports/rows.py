"""Selecting and aggregating results rows: one metric at each run's final step, configurations, and the
mean / std / n / interval of a cell (the rules every report shares; see :mod:`attnlab.results.reports`).

Pure: no Ray, no store access, no network.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from attnlab.errors import UserError
from attnlab.names import is_missing
import attnlab.results.stats as _stats_mod
from attnlab.results.schema import COMPLETE_METRIC, CONFIG_COLUMNS, SCALING_COLUMNS, current_label, metric_bounds


MISSING_CELL = "–"


SINGLE_RUN = "1 seed"  # how tables and figures mark a cell measured on a single run

# The columns table, best and curves look at (``attnlab results`` reads only these for them).
LINEAGE_COLUMNS = ("stage", "extension", "ext_factor", "ext_len", "ext_tokens")  # configuration columns of stages
REPORT_COLUMNS = ("study", "train_key", "step", "metric", "eval_len", "value", "seed", *CONFIG_COLUMNS, "stopped",
                  "stop_rule", "schema_version")


CONFIDENCE = _stats_mod.CONFIDENCE


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


def current_labels(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with its RoPE scaling columns as this version names them (:func:`attnlab.results.schema.current_label`:
    a row of schema 1-8 that says ``yarn`` measured the paper's ramp, ``yarn_paper``), so old and new YaRN rows are
    never one configuration. Rows without ``schema_version`` are left as they are."""
    if "schema_version" not in df.columns:
        return df
    changed = {c: [current_label(v, version) for v, version in zip(df[c].tolist(), df["schema_version"].tolist())]
               for c in SCALING_COLUMNS if c in df.columns}
    return df.assign(**changed) if changed else df


def select(df: pd.DataFrame, metric: str = "val_loss", step="final") -> pd.DataFrame:
    """Rows of one metric, at each run's final step (``step="final"``: by ``train_key``), a given step, or all
    steps."""
    if df is None or len(df) == 0:
        raise UserError("no results rows to report (is the store or the --study/--where selection right?)")
    if metric == COMPLETE_METRIC:
        raise UserError(f"metric {COMPLETE_METRIC!r} is a marker, not a result; pick another --metric")
    rows = current_labels(df[df["metric"] == metric])
    if len(rows) == 0:
        present = sorted(set(df["metric"]) - {COMPLETE_METRIC})
        raise UserError(f"--metric {metric!r} has no rows; metrics present: {', '.join(present) or 'none'}")
    if step == "final":
        final = rows.groupby(["study", "train_key"], dropna=False)["step"].transform("max")
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
    """(all configuration columns present, the ones that vary = the label columns). ``plugin_sha256`` counts only
    where one attention variant has rows of two versions of its plugin (else the variant's name says it)."""
    columns = [c for c in CONFIG_COLUMNS if c in rows.columns]
    # a study without stages: its lineage columns are null throughout and say nothing
    columns = [c for c in columns if c not in LINEAGE_COLUMNS or rows[c].notna().any()]
    if "plugin_sha256" in columns and (rows.groupby("attention", dropna=False)["plugin_sha256"]
                                       .nunique(dropna=False) <= 1).all():
        columns.remove("plugin_sha256")
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
    keys = [out[c].tolist() for c in [*group_columns, "eval_len"]]
    order = sorted(range(len(out)), key=lambda i: tuple(_sort_key(values[i]) for values in keys))
    return out.iloc[order].reset_index(drop=True)


def _train_len(rows: pd.DataFrame) -> int | None:
    if "train_len" in rows.columns and rows["train_len"].nunique() == 1:
        return int(rows["train_len"].iloc[0])
    return None


# ---------------------------------------------------------------------------------------- table
def _same(column: pd.Series, value) -> pd.Series:
    """Rows of ``column`` equal to ``value`` (null matches null)."""
    return column.isna() if _sort_key(value)[0] == 0 else column == value
