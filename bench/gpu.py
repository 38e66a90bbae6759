"""The GPU check: the quick check a first GPU session runs (``--quick``), or the full measurement (default). Every
GPU figure of attention, training and evaluation comes from here (``bench/attention.py`` and ``bench/train.py``
measure on CPU).

``python bench/gpu.py --quick`` (``make gpu-check``): six parts, a. environment, b. fused vs reference, c. kernel
speed and memory, d. training, e. evaluation, f. checkpoint, within a total of 6 minutes (its goal on one H100 from
a cold start: docs/gpu.md#the-quick-check). It needs the site's torch (>= 2.9) and Triton, numpy, pandas, pyarrow,
pyyaml, tiktoken and pydantic; no Ray, no pytest, no network. Each part prints one line, PASS, FAIL or SKIP with
its figures, and is written as it ends to ``--json`` (default ``gpu-check/quick.json``) and ``--lines`` (default
``gpu-check/quick.md``); ``--append`` appends the section to ``--results`` (default: the run's dated log,
``bench/results/<date>-<gpu>-quick.md``). Exit status 1 when a part failed.

``python bench/gpu.py`` (``make bench-gpu``): the full run, meant to take under 25 minutes on one H100: the CPU
tests of the CUDA paths, the memory plan, the CUDA tests, attention, training, evaluation, every variant,
determinism, recompiles; appended to its dated log (``bench/results/<date>-<gpu>-full.md``; it runs pytest, so it
needs the test suite's dependencies).

``--smoke``: tiny shapes on CPU (or the GPU if there is one), no budgets; CI runs ``--quick --smoke`` with Ray
hidden so neither run rots. Without CUDA and without ``--smoke`` it exits 2 with one line.

The parts live in ``bench/gpucheck/`` (one module per part, one harness); the machine header is ``bench/machine.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # gpucheck and torch_floor, when run from anywhere or loaded by a test

import machine  # noqa: E402,F401  (puts platform/ on sys.path before attnlab is imported)
from gpucheck.sizes import PARTS, QUICK_PARTS  # noqa: E402


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="the quick check: six parts within 6 minutes in all, no Ray or pytest needed")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, no budgets; works without CUDA")
    ap.add_argument("--parts", default=None,
                    help=f"comma-separated subset: {','.join(QUICK_PARTS)} (--quick) or {','.join(PARTS)}")
    ap.add_argument("--append", dest="append", action="store_true", default=None,
                    help="append the run's section to --results (default: on for the full GPU run, off for --smoke and "
                         "--quick)")
    ap.add_argument("--no-append", dest="append", action="store_false")
    ap.add_argument("--results", default=None,
                    help="the file --append appends to (default: the run's dated log, bench/results/<date>-<gpu>-"
                         "<quick|full>.md)")
    ap.add_argument("--json", default=None,
                    help="write every figure to this JSON file (--quick: rewritten after each part; default "
                         "gpu-check/quick.json)")
    ap.add_argument("--lines", default=None,
                    help="--quick: the file each part's line is appended to as it ends (default gpu-check/quick.md)")
    ap.add_argument("--no-workers", action="store_true",
                    help="--quick: no background processes (part b's cases and every compile in this process)")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend (default: inductor on the GPU, none for --smoke; 'eager' captures "
                         "graphs without generating code)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="the full run's autocast dtype (default: bfloat16 on the GPU, float32 for --smoke)")
    ap.add_argument("--test-paths", nargs="+", default=None, help="what the full run's pytest -m gpu runs (tests/)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    allowed = QUICK_PARTS if args.quick else PARTS
    parts = [p.strip() for p in (args.parts or ",".join(allowed)).split(",") if p.strip()]
    unknown = [p for p in parts if p not in allowed]
    if unknown:
        ap.error(f"--parts={unknown[0]!r} is not allowed{' with --quick' if args.quick else ''}: use a "
                 f"comma-separated subset of {','.join(allowed)}")
    if args.quick and args.dtype:
        ap.error("--dtype is not allowed with --quick: the quick check runs float32 and bf16 where each belongs")
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print("bench/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); "
              "use --smoke for the CPU check", file=sys.stderr)
        return 2
    if args.quick:
        from gpucheck import quick

        args.append = bool(args.append)
        return quick.run(args, parts)
    from gpucheck import full

    return full.run(args, parts)


if __name__ == "__main__":
    sys.exit(main())
