"""The results store's layout and naming: where each file lives and what its name says (the module docstring of
:mod:`attnlab.results.store` describes the layout), what a listing of a study found, and the store's file
primitives (list, put, delete), on which the other parts of :class:`~attnlab.results.store.ResultsStore` build."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from attnlab.errors import UserError
from attnlab.location import atomic_write
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
_SAFE_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")

# Columns a compacted file adds to the rows: which write each row came from ("<stem>/<run folder>") and its version.
WRITE_COLUMN, VERSION_COLUMN = "_write", "_version"
# (Every field nullable: a layout-1 row may lack a column that is required today.)
_COMPACTED_SCHEMA = pa.schema([f.with_nullable(True) for f in ARROW_SCHEMA]
                              + [pa.field(WRITE_COLUMN, pa.string()), pa.field(VERSION_COLUMN, pa.string())],
                              metadata=ARROW_SCHEMA.metadata)
# Layout-1 files: train_key may be missing (schema 1-5 called it config_hash).
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


def _new_version(after: str | None = None) -> str:
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



# ------------------------------------------------------------------------------------------ files
class _Files:
    """The store's file primitives (``filesystem``, ``root`` and ``_local`` are set by ResultsStore)."""

    filesystem: pafs.FileSystem
    root: str
    _local: bool

    def study_dir(self, study: str) -> str:
        return f"{self.root}/{_STUDY_PREFIX}{study}"

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

    def _put(self, path: str, data, before_rename=None) -> None:
        """Write one whole file (:func:`attnlab.location.atomic_write`); on a local disk its temporary is named
        ``.tmp-<hex>``, which listings skip and compaction removes once it is an hour old."""
        atomic_write(self.filesystem, path, data, temporary=f".tmp-{secrets.token_hex(16)}",
                     before_rename=before_rename)

    def _put_table(self, path: str, table: pa.Table, before_rename=None, **options) -> int:
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, **options)
        data = sink.getvalue()
        self._put(path, data, before_rename)
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
