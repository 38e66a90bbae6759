"""The refresher: a reader that refreshes (``attnlab serve``'s study page) hands back the :class:`StudyRows` of its
last read, and :meth:`Refresher.read_since` opens only the files that read did not (a run's new written files, a
new compacted file): written and compacted files are named by their version or id and never rewritten, so a name
seen before holds the same rows. Nothing changed: no file opened (:meth:`Refresher.signature` names the files).

It never writes, and its rows are always the rows a fresh read returns, in the same order
(docs/results-store.md#reading)."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pyarrow.compute as pc

from attnlab.results.layout import VERSION_COLUMN, WRITE_COLUMN, Layout, Listing, Written, check_study
from attnlab.results.plan import Plan, only_writes, resolve, writes_held
from attnlab.results.reads import Reader, check_schema_version, to_frame
from attnlab.results.schema import ARROW_SCHEMA, STORED_NAMES


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
            self._frame = to_frame(self._table)
        return self._frame

    def __repr__(self) -> str:
        return f"StudyRows({self.study!r}, {self.rows} rows, {self.files_read} files read)"


def _listing_signature(listing: Listing) -> str:
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


class Refresher:
    """Reading a study of the store of ``layout`` again, opening only what changed (layout-1 files: through
    ``reader``)."""

    def __init__(self, layout: Layout, reader: Reader):
        self._layout, self._reader = layout, reader

    def signature(self, study: str) -> str:
        check_study(study)
        return _listing_signature(self._layout.list_study(study))

    def read_since(self, study: str, previous: StudyRows | None = None) -> StudyRows:
        check_study(study)
        if previous is not None and previous.study != study:
            previous = None
        return self._layout.retrying(f"reading study {study!r}", lambda: self._read_since_once(study, previous))

    def _read_since_once(self, study: str, previous: StudyRows | None) -> StudyRows:
        listing = self._layout.list_study(study)
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
            table = self._layout.read_compacted(c, [*columns, WRITE_COLUMN, VERSION_COLUMN])
            files_read += 1
            compacted[c.path] = (table, writes_held(table))
        plan = resolve(listing, {path: writes for path, (_, writes) in compacted.items()})
        # written files, by run: a run whose winning files are the same keeps its rows; a changed run keeps the
        # rows of its files still winning and reads only its new ones
        by_run: dict[str, list[Written]] = {}
        for w in plan.written:
            by_run.setdefault(w.folder, []).append(w)
        old_runs = previous._runs if previous is not None else {}
        runs: dict[str, tuple] = {}
        kept: dict[str, tuple[frozenset, pa.Table | None]] = {}
        new_files: list[Written] = []
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
            table = self._layout.read_whole(new_files, ARROW_SCHEMA, columns, None, {WRITE_COLUMN: lambda f: f.write})
            table = table.combine_chunks()  # one chunk (per file, thousands of chunks make sorting slow)
            files_read += len(new_files)
            check_schema_version(table, self._layout.uri)
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
                table = self._reader.read_plan(Plan([], [], plan.layout_1, plan.layout_2_writes, {}), columns, {})
                files_read += len(plan.layout_1)
                layout_1 = (key, table)
        pieces = [table for _, table in runs.values() if table.num_rows]
        for c, keep in plan.compacted:
            table = compacted[c.path][0].drop_columns([VERSION_COLUMN])
            pieces.append(only_writes(table, keep))
        if layout_1 is not None:
            pieces.append(layout_1[1])
        target = pa.schema([*(ARROW_SCHEMA.field(c) for c in columns), pa.field(WRITE_COLUMN, pa.string())])
        pieces = [pa.Table.from_arrays([t.column(c) for c in target.names], schema=target) for t in pieces
                  if t.num_rows]
        table = pa.concat_tables(pieces).combine_chunks() if pieces else target.empty_table()
        return StudyRows(study, signature, files_read, runs, compacted, layout_1, table)

