"""The results store's layout: where each file lives and what its name says, what a listing found, and
:class:`Layout`, the part of :class:`~attnlab.results.store.ResultsStore` through which the others touch files
(list, read whole, put, delete; a file gone since it was listed means "list again").

It never decides which copy of a write is read (:mod:`~attnlab.results.plan`), and deletes only the files a
caller names. The layout and why it is safe without locks: docs/results-store.md."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from attnlab.errors import UserError
from attnlab.location import Location, atomic_write
from attnlab.names import STUDY_NAME
from attnlab.results.schema import ARROW_SCHEMA

_STUDY_PREFIX = "study="
_RUN_PREFIX = "train_key="
_COMPACTED_DIR = "_compacted"
_MARKER = "_layout.json"

_VERSION = r"\d{17}-[0-9a-f]{8}"
_WRITTEN_NAME = re.compile(rf"^(?P<stem>[^/]+)\.v(?P<version>{_VERSION})\.parquet$")
_INDEX_NAME = re.compile(rf"^_compacted\.(?P<id>{_VERSION})\.json$")
_COMPACTED_NAME = re.compile(rf"^(?P<id>{_VERSION})\.parquet$")
_LAYOUT_1_NAME = re.compile(r"^(?P<stem>[^._][^/]*)\.parquet$")  # a study folder's own Parquet files
_SAFE_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")

# Columns a compacted file adds to the rows: which write each row came from ("<stem>/<run folder>") and its version.
WRITE_COLUMN, VERSION_COLUMN = "_write", "_version"
# (Every field nullable: a layout-1 row may lack a column that is required today.)
COMPACTED_SCHEMA = pa.schema([f.with_nullable(True) for f in ARROW_SCHEMA]
                              + [pa.field(WRITE_COLUMN, pa.string()), pa.field(VERSION_COLUMN, pa.string())],
                              metadata=ARROW_SCHEMA.metadata)
_ATTEMPTS = 8  # reads and compactions start again when a file they listed was removed meanwhile (a compaction)
_REMOTE_THREADS = 16


class _Vanished(Exception):
    """A file listed a moment ago is gone (a compaction merged it, or a newer write replaced it): list again."""


# ------------------------------------------------------------------------------------------ names
def _key_parts(key) -> list:
    if isinstance(key, str):
        parts = [key]
    elif isinstance(key, tuple):
        parts = list(key)
    else:
        raise UserError(f"results write key must be a string or a tuple, got {type(key).__name__}")
    if not parts or any(p == "" for p in parts):
        raise UserError(f"results write key must be non-empty with no empty parts, got {key!r}")
    out = []
    for part in parts:
        if hasattr(part, "item") and not isinstance(part, (str, bytes)):  # numpy scalars
            part = part.item()
        if part is not None and not isinstance(part, (str, int, float)):
            raise UserError(
                f"results write key parts must be str, int, float or None, got {part!r} in {key!r}"
            )
        out.append(part)
    return out


def key_stem(key: str | tuple) -> str:
    """The deterministic stem of a write key's files: a readable prefix plus a hash of the canonical key (the
    layout-1 file name without ``.parquet``)."""
    parts = _key_parts(key)
    canonical = json.dumps(parts, separators=(",", ":"), ensure_ascii=True)
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:20]
    readable = re.sub(r"[^A-Za-z0-9.+-]+", "_", "_".join(str(p) for p in parts)).strip("_.")[:80] or "key"
    return f"{readable}-{digest}"


def run_folder(train_key: str) -> str:
    """The folder of a run's files in its study: ``train_key=<key>``, or for a key that is not a safe file name
    ``train_key=~<sha256[:20]>`` (``~`` never starts a safe key, so the two never meet)."""
    if _SAFE_KEY.match(train_key):
        return _RUN_PREFIX + train_key
    return f"{_RUN_PREFIX}~{hashlib.sha256(train_key.encode()).hexdigest()[:20]}"


def new_version(after: str | None = None) -> str:
    """A version later than ``after`` by this clock: microseconds since the epoch, then random hex digits."""
    micros = time.time_ns() // 1000
    if after is not None:
        micros = max(micros, int(after.split("-", 1)[0]) + 1)
    return f"{micros:017d}-{secrets.token_hex(4)}"


def check_study(study) -> str:
    """``study`` when it is a valid study name (it names the study's folder), else UserError (the one check of
    every store call that takes a study)."""
    if not isinstance(study, str) or not STUDY_NAME.match(study):
        raise UserError(f"study {study!r} is not a valid study name (letters, digits and . _ + -)")
    return study


# ------------------------------------------------------------------------------------------ what a listing found
@dataclass(frozen=True)
class Written:
    path: str
    size: int
    folder: str  # the run folder's name, train_key=<key>
    stem: str
    version: str

    @property
    def write(self) -> str:
        return f"{self.stem}/{self.folder}"


@dataclass(frozen=True)
class File:
    path: str
    size: int
    name: str  # layout-1: the stem; compacted: the compaction id; index: the compaction id
    folder: str = ""  # indexes: their run folder


@dataclass
class Listing:
    written: list[Written] = field(default_factory=list)
    layout_1: list[File] = field(default_factory=list)
    compacted: list[File] = field(default_factory=list)
    indexes: list[File] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)  # temporary files of writes that died over an hour ago

    def paths(self) -> set[str]:
        return {f.path for group in (self.written, self.layout_1, self.compacted, self.indexes) for f in group}


# ------------------------------------------------------------------------------------------ files
class Layout:
    """A store's files: its filesystem (``filesystem``, ``root``), what a listing of a study or a run finds, and
    the primitives every other part reads and writes through."""

    def __init__(self, location: Location):
        self.uri = location.uri
        self.filesystem, self.root = location.fs, location.path.rstrip("/") or "/"
        self.local = location.is_local

    def study_dir(self, study: str) -> str:
        return f"{self.root}/{_STUDY_PREFIX}{study}"

    def written_path(self, study: str, train_key: str, stem: str, version: str) -> str:
        return f"{self.study_dir(study)}/{run_folder(train_key)}/{stem}.v{version}.parquet"

    def marker_path(self, study: str) -> str:
        return f"{self.study_dir(study)}/{_MARKER}"

    def compacted_path(self, study: str, name: str) -> str:
        """The path of the compacted file ``name`` (``<id>.parquet``) of ``study``."""
        return f"{self.study_dir(study)}/{_COMPACTED_DIR}/{name}"

    def index_path(self, study: str, folder: str, compaction_id: str) -> str:
        return f"{self.study_dir(study)}/{folder}/_compacted.{compaction_id}.json"

    def exists(self) -> bool:
        return self.filesystem.get_file_info(self.root).type != pafs.FileType.NotFound

    def is_file(self, path: str) -> bool:
        return self.filesystem.get_file_info(path).type == pafs.FileType.File

    def has_study(self, study: str) -> bool:
        return self.filesystem.get_file_info(self.study_dir(study)).type == pafs.FileType.Directory

    def studies(self) -> list[str]:
        names = []
        for info in self._list(self.root, recursive=False):
            if info.type == pafs.FileType.Directory and info.base_name.startswith(_STUDY_PREFIX):
                names.append(info.base_name[len(_STUDY_PREFIX):])
        return sorted(names)

    # -------------------------------------------------------------------------------------- listings
    def list_study(self, study: str) -> Listing:
        """Everything of a study: written, layout-1 files and indexes first, then (a second listing) compacted
        files, so a file a compaction removes meanwhile is missed only once its compacted copy is there."""
        listing = Listing()
        base = self.study_dir(study)
        old = time.time() - 3600
        for info in self._list(base, recursive=True):
            if info.type != pafs.FileType.File:
                continue
            relative = info.path[len(base) + 1:]
            parts = relative.split("/")
            name = parts[-1]
            if name.startswith(".tmp-"):
                if info.mtime is not None and info.mtime.timestamp() < old:
                    listing.stale.append(info.path)
                continue
            if len(parts) == 1:
                if match := _LAYOUT_1_NAME.match(name):
                    listing.layout_1.append(File(info.path, info.size, match["stem"]))
            elif len(parts) == 2 and parts[0].startswith(_RUN_PREFIX):
                if match := _WRITTEN_NAME.match(name):
                    listing.written.append(Written(info.path, info.size, parts[0], match["stem"], match["version"]))
                elif match := _INDEX_NAME.match(name):
                    listing.indexes.append(File(info.path, info.size, match["id"], parts[0]))
        listing.compacted = self._list_compacted(study)
        for group in (listing.written, listing.layout_1, listing.indexes):
            group.sort(key=lambda f: f.path)
        return listing

    def _list_compacted(self, study: str) -> list[File]:
        out = []
        for info in self._list(f"{self.study_dir(study)}/{_COMPACTED_DIR}", recursive=False):
            if info.type == pafs.FileType.File and (match := _COMPACTED_NAME.match(info.base_name)):
                out.append(File(info.path, info.size, match["id"]))
        return sorted(out, key=lambda f: f.name)

    def list_run(self, study: str, train_key: str) -> Listing:
        """One run's folder: its written files and the indexes compactions left there (one listing)."""
        folder = run_folder(train_key)
        listing = Listing()
        for info in self._list(f"{self.study_dir(study)}/{folder}", recursive=False):
            if info.type != pafs.FileType.File:
                continue
            if match := _WRITTEN_NAME.match(info.base_name):
                listing.written.append(Written(info.path, info.size, folder, match["stem"], match["version"]))
            elif match := _INDEX_NAME.match(info.base_name):
                listing.indexes.append(File(info.path, info.size, match["id"], folder))
        return listing

    def list_layout_1(self, study: str) -> list[File]:
        """The layout-1 files of a study (its folder's own Parquet files)."""
        out = []
        for info in self._list(self.study_dir(study), recursive=False):
            if info.type == pafs.FileType.File and (match := _LAYOUT_1_NAME.match(info.base_name)):
                out.append(File(info.path, info.size, match["stem"]))
        return out

    def _list(self, base: str, recursive: bool) -> list[pafs.FileInfo]:
        selector = pafs.FileSelector(base, recursive=recursive, allow_not_found=True)
        for attempt in range(5):
            try:
                return self.filesystem.get_file_info(selector)
            except FileNotFoundError:
                # pyarrow's local listing raises when the folder appears while it looks (another writer made it)
                if attempt == 4:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    # -------------------------------------------------------------------------------------- writing
    def put(self, path: str, data, before_rename=None) -> None:
        """Write one whole file (:func:`attnlab.location.atomic_write`); on a local disk its temporary is named
        ``.tmp-<hex>``, which listings skip and compaction removes once it is an hour old."""
        atomic_write(self.filesystem, path, data, temporary=f".tmp-{secrets.token_hex(16)}",
                     before_rename=before_rename)

    def put_table(self, path: str, table: pa.Table, before_rename=None, **options) -> int:
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, **options)
        data = sink.getvalue()
        self.put(path, data, before_rename)
        return data.size

    def delete(self, path: str) -> bool:
        try:
            self.filesystem.delete_file(path)
            return True
        except FileNotFoundError:
            return False
        except OSError:
            if self.filesystem.get_file_info(path).type == pafs.FileType.NotFound:
                return False
            raise

    def each(self, function: Callable, items: list, done: Callable[[int], None] | None = None) -> list:
        """``function`` over ``items``: in order on a local disk, on threads on object storage (each item is a
        request or three); ``done(n)`` after each item, with the number of items done so far."""
        if self.local or len(items) < 2:
            out = []
            for i, item in enumerate(items):
                out.append(function(item))
                if done is not None:
                    done(i + 1)
            return out
        count = [0]

        def counted(item):
            result = function(item)
            if done is not None:
                count[0] += 1
                done(count[0])
            return result

        with concurrent.futures.ThreadPoolExecutor(_REMOTE_THREADS) as pool:
            return list(pool.map(counted, items))

    # -------------------------------------------------------------------------------------- reading
    def read_bytes(self, path: str) -> bytes:
        with self.filesystem.open_input_stream(path) as handle:
            return handle.read()

    def read_columns(self, path: str, columns: list[str]) -> pa.Table:
        return pq.read_table(path, columns=columns, filesystem=self.filesystem)

    def num_rows(self, path: str) -> int:
        return pq.read_metadata(path, filesystem=self.filesystem).num_rows

    def read_listed(self, path: str, read: Callable):
        """``read()`` of the file ``path``, listed a moment ago: _Vanished when it has gone since (list again)."""
        try:
            return read()
        except FileNotFoundError:
            raise _Vanished(path) from None
        except OSError:
            if self.filesystem.get_file_info(path).type == pafs.FileType.NotFound:
                raise _Vanished(path) from None
            raise

    def guard(self, read: Callable, files: list):
        """Run ``read`` of ``files``; a failure because a listed file is gone raises _Vanished (list again), any
        other unreadable file a one-line UserError naming it."""
        try:
            return read()
        except (pa.ArrowInvalid, OSError) as exc:
            gone = [f.path for f in files
                    if self.filesystem.get_file_info(f.path).type == pafs.FileType.NotFound]
            if gone:
                raise _Vanished(gone[0]) from None
            bad = self._find_unreadable([f.path for f in files])
            where = f"file {bad!r}" if bad else "a file"
            raise UserError(
                f"results store {self.uri!r}: {where} is not a readable results file "
                f"({str(exc).splitlines()[0]}); move it out of the store and re-run"
            ) from None

    def _find_unreadable(self, files: list[str]) -> str | None:
        for path in files:
            try:
                pq.read_metadata(path, filesystem=self.filesystem)
            except (pa.ArrowInvalid, OSError):
                return path
        return None

    def retrying(self, what: str, read: Callable):
        """``read()``, listed and read again while a file it listed vanishes (a compaction ran meanwhile)."""
        for _ in range(_ATTEMPTS):
            try:
                return read()
            except _Vanished:
                continue
        raise UserError(f"results store {self.uri!r}: files kept changing while {what} ({_ATTEMPTS} tries); "
                        "is a compaction running in a loop? Re-run when it is done")

    def read_compacted(self, f: File, columns: list[str], expr=None) -> pa.Table:
        """``columns`` of the compacted file ``f``'s rows matching ``expr`` (row groups pruned by its statistics)."""
        dataset = ds.dataset([pafs.FileInfo(f.path, type=pafs.FileType.File, size=f.size)],
                             schema=COMPACTED_SCHEMA, format="parquet", filesystem=self.filesystem)
        return self.guard(lambda: dataset.to_table(columns=columns, filter=expr), [f])

    def read_whole(self, files: list, schema: pa.Schema, columns: list[str], expr,
                   labels: Mapping[str, Callable]) -> pa.Table:
        """The rows of ``files`` (whole small files: written and layout-1) matching ``expr``, as ``columns`` of
        ``schema`` (a column a file lacks reads as null) plus one string column per ``labels`` entry (its value
        for each file), in file order. Each file is read whole and parsed on its own (a dataset over thousands of
        files keeps every file's parsed footer: hundreds of MB at 5,000 files), on threads only for object storage
        (a request or two each); the filter runs once per group of files, not once per file."""
        return self.guard(lambda: self._read_whole(files, schema, columns, expr, labels), files)

    def _read_whole(self, files: list, schema: pa.Schema, columns: list[str], expr,
                    labels: Mapping[str, Callable]) -> pa.Table:
        read_schema = pa.schema([schema.field(c).with_nullable(True) for c in columns])
        target = pa.schema([*read_schema, *(pa.field(name, pa.string()) for name in labels)])

        def read_one(f) -> pa.Table:
            data = self.read_bytes(f.path)
            parquet = pq.ParquetFile(pa.BufferReader(data), pre_buffer=False)  # in memory: nothing to coalesce
            try:
                return parquet.read(columns=columns, use_threads=False)  # a column the file lacks is left out
            except (KeyError, pa.ArrowInvalid):
                present = set(parquet.schema_arrow.names)
                return parquet.read(columns=[c for c in columns if c in present], use_threads=False)

        def conform(table: pa.Table, to: pa.Schema) -> pa.Table:
            arrays = []
            for column in to:
                if column.name in table.column_names:
                    array = table.column(column.name)
                    arrays.append(array if array.type == column.type else array.cast(column.type))
                else:
                    arrays.append(pa.nulls(table.num_rows, column.type))
            return pa.Table.from_arrays(arrays, schema=to)

        def group(group_files: list, tables: list[pa.Table]) -> pa.Table:
            if not tables:
                return target.empty_table()
            first = tables[0].schema
            if all(t.schema.equals(first) for t in tables):
                table = pa.concat_tables(tables)
            else:
                table = pa.concat_tables([conform(t, read_schema) for t in tables])
            counts = [t.num_rows for t in tables]
            for name, label in labels.items():  # each file's label on each of its rows
                values = np.repeat(np.array([label(f) for f in group_files], dtype=object), counts)
                table = table.append_column(name, pa.array(values, pa.string()))
            table = conform(table, target)
            return table.combine_chunks().filter(expr) if expr is not None else table  # one batch: one pass

        # Parsing a small file holds the GIL for most of its time: threads only pay on object storage, where each
        # file waits for a request or two.
        pool = concurrent.futures.ThreadPoolExecutor(_REMOTE_THREADS) if not self.local and len(files) > 2 else None
        out, pending = [], []
        try:
            for f, table in zip(files, pool.map(read_one, files) if pool else map(read_one, files)):
                pending.append((f, table))
                if len(pending) == 512:
                    out.append(group([p[0] for p in pending], [p[1] for p in pending]))
                    pending = []
        finally:
            if pool:
                pool.shutdown()
        out.append(group([p[0] for p in pending], [p[1] for p in pending]))
        return pa.concat_tables(out)
