"""Read planning: which files a read opens and which copy of each write it reads. A study-wide read lists the
study (written files, layout-1 files and indexes, then compacted files); a per-run read lists the run's folder and
the compacted files its indexes name. Every write is identified by ``(stem, run)``; its newest version is read,
from exactly one place (:func:`_resolve`). A file that vanishes between listing and reading (a compaction merged
it) starts the read again (:meth:`_Planning._retrying`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from attnlab.errors import UserError
from attnlab.results.layout import (
    _ATTEMPTS,
    _COMPACTED_DIR,
    _COMPACTED_NAME,
    _COMPACTED_SCHEMA,
    _INDEX_NAME,
    _RUN_PREFIX,
    _WRITTEN_NAME,
    VERSION_COLUMN,
    WRITE_COLUMN,
    _File,
    _Listing,
    _Vanished,
    _Written,
    run_folder,
)


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



def writes_held(table: pa.Table) -> dict[str, str]:
    """``{write: version}`` of the rows of a compacted file (its ``_write`` and ``_version`` columns)."""
    pairs = table.group_by([WRITE_COLUMN, VERSION_COLUMN]).aggregate([])
    return dict(zip(pairs.column(WRITE_COLUMN).to_pylist(), pairs.column(VERSION_COLUMN).to_pylist()))


def only_writes(table: pa.Table, keep: frozenset | None) -> pa.Table:
    """The rows of a compacted file's ``table`` that belong to the writes it wins (``keep``; None: all)."""
    if keep is None:
        return table
    return table.filter(pc.is_in(table.column(WRITE_COLUMN), value_set=pa.array(sorted(keep))))


class _Planning:
    """Listing a study or a run and resolving what a read reads (a mixin of ResultsStore)."""

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
            content = json.loads(self._read_listed(index.path, lambda: self._read_bytes(index.path)))
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

    def _compacted_writes(self, files: list[_File]) -> dict[str, dict[str, str]]:
        """``{write: version}`` held by each compacted file (two small dictionary-encoded columns)."""
        out = {}
        for f in files:
            table = self._read_listed(f.path, lambda: pq.read_table(f.path, columns=[WRITE_COLUMN, VERSION_COLUMN],
                                                                    filesystem=self.filesystem))
            out[f.path] = writes_held(table)
        return out

    def _read_compacted(self, f: _File, columns: list[str], expr=None) -> pa.Table:
        """``columns`` of the compacted file ``f``'s rows matching ``expr`` (row groups pruned by its statistics)."""
        dataset = ds.dataset([pafs.FileInfo(f.path, type=pafs.FileType.File, size=f.size)],
                             schema=_COMPACTED_SCHEMA, format="parquet", filesystem=self.filesystem)
        return self._guard(lambda: dataset.to_table(columns=columns, filter=expr), [f])

    def _read_bytes(self, path: str) -> bytes:
        with self.filesystem.open_input_stream(path) as handle:
            return handle.read()

    def _read_listed(self, path: str, read: Callable):
        """``read()`` of the file ``path``, listed a moment ago: _Vanished when it has gone since (list again)."""
        try:
            return read()
        except FileNotFoundError:
            raise _Vanished(path) from None
        except OSError:
            if self.filesystem.get_file_info(path).type == pafs.FileType.NotFound:
                raise _Vanished(path) from None
            raise

    def _plan_study(self, study: str) -> _Plan:
        listing = self._list_study(study)
        if len(listing.compacted) == 1 and not listing.written and not listing.layout_1:
            only = listing.compacted[0]
            return _Plan([], [(only, None)], [], set(), {})  # the compacted file wins everything it holds
        return _resolve(listing, self._compacted_writes(listing.compacted))

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
