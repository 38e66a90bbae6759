"""Training throughput on CPU: tokens/s and MFU per preset and attention variant through the training loop (the demo
corpus, ``train_worker``), and the overhead of Ray Train.

Prints figures after the machine header (``bench/machine.py``); asserts nothing. Usage:

    python bench/train.py [--preset tiny] [--variants softmax,lssa,lssar] [--steps 8] [--seq-len N]
                          [--micro-batch B] [--threads N] [--compile] [--ray-overhead]

The Ray overhead compares 1 Ray Train worker with the same loop in this process (LocalSession), at steady
state (the first steps, which include start-up, are excluded by timing from the metrics' tokens_per_s).
On a GPU, training throughput and MFU (GPT-2 small, against llm.c's) are the GPU check's: part d of
``python bench/gpu.py --quick``, and ``python bench/gpu.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/machine.py, also when a test loads this file
import machine  # noqa: E402  (puts platform/ on sys.path)

from attnlab.train import load_train_config  # noqa: E402
from attnlab.train.loop import LocalSession, train_worker  # noqa: E402


def demo_data() -> str:
    from attnlab.data import prepare

    out = Path(os.environ.get("ATTNLAB_CACHE_DIR", Path.home() / ".cache" / "attnlab")) / "bench-demo-data"
    if not (out / "manifest.json").exists():
        prepare("demo", out=str(out), val_tokens=200_000, seed=0, workers=1, progress=False)
    return str(out)


def config(args, attention: str, data: str, steps: int):
    seq = args.seq_len or None
    probe = load_train_config(dict(preset=args.preset, data=data, seq_len=seq))
    T = probe.seq_length
    return load_train_config(dict(
        preset=args.preset, attention=attention, data=data, seq_len=T, steps=steps,
        tokens_per_step=T * args.micro_batch, micro_batch=args.micro_batch, warmup_steps=1, lr=1e-3,
        log_every=1, val_every=10**9, val_tokens=T, checkpoint_every=10**9, gpus_per_worker=0.0,
        compile=args.compile, threads_per_worker=args.threads))


def steady(metrics: list[dict], skip: int) -> tuple[float, object]:
    rows = metrics[skip:-1] or metrics[-1:]  # drop warm-up steps and the final step (it checkpoints)
    tps = sum(m["tokens_per_s"] for m in rows) / len(rows)
    return tps, rows[-1].get("mfu")  # None: no peak-FLOPs figure for this device (printed as "unknown")


def local_run(cfg) -> list[dict]:
    with tempfile.TemporaryDirectory() as run_dir:
        session = LocalSession(run_dir, device="cpu")
        train_worker(cfg, session, run_dir)
        return session.reports


def ray_run(cfg) -> list[dict]:
    from attnlab.train.ray_train import run_training

    with tempfile.TemporaryDirectory() as tmp:
        result = run_training(cfg.model_copy(update={"workers": 1}), Path(tmp) / "run")
        return [json.loads(line) for line in (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--variants", default="softmax,lssa,lssar,sigmoid_l1")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps excluded from the average")
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--ray-overhead", action="store_true")
    args = ap.parse_args()

    machine.print_header(packages=("ray",))
    data = demo_data()
    print("| preset | attention | seq_len | tokens/step | tokens/s | MFU |")
    print("|---|---|---|---|---|---|")
    for attention in args.variants.split(","):
        cfg = config(args, attention, data, args.steps)
        tps, mfu = steady(local_run(cfg), args.skip)
        mfu_s = f"{mfu:.1%}" if isinstance(mfu, float) else "unknown"
        print(f"| {args.preset} | {attention} | {cfg.seq_length} | {cfg.tokens_per_step} | {tps:,.0f} | {mfu_s} |",
              flush=True)
    if args.ray_overhead:
        from attnlab.ray_runtime import ensure_ray

        ensure_ray()
        attention = args.variants.split(",")[0]
        cfg = config(args, attention, data, args.steps)
        local_tps, _ = steady(local_run(cfg), args.skip)
        ray_tps, _ = steady(ray_run(cfg), args.skip)
        print(f"\nRay Train overhead ({attention}, 1 worker vs plain process, steady state): "
              f"plain {local_tps:,.0f} tok/s, Ray Train {ray_tps:,.0f} tok/s, "
              f"ratio {ray_tps / local_tps:.3f} (overhead {1 - ray_tps / local_tps:+.1%}; target <= 5%)")


if __name__ == "__main__":
    main()
