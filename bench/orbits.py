"""Benchmark: what one orbit-study trial costs on a CPU core (not a test; prints figures as JSON lines).

For one attention variant at the orbit source's ``size`` (default ``cpu``), in one process with one torch
thread: generating the training pool and the validation windows, ``--steps`` training steps of an
:class:`attnlab.model.orbit.OrbitGPT` (``tiny`` shape by default: 2 layers, width 128, 2 heads of 64) with
AdamW, warm-up and cosine decay as in the platform's recipe, the evaluation at 1x..16x the training length
(:func:`attnlab.evaluate.extrapolation.evaluate_checkpoint`), and both force probes with their symbolic regression.
Each phase reports wall seconds and CPU (process) seconds: on a shared machine the CPU seconds are what an idle
core would take. The training loss and the 1x..16x figures are printed too, so a run doubles as a look at what
the model learned.

Run: ``python bench/orbits.py --attention lssar --steps 1500 [--seq-len 128] [--batch 16] [--probe]``; the
simulation rate at the paper's size: ``python bench/orbits.py --size paper --seq-len 999 --pool-blocks 2
--sim-only``. The first line is the machine header (``bench/machine.py``) as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.append(str(Path(__file__).resolve().parent))  # bench/machine.py, also when a test loads this file
import machine  # noqa: E402


def _clock():
    return time.perf_counter(), time.process_time()


def _since(start) -> dict:
    return {"wall_s": round(time.perf_counter() - start[0], 2), "cpu_s": round(time.process_time() - start[1], 2)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", default="softmax")
    parser.add_argument("--size", default="cpu", choices=("cpu", "paper"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=2)
    parser.add_argument("--eval-tokens", type=int, default=2**17, help="token budget per evaluation length")
    parser.add_argument("--probe", action="store_true", help="also run both force probes + symbolic regression")
    parser.add_argument("--pool-blocks", type=int, default=None,
                        help="simulate only this many training blocks up front (default: every block of the size; "
                             "use a few for size paper, whose 10M systems are made on the fly)")
    parser.add_argument("--sim-only", action="store_true",
                        help="stop after the simulation rate (systems/s, tokens/s): what a GPU worker's CPUs must supply")
    parser.add_argument("--probe-train", type=int, default=256)
    parser.add_argument("--probe-test", type=int, default=64)
    parser.add_argument("--probe-steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from attnlab.data.generators.orbits import open_orbits
    from attnlab.model.orbit import OrbitGPT, OrbitGPTConfig
    from attnlab.evaluate.extrapolation import evaluate_checkpoint
    from attnlab.evaluate.force_probe import finetune_force_probe, linear_force_probe
    from attnlab.evaluate.plan import EvalConfig

    def say(record: dict) -> None:
        print(json.dumps(record, default=str), flush=True)

    say({"phase": "setup", **machine.header(), "args": vars(args)})
    data = open_orbits({"synthetic": "orbits", "size": args.size})
    T, B = args.seq_len, args.batch

    start = _clock()
    blocks = data.task.n_train_systems // data.task.block_systems
    if args.pool_blocks is not None:
        blocks = min(blocks, args.pool_blocks)
    for b in range(blocks):
        data.block("train", 0, b, T)
    pool = _since(start)
    systems = blocks * data.task.block_systems
    say({"phase": "train_pool", "systems": systems, "tokens_per_system": T, **pool,
         "systems_per_cpu_s": round(systems / max(pool["cpu_s"], 1e-9), 1),
         "tokens_per_cpu_s": round(systems * T / max(pool["cpu_s"], 1e-9))})
    if args.sim_only:
        return

    torch.manual_seed(args.seed)
    model = OrbitGPT(OrbitGPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                                    vocab_size=data.vocab_size, train_len=T, attention=args.attention))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses, step_cpu, step_wall = [], 0.0, 0.0
    start = _clock()
    for step in range(args.steps):
        warm = min(1.0, (step + 1) / max(1, args.warmup))
        cosine = 0.5 * (1 + math.cos(math.pi * max(0, step - args.warmup) / max(1, args.steps - args.warmup)))
        for group in opt.param_groups:
            group["lr"] = args.lr * warm * cosine
        x, y, _ = data.train_batch(step, 0, 1, 0, B, seq_len=T, global_batch=B, seed=0)
        t = _clock()
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step_wall += time.perf_counter() - t[0]
        step_cpu += time.process_time() - t[1]
        losses.append(float(loss.detach()))
    say({"phase": "train", "attention": args.attention, "params": model.num_params(), "steps": args.steps,
         "tokens_per_step": B * T, **_since(start), "step_cpu_s": round(step_cpu / args.steps, 4),
         "step_wall_s": round(step_wall / args.steps, 4),
         "loss": {s: round(float(np.mean(losses[max(0, s - 20):s])), 3)
                  for s in sorted({20, args.steps // 4, args.steps // 2, args.steps}) if s >= 1}})

    start = _clock()
    for length in (T, 2 * T, 4 * T, 8 * T, 16 * T):
        data.eval_set(length, max_tokens=args.eval_tokens)
    say({"phase": "val_windows", **_since(start)})
    start = _clock()
    loaded = (model, {"data": data.spec, "seed": args.seed, "tokens_per_step": B * T},
              {"step": args.steps, "checkpoint": None})
    rows = evaluate_checkpoint(loaded, EvalConfig(rope_scaling="ntk", max_tokens=args.eval_tokens),
                               context={"study": "bench"})

    def table(metric, bucket=None):
        return {r["eval_len"]: round(r["value"], 4) for r in rows
                if r["metric"] == metric and r.get("bucket") == bucket}

    say({"phase": "eval", **_since(start), "val_loss": table("val_loss"), "acc": table("acc"),
         "coord_err_au": table("coord_err_au"), "loss_late": table("loss_bucket", "late"),
         "windows": {r["eval_len"]: r["n_tokens"] // r["eval_len"] for r in rows
                     if r["metric"] == "val_loss" and r.get("bucket") is None}})
    if not args.probe:
        return
    for name, run in (("finetune", lambda: finetune_force_probe(
            model, data, n_train=args.probe_train, n_test=args.probe_test, steps=args.probe_steps, batch_size=16,
            seed=args.seed, oracle=True)),
                      ("linear", lambda: linear_force_probe(model, data, n_train=args.probe_train,
                                                            n_test=args.probe_test, seed=args.seed))):
        start = _clock()
        result = run()
        law = result.law
        record = {"phase": f"probe_{name}", **_since(start), "probe_err": round(result.probe_error, 4),
                  "probe_r2": round(result.probe_r2, 4), "expression": law.expression,
                  "newton_distance": round(law.newton_distance, 3), "is_newton": law.is_newton,
                  "sr_exponents": [round(v, 3) for v in (law.sr_exp_r, law.sr_exp_m1, law.sr_exp_m2)],
                  "power_law": [round(v, 3) for v in (law.power_law.exp_r, law.power_law.exp_m1,
                                                     law.power_law.exp_m2)]}
        if result.oracle_law is not None:
            record["oracle_expression"] = result.oracle_law.expression
        say(record)


if __name__ == "__main__":
    sys.exit(main())
