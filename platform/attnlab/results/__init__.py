"""The results store (immutable Parquet files of long-format rows) and the reports read from it.

Public API:
- ``ResultsStore(uri)``: ``write(rows, key)``, ``read(study=None, **filters)``,
  ``stored_eval_keys(study, config_hash)``, ``studies()``.
- ``reports``: ``table`` / ``to_markdown`` / ``to_csv``, ``curves``, ``best``, ``compare`` (also here as
  ``attnlab.results.compare``, returning a ``Comparison``), ``export``, ``format_reference_table``.
- ``stats``: the small-sample statistics the reports use (Student t cell interval, Welch + permutation test).
- ``schema``: the columns, ``SCHEMA_VERSION``, the metric registry (``register_metric``).

Importable without Ray (nothing here imports it); matplotlib is imported only when plotting.
"""

from attnlab.results.reports import Comparison, compare
from attnlab.results.schema import (
    COLUMN_NAMES,
    COMPLETE_METRIC,
    CONFIG_COLUMNS,
    LAW_METRIC,
    METRICS,
    SCHEMA_VERSION,
    describe_schema,
    register_metric,
    validate_row,
)
from attnlab.results.store import ResultsStore, file_name_for_key

__all__ = [
    "COLUMN_NAMES",
    "COMPLETE_METRIC",
    "Comparison",
    "CONFIG_COLUMNS",
    "LAW_METRIC",
    "METRICS",
    "SCHEMA_VERSION",
    "ResultsStore",
    "compare",
    "describe_schema",
    "file_name_for_key",
    "register_metric",
    "validate_row",
]
