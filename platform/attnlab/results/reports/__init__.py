"""Reports over results rows: the paper's Table 4 layout, extrapolation curves, rankings, comparisons, force laws,
export; this package is their public surface (``from attnlab.results import reports; reports.table(...)``).

Owns how rows become reports, one module per job: :mod:`.rows` (the shared rules: which rows, what a
configuration is, how a cell aggregates its runs), :mod:`.table` (Table 4 layout), :mod:`.reference` (the paper's
Table 4), :mod:`.best` (rankings), :mod:`.compare` (two configurations, or a family, tested), :mod:`.laws` (the
orbit study's force laws), :mod:`.figures` (curves) and :mod:`.export`. The statistics themselves are
:mod:`attnlab.results.stats`'s.

Every function takes a pandas DataFrame of results rows (``ResultsStore.read``) and returns frames, text or files
written where the caller says. Reports must never import Ray, read a store or touch the network (the HTML page
embeds its PNG), and never drop a diverged run's NaN or report the ``complete`` marker rows.

Details: docs/protocol.md#reports-and-statistics.
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
