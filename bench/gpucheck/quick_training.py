"""d. Training: GPT-2 small, softmax and LSSAR (on attnlab's Triton kernels: what ``auto`` picks on a GPU),
compiled, bf16, through the production step (``ModelAndOptimizer.step``, ``accum`` micro-batches a step): tokens/s,
MFU, the measured peak against the memory plan, LSSAR's step against softmax's, its MFU and first (compiling) step
against the targets, and the first steps run twice from the same state (identical losses?). When they differ, two
probes say whether an embedding's backward is bit-identical twice, eager and compiled; LSSAR's step is profiled (its
costliest CUDA kernels)."""

from __future__ import annotations

import math
import time

import torch

from gpucheck.harness import (FAIL, PASS, Context, Outcome, fmt, free_memory, one_line, reset_dynamo, say, sync,
                              wait_for_warmers)
from gpucheck.sizes import TARGETS, gib, peak_vs_estimate
from gpucheck.training import LR, precision_of, production_step, random_steps, run_steps

QUICK_VARIANTS = (("softmax", None), ("lssar", 15.0))


def warm(ctx: Context, name: str, p) -> None:
    """Compile what :func:`training` runs for ``name`` (its first step), in a background process."""
    sizes = ctx.sizes
    parts = production_step(sizes, ctx.device, name, p, ctx.compile_backend)
    steps = random_steps(parts.model.cfg.vocab_size, sizes.train_len, sizes.micro_batch, sizes.accum, 1, ctx.device)
    run_steps(parts, steps, sizes.accum)


def _profile_step(parts, batches, accum: int, rows: int = 12) -> list[dict]:
    """The CUDA kernels of one step, the costliest first (name, total ms, calls): where a slow step spends."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        parts.step(batches, accum, LR, 1.0)
        torch.cuda.synchronize()
    def device_us(e) -> float:
        return getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0) or 0

    events = sorted((e for e in prof.key_averages() if device_us(e) > 0), key=device_us, reverse=True)
    return [{"kernel": e.key[:120], "ms": round(device_us(e) / 1e3, 3), "calls": e.count} for e in events[:rows]]


def embedding_backward_twice(device: torch.device, compiled: bool) -> bool:
    """Whether an embedding's weight gradient (many repeated ids, as a batch of text has) is the same bit for bit
    when computed twice: atomics in its backward make training steps differ in the last bits."""
    weight = torch.randn(50257, 768, device=device, requires_grad=True)
    ids = torch.randint(0, 512, (16, 1024), device=device, generator=torch.Generator(device=device).manual_seed(0))
    grad = torch.randn(16, 1024, 768, device=device, generator=torch.Generator(device=device).manual_seed(1))

    def fn(w, i):
        return torch.nn.functional.embedding(i, w)

    f = torch.compile(fn, dynamic=False) if compiled else fn
    grads = []
    for _ in range(2):
        (g,) = torch.autograd.grad(f(weight, ids), weight, grad)
        grads.append(g)
    return bool(torch.equal(grads[0], grads[1]))


def _quick_one(ctx: Context, name: str, p) -> dict:
    from attnlab.model.memory import ALLOCATOR_OVERHEAD, estimate_train_step
    from attnlab.train.config import TrainConfig
    from attnlab.train.recipe import build_optimizer, peak_flops

    sizes, device = ctx.sizes, ctx.device
    warmed = wait_for_warmers(ctx, f"warm-train-{name}", 0.6)
    compiled_where = {True: "compiled ahead", False: "compiled here (the background compile had not finished)",
                      None: ""}[warmed]
    parts = production_step(sizes, device, name, p, ctx.compile_backend)
    model, T, B, accum = parts.model, sizes.train_len, sizes.micro_batch, sizes.accum
    # The starting weights, kept on the CPU: a copy on the GPU would count in the peak measured below.
    start = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    estimate = estimate_train_step(model.cfg, T, B, precision=precision_of(sizes),
                                   compiled=ctx.compile_backend is not None)
    steps = random_steps(model.cfg.vocab_size, T, B, accum, sizes.warmup_steps + sizes.timed_steps, device)
    row = {"variant": name if p is None else f"{name} p={p:g}", "micro_batch": B, "accum": accum,
           "compiled": compiled_where,
           "tokens_per_step": B * accum * T, "estimate_gib": gib(estimate.tensor_bytes),
           "allowance_gib": gib(estimate.tensor_bytes * (1 + ALLOCATOR_OVERHEAD))}
    t0 = time.perf_counter()
    losses = run_steps(parts, steps[:1], accum)
    sync(device)
    row["first_step_s"] = time.perf_counter() - t0  # the compile, forward and backward
    losses += run_steps(parts, steps[1:sizes.warmup_steps], accum)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    losses += run_steps(parts, steps[sizes.warmup_steps:], accum)
    seconds = time.perf_counter() - t0
    row["tokens_per_s"] = B * accum * T * sizes.timed_steps / seconds
    row["step_ms"] = seconds / sizes.timed_steps * 1e3
    peak = peak_flops(device)
    row["mfu"] = model.flops_per_token(T) * row["tokens_per_s"] / peak if peak else None
    row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    row["peak_vs_estimate"] = peak_vs_estimate(row["peak_gib"], row["estimate_gib"])
    row["losses"] = losses
    row["finite"] = all(math.isfinite(x) for x in losses)
    if device.type == "cuda":  # what stays between steps (weights, AdamW's moments; the grads were set to None)
        row["resident_gib"] = torch.cuda.memory_allocated(device) / 2**30
        if name != "softmax" and not ctx.clock.expired():
            try:
                row["profile"] = _profile_step(parts, steps[-1], accum)
            except Exception as exc:  # noqa: BLE001 - a diagnosis, not a verdict
                row["profile"] = [{"kernel": f"profile failed: {one_line(exc)}", "ms": 0, "calls": 0}]
            say(f"{name}'s step, its costliest CUDA kernels: " + "; ".join(
                f"{e['kernel'][:60]} {e['ms']:.1f} ms x{e['calls']}" for e in row["profile"][:8]))
    # The same first steps again from the same state: the weights put back, a new optimizer (as a resumed run
    # would hold its own), the same batches; the compiled graphs are reused.
    if not ctx.clock.expired():
        model.load_state_dict(start)
        parts.optimizer = build_optimizer(model, TrainConfig(preset=sizes.preset), device)
        again = run_steps(parts, steps[:sizes.repeat_steps], accum)
        row["repeat_losses"] = again
        row["identical"] = again == losses[:sizes.repeat_steps]
    del parts, model, start
    return row


def training(ctx: Context) -> Outcome:
    """Part d: softmax and LSSAR, compiled, through ``ModelAndOptimizer.step`` with accumulation."""
    sizes, device = ctx.sizes, ctx.device
    say(f"{sizes.preset}, T = {sizes.train_len}, micro-batch {sizes.micro_batch} x {sizes.accum} accumulated, "
        f"{sizes.dtype}{' autocast' if device.type == 'cuda' and sizes.dtype == 'bfloat16' else ''}, "
        f"{'compiled (' + ctx.compile_backend + ')' if ctx.compile_backend else 'eager'}; {sizes.warmup_steps} "
        f"warm-up + {sizes.timed_steps} timed steps; the first {sizes.repeat_steps} steps run again from the same "
        "state")
    say("| variant | tokens/s | step ms | MFU | first step s | peak GiB | plan GiB (tensors) | peak / plan | "
        "same losses twice |")
    say("|---|---|---|---|---|---|---|---|---|")
    rows, problems = [], []
    for name, p in QUICK_VARIANTS:
        if ctx.clock.expired():
            rows.append({"variant": name, "skipped": "time budget"})
            continue
        try:
            row = _quick_one(ctx, name, p)
        except Exception as exc:  # noqa: BLE001
            row = {"variant": name, "error": one_line(exc, 200)}
            problems.append(f"{name}: {row['error']}")
        finally:
            reset_dynamo()
            free_memory(device)
        rows.append(row)
        if "error" in row:
            continue
        if not row["finite"]:
            problems.append(f"{row['variant']}: a loss is not finite ({row['losses']})")
        if row.get("identical") is False:
            problems.append(f"{row['variant']}: the same steps twice gave other losses ({row['losses'][:3]} then "
                            f"{row['repeat_losses']})")
        if row["peak_gib"] is not None and row["peak_gib"] > row["allowance_gib"]:
            problems.append(f"{row['variant']}: peak {row['peak_gib']:.2f} GiB is over the plan's "
                            f"{row['allowance_gib']:.2f} GiB (tensors + allocator overhead)")
        say(f"| {row['variant']} | {row['tokens_per_s']:,.0f} | {row['step_ms']:.1f} | "
            f"{fmt(row['mfu'], '.1%', 'unknown')} | {row['first_step_s']:.1f} | {fmt(row['peak_gib'])} | "
            f"{fmt(row['estimate_gib'])} | {fmt(row['peak_vs_estimate'])} | "
            f"{'-' if 'identical' not in row else 'yes' if row['identical'] else 'NO'} |")
    done = {r["variant"].split()[0]: r for r in rows if "tokens_per_s" in r}
    bits = [f"{v} {r['tokens_per_s']:,.0f} tok/s (MFU {fmt(r['mfu'], '.0%', 'unknown')}, peak/plan "
            f"{fmt(r['peak_vs_estimate'])})" for v, r in done.items()]
    if "softmax" in done and "lssar" in done:
        ratio = done["softmax"]["tokens_per_s"] / done["lssar"]["tokens_per_s"]
        lssar = done["lssar"]
        mfu = lssar["mfu"]
        mfu_verdict = "not measured" if mfu is None else "met" if mfu >= TARGETS["lssar_mfu"] else "NOT met"
        bits.append(f"lssar step {ratio:.2f}x softmax's (<= {TARGETS['lssar_train_step']}: "
                    f"{'met' if ratio <= TARGETS['lssar_train_step'] else 'NOT met'}), MFU "
                    f"{fmt(mfu, '.0%', 'unknown')} (>= {TARGETS['lssar_mfu']:.0%}: {mfu_verdict}), first step "
                    f"{lssar['first_step_s']:.0f} s{' ' + lssar['compiled'] if lssar['compiled'] else ''}")
    probes = {}
    if device.type == "cuda" and any(r.get("identical") is False for r in done.values()):
        for compiled in (False, True):  # where the difference comes from: the embedding's backward?
            try:
                probes["compiled" if compiled else "eager"] = embedding_backward_twice(device, compiled)
            except Exception as exc:  # noqa: BLE001 - a probe, not a verdict
                probes["compiled" if compiled else "eager"] = one_line(exc)
        say(f"embedding backward computed twice, bit-identical: {probes}")
    same = [r.get("identical") for r in done.values()]
    bits.append("losses identical twice" if same and all(same) else
                "repeat not run (time)" if any(s is None for s in same) else "losses DIFFER twice")
    skipped = sum(1 for r in rows if "skipped" in r)
    figures = "; ".join(bits) + (f"; {skipped} variant(s) skipped for time" if skipped else "")
    return Outcome(FAIL if problems else PASS, ("; ".join(problems) + f" ({figures})") if problems else figures,
                   {"rows": rows, "embedding_backward_identical": probes})
