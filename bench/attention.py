"""Benchmark: time and peak memory of the fused (FlexAttention) and dense forms of each fusable variant, as
ratios to SDPA softmax (FlashAttention on GPU), forward and forward + backward (not a test; prints figures).

GPU (``--device cuda``, the default when one is present): every fusable variant of the registry (plus
``softmax`` and ``sigmoid_l1`` re-weighted with p = 15) at T = 1K, 2K, 4K, 8K, 16K, batch 1, 12 heads of 64,
bf16. Time: CUDA events, median of ``--repeats`` calls after two warm-up calls (the compile is not timed).
Memory: ``torch.cuda.max_memory_allocated`` during the call minus what was allocated before it (inputs and,
for forward + backward, their gradients are counted alike for every method). Targets (issue 7): fused LSSAR
peak memory at 16K within 1.2x of SDPA, fused LSSAR forward + backward time within 2.5x of SDPA.

CPU (``--device cpu``): compiled FlexAttention on CPU has no backward and no LSE, so the fused path runs
FlexAttention's unfused implementation there; the figures that mean something are memory ratios of the dense
reference against the fused forms that exist on CPU: SDPA softmax (a fused CPU kernel) and compiled
FlexAttention for the one-pass variants (``lssa``, inference only). Memory: the peak resident set size during
the call minus the resident set size just before it, sampled every 0.2 ms from ``/proc/self/statm`` in a fresh
subprocess per measurement, with ``MALLOC_MMAP_THRESHOLD_`` set so that freed tensors leave the resident set
(``tracemalloc`` does not see torch's allocations). The analytic size of one (B, H, T, T) float32 matrix is
printed beside it. CPU times are printed but are only indicative on a shared machine (the load is printed).

Run: ``python bench/attention.py [--device cuda|cpu] [--lengths 1024 2048 ...] [--variants lssar softmax ...]``.
Hardware, versions and date are printed too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform as _platform  # the stdlib module (this file is not inside the attnlab package)
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.nn.functional as F

GPU_LENGTHS = (1024, 2048, 4096, 8192, 16384)
CPU_LENGTHS = (1024, 2048, 4096)
EXTRA_SHARPENED = (("softmax", 15.0), ("sigmoid_l1", 15.0))


def fusable_variants() -> list[tuple[str, float | None]]:
    """One ``(name, p)`` per distinct fusable spec of the registry, plus the re-weighted baselines of Table 4."""
    from attnlab.attention import get_variant, variant_names
    from attnlab.attention.flex import is_fusable

    seen, out = set(), []
    for name in variant_names():
        spec = get_variant(name)
        key = spec.replace(name="", source="")
        if is_fusable(spec) and key not in seen:
            seen.add(key)
            out.append((spec.name, spec.p))
    return sorted(set(out)) + list(EXTRA_SHARPENED)


def header(device: str) -> str:
    lines = [f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
             f"python {_platform.python_version()}, torch {torch.__version__}, {_platform.platform()}"]
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        lines.append(f"GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}")
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    lines.append(f"CPU: {cpu}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    return "\n".join(lines)


def _method(kind: str, name: str | None, p: float | None):
    """A function ``(q, k, v) -> out`` for ``sdpa``, ``fused``, ``dense`` or ``fused-compiled-cpu``."""
    if kind == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    from attnlab.attention import get_variant
    from attnlab.attention.dense import attend_dense
    from attnlab.attention.flex import attend_flex

    spec = get_variant(name, p=p)
    if kind == "dense":
        return lambda q, k, v: attend_dense(q, k, v, spec)
    if kind == "fused":
        return lambda q, k, v: attend_flex(q, k, v, spec)
    if kind == "fused-compiled-cpu":  # one-pass variants only: compiled CPU FlexAttention, inference
        from torch.nn.attention.flex_attention import flex_attention

        from attnlab.attention.flex import Sizes, first_stage_score_mod, inverse_norm
        from attnlab.attention.masks import causal_block_mask

        assert spec.p is None, "compiled FlexAttention on CPU returns no LSE: one-pass variants only"
        compiled = torch.compile(flex_attention, dynamic=False)

        def run(q, k, v):
            norms = (inverse_norm(q), inverse_norm(k)) if spec.qk_norm else ()
            mod = first_stage_score_mod(spec, Sizes(q.shape[-1], q.shape[-2]), norms).bound()
            return compiled(q, k, v, score_mod=mod, block_mask=causal_block_mask(q.shape[-2], q.device), scale=1.0)
        return run
    raise ValueError(kind)


# --- GPU ----------------------------------------------------------------------------------------------------

def measure_cuda(fn, q, k, v, backward: bool, repeats: int) -> tuple[float, float]:
    """(median milliseconds, peak MiB above the memory allocated before the call)."""
    q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))
    grad_out = torch.randn_like(v) if backward else None

    def call():
        out = fn(q, k, v)
        if backward:
            out.backward(grad_out)
            q.grad = k.grad = v.grad = None

    for _ in range(2):
        call()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20


def bench_cuda(args) -> None:
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096
    dtype = getattr(torch, args.dtype)
    variants = [(n, p) for n, p in fusable_variants() if not args.variants or n in args.variants]
    print(header("cuda"))
    print(f"shape: B={args.batch}, H={args.heads}, D={args.head_dim}, {args.dtype}; repeats={args.repeats}\n")
    for T in args.lengths:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(args.batch, args.heads, T, args.head_dim, device="cuda", dtype=dtype,
                               generator=gen) for _ in range(3))
        rows = [("sdpa softmax", "sdpa", None, None)]
        for name, p in variants:
            label = name if p is None or name == "lssar" else f"{name} p={p:g}"
            rows += [(f"{label} fused", "fused", name, p), (f"{label} dense", "dense", name, p)]
        results = {}
        for label, kind, name, p in rows:
            fn = _method(kind, name, p)
            for backward in (False, True):
                try:
                    results[label, backward] = measure_cuda(fn, q, k, v, backward, args.repeats)
                except torch.cuda.OutOfMemoryError:
                    results[label, backward] = None
                torch.cuda.empty_cache()
        print(f"### T = {T}\n")
        print("| method | fwd ms | x SDPA | fwd MiB | x SDPA | fwd+bwd ms | x SDPA | fwd+bwd MiB | x SDPA |")
        print("|---|---|---|---|---|---|---|---|---|")
        for label, *_ in rows:
            cells = []
            for backward in (False, True):
                res, ref = results[label, backward], results["sdpa softmax", backward]
                if res is None:
                    cells += ["OOM", "", "OOM", ""]
                else:
                    cells += [f"{res[0]:.2f}", f"{res[0] / ref[0]:.2f}", f"{res[1]:.0f}",
                              f"{res[1] / max(ref[1], 1e-9):.2f}"]
            print(f"| {label} | " + " | ".join(cells) + " |")
        print(flush=True)


# --- CPU ----------------------------------------------------------------------------------------------------

def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_cpu_child(spec: dict) -> dict:
    """One measurement in this (fresh) process: seconds and peak RSS increase of one call at length T."""
    torch.manual_seed(0)
    B, H, D, T = spec["batch"], spec["heads"], spec["head_dim"], spec["T"]
    backward = spec["backward"]
    fn = _method(spec["kind"], spec["name"], spec["p"])

    def inputs(length):
        return [torch.randn(B, H, length, D).requires_grad_(backward) for _ in range(3)]

    def call(q, k, v):
        out = fn(q, k, v)
        if backward:
            out.backward(torch.ones_like(out))
        return out

    with torch.no_grad() if not backward else torch.enable_grad():
        warm = inputs(T if spec["kind"] == "fused-compiled-cpu" else 64)  # loads kernels; compiles at T
        call(*warm)
        del warm
        q, k, v = inputs(T)
        before = peak = _rss_bytes()
        done = threading.Event()

        def sample():
            nonlocal peak
            while not done.is_set():
                peak = max(peak, _rss_bytes())
                time.sleep(0.0002)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        start = time.perf_counter()
        out = call(q, k, v)
        seconds = time.perf_counter() - start
        done.set()
        sampler.join()
        peak = max(peak, _rss_bytes())
        del out
    return {"seconds": seconds, "peak_mib": (peak - before) / 2**20}


def measure_cpu(spec: dict) -> dict | None:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    proc = subprocess.run([sys.executable, __file__, "--cpu-child", json.dumps(spec)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  [{spec['kind']} {spec['name']} T={spec['T']}: failed: {proc.stderr.strip().splitlines()[-1:]}]")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_cpu(args) -> None:
    print(header("cpu"))
    B, H, D = args.batch, args.heads, args.head_dim
    print(f"shape: B={B}, H={H}, D={D}, float32; one call per measurement, each in a fresh process\n")
    rows = [("sdpa softmax", "sdpa", None, None, False), ("sdpa softmax", "sdpa", None, None, True),
            ("lssa fused (compiled, inference)", "fused-compiled-cpu", "lssa", None, False),
            ("lssa dense", "dense", "lssa", None, False), ("lssa dense", "dense", "lssa", None, True),
            ("lssar dense", "dense", "lssar", 15.0, False), ("lssar dense", "dense", "lssar", 15.0, True)]
    if args.unfused_flex:  # FlexAttention's unfused CPU implementation: materialises the scores
        rows += [("lssa flex, unfused CPU form", "fused", "lssa", None, False),
                 ("lssar flex, unfused CPU form", "fused", "lssar", 15.0, False)]
    print("| T | method | pass | seconds | peak MiB | x SDPA fwd MiB | x compiled lssa MiB | one (B,H,T,T) fp32 MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for T in args.lengths:
        res = {}
        for label, kind, name, p, backward in rows:
            spec = dict(kind=kind, name=name, p=p, backward=backward, T=T, batch=B, heads=H, head_dim=D)
            res[label, backward] = measure_cpu(spec)
        sdpa = res["sdpa softmax", False]
        fused = res["lssa fused (compiled, inference)", False]
        square = B * H * T * T * 4 / 2**20
        for label, kind, name, p, backward in rows:
            r = res[label, backward]
            if r is None:
                continue
            vs_sdpa = f"{r['peak_mib'] / sdpa['peak_mib']:.1f}" if sdpa and sdpa["peak_mib"] > 0 else "-"
            vs_fused = f"{r['peak_mib'] / fused['peak_mib']:.1f}" if fused and fused["peak_mib"] > 0 else "-"
            print(f"| {T} | {label} | {'fwd+bwd' if backward else 'fwd'} | {r['seconds']:.2f} | "
                  f"{r['peak_mib']:.0f} | {vs_sdpa} | {vs_fused} | {square:.0f} |", flush=True)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--cpu-child":
        print(json.dumps(measure_cpu_child(json.loads(sys.argv[2]))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="sequence lengths T")
    ap.add_argument("--variants", nargs="+", default=None, help="GPU: only these variant names")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=None, help="default: 12 on GPU, 4 on CPU")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="GPU input dtype")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--unfused-flex", action="store_true", help="CPU: also measure the unfused CPU flex path")
    args = ap.parse_args()
    if args.device == "cuda":
        args.lengths = args.lengths or GPU_LENGTHS
        args.heads = args.heads or 12
        bench_cuda(args)
    else:
        args.lengths = args.lengths or CPU_LENGTHS
        args.heads = args.heads or 4
        bench_cpu(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
