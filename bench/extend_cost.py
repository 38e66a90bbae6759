"""The cost of studies/extend_proxy.yaml before it runs: CPU seconds of one training step of each of its runs and of
its evaluation, one thread (as its trials run), and the study's total on 2 cores (docs/extend-proxy.md#cost).

Prints figures under bench/machine.py's header; asserts nothing. ``time.process_time`` over the study's own models
(the tiny GPT, 4 layers x 128, byte vocabulary): a parent's step at 128 (32 sequences), a child's at 512 (8), and a
forward of each evaluation length scaled to 65,536 bytes. On a machine other jobs share, CPU time is inflated too:
read the figures as an upper bound. Usage:

    python bench/extend_cost.py [--overhead 15]

``--overhead``: seconds a run costs besides training and evaluation (its trial's start, validation, checkpoints).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "bench"))  # bench/machine.py, also when a test loads this file
import machine  # noqa: E402  (puts platform/ on sys.path)

import torch  # noqa: E402

from attnlab.attention import load_plugin  # noqa: E402
from attnlab.model import GPT, preset  # noqa: E402
from attnlab.provenance import hardware  # noqa: E402
from attnlab.study.spec import load_spec  # noqa: E402

NOPE = ("fox", "stickbreaking")


def _model(variant: str, train_len: int, **fields) -> GPT:
    torch.manual_seed(0)
    position = {"position": "nope"} if variant in NOPE else {}
    return GPT(preset("tiny", n_layer=4, attention=variant, vocab_size=257, train_len=train_len, **position,
                      **fields))


def step_seconds(model: GPT, batch: int, length: int, repeats: int = 5) -> float:
    """The fastest of ``repeats`` training steps (forward, backward, AdamW), after one to warm up."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 257, (batch, length))
    best = float("inf")
    for i in range(repeats + 1):
        start = time.process_time()
        _, loss = model(x, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if i:
            best = min(best, time.process_time() - start)
    return best


def eval_seconds(model: GPT, length: int, tokens: int, train_len: int = 128, val_batch: int = 8) -> float:
    """A forward of ``length`` (evaluation's batch: ``val_batch`` windows at the training length) scaled to ``tokens``."""
    batch = max(1, val_batch * train_len // length)
    x = torch.randint(0, 257, (batch, length))
    with torch.no_grad():
        model.eval()(x, x)
        start = time.process_time()
        model(x, x)
        return (time.process_time() - start) * tokens / (batch * length)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--overhead", type=float, default=15.0, help="seconds a run costs besides training and "
                        "evaluation (default 15)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in NOPE:
        load_plugin(str(ROOT / "plugins" / f"{name}.py"))
    spec = load_spec(ROOT / "studies" / "extend_proxy.yaml")
    space = spec.search_space()
    lengths = spec.eval.eval_lengths(spec.train.seq_length)
    tokens = spec.eval.max_tokens
    print("# extend_proxy cost, one thread")
    machine.print_header()
    print(f"- CPU kernel path: {hardware().get('cpu_capability')}")
    parents, children, costs = {}, {}, {}
    for variant in space.attentions():
        model = _model(variant, spec.train.seq_length)
        parents[variant] = step_seconds(model, spec.train.tokens_per_step // spec.train.seq_length,
                                        spec.train.seq_length)
        costs[variant] = sum(eval_seconds(model, length, tokens) for length in lengths)
        print(f"{variant} parent: step {parents[variant]:.2f} s, evaluation {costs[variant]:.1f} s")
    total, runs = 0.0, 0
    for point in space.grid():
        cfg = space.config(point)
        variant, stage = cfg.attention, point.get("stage")
        if stage is None:
            seconds = cfg.steps * parents[variant]
        else:
            key = (variant, cfg.seq_length)
            if key not in children:
                child = _model(variant, cfg.seq_length, original_len=spec.train.seq_length)
                children[key] = step_seconds(child, cfg.tokens_per_step // cfg.seq_length, cfg.seq_length)
                print(f"{variant} child at {cfg.seq_length}: step {children[key]:.2f} s")
            seconds = cfg.steps * children[key]
        total += seconds + costs[variant] + args.overhead
        runs += 1
    print(f"{runs} runs: {total:,.0f} CPU-seconds, {total / 2 / 60:.0f} min on 2 cores two trials at a time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
