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


def test_rope_scalings_are_the_six_names():
    assert set(ROPE_SCALINGS) == {"none", "ntk", "pi", "yarn", "yarn_paper", "dynamic"}


@pytest.mark.parametrize("scaling", ["none", "ntk", "pi", "yarn", "yarn_paper", "dynamic:2"])
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
def test_yarn_paper_frequencies_and_temperature_match_the_paper(d, L, L_train, base):
    """yarn_paper is the paper's equation (yarn is the reference code's: tests/test_rope_reference.py)."""
    want, want_multiplier = _yarn_reference(d, L, L_train, base)
    inv_freq, multiplier = rope_frequencies("yarn_paper", d, L, L_train, base)
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


def test_bad_rope_scaling_is_one_line():
    model = GPT(preset("tiny", vocab_size=64))
    with pytest.raises(ValueError) as info:
        model(torch.zeros(1, 8, dtype=torch.long), rope_scaling="x")
    assert str(info.value) == "rope_scaling='x' is not allowed: use one of ntk, none, pi, yarn, yarn_paper, dynamic"


# ------------------------------------------------------------------------- position encodings (rope / nope / alibi)
def _alibi_available() -> bool:
    from attnlab.model.config import alibi_override

    return alibi_override() is not None


POSITIONS_NOW = ["rope", "nope"] + (["alibi"] if _alibi_available() else [])


@pytest.mark.parametrize("attention", ["softmax", "lssa"])
def test_nope_has_no_position_signal_and_rope_has_one(attention):
    """One layer: without any position signal (causal mask only) the prediction at position t is a function of
    the set of tokens before it, so permuting them changes nothing; with RoPE it does."""
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (1, 40))
    shuffled = torch.cat([idx[:, :-1][:, torch.randperm(39)], idx[:, -1:]], dim=1)
    for position, invariant in (("nope", True), ("rope", False)):
        model = GPT(preset("tiny", n_layer=1, vocab_size=64, attention=attention, position=position)).eval()
        with torch.no_grad():
            a, b = model(idx)[0][:, -1], model(shuffled)[0][:, -1]
        assert torch.allclose(a, b, atol=1e-5) is invariant, position


def test_nope_ignores_the_rope_scaling_and_equals_rope_at_position_zero():
    torch.manual_seed(1)
    rope = GPT(preset("tiny", vocab_size=64)).eval()
    nope = GPT(preset("tiny", vocab_size=64, position="nope")).eval()
    nope.load_state_dict(rope.state_dict())  # position adds no parameters
    idx = torch.randint(0, 64, (2, 4 * 64))
    with torch.no_grad():
        outs = [nope(idx, rope_scaling=s)[0] for s in ("none", "ntk", "pi", "yarn")]
        with_rope, _ = rope(idx)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert torch.allclose(outs[0][:, 0], with_rope[:, 0], atol=1e-5) and not torch.allclose(outs[0], with_rope)
    with pytest.raises(ValueError, match="rope_scaling='x' is not allowed"):
        nope(idx, rope_scaling="x")


@pytest.mark.skipif(not _alibi_available(), reason="the attention package has no ALiBi field yet")
def test_alibi_reaches_the_attention():
    torch.manual_seed(2)
    cfg = preset("tiny", vocab_size=64, position="alibi")
    assert cfg.attention_spec().position_bias == "alibi" and cfg.attention_spec(p=15).position_bias == "alibi"
    alibi = GPT(cfg).eval()
    nope = GPT(preset("tiny", vocab_size=64, position="nope")).eval()
    nope.load_state_dict(alibi.state_dict())
    idx = torch.randint(0, 64, (2, 96))
    with torch.no_grad():
        a, b = alibi(idx)[0], nope(idx)[0]
        evaluated = alibi(idx, attention=nope.cfg.attention_spec(p=15))[0]  # a p_eval spec keeps the bias
        wanted = alibi(idx, attention=cfg.attention_spec(p=15))[0]
    assert not torch.allclose(a, b) and torch.allclose(a[:, 0], b[:, 0], atol=1e-5)
    assert torch.equal(evaluated, wanted)


# ------------------------------------------------------------------------------------------------ llama block
@pytest.mark.parametrize("position", POSITIONS_NOW)
@pytest.mark.parametrize("attention", ["softmax", "lssa", "lssar"] + (["softmax_qknorm"] if _alibi_available() else []))
def test_llama_block_forward_backward(attention, position):
    torch.manual_seed(3)
    model = GPT(preset("tiny-llama", attention=attention, position=position, vocab_size=128))
    idx = torch.randint(0, 128, (2, 33))
    _, loss = model(idx[:, :-1], idx[:, 1:])
    assert loss.item() == pytest.approx(math.log(128), abs=0.2)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.blocks[0].mlp.c_up.weight.grad.abs().sum() > 0
    with torch.no_grad():
        loss16, _ = model.eval().token_stats(idx[:, :-1].repeat(1, 4), idx[:, 1:].repeat(1, 4), rope_scaling="yarn")
    assert torch.isfinite(loss16).all()


def test_llama_block_shape():
    model = GPT(preset("tiny-llama", vocab_size=128))
    assert model.cfg.bias is False and model.cfg.mlp_hidden == 384  # 8/3 x 128 = 341.3, up to a multiple of 64
    assert all(isinstance(m, torch.nn.RMSNorm) for m in (model.blocks[0].ln_1, model.blocks[0].ln_2, model.ln_f))
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model.lm_head.weight is model.wte.weight
    assert preset("tiny", block="llama", bias=True).bias is False  # llama has no biases


@pytest.mark.parametrize("name, kwargs", [("tiny-llama", {}), ("llama-45m", {}), ("tiny-llama", dict(vocab_size=512)),
                                          ("gpt2-45m", dict(block="llama", position="nope")),
                                          ("tiny-4l", dict(block="llama", n_embd=320, n_head=5)),
                                          ("tiny-llama", dict(attention="softmax_qknorm")),
                                          ("tiny", dict(attention="softmax_qknorm_logn"))])
def test_parameter_count_matches_the_memory_plan(name, kwargs):
    from attnlab.model.memory import num_params

    cfg = preset(name, **kwargs)
    with torch.device("meta"):
        model = GPT(cfg)
    assert num_params(cfg) == sum(p.numel() for p in model.parameters()) == model.num_params()


def test_llama_orbit_model_uses_the_llama_block():
    from attnlab.model import OrbitGPT, with_kind

    model = OrbitGPT(with_kind(preset("tiny-llama", vocab_size=32), "orbit"))
    assert isinstance(model.ln_f, torch.nn.RMSNorm) and hasattr(model.blocks[0].mlp, "c_up")


# ------------------------------------------------------------------------------ configs: sweeps and bad values
@pytest.mark.parametrize("bad, match", [
    (dict(block="x"), "model.block='x' is not allowed: use one of gpt2, llama"),
    (dict(position="x"), "model.position='x' is not allowed: use one of rope, nope, alibi"),
])
def test_bad_block_or_position_is_one_line(bad, match):
    with pytest.raises(UserError) as info:
        preset("tiny", **bad)
    assert str(info.value) == match


def test_position_and_block_are_training_and_study_axes():
    from attnlab.study.spec import load_spec
    from attnlab.train import load_train_config

    base = load_train_config(dict(preset="tiny", data="demo"))
    nope = load_train_config(dict(preset="tiny", data="demo", model={"position": "nope"}))
    llama = load_train_config(dict(preset="tiny-llama", data="demo"))
    assert "position" not in base.identity("fp")["model"] and "block" not in base.identity("fp")["model"]
    assert nope.identity("fp")["model"]["position"] == "nope" and llama.identity("fp")["model"]["block"] == "llama"
    assert len({c.train_key("fp") for c in (base, nope, llama)}) == 3
    assert llama.steps == base.steps and llama.lr == base.lr  # tiny's recipe
    spec = load_spec({"name": "t", "train": {"preset": "tiny", "data": "demo"},
                      "space": {"model.position": POSITIONS_NOW, "model.block": ["gpt2", "llama"]}})
    space = spec.search_space()
    configs = [space.config(p) for p in space.grid()]
    assert {(c.gpt_config().position, c.gpt_config().block) for c in configs} == \
        {(p, b) for p in POSITIONS_NOW for b in ("gpt2", "llama")}
    with pytest.raises(UserError) as info:
        load_train_config(dict(preset="tiny", data="demo", model={"position": "learned"}))
    assert "model.position='learned' is not allowed: use one of rope, nope, alibi" in str(info.value)


@pytest.mark.parametrize("position", [p for p in POSITIONS_NOW if p != "rope"])
def test_models_without_rope_evaluate_every_scaling_as_the_same_forward(demo_data_dir, position):
    """rope_scaling is meaningless without RoPE: rows record each scaling as asked, with equal numbers."""
    from attnlab.evaluate import EvalConfig, evaluate_checkpoint
    from attnlab.train import load_train_config

    torch.manual_seed(0)
    model = GPT(preset("tiny-llama", position=position)).eval()
    cfg = load_train_config({"preset": "tiny-llama", "model": {"position": position}, "data": str(demo_data_dir),
                             "seq_len": 64})
    config = EvalConfig(multiples=[1, 2], rope_scaling=["none", "ntk", "pi", "yarn"], max_tokens=256)
    rows = evaluate_checkpoint((model, cfg, {"step": 0}), config, device="cpu")
    loss = {(r["rope_scaling"], r["eval_len"]): r["value"] for r in rows if r["metric"] == "val_loss"}
    assert set(loss) == {(s, L) for s in ("none", "ntk", "pi", "yarn") for L in (64, 128)}
    assert {loss[(s, 128)] for s in ("none", "ntk", "pi", "yarn")} == {loss[("none", 128)]}
