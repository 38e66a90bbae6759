"""The orbit study's recovered force laws, one row per trial (``attnlab results laws``).

Pure: no Ray, no store access, no network.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from attnlab.errors import UserError
from attnlab.names import is_missing
from attnlab.results.reports.rows import MISSING_CELL, _sort_key, format_value, select
from attnlab.results.reports.table import _markdown, _number
from attnlab.results.schema import LAW_METRIC


# ---------------------------------------------------------------------------------------- curves
# ---------------------------------------------------------------------------------------- recovered laws
# (column, metric): what `attnlab results laws` shows of each trial's force probe, in this order.
LAW_COLUMNS = (("exp_r", "force_exp_r"), ("exp_m1", "force_exp_m1"), ("exp_m2", "force_exp_m2"),
               ("newton_dist", LAW_METRIC), ("newton", "force_is_newton"), ("sr_err", "force_sr_err"),
               ("probe_err", "force_probe_err"), ("probe_r2", "force_probe_r2"), ("pl_exp_r", "force_pl_exp_r"),
               ("pl_exp_m1", "force_pl_exp_m1"), ("pl_exp_m2", "force_pl_exp_m2"))


LAW_KEYS = ("attention", "scale", "p_train", "knobs", "seed", "window_mode", "train_key")


def laws(df: pd.DataFrame, step="final") -> pd.DataFrame:
    """One row per training run and force probe: ``attention, scale, p_train, knobs, seed, probe`` (finetune or linear),
    ``expression`` (the recovered law, in r, m1, m2), then :data:`LAW_COLUMNS` (``newton``: 1 when the law is
    Newton's within the probe's tolerance). Sorted by attention, p_train, seed."""
    rows = select(df, LAW_METRIC, step)
    if len(rows) == 0:
        raise UserError("no force-probe rows: evaluate an orbit model with eval.force_probe (studies/orbits.yaml)")
    # every force metric of each probe, keyed like the law rows (which ``select`` already put at the right step)
    probes = df[df["window_mode"].astype(str).str.startswith("force_")]
    keys = ["study", "train_key", "window_mode", "step"]
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
    shown = [c for c in result.columns if c != "train_key"]
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
