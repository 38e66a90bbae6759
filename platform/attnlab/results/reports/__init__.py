"""Reports over results rows: the paper's Table 4 layout, extrapolation curves, rankings, comparisons, export.

One module per job: :mod:`.rows` (selection and aggregation, the rules below), :mod:`.table` (Table 4 layout),
:mod:`.reference` (the paper's Table 4), :mod:`.best` (rankings), :mod:`.compare` (two configurations, tested),
:mod:`.laws` (the orbit study's force laws), :mod:`.figures` (curves) and :mod:`.export`; this package is their
public surface (``from attnlab.results import reports; reports.table(...)``).

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
  permutation test; when the two sides have the same seeds, the paired t and the exact sign-flip test:
  :mod:`attnlab.results.stats`), gives the smallest difference the design detects with 80% power, and says
  plainly when it is not significant or when n < 2 leaves nothing to test; :func:`compare_family` tests several
  as one family, with Holm's correction.

Reports never import Ray, never read a store and never touch the network; they take rows and return
frames, text or files written where the caller says.
"""

from attnlab.results.reports.best import best, best_to_csv, best_to_markdown
from attnlab.results.reports.compare import (Comparison, compare, compare_family, format_comparison, format_family,
                                             read_pairs)
from attnlab.results.reports.export import export
from attnlab.results.reports.figures import curve_figure, curves, metric_axis_label
from attnlab.results.reports.laws import LAW_COLUMNS, LAW_KEYS, laws, laws_to_csv, laws_to_markdown
from attnlab.results.reports.reference import PAPER_TABLE4, PAPER_TABLE4_LENGTHS, format_reference_table, reference_table
from attnlab.results.reports.rows import (
    CONFIDENCE, MISSING_CELL, SINGLE_RUN, aggregate, format_value, length_label, select,
)
from attnlab.results.reports.table import CAP_MARK, caption, formatted_cells, table, to_csv, to_markdown

__all__ = [
    "CAP_MARK", "CONFIDENCE", "Comparison", "LAW_COLUMNS", "LAW_KEYS", "MISSING_CELL", "PAPER_TABLE4",
    "PAPER_TABLE4_LENGTHS", "SINGLE_RUN", "aggregate", "best", "best_to_csv", "best_to_markdown", "caption",
    "compare", "compare_family", "curve_figure", "curves", "export", "format_comparison", "format_family", "format_reference_table", "format_value",
    "formatted_cells", "laws", "laws_to_csv", "laws_to_markdown", "length_label", "metric_axis_label",
    "read_pairs", "reference_table", "select", "table", "to_csv", "to_markdown",
]
