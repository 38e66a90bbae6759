"""Extrapolation curves (the paper's Figure 1, metric against evaluation length) and Figure 2 (against p):
PNG and a self-contained HTML page (``attnlab results curves``). Imports matplotlib only when drawing.

Pure: no Ray, no store access, no network.
"""

from __future__ import annotations

import base64
import html
import io
import textwrap

import numpy as np
import pandas as pd

from attnlab.errors import UserError
from attnlab.names import is_missing
import attnlab.results.stats as _stats_mod
from attnlab.results.schema import metric_bounds
from attnlab.results.reports.rows import SINGLE_RUN, _sort_key, aggregate, format_value, length_label, select
from attnlab.results.reports.table import _format_cell, caption, formatted_cells, table


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


def _plot_by_length(axes, result: pd.DataFrame, bounds, digits: int):
    """One line per configuration against the evaluation length (log2 axis, the training length marked, each tick
    with its multiple). Returns ``(single_runs, header, body)``: whether a point has one seed, and the table."""
    single_runs = False
    train_len = result.attrs.get("train_len")
    seed_values = result.attrs.get("seed_values") or {}
    label_columns = result.attrs["label_columns"]
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
    return single_runs, header, body


def _plot_by_p(axes, rows: pd.DataFrame, result: pd.DataFrame, metric: str, bounds, digits: int):
    """One line per configuration and evaluation length against the sharpening power (p_eval none reads "as
    trained"). Returns ``(single_runs, header, body, p_column)``."""
    single_runs = False
    train_len = result.attrs.get("train_len")
    label_columns = result.attrs["label_columns"]
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
    return single_runs, header, body, p_column


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
    bounds = metric_bounds(metric)
    figure = Figure(figsize=(9, 5.5), dpi=100)
    FigureCanvasAgg(figure)  # a renderer to measure the titles with (they are wrapped to the figure's width)
    axes = figure.add_subplot(1, 1, 1)

    if by == "length":
        single_runs, header, body = _plot_by_length(axes, result, bounds, digits)
        p_column = None
    else:
        single_runs, header, body, p_column = _plot_by_p(axes, rows, result, metric, bounds, digits)

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
