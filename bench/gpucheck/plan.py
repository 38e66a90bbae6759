"""The full run's ``plan`` part: the memory plan's estimated peak of every training and evaluation configuration
the run measures, and the largest micro-batch that fits this device (:mod:`attnlab.model.memory`)."""

from __future__ import annotations

import torch

from gpucheck.harness import fmt, say
from gpucheck.sizes import (VARIANTS, Sizes, device_memory, eval_batch, eval_estimate, gib, model_config,
                            precision_name, train_estimate)


def bench_plan(sizes: Sizes, device: torch.device, compile_backend: str | None) -> list[dict]:
    """The estimated peak of every training and evaluation configuration the run measures, and what fits here."""
    from attnlab.model.memory import largest_micro_batch

    budget = device_memory(device)
    compiled = compile_backend is not None
    say(f"attnlab.model.memory, {precision_name(sizes)}, {'compiled' if compiled else 'eager'}; "
        f"device memory: {f'{gib(budget):.1f} GiB' if budget else 'none (CPU): the figures are what a GPU needs'}\n")
    say("| step | variant | T | batch | estimate GiB (total) | tensors GiB | fits | largest micro-batch that fits |")
    say("|---|---|---|---|---|---|---|---|")
    rows = []
    for name, p in VARIANTS:
        cfg = model_config(sizes, name, p)
        label = name if p is None else f"{name} p={p:g}"
        items = [("train", sizes.train_len, sizes.max_micro_batch, train_estimate(sizes, cfg, sizes.max_micro_batch,
                                                                                  compiled))]
        items += [("eval", m * sizes.train_len, eval_batch(sizes, m),
                   eval_estimate(sizes, cfg, m * sizes.train_len, eval_batch(sizes, m))) for m in sizes.eval_multiples]
        for step, T, batch, est in items:
            fits = None if budget is None else est.total <= budget
            largest = (largest_micro_batch(cfg, T, budget, precision=precision_name(sizes), compiled=compiled)
                       if budget is not None and step == "train" else None)
            rows.append({"step": step, "variant": name, "p": p, "T": T, "batch": batch, "estimate_gib": est.gib(),
                         "tensor_gib": gib(est.tensor_bytes), "breakdown": est.breakdown, "fits": fits,
                         "largest_micro_batch": largest})
            say(f"| {step} | {label} | {T} | {batch} | {est.gib():.2f} | {gib(est.tensor_bytes):.2f} | "
                f"{'-' if fits is None else 'yes' if fits else 'NO'} | {fmt(largest, 'd')} |")
    return rows


