"""The results store: Parquet files of long-format rows under a store URI, kept per training run so that a run's
reads touch only its own files, and merged per study by compaction.

Layout 2 (``ROOT`` is a local folder or any pyarrow filesystem URI: ``file://``, ``s3://``, ``gs://``)::

    ROOT/study=<study>/train_key=<key>/<stem>.v<version>.parquet   a written file: one write key's rows of one run
    ROOT/study=<study>/train_key=<key>/_compacted.<id>.json       what compaction <id> took from this run's files
    ROOT/study=<study>/_compacted/<id>.parquet                    compaction <id>'s rows (every run of the study)
    ROOT/study=<study>/_layout.json                               present once the study has no layout-1 files
    ROOT/study=<study>/<stem>.parquet                             layout 1 (schema 1-5 writers): read, compacted away

- **Writes.** Every writer writes its own files: no lock, no single writer, no shared index. A write's ``key``
  (e.g. ``("eval", train_key, length, digest)``) names its *stem*; the rows go to their run's folder
  (``train_key=<key>``; a write with rows of several runs writes one file per run), under a new *version*
  (the writer's clock in microseconds, after any version of the key the folder already holds, plus 8 random hex
  digits). The newest version of a ``(stem, run)`` is the one read: writing a key again replaces its rows. The
  writer then deletes the older versions it listed. Local disks: a temporary ``.``-name renamed into place;
  object stores: a direct put (an object appears whole). Readers skip ``.``-names.
- **Per-run reads** (:meth:`ResultsStore.stored_eval_keys`, the skip-done check every trial makes, and any read
  filtered to one ``train_key``) list only the run's folder: its written files, and the index each compaction
  left there (the run's writes it merged: stem, version, evaluation keys, in which compacted file). The cost
  does not grow with the study.
- **Study-wide reads** list the study once (written and layout-1 files), then its ``_compacted/`` folder, and
  read only the columns asked for with the filters pushed into the Parquet scan (row-group statistics prune
  compacted files).
- **Refreshing reads** (:meth:`ResultsStore.read_since`, the study page's refresh) list the study as a study-wide
  read does and hand back a :class:`StudyRows`; given the previous one, they open only the files it did not read
  (a run's new written files, a new compacted file): written files and compacted files are named by their
  version or id and never rewritten, so a name seen before holds the same rows. Nothing changed: no file opened.
- **Which copy is read.** Every write is identified by ``(stem, run)`` and ordered by its version; a compacted
  file keeps each row's write and version (columns ``_write``, ``_version``). For each write the newest version
  is read, from exactly one place (a compacted copy before a written file of the same version, a later
  compacted file before an earlier one); a layout-1 file's rows yield to any layout-2 copy of their write. So
  a write of a compacted key wins at read time and at the next compaction, and a copy left twice by a crash
  or by two compactions at once is read once.
- **Compaction** (:meth:`ResultsStore.compact`, ``attnlab results compact``) merges everything it lists into
  one compacted file, then writes each run's index, then deletes exactly the files it merged, then the older
  indexes and compacted files. It never deletes a file it did not list and read, so writes made meanwhile
  stay; at every point between the steps the store reads every row once (readers list written files before
  compacted files, and re-list when a file they listed has gone). A crash leaves a readable store; running
  compaction again completes it.
- "Done": an evaluation cell is done once rows with its ``eval_key`` are stored (a file appears whole, so
  rows of a cell are all there or none).

Layout-1 stores (one flat folder per study, files named by the key, schema versions 1-5) read as they are; their
``config_hash`` column is read as ``train_key``. Until ``attnlab results compact`` rewrites them, a run's
skip-done check in such a study lists the study folder. Writers of schema 1-5 must not write to a study once
layout 2 has written to it (their files would be seen by study-wide reads but not by per-run reads).

Never deletes or rewrites a file outside those two cases (older versions of the key being written; files a
compaction merged). No Ray here.
"""

from __future__ import annotations

import concurrent.futures
import datetime as _dt
import hashlib
import json
import math
import os
import re
import secrets
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from attnlab.errors import UserError
from attnlab.location import DEFAULT_STORE, Location
from attnlab.names import STUDY_NAME
from attnlab.results.schema import (
    ARROW_SCHEMA,
    INPUT_ALIASES,
    SCHEMA_VERSION,
    STORED_NAMES,
    empty_table,
    rows_to_table,
)

_STUDY_PREFIX = "study="
_RUN_PREFIX = "train_key="
_COMPACTED_DIR = "_compacted"
_MARKER = "_layout.json"
_NULLABLE_INT_COLUMNS = ("layer", "n_tokens")
_SORT_COLUMNS = ("study", "trial", "step", "metric", "eval_len", "p_eval", "layer", "bucket", "task")

_VERSION = r"\d{17}-[0-9a-f]{8}"
_WRITTEN_NAME = re.compile(rf"^(?P<stem>[^/]+)\.v(?P<version>{_VERSION})\.parquet$")
_INDEX_NAME = re.compile(rf"^_compacted\.(?P<id>{_VERSION})\.json$")
_COMPACTED_NAME = re.compile(rf"^(?P<id>{_VERSION})\.parquet$")
_SAFE_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")
LAYOUT_1_VERSION = "0" * 17 + "-00000000"  # the version of every layout-1 file: older than any write

# Columns a compacted file adds to the rows: which write each row came from ("<stem>/<run folder>") and its version.
WRITE_COLUMN, VERSION_COLUMN = "_write", "_version"
# (Every field nullable: a layout-1 row may lack a column that is required today.)
_COMPACTED_SCHEMA = pa.schema([f.with_nullable(True) for f in ARROW_SCHEMA]
                              + [pa.field(WRITE_COLUMN, pa.string()), pa.field(VERSION_COLUMN, pa.string())],
                              metadata=ARROW_SCHEMA.metadata)
# Layout-1 files: train_key may be missing (schema 1-5 called it config_hash).
_LAYOUT_1_SCHEMA = pa.schema([f.with_nullable(True) if f.name == "train_key" else f for f in ARROW_SCHEMA]
                             + [pa.field(old, pa.string()) for old in INPUT_ALIASES])
_COMPACTED_ROW_GROUP = 16_384
_ATTEMPTS = 8  # reads and compactions start again when a file they listed was removed meanwhile (a compaction)
_REMOTE_THREADS = 16

# Test-only crash injection (as train/loop.py's): ``<step>`` ends the process (os._exit) just before step <step>
# of a compaction, ``<step>:<n>`` after n items of it. The steps are listed in ResultsStore.compact.
CRASH_ENV = "ATTNLAB_COMPACT_CRASH_AT"
CRASH_EXIT_CODE = 71


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


def _new_version(after: str | None = None) -> str:
    """A version later than ``after`` by this clock: microseconds since the epoch, then random hex digits."""
    micros = time.time_ns() // 1000
    if after is not None:
        micros = max(micros, int(after.split("-", 1)[0]) + 1)
    return f"{micros:017d}-{secrets.token_hex(4)}"


def _crash_point(step: int, items: int | None = None) -> None:
    wanted = os.environ.get(CRASH_ENV)
    if wanted and wanted == (str(step) if items is None else f"{step}:{items}"):
        os._exit(CRASH_EXIT_CODE)


# ------------------------------------------------------------------------------------------ what a listing found
@dataclass(frozen=True)
class _Written:
    path: str
    size: int
    folder: str  # the run folder's name, train_key=<key>
    stem: str
    version: str

    @property
    def write(self) -> str:
        return f"{self.stem}/{self.folder}"


@dataclass(frozen=True)
class _File:
    path: str
    size: int
    name: str  # layout-1: the stem; compacted: the compaction id; index: the compaction id
    folder: str = ""  # indexes: their run folder


@dataclass
class _Listing:
    written: list[_Written] = field(default_factory=list)
    layout_1: list[_File] = field(default_factory=list)
    compacted: list[_File] = field(default_factory=list)
    indexes: list[_File] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)  # temporary files of writes that died over an hour ago

    def paths(self) -> set[str]:
        return {f.path for group in (self.written, self.layout_1, self.compacted, self.indexes) for f in group}


@dataclass
class _Plan:
    """What a read reads: the winning written files, each compacted file with the writes it wins (None: all it
    holds), the layout-1 files, and every write some layout-2 source holds (layout-1 rows of those yield)."""

    written: list[_Written]
    compacted: list[tuple[_File, frozenset | None]]
    layout_1: list[_File]
    layout_2_writes: set[str]
    versions: dict[str, str]  # the winning version of each write


def _resolve(listing: _Listing, compacted_writes: dict[str, dict[str, str]]) -> _Plan:
    """The newest version of each write, read from one place (``compacted_writes``: per compacted file path,
    ``{write: version}`` of what it holds)."""
    best: dict[str, tuple[tuple, object]] = {}

    def offer(write: str, rank: tuple, source) -> None:
        if write not in best or rank > best[write][0]:
            best[write] = (rank, source)

    for w in listing.written:
        offer(w.write, (w.version, 1, w.path), w)
    for c in listing.compacted:
        for write, version in compacted_writes.get(c.path, {}).items():
            offer(write, (version, 2, c.name), c)
    written = [w for w in listing.written if best[w.write][1] is w]
    compacted = []
    for c in listing.compacted:
        holds = compacted_writes.get(c.path, {})
        won = frozenset(w for w in holds if best[w][1] is c)
        if won:
            compacted.append((c, None if len(won) == len(holds) else won))
    return _Plan(written, compacted, listing.layout_1, set(best), {w: rank[0] for w, (rank, _) in best.items()})


# ------------------------------------------------------------------------------------------ filters
def _filter_expression(filters: Mapping[str, object], layout_1: bool = False):
    """The filters as one pyarrow expression (``layout_1``: ``train_key`` falls back to the old ``config_hash``)."""
    expr = None
    for name, wanted in filters.items():
        field_ = pc.field(name)
        if name == "train_key" and layout_1:
            field_ = pc.coalesce(pc.field("train_key"), pc.field("config_hash"))
        if isinstance(wanted, (list, tuple, set, frozenset)):
            values = list(wanted)
            non_null = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
            term = None
            if non_null:
                term = field_.isin(pa.array(non_null, type=ARROW_SCHEMA.field(name).type))
            if len(non_null) < len(values):
                term = field_.is_null() if term is None else (term | field_.is_null())
            if term is None:  # empty list: nothing matches
                term = pc.scalar(False)
        elif wanted is None:
            term = field_.is_null()
        else:
            term = field_ == pa.scalar(wanted, type=ARROW_SCHEMA.field(name).type)
        expr = term if expr is None else (expr & term)
    return expr


def _current_filters(filters: Mapping[str, object]) -> dict:
    out = {}
    for name, wanted in filters.items():
        current = INPUT_ALIASES.get(name, name)
        if current not in STORED_NAMES:
            raise UserError(f"results filter {name!r} is not a column; allowed: {', '.join(STORED_NAMES)}")
        if current in out and out[current] != wanted:
            raise UserError(f"results filters {name!r} and {current!r} name one column ({name!r} is its old name) "
                            "with two values: give one")
        out[current] = wanted
    return out


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


class StudyRows:
    """A study's rows as :meth:`ResultsStore.read_since` read them: hand it back to the next call, which re-reads
    only the files that changed since (a reader that refreshes, such as ``attnlab serve``'s study page).

    ``signature`` names the study's files when they were read (:meth:`ResultsStore.signature`), ``files_read`` how
    many Parquet files this read opened (0: nothing changed), ``rows`` how many rows the study has. Immutable: a
    newer read shares the tables of the runs that did not change."""

    def __init__(self, study: str, signature: str, files_read: int, runs: dict, compacted: dict,
                 layout_1: tuple | None, table: pa.Table):
        self.study, self.signature, self.files_read = study, signature, files_read
        self._runs = runs  # run folder -> (frozenset of its winning written files' paths, their rows)
        self._compacted = compacted  # compacted file path -> (its rows with _write and _version, {write: version})
        self._layout_1 = layout_1  # ((layout-1 files, writes layout 2 holds), their rows), or None
        self._table = table  # every row: the stored columns plus _write
        self._frame = None

    @property
    def rows(self) -> int:
        return self._table.num_rows

    def unchanged(self) -> StudyRows:
        """This read again, as a read that opened no file."""
        again = StudyRows(self.study, self.signature, 0, self._runs, self._compacted, self._layout_1, self._table)
        again._frame = self._frame
        return again

    def frame(self):
        """The rows as a pandas DataFrame, sorted as :meth:`ResultsStore.read` sorts them (built once per read)."""
        if self._frame is None:
            self._frame = _to_frame(self._table)
        return self._frame

    def __repr__(self) -> str:
        return f"StudyRows({self.study!r}, {self.rows} rows, {self.files_read} files read)"


def _to_frame(table: pa.Table):
    """Rows (with ``_write``) as ``read()`` returns them: sorted by :data:`_SORT_COLUMNS` then as written, nullable
    integer columns as pandas ``Int64``."""
    sort_keys = [(c, "ascending") for c in (*_SORT_COLUMNS, WRITE_COLUMN) if c in table.column_names]
    if table.num_rows:
        table = table.sort_by(sort_keys)
    frame = table.drop_columns([WRITE_COLUMN]).to_pandas()
    for name in _NULLABLE_INT_COLUMNS:
        if name in frame.columns:
            frame[name] = frame[name].astype("Int64")
    return frame


def _listing_signature(listing: _Listing) -> str:
    """A short hash of a study listing's files (paths and sizes): written files, compacted files and indexes are
    named by their version or id and never rewritten, so a new name is a change; a layout-1 file also by size."""
    blob = "\n".join(sorted(f"{f.path}:{f.size}" for group in (listing.written, listing.layout_1, listing.compacted,
                                                                  listing.indexes) for f in group))
    return hashlib.sha1(blob.encode()).hexdigest()[:16] if blob else ""


def _value_counts(column) -> tuple[list, list]:
    counts = pc.value_counts(column)
    return counts.field("values").to_pylist(), counts.field("counts").to_pylist()


def _empty_rows(columns: list[str]) -> pa.Table:
    """No rows: ``columns`` of the schema plus ``_write``."""
    return pa.schema([*(ARROW_SCHEMA.field(c) for c in columns), pa.field(WRITE_COLUMN, pa.string())]).empty_table()


def _check_schema_version(table: pa.Table, uri: str) -> None:
    if table.num_rows and "schema_version" in table.column_names:
        newest = pc.max(table.column("schema_version")).as_py()
        if newest is not None and newest > SCHEMA_VERSION:
            raise UserError(f"results store {uri!r} holds schema version {newest}, newer than this attnlab "
                            f"(version {SCHEMA_VERSION}); upgrade attnlab to read it")


class ResultsStore:
    """A results store at ``uri`` (a local folder by default, or any pyarrow filesystem URI).

    >>> store = ResultsStore("results")
    >>> store.write(rows, key=(trial, step, "eval"))       # replaces on retry
    >>> df = store.read(study="table4", metric="val_loss", eval_len=[1024, 2048])
    >>> store.stored_eval_keys("table4", train_key)        # one run's cells, reading only its files
    >>> store.compact("table4")                             # merge the study's small files
    """

    def __init__(self, uri: str | os.PathLike | Location = DEFAULT_STORE):
        self.location = Location.parse(uri, field="store")
        self.uri = self.location.uri
        self.filesystem, self.root = self.location.fs, self.location.path.rstrip("/") or "/"
        self._local = self.location.is_local
        self._marked: set[str] = set()  # studies seen with their layout marker (it is never removed)

    def __repr__(self) -> str:
        return f"ResultsStore({self.uri!r})"

    def __getstate__(self):  # a pickled store (handed to Ray workers) checks the markers afresh
        return {**self.__dict__, "_marked": set()}

    # ------------------------------------------------------------------ files
    def study_dir(self, study: str) -> str:
        return f"{self.root}/{_STUDY_PREFIX}{study}"

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

    def _put(self, path: str, data) -> None:
        """Write one whole file: a temporary name renamed into place on a local disk, a direct put elsewhere."""
        if not self._local:
            with self.filesystem.open_output_stream(path) as out:
                out.write(data)
            return
        folder = path.rsplit("/", 1)[0]
        self.filesystem.create_dir(folder, recursive=True)
        temporary = f"{folder}/.tmp-{uuid.uuid4().hex}"
        try:
            with self.filesystem.open_output_stream(temporary) as out:
                out.write(data)
            self.filesystem.move(temporary, path)  # rename(2): atomic on POSIX
        except BaseException:
            try:
                self.filesystem.delete_file(temporary)
            except OSError:
                pass
            raise

    def _put_table(self, path: str, table: pa.Table, **options) -> int:
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, **options)
        data = sink.getvalue()
        self._put(path, data)
        return data.size

    def _delete(self, path: str) -> bool:
        try:
            self.filesystem.delete_file(path)
            return True
        except FileNotFoundError:
            return False
        except OSError:
            if self.filesystem.get_file_info(path).type == pafs.FileType.NotFound:
                return False
            raise

    def _each(self, function: Callable, items: list, step: int | None = None) -> list:
        """``function`` over ``items``: in order on a local disk, on threads on object storage (each item is a
        request or three). ``step``: a compaction step (its crash points count the items done)."""
        if self._local or len(items) < 2:
            out = []
            for i, item in enumerate(items):
                out.append(function(item))
                if step is not None:
                    _crash_point(step, i + 1)
            return out
        done = [0]

        def counted(item):
            result = function(item)
            if step is not None:
                done[0] += 1
                _crash_point(step, done[0])
            return result

        with concurrent.futures.ThreadPoolExecutor(_REMOTE_THREADS) as pool:
            return list(pool.map(counted, items))

    # ------------------------------------------------------------------ writing
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
        self._put(marker, json.dumps({"layout": 2, "layout_1_files": False}).encode() + b"\n")
        self._marked.add(study)
        return True

    def _layout_1_files(self, study: str) -> list[_File]:
        out = []
        for info in self._list(self.study_dir(study), recursive=False):
            name = info.base_name
            if info.type == pafs.FileType.File and name.endswith(".parquet") and name[0] not in "._":
                out.append(_File(info.path, info.size, name[: -len(".parquet")]))
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

    # ------------------------------------------------------------------ listing
    def exists(self) -> bool:
        return self.filesystem.get_file_info(self.root).type != pafs.FileType.NotFound

    def has_study(self, study: str) -> bool:
        """Whether the store has a folder of rows for ``study`` (one listing; no file is read)."""
        return self.filesystem.get_file_info(self.study_dir(study)).type == pafs.FileType.Directory

    def studies(self) -> list[str]:
        """Names of the studies in the store (one listing of the store's top folder)."""
        names = []
        for info in self._list(self.root, recursive=False):
            if info.type == pafs.FileType.Directory and info.base_name.startswith(_STUDY_PREFIX):
                names.append(info.base_name[len(_STUDY_PREFIX):])
        return sorted(names)

    def _list_study(self, study: str) -> _Listing:
        """Everything of a study: written, layout-1 files and indexes first, then (a second listing) compacted
        files, so a file a compaction removes meanwhile is missed only once its compacted copy is there."""
        listing = _Listing()
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
                if name.endswith(".parquet") and name[0] not in "._":
                    listing.layout_1.append(_File(info.path, info.size, name[: -len(".parquet")]))
            elif len(parts) == 2 and parts[0].startswith(_RUN_PREFIX):
                if match := _WRITTEN_NAME.match(name):
                    listing.written.append(_Written(info.path, info.size, parts[0], match["stem"], match["version"]))
                elif match := _INDEX_NAME.match(name):
                    listing.indexes.append(_File(info.path, info.size, match["id"], parts[0]))
        listing.compacted = self._list_compacted(study)
        for group in (listing.written, listing.layout_1, listing.indexes):
            group.sort(key=lambda f: f.path)
        return listing

    def _list_compacted(self, study: str) -> list[_File]:
        out = []
        for info in self._list(f"{self.study_dir(study)}/{_COMPACTED_DIR}", recursive=False):
            if info.type == pafs.FileType.File and (match := _COMPACTED_NAME.match(info.base_name)):
                out.append(_File(info.path, info.size, match["id"]))
        return sorted(out, key=lambda f: f.name)

    def _list_run(self, study: str, train_key: str) -> tuple[_Listing, dict[str, dict[str, str]], dict[str, list]]:
        """One run's files: its folder's written files and indexes, the compacted files those indexes name, and
        layout-1 files when the study may still have some. Returns the listing, the compacted writes of this run
        (per compacted path ``{write: version}``) and the evaluation keys of each compacted write."""
        folder = run_folder(train_key)
        base = f"{self.study_dir(study)}/{folder}"
        listing = _Listing()
        for info in self._list(base, recursive=False):
            if info.type != pafs.FileType.File:
                continue
            if match := _WRITTEN_NAME.match(info.base_name):
                listing.written.append(_Written(info.path, info.size, folder, match["stem"], match["version"]))
            elif match := _INDEX_NAME.match(info.base_name):
                listing.indexes.append(_File(info.path, info.size, match["id"], folder))
        compacted_writes: dict[str, dict[str, str]] = {}
        eval_keys: dict[str, list] = {}
        compacted: dict[str, _File] = {}
        for index in listing.indexes:
            try:
                with self.filesystem.open_input_stream(index.path) as handle:
                    content = json.loads(handle.read())
            except FileNotFoundError:
                raise _Vanished(index.path) from None
            except OSError:
                if self.filesystem.get_file_info(index.path).type == pafs.FileType.NotFound:
                    raise _Vanished(index.path) from None
                raise
            path = f"{self.study_dir(study)}/{_COMPACTED_DIR}/{content['compacted']}"
            compacted[path] = _File(path, int(content["size"]), content["compacted"][: -len(".parquet")])
            held = compacted_writes.setdefault(path, {})
            for key, stem, version, keys in content["writes"]:
                if key == train_key:
                    held[f"{stem}/{folder}"] = version
                    eval_keys[f"{path}|{stem}/{folder}"] = keys
        listing.compacted = sorted(compacted.values(), key=lambda f: f.name)
        if not self._ensure_marker(study):
            listing.layout_1 = self._layout_1_files(study)
        listing.written.sort(key=lambda f: f.path)
        return listing, compacted_writes, eval_keys

    # ------------------------------------------------------------------ reading
    def _compacted_writes(self, files: list[_File]) -> dict[str, dict[str, str]]:
        """``{write: version}`` held by each compacted file (two small dictionary-encoded columns)."""
        out = {}
        for f in files:
            try:
                table = pq.read_table(f.path, columns=[WRITE_COLUMN, VERSION_COLUMN], filesystem=self.filesystem)
            except FileNotFoundError:
                raise _Vanished(f.path) from None
            except OSError:
                if self.filesystem.get_file_info(f.path).type == pafs.FileType.NotFound:
                    raise _Vanished(f.path) from None
                raise
            pairs = table.group_by([WRITE_COLUMN, VERSION_COLUMN]).aggregate([])
            out[f.path] = dict(zip(pairs.column(WRITE_COLUMN).to_pylist(), pairs.column(VERSION_COLUMN).to_pylist()))
        return out

    def _plan_study(self, study: str) -> _Plan:
        listing = self._list_study(study)
        if len(listing.compacted) == 1 and not listing.written and not listing.layout_1:
            only = listing.compacted[0]
            return _Plan([], [(only, None)], [], set(), {})  # the compacted file wins everything it holds
        return _resolve(listing, self._compacted_writes(listing.compacted))

    def _read_small(self, files: list, schema: pa.Schema, columns: list[str], expr,
                    labels: Mapping[str, Callable]) -> pa.Table:
        """The rows of ``files`` (whole small files: written and layout-1) matching ``expr``, as ``columns`` of
        ``schema`` (a column a file lacks reads as null) plus one string column per ``labels`` entry (its value
        for each file), in file order. Each file is read whole and parsed on its own (a dataset over thousands of
        files keeps every file's parsed footer: hundreds of MB at 5,000 files), on threads only for object storage
        (a request or two each); the filter runs once per group of files, not once per file."""
        read_schema = pa.schema([schema.field(c).with_nullable(True) for c in columns])
        target = pa.schema([*read_schema, *(pa.field(name, pa.string()) for name in labels)])

        def read_one(f) -> pa.Table:
            with self.filesystem.open_input_stream(f.path) as handle:
                data = handle.read()
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
        pool = concurrent.futures.ThreadPoolExecutor(_REMOTE_THREADS) if not self._local and len(files) > 2 else None
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

    def _read_plan(self, plan: _Plan, columns: list[str], filters: dict, versions: bool = False) -> pa.Table:
        """The rows ``plan`` reads (``columns`` plus ``_write``, and ``_version`` with ``versions``), filtered.

        ``_write`` says where a row comes from, for ordering and compaction: ``<stem>/<run folder>`` (a layout-1
        row outside compaction: ``<stem>/``, its file, whose rows keep their order)."""
        wanted = [c for c in STORED_NAMES if c in columns or c == "schema_version"]
        extra = [WRITE_COLUMN] + ([VERSION_COLUMN] if versions else [])
        out_schema = pa.schema([ARROW_SCHEMA.field(c) for c in wanted] + [pa.field(c, pa.string()) for c in extra])
        # the columns the filters look at are read too (files are filtered after they are read)
        scanned = wanted + [c for c in filters if c not in wanted]
        expr = _filter_expression(filters) if filters else None
        pieces: list[pa.Table] = []

        def add(table: pa.Table) -> None:
            if table.num_rows:
                pieces.append(pa.Table.from_arrays([table.column(c) for c in out_schema.names], schema=out_schema))

        # written files: one write each
        labels = {WRITE_COLUMN: lambda f: f.write, **({VERSION_COLUMN: lambda f: f.version} if versions else {})}
        add(self._guard(lambda: self._read_small(plan.written, ARROW_SCHEMA, scanned, expr, labels), plan.written))
        # compacted files: each with the writes it wins (row groups pruned by the filters' statistics)
        for compacted, keep in plan.compacted:
            read_columns = [*wanted, *extra] + [c for c in filters if c not in wanted]
            dataset = ds.dataset([pafs.FileInfo(compacted.path, type=pafs.FileType.File, size=compacted.size)],
                                 schema=_COMPACTED_SCHEMA, format="parquet", filesystem=self.filesystem)
            table = self._guard(lambda: dataset.to_table(columns=read_columns, filter=expr), [compacted])
            if keep is not None and table.num_rows:
                table = table.filter(pc.is_in(table.column(WRITE_COLUMN), value_set=pa.array(sorted(keep))))
            add(table)
        # layout-1 files: train_key from config_hash; rows of writes that layout 2 holds yield to it
        if plan.layout_1:
            legacy = [c for c in scanned if c != "train_key"] + ["train_key", *INPUT_ALIASES]
            expr_1 = _filter_expression(filters, layout_1=True) if filters else None
            table = self._guard(lambda: self._read_small(plan.layout_1, _LAYOUT_1_SCHEMA, legacy, expr_1,
                                                         {"_stem": lambda f: f.name}), plan.layout_1)
            keys = pc.coalesce(table.column("train_key"), table.column("config_hash"))
            table = table.set_column(table.column_names.index("train_key"), "train_key", keys)
            # each row's write: its file's stem and its run's folder (worked out once per stem and run)
            pairs = pc.binary_join_element_wise(table.column("_stem"), keys, "\x00")
            distinct = pc.unique(pairs).to_pylist()
            writes = pa.array([f"{p.split(chr(0), 1)[0]}/{run_folder(p.split(chr(0), 1)[1])}" for p in distinct],
                              pa.string())
            write = pc.take(writes, pc.index_in(pairs, value_set=pa.array(distinct, pa.string())))
            yielded = [w for w in writes.to_pylist() if w in plan.layout_2_writes]
            if yielded:
                kept = pc.invert(pc.is_in(write, value_set=pa.array(yielded, pa.string())))
                table, write = table.filter(kept), write.filter(kept)
            if versions:  # compaction: each row's exact write
                table = table.append_column(WRITE_COLUMN, write)
                table = table.append_column(VERSION_COLUMN, pa.array([LAYOUT_1_VERSION] * table.num_rows, pa.string()))
            else:  # ordering only: the file, as layout 1 ordered its rows
                table = table.append_column(WRITE_COLUMN, pc.binary_join_element_wise(table.column("_stem"), "",
                                                                                        "/"))
            add(table)
        if not pieces:
            return out_schema.empty_table()
        table = pa.concat_tables(pieces)
        if table.num_rows:
            newest = pc.max(table.column("schema_version")).as_py()
            if newest is not None and newest > SCHEMA_VERSION:
                raise UserError(
                    f"results store {self.uri!r} holds schema version {newest}, newer than this attnlab "
                    f"(version {SCHEMA_VERSION}); upgrade attnlab to read it"
                )
        return table

    def _guard(self, read: Callable, files: list):
        """Run ``read``; a failure because a listed file is gone raises _Vanished (list again), any other
        unreadable file a one-line UserError naming it."""
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

    def _retrying(self, what: str, read: Callable):
        for _ in range(_ATTEMPTS):
            try:
                return read()
            except _Vanished:
                continue
        raise UserError(f"results store {self.uri!r}: files kept changing while {what} ({_ATTEMPTS} tries); "
                        "is a compaction running in a loop? Re-run when it is done")

    def read_table(self, study: str | list[str] | None = None, columns: list[str] | None = None,
                   **filters) -> pa.Table:
        """Like :meth:`read`, as an Arrow table (rows in no particular order)."""
        table = self._read(study, columns, filters)
        return table.drop_columns([WRITE_COLUMN]) if WRITE_COLUMN in table.column_names else table

    def _read(self, study, columns, filters) -> pa.Table:
        if isinstance(study, str) and not STUDY_NAME.match(study):
            raise UserError(f"study {study!r} is not a valid study name (letters, digits and . _ + -)")
        filters = _current_filters(filters)
        if columns is not None:
            for c in columns:
                if c in INPUT_ALIASES:
                    raise UserError(f"results column {c!r} is called {INPUT_ALIASES[c]!r} since schema version 6; "
                                    f"ask for {INPUT_ALIASES[c]!r}")
            unknown = [c for c in columns if c not in STORED_NAMES]
            if unknown:
                raise UserError(f"results column {unknown[0]!r} is unknown; allowed: {', '.join(STORED_NAMES)}")
        if isinstance(study, str):
            names = [study]
        else:
            present = self.studies()
            names = present if study is None else [s for s in present if s in set(study)]
            if "study" in filters:  # study=... given as a filter: only those folders
                wanted = filters["study"]
                wanted = set(wanted) if isinstance(wanted, (list, tuple, set, frozenset)) else {wanted}
                names = [s for s in names if s in wanted]
        wanted_columns = list(STORED_NAMES) if columns is None else list(columns)
        tables = []
        for name in names:
            run = filters.get("train_key")
            if isinstance(run, str):
                def read_one(name=name, run=run):
                    listing, compacted_writes, _ = self._list_run(name, run)
                    return self._read_plan(_resolve(listing, compacted_writes), wanted_columns, filters)
            else:
                def read_one(name=name):
                    return self._read_plan(self._plan_study(name), wanted_columns, filters)
            tables.append(self._retrying(f"reading study {name!r}", read_one))
        keep = [c for c in STORED_NAMES if c in wanted_columns]
        if columns is not None:
            keep = list(columns)
        tables = [t for t in tables if t.num_rows]
        if not tables:
            empty = empty_table()
            return empty.select(keep).append_column(WRITE_COLUMN, pa.array([], pa.string()))
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        return table.select([*keep, WRITE_COLUMN])

    def read(self, study: str | list[str] | None = None, columns: list[str] | None = None, **filters):
        """Read rows as a pandas DataFrame. ``filters``: ``column=value`` (equality), ``column=[...]``
        (any of; ``None`` in the list matches null) or ``column=None`` (is null); ``config_hash`` names
        ``train_key``. A filter on one ``train_key`` (with a study) reads only that run's files.

        Rows come back sorted by study, trial, step, metric, eval_len, p_eval, layer, bucket, task, then as
        they were written (by write key, then each write's row order). A store that does not exist yet reads
        as empty.
        """
        return _to_frame(self._read(study, columns, filters))

    def signature(self, study: str) -> str:
        """A short hash naming the study's files (listed, none read): it changes whenever rows are written,
        replaced or compacted; "" for a study with no files. :attr:`StudyRows.signature` is the same hash."""
        self._check_study(study)
        return _listing_signature(self._list_study(study))

    def read_since(self, study: str, previous: StudyRows | None = None) -> StudyRows:
        """Every row of ``study`` (all columns), re-reading only what changed since ``previous`` (an earlier
        :class:`StudyRows` of this store and study; None reads everything).

        It lists the study as :meth:`read` does (written files, then compacted files): with the same files as
        ``previous`` it opens none. Otherwise it opens only the files ``previous`` did not read: a run's new
        written files (the rows of that run's files that are still the newest version of their write are kept,
        those of a replaced or merged write dropped), and a compacted file a compaction made since (read whole,
        once; the files it merged are gone from the listing, so no row is counted twice or lost). Layout-1 files
        (a study not compacted since schema 5) are read again whenever anything changed. The rows are the rows
        :meth:`read` returns, in the same order (:meth:`StudyRows.frame`)."""
        self._check_study(study)
        if previous is not None and previous.study != study:
            previous = None
        return self._retrying(f"reading study {study!r}", lambda: self._read_since_once(study, previous))

    def _check_study(self, study: str) -> None:
        if not isinstance(study, str) or not STUDY_NAME.match(study):
            raise UserError(f"study {study!r} is not a valid study name (letters, digits and . _ + -)")

    def _read_since_once(self, study: str, previous: StudyRows | None) -> StudyRows:
        listing = self._list_study(study)
        signature = _listing_signature(listing)
        if previous is not None and previous.signature == signature:
            return previous.unchanged()
        files_read = 0
        columns = list(STORED_NAMES)
        # compacted files: each read whole once (its rows never change), with the writes it holds
        before = previous._compacted if previous is not None else {}
        compacted = {}
        for c in listing.compacted:
            if c.path in before:
                compacted[c.path] = before[c.path]
                continue
            dataset = ds.dataset([pafs.FileInfo(c.path, type=pafs.FileType.File, size=c.size)],
                                 schema=_COMPACTED_SCHEMA, format="parquet", filesystem=self.filesystem)
            table = self._guard(lambda: dataset.to_table(columns=[*columns, WRITE_COLUMN, VERSION_COLUMN]), [c])
            files_read += 1
            pairs = table.group_by([WRITE_COLUMN, VERSION_COLUMN]).aggregate([])
            compacted[c.path] = (table, dict(zip(pairs.column(WRITE_COLUMN).to_pylist(),
                                                 pairs.column(VERSION_COLUMN).to_pylist())))
        plan = _resolve(listing, {path: writes for path, (_, writes) in compacted.items()})
        # written files, by run: a run whose winning files are the same keeps its rows; a changed run keeps the
        # rows of its files still winning and reads only its new ones
        by_run: dict[str, list[_Written]] = {}
        for w in plan.written:
            by_run.setdefault(w.folder, []).append(w)
        old_runs = previous._runs if previous is not None else {}
        runs: dict[str, tuple] = {}
        kept: dict[str, tuple[frozenset, pa.Table | None]] = {}
        new_files: list[_Written] = []
        for folder, files in by_run.items():
            paths = frozenset(f.path for f in files)
            old = old_runs.get(folder)
            if old is not None and old[0] == paths:
                runs[folder] = old
                continue
            still = old[0] & paths if old is not None else frozenset()
            part = None
            if still:
                writes = pa.array(sorted(f.write for f in files if f.path in still), pa.string())
                part = old[1].filter(pc.is_in(old[1].column(WRITE_COLUMN), value_set=writes))
            kept[folder] = (paths, part)
            new_files.extend(f for f in files if f.path not in still)
        if new_files:
            new_files.sort(key=lambda f: (f.folder, f.path))
            table = self._guard(lambda: self._read_small(new_files, ARROW_SCHEMA, columns, None,
                                                         {WRITE_COLUMN: lambda f: f.write}), new_files)
            table = table.combine_chunks()  # one chunk (per file, thousands of chunks make sorting slow)
            files_read += len(new_files)
            _check_schema_version(table, self.uri)
            # the rows come in file order, grouped by run: slice each run's rows off (no copy)
            counts: dict[str, int] = {}
            for write, n in zip(*_value_counts(table.column(WRITE_COLUMN))):
                folder = write.split("/", 1)[1]
                counts[folder] = counts.get(folder, 0) + n
            offset = 0
            for folder in dict.fromkeys(f.folder for f in new_files):
                n = counts.get(folder, 0)
                paths, part = kept.pop(folder)
                piece = table.slice(offset, n)
                offset += n
                runs[folder] = (paths, piece if part is None else pa.concat_tables([part, piece]))
        for folder, (paths, part) in kept.items():  # changed runs with no new file (a file merged away)
            runs[folder] = (paths, part if part is not None else _empty_rows(columns))
        # layout-1 files: read again whenever anything changed (until a compaction rewrites them)
        layout_1 = None
        if plan.layout_1:
            key = (tuple((f.path, f.size) for f in plan.layout_1), frozenset(plan.layout_2_writes))
            if previous is not None and previous._layout_1 is not None and previous._layout_1[0] == key:
                layout_1 = previous._layout_1
            else:
                table = self._read_plan(_Plan([], [], plan.layout_1, plan.layout_2_writes, {}), columns, {})
                files_read += len(plan.layout_1)
                layout_1 = (key, table)
        pieces = [table for _, table in runs.values() if table.num_rows]
        for c, keep in plan.compacted:
            table = compacted[c.path][0].drop_columns([VERSION_COLUMN])
            if keep is not None:
                table = table.filter(pc.is_in(table.column(WRITE_COLUMN), value_set=pa.array(sorted(keep))))
            pieces.append(table)
        if layout_1 is not None:
            pieces.append(layout_1[1])
        target = pa.schema([*(ARROW_SCHEMA.field(c) for c in columns), pa.field(WRITE_COLUMN, pa.string())])
        pieces = [pa.Table.from_arrays([t.column(c) for c in target.names], schema=target) for t in pieces
                  if t.num_rows]
        table = pa.concat_tables(pieces).combine_chunks() if pieces else target.empty_table()
        return StudyRows(study, signature, files_read, runs, compacted, layout_1, table)

    def stored_eval_keys(self, study: str, train_key: str | None = None, *, config_hash: str | None = None) -> set[str]:
        """The evaluation cells (``eval_key``) stored for one training run of a study: lists the run's folder and
        reads its files and indexes only, so it costs the same in a study of 10 runs or 10,000. ``config_hash``
        is the old name of ``train_key``."""
        key = train_key if train_key is not None else config_hash
        if not isinstance(key, str) or not key:
            raise UserError(f"stored_eval_keys: train_key must be a non-empty string, got {key!r}")
        if not STUDY_NAME.match(study):
            raise UserError(f"study {study!r} is not a valid study name (letters, digits and . _ + -)")

        def read_keys() -> set[str]:
            listing, compacted_writes, eval_keys = self._list_run(study, key)
            plan = _resolve(listing, compacted_writes)
            out: set[str] = set()
            for compacted, keep in plan.compacted:
                for write in (keep if keep is not None else compacted_writes[compacted.path]):
                    out.update(k for k in eval_keys.get(f"{compacted.path}|{write}", ()) if k)
            reads = _Plan(plan.written, [], plan.layout_1, plan.layout_2_writes, plan.versions)
            table = self._read_plan(reads, ["eval_key"], {"train_key": key})
            out.update(k for k in table.column("eval_key").to_pylist() if k)
            return out

        return self._retrying(f"reading run {key!r} of study {study!r}", read_keys)

    # ------------------------------------------------------------------ compaction
    def compact(self, study: str) -> Compaction:
        """Merge a study's files into one compacted file; returns what was done.

        Steps (each numbered step is a crash point of :data:`CRASH_ENV`, for the tests):

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
        if not isinstance(study, str) or not STUDY_NAME.match(study):
            raise UserError(f"study {study!r} is not a valid study name (letters, digits and . _ + -)")
        return self._retrying(f"compacting study {study!r}", lambda: self._compact_once(study))

    def _compact_once(self, study: str) -> Compaction:
        _crash_point(1)
        listing = self._list_study(study)
        _crash_point(2)
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
        _crash_point(3)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, row_group_size=_COMPACTED_ROW_GROUP)
        data = sink.getvalue()
        if self._local:
            folder = target.rsplit("/", 1)[0]
            self.filesystem.create_dir(folder, recursive=True)
            temporary = f"{folder}/.tmp-{uuid.uuid4().hex}"
            with self.filesystem.open_output_stream(temporary) as out:
                out.write(data)
            _crash_point(3, 1)
            self.filesystem.move(temporary, target)
        else:
            self._put(target, data)
        _crash_point(4)
        indexes = self._index_documents(table, f"{compaction_id}.parquet", data.size)
        self._each(lambda item: self._put(f"{self.study_dir(study)}/{item[0]}/_compacted.{compaction_id}.json",
                                          item[1]), sorted(indexes.items()), step=4)
        _crash_point(5)
        merged = [f.path for f in listing.written] + [f.path for f in listing.layout_1] + listing.stale
        removed = sum(self._each(self._delete, merged, step=5))
        _crash_point(6)
        removed += sum(self._each(self._delete, [f.path for f in listing.indexes], step=6))
        _crash_point(7)
        removed += sum(self._each(self._delete, [f.path for f in listing.compacted], step=7))
        _crash_point(8)
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

    def _mark_if_free(self, study: str) -> None:
        if not self._ensure_marker(study) and not self._layout_1_files(study):
            self._put(f"{self.study_dir(study)}/{_MARKER}",
                      json.dumps({"layout": 2, "layout_1_files": False}).encode() + b"\n")
            self._marked.add(study)
