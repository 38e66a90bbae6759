"""The baselines a reviewer asks for (docs/attention.md#modern-softmax-baselines, docs/attention.md#alibi).

- ``softmax_qknorm``, ``softmax_logn``, ``softmax_qknorm_logn``: their formulas evaluated directly (the learned
  QK-norm gain against torch's own RMSNorm), and the fused paths (FlexAttention, SDPA) against the dense
  reference, forward and backward (the gains' gradients included), causal, several lengths.
- ALiBi (``position_bias='alibi'``): the slopes against the paper's values, the bias ``-m_h (i - j)`` evaluated
  directly, and FlexAttention against the dense reference for softmax, lssa and lssar (and the other fused
  forms), forward and backward.
- Routing (SDPA serves the baselines, ALiBi goes to FlexAttention on CUDA) and one-line errors for bad values.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.attention import Backend, AttentionSpec, attend, attention_weights, get_variant, resolve_backend
from attnlab.attention.dense import attend_dense
from attnlab.attention.flex import attend_flex, is_fusable
from attnlab.attention.masks import alibi_bias, alibi_slope, alibi_slopes
from attnlab.attention.sdpa import attend_sdpa, is_sdpa_exact

BASELINES = ("softmax_qknorm", "softmax_logn", "softmax_qknorm_logn")
LENGTHS = (1, 2, 3, 4, 17, 130)  # the first rows, odd sizes, past one 128-row block


def _qkv(T, D=16, H=2, B=1, dtype=torch.float64, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)
            for _ in range(3)]


def _gains(H, D, seed=1, per_head_q=True, requires_grad=False):
    """Learned QK-norm gains as a model would hold them (away from 1 so that they matter)."""
    gen = torch.Generator().manual_seed(seed)
    gq = 1 + 0.3 * torch.randn((H, D) if per_head_q else (D,), generator=gen, dtype=torch.float64)
    gk = 1 + 0.3 * torch.randn(D, generator=gen, dtype=torch.float64)
    return gq.requires_grad_(requires_grad), gk.requires_grad_(requires_grad)


def _gain_for(spec, H, D, **kw):
    return _gains(H, D, **kw) if spec.learned_qk_gain else None


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _causal_softmax(s):
    T = s.shape[-1]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)


# --- the registry ---------------------------------------------------------------------------------------------

def test_baselines_are_registered_with_their_fields_and_sources():
    qknorm, logn, both = (get_variant(n) for n in BASELINES)
    assert (qknorm.phi, qknorm.norm, qknorm.scale, qknorm.qk_norm, qknorm.qk_norm_gain) == \
        ("exp", "l1", "inv_sqrt_d", True, "learned")
    assert (logn.phi, logn.norm, logn.scale, logn.qk_norm, logn.qk_norm_gain) == ("exp", "l1", "log_n", False, "none")
    assert (both.scale, both.qk_norm, both.qk_norm_gain) == ("log_n", True, "learned")
    assert "OLMo 2" in qknorm.source and "RMSNorm" in qknorm.source and "learned" in qknorm.source
    assert "Scalable-Softmax" in logn.source and "Chiang" in logn.source and "fixed" in logn.source
    for spec in (qknorm, logn, both):
        assert spec.position_bias == "none" and spec.p is None and spec.learned_qk_gain is (spec.qk_norm)


def test_alibi_is_a_field_any_variant_takes():
    for name in ("softmax", "lssa", "lssar", *BASELINES):
        spec = get_variant(name).replace(position_bias="alibi")
        assert spec == get_variant(name, position_bias="alibi") and spec.position_bias == "alibi"
    assert get_variant("lssar", position_bias="alibi").p == 15


@pytest.mark.parametrize("make, message", [
    (lambda: AttentionSpec("x", position_bias="rope"), "position_bias='rope' is not allowed: use one of none, alibi"),
    (lambda: AttentionSpec("x", position_bias=True), "position_bias=True is not allowed: use one of none, alibi"),
    (lambda: AttentionSpec("x", qk_norm=True, qk_norm_gain="yes"),
     "qk_norm_gain='yes' is not allowed: use one of none, learned"),
    (lambda: AttentionSpec("x", qk_norm_gain="learned"), "qk_norm_gain='learned' needs qk_norm=true"),
    (lambda: get_variant("softmax_qknorm", qk_norm=False), "qk_norm_gain='learned' needs qk_norm=true"),
    (lambda: get_variant("softmax", position_bias="Alibi"), "position_bias='Alibi' is not allowed"),
    (lambda: alibi_slopes(0), "n_head=0 is not allowed"),
])
def test_bad_values_are_one_line_naming_the_field(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_qk_gain_must_fit_the_spec():
    q, k, v = _qkv(5, D=8, H=2)
    qknorm, softmax = get_variant("softmax_qknorm"), get_variant("softmax")
    bad = [(qknorm, None, "qk_norm_gain='learned': pass qk_gain=a pair (gain_q, gain_k)"),
           (qknorm, (torch.ones(8),), "pass qk_gain=a pair"),
           (qknorm, (torch.ones(7), torch.ones(8)), "qk_gain gain_q has shape (7,): use a pair"),
           (qknorm, (torch.ones(8), torch.ones(3, 8)), "qk_gain gain_k has shape (3, 8)"),
           (softmax, (torch.ones(8), torch.ones(8)),
            "qk_gain is given but attention 'softmax' has qk_norm_gain='none'")]
    for spec, gain, message in bad:
        for impl in ("dense", "flex", "sdpa"):
            with pytest.raises(ValueError) as info:
                attend(q, k, v, spec, impl=impl, qk_gain=gain)
            assert message in str(info.value) and "\n" not in str(info.value), (impl, str(info.value))
        with pytest.raises(ValueError, match="qk_gain"):
            attention_weights(q, k, spec, qk_gain=gain)


# --- the baselines' formulas, evaluated directly ------------------------------------------------------------------

@pytest.mark.parametrize("name", BASELINES)
def test_baseline_weights_are_the_formula(name):
    # softmax over j <= i of  c_i * RMSNorm(q_i; g_q) . RMSNorm(k_j; g_k) / sqrt(d)  (qknorm; c_i = 1 or ln N_i),
    # with torch's own RMSNorm (its eps, 1e-30 here, is the only difference from sqrt(d) g x / |x|).
    B, H, T, D = 2, 3, 11, 8
    q, k, _ = _qkv(T, D=D, H=H, B=B)
    spec = get_variant(name)
    gains = _gain_for(spec, H, D)
    if spec.qk_norm:
        gq, gk = gains
        qn = torch.stack([F.rms_norm(q[:, h], (D,), weight=gq[h], eps=1e-30) for h in range(H)], dim=1)
        kn = F.rms_norm(k, (D,), weight=gk, eps=1e-30)
    else:
        qn, kn = q, k
    s = qn @ kn.transpose(-1, -2) / math.sqrt(D)
    if spec.scale == "log_n":
        s = s * torch.log(torch.arange(1, T + 1, dtype=torch.float64))[:, None]
    expected = _causal_softmax(s)
    assert _max_err(attention_weights(q, k, spec, qk_gain=gains), expected) <= 1e-12


def test_qknorm_logits_can_sharpen_unlike_l2_with_inv_sqrt_d():
    # L2-normalised q, k with 1/sqrt(d): |logit| <= 1/8 at d = 64, every row nearly uniform. The RMSNorm form
    # (gain 1) reaches sqrt(d) = 8; with ln(N_i) more. Row T-1, key equal to the query: the weight on it.
    T, D = 64, 64
    q, k, _ = _qkv(T, D=D, H=1)
    k[..., 0, :] = q[..., -1, :]
    ones = (torch.ones(D, dtype=torch.float64), torch.ones(D, dtype=torch.float64))
    l2 = attention_weights(q, k, get_variant("softmax", qk_norm=True))[0, 0, -1, 0].item()
    rms = attention_weights(q, k, get_variant("softmax_qknorm"), qk_gain=ones)[0, 0, -1, 0].item()
    rms_logn = attention_weights(q, k, get_variant("softmax_qknorm_logn"), qk_gain=ones)[0, 0, -1, 0].item()
    assert l2 < 1.2 / T and rms > 0.5 and rms_logn > 0.99


# --- the baselines: fused paths against the dense reference, forward and backward -------------------------------

@pytest.mark.parametrize("impl", ["flex", "sdpa"])
@pytest.mark.parametrize("name", BASELINES)
@pytest.mark.parametrize("per_head_q", [True, False], ids=["gain_q_per_head", "gain_q_shared"])
def test_baselines_fused_match_dense_forward_and_backward(name, impl, per_head_q):
    spec = get_variant(name)
    fused = attend_flex if impl == "flex" else attend_sdpa
    worst_out = worst_grad = 0.0
    for T in LENGTHS:
        H, D = 3, 16
        q, k, v = _qkv(T, D=D, H=H, seed=T, requires_grad=True)
        gains = _gain_for(spec, H, D, per_head_q=per_head_q, requires_grad=True)
        inputs = (q, k, v, *(gains or ()))
        w = torch.randn(1, H, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(T + 7))
        ref = attend_dense(q, k, v, spec, qk_gain=gains)
        out = fused(q, k, v, spec, qk_gain=gains)
        assert out.shape == (1, H, T, D) and out.dtype == torch.float64
        worst_out = max(worst_out, _max_err(out, ref))
        expected = torch.autograd.grad((ref * w).sum(), inputs)
        got = torch.autograd.grad((out * w).sum(), inputs)
        worst_grad = max(worst_grad, *(_max_err(a, b) for a, b in zip(got, expected)))
    assert worst_out <= 1e-10 and worst_grad <= 1e-9, (worst_out, worst_grad)


@pytest.mark.parametrize("impl", ["flex", "sdpa"])
def test_baselines_in_bf16(impl):
    # bf16 q, k, v with float32 gains (a model's parameters under autocast): the error against the dense reference
    # on the same bf16 values is bf16 rounding (the product gain * q is rounded once on the fused paths).
    spec = get_variant("softmax_qknorm_logn")
    q, k, v = _qkv(130, D=64, H=2, dtype=torch.bfloat16)
    gq, gk = (g.float() for g in _gains(2, 64))
    out = attend(q, k, v, spec, impl=impl, qk_gain=(gq, gk))
    reference = attend_dense(q.double(), k.double(), v.double(), spec, qk_gain=(gq.double(), gk.double()))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert _max_err(out, reference) / reference.abs().max().item() <= 3e-2


def test_dense_chunks_and_autocast_keep_the_gain():
    spec = get_variant("softmax_qknorm_logn")
    q, k, v = _qkv(33, D=16, H=2)
    gains = _gains(2, 16)
    whole = attend_dense(q, k, v, spec, qk_gain=gains)
    assert _max_err(attend_dense(q, k, v, spec, chunk_bytes=1, qk_gain=gains), whole) <= 1e-13
    assert _max_err(attend(q, k, v, spec, qk_gain=gains), whole) == 0.0  # auto on CPU: the reference


def test_routing_of_the_baselines():
    for name in BASELINES:
        spec = get_variant(name)
        assert is_sdpa_exact(spec) and is_fusable(spec)
        assert resolve_backend(spec, "cuda") is Backend.SDPA and resolve_backend(spec, "cpu") is Backend.DENSE


# --- ALiBi: slopes and bias ------------------------------------------------------------------------------------

def test_alibi_slopes_are_the_papers():
    # Press et al. 2022: m_h = 2^(-8h/H), h = 1..H; H not a power of two: the closest power of two c below H, then
    # every other slope of 2c heads (the paper's get_slopes).
    assert alibi_slopes(8).tolist() == [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256]
    assert alibi_slopes(2).tolist() == [1 / 16, 1 / 256]
    assert alibi_slopes(1).tolist() == [1 / 256]
    assert alibi_slopes(16).tolist() == pytest.approx([2 ** (-0.5 * h) for h in range(1, 17)], rel=1e-15)
    assert alibi_slopes(6).tolist() == [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8]
    twelve = alibi_slopes(12).tolist()
    assert twelve[:8] == alibi_slopes(8).tolist()
    assert twelve[8:] == pytest.approx(alibi_slopes(16).tolist()[0::2][:4], rel=1e-15)

    def get_slopes(n):  # the paper's code (ofirpress/attention_with_linear_biases), written out
        def power_of_2(n):
            start = 2 ** (-2 ** -(math.log2(n) - 3))
            return [start * start ** i for i in range(n)]
        if math.log2(n).is_integer():
            return power_of_2(n)
        c = 2 ** math.floor(math.log2(n))
        return power_of_2(c) + get_slopes(2 * c)[0::2][:n - c]

    for H in range(1, 33):
        assert alibi_slopes(H).tolist() == pytest.approx(get_slopes(H), rel=1e-12), H
        assert alibi_slopes(H, dtype=torch.float32).dtype == torch.float32
        assert torch.equal(alibi_slope(torch.arange(H), H, torch.float64), alibi_slopes(H))


@pytest.mark.parametrize("name", ["softmax", "lssa", "sigmoid_ramapuram"])
def test_alibi_bias_is_the_formula(name):
    # S_ij = scale_i * q_i . k_j + bias_i - m_h * (i - j), then the variant's f and normalisation, written out.
    B, H, T, D = 2, 3, 9, 8
    q, k, _ = _qkv(T, D=D, H=H, B=B)
    slopes = alibi_slopes(H)
    i = torch.arange(T, dtype=torch.float64)[:, None]
    j = torch.arange(T, dtype=torch.float64)[None, :]
    bias = -slopes[:, None, None] * (i - j)  # (H, T, T)
    assert torch.equal(alibi_bias(torch.arange(H)[:, None, None], i, j, H, torch.float64), bias)
    mask = (j <= i)
    n = i + 1
    if name == "softmax":
        expected = _causal_softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + bias)
    elif name == "lssa":
        cos = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)
        f = F.softplus(math.log(D) * torch.log(n) * cos + bias) * mask
        expected = f / f.sum(-1, keepdim=True)
    else:  # sigmoid(S - ln T), no normalisation
        expected = torch.sigmoid(q @ k.transpose(-1, -2) / math.sqrt(D) - math.log(T) + bias) * mask
    got = attention_weights(q, k, get_variant(name, position_bias="alibi"))
    assert _max_err(got, expected) <= 1e-12
    assert _max_err(got, attention_weights(q, k, get_variant(name))) > 1e-3  # the bias changes the weights


def test_alibi_in_chunked_dense_uses_absolute_rows():
    spec = get_variant("lssar", position_bias="alibi")
    q, k, v = _qkv(40, D=16, H=3)
    assert _max_err(attend_dense(q, k, v, spec, chunk_bytes=1), attend_dense(q, k, v, spec)) <= 1e-12
    with pytest.raises(ValueError, match="position_bias='alibi' needs q of shape"):
        from attnlab.attention.dense import weights_for_rows
        weights_for_rows(q[0, 0], k[0, 0], spec)


# --- ALiBi: FlexAttention against the dense reference, forward and backward ---------------------------------------

ALIBI_VARIANTS = [("softmax", None), ("lssa", None), ("lssar", 15), ("softmax", 3), ("softmax_qknorm_logn", None),
                  ("relu_wortsman", None), ("gelu", None), ("softmax_recentred_l1", None), ("relu_shen", None)]


@pytest.mark.parametrize("H", [3, 4])
@pytest.mark.parametrize("name, p", ALIBI_VARIANTS, ids=lambda x: str(x))
def test_alibi_flex_matches_dense_forward_and_backward(name, p, H):
    spec = get_variant(name, position_bias="alibi", **({"p": p} if p is not None else {}))
    assert is_fusable(spec)
    worst_out = worst_grad = 0.0
    for T in LENGTHS:
        D = 16
        q, k, v = _qkv(T, D=D, H=H, seed=3 * T, requires_grad=True)
        gains = _gain_for(spec, H, D, requires_grad=True)
        inputs = (q, k, v, *(gains or ()))
        w = torch.randn(1, H, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
        ref = attend_dense(q, k, v, spec, qk_gain=gains)
        out = attend_flex(q, k, v, spec, qk_gain=gains)
        worst_out = max(worst_out, _max_err(out, ref))
        expected = torch.autograd.grad((ref * w).sum(), inputs)
        got = torch.autograd.grad((out * w).sum(), inputs)
        worst_grad = max(worst_grad, *(_max_err(a, b) for a, b in zip(got, expected)))
    assert worst_out <= 1e-9 and worst_grad <= 1e-8, (worst_out, worst_grad)


def test_alibi_routing_avoids_sdpa():
    spec = get_variant("softmax", position_bias="alibi")
    assert not is_sdpa_exact(spec)
    assert resolve_backend(spec, "cuda") is Backend.FLEX and resolve_backend(spec, "cpu") is Backend.DENSE
    assert resolve_backend(get_variant("lssar", position_bias="alibi"), "cuda") is Backend.FLEX
    q, k, v = _qkv(5)
    with pytest.raises(ValueError) as info:
        attend(q, k, v, spec, impl="sdpa")
    assert "position_bias='alibi'" in str(info.value) and "\n" not in str(info.value)
