"""The results store: immutable Parquet files of long-format rows under a store URI.

Layout (``ROOT`` is a local folder or any pyarrow filesystem URI: ``file://``, ``s3://``, ``gs://``)::

    ROOT/study=<study>/<readable-key>-<sha256(key)[:20]>.parquet

- Every writer writes its own files: no lock, no single writer, no shared index.
- The file name is derived from a caller-given ``key`` (e.g. ``(trial, step, "eval")``), so a retried
  write of the same key *replaces* the file instead of adding duplicates. Different keys never collide.
- Local disks: write ``.tmp-...`` beside the target, then rename it over the target (atomic on POSIX).
  Object stores: write the object directly (an object only becomes visible once its upload completes).
  Readers skip names starting with ``.`` or ``_``, so they never see a half-written file.
- "Done": an evaluation cell is done once rows with its ``eval_key`` are stored (a file appears whole, so
  rows of a cell are all there or none); ``stored_eval_keys`` lists them for a training run.
- Reads read the whole dataset (or one study folder) with ``pyarrow.dataset`` against the current
  schema, so columns an older file lacks read as null.

Never deletes or rewrites a file other than the one named by the key being written. No Ray here.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import uuid
from collections.abc import Iterable, Mapping

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
    COLUMN_NAMES,
    SCHEMA_VERSION,
    empty_table,
    rows_to_table,
)

_STUDY_PREFIX = "study="
_NULLABLE_INT_COLUMNS = ("layer", "n_tokens")
_SORT_COLUMNS = ("study", "trial", "step", "metric", "eval_len", "p_eval", "layer", "bucket", "task")


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


def file_name_for_key(key: str | tuple) -> str:
    """The deterministic file name of a write key: a readable prefix plus a hash of the canonical key."""
    parts = _key_parts(key)
    canonical = json.dumps(parts, separators=(",", ":"), ensure_ascii=True)
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:20]
    readable = re.sub(r"[^A-Za-z0-9.+-]+", "_", "_".join(str(p) for p in parts)).strip("_.")[:80] or "key"
    return f"{readable}-{digest}.parquet"


def _filter_expression(filters: Mapping[str, object]):
    expr = None
    for name, wanted in filters.items():
        if name not in COLUMN_NAMES:
            raise UserError(f"results filter {name!r} is not a column; allowed: {', '.join(COLUMN_NAMES)}")
        field = pc.field(name)
        if isinstance(wanted, (list, tuple, set, frozenset)):
            values = list(wanted)
            non_null = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
            term = None
            if non_null:
                term = field.isin(pa.array(non_null, type=ARROW_SCHEMA.field(name).type))
            if len(non_null) < len(values):
                term = field.is_null() if term is None else (term | field.is_null())
            if term is None:  # empty list: nothing matches
                term = pc.scalar(False)
        elif wanted is None:
            term = field.is_null()
        else:
            term = field == pa.scalar(wanted, type=ARROW_SCHEMA.field(name).type)
        expr = term if expr is None else (expr & term)
    return expr


class ResultsStore:
    """A results store at ``uri`` (a local folder by default, or any pyarrow filesystem URI).

    >>> store = ResultsStore("results")
    >>> store.write(rows, key=(trial, step, "eval"))       # replaces on retry
    >>> df = store.read(study="table4", metric="val_loss", eval_len=[1024, 2048])
    """

    def __init__(self, uri: str | os.PathLike | Location = DEFAULT_STORE):
        self.location = Location.parse(uri, field="store")
        self.uri = self.location.uri
        self.filesystem, self.root = self.location.fs, self.location.path.rstrip("/") or "/"
        self._local = self.location.is_local

    def __repr__(self) -> str:
        return f"ResultsStore({self.uri!r})"

    # ------------------------------------------------------------------ writing
    def study_dir(self, study: str) -> str:
        return f"{self.root}/{_STUDY_PREFIX}{study}"

    def write(self, rows, key: str | tuple) -> str:
        """Validate ``rows`` (a list of dicts or a pandas DataFrame) and write them as one immutable file.

        All rows must belong to one study. Writing again with the same ``key`` in the same study
        replaces that file (a retry never duplicates). Returns the file's path on the store's filesystem.
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
        folder = self.study_dir(studies[0])
        target = f"{folder}/{file_name_for_key(key)}"
        self.filesystem.create_dir(folder, recursive=True)
        if self._local:
            temporary = f"{folder}/.tmp-{uuid.uuid4().hex}.parquet"
            try:
                pq.write_table(table, temporary, filesystem=self.filesystem)
                self.filesystem.move(temporary, target)  # rename(2): atomic replace on POSIX
            except BaseException:
                try:
                    self.filesystem.delete_file(temporary)
                except (FileNotFoundError, OSError):
                    pass
                raise
        else:
            pq.write_table(table, target, filesystem=self.filesystem)
        return target

    @staticmethod
    def _records(rows) -> list[dict]:
        if hasattr(rows, "to_dict") and hasattr(rows, "columns"):  # pandas DataFrame
            return rows.to_dict("records")
        if isinstance(rows, Mapping):
            raise UserError("results rows must be a list of dicts or a DataFrame, got a single dict")
        if not isinstance(rows, Iterable):
            raise UserError(f"results rows must be a list of dicts or a DataFrame, got {type(rows).__name__}")
        return list(rows)

    # ------------------------------------------------------------------ reading
    def _data_files(self, study: str | None = None) -> list[str]:
        base = self.root if study is None else self.study_dir(study)
        info = self.filesystem.get_file_info(base)
        if info.type == pafs.FileType.NotFound:
            return []
        selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
        files = []
        for entry in self.filesystem.get_file_info(selector):
            name = entry.base_name
            if entry.type == pafs.FileType.File and name.endswith(".parquet") and name[0] not in "._":
                if study is None and not entry.path[len(self.root) + 1:].startswith(_STUDY_PREFIX):
                    continue
                files.append(entry.path)
        return sorted(files)

    def exists(self) -> bool:
        return self.filesystem.get_file_info(self.root).type != pafs.FileType.NotFound

    def has_study(self, study: str) -> bool:
        """Whether the store has a folder of rows for ``study`` (one listing; no file is read)."""
        return self.filesystem.get_file_info(self.study_dir(study)).type == pafs.FileType.Directory

    def studies(self) -> list[str]:
        """Names of the studies that have at least one results file."""
        names = set()
        for path in self._data_files():
            first = path[len(self.root) + 1:].split("/", 1)[0]
            names.add(first[len(_STUDY_PREFIX):])
        return sorted(names)

    def read_table(self, study: str | None = None, columns: list[str] | None = None, **filters) -> pa.Table:
        """Like :meth:`read`, as an Arrow table."""
        if isinstance(study, str) and not STUDY_NAME.match(study):
            raise UserError(f"study {study!r} is not a valid study name (letters, digits and . _ + -)")
        if study is not None:
            filters = {"study": study, **filters}
        files = self._data_files(study if isinstance(study, str) else None)
        if columns is not None:
            unknown = [c for c in columns if c not in COLUMN_NAMES]
            if unknown:
                raise UserError(f"results column {unknown[0]!r} is unknown; allowed: {', '.join(COLUMN_NAMES)}")
        expr = _filter_expression(filters) if filters else None
        if not files:
            table = empty_table()
            return table.select(columns) if columns is not None else table
        dataset = ds.dataset(files, schema=ARROW_SCHEMA, format="parquet", filesystem=self.filesystem)
        try:
            table = dataset.to_table(columns=columns, filter=expr)
        except (pa.ArrowInvalid, OSError) as exc:
            bad = self._find_unreadable(files)
            where = f"file {bad!r}" if bad else "a file"
            raise UserError(
                f"results store {self.uri!r}: {where} is not a readable results file "
                f"({str(exc).splitlines()[0]}); move it out of the store and re-run"
            ) from None
        if "schema_version" in table.column_names and table.num_rows:
            newest = pc.max(table.column("schema_version")).as_py()
            if newest is not None and newest > SCHEMA_VERSION:
                raise UserError(
                    f"results store {self.uri!r} holds schema version {newest}, newer than this attnlab "
                    f"(version {SCHEMA_VERSION}); upgrade attnlab to read it"
                )
        return table

    def _find_unreadable(self, files: list[str]) -> str | None:
        for path in files:
            try:
                pq.read_metadata(path, filesystem=self.filesystem)
            except (pa.ArrowInvalid, OSError):
                return path
        return None

    def read(self, study: str | None = None, columns: list[str] | None = None, **filters):
        """Read rows as a pandas DataFrame. ``filters``: ``column=value`` (equality), ``column=[...]``
        (any of; ``None`` in the list matches null) or ``column=None`` (is null).

        Rows come back sorted by study, trial, step, metric, eval_len, p_eval, layer, bucket, task. A store
        that does not exist yet reads as empty.
        """
        table = self.read_table(study, columns=columns, **filters)
        sort_keys = [(c, "ascending") for c in _SORT_COLUMNS if c in table.column_names]
        if sort_keys and table.num_rows:
            table = table.sort_by(sort_keys)
        frame = table.to_pandas()
        for name in _NULLABLE_INT_COLUMNS:
            if name in frame.columns:
                frame[name] = frame[name].astype("Int64")
        return frame

    def stored_eval_keys(self, study: str, config_hash: str) -> set[str]:
        """The evaluation cells (``eval_key``) stored for one training run (``config_hash``) of a study."""
        table = self.read_table(study, columns=["eval_key"], config_hash=config_hash)
        return {key for key in table.column("eval_key").to_pylist() if key}
