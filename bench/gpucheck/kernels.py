"""Attention kernels: forward (+ backward) time and peak memory against SDPA.

- :func:`bench_attention`: the full run's ``attention`` part (softmax through SDPA, LSSA and LSSAR through
  FlexAttention, forward + backward).
- :func:`kernels`: the quick check's part c: softmax through SDPA (FlashAttention), LSSA and LSSAR through
  FlexAttention, forward + backward, each as a multiple of SDPA's time and memory at the same length (a forward
  alone would be one more compile per method and length, a cold minute); the targets P1 (LSSAR's forward +
  backward within 2.5x SDPA's time at every length) and P2 (LSSAR's peak memory within 1.2x SDPA's at the
  longest) are judged from the figures (docs/gpu.md#the-quick-check).

CUDA events, the median of the repeats after the warm-up calls (the compile is not timed); memory:
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` minus what was allocated before the call.
"""

from __future__ import annotations

import statistics
import time

import torch

from gpucheck.harness import (FAIL, PASS, Clock, Context, Outcome, fmt, free_memory, is_oom, one_line, say, sync,
                              wait_for_warmers)
from gpucheck.sizes import TARGETS, Sizes

def measure_fwd_bwd(fn, q, k, v, repeats: int, device: torch.device, warmup: int = 2,
                    backward: bool = True) -> tuple[float, float | None]:
    """(median milliseconds, peak MiB above what was allocated before the call) of ``fn(q, k, v)`` and its
    backward (``backward=False``: the forward alone, without autograd)."""
    q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))
    grad_out = torch.randn_like(v)

    def call():
        if not backward:
            with torch.no_grad():
                fn(q, k, v)
            return
        fn(q, k, v).backward(grad_out)
        q.grad = k.grad = v.grad = None

    for _ in range(warmup):  # compiles, loads kernels
        call()
    sync(device)
    free_memory(device)
    peak = None
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return statistics.median(times), peak


def bench_attention(sizes: Sizes, device: torch.device, clock: Clock) -> list[dict]:
    from attnlab.attention import attend, get_variant

    dtype = getattr(torch, sizes.dtype)
    methods = [("softmax", None, "sdpa"), ("lssa", None, "flex"), ("lssar", 15.0, "flex")]
    rows = []
    say(f"B={sizes.att_batch}, H={sizes.att_heads} (B*H={sizes.att_batch * sizes.att_heads}), "
        f"d={sizes.head_dim}, {sizes.dtype}, median of {sizes.att_repeats} after {sizes.att_warmup} warm-up "
        "call(s)\n")
    say("| T | variant | backend | fwd+bwd ms | x SDPA | peak MiB | x SDPA |")
    say("|---|---|---|---|---|---|---|")
    for T in sizes.att_lengths:
        gen = torch.Generator(device=device).manual_seed(T)
        q, k, v = (torch.randn(sizes.att_batch, sizes.att_heads, T, sizes.head_dim, generator=gen, device=device,
                               dtype=dtype) for _ in range(3))
        ref = None
        for name, p, impl in methods:
            row = {"T": T, "variant": name, "p": p, "backend": impl, "ms": None, "peak_mib": None}
            if clock.expired():
                row["skipped"] = "time budget"
            else:
                spec = get_variant(name, p=p)
                try:
                    row["ms"], row["peak_mib"] = measure_fwd_bwd(lambda a, b, c: attend(a, b, c, spec, impl=impl),
                                                                 q, k, v, sizes.att_repeats, device,
                                                                 sizes.att_warmup)
                except Exception as exc:  # noqa: BLE001 - a figure that cannot be taken is reported, not fatal
                    row["error"] = "OOM" if is_oom(exc) else f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                free_memory(device)
            if name == "softmax":
                ref = row
            row["x_time"] = row["ms"] / ref["ms"] if row["ms"] and ref and ref["ms"] else None
            row["x_mem"] = (row["peak_mib"] / ref["peak_mib"] if row["peak_mib"] is not None and ref
                            and ref["peak_mib"] else None)
            note = row.get("error") or row.get("skipped")
            say(f"| {T} | {name}{'' if p is None else f' p={p:g}'} | {impl} | "
                f"{note or fmt(row['ms'])} | {fmt(row['x_time'])} | {fmt(row['peak_mib'], '.0f')} | "
                f"{fmt(row['x_mem'])} |")
            rows.append(row)
        del q, k, v
        free_memory(device)
    return rows




# --- the quick check's part c ------------------------------------------------------------------------------------

KERNEL_METHODS = (("softmax", None, "sdpa"), ("lssa", None, "flex"), ("lssar", 15.0, "flex"))


def _inputs(sizes, T: int, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(T)
    return [torch.randn(1, sizes.speed_heads, T, sizes.head_dim, generator=gen, device=device,
                        dtype=getattr(torch, sizes.dtype)) for _ in range(3)]


def warm(ctx: Context, only: str | None = None) -> None:
    """Compile what :func:`kernels` times (each FlexAttention method, or ``only`` that one, at each length, forward
    alone and with its backward), in a background process: the part then finds inductor's caches warm."""
    from attnlab.attention import attend, get_variant

    for T in ctx.sizes.speed_lengths:
        q, k, v = _inputs(ctx.sizes, T, ctx.device)
        for name, p, impl in KERNEL_METHODS:
            if impl == "flex" and only in (None, name):
                spec = get_variant(name, p=p)
                fn = lambda a, b, c, spec=spec: attend(a, b, c, spec, impl="flex")  # noqa: E731
                measure_fwd_bwd(fn, q, k, v, 1, ctx.device, warmup=1)
        del q, k, v
        free_memory(ctx.device)


def kernels(ctx: Context) -> Outcome:
    """Part c: forward and forward + backward of each method at each length, against SDPA's softmax."""
    from attnlab.attention import attend, get_variant

    sizes, device = ctx.sizes, ctx.device
    H, D = sizes.speed_heads, sizes.head_dim
    wait_for_warmers(ctx, "warm-kernels", 0.6)
    say(f"B=1, H={H}, d={D}, {sizes.dtype}; median of {sizes.speed_repeats} after 2 warm-up calls; peak = "
        "max_memory_allocated above the inputs")
    say("| T | variant | backend | fwd+bwd ms | x SDPA | fwd+bwd peak MiB | x SDPA |")
    say("|---|---|---|---|---|---|---|")
    rows, errors = [], []
    for T in sizes.speed_lengths:
        q, k, v = _inputs(sizes, T, device)
        ref = None
        for name, p, impl in KERNEL_METHODS:
            label = name if p is None else f"{name} p={p:g}"
            row = {"T": T, "variant": label, "backend": impl}
            if ctx.clock.expired():
                row["skipped"] = "time budget"
                rows.append(row)
                continue
            spec = get_variant(name, p=p)
            fn = lambda a, b, c, spec=spec, impl=impl: attend(a, b, c, spec, impl=impl)  # noqa: E731
            try:
                row["ms"], row["peak_mib"] = measure_fwd_bwd(fn, q, k, v, sizes.speed_repeats, device)
            except Exception as exc:  # noqa: BLE001 - one method that breaks is reported; the others run
                row["error"] = one_line(exc, 160)
                errors.append(f"{label} ({impl}) T={T}: {row['error']}")
            free_memory(device)
            if impl == "sdpa":
                ref = row
            for key, out in (("ms", "x_time"), ("peak_mib", "x_mem")):
                row[out] = row[key] / ref[key] if row.get(key) and ref and ref.get(key) else None
            rows.append(row)
            say(f"| {T} | {label} | {impl} | {row.get('error') or fmt(row.get('ms'))} | {fmt(row['x_time'])} | "
                f"{fmt(row.get('peak_mib'), '.0f')} | {fmt(row['x_mem'])} |")
        del q, k, v
        free_memory(device)
    lssar = [r for r in rows if r["variant"].startswith("lssar") and r.get("x_time") is not None]
    p1 = max((r["x_time"] for r in lssar), default=None)
    longest = max(lssar, key=lambda r: r["T"], default=None)
    p2 = longest.get("x_mem") if longest else None
    targets = {"P1": {"figure": p1, "limit": TARGETS["lssar_time"],
                      "met": None if p1 is None else p1 <= TARGETS["lssar_time"]},
               "P2": {"figure": p2, "limit": TARGETS["lssar_memory_16k"], "T": longest["T"] if longest else None,
                      "met": None if p2 is None else p2 <= TARGETS["lssar_memory_16k"]}}
    skipped = sum(1 for r in rows if "skipped" in r)

    def verdict(t):
        return "not measured" if t["met"] is None else "met" if t["met"] else "NOT met"

    lssar_at = {r["T"]: r for r in lssar}
    ratios = ", ".join(fmt(r["x_time"]) + "x" for r in lssar_at.values())
    figures = (f"lssar fwd+bwd {ratios} SDPA at T = "
               f"{', '.join(map(str, lssar_at))} (P1 <= {TARGETS['lssar_time']}x: {verdict(targets['P1'])}); "
               f"peak {fmt(p2)}x SDPA at T = {targets['P2']['T']} (P2 <= {TARGETS['lssar_memory_16k']}x: "
               f"{verdict(targets['P2'])})" + (f"; {skipped} skipped for time" if skipped else ""))
    data = {"rows": rows, "targets": targets, "skipped": skipped}
    missed = [k for k, t in targets.items() if t["met"] is False]
    if device.type != "cuda":  # CPU: the fused path is the unfused equivalence implementation, not a kernel
        missed = []
        figures = "CPU (smoke: no kernel, figures mean nothing): " + figures
    if errors or missed:
        return Outcome(FAIL, "; ".join(errors[:2] + [f"{k} not met" for k in missed]) + f" ({figures})", data)
    return Outcome(PASS, figures, data)
