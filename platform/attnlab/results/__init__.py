"""The results store (Parquet files of long-format rows, kept per training run) and the reports read from it.

Public API:
- ``ResultsStore(uri)``: ``write(rows, key)``, ``read(study=None, **filters)``,
  ``stored_eval_keys(study, train_key)``, ``studies()``, ``compact(study)`` (returning a ``Compaction``),
  ``signature(study)`` and ``read_since(study, previous)`` (a ``StudyRows``: a refreshing reader's rows, re-read
  only where files changed);
  ``key_stem(key)``: the name a write key gives its files.
- ``reports``: ``table`` / ``to_markdown`` / ``to_csv``, ``curves``, ``best``, ``compare`` (also here as
  ``attnlab.results.compare``, returning a ``Comparison``), ``export``, ``format_reference_table``.
- ``stats``: the small-sample statistics the reports use (Student t cell interval, Welch + permutation test).
- ``schema``: the columns (``STORED_NAMES``; ``INPUT_ALIASES``: the old names a row may still be written or filtered with),
  ``SCHEMA_VERSION``, the metric registry (``register_metric``).

Importable without Ray (nothing here imports it); matplotlib is imported only when plotting.
"""

from attnlab.results.reports import Comparison, compare
from attnlab.results.schema import (
    COMPLETE_METRIC,
    CONFIG_COLUMNS,
    INPUT_ALIASES,
    LAW_METRIC,
    METRICS,
    SCHEMA_VERSION,
    STORED_NAMES,
    describe_schema,
    register_metric,
    validate_row,
)
from attnlab.results.store import Compaction, ResultsStore, StudyRows, key_stem

__all__ = [
    "COMPLETE_METRIC",
    "Comparison",
    "CONFIG_COLUMNS",
    "INPUT_ALIASES",
    "LAW_METRIC",
    "METRICS",
    "SCHEMA_VERSION",
    "STORED_NAMES",
    "ResultsStore",
    "StudyRows",
    "Compaction",
    "compare",
    "describe_schema",
    "key_stem",
    "register_metric",
    "validate_row",
]
