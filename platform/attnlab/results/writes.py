"""The writer: every writer writes its own files (no lock, no shared index). A write's key names its stem; its rows
go to their run's folder under a new version (after any version of the key the folder holds), and the writer then
deletes the older versions it listed, so the newest version of a ``(stem, run)`` is the one read.

It never deletes anything but older versions of the key it writes, and never writes to a layout-1 file
(docs/results-store.md#writing)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import pyarrow as pa
import pyarrow.compute as pc

from attnlab.errors import UserError
from attnlab.results.layout import Layout, key_stem, new_version
from attnlab.results.legacy import LegacyReader
from attnlab.results.schema import rows_to_table


class Writer:
    """Writing rows to the store of ``layout`` (``legacy``: the marker a first write leaves in a new study)."""

    def __init__(self, layout: Layout, legacy: LegacyReader):
        self._layout, self._legacy = layout, legacy

    def write(self, rows, key: str | tuple) -> str:
        records = self._records(rows)
        if not records:
            raise UserError(f"results write for key {key!r}: no rows to write")
        table = rows_to_table(records)
        studies = sorted(set(table.column("study").to_pylist()))
        if len(studies) != 1:
            raise UserError(
                f"results write for key {key!r}: rows of one write must share one study, got {studies}"
            )
        study, stem = studies[0], key_stem(key)
        self._legacy.marked(study, new_write=True)
        keys = table.column("train_key")
        runs = list(dict.fromkeys(keys.to_pylist()))
        paths = []
        for train_key in runs:
            part = table if len(runs) == 1 else table.filter(pc.equal(keys, train_key))
            paths.append(self._write_version(study, train_key, stem, part))
        return paths[0]

    def _write_version(self, study: str, train_key: str, stem: str, table: pa.Table) -> str:
        older = [w for w in self._layout.list_run(study, train_key).written if w.stem == stem]
        version = new_version(max((w.version for w in older), default=None))
        path = self._layout.written_path(study, train_key, stem, version)
        # read whole, never pruned: no statistics, no dictionaries (20% cheaper to read, a quarter smaller)
        self._layout.put_table(path, table, use_dictionary=False, write_statistics=False)
        for w in older:  # readers already prefer the new version; this only keeps one file per key
            self._layout.delete(w.path)
        return path

    @staticmethod
    def _records(rows) -> list[dict]:
        if hasattr(rows, "to_dict") and hasattr(rows, "columns"):  # pandas DataFrame
            return rows.to_dict("records")
        if isinstance(rows, Mapping):
            raise UserError("results rows must be a list of dicts or a DataFrame, got a single dict")
        if not isinstance(rows, Iterable):
            raise UserError(f"results rows must be a list of dicts or a DataFrame, got {type(rows).__name__}")
        return list(rows)
