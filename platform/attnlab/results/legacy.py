"""The legacy reader: layout 1, the store as schema 1-5 wrote it (one flat folder per study, files named by their
write key's stem, ``train_key`` still called ``config_hash``), and ``_layout.json``, the marker of a study that has
no layout-1 file left (so a run's reads need not look for them).

It reads layout-1 rows as today's rows and writes only the marker; it never writes or deletes a layout-1 file
(compaction merges them away). Details: docs/results-store.md#stores-written-before-schema-6."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc

from attnlab.results.filters import filter_expression
from attnlab.results.layout import VERSION_COLUMN, WRITE_COLUMN, File, Layout, run_folder
from attnlab.results.schema import ARROW_SCHEMA, INPUT_ALIASES

LAYOUT_1_VERSION = "0" * 17 + "-00000000"  # the version of every layout-1 file: older than any write
# Layout-1 files: train_key may be missing (schema 1-5 called it config_hash).
_LAYOUT_1_SCHEMA = pa.schema([f.with_nullable(True) if f.name == "train_key" else f for f in ARROW_SCHEMA]
                             + [pa.field(old, pa.string()) for old in INPUT_ALIASES])
_TRAIN_KEY = pc.coalesce(pc.field("train_key"), pc.field("config_hash"))  # what a train_key filter compares


class LegacyReader:
    """Layout-1 files and the marker of a study free of them, in the store of ``layout``."""

    def __init__(self, layout: Layout):
        self._layout = layout
        self._marked: set[str] = set()  # studies seen with their layout marker (it is never removed)

    def __getstate__(self):  # a pickled store (handed to Ray workers) checks the markers afresh
        return {**self.__dict__, "_marked": set()}

    def files(self, study: str) -> list[File]:
        return self._layout.list_layout_1(study)

    def marked(self, study: str, new_write: bool = False) -> bool:
        """Whether the study's layout marker is there (no layout-1 files); a write (``new_write``) creates it for a
        study without layout-1 files. Known markers are remembered (a marker is never removed)."""
        if study in self._marked:
            return True
        if self._layout.is_file(self._layout.marker_path(study)):
            self._marked.add(study)
            return True
        if not new_write:
            return False
        if self.files(study):
            return False
        self._write_marker(study)
        return True

    def mark_if_free(self, study: str) -> None:
        if not self.marked(study) and not self.files(study):
            self._write_marker(study)

    def _write_marker(self, study: str) -> None:
        self._layout.put(self._layout.marker_path(study),
                         json.dumps({"layout": 2, "layout_1_files": False}).encode() + b"\n")
        self._marked.add(study)

    def read(self, files: list[File], layout_2_writes: set[str], scanned: list[str], filters: dict,
             versions: bool) -> pa.Table:
        """The rows of layout-1 ``files`` matching ``filters``: train_key from config_hash; rows of writes that
        layout 2 holds (``layout_2_writes``) yield to it. ``versions`` (compaction): each row gets its exact write
        and :data:`LAYOUT_1_VERSION`; otherwise its ``_write`` is ``<stem>/`` (its file, whose rows keep their
        order)."""
        legacy = [c for c in scanned if c != "train_key"] + ["train_key", *INPUT_ALIASES]
        expr = filter_expression(filters, train_key=_TRAIN_KEY) if filters else None
        table = self._layout.read_whole(files, _LAYOUT_1_SCHEMA, legacy, expr, {"_stem": lambda f: f.name})
        keys = pc.coalesce(table.column("train_key"), table.column("config_hash"))
        table = table.set_column(table.column_names.index("train_key"), "train_key", keys)
        # each row's write: its file's stem and its run's folder (worked out once per stem and run)
        pairs = pc.binary_join_element_wise(table.column("_stem"), keys, "\x00")
        distinct = pc.unique(pairs).to_pylist()
        writes = pa.array([f"{p.split(chr(0), 1)[0]}/{run_folder(p.split(chr(0), 1)[1])}" for p in distinct],
                          pa.string())
        write = pc.take(writes, pc.index_in(pairs, value_set=pa.array(distinct, pa.string())))
        yielded = [w for w in writes.to_pylist() if w in layout_2_writes]
        if yielded:
            kept = pc.invert(pc.is_in(write, value_set=pa.array(yielded, pa.string())))
            table, write = table.filter(kept), write.filter(kept)
        if versions:  # compaction: each row's exact write
            table = table.append_column(WRITE_COLUMN, write)
            return table.append_column(VERSION_COLUMN, pa.array([LAYOUT_1_VERSION] * table.num_rows, pa.string()))
        # ordering only: the file, as layout 1 ordered its rows
        return table.append_column(WRITE_COLUMN, pc.binary_join_element_wise(table.column("_stem"), "", "/"))
