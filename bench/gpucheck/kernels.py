"""Attention kernels: forward (+ backward) time and peak memory against SDPA.

- :func:`bench_attention`: the full run's ``attention`` part (:data:`KERNEL_METHODS`, forward + backward).
- :func:`kernels`: the quick check's part c: softmax through SDPA (FlashAttention), LSSA and LSSAR through
  attnlab's Triton kernels (what ``auto`` runs on a GPU) and through FlexAttention (the path they replaced), forward
  + backward, each as a multiple of SDPA's time and memory at the same length (a forward alone would be one more
  compile per method and length, a cold minute); the targets, judged on the Triton rows (docs/gpu.md#the-quick-check):
  P1, LSSAR's forward + backward within 3x SDPA's time at 1K and 2.5x at 4K and 16K; P2, LSSAR's peak memory within
  1.25x SDPA's at the longest; P3, LSSA's within 1.6x at 4K and 16K.

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
    methods = [m for m in KERNEL_METHODS if runnable(m[2], device) is None]
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

# (variant, p, backend): the Triton rows are what auto runs on a GPU; the FlexAttention rows, the path they replaced.
KERNEL_METHODS = (("softmax", None, "sdpa"), ("lssa", None, "triton"), ("lssar", 15.0, "triton"),
                  ("lssa", None, "flex"), ("lssar", 15.0, "flex"))


def runnable(impl: str, device: torch.device) -> str | None:
    """Why ``impl`` cannot run on ``device`` here (the Triton kernels on CPU need Triton's interpreter), or None."""
    if impl != "triton":
        return None
    from attnlab.attention.kernels import device_refusal

    return device_refusal(device)


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


def _targets(rows: list[dict]) -> dict:
    """P1-P3 from the Triton rows (docs/gpu.md#the-quick-check): each with its figure, limit and verdict."""
    def triton_rows(name, key):
        return [r for r in rows if r["variant"].split()[0] == name and r["backend"] == "triton"
                and r.get(key) is not None]

    def worst(name, lengths):
        return max((r["x_time"] for r in triton_rows(name, "x_time") if r["T"] in lengths), default=None)

    def met(figure, limit):
        return None if figure is None else figure <= limit

    long_lengths = {4096, 16384}
    p1_long, p1_1k = worst("lssar", long_lengths), worst("lssar", {1024})
    verdicts = [v for v in (met(p1_long, TARGETS["lssar_time"]), met(p1_1k, TARGETS["lssar_time_1k"])) if v is not None]
    longest = max(triton_rows("lssar", "x_mem"), key=lambda r: r["T"], default=None)
    p2 = longest["x_mem"] if longest else None
    p3 = worst("lssa", long_lengths)
    return {"P1": {"figure": p1_long, "limit": TARGETS["lssar_time"], "at_1k": p1_1k,
                   "limit_1k": TARGETS["lssar_time_1k"], "met": all(verdicts) if verdicts else None},
            "P2": {"figure": p2, "limit": TARGETS["lssar_memory_16k"], "T": longest["T"] if longest else None,
                   "met": met(p2, TARGETS["lssar_memory_16k"])},
            "P3": {"figure": p3, "limit": TARGETS["lssa_time"], "met": met(p3, TARGETS["lssa_time"])}}


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
            refusal = runnable(impl, device)
            if refusal is not None or ctx.clock.expired():
                row["skipped"] = refusal or "time budget"
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
    targets = _targets(rows)
    skipped = sum(1 for r in rows if "skipped" in r)

    def verdict(t):
        return "not measured" if t["met"] is None else "met" if t["met"] else "NOT met"

    def ratios(name, impl):
        at = {r["T"]: r for r in rows if r["variant"].split()[0] == name and r["backend"] == impl
              and r.get("x_time") is not None}
        return ", ".join(f"{fmt(r['x_time'])}x" for r in at.values()) + f" SDPA at T = {', '.join(map(str, at))}"

    t = targets
    figures = (f"lssar fwd+bwd triton {ratios('lssar', 'triton')}, flex {ratios('lssar', 'flex')} (P1 <= "
               f"{TARGETS['lssar_time_1k']}x at 1K, {TARGETS['lssar_time']}x at 4K/16K: {verdict(t['P1'])}); "
               f"lssa triton {ratios('lssa', 'triton')} (P3 <= {TARGETS['lssa_time']}x: {verdict(t['P3'])}); "
               f"lssar peak {fmt(t['P2']['figure'])}x SDPA at T = {t['P2']['T']} (P2 <= "
               f"{TARGETS['lssar_memory_16k']}x: {verdict(t['P2'])})" +
               (f"; {skipped} skipped ({'; '.join(sorted({r['skipped'] for r in rows if 'skipped' in r}))})"
                if skipped else ""))
    data = {"rows": rows, "targets": targets, "skipped": skipped}
    missed = [k for k, target in targets.items() if target["met"] is False]
    if device.type != "cuda":  # CPU: FlexAttention's unfused implementation and Triton's interpreter: no kernel
        missed = []
        figures = "CPU (smoke: no kernel, figures mean nothing): " + figures
    if errors or missed:
        return Outcome(FAIL, "; ".join(errors[:2] + [f"{k} not met" for k in missed]) + f" ({figures})", data)
    return Outcome(PASS, figures, data)
