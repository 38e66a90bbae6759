"""Training through the production step (:class:`attnlab.train.parts.ModelAndOptimizer`: its ``step`` accumulates
the micro-batches' gradients under the run's autocast, clips, and steps the recipe's AdamW), compiled in place as a
study's worker compiles it.

- :func:`bench_train`: the full run's ``train`` part (tokens/s and MFU of softmax, LSSA and LSSAR at the largest
  micro-batch that fits, one micro-batch a step).
- :func:`production_step`, :func:`random_steps`, :func:`run_steps`: what the quick check's part d
  (:mod:`gpucheck.quick_training`) and f (:mod:`gpucheck.checkpoint`) train with.
"""

from __future__ import annotations

import math
import time

import torch

from gpucheck.harness import Clock, fmt, free_memory, is_oom, llmc_reference, reset_dynamo, say, sync
from gpucheck.report import lssar_step_ratio
from gpucheck.sizes import VARIANTS, Sizes, gib, model_config, peak_vs_estimate, precision_label, train_estimate

LR = 6e-4  # the recipe's peak learning rate (docs/protocol.md#training), held for the few steps measured here


def batch_candidates(start: int) -> list[int]:
    """``start``, then halved down to 1: the micro-batches tried after an out-of-memory error."""
    out, b = [], start
    while b >= 1:
        out.append(b)
        b //= 2
    return out


def largest_fitting(run, start: int, device: torch.device) -> tuple[int | None, object, list[int]]:
    """``(micro_batch, run(micro_batch), the micro-batches that ran out of memory)``, halving from ``start``."""
    ooms = []
    for b in batch_candidates(start):
        try:
            return b, run(b), ooms
        except Exception as exc:  # noqa: BLE001
            if not is_oom(exc):
                raise
            ooms.append(b)
        # Outside the except block: the exception (and the tensors its frames hold) is gone by now.
        reset_dynamo()
        free_memory(device)
    return None, None, ooms


def precision_of(sizes) -> str:
    """The training config's ``precision`` for the run's dtype (bf16 autocast on CUDA, none on CPU)."""
    return "bf16" if sizes.dtype == "bfloat16" else "fp32"


def production_step(sizes, device: torch.device, name: str, p, compile_backend: str | None,
                    n_layer: int | None = None):
    """A :class:`ModelAndOptimizer` as a worker builds one: seed 0, the model compiled in place (``compile_backend``;
    None: eager), the recipe's AdamW (fused on CUDA)."""
    from attnlab.model import GPT, compile_model
    from attnlab.train.config import TrainConfig
    from attnlab.train.parts import ModelAndOptimizer
    from attnlab.train.recipe import build_optimizer

    torch.manual_seed(0)
    model = GPT(model_config(sizes, name, p, n_layer)).to(device)
    if compile_backend is not None:
        compile_model(model, True, backend=compile_backend)
    optimizer = build_optimizer(model, TrainConfig(preset=sizes.preset), device)
    return ModelAndOptimizer(model, optimizer, device, precision_of(sizes))


def random_steps(vocab_size: int, T: int, micro_batch: int, accum: int, steps: int, device: torch.device,
                 seed: int = 1) -> list[list[tuple]]:
    """``steps`` optimizer steps of ``accum`` micro-batches ``(x, y, None)`` of random tokens, on the device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(steps):
        micro = []
        for _ in range(accum):
            idx = torch.randint(0, vocab_size, (micro_batch, T + 1), device=device, generator=gen)
            micro.append((idx[:, :-1], idx[:, 1:], None))
        out.append(micro)
    return out


def run_steps(parts, steps: list[list[tuple]], accum: int) -> list[float]:
    """Each step through ``ModelAndOptimizer.step``; the mean micro-batch loss of each (read once, at the end)."""
    losses = [parts.step(batches, accum, LR, 1.0)[0] / accum for batches in steps]
    return [float(v) for v in losses]


def train_throughput(sizes: Sizes, device: torch.device, name: str, p, micro_batch: int, compile_backend: str | None,
                     n_layer: int | None = None) -> dict:
    """Tokens/s and MFU of ``sizes.train_steps`` timed steps after ``sizes.train_warmup`` warm-up steps."""
    from attnlab.train.recipe import peak_flops

    parts = production_step(sizes, device, name, p, compile_backend, n_layer)
    model, compiled = parts.model, compile_backend is not None
    estimate = train_estimate(sizes, model.cfg, micro_batch, compiled)
    T = sizes.train_len
    steps = random_steps(model.cfg.vocab_size, T, micro_batch, 1, sizes.train_warmup + sizes.train_steps, device)
    try:
        t0 = time.perf_counter()
        run_steps(parts, steps[:1], 1)
        sync(device)
        first_s = time.perf_counter() - t0
        run_steps(parts, steps[1:sizes.train_warmup], 1)
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        losses = run_steps(parts, steps[sizes.train_warmup:], 1)
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        tokens_per_s = micro_batch * T * sizes.train_steps / seconds
        peak_flops_s = peak_flops(device)
        mfu = model.flops_per_token(T) * tokens_per_s / peak_flops_s if peak_flops_s else None
        return {"variant": name, "p": p, "micro_batch": micro_batch, "compiled": compiled,
                "tokens_per_s": tokens_per_s, "step_ms": seconds / sizes.train_steps * 1e3, "mfu": mfu,
                "first_step_s": first_s, "peak_gib": peak, "estimate_gib": gib(estimate.tensor_bytes),
                "peak_vs_estimate": peak_vs_estimate(peak, gib(estimate.tensor_bytes)),
                "loss_finite": all(math.isfinite(x) for x in losses)}
    finally:
        del model, parts
        free_memory(device)


def bench_train(sizes: Sizes, device: torch.device, clock: Clock, compile_backend: str | None) -> list[dict]:
    say(f"{sizes.preset}, T = {sizes.train_len}, {precision_label(sizes)}, "
        f"{'compiled (' + compile_backend + ')' if compile_backend else 'eager'}, "
        f"AdamW{' (fused)' if device.type == 'cuda' else ''}, grad clip 1.0, {sizes.train_warmup} warm-up + "
        f"{sizes.train_steps} timed steps, one micro-batch per step, random tokens\n")
    say("| variant | micro-batch | tokens/s | step ms | MFU | peak GiB | estimate GiB | peak / estimate | "
        "first step s (compile) |")
    say("|---|---|---|---|---|---|---|---|---|")
    rows, start = [], sizes.max_micro_batch
    for name, p in VARIANTS:
        if clock.expired():
            rows.append({"variant": name, "p": p, "skipped": "time budget"})
            say(f"| {name} | skipped (time budget) | | | | | | | |")
            continue
        try:
            b, row, ooms = largest_fitting(
                lambda mb: train_throughput(sizes, device, name, p, mb, compile_backend), start, device)
        except Exception as exc:  # noqa: BLE001
            row, b, ooms = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}, None, []
        if row is None:
            row = {"error": "OOM at micro-batch 1"}
        row.update(variant=name, p=p, oom_micro_batches=ooms)
        if name == "softmax" and b:
            start = b  # lssa/lssar start their search at softmax's micro-batch
        rows.append(row)
        reset_dynamo()
        if "error" in row:
            say(f"| {name} | {row['error']} | | | | | | | |")
        else:
            say(f"| {name}{'' if p is None else f' p={p:g}'} | {row['micro_batch']} | {row['tokens_per_s']:,.0f} | "
                f"{row['step_ms']:.1f} | {fmt(row['mfu'], '.1%', 'unknown')} | {fmt(row['peak_gib'])} | "
                f"{fmt(row['estimate_gib'])} | {fmt(row['peak_vs_estimate'])} | {row['first_step_s']:.1f} |")
    ratio = lssar_step_ratio(rows)
    if ratio is not None:
        lssar = next(r for r in rows if r["variant"] == "lssar")
        softmax_row = next(r for r in rows if r["variant"] == "softmax")
        say(f"\nlssar: {lssar['step_ms']:.1f} ms per step at micro-batch {lssar['micro_batch']} against softmax's "
            f"{softmax_row['step_ms']:.1f} ms at {softmax_row['micro_batch']}: {ratio:.2f}x softmax's time per token")
    ref = llmc_reference(device)
    softmax = next((r for r in rows if r["variant"] == "softmax" and "tokens_per_s" in r), None)
    if ref and softmax:
        say(f"\nsoftmax: {softmax['tokens_per_s']:,.0f} tok/s = {softmax['tokens_per_s'] / ref[1]:.2f}x llm.c's "
            f"{ref[1] / 1e3:.0f}K tok/s per {ref[0]}")
    return rows
