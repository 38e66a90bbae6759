"""The baselines a reviewer asks for: RoPE extensions at evaluation (PI, YaRN), position encodings (RoPE, NoPE,
ALiBi) as a model axis, and a Llama-style block. Formulas are written here from the papers, not read from
the code under test."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.errors import UserError
from attnlab.model import GPT, preset, rope_frequencies
from attnlab.names import ROPE_SCALINGS


# ------------------------------------------------------------------------------- RoPE scalings (PI, YaRN)
def _plain_inv_freq(base: float, d: int) -> list[float]:
    return [base ** (-2 * m / d) for m in range(d // 2)]


def test_rope_scalings_are_the_four_names():
    assert set(ROPE_SCALINGS) == {"none", "ntk", "pi", "yarn"}


@pytest.mark.parametrize("scaling", ["none", "ntk", "pi", "yarn"])
@pytest.mark.parametrize("seq_len", [1, 32, 64])
def test_every_scaling_is_none_up_to_the_training_length(scaling, seq_len):
    inv_freq, multiplier = rope_frequencies(scaling, 64, seq_len, 64, 10000.0)
    assert inv_freq.tolist() == pytest.approx(_plain_inv_freq(10000.0, 64), rel=1e-12)
    assert multiplier == 1.0


@pytest.mark.parametrize("s", [2, 4, 16])
def test_position_interpolation_divides_every_frequency_by_s(s):
    # Chen et al. 2023: position t of a window of L = s * L_train tokens is rotated as t * L_train / L.
    inv_freq, multiplier = rope_frequencies("pi", 64, 1024 * s, 1024, 10000.0)
    want = [f * 1024 / (1024 * s) for f in _plain_inv_freq(10000.0, 64)]
    assert inv_freq.tolist() == pytest.approx(want, rel=1e-12) and multiplier == 1.0


def _yarn_reference(d: int, L: int, L_train: int, base: float, alpha: float = 1.0, beta: float = 32.0):
    """Peng et al. 2023 (YaRN), written from the paper: NTK-by-parts h(theta_d) and sqrt(1/t) = 0.1 ln s + 1."""
    s = L / L_train
    out = []
    for i in range(d // 2):
        theta = base ** (-2 * i / d)
        wavelength = 2 * math.pi / theta
        r = L_train / wavelength
        gamma = 0.0 if r < alpha else 1.0 if r > beta else (r - alpha) / (beta - alpha)
        out.append((1 - gamma) * theta / s + gamma * theta)
    sqrt_inv_t = 0.1 * math.log(s) + 1
    return out, sqrt_inv_t ** 2


@pytest.mark.parametrize("d, L, L_train, base", [(64, 16384, 1024, 10000.0), (64, 128, 64, 10000.0),
                                                 (128, 8192, 4096, 500000.0), (64, 1536, 1024, 10000.0)])
def test_yarn_frequencies_and_temperature_match_the_paper(d, L, L_train, base):
    want, want_multiplier = _yarn_reference(d, L, L_train, base)
    inv_freq, multiplier = rope_frequencies("yarn", d, L, L_train, base)
    assert inv_freq.tolist() == pytest.approx(want, rel=1e-12)
    assert multiplier == pytest.approx(want_multiplier, rel=1e-12)
    s = L / L_train
    if L_train / (2 * math.pi) > 32:
        assert inv_freq[0].item() == pytest.approx(1.0)  # the fastest pair (32+ rotations) is kept
    assert inv_freq[-1].item() == pytest.approx(base ** (-(d - 2) / d) / s)  # the slowest is interpolated


def test_yarn_temperature_reaches_the_attention_logits():
    """The logit multiplier is in q . k after RoPE (folded into the tables): q_i . k_i at position i scales
    by exactly the multiplier, whatever the rotation."""
    from attnlab.model.rope import apply_rope, scaled_rope_tables

    torch.manual_seed(0)
    q = torch.randn(1, 1, 256, 64, dtype=torch.float64)
    k = torch.randn(1, 1, 256, 64, dtype=torch.float64)
    cos, sin = scaled_rope_tables("yarn", 256, 64, 64, 10000.0, dtype=torch.float64)
    cos_pi, sin_pi = scaled_rope_tables("pi", 256, 64, 64, 10000.0, dtype=torch.float64)
    same_pos = (apply_rope(q, cos, sin) * apply_rope(k, cos, sin)).sum(-1)
    unrotated = (q * k).sum(-1)  # RoPE's rotation of q_i and k_i by the same angle keeps q_i . k_i
    assert torch.allclose(same_pos, unrotated * (0.1 * math.log(4) + 1) ** 2)
    assert torch.allclose((apply_rope(q, cos_pi, sin_pi) * apply_rope(k, cos_pi, sin_pi)).sum(-1), unrotated)


def test_model_scalings_agree_up_to_the_training_length_and_differ_beyond():
    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=256)).eval()
    T = model.cfg.train_len
    idx = torch.randint(0, 256, (2, 4 * T))
    with torch.no_grad():
        base, _ = model(idx[:, :T], rope_scaling="none")
        for scaling in ("ntk", "pi", "yarn"):
            assert torch.equal(model(idx[:, :T], rope_scaling=scaling)[0], base)
        long = {scaling: model(idx, rope_scaling=scaling)[0] for scaling in ROPE_SCALINGS}
    for a in ROPE_SCALINGS:
        for b in ROPE_SCALINGS:
            if a < b:
                assert not torch.allclose(long[a], long[b]), (a, b)
    for scaling in ROPE_SCALINGS:  # position 0 sees only itself: no rotation, one key
        assert torch.allclose(long[scaling][:, :1], long["none"][:, :1], atol=1e-5)


def test_bad_rope_scaling_is_one_line():
    model = GPT(preset("tiny", vocab_size=64))
    with pytest.raises(ValueError) as info:
        model(torch.zeros(1, 8, dtype=torch.long), rope_scaling="x")
    assert str(info.value) == "rope_scaling='x' is not allowed: use one of ntk, none, pi, yarn"
