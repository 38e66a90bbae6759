"""``attnlab results table|curves|best|compare|laws|export|studies|schema|compact``: reports from a results store,
and merging a study's small files.

Thin argument handling only: reading and compaction are ``ResultsStore``'s, the reports
``attnlab.results.reports``. A report of one metric reads only that metric's rows (and table, curves and best
only the columns they show). No Ray here. Bad input raises ``UserError`` (printed by the top-level CLI as one
line, exit 2).
"""

from __future__ import annotations

import argparse
import os
import sys

from attnlab.errors import UserError
from attnlab.location import DEFAULT_STORE
from attnlab.results import reports
from attnlab.results.reports.rows import REPORT_COLUMNS, current_labels
from attnlab.results.schema import (COLUMNS, COMPLETE_METRIC, INPUT_ALIASES, SCALING_COLUMNS, describe_schema,
                                    stored_labels)
from attnlab.results.store import ResultsStore

_COLUMN_KINDS = {c.name: c for c in COLUMNS}


def _parse_where(items: list[str] | None) -> dict:
    """``--where COL=V1,V2``: equality or any-of; ``none`` means null for nullable columns."""
    filters: dict = {}
    for item in items or []:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise UserError(f"--where {item!r}: use COLUMN=VALUE or COLUMN=V1,V2")
        name = INPUT_ALIASES.get(name, name)  # config_hash: train_key's name before schema version 6
        column = _COLUMN_KINDS.get(name)
        if column is None:
            raise UserError(f"--where {item!r}: unknown column {name!r}; allowed: {', '.join(_COLUMN_KINDS)}")
        values = []
        for raw in text.split(","):
            raw = raw.strip()
            if raw.lower() == "none" and not column.required:
                values.append(None)
            elif column.kind == "int":
                try:
                    values.append(int(raw))
                except ValueError:
                    raise UserError(f"--where {item!r}: {name} takes integers, got {raw!r}") from None
            elif column.kind == "float":
                try:
                    values.append(float(raw))
                except ValueError:
                    raise UserError(f"--where {item!r}: {name} takes numbers or none, got {raw!r}") from None
            else:
                values.append(raw)
        filters[name] = values if len(values) > 1 else values[0]
    return filters


def _scaling_filters(filters: dict) -> tuple[dict, dict]:
    """``(what the store reads, what the rows must then say)``: a filter on a RoPE scaling column also reads the
    older spelling of its value (``yarn_paper`` was stored as ``yarn`` before schema 9) and keeps, once rows are read,
    those whose current label it is (:func:`attnlab.results.schema.current_label`)."""
    stored, wanted = dict(filters), {}
    for name in SCALING_COLUMNS:
        if name in filters:
            values = filters[name] if isinstance(filters[name], list) else [filters[name]]
            stored[name] = sorted({s for v in values for s in (stored_labels(v) if v is not None else [None])},
                                  key=lambda v: (v is None, v or ""))
            wanted[name] = values
    return stored, wanted


def _load(args, metric: str | None = None, columns: tuple[str, ...] | None = None):
    """The rows a report reads: with ``metric``, only that metric's rows (and only ``columns``), else all; when
    the metric has none, every row, so the report can say which metrics there are. Its RoPE scaling columns say
    what the rows measured (:func:`attnlab.results.reports.rows.current_labels`)."""
    store = ResultsStore(args.store)
    filters, wanted = _scaling_filters(_parse_where(getattr(args, "where", None)))

    def read(**kwargs):
        frame = current_labels(store.read(study=args.study, **filters, **kwargs))
        for name, values in wanted.items():
            frame = frame[frame[name].isin([v for v in values if v is not None])
                          | (frame[name].isna() if None in values else False)]
        return frame

    if metric is not None and metric != COMPLETE_METRIC and "metric" not in filters:
        frame = read(columns=list(columns) if columns else None, metric=metric)
        if len(frame):
            return frame
    frame = read()
    if len(frame) == 0:
        if not store.exists():
            raise UserError(f"--store {args.store!r}: no results store there (nothing has been written yet)")
        studies = store.studies()
        if args.study and args.study not in studies:
            raise UserError(f"--study {args.study!r} not in store {args.store!r}; studies: {', '.join(studies) or 'none'}")
        raise UserError(f"store {args.store!r}: no rows match the selection (--study/--where)")
    return frame


def _emit(text: str, out: str | None) -> None:
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w", encoding="utf-8") as handle:
            handle.write(text if text.endswith("\n") else text + "\n")
        print(out)
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")


def _table(args) -> int:
    result = reports.table(_load(args, args.metric, REPORT_COLUMNS), metric=args.metric, step=args.step)
    if args.format == "csv":
        text = reports.to_csv(result)
    else:
        text = reports.to_markdown(result, digits=args.digits, per_seed=args.per_seed)
        if args.reference:
            text += "\n\n" + reports.format_reference_table()
    _emit(text, args.out)
    return 0


def _curves(args) -> int:
    paths = reports.curves(_load(args, args.metric, REPORT_COLUMNS), args.out, metric=args.metric, by=args.by,
                           step=args.step)
    print(paths["png"])
    print(paths["html"])
    return 0


def _best(args) -> int:
    ranking = reports.best(_load(args, args.metric, REPORT_COLUMNS), at=args.at, metric=args.metric,
                           step=args.step)
    if args.top:
        ranking = ranking.head(args.top)
    text = reports.best_to_markdown(ranking, digits=args.digits) if args.format == "markdown" else \
        reports.best_to_csv(ranking)
    _emit(text, None)
    return 0


def _compare(args) -> int:
    if args.pairs:
        if args.a or args.b or args.at:
            raise UserError("--pairs FILE lists the comparisons: leave out --a, --b and --at")
        comparisons = reports.read_pairs(args.pairs)
    else:
        missing = [flag for flag, value in (("--a", args.a), ("--b", args.b), ("--at", args.at)) if not value]
        if missing:
            raise UserError(f"results compare needs {', '.join(missing)} (or --pairs FILE)")
        comparisons = [(args.a, b, at) for b in args.b for at in args.at]
    frame = _load(args, args.metric)
    paired = False if args.unpaired else None
    if len(comparisons) == 1:
        a, b, at = comparisons[0]
        result = reports.compare(frame, a=a, b=b, at=at, metric=args.metric, step=args.step, paired=paired)
        _emit(reports.format_comparison(result, digits=args.digits), None)
    else:
        results = reports.compare_family(frame, comparisons, metric=args.metric, step=args.step, paired=paired)
        _emit(reports.format_family(results, digits=args.digits), None)
    return 0


def _laws(args) -> int:
    result = reports.laws(_load(args), step=args.step)
    text = reports.laws_to_markdown(result, digits=args.digits) if args.format == "markdown" else \
        reports.laws_to_csv(result)
    _emit(text, args.out)
    return 0


def _export(args) -> int:
    print(reports.export(_load(args), args.out, format=args.format))
    return 0


def _studies(args) -> int:
    for name in ResultsStore(args.store).studies():
        print(name)
    return 0


def _schema(args) -> int:
    print(describe_schema())
    return 0


def _compact(args) -> int:
    store = ResultsStore(args.store)
    if args.study is not None:
        names = [args.study]
        if args.study not in store.studies():
            raise UserError(f"--study {args.study!r} not in store {args.store!r}; studies: "
                            f"{', '.join(store.studies()) or 'none'}")
    else:
        names = store.studies()
        if not names:
            raise UserError(f"--store {args.store!r}: no studies to compact (nothing has been written yet)")
    for name in names:
        print(store.compact(name).describe())
    return 0


def _store_options(parser: argparse.ArgumentParser, selection: bool = True) -> None:
    default = os.environ.get("ATTNLAB_STORE", DEFAULT_STORE)
    parser.add_argument("--store", default=default, metavar="URI",
                        help=f"results store: a folder or a pyarrow URI (file://, s3://, gs://); default {default!r} "
                             "(env ATTNLAB_STORE)")
    if selection:
        parser.add_argument("--study", default=None, metavar="NAME", help="only this study")
        parser.add_argument("--where", action="append", metavar="COL=V[,V2]",
                            help="keep rows whose column equals a value (several: any of; 'none' = null); repeatable")


def _report_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metric", default="val_loss", help="metric to report (default val_loss; e.g. acc, bpb)")
    parser.add_argument("--step", default="final",
                        help="'final' (each run's last step, default), 'all', or a step number")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "results", help="tables, curves, rankings and exports from a results store",
        description="Reports from a results store (long-format Parquet rows written by eval and studies).",
    )
    sub = parser.add_subparsers(dest="results_command", metavar="REPORT")
    sub.required = True

    p = sub.add_parser("table", help="Table-4 layout: one row per configuration, one column per eval length",
                       description="One row per configuration (constant columns dropped from the label), one "
                                   "column per eval length: mean ± sample std over seeds (n) and the 95% Student "
                                   "t interval of the mean; a single run is marked '1 seed'.")
    _store_options(p)
    _report_options(p)
    p.add_argument("--format", choices=("markdown", "csv"), default="markdown",
                   help="markdown (the paper's Table 4 layout, default) or csv (one column per statistic)")
    p.add_argument("--digits", type=int, default=4, help="decimals in markdown cells (default 4)")
    p.add_argument("--reference", action="store_true", help="also print the paper's Table 4 (docs/reference-numbers.md#table-4)")
    p.add_argument("--per-seed", action="store_true", help="markdown cells also list each seed's value")
    p.add_argument("--out", default=None, metavar="FILE", help="write to FILE instead of stdout")
    p.set_defaults(func=_table)

    p = sub.add_parser("curves", help="PNG + HTML of the metric vs eval length (or vs p with --by p)",
                       description="Metric against eval length (log2 x axis, one line per configuration; the "
                                   "paper's Figure 1), or with --by p against p per length (its Figure 2).")
    _store_options(p)
    _report_options(p)
    p.add_argument("--by", choices=("length", "p"), default="length",
                   help="x axis: length (evaluation length, 1x..16x; default) or p (the sharpening power, one line "
                        "per length; p_eval none = as trained)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for <metric>_vs_<by>.png/.html")
    p.set_defaults(func=_curves)

    p = sub.add_parser("best", help="rank configurations at one eval length",
                       description="Rank configurations by the metric at one eval length (lower is better for "
                                   "losses, higher for accuracies).")
    _store_options(p)
    _report_options(p)
    p.add_argument("--at", required=True, metavar="LENGTH", help="eval length (16384, 16k) or multiple of train_len (16x)")
    p.add_argument("--top", type=int, default=None, help="show only the first N")
    p.add_argument("--format", choices=("markdown", "csv"), default="markdown", help="markdown (default) or csv")
    p.add_argument("--digits", type=int, default=4, help="decimals in markdown cells (default 4)")
    p.set_defaults(func=_best)

    p = sub.add_parser("compare", help="is configuration b different from a at one length? difference, interval, test",
                       description="The difference b - a of the metric at one eval length, mean over seeds, with "
                                   "its 95% interval and test: the paired t and an exact sign-flip test when both "
                                   "sides have the same seeds (children of one parent, or runs of one seed), else "
                                   "Welch's t and an exact permutation test; the smallest difference the design "
                                   "detects with 80% power; a plain verdict (not significant / n too small to "
                                   "test). --a/--b name an attention variant, optionally pinned: --a "
                                   "softmax,p_eval=15. Each must pick one configuration: pin the others with --where "
                                   "(e.g. --where rope_scaling=none). Several --b or --at (every b at every length), "
                                   "or --pairs FILE, make one family: each line prints its raw and its "
                                   "Holm-adjusted p.")
    _store_options(p)
    _report_options(p)
    p.add_argument("--a", metavar="VARIANT[,COL=V]", help="the reference configuration, e.g. softmax")
    p.add_argument("--b", action="append", metavar="VARIANT[,COL=V]",
                   help="the configuration compared with it, e.g. lssar; repeatable (a family)")
    p.add_argument("--at", action="append", metavar="LENGTH",
                   help="eval length (1024, 1k) or multiple of train_len (16x); repeatable (a family)")
    p.add_argument("--pairs", metavar="FILE", help="a family of comparisons from a file, one 'A B AT' a line "
                   "(# comments): instead of --a/--b/--at")
    p.add_argument("--unpaired", action="store_true",
                   help="Welch's t even when both sides have the same seeds (default: paired where the design allows)")
    p.add_argument("--digits", type=int, default=4, help="decimals in the printed difference and interval (default 4)")
    p.set_defaults(func=_compare)

    p = sub.add_parser("laws", help="the force law each orbit-study trial's probe recovered (variant, seed, law)",
                       description="Per trial and force probe of an orbit study: the law recovered by symbolic "
                                   "regression of the probe's forces (in r, m1, m2), its exponents, its distance "
                                   "from Newton's G m1 m2 / r^2, the fit and probe errors, and the power-law fit.")
    _store_options(p)
    p.add_argument("--step", default="final", help="'final' (each run's last step, default) or a step number")
    p.add_argument("--format", choices=("markdown", "csv"), default="markdown", help="markdown (default) or csv")
    p.add_argument("--digits", type=int, default=3, help="decimals in markdown cells (default 3)")
    p.add_argument("--out", default=None, metavar="FILE", help="write to FILE instead of stdout")
    p.set_defaults(func=_laws)

    p = sub.add_parser("export", help="write the selected rows as Parquet or CSV")
    _store_options(p)
    p.add_argument("--format", choices=("parquet", "csv"), default=None, help="default: from the --out suffix")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="file to write: .parquet or .csv (a local path; the folder is created)")
    p.set_defaults(func=_export)

    p = sub.add_parser("studies", help="list the studies in the store")
    _store_options(p, selection=False)
    p.set_defaults(func=_studies)

    p = sub.add_parser("schema", help="print the results-row schema")
    p.set_defaults(func=_schema)

    p = sub.add_parser("compact", help="merge a study's small files into one (reads then touch one file)",
                       description="Merge every file of a study (one per write and run, and files of stores written "
                                   "before schema 6) into one compacted file, leaving each run an index of its cells. "
                                   "Safe while studies write and read: nothing "
                                   "is read twice or missed, a later write of a key still replaces its rows, and a "
                                   "crash leaves a readable store (run it again to finish). See "
                                   "docs/results-store.md.")
    _store_options(p, selection=False)
    p.add_argument("--study", default=None, metavar="NAME", help="only this study (default: every study)")
    p.set_defaults(func=_compact)
