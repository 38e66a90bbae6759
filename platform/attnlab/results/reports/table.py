"""The paper's Table 4 layout: configurations by evaluation length, cells formatted with their spread, the
caption stating what is constant, the step-cap marker, Markdown and CSV.

Pure: no Ray, no store access, no network.
"""

from __future__ import annotations

import math

import pandas as pd

from attnlab.names import is_missing
from attnlab.states import StopReason
import attnlab.results.stats as _stats_mod
from attnlab.results.schema import metric_bounds
from attnlab.results.reports.rows import (
    CONFIDENCE, MISSING_CELL, SINGLE_RUN, _config_columns, _constants, _same, _train_len, aggregate, format_value,
    length_label, select,
)


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
    # Each (configuration, length) cell's statistics row, found by its label values (null matching null).
    cell_rows: dict[tuple, dict] = {}
    for record in stats.to_dict("records"):
        cell_rows.setdefault((*(_cell_key(record[c]) for c in label_columns), record["eval_len"]), record)
    config_keys = [tuple(_cell_key(v) for v in values)
                   for values in zip(*(configs[c].tolist() for c in label_columns))] if label_columns else \
        [()] * len(configs)
    for length in lengths:
        cells = {name: [] for name in ("mean", "std", "n", "ci_low", "ci_high")}
        for i in range(len(configs)):
            first = cell_rows.get((*config_keys[i], length))
            if first is not None:
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


_NULL = object()  # every spelling of a missing label value, as one dictionary key


def _cell_key(value):
    return _NULL if is_missing(value) else value


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
    capped = rows[rows["stopped"].astype(object).eq(StopReason.CAP.value).fillna(False).astype(bool)]
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
    step_text = "final step of each run" if step == "final" else ("all steps" if step in ("all", None) else f"step {step}")
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
    plain = result.copy()
    plain.attrs = {}  # each row of a frame gets a deep copy of its attrs (every cell's seed values): rows of a copy
    for i in range(len(plain)):
        row = plain.iloc[i]
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
