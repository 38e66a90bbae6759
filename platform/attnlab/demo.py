"""``attnlab demo``: the README's main command, end to end on one machine.

Builds the offline demo corpus (once, into the attnlab cache), runs ``studies/smoke.yaml`` on an embedded local
Ray with a local results store and Tune state under ``--out``, then prints the results table and the path of
the curves. It only wires existing pieces (``attnlab.study``); no logic of its own.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from attnlab.errors import UserError

DEFAULT_OUT = "demo-out"


def _default_study() -> str:
    """``studies/smoke.yaml`` of the current folder, else the one beside the package's source tree."""
    here = Path("studies/smoke.yaml")
    if here.exists():
        return str(here)
    repo = Path(__file__).resolve().parents[2] / "studies" / "smoke.yaml"
    return str(repo)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="build the demo corpus, run studies/smoke.yaml locally, print the table and curves",
        description="The main command: prepare the offline demo corpus, run the smoke study (softmax vs LSSA vs "
                    "LSSAR, tiny GPT, CPU) on an embedded local Ray, and print the extrapolation table and the "
                    "path of the curves. Everything is written under --out.")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")
    p.add_argument("--study", default=None, help="the study to run (default studies/smoke.yaml)")
    p.add_argument("--fresh", action="store_true", help="start the search over (finished trials are still reused)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from attnlab.study.runner import resolve_data, run_study
    from attnlab.study.spec import load_spec

    study = args.study or _default_study()
    if not Path(study).exists():
        raise UserError(f"--study {study}: no such file")
    spec = load_spec(study)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if spec.data == "demo":
        print(f"data: {resolve_data('demo')}", flush=True)
    if not os.environ.get("RAY_ADDRESS"):
        from attnlab.raycluster import ensure_ray

        # 4 logical CPUs on small machines: one trial driver + fractional Train workers fit with room to spare.
        ensure_ray(num_cpus=max(4, os.cpu_count() or 1), object_store_mb=256)
    summary = run_study(spec, store=str(out / "results"), storage=str(out / "runs"),
                        resume=False if args.fresh else None, curves_dir=str(out / "curves"))
    print(f"\ndemo done: table above; curves in {out / 'curves'}; results store {out / 'results'}")
    print(f"  attnlab results table --store {out / 'results'} --study {spec.name}")
    return 0 if summary.count("complete") else 1
