"""Benchmark, on CPU: the peak memory (and the time) of the dense reference of LSSA and LSSAR against the fused
forms that exist on CPU, forward and forward + backward (not a test; prints figures).

The fused forms on CPU are SDPA softmax (a fused CPU kernel) and compiled FlexAttention for the one-pass variants
(``lssa``, inference only): compiled FlexAttention on CPU has no backward and no LSE, so LSSAR's fused path runs
FlexAttention's unfused implementation there (``--unfused-flex`` measures it too). Memory: the peak resident set
size during the call minus the resident set size just before it, sampled every 0.2 ms from ``/proc/self/statm`` in
a fresh subprocess per measurement, with ``MALLOC_MMAP_THRESHOLD_`` set so that freed tensors leave the resident set
(``tracemalloc`` does not see torch's allocations). The analytic size of one (B, H, T, T) float32 matrix is printed
beside it. CPU times are printed but are only indicative on a shared machine (the load is in the header).

On a GPU, attention's time and memory against SDPA (FlashAttention), through attnlab's Triton kernels and
FlexAttention, are the GPU check's: ``python bench/gpu.py --quick`` (part c) and ``python bench/gpu.py``.

Run: ``python bench/attention.py [--lengths 1024 2048 4096] [--heads 4] [--unfused-flex]``. The machine header
(``bench/machine.py``) is printed first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parent))  # bench/machine.py, also when a test loads this file
import machine  # noqa: E402  (puts platform/ on sys.path)

LENGTHS = (1024, 2048, 4096)


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
    machine.print_header()
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
    ap.add_argument("--lengths", type=int, nargs="+", default=LENGTHS, help="sequence lengths T")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--unfused-flex", action="store_true", help="also measure FlexAttention's unfused CPU path")
    bench_cpu(ap.parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())
