"""Versioned writes: every writer writes its own files (no lock, no shared index). A write's key names its stem;
its rows go to their run's folder under a new version (after any version of the key the folder holds), and the
writer then deletes the older versions it listed, so the newest version of a ``(stem, run)`` is the one read."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from attnlab.errors import UserError
from attnlab.results.layout import _WRITTEN_NAME, _new_version, _Written, key_stem, run_folder
from attnlab.results.schema import rows_to_table


class _Writes:
    """Writing rows (a mixin of ResultsStore)."""

    def write(self, rows, key: str | tuple) -> str:
        """Validate ``rows`` (a list of dicts or a pandas DataFrame) and write them as a new version of ``key``.

        All rows must belong to one study. Writing again with the same ``key`` in the same study replaces its rows
        (a retry never duplicates), compacted or not. Rows of several runs (``train_key``) are written to each
        run's folder, one file per run; writing the key again replaces the rows of the runs it writes. Rows may
        still name ``train_key`` by its old name ``config_hash``. Returns the path of the file written (of the
        first run's, for several).
        """
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
        self._ensure_marker(study, new_write=True)
        keys = table.column("train_key")
        runs = list(dict.fromkeys(keys.to_pylist()))
        paths = []
        for train_key in runs:
            part = table if len(runs) == 1 else table.filter(pc.equal(keys, train_key))
            paths.append(self._write_version(study, train_key, stem, part))
        return paths[0]

    def _write_version(self, study: str, train_key: str, stem: str, table: pa.Table) -> str:
        folder = f"{self.study_dir(study)}/{run_folder(train_key)}"
        older = [w for w in (self._written_in(folder)) if w.stem == stem]
        version = _new_version(max((w.version for w in older), default=None))
        path = f"{folder}/{stem}.v{version}.parquet"
        # read whole, never pruned: no statistics, no dictionaries (20% cheaper to read, a quarter smaller)
        self._put_table(path, table, use_dictionary=False, write_statistics=False)
        for w in older:  # readers already prefer the new version; this only keeps one file per key
            self._delete(w.path)
        return path

    def _written_in(self, folder: str) -> list[_Written]:
        out = []
        for info in self._list(folder, recursive=False):
            match = _WRITTEN_NAME.match(info.base_name)
            if info.type == pafs.FileType.File and match:
                out.append(_Written(info.path, info.size, folder.rsplit("/", 1)[-1], match["stem"],
                                    match["version"]))
        return out

    @staticmethod
    def _records(rows) -> list[dict]:
        if hasattr(rows, "to_dict") and hasattr(rows, "columns"):  # pandas DataFrame
            return rows.to_dict("records")
        if isinstance(rows, Mapping):
            raise UserError("results rows must be a list of dicts or a DataFrame, got a single dict")
        if not isinstance(rows, Iterable):
            raise UserError(f"results rows must be a list of dicts or a DataFrame, got {type(rows).__name__}")
        return list(rows)
