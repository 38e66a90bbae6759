"""Rankings: configurations ordered by a metric at one evaluation length (``attnlab results best``).

Pure: no Ray, no store access, no network.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from attnlab.errors import UserError
from attnlab.names import parse_at
from attnlab.results.schema import METRICS
from attnlab.results.reports.rows import (
    CONFIDENCE, SINGLE_RUN, _config_columns, _constants, aggregate, format_value, select,
)
from attnlab.results.reports.table import _format_cell, _markdown


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
