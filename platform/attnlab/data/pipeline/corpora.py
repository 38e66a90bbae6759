"""Document sources for ``attnlab data prepare``: each yields plain-text documents, split into partitions.

A source lists its partitions (files, row-group ranges, dataset shards) up front; a partition is a small
picklable value, and reading it yields that partition's documents in a fixed order. Concatenating all
partitions in order gives the corpus, independent of how many workers read them, which is what makes the
prepared shards byte-identical whatever the parallelism.

Sources (``make_source(kind, ...)``):

- ``fineweb``: Hugging Face ``datasets`` ``load_dataset(path, name=config, split="train", streaming=True)``;
  ``path`` defaults to ``HuggingFaceFW/fineweb`` (alias ``fineweb``; ``fineweb-edu`` means
  ``HuggingFaceFW/fineweb-edu``), ``name`` to ``sample-10BT``. A local folder laid out like the hub repo
  (``README.md`` with the ``configs:`` YAML + the parquet files) goes through the same call.
- ``parquet`` / ``jsonl``: local files, folders or globs with a ``text`` column (another can be named).
- ``text``: a folder of ``.txt`` / ``.md`` files (recursive), one document per file.
- ``demo``: the offline demo corpus (see :mod:`attnlab.data.pipeline.demo_corpus`).

Bad input (missing path, no files, missing text column, hub unreachable, unknown config) raises a one-line
``UserError`` *before* anything is written. ``datasets`` is imported lazily, only by the fineweb source.
Never imports Ray.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

from attnlab.data.pipeline.demo_corpus import CORPUS_VERSION, LICENSE, SDIST_NAME, SDIST_SHA256, ensure_demo_corpus
from attnlab.errors import UserError

SOURCE_KINDS = ("fineweb", "parquet", "jsonl", "text", "demo")
HUB_ALIASES = {"fineweb": "HuggingFaceFW/fineweb", "fineweb-edu": "HuggingFaceFW/fineweb-edu"}
DEFAULT_FINEWEB = "HuggingFaceFW/fineweb"
DEFAULT_FINEWEB_CONFIG = "sample-10BT"
_PARTITION_BYTES = 64 * 1024**2  # target uncompressed text per partition for parquet row groups
_TEXT_PARTITION_BYTES = 4 * 1024**2  # target bytes per partition for folders of text files


@dataclass(frozen=True)
class Partition:
    """One unit of parallel work: ``payload`` is source-specific and picklable."""

    index: int
    label: str
    payload: tuple = field(default=())


class Source:
    """Base class: ``describe()`` goes into the manifest; ``partitions()``; ``documents(partition)``."""

    kind: str = ""

    def describe(self) -> dict:
        raise NotImplementedError

    def partitions(self) -> list[Partition]:
        raise NotImplementedError

    def documents(self, partition: Partition) -> Iterator[str]:
        raise NotImplementedError


def _has_glob(text: str) -> bool:
    return any(c in text for c in "*?[")


def expand_files(path: str | None, suffixes: tuple[str, ...], what: str) -> list[str]:
    """Sorted files from a file, a folder (recursive, by suffix) or a glob; UserError if none."""
    if not path:
        raise UserError(f"--path is required for --source {what}")
    path = os.path.expanduser(os.fspath(path))
    if _has_glob(path):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        if not files:
            raise UserError(f"--path {path!r}: the glob matches no files")
        return [os.path.abspath(f) for f in files]
    if os.path.isfile(path):
        return [os.path.abspath(path)]
    if os.path.isdir(path):
        files = sorted(
            os.path.join(root, name)
            for root, _, names in os.walk(path)
            for name in names
            if name.lower().endswith(suffixes) and not name.startswith(".")
        )
        if not files:
            raise UserError(f"--path {path!r}: empty corpus, the folder holds no {'/'.join(suffixes)} files")
        return [os.path.abspath(f) for f in files]
    raise UserError(f"--path {path!r} does not exist (expected a file, a folder or a glob)")


def _missing_column(column: str, where: str, columns: list[str]) -> UserError:
    return UserError(
        f"text column {column!r} is missing in {where}; its columns are {columns}; pick one with --text-column"
    )


@dataclass
class RecordFilesSource(Source):
    """Files of records with a text column (Parquet, JSONL): the files under ``path`` with one of ``SUFFIXES``."""

    path: str
    text_column: str = "text"
    SUFFIXES: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self):
        self.files = expand_files(self.path, self.SUFFIXES, self.kind)

    def describe(self) -> dict:
        return {"kind": self.kind, "path": os.path.abspath(os.path.expanduser(self.path)), "text_column": self.text_column}


# ----------------------------------------------------------------------------------------------- parquet
@dataclass
class ParquetSource(RecordFilesSource):
    kind: str = "parquet"
    SUFFIXES: ClassVar[tuple[str, ...]] = (".parquet",)

    def partitions(self) -> list[Partition]:
        import pyarrow.parquet as pq

        parts: list[Partition] = []
        for f in self.files:
            try:
                meta = pq.ParquetFile(f).metadata
            except Exception as exc:
                raise UserError(f"{f} is not a readable parquet file: {str(exc).splitlines()[0]}") from exc
            names = meta.schema.names
            if self.text_column not in names:
                raise _missing_column(self.text_column, f, names)
            group: list[int] = []
            size = 0
            for rg in range(meta.num_row_groups):
                group.append(rg)
                size += meta.row_group(rg).total_byte_size
                if size >= _PARTITION_BYTES:
                    parts.append(Partition(len(parts), f"{f}[row groups {group[0]}-{group[-1]}]", (f, tuple(group))))
                    group, size = [], 0
            if group:
                parts.append(Partition(len(parts), f"{f}[row groups {group[0]}-{group[-1]}]", (f, tuple(group))))
        return parts

    def documents(self, partition: Partition) -> Iterator[str]:
        import pyarrow.parquet as pq

        f, row_groups = partition.payload
        pf = pq.ParquetFile(f)
        for batch in pf.iter_batches(batch_size=4096, row_groups=list(row_groups), columns=[self.text_column]):
            for text in batch.column(0).to_pylist():
                if text:
                    yield text


# ------------------------------------------------------------------------------------------------- jsonl
def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


@dataclass
class JsonlSource(RecordFilesSource):
    kind: str = "jsonl"
    SUFFIXES: ClassVar[tuple[str, ...]] = (".jsonl", ".jsonl.gz", ".json", ".ndjson")

    def _records(self, f: str) -> Iterator[tuple[int, dict]]:
        with _open_text(f) as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UserError(f"{f}:{lineno} is not valid JSON ({exc.msg})") from exc
                if not isinstance(record, dict):
                    raise UserError(f"{f}:{lineno} is not a JSON object")
                yield lineno, record

    def partitions(self) -> list[Partition]:
        for f in self.files:  # check the column on each file's first record before any work starts
            for lineno, record in self._records(f):
                if self.text_column not in record:
                    raise _missing_column(self.text_column, f"{f}:{lineno}", sorted(record))
                break
        return [Partition(i, f, (f,)) for i, f in enumerate(self.files)]

    def documents(self, partition: Partition) -> Iterator[str]:
        (f,) = partition.payload
        for lineno, record in self._records(f):
            if self.text_column not in record:
                raise _missing_column(self.text_column, f"{f}:{lineno}", sorted(record))
            text = record[self.text_column]
            if text:
                yield str(text)


# -------------------------------------------------------------------------------------------------- text
def group_files_by_size(files: list[str], target_bytes: int) -> list[list[str]]:
    """Consecutive groups of files of about ``target_bytes`` each (deterministic, order-preserving)."""
    groups: list[list[str]] = []
    current: list[str] = []
    size = 0
    for f in files:
        current.append(f)
        size += os.path.getsize(f)
        if size >= target_bytes:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


@dataclass
class TextSource(Source):
    path: str
    kind: str = "text"
    partition_bytes: int = _TEXT_PARTITION_BYTES

    def __post_init__(self):
        self.files = expand_files(self.path, (".txt", ".md"), "text")

    def describe(self) -> dict:
        return {"kind": self.kind, "path": os.path.abspath(os.path.expanduser(self.path))}

    def partitions(self) -> list[Partition]:
        groups = group_files_by_size(self.files, self.partition_bytes)
        return [Partition(i, f"{g[0]} (+{len(g) - 1} files)", tuple(g)) for i, g in enumerate(groups)]

    def documents(self, partition: Partition) -> Iterator[str]:
        for f in partition.payload:
            with open(f, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
            if text.strip():
                yield text


# ----------------------------------------------------------------------------------------------- fineweb
_OFFLINE_MARKERS = ("offline", "couldn't reach", "connection", "name resolution", "max retries", "timed out")


def _hub_error(path: str, name: str, exc: Exception) -> UserError:
    first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
    low = f"{type(exc).__name__} {exc}".lower()
    if "builderconfig" in low or ("config" in low and "not found" in low):
        return UserError(f"--name {name!r} is not a config of dataset {path!r}: {first}")
    if any(m in low for m in _OFFLINE_MARKERS) and not os.path.exists(path):
        return UserError(
            f"cannot reach the Hugging Face hub for dataset {path!r} (no network or HF_HUB_OFFLINE=1): use a "
            f"local source instead: --source fineweb --path DIR (a local copy laid out like the hub repo), "
            f"--source parquet --path 'DIR/*.parquet', or --source demo"
        )
    return UserError(f"cannot load dataset {path!r} (config {name!r}): {type(exc).__name__}: {first}")


@dataclass
class FinewebSource(Source):
    path: str | None = None
    name: str | None = None
    text_column: str = "text"
    kind: str = "fineweb"

    def __post_init__(self):
        self.path = HUB_ALIASES.get(self.path or "", self.path or DEFAULT_FINEWEB)
        self.name = self.name or DEFAULT_FINEWEB_CONFIG
        local = os.path.expanduser(self.path)
        if os.path.exists(local):
            self.path = os.path.abspath(local)
        elif self.path.startswith((".", "/", "~")) or self.path.count("/") > 1:
            raise UserError(f"--path {self.path!r} does not exist (expected a hub dataset id or a local folder)")

    def describe(self) -> dict:
        return {"kind": self.kind, "path": self.path, "name": self.name, "text_column": self.text_column}

    def _load(self):
        import datasets

        try:
            return datasets.load_dataset(self.path, name=self.name, split="train", streaming=True)
        except Exception as exc:  # ConnectionError, DatasetNotFoundError, ValueError(BuilderConfig), ...
            raise _hub_error(self.path, self.name, exc) from exc

    def partitions(self) -> list[Partition]:
        ds = self._load()
        columns = list(ds.column_names or (ds.features or {}).keys() or [])
        if not columns:
            first = next(iter(ds), None)
            if first is None:
                raise UserError(f"dataset {self.path!r} (config {self.name!r}) is empty")
            columns = list(first)
        if self.text_column not in columns:
            raise _missing_column(self.text_column, f"dataset {self.path!r} (config {self.name!r})", columns)
        n = max(1, int(ds.num_shards))
        return [Partition(i, f"{self.path}:{self.name} shard {i}/{n}", (n,)) for i in range(n)]

    def documents(self, partition: Partition) -> Iterator[str]:
        (n,) = partition.payload
        ds = self._load()
        if n > 1:
            ds = ds.shard(num_shards=n, index=partition.index, contiguous=True)
        ds = ds.select_columns([self.text_column])
        for batch in ds.iter(batch_size=1024):
            for text in batch[self.text_column]:
                if text:
                    yield text


@dataclass
class DemoSource(TextSource):
    """The demo corpus as a text source; ``path`` is ignored (the corpus lives in the cache)."""

    path: str | None = None
    kind: str = "demo"
    partition_bytes: int = 1024**2

    def __post_init__(self):
        self.path = str(ensure_demo_corpus())
        super().__post_init__()

    def describe(self) -> dict:
        return {"kind": "demo", "corpus": CORPUS_VERSION, "sdist": SDIST_NAME, "sdist_sha256": SDIST_SHA256,
                "license": LICENSE}


# ---------------------------------------------------------------------------------------------- factory
def make_source(kind: str, path: str | None = None, name: str | None = None, text_column: str = "text") -> Source:
    """The source named ``kind`` (one of SOURCE_KINDS); validates the path before any work."""
    if kind == "fineweb":
        return FinewebSource(path, name, text_column or "text")
    if kind == "parquet":
        return ParquetSource(path, text_column or "text")
    if kind == "jsonl":
        return JsonlSource(path, text_column or "text")
    if kind == "text":
        return TextSource(path)
    if kind == "demo":
        return DemoSource(path)
    raise UserError(f"--source {kind!r} is unknown; allowed: {', '.join(SOURCE_KINDS)}")
