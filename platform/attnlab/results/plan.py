"""The planner: which files a read opens and which copy of each write it reads. Every write is identified by
``(stem, run)``; its newest version is read, from exactly one place (:func:`resolve`). A study-wide read plans
from the study's listing; a per-run read from the run's folder, the compacted files its indexes name, and the
layout-1 files while the study may still have some (:class:`~attnlab.results.legacy.LegacyReader`).

It opens only indexes and the two bookkeeping columns of compacted files; it never reads rows
(:mod:`~attnlab.results.reads`) and never writes. The rules: docs/results-store.md#reading.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from attnlab.results.layout import VERSION_COLUMN, WRITE_COLUMN, File, Layout, Listing, Written, run_folder
from attnlab.results.legacy import LegacyReader


@dataclass
class Plan:
    """What a read reads: the winning written files, each compacted file with the writes it wins (None: all it
    holds), the layout-1 files, and every write some layout-2 source holds (layout-1 rows of those yield)."""

    written: list[Written]
    compacted: list[tuple[File, frozenset | None]]
    layout_1: list[File]
    layout_2_writes: set[str]
    versions: dict[str, str]  # the winning version of each write


def resolve(listing: Listing, compacted_writes: dict[str, dict[str, str]]) -> Plan:
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
    return Plan(written, compacted, listing.layout_1, set(best), {w: rank[0] for w, (rank, _) in best.items()})


def writes_held(table: pa.Table) -> dict[str, str]:
    """``{write: version}`` of the rows of a compacted file (its ``_write`` and ``_version`` columns)."""
    pairs = table.group_by([WRITE_COLUMN, VERSION_COLUMN]).aggregate([])
    return dict(zip(pairs.column(WRITE_COLUMN).to_pylist(), pairs.column(VERSION_COLUMN).to_pylist()))


def only_writes(table: pa.Table, keep: frozenset | None) -> pa.Table:
    """The rows of a compacted file's ``table`` that belong to the writes it wins (``keep``; None: all)."""
    if keep is None:
        return table
    return table.filter(pc.is_in(table.column(WRITE_COLUMN), value_set=pa.array(sorted(keep))))


class Planner:
    """Listing a study or a run and resolving what a read reads, in the store of ``layout``."""

    def __init__(self, layout: Layout, legacy: LegacyReader):
        self._layout, self._legacy = layout, legacy

    def list_run(self, study: str, train_key: str) -> tuple[Listing, dict[str, dict[str, str]], dict[str, list]]:
        """One run's files: its folder's written files and indexes, the compacted files those indexes name, and
        layout-1 files when the study may still have some. Returns the listing, the compacted writes of this run
        (per compacted path ``{write: version}``) and the evaluation keys of each compacted write."""
        folder = run_folder(train_key)
        listing = self._layout.list_run(study, train_key)
        compacted_writes: dict[str, dict[str, str]] = {}
        eval_keys: dict[str, list] = {}
        compacted: dict[str, File] = {}
        for index in listing.indexes:
            content = json.loads(self._layout.read_listed(index.path, lambda: self._layout.read_bytes(index.path)))
            path = self._layout.compacted_path(study, content["compacted"])
            compacted[path] = File(path, int(content["size"]), content["compacted"][: -len(".parquet")])
            held = compacted_writes.setdefault(path, {})
            for key, stem, version, keys in content["writes"]:
                if key == train_key:
                    held[f"{stem}/{folder}"] = version
                    eval_keys[f"{path}|{stem}/{folder}"] = keys
        listing.compacted = sorted(compacted.values(), key=lambda f: f.name)
        if not self._legacy.marked(study):
            listing.layout_1 = self._legacy.files(study)
        listing.written.sort(key=lambda f: f.path)
        return listing, compacted_writes, eval_keys

    def compacted_writes(self, files: list[File]) -> dict[str, dict[str, str]]:
        """``{write: version}`` held by each compacted file (two small dictionary-encoded columns)."""
        out = {}
        for f in files:
            table = self._layout.read_listed(
                f.path, lambda: self._layout.read_columns(f.path, [WRITE_COLUMN, VERSION_COLUMN]))
            out[f.path] = writes_held(table)
        return out

    def plan_study(self, study: str) -> Plan:
        listing = self._layout.list_study(study)
        if len(listing.compacted) == 1 and not listing.written and not listing.layout_1:
            only = listing.compacted[0]
            return Plan([], [(only, None)], [], set(), {})  # the compacted file wins everything it holds
        return resolve(listing, self.compacted_writes(listing.compacted))
