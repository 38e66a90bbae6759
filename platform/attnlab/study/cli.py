"""``attnlab study run|validate|submit``: run a study YAML as a Ray Tune search, check it, or submit it as a Ray Job.

Thin argument handling only: the spec is ``attnlab.study.spec``, the Tune wiring ``attnlab.study.runner``, the
job submission ``attnlab.study.submit``. Bad input raises ``UserError`` (one line, exit 2).
"""

from __future__ import annotations

import argparse

from attnlab.errors import UserError
from attnlab.states import TrialStatus


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "study", help="run a study YAML as a Ray Tune + Optuna search (run, validate, submit)",
        description="Studies: one YAML file (see studies/) run as a Ray Tune search over attention variants, "
                    "scale factors and p; every trial trains with Ray Train, evaluates at 1x..16x and writes "
                    "to the results store.")
    sub = p.add_subparsers(dest="study_command", metavar="SUBCOMMAND")
    sub.required = True

    run = sub.add_parser(
        "run", help="run a study on the current Ray cluster (RAY_ADDRESS, or an embedded local one)",
        description="Run STUDY.yaml. Running it again resumes its Tune state (finished trials are not re-run); a "
                    "finished training run is never trained again, and only evaluation cells with no rows in the "
                    "store are measured (add a p_eval value or a length and re-run: nothing retrains).")
    run.add_argument("study", metavar="STUDY.yaml", help="the study file (examples: studies/*.yaml)")
    run.add_argument("--store", help="results store, a path or an s3://, gs:// URI (default: the study's store:, else "
                     "$ATTNLAB_STORAGE/results, else ./results)")
    run.add_argument("--runs", "--storage", dest="runs",
                     help="the runs folder: where the study keeps its Tune state, training runs and trial status, a "
                     "path or an s3://, gs:// URI (default: $ATTNLAB_STORAGE/runs, else ./runs; --storage is its "
                     "earlier name)")
    mode = run.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="require existing Tune state and resume it")
    mode.add_argument("--fresh", action="store_true",
                      help="start a new search even if Tune state exists (the old state is moved aside)")
    run.add_argument("--curves", metavar="DIR", help="a local folder for the curves (default <runs>/<study>/curves)")
    run.add_argument("--verbose", action="store_true",
                     help="show Ray's and Tune's own output here (default: a log file, whose path is printed, and a "
                     "line per trial change)")
    run.add_argument("--no-compact", dest="compact", action="store_false",
                     help="leave the study's small results files as written when it ends (default: merge them, as "
                     "`attnlab results compact` does)")
    add_plugin_argument(run)
    run.add_argument("--plugin-bundle", metavar="MODULE", help="the plugins' sources shipped as a package on the "
                     "job's path (set by `attnlab study submit`: the job reads no plugin file)")
    run.set_defaults(func=_run)

    val = sub.add_parser("validate", help="check a study file and print its trials and resources",
                         description="Validate STUDY.yaml: exit 0 and print the resolved trial count and "
                                     "resources, or exit 2 with a one-line error.")
    val.add_argument("study", metavar="STUDY.yaml", nargs="+", help="study files to check (nothing runs)")
    val.add_argument("--cluster", metavar="CLUSTER.yaml",
                     help="also check the resources fit this cluster config (a local train.data folder is then "
                     "taken to be the cluster's, and not looked for here)")
    add_plugin_argument(val)
    val.set_defaults(func=_validate)

    status = sub.add_parser("status", help="print a study's trials: each one's status and why it ended",
                            description="Print the trials of STUDY (its name, or its YAML file) as its runs folder "
                                        "records them: counts by status, then a line per trial (running, complete, "
                                        "cached, diverged, pruned, interrupted, failed or skipped), with its point, "
                                        "its run's key and its progress, objectives or reason. Reads files only: it "
                                        "starts nothing.")
    status.add_argument("study", metavar="STUDY", help="the study's name, or its YAML file (only its name: is read)")
    status.add_argument("--runs", "--storage", dest="runs",
                        help="the runs folder the study was run with (default: $ATTNLAB_STORAGE/runs, else ./runs)")
    status.set_defaults(func=_status)

    from attnlab.study.submit import add_submit_parser

    add_submit_parser(sub)


def add_plugin_argument(parser) -> None:
    parser.add_argument("--plugin", action="append", metavar="FILE_OR_MODULE",
                        help="an attention plugin (a .py file or an importable module) added to the study's plugins:, "
                        "repeatable (docs/plugins.md#plugins-in-studies)")


def _run(args: argparse.Namespace) -> int:
    from attnlab.study.runner import run_study
    from attnlab.study.spec import load_spec

    bundle = None
    if args.plugin_bundle:
        from attnlab.study.submit import read_bundle

        bundle = read_bundle(args.plugin_bundle)
    spec = load_spec(args.study, plugins=args.plugin or (), bundle=bundle)
    resume = True if args.resume else (False if args.fresh else None)
    summary = run_study(spec, store=args.store, runs=args.runs, resume=resume, curves_dir=args.curves,
                        verbose=1 if args.verbose else 0, quiet=not args.verbose, compact=args.compact,
                        own_process=True)
    # after the summary and the table: a study with a failed trial did not do what it was asked (exit 1), a trial
    # whose process died before it recorded a run included
    return 1 if summary.count(TrialStatus.FAILED) else 0


def _status(args: argparse.Namespace) -> int:
    import os

    from attnlab.location import runs_location
    from attnlab.names import check_study_name
    from attnlab.study.console import status_lines
    from attnlab.study.folder import StudyFolder

    name = args.study
    if name.endswith((".yaml", ".yml")) or os.path.isfile(name):
        import yaml

        try:
            with open(name) as f:
                loaded = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as exc:
            raise UserError(f"{name}: cannot be read as a study file ({type(exc).__name__}: {exc})") from None
        name = loaded.get("name") if isinstance(loaded, dict) else None
        if name is None:
            raise UserError(f"{args.study}: the study file has no name:")
    check_study_name(name, field="STUDY")
    state = StudyFolder(runs_location(args.runs), name)
    if state.saved_study() is None and not state.statuses():
        raise UserError(f"study {name}: nothing recorded at {state.loc.uri}; give the --runs it was run with")
    print("\n".join(status_lines(state)))
    return 0


def _validate(args: argparse.Namespace) -> int:
    from attnlab.study.spec import load_spec

    for path in args.study:
        spec = load_spec(path, plugins=args.plugin or ())
        notes = []
        if not args.cluster:  # a trial would fail on it: the prepared folder must be where the study runs
            from attnlab.data.source import check_prepared

            try:
                check_prepared(spec.train.data)
            except UserError as exc:
                raise UserError(f"{path}: {exc}") from None
        if args.cluster:
            from attnlab.study.fit import check_study_fits

            notes = check_study_fits(spec, args.cluster)
        print(f"{path}: ok")
        print("  " + spec.describe().replace("\n", "\n  "))
        for note in notes:
            print("  " + note)
    return 0

