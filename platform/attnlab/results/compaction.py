"""The compactor (``attnlab results compact``): a study's files merged into one compacted file, each run's index of
what it took, then exactly the merged files deleted. Every step leaves a store that reads every row once; a crash
leaves a readable store and running compaction again completes it.

It never deletes a file it did not list and merge, so writes made meanwhile stay. The crash tests stop it at each
step through the seam :func:`attnlab.faults.compaction_step`. The steps and why each is safe:
docs/results-store.md#compaction."""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass

import pyarrow as pa

import attnlab.faults as faults
from attnlab.results.layout import COMPACTED_SCHEMA, VERSION_COLUMN, WRITE_COLUMN, Layout, check_study, new_version
from attnlab.results.legacy import LegacyReader
from attnlab.results.plan import Planner, resolve
from attnlab.results.reads import Reader
from attnlab.results.schema import STORED_NAMES

_COMPACTED_ROW_GROUP = 16_384


@dataclass(frozen=True)
class Compaction:
    """What :meth:`ResultsStore.compact` did to one study."""

    study: str
    merged: int  # files merged: written, layout-1 and earlier compacted files
    rows: int  # rows in the new compacted file
    compacted: str | None  # its path (None: there was nothing to merge)
    removed: int  # files deleted (merged files, superseded indexes, leftovers of dead writes)

    def describe(self) -> str:
        if self.compacted is None:
            return f"study {self.study}: " + (f"already compact ({self.rows} rows in one file)" if self.rows else
                                              "nothing to compact")
        return (f"study {self.study}: merged {self.merged} files into {self.compacted} ({self.rows} rows), "
                f"removed {self.removed} files")


class Compactor:
    """Compacting a study of the store of ``layout``: listed by it, planned by ``planner``, read by ``reader``, and
    marked free of layout-1 files by ``legacy``."""

    def __init__(self, layout: Layout, planner: Planner, reader: Reader, legacy: LegacyReader):
        self._layout, self._planner, self._reader, self._legacy = layout, planner, reader, legacy

    def _each(self, function, items: list, step: int) -> list:
        """``function`` over ``items`` (:meth:`Layout.each`), the crash seam called after each item of ``step``."""
        return self._layout.each(function, items, done=lambda n: faults.compaction_step(step, n))

    def compact(self, study: str) -> Compaction:
        """Steps (before each numbered step it calls :func:`attnlab.faults.compaction_step`, for the tests):

        1. list the study (written files, layout-1 files, indexes; then compacted files);
        2. read the newest version of every write, once (with its write and version);
        3. write them as ``_compacted/<id>.parquet`` (sorted by run; a local temporary renamed into place);
        4. write each run's index ``train_key=<key>/_compacted.<id>.json`` (its writes, versions, cell keys);
        5. delete the written and layout-1 files listed in 1 (and temporary files of writes dead for an hour);
        6. delete the indexes listed in 1;
        7. delete the compacted files listed in 1;
        8. mark the study as free of layout-1 files (``_layout.json``), when it is.

        Files written while it runs are not listed, so not deleted: a newer version of a key it merged stays
        newer and wins. Readers see every row once at every point; after a crash the store reads whole and
        running ``compact`` again finishes the job. Two compactions at once are safe (each deletes only what it
        merged; a write held twice is read once).
        """
        check_study(study)
        return self._layout.retrying(f"compacting study {study!r}", lambda: self._compact_once(study))

    def _compact_once(self, study: str) -> Compaction:
        faults.compaction_step(1)
        listing = self._layout.list_study(study)
        faults.compaction_step(2)
        if not listing.written and not listing.layout_1 and (
                (not listing.compacted and not listing.indexes) or
                (len(listing.compacted) == 1 and all(i.name == listing.compacted[0].name for i in listing.indexes))):
            for path in listing.stale:
                self._layout.delete(path)
            self._legacy.mark_if_free(study)
            rows = 0
            if listing.compacted:
                rows = self._layout.num_rows(listing.compacted[0].path)
            return Compaction(study, 0, rows, None, len(listing.stale))
        plan = resolve(listing, self._planner.compacted_writes(listing.compacted))
        table = self._reader.read_plan(plan, list(STORED_NAMES), {}, versions=True)
        table = table.sort_by([("train_key", "ascending"), (WRITE_COLUMN, "ascending")])
        table = pa.Table.from_arrays([table.column(f.name) for f in COMPACTED_SCHEMA],
                                     schema=COMPACTED_SCHEMA)
        compaction_id = new_version(max((c.name for c in listing.compacted), default=None))
        target = self._layout.compacted_path(study, f"{compaction_id}.parquet")
        faults.compaction_step(3)
        size = self._layout.put_table(target, table, before_rename=lambda: faults.compaction_step(3, 1),
                               row_group_size=_COMPACTED_ROW_GROUP)
        faults.compaction_step(4)
        indexes = self._index_documents(table, f"{compaction_id}.parquet", size)
        self._each(lambda item: self._layout.put(self._layout.index_path(study, item[0], compaction_id), item[1]),
                   sorted(indexes.items()), step=4)
        faults.compaction_step(5)
        merged = [f.path for f in listing.written] + [f.path for f in listing.layout_1] + listing.stale
        removed = sum(self._each(self._layout.delete, merged, step=5))
        faults.compaction_step(6)
        removed += sum(self._each(self._layout.delete, [f.path for f in listing.indexes], step=6))
        faults.compaction_step(7)
        removed += sum(self._each(self._layout.delete, [f.path for f in listing.compacted], step=7))
        faults.compaction_step(8)
        self._legacy.mark_if_free(study)
        merged_count = len(listing.written) + len(listing.layout_1) + len(listing.compacted)
        return Compaction(study, merged_count, table.num_rows, target, removed)

    @staticmethod
    def _index_documents(table: pa.Table, compacted_name: str, size: int) -> dict[str, bytes]:
        """Per run folder, the JSON index of the compacted file: ``writes`` = [train_key, stem, version, cell
        keys] of each write of the run it holds."""
        groups = table.group_by(["train_key", WRITE_COLUMN, VERSION_COLUMN], use_threads=False).aggregate(
            [("eval_key", "distinct")])
        folders: dict[str, list] = {}
        for key, write, version, keys in zip(groups.column("train_key").to_pylist(),
                                             groups.column(WRITE_COLUMN).to_pylist(),
                                             groups.column(VERSION_COLUMN).to_pylist(),
                                             groups.column("eval_key_distinct").to_pylist()):
            stem, folder = write.split("/", 1)
            folders.setdefault(folder, []).append([key, stem, version, sorted(k for k in keys if k)])
        created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        return {folder: (json.dumps({"compacted": compacted_name, "size": size, "created": created,
                                     "writes": writes}, separators=(",", ":")) + "\n").encode()
                for folder, writes in folders.items()}
