"""``attnlab demo``: the README's main command, end to end on one machine.

Builds the offline demo corpus (once, into the attnlab cache), then runs on an embedded local Ray, with a local
results store and Tune state under ``--out``: ``studies/demo_text.yaml`` (real text: a cut of the byte-level CPU
proxy ``studies/proxy_text.yaml``, softmax vs LSSA vs LSSAR, val loss at 1x..16x), sized so that ``make demo``
takes at most 5 minutes on a 2-core machine, set-up included. ``--study`` runs others instead, e.g.
``studies/demo_probe.yaml`` (the copy-with-distractors probe, about 3 minutes more). Each study prints its table
and the path of its curves.
It only wires existing pieces (``attnlab.study``); no logic of its own.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from attnlab.errors import UserError
from attnlab.states import TrialStatus

DEFAULT_OUT = "demo-out"


DEFAULT_STUDIES = ("demo_text.yaml",)


def _default_studies() -> list[str]:
    """``studies/demo_text.yaml`` of the current folder (the repository's root, where ``make demo`` runs); the study
    files are the repository's, not part of the installed package."""
    paths = [Path("studies") / name for name in DEFAULT_STUDIES]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise UserError(f"{missing[0]}: not found here; run attnlab demo from the repository's root (where studies/ "
                        "is), or name the studies with --study FILE")
    return [str(p) for p in paths]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="build the demo corpus, run the real-text study locally, print its table and curves",
        description="The main command: prepare the offline demo corpus, then run on an embedded local Ray the "
                    "real-text study (UTF-8 bytes: softmax vs LSSA vs LSSAR, tiny GPT trained at 128 bytes, val loss "
                    "at 1x..16x), printing its table and the path of its curves; --study studies/demo_probe.yaml "
                    "runs the copy probe (softmax vs LSSAR, accuracy at 1x..16x). Everything is written under --out.")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")
    p.add_argument("--study", action="append", default=None,
                   help="a study to run, repeatable (default: studies/demo_text.yaml; the copy probe: "
                        "studies/demo_probe.yaml)")
    p.add_argument("--fresh", action="store_true", help="start the search over (finished trials are still reused)")
    p.add_argument("--verbose", action="store_true", help="show Ray's and Tune's own output (default: a log file)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from attnlab.study.runner import run_study
    from attnlab.study.spec import load_spec

    studies = args.study or _default_studies()
    for study in studies:
        if not Path(study).exists():
            raise UserError(f"--study {study}: no such file")
    specs = [load_spec(study) for study in studies]  # every file is validated before anything runs
    from attnlab.location import DEFAULT_RUNS, DEFAULT_STORE, Location

    out = Location.parse(args.out, field="--out")  # a folder, or s3:// / gs://
    out.mkdir()
    store, runs = out.child(DEFAULT_STORE).uri, out.child(DEFAULT_RUNS).uri
    if not os.environ.get("RAY_ADDRESS"):
        from attnlab.ray_runtime import ensure_ray

        # 4 logical CPUs on small machines: one trial driver + fractional Train workers fit with room to spare.
        ensure_ray(num_cpus=max(4, os.cpu_count() or 1), object_store_mb=256, log_to_driver=args.verbose)
    ok = True
    for spec in specs:
        summary = run_study(spec, store=store, runs=runs, resume=False if args.fresh else None,
                            curves_dir=out.child("curves", spec.name).uri, verbose=1 if args.verbose else 0,
                            quiet=not args.verbose, own_process=True)
        ok = ok and bool(summary.count(TrialStatus.COMPLETE))
    print(f"\ndemo done: tables above; curves in {out.child('curves').uri}; results store {store}")
    for spec in specs:
        metric = spec.objective[0].parts.metric
        print(f"  attnlab results table --store {store} --study {spec.name} --metric {metric}")
    if not args.study:
        print(f"the copy probe, about 3 minutes more (softmax vs LSSAR, accuracy at 1x..16x):\n"
              f"  attnlab demo --out {args.out} --study studies/demo_probe.yaml")
    print(f"watch and compare the studies in a browser:\n  attnlab serve --store {store} --runs {runs}"
          "   # then open http://127.0.0.1:8000/")
    return 0 if ok else 1
