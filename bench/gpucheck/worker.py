"""One background process of the quick check (:mod:`gpucheck.background`):

``python -m gpucheck.worker JOB SIZES BACKEND PAYLOAD OUT``, with JOB one of ``agreement`` (PAYLOAD: the cases),
``warm-kernels``, ``warm-train`` (PAYLOAD: ``[name, p]``) or ``warm-eval``; SIZES ``QUICK`` or ``QUICK_SMOKE``;
BACKEND ``inductor``, ``eager`` or ``none``. Each result is one JSON line appended to OUT as it ends; the last line
says the job is done and how long it took.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from gpucheck import sizes as sizes_module
from gpucheck.harness import Clock, Context, one_line


def main(argv: list[str]) -> int:
    job, sizes_name, backend, payload, out = argv
    sizes = getattr(sizes_module, sizes_name)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ctx = Context(sizes, device, Clock(1e9), None if backend == "none" else backend)
    payload = json.loads(payload)
    t0 = time.perf_counter()

    def report(row: dict) -> None:
        with open(out, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    try:
        if job == "agreement":
            from gpucheck.agreement import run_cases

            run_cases(sizes, device, [tuple(c) for c in payload], report)
        elif job == "warm-kernels":
            from gpucheck.kernels import warm

            warm(ctx, *payload)
        elif job == "warm-train":
            from gpucheck.quick_training import warm

            warm(ctx, *payload)
        elif job == "warm-eval":
            from gpucheck.evaluation import warm

            warm(ctx)
        else:
            raise ValueError(f"job {job!r} is unknown: use agreement, warm-kernels, warm-train or warm-eval")
    except Exception as exc:  # noqa: BLE001 - the parent reads the failure; it compiles for itself
        report({"done": False, "error": one_line(exc, 500), "seconds": time.perf_counter() - t0})
        return 1
    report({"done": True, "seconds": round(time.perf_counter() - t0, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
