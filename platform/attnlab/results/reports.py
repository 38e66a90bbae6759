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
  mean, **sample** standard deviation (ddof=1; none when n = 1) and n. NaN values (diverged runs)
  are kept, so a diverged seed makes the mean NaN rather than silently vanishing.
"""

from __future__ import annotations

import base64
import html
import io
import math
import os

import numpy as np
import pandas as pd

from attnlab.errors import UserError
from attnlab.names import is_missing, parse_at  # noqa: F401 - parse_at is part of this module's API
from attnlab.results.schema import COMPLETE_METRIC, CONFIG_COLUMNS, METRICS

MISSING_CELL = "–"

# SPEC.md section 8: the paper's Table 4 (validation loss, GPT-2 124M trained at 1K, FineWeb).
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
        if c in ("layer", "bucket", "preset", "data", "knobs") and is_missing(value):
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


def _stats(values: np.ndarray) -> tuple[float, float, int]:
    values = np.asarray(values, dtype=float)
    n = len(values)
    mean = float(np.mean(values))
    std = float(np.std(values, ddof=1)) if n > 1 else float("nan")
    return mean, std, n


def aggregate(rows: pd.DataFrame, group_columns: list[str]) -> pd.DataFrame:
    """Long statistics: one row per (group, eval_len) with mean, std (ddof=1), n, sorted."""
    records = []
    for keys, group in rows.groupby([*group_columns, "eval_len"], dropna=False, sort=False):
        keys = keys if isinstance(keys, tuple) else (keys,)
        mean, std, n = _stats(group["value"].to_numpy())
        record = dict(zip([*group_columns, "eval_len"], keys))
        record.update(mean=mean, std=std, n=n)
        records.append(record)
    out = pd.DataFrame.from_records(records, columns=[*group_columns, "eval_len", "mean", "std", "n"])
    order = sorted(range(len(out)), key=lambda i: tuple(_sort_key(out.iloc[i][c]) for c in [*group_columns, "eval_len"]))
    return out.iloc[order].reset_index(drop=True)


def _train_len(rows: pd.DataFrame) -> int | None:
    if "train_len" in rows.columns and rows["train_len"].nunique() == 1:
        return int(rows["train_len"].iloc[0])
    return None


# ---------------------------------------------------------------------------------------- table
def table(df: pd.DataFrame, metric: str = "val_loss", step="final", lengths: list[int] | None = None) -> pd.DataFrame:
    """The paper's Table 4 layout: one row per configuration, one column group per eval length.

    Returns a DataFrame whose columns are the label columns (configuration columns that vary), then
    ``mean@L``, ``std@L``, ``n@L`` for each eval length ``L`` ascending (std is NaN when n = 1, cells
    with no rows are NaN with n = 0). ``attrs`` carries ``metric``, ``lengths``, ``label_columns``,
    ``constants`` (the dropped constant columns and their value), ``train_len`` and ``step``.
    """
    rows = select(df, metric, step)
    columns, label_columns = _config_columns(rows)
    constants = _constants(rows, columns, label_columns)
    stats = aggregate(rows, label_columns)
    all_lengths = sorted(int(x) for x in stats["eval_len"].unique())
    lengths = all_lengths if lengths is None else sorted(int(x) for x in lengths)
    configs = stats[label_columns].drop_duplicates().reset_index(drop=True)
    result = configs.copy()
    for length in lengths:
        means, stds, ns = [], [], []
        at_length = stats[stats["eval_len"] == length]
        for i in range(len(configs)):
            match = at_length
            for c in label_columns:
                value = configs.iloc[i][c]
                if _sort_key(value)[0] == 0:
                    match = match[match[c].isna()]
                else:
                    match = match[match[c] == value]
            if len(match):
                means.append(float(match["mean"].iloc[0]))
                stds.append(float(match["std"].iloc[0]))
                ns.append(int(match["n"].iloc[0]))
            else:
                means.append(float("nan"))
                stds.append(float("nan"))
                ns.append(0)
        result[f"mean@{length}"] = means
        result[f"std@{length}"] = stds
        result[f"n@{length}"] = ns
    result.attrs.update(
        metric=metric, lengths=lengths, label_columns=label_columns, constants=constants,
        train_len=_train_len(rows), step=step,
    )
    return result


def _format_cell(mean: float, std: float, n: int, digits: int) -> str:
    if n == 0:
        return MISSING_CELL
    text = "nan" if math.isnan(mean) else f"{mean:.{digits}f}"
    if n > 1:
        spread = "nan" if math.isnan(std) else f"{std:.{digits}f}"
        text += f" ± {spread} (n={n})"
    return text


def _length_headers(lengths: list[int], train_len: int | None) -> list[str]:
    if train_len:
        return [f"{length_label(L)} ({L / train_len:g}x)" for L in lengths]
    return [length_label(L) for L in lengths]


def caption(result: pd.DataFrame) -> str:
    """One line: metric, step selection and the constant configuration columns."""
    attrs = result.attrs
    step = attrs.get("step", "final")
    step_text = "final step of each trial" if step == "final" else ("all steps" if step in ("all", None) else f"step {step}")
    parts = [f"{attrs.get('metric', 'value')} ({step_text}; mean ± sample std over seeds when n > 1)"]
    constants = attrs.get("constants") or {}
    if constants:
        parts.append("constant: " + ", ".join(f"{k}={format_value(v)}" for k, v in constants.items()))
    return "; ".join(parts)


def formatted_cells(result: pd.DataFrame, digits: int = 4) -> tuple[list[str], list[list[str]]]:
    """(header, body) of a table() result as display strings."""
    label_columns = result.attrs["label_columns"]
    lengths = result.attrs["lengths"]
    header = [*label_columns, *_length_headers(lengths, result.attrs.get("train_len"))]
    body = []
    for i in range(len(result)):
        row = result.iloc[i]
        cells = [format_value(row[c]) for c in label_columns]
        cells += [_format_cell(row[f"mean@{L}"], row[f"std@{L}"], int(row[f"n@{L}"]), digits) for L in lengths]
        body.append(cells)
    return header, body


def _markdown(header: list[str], body: list[list[str]]) -> str:
    def esc(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(esc(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in cells) + " |" for cells in body]
    return "\n".join(lines)


def to_markdown(result: pd.DataFrame, digits: int = 4, with_caption: bool = True) -> str:
    """A table() result as a markdown table (cells "mean ± std (n=k)", "–" where nothing was measured)."""
    header, body = formatted_cells(result, digits)
    text = _markdown(header, body)
    return (caption(result) + "\n\n" + text) if with_caption else text


def to_csv(result: pd.DataFrame) -> str:
    """A table() result as CSV with numeric columns (label columns, then mean@L, std@L, n@L)."""
    return result.to_csv(index=False, lineterminator="\n")


# ---------------------------------------------------------------------------------------- reference
def reference_table() -> pd.DataFrame:
    """SPEC.md section 8 (the paper's Table 4) as a DataFrame: attention, p, loss@1024..8192."""
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
def best(df: pd.DataFrame, at, metric: str = "val_loss", step="final") -> pd.DataFrame:
    """Rank configurations by ``metric`` at one eval length (``at``: ``16384``, ``"16k"`` or ``"16x"``).

    Lower is better unless the metric is registered as higher-is-better (accuracies). NaN ranks last.
    Returns columns: rank (1 = best), the label columns, eval_len, mean, std, n.
    """
    rows = select(df, metric, step)
    kind, amount = parse_at(at)
    if kind == "length":
        picked = rows[rows["eval_len"] == amount]
    else:
        picked = rows[np.isclose(rows["eval_len"].to_numpy(float), amount * rows["train_len"].to_numpy(float))]
    if len(picked) == 0:
        available = ", ".join(str(int(x)) for x in sorted(rows["eval_len"].unique()))
        raise UserError(f"--at {at!r}: no {metric!r} rows at that length; eval lengths present: {available}")
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
                     str(int(row["eval_len"])), _format_cell(row["mean"], row["std"], int(row["n"]), digits)])
    direction = "higher is better" if ranking.attrs.get("higher_is_better") else "lower is better"
    return f"ranking at {ranking.attrs.get('at')} ({direction})\n\n" + _markdown(header, body)


# ---------------------------------------------------------------------------------------- curves
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


def curves(df: pd.DataFrame, out_dir: str, metric: str = "val_loss", by: str = "length", step="final",
           digits: int = 4) -> dict[str, str]:
    """Plot ``metric`` against eval length (log2 x axis, one line per configuration; the paper's
    Figure 1) or, with ``by="p"``, against the sharpening power p (one line per eval length and
    configuration; its Figure 2). Error bars show the sample std when n > 1.

    Writes ``<metric>_vs_<by>.png`` and a self-contained ``<metric>_vs_<by>.html`` (the PNG inlined as
    base64 plus the numbers as a table) into ``out_dir``; returns ``{"png": path, "html": path}``.
    """
    if by not in ("length", "p"):
        raise UserError(f"--by {by!r}: allowed: length, p")
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    rows = select(df, metric, step)
    result = table(df, metric=metric, step=step)
    label_columns = result.attrs["label_columns"]
    figure = Figure(figsize=(8, 5), dpi=100)
    axes = figure.add_subplot(1, 1, 1)

    if by == "length":
        lengths = result.attrs["lengths"]
        for i in range(len(result)):
            row = result.iloc[i]
            n = np.array([row[f"n@{L}"] for L in lengths])
            xs = np.array(lengths, dtype=float)[n > 0]
            ys = np.array([row[f"mean@{L}"] for L in lengths])[n > 0]
            errs = np.nan_to_num(np.array([row[f"std@{L}"] for L in lengths])[n > 0])
            axes.errorbar(xs, ys, yerr=errs if errs.any() else None, marker="o", capsize=3,
                          label=_config_label(row, label_columns))
        axes.set_xscale("log", base=2)
        axes.set_xticks(lengths)
        axes.set_xticklabels([length_label(L) for L in lengths])
        axes.set_xlabel("evaluation length (tokens, log2 scale)")
        header, body = formatted_cells(result, digits)
    else:
        p_column = _p_column(rows)
        group_columns = [c for c in label_columns if c != p_column]
        stats = aggregate(rows, [*group_columns, p_column])
        p_values = sorted(stats[p_column].drop_duplicates().tolist(), key=_sort_key)
        positions = {format_value(p): i for i, p in enumerate(p_values)}
        line_columns = [*group_columns, "eval_len"]
        for _, line in stats.groupby(line_columns, dropna=False, sort=False):
            first = line.iloc[0]
            label = ", ".join([*(f"{c}={format_value(first[c])}" for c in group_columns),
                               f"L={length_label(first['eval_len'])}"])
            xs = [positions[format_value(p)] for p in line[p_column]]
            errs = np.nan_to_num(line["std"].to_numpy(float))
            axes.errorbar(xs, line["mean"].to_numpy(float), yerr=errs if errs.any() else None,
                          marker="o", capsize=3, label=label)
        axes.set_xticks(range(len(p_values)))
        axes.set_xticklabels([format_value(p) for p in p_values])
        axes.set_xlabel(f"{p_column} (sharpening power; none = no sharpening)")
        header = [*group_columns, p_column, "eval_len", metric]
        body = [[*(format_value(r[c]) for c in group_columns), format_value(r[p_column]), str(int(r["eval_len"])),
                 _format_cell(r["mean"], r["std"], int(r["n"]), digits)] for _, r in stats.iterrows()]

    axes.set_ylabel(metric)
    title = f"{metric} vs {'evaluation length' if by == 'length' else 'p'}"
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()

    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{metric}_vs_{by}")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    png_bytes = buffer.getvalue()
    with open(stem + ".png", "wb") as handle:
        handle.write(png_bytes)
    with open(stem + ".html", "w", encoding="utf-8") as handle:
        handle.write(_html_page(title, caption(result), png_bytes, header, body))
    return {"png": stem + ".png", "html": stem + ".html"}


# ---------------------------------------------------------------------------------------- export
def export(df: pd.DataFrame, path: str, format: str | None = None) -> str:
    """Write rows to ``path`` as Parquet or CSV (``format`` defaults to the file suffix). Returns path."""
    if format is None:
        format = "csv" if str(path).lower().endswith(".csv") else "parquet"
    if format not in ("parquet", "csv"):
        raise UserError(f"--format {format!r}: allowed: parquet, csv")
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    if format == "csv":
        df.to_csv(path, index=False)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pandas(df, preserve_index=False), path)
    return path
