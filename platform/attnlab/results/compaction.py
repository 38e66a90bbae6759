"""Compaction (``attnlab results compact``): a study's files merged into one compacted file, each run's index of
what it took, then exactly the merged files deleted. Every step leaves a store that reads every row once; a crash
leaves a readable store and running compaction again completes it.

The tests kill a compaction at each step through :func:`attnlab.faults.compaction_step`, the seam called at every
step (and after each item of a step)."""

from __future__ import annotations

import concurrent.futures
import datetime as _dt
import json
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

import attnlab.faults as faults
from attnlab.results.layout import (
    _COMPACTED_DIR,
    _COMPACTED_SCHEMA,
    _REMOTE_THREADS,
    VERSION_COLUMN,
    WRITE_COLUMN,
    _new_version,
    check_study,
)
from attnlab.results.plan import _resolve
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


class _Compaction:
    """Compacting a study (a mixin of ResultsStore)."""

    def _each(self, function: Callable, items: list, step: int | None = None) -> list:
        """``function`` over ``items``: in order on a local disk, on threads on object storage (each item is a
        request or three). ``step``: a compaction step (its crash points count the items done)."""
        if self._local or len(items) < 2:
            out = []
            for i, item in enumerate(items):
                out.append(function(item))
                if step is not None:
                    faults.compaction_step(step, i + 1)
            return out
        done = [0]

        def counted(item):
            result = function(item)
            if step is not None:
                done[0] += 1
                faults.compaction_step(step, done[0])
            return result

        with concurrent.futures.ThreadPoolExecutor(_REMOTE_THREADS) as pool:
            return list(pool.map(counted, items))

    def compact(self, study: str) -> Compaction:
        """Merge a study's files into one compacted file; returns what was done.

        Steps (before each numbered step it calls :func:`attnlab.faults.compaction_step`, for the tests):

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
        return self._retrying(f"compacting study {study!r}", lambda: self._compact_once(study))

    def _compact_once(self, study: str) -> Compaction:
        faults.compaction_step(1)
        listing = self._list_study(study)
        faults.compaction_step(2)
        if not listing.written and not listing.layout_1 and (
                (not listing.compacted and not listing.indexes) or
                (len(listing.compacted) == 1 and all(i.name == listing.compacted[0].name for i in listing.indexes))):
            for path in listing.stale:
                self._delete(path)
            self._mark_if_free(study)
            rows = 0
            if listing.compacted:
                rows = pq.read_metadata(listing.compacted[0].path, filesystem=self.filesystem).num_rows
            return Compaction(study, 0, rows, None, len(listing.stale))
        plan = _resolve(listing, self._compacted_writes(listing.compacted))
        table = self._read_plan(plan, list(STORED_NAMES), {}, versions=True)
        table = table.sort_by([("train_key", "ascending"), (WRITE_COLUMN, "ascending")])
        table = pa.Table.from_arrays([table.column(f.name) for f in _COMPACTED_SCHEMA],
                                     schema=_COMPACTED_SCHEMA)
        compaction_id = _new_version(max((c.name for c in listing.compacted), default=None))
        target = f"{self.study_dir(study)}/{_COMPACTED_DIR}/{compaction_id}.parquet"
        faults.compaction_step(3)
        size = self._put_table(target, table, before_rename=lambda: faults.compaction_step(3, 1),
                               row_group_size=_COMPACTED_ROW_GROUP)
        faults.compaction_step(4)
        indexes = self._index_documents(table, f"{compaction_id}.parquet", size)
        self._each(lambda item: self._put(f"{self.study_dir(study)}/{item[0]}/_compacted.{compaction_id}.json",
                                          item[1]), sorted(indexes.items()), step=4)
        faults.compaction_step(5)
        merged = [f.path for f in listing.written] + [f.path for f in listing.layout_1] + listing.stale
        removed = sum(self._each(self._delete, merged, step=5))
        faults.compaction_step(6)
        removed += sum(self._each(self._delete, [f.path for f in listing.indexes], step=6))
        faults.compaction_step(7)
        removed += sum(self._each(self._delete, [f.path for f in listing.compacted], step=7))
        faults.compaction_step(8)
        self._mark_if_free(study)
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
