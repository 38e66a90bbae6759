"""The full run (``make bench-gpu``, ``python bench/gpu.py``): every part of :data:`gpucheck.sizes.PARTS` in order,
printed and appended to the run's dated log under ``bench/results/``; meant to take under 25 minutes on one H100.
The ``proxy`` and ``tests`` parts run pytest, so the full run needs the test suite's dependencies; the quick check
(:mod:`gpucheck.quick`) needs none."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from gpucheck.determinism import bench_determinism
from gpucheck.evaluation import bench_eval
from gpucheck.harness import Clock, Tee, append_log, say
from gpucheck.kernels import bench_attention
from gpucheck.plan import bench_plan
from gpucheck.pytests import run_cuda_tests
from gpucheck.recompiles import bench_recompiles
from gpucheck.report import print_targets, summary, targets
from gpucheck.sizes import GPU, PARTS, SMOKE, TOTAL_BUDGET_S
from gpucheck.training import bench_train
from gpucheck.variants import bench_variants
from machine import header
from machine import lines as machine_lines


def run(args, parts: list[str]) -> int:
    """The full run of ``parts`` with the parsed arguments of ``bench/gpu.py``."""
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("bench/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); "
              "use --smoke for the CPU check", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    sizes = SMOKE if args.smoke else GPU
    if args.dtype:
        sizes = dataclasses.replace(sizes, dtype=args.dtype)
    backend = args.compile_backend or ("none" if args.smoke else "inductor")
    backend = None if backend == "none" else backend
    append = (not args.smoke) if args.append is None else args.append
    clock = Clock(1e9 if args.smoke else TOTAL_BUDGET_S)
    tee = Tee(sys.stdout)
    results: dict = {"parts": parts, "smoke": args.smoke, "sizes": asdict(sizes), "compile_backend": backend}
    with contextlib.redirect_stdout(tee):
        info = header(device, ("triton",))
        results["header"] = info
        say(f"\n## The full GPU run (`bench/gpu.py{' --smoke' if args.smoke else ''}`): "
            f"{info['device'].split(',')[0]}, {info['date'][:10]}\n")
        for line in machine_lines(info):
            say(line)
        say(f"- parts: {', '.join(parts)}" + ("; no time allotments (smoke)\n" if args.smoke else
                                               f"; no item starts after {TOTAL_BUDGET_S // 60} min\n"))
        steps = {
            "proxy": lambda: run_cuda_tests(args.test_paths or ["tests"], sizes.budgets_s["proxy"], "cuda_proxy"),
            "plan": lambda: bench_plan(sizes, device, backend),
            "tests": lambda: run_cuda_tests(args.test_paths or ["tests"], sizes.budgets_s["tests"]),
            "attention": lambda: bench_attention(sizes, device, clock),
            "train": lambda: bench_train(sizes, device, clock, backend),
            "eval": lambda: bench_eval(sizes, device, clock, backend),
            "variants": lambda: bench_variants(sizes, device, clock),
            "determinism": lambda: bench_determinism(sizes, device, clock, backend),
            "recompiles": lambda: bench_recompiles(sizes, device, clock),
        }
        titles = {"proxy": "CPU tests of the CUDA paths (`pytest -m cuda_proxy`)", "plan": "Memory plan",
                  "tests": "CUDA tests (`pytest -m gpu`)", "attention": "Attention forward + backward",
                  "train": "Training throughput", "eval": "Evaluation throughput",
                  "variants": f"Every variant: a few {sizes.dtype} training steps",
                  "determinism": "LSSAR run twice: bit-identical gradients?",
                  "recompiles": "Graphs compiled by a p_eval sweep (studies/p_sweep.yaml's grid)"}
        for part in PARTS:
            if part not in parts:
                continue
            say(f"### {titles[part]}\n")
            clock.begin(sizes.budgets_s[part])
            results[part] = steps[part]()
            if part in ("proxy", "tests"):
                r = results[part]
                say(f"`{r['command']}`: {r['summary']} (rc {r['rc']}, {r['seconds']:.0f} s)")
                if r["tail"]:
                    say("\n```\n" + r["tail"].strip() + "\n```")
            say(f"\n({part}: {clock.part_elapsed():.0f} s)\n")
        say("### Targets (measured, not asserted)\n")
        results["targets"] = targets(results, device)
        print_targets(results["targets"])
        say("\n### What passed and what did not\n")
        results["summary"] = summary(results)
        for row in results["summary"]:
            say(f"- {row['part']}: **{row['verdict']}**{' - ' + row['detail'] if row['detail'] else ''}")
        results["seconds"] = time.monotonic() - clock.start
        say(f"\nTotal: {results['seconds'] / 60:.1f} min.")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    if append:
        print(f"appended to {append_log(args.results, info, 'full', tee.text())}")
    return 0

