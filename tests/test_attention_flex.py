"""The fused FlexAttention path against the dense reference: forward (and backward) on CPU in float64, the
fallback of variants without a fused form, bf16 inputs, and on a CUDA GPU forward and backward at 1K and 4K.

On CPU the fused path runs FlexAttention's own unfused implementation (the compiled one has no CPU backward):
same score_mods, same two passes, same captured normaliser, so the math is checked here and the kernels on GPU.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask

from attnlab.attention import Backend, attend, get_variant, variant_names
from attnlab.attention import flex
from attnlab.attention.dense import attend_dense
from attnlab.attention.masks import causal_rows
from attnlab.attention.flex import (RadialGradientRemoved, Sizes, attend_flex, first_stage_score_mod,
                                    inverse_norm, is_fusable, sharpen_rows_with_mass, sharpen_score_mod)
from attnlab.attention.masks import causal_block_mask, causal_mask_mod, visible_keys

# Written out by hand from docs/attention.md#which-variants-are-fused: normalised non-negative rows (the ones that
# may also be sharpened; relu_l1 duplicates relu).
SHARPENABLE = ("softmax exp scenario_iv relu relu2 relu6 sigmoid softplus sigmoid_ramapuram_b_l1 sigmoid_l1 relu_l1 "
               "lssa lssar").split()
# Fused through FlexAttention's row sums (norm none/count, output LayerNorm: Table 4) and the sign split of a
# sign-changing f, negate and recentre (Tables 1-3).
TABLE4_ROW_SUMS = ("sigmoid_ramapuram", "sigmoid_ramapuram_b", "relu_wortsman", "relu_shen")
SIGN_SPLIT_AND_POST = ("gelu", "mish", "scenario_i", "scenario_ii", "scenario_iii", "softmax_inverse",
                       "softmax_recentred", "softmax_recentred_l1")
# The modern softmax baselines (tests/test_attention_baselines.py checks them against the dense reference).
BASELINES = ("softmax_qknorm", "softmax_logn", "softmax_qknorm_logn")
FUSABLE = SHARPENABLE + list(TABLE4_ROW_SUMS) + list(SIGN_SPLIT_AND_POST) + list(BASELINES)
# Overrides with a fused form that no registered variant has: post-processing on other rows.
FUSED_OVERRIDES = [("relu_l1", dict(post="recentre_l1")), ("lssa", dict(post="recentre_l1")),
                   ("relu_wortsman", dict(post="negate")), ("mish", dict(post="recentre")),
                   ("relu_shen", dict(post="recentre")), ("scenario_iii", dict(bias="neg_log_n"))]
# Overrides without one: sharpening of rows that are not normalised non-negative ones, recentre_l1 of them.
UNFUSABLE = [("relu_wortsman", dict(p=3)), ("gelu", dict(p=2)), ("softmax_inverse", dict(p=3)),
             ("gelu", dict(post="recentre_l1"))]
FORWARD_VARIANTS = [n for n in SHARPENABLE if n not in ("exp", "scenario_iv", "relu_l1")]  # one per distinct spec
LENGTHS = (1, 2, 3, 4, 17, 64, 130)  # the first-three-rows rule, odd sizes, and past one 128-row block
POWERS = (None, 1, 3, 15)
HEAD_DIMS = (16, 64)


def _qkv(T, D, dtype=torch.float64, seed=0, B=1, H=2, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)
            for _ in range(3)]


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


# --- masks and positions --------------------------------------------------------------------------------------

@pytest.mark.parametrize("T", [1, 5, 130])
def test_flex_mask_and_counts_are_the_dense_ones(T):
    rows, visible = causal_rows(0, T, T, "cpu")
    assert torch.equal(create_mask(causal_mask_mod, 1, 1, T, T, device="cpu")[0, 0], visible)
    assert torch.equal(visible_keys(torch.arange(T), torch.float64), (rows[:, 0] + 1).double())
    assert causal_block_mask(T, "cpu") is causal_block_mask(T, torch.device("cpu"))  # built once


# --- which variants are fused ----------------------------------------------------------------------------------

def test_every_registered_variant_is_fusable():
    assert sorted(n for n in variant_names() if is_fusable(get_variant(n))) == sorted(FUSABLE) == variant_names()
    assert is_fusable(get_variant("softmax", p=3)) and is_fusable(get_variant("sigmoid_l1", scale="log_n"))
    assert is_fusable(get_variant("lssa", phi="mish"))  # the sign split
    assert all(is_fusable(get_variant(n, **o)) for n, o in FUSED_OVERRIDES)
    assert all(is_fusable(get_variant(n, position_bias="alibi")) for n in FUSABLE)  # ALiBi is one more score term
    assert not any(is_fusable(get_variant(n, **o)) for n, o in UNFUSABLE)


# --- forward in float64 -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("p", POWERS, ids=lambda p: f"p{p}")
@pytest.mark.parametrize("name", FORWARD_VARIANTS)
def test_forward_matches_dense_in_float64(name, p):
    spec = get_variant(name, p=p)
    worst = 0.0
    for D in HEAD_DIMS:
        for T in LENGTHS:
            q, k, v = _qkv(T, D, seed=T * D)
            out = attend_flex(q, k, v, spec)
            assert out.shape == (1, 2, T, D) and out.dtype == torch.float64
            worst = max(worst, _max_err(out, attend_dense(q, k, v, spec)))
    assert worst <= 1e-6, f"{name} p={p}: max |flex - dense| = {worst:.2e}"


@pytest.mark.parametrize("name, p", [("lssar", 15), ("softmax", 3), ("sigmoid_l1", 1)])
def test_uniform_rows_keep_the_unsharpened_row(name, p):
    # q = 0: every score is equal, A is uniform; rows >= 3 have no key above 1/N_i (the all-zero fallback) and
    # rows 0-2 sharpen a uniform row into itself, so every output row is the running mean of v.
    T, D = 9, 16
    _, k, v = _qkv(T, D)
    q = torch.zeros_like(k)
    expected = torch.cumsum(v, dim=-2) / torch.arange(1, T + 1, dtype=torch.float64)[:, None]
    out = attend_flex(q, k, v, get_variant(name, p=p))
    assert _max_err(out, expected) <= 1e-12
    assert _max_err(out, attend_dense(q, k, v, get_variant(name, p=p))) <= 1e-12


@pytest.mark.parametrize("p", [None, 3])
def test_relu_rows_with_no_positive_score_give_zero(p):
    # Every key is +u; rows with q = -u have only negative scores: relu(S) is all zero, l1norm keeps the zero
    # row, and sharpening keeps it too. Rows with q = +u see equal positive scores: the running mean of v.
    # Over 200 seeded draws: with p, about 1 in 100 once gave a row its rounding noise sharpened (flex only;
    # draw 88 of these), until a uniform row's excess within rounding no longer counted as mass.
    T, D = 8, 16
    spec = get_variant("relu_l1", p=p)
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    for draw in range(200):
        u = torch.randn(D, dtype=torch.float64, generator=generator)
        k = u.expand(1, 1, T, D).clone()
        q = (sign[:, None] * u).expand(1, 1, T, D).clone()
        v = torch.randn(1, 1, T, D, dtype=torch.float64, generator=generator)
        running_mean = torch.cumsum(v, dim=-2) / torch.arange(1, T + 1, dtype=torch.float64)[:, None]
        expected = torch.where(sign[:, None] > 0, running_mean, torch.zeros(()))
        out = attend_flex(q, k, v, spec)
        assert torch.isfinite(out).all()
        assert _max_err(out, expected) <= 1e-12, draw
        assert _max_err(out, attend_dense(q, k, v, spec)) <= 1e-12, draw


def test_rows_with_mass_from_lse_and_row_max():
    # log Z = log 4 and max log f = log 2 give max A = 1/2: N * max A = (i + 1) / 2 > O_i for i = 0..2 (O = 0)
    # and for i >= 3 (O = 1, N >= 4); a row with LSE -inf (no visible weight) has no mass.
    log_z = torch.full((1, 1, 6), math.log(4.0), dtype=torch.float64)
    max_log = torch.full((1, 1, 6), math.log(2.0), dtype=torch.float64)
    max_log[..., 4] = math.log(0.25 * 4 / 5)  # row 4: N * max A = 5 * 0.2 = 1, not above O = 1
    log_z[..., 5] = float("-inf")
    max_log[..., 5] = float("-inf")
    assert sharpen_rows_with_mass(log_z, max_log)[0, 0].tolist() == [True, True, True, True, False, False]


# --- fallback of variants without a fused form ---------------------------------------------------------------

def test_unfusable_variants_fall_back_to_dense_and_warn_once(monkeypatch):
    monkeypatch.setattr(flex, "_warned_fallback", set())
    q, k, v = _qkv(11, 16)
    for spec in [get_variant(n, **o) for n, o in UNFUSABLE[:3]]:  # three distinct names (one warning each)
        name = spec.name
        with warnings.catch_warnings(record=True) as first:
            warnings.simplefilter("always")
            out = attend_flex(q, k, v, spec)
        with warnings.catch_warnings(record=True) as second:
            warnings.simplefilter("always")
            again = attend(q, k, v, spec, impl="flex")
        assert torch.equal(out, attend_dense(q, k, v, spec)) and torch.equal(again, out)
        messages = [str(w.message) for w in first]
        assert len(messages) == 1 and f"'{name}'" in messages[0] and "dense reference" in messages[0], messages
        assert not second, [str(w.message) for w in second]


# --- dtypes and dispatch -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, p", [("lssar", 15), ("softmax", 3), ("sigmoid_l1", None)])
def test_bf16_inputs_are_accepted(name, p):
    spec = get_variant(name, p=p)
    q, k, v = _qkv(130, 64, dtype=torch.bfloat16)
    out = attend_flex(q, k, v, spec)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    reference = attend_dense(q.double(), k.double(), v.double(), spec)  # the same bf16 values, exactly
    flex_err = _max_err(out, reference) / reference.abs().max().item()
    dense_err = _max_err(attend_dense(q, k, v, spec), reference) / reference.abs().max().item()
    # Stated tolerance: 3e-2 of the largest output (the dense path in bf16 is at ~2e-3 here).
    assert flex_err <= 3e-2, f"bf16 flex error {flex_err:.1e} (dense in bf16: {dense_err:.1e})"


def test_mixed_dtypes_and_value_head_dim():
    spec = get_variant("lssar")
    q, k, _ = _qkv(20, 16, dtype=torch.float32)
    v = torch.randn(1, 2, 20, 32, dtype=torch.float64)
    out = attend_flex(q, k, v, spec)
    assert out.shape == (1, 2, 20, 32) and out.dtype == torch.float64
    assert _max_err(out, attend_dense(q, k, v, spec)) <= 1e-5


def test_attend_dispatches_flex_and_auto():
    spec = get_variant("lssar", p=3)
    q, k, v = _qkv(33, 16, dtype=torch.float32)
    for impl in ("flex", Backend.FLEX):
        assert torch.equal(attend(q, k, v, spec, impl=impl), attend_flex(q, k, v, spec))
    assert torch.equal(attend(q, k, v, spec, impl="auto"), attend_dense(q, k, v, spec))  # CPU: the reference
    with pytest.raises(ValueError, match="impl='fused'.*auto, dense, flex, sdpa"):
        attend(q, k, v, spec, impl="fused")


# --- backward (CPU, float64: FlexAttention's unfused implementation differentiates the same score_mods) ---------

def test_radial_gradient_removal_is_the_normalisation_gradient():
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, 16, dtype=torch.float64)
    (expected,) = torch.autograd.grad((F.normalize(x, dim=-1) * w).sum(), x)
    (got,) = torch.autograd.grad((RadialGradientRemoved.apply(x) * inverse_norm(x)[..., None] * w).sum(), x)
    assert _max_err(got, expected) <= 1e-13


@pytest.mark.parametrize("name, p, T", [("lssar", 15, 130), ("lssa", None, 17), ("softmax", 3, 17),
                                        ("relu_l1", 3, 17), ("sigmoid_ramapuram_b_l1", 15, 17)])
def test_backward_matches_dense_in_float64(name, p, T):
    spec = get_variant(name, p=p)
    q, k, v = _qkv(T, 16, requires_grad=True)
    w = torch.randn(1, 2, T, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((attend_flex(q, k, v, spec) * w).sum(), (q, k, v))
    expected = torch.autograd.grad((attend_dense(q, k, v, spec) * w).sum(), (q, k, v))
    for label, a, b in zip("qkv", got, expected):
        assert _max_err(a, b) <= 1e-9 * max(1.0, b.abs().max().item()), f"d{label}: {_max_err(a, b):.2e}"


# Every sharpened form: each distinct normalised non-negative variant at p = 3, LSSAR with ALiBi, a learned QK-norm
# gain (softmax_qknorm) sharpened with and without ALiBi, and recentre_l1 of softmax, relu_l1 and lssa.
SHARPENED_GRADIENT_CASES = ([(name, dict(p=3)) for name in FORWARD_VARIANTS]
                            + [("lssar", dict(position_bias="alibi")), ("softmax_qknorm", dict(p=5)),
                               ("softmax_qknorm_logn", dict(p=15, position_bias="alibi")),
                               ("softmax_recentred_l1", {}), ("relu_l1", dict(post="recentre_l1")),
                               ("lssa", dict(post="recentre_l1", position_bias="alibi"))])


@pytest.mark.parametrize("name, overrides", SHARPENED_GRADIENT_CASES,
                         ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}={v}" for k, v in x.items()))
def test_two_pass_gradients_match_dense_in_float64(name, overrides):
    # The backward of the two passes (docs/attention.md#the-backward-of-the-two-passes): pass 2 reads log Z as a
    # constant and pass 1 gets dL/dlog Z as an LSE gradient, from one more call. q, k, v and the learned gains.
    spec = get_variant(name, **overrides)
    worst = 0.0
    for T in (4, 17, 130):
        q, k, v = _qkv(T, 16, seed=T, B=2, requires_grad=True)
        gen = torch.Generator().manual_seed(T)
        w = torch.randn(2, 2, T, 16, dtype=torch.float64, generator=gen)
        gains = None
        if spec.learned_qk_gain:
            gains = ((1 + 0.1 * torch.randn(2, 16, generator=gen, dtype=torch.float64)).requires_grad_(),
                     (1 + 0.1 * torch.randn(16, generator=gen, dtype=torch.float64)).requires_grad_())
        inputs = (q, k, v, *(gains or ()))
        got = torch.autograd.grad((attend_flex(q, k, v, spec, qk_gain=gains) * w).sum(), inputs)
        want = torch.autograd.grad((attend_dense(q, k, v, spec, qk_gain=gains) * w).sum(), inputs)
        worst = max(worst, *(_max_err(a, b) / max(1.0, b.abs().max().item()) for a, b in zip(got, want)))
    assert worst <= 1e-9, f"{name} {overrides}: {worst:.2e}"


def test_a_tensor_power_is_the_power_of_the_spec():
    # attend(..., p=tensor) (how the model passes p_eval) equals the spec with that power, forward and backward, on
    # the fused path and the dense one; the tensor's value is read, not the spec's.
    q, k, v = _qkv(17, 16, requires_grad=True)
    for impl in ("flex", "dense"):
        for p in (1.0, 3.0, 31.0):
            got = attend(q, k, v, get_variant("lssar"), impl=impl, p=torch.tensor(p, dtype=torch.float64))
            want = attend(q, k, v, get_variant("lssar", p=p), impl=impl)
            assert _max_err(got, want) <= 1e-13
            g = torch.autograd.grad(got.sum(), q)[0]
            assert _max_err(g, torch.autograd.grad(want.sum(), q)[0]) <= 1e-12
    with pytest.raises(ValueError, match="p=.* is given but attention 'lssa' is not sharpened"):
        attend(q, k, v, get_variant("lssa"), impl="flex", p=3.0)
    with pytest.raises(ValueError, match="0-d floating-point tensor"):
        attend(q, k, v, get_variant("lssar"), impl="flex", p=torch.tensor([3.0]))


def test_backward_needs_the_gradient_of_pass_one_normaliser():
    # The same two passes with nothing handed to pass 1's LSE (pass 2 reads it detached) give a visibly wrong dq:
    # the LSE gradient attend_log_scores adds is what makes test_backward_matches_dense_in_float64 pass.
    spec = get_variant("softmax", p=3)
    T, D = 17, 16
    q, k, v = _qkv(T, D, requires_grad=True)
    sizes, block_mask = Sizes(D, T), causal_block_mask(T, "cpu")
    first = first_stage_score_mod(spec, sizes)
    _, log_z, max_log = flex._flex_unfused(q, k, q.new_zeros(1, 2, T, 16), first, block_mask, with_stats=True)
    has_mass = sharpen_rows_with_mass(log_z.detach(), max_log.detach())
    second = sharpen_score_mod(first, log_z.detach(), has_mass, torch.tensor(3.0, dtype=torch.float64))
    out, _, _ = flex._flex_unfused(q, k, v, second, block_mask, with_stats=False)
    (dq_detached,) = torch.autograd.grad(out.sum(), q)
    (dq_dense,) = torch.autograd.grad(attend_dense(q, k, v, spec).sum(), q)
    assert _max_err(out, attend_dense(q, k, v, spec)) <= 1e-12  # same forward
    assert _max_err(dq_detached, dq_dense) > 1e-2


# --- unnormalised rows and the sign split (FlexAttention's row sums: out * exp(lse)) ---------------------------------

def _forward_and_grads(fn, spec, q, k, v, w):
    out = fn(q, k, v, spec)
    return (out, *torch.autograd.grad((out * w).sum(), (q, k, v)))


@pytest.mark.parametrize("name, overrides", [(n, {}) for n in TABLE4_ROW_SUMS + SIGN_SPLIT_AND_POST] + FUSED_OVERRIDES,
                         ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}={v}" for k, v in x.items()))
def test_row_sum_variants_match_dense_forward_and_backward_in_float64(name, overrides):
    spec = get_variant(name, **overrides)
    worst = dict.fromkeys(("out", "dq", "dk", "dv"), 0.0)
    for D, T in ((16, 1), (16, 4), (16, 17), (64, 130)):
        q, k, v = _qkv(T, D, seed=T * D, requires_grad=True)
        w = torch.randn(1, 2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
        got = _forward_and_grads(attend_flex, spec, q, k, v, w)
        want = _forward_and_grads(attend_dense, spec, q, k, v, w)
        for key, a, b in zip(worst, got, want):
            worst[key] = max(worst[key], _max_err(a, b))
    assert max(worst.values()) <= 1e-6, f"{name}: {worst}"


@pytest.mark.parametrize("name", ["relu_wortsman", "relu_shen", "scenario_i", "gelu"])
def test_rows_without_visible_weight_are_zero_without_nan(name):
    # Keys all +u, queries -u on some rows: relu rows see only negative scores (lse = -inf, output exactly 0
    # before LayerNorm); a zero query gives identity/gelu rows of exact zeros (both f+ and f- empty).
    T, D = 8, 16
    u = torch.randn(D, dtype=torch.float64)
    sign = torch.tensor([1.0, -1.0, 0.0, -1.0, -1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    q = (sign[:, None] * u).expand(1, 1, T, D).clone().requires_grad_()
    k = u.expand(1, 1, T, D).clone().requires_grad_()
    v = torch.randn(1, 1, T, D, dtype=torch.float64, requires_grad=True)
    spec = get_variant(name)
    got = _forward_and_grads(attend_flex, spec, q, k, v, torch.ones(1, 1, T, D, dtype=torch.float64))
    want = _forward_and_grads(attend_dense, spec, q, k, v, torch.ones(1, 1, T, D, dtype=torch.float64))
    # At an exact zero of a sign-changing f both parts are empty and the sign split's gradient there is 0 (as
    # relu's at 0), where the dense identity/gelu have f'(0): so for those, outputs only (a measure-zero case).
    compared = 4 if spec.phi == "relu" else 1
    for a, b in zip(got[:compared], want[:compared]):
        assert _max_err(a, b) <= 1e-9
    assert all(torch.isfinite(a).all() for a in got)
    if spec.out_norm == "none":
        empty_row = 1 if spec.phi == "relu" else 2  # relu: only negative scores; identity/gelu: all scores 0
        assert torch.equal(got[0][0, 0, empty_row], torch.zeros(D, dtype=torch.float64))


@pytest.mark.parametrize("name", ["sigmoid_ramapuram", "relu_shen", "gelu", "softmax_recentred"])
def test_row_sum_variants_accept_bf16(name):
    spec = get_variant(name)
    q, k, v = _qkv(130, 64, dtype=torch.bfloat16)
    out = attend_flex(q, k, v, spec)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    reference = attend_dense(q.double(), k.double(), v.double(), spec)
    assert _max_err(out, reference) <= 3e-2 * reference.abs().max().item()


# --- CUDA: the compiled kernels (skipped without a GPU) ------------------------------------------------------------

def cuda(test):
    """Mark a test as a CUDA test (``pytest -m gpu`` selects them all) and skip it without a CUDA device."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled FlexAttention)")
    return pytest.mark.gpu(skip(test))

# Stated tolerances, as a fraction of the largest |value| of the float64 dense reference on the same inputs.
CUDA_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2}
CUDA_CASES = ([("lssar", 15, T, dt) for T in (1024, 4096) for dt in (torch.float32, torch.bfloat16)]
              + [(n, p, 1024, dt) for n, p in (("lssa", None), ("softmax", None), ("softmax", 3), ("sigmoid_l1", 3))
                 for dt in (torch.float32, torch.bfloat16)]
              # the row sums (Table 4) in both dtypes; the sign split and recentre_l1 in float32 (f+ and f- parts
              # can cancel, so bf16 outputs there are not held to a fraction of the largest value)
              + [(n, None, 1024, dt) for n in TABLE4_ROW_SUMS for dt in (torch.float32, torch.bfloat16)]
              + [(n, None, 1024, torch.float32) for n in ("gelu", "scenario_i", "softmax_recentred_l1")])


@cuda
@pytest.mark.parametrize("name, p, T, dtype", CUDA_CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_cuda_forward_and_backward_match_dense(name, p, T, dtype):
    spec = get_variant(name, p=p)
    base = [t.to("cuda", dtype) for t in _qkv(T, 64, dtype=torch.float32, B=1, H=4)]
    w = torch.randn(1, 4, T, 64, device="cuda", dtype=torch.float64)

    def run(fn, tensors):
        tensors = [t.detach().clone().requires_grad_() for t in tensors]
        out = fn(*tensors, spec)
        grads = torch.autograd.grad((out.double() * w).sum(), tensors)
        return out.detach(), grads

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, grads = run(attend_flex, base)
    assert not [w for w in caught if "no fused form" in str(w.message)]  # really the fused path
    ref_out, ref_grads = run(attend_dense, [t.double() for t in base])
    tol = CUDA_TOLERANCE[dtype]
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert _max_err(out, ref_out) <= tol * ref_out.abs().max().item()
    for label, g, r in zip("qkv", grads, ref_grads):
        assert torch.isfinite(g).all()
        assert _max_err(g, r) <= tol * r.abs().max().item(), f"d{label}: {_max_err(g, r) / r.abs().max():.2e}"


@cuda
def test_cuda_auto_uses_the_fused_path():
    spec = get_variant("lssar")
    q, k, v = (t.to("cuda") for t in _qkv(1024, 64, dtype=torch.float32))
    assert torch.equal(attend(q, k, v, spec, impl="auto"), attend_flex(q, k, v, spec))


@cuda
def test_cuda_compiled_model_with_flex_matches_eager():
    # FlexAttention inside a compiled model: the enclosing graph compiles it (flex.py's is_compiling branch)
    # and builds the block mask in the graph; forward and backward must equal the eager model's.
    from attnlab.model import GPT, compile_model, preset

    torch.manual_seed(0)
    eager = GPT(preset("tiny", attention="lssar", vocab_size=512)).cuda()
    compiled = GPT(preset("tiny", attention="lssar", vocab_size=512)).cuda()
    compiled.load_state_dict(eager.state_dict())
    compile_model(compiled, True)
    idx = torch.randint(0, 512, (2, 257), device="cuda")
    losses, grads = [], []
    for model in (eager, compiled):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        losses.append(loss.item())
        grads.append(model.blocks[0].attn.c_attn.weight.grad.float())
    assert losses[1] == pytest.approx(losses[0], rel=2e-3)
    assert _max_err(grads[1], grads[0]) <= 5e-2 * grads[0].abs().max().item()
