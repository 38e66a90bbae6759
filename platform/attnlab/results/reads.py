"""Reads: rows as a DataFrame or an Arrow table, only the columns asked for, with the filters pushed into the scan
(row-group statistics prune compacted files), and one run's evaluation cells read from its own files only (the
skip-done check every trial makes). What each read opens is planned in :mod:`attnlab.results.plan`."""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from attnlab.errors import UserError
from attnlab.results.layout import _REMOTE_THREADS, VERSION_COLUMN, WRITE_COLUMN, check_study
from attnlab.results.plan import _Plan, _resolve, only_writes
from attnlab.results.schema import ARROW_SCHEMA, INPUT_ALIASES, SCHEMA_VERSION, STORED_NAMES, empty_table

_NULLABLE_INT_COLUMNS = ("layer", "n_tokens")
_SORT_COLUMNS = ("study", "trial", "step", "metric", "eval_len", "p_eval", "layer", "bucket", "task")


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


def _check_schema_version(table: pa.Table, uri: str) -> None:
    if table.num_rows and "schema_version" in table.column_names:
        newest = pc.max(table.column("schema_version")).as_py()
        if newest is not None and newest > SCHEMA_VERSION:
            raise UserError(f"results store {uri!r} holds schema version {newest}, newer than this attnlab "
                            f"(version {SCHEMA_VERSION}); upgrade attnlab to read it")


class _Reads:
    """Reading rows (a mixin of ResultsStore)."""

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
            table = self._read_compacted(compacted, read_columns, expr)
            add(only_writes(table, keep) if table.num_rows else table)
        if plan.layout_1:  # layout-1 files (attnlab.results.legacy)
            add(self._read_layout_1(plan.layout_1, plan.layout_2_writes, scanned, filters, versions))
        if not pieces:
            return out_schema.empty_table()
        table = pa.concat_tables(pieces)
        _check_schema_version(table, self.uri)
        return table

    def read_table(self, study: str | list[str] | None = None, columns: list[str] | None = None,
                   **filters) -> pa.Table:
        """Like :meth:`read`, as an Arrow table (rows in no particular order)."""
        table = self._read(study, columns, filters)
        return table.drop_columns([WRITE_COLUMN]) if WRITE_COLUMN in table.column_names else table

    def _read(self, study, columns, filters) -> pa.Table:
        if isinstance(study, str):
            check_study(study)
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

    def stored_eval_keys(self, study: str, train_key: str | None = None, *, config_hash: str | None = None) -> set[str]:
        """The evaluation cells (``eval_key``) stored for one training run of a study: lists the run's folder and
        reads its files and indexes only, so it costs the same in a study of 10 runs or 10,000. ``config_hash``
        is the old name of ``train_key``."""
        key = train_key if train_key is not None else config_hash
        if not isinstance(key, str) or not key:
            raise UserError(f"stored_eval_keys: train_key must be a non-empty string, got {key!r}")
        check_study(study)

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

