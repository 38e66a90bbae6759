"""The quick check (``python bench/gpu.py --quick``, ``make gpu-check``): what a first GPU session must answer, with
the site's torch and Triton and no Ray, pytest or network; no part starts after 6 minutes (the goal for all six
on one H100 from a cold start: docs/gpu.md#the-quick-check).

Parts, lettered in the order of what they decide (each with a budget; an item that would start past it is skipped
and counted; no part starts after the run's total). They run in :data:`~gpucheck.sizes.QUICK_RUN_ORDER`: a, f, b,
e, c, d, the short ones before those that wait on compiles:

a. ``environment``: the GPU, driver, torch, CUDA, Triton, Python; the torch floor check.
b. ``agreement``: every registered variant and each shipped plugin, fused on this device against the float64 dense
   reference, forward and backward, float32 and bf16, at 1,024 and 4,096 tokens.
c. ``kernels``: the fused kernels against SDPA (softmax, LSSA, LSSAR; 1K to 16K tokens; forward, and forward +
   backward): time and peak memory, and the targets P1 and P2.
d. ``training``: GPT-2 small, softmax and LSSAR, compiled, bf16, through ``ModelAndOptimizer.step`` with
   accumulation: tokens/s, MFU, peak memory against the plan, and the same steps twice (identical losses?).
e. ``evaluation``: 1x..16x with a ``p_eval`` sweep through the evaluation's scoring: graphs compiled, peak memory
   against the plan.
f. ``checkpoint``: save and resume on the GPU; the RNG streams continue.

Part b's cases run in worker processes, and the compiles of c, d and e in warmers, all started as the check begins
(:mod:`gpucheck.background`; ``--no-workers``: everything in this process, one after another). Each part prints one
line, PASS, FAIL or SKIP with its figures, written at once to the JSON file and to the lines file (the run's
section, which ``--append`` adds to its dated log under ``bench/results/``). ``--smoke``: tiny shapes on CPU, no
budgets (CI runs it, Ray hidden).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from gpucheck.agreement import agreement, start_workers
from gpucheck.background import Background
from gpucheck.checkpoint import checkpoint
from gpucheck.environment import environment
from gpucheck.evaluation import evaluation
from gpucheck.harness import FAIL, Clock, Context, Recorder, append_log, run_part, say
from gpucheck.kernels import KERNEL_METHODS, kernels
from gpucheck.sizes import QUICK, QUICK_PARTS, QUICK_RUN_ORDER, QUICK_SMOKE
from gpucheck.quick_training import QUICK_VARIANTS, training
from machine import header
from machine import lines as machine_lines

PARTS = {"environment": ("a. environment", environment), "agreement": ("b. fused vs reference", agreement),
         "kernels": ("c. kernel speed and memory", kernels), "training": ("d. training", training),
         "evaluation": ("e. evaluation", evaluation), "checkpoint": ("f. checkpoint", checkpoint)}
assert tuple(PARTS) == QUICK_PARTS


def start_background(background: Background, sizes, parts: list[str], backend: str | None) -> None:
    """Part b's workers, and (when compiling) the warmers of parts c, d and e (:mod:`gpucheck.background`)."""
    if "agreement" in parts:
        n = start_workers(background, sizes)
        say(f"started {n} agreement worker process(es)")
    if backend is None:
        return  # nothing compiles: nothing to warm
    if "kernels" in parts:
        for name, _, impl in KERNEL_METHODS:
            if impl == "flex":
                background.start(f"warm-kernels-{name}", "warm-kernels", [name])
    if "training" in parts:
        for name, p in QUICK_VARIANTS:
            background.start(f"warm-train-{name}", "warm-train", [name, p])
    if "evaluation" in parts:
        background.start("warm-eval", "warm-eval", [])
    say(f"started the compile warmers: {', '.join(background.keys('warm-'))}")


def run(args, parts: list[str]) -> int:
    """The quick check of ``parts``; exit status 1 when a part failed, else 0."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sizes = QUICK_SMOKE if args.smoke else QUICK
    backend = args.compile_backend or ("none" if args.smoke else "inductor")
    backend = None if backend == "none" else backend
    clock = Clock(sizes.total_s)
    info = header(device, ("triton",))
    results = {"kind": "quick", "smoke": args.smoke, "header": info, "sizes": asdict(sizes),
               "compile_backend": backend, "selected": parts}
    json_path = Path(args.json or "gpu-check/quick.json")
    lines_path = Path(args.lines or "gpu-check/quick.md")
    recorder = Recorder(json_path, lines_path, results)
    title = (f"## Quick GPU check (`bench/gpu.py --quick{' --smoke' if args.smoke else ''}`): "
             f"{info['device'].split(',')[0]}, {info['date'][:10]}")
    for text in (title, "", *machine_lines(info), f"- compile: {backend or 'eager'}; budget: "
                 f"{'none (smoke)' if args.smoke else f'{sizes.total_s / 60:.0f} min in all'}", "",
                 "| part | verdict | figures | seconds |", "|---|---|---|---|"):
        recorder.line(text)
    say(title)
    background = None if args.no_workers else Background("QUICK_SMOKE" if args.smoke else "QUICK", backend)
    ctx = Context(sizes, device, clock, backend, background)
    outcomes = {}
    try:
        if background is not None:
            start_background(background, sizes, parts, backend)
        for key in QUICK_RUN_ORDER:
            if key in parts:
                name, fn = PARTS[key]
                outcomes[key] = run_part(ctx, recorder, key, name, sizes.budgets_s[key], fn)
    finally:
        if background is not None:
            background.stop()
            results["background"] = background.summary()
            for key, job in results["background"].items():
                if not key.startswith("agreement"):
                    say(f"background {key}: " + ("done" if job["done"] else "FAILED: " + str(job["error"])
                                                 if job["done"] is False else "did not finish")
                        + (f" in {job['seconds']:.0f} s" if job["seconds"] else ""))
            background.close()
    seconds = time.monotonic() - clock.start
    results["seconds"] = round(seconds, 1)
    failed = [k for k, o in outcomes.items() if o.status == FAIL]
    results["verdict"] = "FAIL" if failed else "PASS"
    recorder.save()
    recorder.line(f"\nTotal: {seconds / 60:.1f} min; {len(outcomes) - len(failed)} of {len(outcomes)} parts without "
                  f"a failure" + (f"; FAIL: {', '.join(failed)}" if failed else "") + ".")
    say(f"\nquick check: {'FAIL (' + ', '.join(failed) + ')' if failed else 'no failure'} in {seconds / 60:.1f} min; "
        f"results in {json_path} and {lines_path}")
    if args.append:
        print(f"appended to {append_log(args.results, info, 'quick', lines_path.read_text())}")
    return 1 if failed else 0


__all__ = ["PARTS", "run"]
if __name__ == "__main__":  # pragma: no cover - run through bench/gpu.py
    sys.exit("run: python bench/gpu.py --quick")
