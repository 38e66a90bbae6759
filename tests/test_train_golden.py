"""One key, one training: the first training losses of a tiny model, pinned for every built-in attention variant.

A change that alters what a variant computes moves these losses, and then its train key must change too, or a run
trained under the older meaning is found by key and reused as if it were new (docs/stages.md#identity-and-reuse).
So this test fails until the variant's version in ``attnlab.train.config.ATTENTION_SEMANTICS`` is raised (which
changes its train keys), and then until the new losses are recorded:

    .venv/bin/python tests/test_train_golden.py --write

which rewrites only the variants whose version was raised (or that are new), and refuses a variant whose losses
moved under the same version.

The tolerance, measured on the 2-core AMD EPYC (AVX-512), over these :data:`STEPS` steps and all 26 variants: the
losses move by at most 4.8e-7 with 2 threads instead of 1, 9.5e-7 on torch's and MKL's AVX2 kernels
(``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2``: what a CPU without AVX-512, Intel's or AMD's, runs),
5.2e-6 in float64, and 4.7e-5 on the scalar kernels (``ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2``,
LSSAR at step 3), the farthest path a CPU can take. :data:`TOLERANCE` = 1e-4 passes them all. Changes of meaning
tried against it: LSSAR's power 15 -> 14 moves step 2 by 3.2e-3, softmax's scale 1/sqrt(d) -> logd_logn step 1 by
1.5e-3 (caught); the RoPE base 10,000 -> 10,001 moves step 3 by 5e-7 and the sharpening's rounding margin
(attention/dense.py ``sharpen_tolerance``) 256 ulps -> 0 moves nothing (not caught: within rounding). Later steps
are not pinned: from step 4 sharpened variants amplify rounding (LSSAR's float32 and float64 losses are 3e-4 apart at
step 4 and 1.5e-2 at step 6), so no tolerance there separates rounding from meaning.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from attnlab.attention import get_variant
from attnlab.attention.variants import builtin_names
from attnlab.model import GPT, GPTConfig
from attnlab.train.config import TrainConfig, semantics_version
from attnlab.train.recipe import build_optimizer, lr_at

GOLDEN = Path(__file__).with_name("golden_losses.json")
STEPS = 3
TOLERANCE = 1e-4
VARIANTS = sorted({get_variant(name).name for name in builtin_names()})
WRITE = ".venv/bin/python tests/test_train_golden.py --write"


def golden_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """8 sequences of 33 tokens (of 64) that repeat every 8 tokens, a tenth of them replaced: attention must look
    back 8 positions to predict, so the variants' forms decide the losses."""
    g = torch.Generator().manual_seed(0)
    head = torch.randint(0, 64, (8, 8), generator=g)
    seq = head.repeat(1, 5)[:, :33]
    noise = torch.rand(seq.shape, generator=g) < 0.1
    seq = torch.where(noise, torch.randint(0, 64, seq.shape, generator=g), seq)
    return seq[:, :-1], seq[:, 1:]


def golden_losses(variant: str, dtype: torch.dtype = torch.float32) -> list[float]:
    """The first :data:`STEPS` training losses of a 2-layer model (2 heads of 32) of ``variant`` on
    :func:`golden_batch`, with attnlab's recipe (AdamW with decay on 2-D weights, warm-up, clipping 1.0)."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=64, train_len=32, attention=variant, attn_impl="dense")
    model = GPT(cfg).to(dtype)
    recipe = TrainConfig(preset="tiny", data="golden", lr=1e-2, warmup_steps=2, steps=6)
    optimizer = build_optimizer(model, recipe, torch.device("cpu"))
    x, y = golden_batch()
    losses = []
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, recipe)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _recorded() -> dict:
    return json.loads(GOLDEN.read_text())["variants"] if GOLDEN.exists() else {}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_first_training_losses_are_pinned_until_the_variant_s_version_is_raised(variant):
    entry = _recorded().get(variant)
    assert entry is not None, f"{variant}: no pinned losses (a new variant): record them with {WRITE}"
    version = semantics_version(variant)
    assert version == entry["semantics"], (f"{variant}: its semantics version is {version}, the pinned losses are of "
                                           f"version {entry['semantics']}: record the new ones with {WRITE}")
    got = golden_losses(variant)
    moved = max(abs(a - b) for a, b in zip(got, entry["losses"]))
    assert moved <= TOLERANCE, (
        f"{variant}: the first {STEPS} training losses moved by {moved:.2e} (> {TOLERANCE:g}, beyond rounding): what "
        f"it computes changed. Raise its version in attnlab.train.config.ATTENTION_SEMANTICS (its train keys change, "
        f"so runs of the old meaning are not reused), then record the new losses with {WRITE}. Pinned "
        f"{entry['losses']}, now {got}")


def test_a_raised_version_changes_the_train_key(monkeypatch):
    import attnlab.train.config as config

    cfg = TrainConfig(preset="tiny", data="x", attention="lssar")
    before = cfg.train_key("data")
    monkeypatch.setitem(config.ATTENTION_SEMANTICS, "lssar", 2)
    assert cfg.train_key("data") != before
    assert TrainConfig(preset="tiny", data="x", attention="softmax").train_key("data") == \
        TrainConfig(preset="tiny", data="x", attention="softmax").train_key("data")


def _write() -> int:
    recorded, out, refused = _recorded(), {}, []
    for variant in VARIANTS:
        got, version = golden_losses(variant), semantics_version(variant)
        entry = recorded.get(variant)
        if entry is not None and entry["semantics"] == version:
            if max(abs(a - b) for a, b in zip(got, entry["losses"])) > TOLERANCE:
                refused.append(variant)
            out[variant] = entry  # unchanged: the recorded losses stay
            continue
        out[variant] = {"semantics": version, "losses": got}
        print(f"{variant}: version {version}: {got}")
    if refused:
        print(f"refused: the losses of {', '.join(refused)} moved under the same semantics version; raise it in "
              "attnlab.train.config.ATTENTION_SEMANTICS first", file=sys.stderr)
        return 1
    GOLDEN.write_text(json.dumps({"steps": STEPS, "tolerance": TOLERANCE, "variants": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: tests/test_train_golden.py --write")
    torch.set_num_threads(1)
    sys.exit(_write())
