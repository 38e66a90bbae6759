"""Layout 1 (the store as schema 1-5 wrote it): one flat folder per study, files named by their write key's stem,
``train_key`` still called ``config_hash``. Such files read as they are (their rows yield to any layout-2 copy of
their write) until compaction rewrites them; ``_layout.json`` marks a study that has none left, so a run's reads
need not look for them."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from attnlab.results.layout import _MARKER, VERSION_COLUMN, WRITE_COLUMN, _File, run_folder
from attnlab.results.reads import _filter_expression
from attnlab.results.schema import ARROW_SCHEMA, INPUT_ALIASES

LAYOUT_1_VERSION = "0" * 17 + "-00000000"  # the version of every layout-1 file: older than any write
# Layout-1 files: train_key may be missing (schema 1-5 called it config_hash).
_LAYOUT_1_SCHEMA = pa.schema([f.with_nullable(True) if f.name == "train_key" else f for f in ARROW_SCHEMA]
                             + [pa.field(old, pa.string()) for old in INPUT_ALIASES])


class _Legacy:
    """Layout-1 files and the marker of a study free of them (a mixin of ResultsStore)."""

    _marked: set[str]  # studies seen with their layout marker (it is never removed)

    def _layout_1_files(self, study: str) -> list[_File]:
        out = []
        for info in self._list(self.study_dir(study), recursive=False):
            name = info.base_name
            if info.type == pafs.FileType.File and name.endswith(".parquet") and name[0] not in "._":
                out.append(_File(info.path, info.size, name[: -len(".parquet")]))
        return out

    def _ensure_marker(self, study: str, new_write: bool = False) -> bool:
        """Whether the study's layout marker is there (no layout-1 files); a write creates it for a study without
        layout-1 files. Known markers are remembered (a marker is never removed)."""
        if study in self._marked:
            return True
        marker = f"{self.study_dir(study)}/{_MARKER}"
        if self.filesystem.get_file_info(marker).type == pafs.FileType.File:
            self._marked.add(study)
            return True
        if not new_write:
            return False
        if self._layout_1_files(study):
            return False
        self._write_marker(study)
        return True

    def _mark_if_free(self, study: str) -> None:
        if not self._ensure_marker(study) and not self._layout_1_files(study):
            self._write_marker(study)

    def _write_marker(self, study: str) -> None:
        self._put(f"{self.study_dir(study)}/{_MARKER}", json.dumps({"layout": 2, "layout_1_files": False}).encode()
                  + b"\n")
        self._marked.add(study)

    def _read_layout_1(self, files: list[_File], layout_2_writes: set[str], scanned: list[str], filters: dict,
                       versions: bool) -> pa.Table:
        """The rows of layout-1 ``files`` matching ``filters``: train_key from config_hash; rows of writes that
        layout 2 holds (``layout_2_writes``) yield to it. ``versions`` (compaction): each row gets its exact write
        and :data:`LAYOUT_1_VERSION`; otherwise its ``_write`` is ``<stem>/`` (its file, whose rows keep their
        order)."""
        legacy = [c for c in scanned if c != "train_key"] + ["train_key", *INPUT_ALIASES]
        expr_1 = _filter_expression(filters, layout_1=True) if filters else None
        table = self._guard(lambda: self._read_small(files, _LAYOUT_1_SCHEMA, legacy, expr_1,
                                                     {"_stem": lambda f: f.name}), files)
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
