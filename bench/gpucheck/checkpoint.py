"""f. Checkpoint: a run saved on this device and resumed into a new model and optimizer, with the production
functions (:func:`attnlab.model.checkpoint.save_checkpoint` and :func:`~attnlab.model.checkpoint.resume`).

After the save the original run goes on: it draws from each RNG stream (torch's CPU generator, this device's CUDA
generator, numpy's and Python's) and takes one more step. The resumed run, built from another seed and with every
stream disturbed first, must draw the same numbers and take the same step (the loss bit for bit), with its
optimizer state on the device.
"""

from __future__ import annotations

import dataclasses
import random
import tempfile

import numpy as np
import torch

from gpucheck.harness import FAIL, PASS, Context, Outcome, say
from gpucheck.training import production_step, random_steps, run_steps


def _draws(device: torch.device) -> dict:
    return {"torch": torch.rand(4).tolist(),
            "cuda": torch.rand(4, device=device).tolist() if device.type == "cuda" else None,
            "numpy": np.random.rand(4).tolist(), "python": [random.random() for _ in range(4)]}


def checkpoint(ctx: Context) -> Outcome:
    from attnlab.model.checkpoint import resume, save_checkpoint

    sizes, device = ctx.sizes, ctx.device
    # The tiny model, eager: this part checks the state's round trip, not speed.
    tiny = dataclasses.replace(sizes, preset="tiny", vocab_size=512, train_len=64)
    say(f"tiny lssar model on {device.type}, 2 steps of {tiny.micro_batch} x {tiny.accum}, saved, then resumed "
        "into a model built from another seed")
    parts = production_step(tiny, device, "lssar", 15.0, None)
    steps = random_steps(512, tiny.train_len, tiny.micro_batch, tiny.accum, 3, device)
    run_steps(parts, steps[:2], tiny.accum)
    random.seed(1)
    np.random.seed(2)
    with tempfile.TemporaryDirectory(prefix="attnlab-gpu-check-") as tmp:
        save_checkpoint(tmp, model=parts.model, optimizer=parts.optimizer, step=2, cfg={"check": "gpu"},
                        gpt_config={}, metrics={})
        expected = _draws(device)
        expected_loss = run_steps(parts, steps[2:], tiny.accum)[0]
        torch.manual_seed(99)
        other = production_step(tiny, device, "lssar", 15.0, None)  # seed 0 again: change its weights
        with torch.no_grad():
            for param in other.model.parameters():
                param.add_(0.01)
        torch.manual_seed(12345)
        if device.type == "cuda":
            torch.cuda.manual_seed(12345)
        np.random.seed(7)
        random.seed(7)
        step = resume(tmp, other.model, other.optimizer)
    got = _draws(device)
    loss = run_steps(other, steps[2:], tiny.accum)[0]
    state_devices = {t.device.type for s in other.optimizer.state.values() for t in s.values()
                     if isinstance(t, torch.Tensor) and t.dim() > 0}
    problems = [f"the {name} stream does not continue ({got[name][:2]} for {expected[name][:2]})"
                for name in expected if got[name] != expected[name]]
    if step != 2:
        problems.append(f"resumed at step {step}, saved at 2")
    if loss != expected_loss:
        problems.append(f"the next step's loss is {loss!r} resumed, {expected_loss!r} before")
    if state_devices != {device.type}:
        problems.append(f"optimizer state on {sorted(state_devices)}, the model on {device.type}")
    streams = [name for name in expected if expected[name] is not None]
    figures = (f"resumed at step {step}; RNG streams continue ({', '.join(streams)}); next loss "
               f"{'identical' if loss == expected_loss else 'DIFFERS'} ({loss:.6f}); optimizer state on "
               f"{', '.join(sorted(state_devices))}")
    data = {"step": step, "expected": expected, "got": got, "loss": loss, "expected_loss": expected_loss}
    return Outcome(FAIL if problems else PASS, ("; ".join(problems) + f" ({figures})") if problems else figures,
                   data)
