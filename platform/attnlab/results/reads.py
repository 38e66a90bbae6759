"""The reader: rows as a DataFrame or an Arrow table, only the columns asked for, with the filters pushed into the
scan (row-group statistics prune compacted files), and one run's evaluation cells read from its own files only
(the skip-done check every trial makes). What a read opens is the planner's (:mod:`~attnlab.results.plan`);
layout-1 files are read by the legacy reader.

It never writes, and re-lists (:meth:`~attnlab.results.layout.Layout.retrying`) when a file it listed has gone.
The rules: docs/results-store.md#reading."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from attnlab.errors import UserError
from attnlab.results.filters import current_filters, filter_expression
from attnlab.results.layout import VERSION_COLUMN, WRITE_COLUMN, Layout, check_study
from attnlab.results.legacy import LegacyReader
from attnlab.results.plan import Plan, Planner, only_writes, resolve
from attnlab.results.schema import ARROW_SCHEMA, INPUT_ALIASES, SCHEMA_VERSION, STORED_NAMES, empty_table

_NULLABLE_INT_COLUMNS = ("layer", "n_tokens")
_SORT_COLUMNS = ("study", "trial", "step", "metric", "eval_len", "p_eval", "layer", "bucket", "task")


def to_frame(table: pa.Table):
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


def check_schema_version(table: pa.Table, uri: str) -> None:
    if table.num_rows and "schema_version" in table.column_names:
        newest = pc.max(table.column("schema_version")).as_py()
        if newest is not None and newest > SCHEMA_VERSION:
            raise UserError(f"results store {uri!r} holds schema version {newest}, newer than this attnlab "
                            f"(version {SCHEMA_VERSION}); upgrade attnlab to read it")


class Reader:
    """Reading rows of the store of ``layout``, as ``planner`` plans them."""

    def __init__(self, layout: Layout, planner: Planner, legacy: LegacyReader):
        self._layout, self._planner, self._legacy = layout, planner, legacy

    def read_plan(self, plan: Plan, columns: list[str], filters: dict, versions: bool = False) -> pa.Table:
        """The rows ``plan`` reads (``columns`` plus ``_write``, and ``_version`` with ``versions``), filtered.

        ``_write`` says where a row comes from, for ordering and compaction: ``<stem>/<run folder>`` (a layout-1
        row outside compaction: ``<stem>/``, its file, whose rows keep their order)."""
        wanted = [c for c in STORED_NAMES if c in columns or c == "schema_version"]
        extra = [WRITE_COLUMN] + ([VERSION_COLUMN] if versions else [])
        out_schema = pa.schema([ARROW_SCHEMA.field(c) for c in wanted] + [pa.field(c, pa.string()) for c in extra])
        # the columns the filters look at are read too (files are filtered after they are read)
        scanned = wanted + [c for c in filters if c not in wanted]
        expr = filter_expression(filters) if filters else None
        pieces: list[pa.Table] = []

        def add(table: pa.Table) -> None:
            if table.num_rows:
                pieces.append(pa.Table.from_arrays([table.column(c) for c in out_schema.names], schema=out_schema))

        # written files: one write each
        labels = {WRITE_COLUMN: lambda f: f.write, **({VERSION_COLUMN: lambda f: f.version} if versions else {})}
        add(self._layout.read_whole(plan.written, ARROW_SCHEMA, scanned, expr, labels))
        # compacted files: each with the writes it wins (row groups pruned by the filters' statistics)
        for compacted, keep in plan.compacted:
            read_columns = [*wanted, *extra] + [c for c in filters if c not in wanted]
            table = self._layout.read_compacted(compacted, read_columns, expr)
            add(only_writes(table, keep) if table.num_rows else table)
        if plan.layout_1:
            add(self._legacy.read(plan.layout_1, plan.layout_2_writes, scanned, filters, versions))
        if not pieces:
            return out_schema.empty_table()
        table = pa.concat_tables(pieces)
        check_schema_version(table, self._layout.uri)
        return table

    def read_table(self, study: str | list[str] | None = None, columns: list[str] | None = None,
                   **filters) -> pa.Table:
        table = self._read(study, columns, filters)
        return table.drop_columns([WRITE_COLUMN]) if WRITE_COLUMN in table.column_names else table

    def _read(self, study, columns, filters) -> pa.Table:
        if isinstance(study, str):
            check_study(study)
        filters = current_filters(filters)
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
            present = self._layout.studies()
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
                    listing, compacted_writes, _ = self._planner.list_run(name, run)
                    return self.read_plan(resolve(listing, compacted_writes), wanted_columns, filters)
            else:
                def read_one(name=name):
                    return self.read_plan(self._planner.plan_study(name), wanted_columns, filters)
            tables.append(self._layout.retrying(f"reading study {name!r}", read_one))
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
        return to_frame(self._read(study, columns, filters))

    def stored_eval_keys(self, study: str, train_key: str | None = None, *, config_hash: str | None = None) -> set[str]:
        """One run's cells: its folder's written files and the indexes compactions left there, never a compacted
        file's rows (an index lists the cells of each write it took)."""
        key = train_key if train_key is not None else config_hash
        if not isinstance(key, str) or not key:
            raise UserError(f"stored_eval_keys: train_key must be a non-empty string, got {key!r}")
        check_study(study)

        def read_keys() -> set[str]:
            listing, compacted_writes, eval_keys = self._planner.list_run(study, key)
            plan = resolve(listing, compacted_writes)
            out: set[str] = set()
            for compacted, keep in plan.compacted:
                for write in (keep if keep is not None else compacted_writes[compacted.path]):
                    out.update(k for k in eval_keys.get(f"{compacted.path}|{write}", ()) if k)
            reads = Plan(plan.written, [], plan.layout_1, plan.layout_2_writes, plan.versions)
            table = self.read_plan(reads, ["eval_key"], {"train_key": key})
            out.update(k for k in table.column("eval_key").to_pylist() if k)
            return out

        return self._layout.retrying(f"reading run {key!r} of study {study!r}", read_keys)

