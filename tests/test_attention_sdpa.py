"""The backend names and the rule that picks one, and the SDPA softmax path against the dense reference.

SDPA runs on CPU too (PyTorch's own CPU kernels), so its equivalence is tested here for every scale override,
QK-norm on and off, the per-row biases, in float64, float32 and bf16, forward and backward. On CUDA the same
checks run on FlashAttention (marked ``gpu``, skipped without a CUDA device).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from attnlab.attention import Backend, attend, get_variant, resolve_backend, variant_names
from attnlab.attention import flex
from attnlab.attention.dense import attend_dense
from attnlab.attention.flex import is_fusable
from attnlab.attention.kernels import unsupported_reason as kernels_unsupported_reason
from attnlab.attention.sdpa import attend_sdpa, is_sdpa_exact, sdpa_unsupported_reason
from attnlab.errors import UserError
from attnlab.model import GPT, preset

# Every scale override; coef*log_n with a small and an LSSA-sized coefficient.
SCALES = [dict(scale="inv_sqrt_d"), dict(scale="log_n"), dict(scale="logd_logn"), dict(scale=0.3),
          dict(scale=4.16)]
LENGTHS = (1, 2, 3, 17, 130)


def _qkv(T, D=64, dtype=torch.float64, seed=0, B=2, H=2, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)
            for _ in range(3)]


def _rel_err(a, b):
    return (a.double() - b.double()).abs().max().item() / max(b.abs().max().item(), 1e-300)


def _softmax(scale: dict, qk_norm: bool, **more):
    return get_variant("softmax", qk_norm=qk_norm, **scale, **more)


def _ids(value):
    return "-".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else str(value)


# --- the names -----------------------------------------------------------------------------------------------

def test_backend_names_and_parsing():
    assert Backend.names() == ("auto", "dense", "flex", "sdpa", "triton")
    assert [b.value for b in Backend] == list(Backend.names())
    for member in Backend:
        assert Backend.parse(member) is member and Backend.parse(member.value) is member
        assert member == member.value and f"{member}" == member.value
    for bad in ("fused", "SDPA", None, 3):
        with pytest.raises(ValueError, match=rf"impl={bad!r} is not allowed: use one of auto, dense, flex, sdpa, triton"):
            Backend.parse(bad)
    with pytest.raises(ValueError, match="model.attn_impl='x'"):
        Backend.parse("x", field="model.attn_impl")


# --- which backend runs a spec -----------------------------------------------------------------------------------

def test_sdpa_exact_variants_are_the_plain_softmaxes():
    exact = sorted(n for n in variant_names() if is_sdpa_exact(get_variant(n)))
    assert exact == ["exp", "scenario_iv", "softmax", "softmax_logn", "softmax_qknorm", "softmax_qknorm_logn"]
    for overrides in (*SCALES, dict(qk_norm=True), dict(bias="neg_log_n"), dict(bias="neg_log_t")):
        assert is_sdpa_exact(get_variant("softmax", **overrides)), overrides
    assert is_sdpa_exact(get_variant("lssa", phi="exp"))  # QK-norm + ln(d) ln(N_i) + exp: a softmax


@pytest.mark.parametrize("name, overrides, why", [
    ("lssar", {}, "phi='softplus' is not exp"),
    ("softmax", dict(p=3), "p=3 sharpens the rows"),
    ("softmax_recentred", {}, "post='recentre'"),
    ("softmax_inverse", {}, "post='negate'"),
    ("scenario_ii", {}, "norm='none'"),
    ("softmax", dict(out_norm="layernorm"), "out_norm='layernorm'"),
    ("softmax", dict(position_bias="alibi"), "position_bias='alibi'"),
    ("softmax_logn", dict(position_bias="alibi"), "position_bias='alibi'"),
])
def test_sdpa_refuses_what_it_cannot_compute_exactly(name, overrides, why):
    spec = get_variant(name, **overrides)
    assert why in sdpa_unsupported_reason(spec)
    q, k, v = _qkv(5, 16)
    for call in (lambda: attend(q, k, v, spec, impl="sdpa"), lambda: attend_sdpa(q, k, v, spec),
                 lambda: resolve_backend(spec, "cuda", Backend.SDPA)):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert "\n" not in message and f"attention {name!r}" in message and why in message, message


def test_auto_is_dense_on_cpu_for_every_variant():
    for name in variant_names():
        assert resolve_backend(get_variant(name), "cpu") is Backend.DENSE, name
    spec = get_variant("softmax")
    q, k, v = _qkv(33, 16, dtype=torch.float32)
    assert torch.equal(attend(q, k, v, spec), attend_dense(q, k, v, spec))  # CPU results do not change


def test_auto_on_cuda_picks_the_fastest_exact_path(monkeypatch):
    # Resolution needs only the device, so the CUDA choice is checked here without a GPU.
    monkeypatch.setattr(flex, "_warned_fallback", set())
    cuda = torch.device("cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning for the fused choices
        for overrides in (*SCALES, dict(qk_norm=True, scale="logd_logn"), dict(bias="neg_log_n")):
            assert resolve_backend(get_variant("softmax", **overrides), cuda) is Backend.SDPA, overrides
        for name, overrides in (("lssa", {}), ("lssar", {}), ("softmax", dict(p=3)), ("sigmoid_l1", dict(p=15))):
            assert resolve_backend(get_variant(name, **overrides), cuda) is Backend.TRITON, name
        for name, overrides in (("relu_l1", {}), ("sigmoid_ramapuram_b_l1", {}), ("lssar", dict(position_bias="alibi"))):
            assert resolve_backend(get_variant(name, **overrides), cuda) is Backend.FLEX, name
    for name in variant_names():
        spec = get_variant(name)
        expected = (Backend.SDPA if is_sdpa_exact(spec) else Backend.TRITON if kernels_unsupported_reason(spec) is None
                    else Backend.FLEX if is_fusable(spec) else Backend.DENSE)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert resolve_backend(spec, cuda) is expected, name
            assert resolve_backend(spec, cuda, "auto") is expected  # the second time: no second warning
        fallback = [str(w.message) for w in caught if "dense reference" in str(w.message)]
        assert len(fallback) <= (1 if expected is Backend.DENSE else 0), (name, fallback)
    monkeypatch.setattr(flex, "_warned_fallback", set())
    with pytest.warns(UserWarning, match="'gelu' has no fused form.*dense reference"):
        assert resolve_backend(get_variant("gelu", p=2), cuda) is Backend.DENSE  # sharpening a sign-changing f
    assert all(resolve_backend(get_variant(name), cuda) is not Backend.DENSE for name in variant_names())
    assert resolve_backend(get_variant("lssar"), cuda, "dense") is Backend.DENSE
    assert resolve_backend(get_variant("softmax"), "cpu", Backend.SDPA) is Backend.SDPA


def test_attend_sdpa_calls_the_fused_kernel(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    q, k, v = _qkv(9, 16)
    attend(q, k, v, get_variant("softmax"), impl=Backend.SDPA)
    attend(q, k, v, get_variant("softmax", scale="log_n", qk_norm=True), impl="sdpa")
    attend(q, k, v, get_variant("softmax"), impl="dense")
    assert len(calls) == 2 and all(c["is_causal"] for c in calls)
    assert calls[0]["scale"] == pytest.approx(1 / 4) and calls[1]["scale"] == 1.0


# --- forward and backward against the dense reference --------------------------------------------------------------

@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("scale", SCALES, ids=_ids)
def test_forward_matches_dense_in_float64_and_float32(scale, qk_norm):
    spec = _softmax(scale, qk_norm)
    worst = {torch.float64: 0.0, torch.float32: 0.0}
    for T in LENGTHS:
        for dtype in worst:
            q, k, v = _qkv(T, dtype=dtype, seed=T)
            out = attend_sdpa(q, k, v, spec)
            assert out.shape == v.shape and out.dtype == dtype
            worst[dtype] = max(worst[dtype], _rel_err(out, attend_dense(q, k, v, spec)))
    assert worst[torch.float64] <= 1e-12, worst
    # float32: the kernel's and the reference's summation orders differ; logits reach ~200 (ln d ln N, no norm)
    assert worst[torch.float32] <= 1e-4, worst


@pytest.mark.parametrize("bias", ["neg_log_n", "neg_log_t"])
def test_a_per_row_bias_does_not_change_a_softmax_row(bias):
    for qk_norm in (False, True):
        spec = get_variant("softmax", scale="log_n", qk_norm=qk_norm, bias=bias)
        q, k, v = _qkv(40)
        assert _rel_err(attend_sdpa(q, k, v, spec), attend_dense(q, k, v, spec)) <= 1e-12


# bf16: the scaled (and normalised) q, k are rounded to bf16 before the kernel. Cases whose logits stay in the
# tens: every scale with QK-norm; without it, the scales that keep |logit| ~ |q.k|/sqrt(d) (ln d ln N_i or
# 4.16 ln N_i without QK-norm give logits in the hundreds, where bf16's 8 bits round whole logit units).
BF16_CASES = [(s, True) for s in SCALES] + [(s, False) for s in SCALES[:2]] + [(dict(scale=0.3), False)]
# Stated tolerance, as a fraction of the largest |output| of the float64 reference on the same bf16 inputs
# (the dense path in bf16 is at ~2e-3 here, SDPA at 1e-3 .. 5e-3).
BF16_TOLERANCE = 2e-2


@pytest.mark.parametrize("scale, qk_norm", BF16_CASES, ids=_ids)
def test_bf16_forward_and_backward_within_tolerance(scale, qk_norm):
    spec = _softmax(scale, qk_norm)
    q, k, v = _qkv(130, dtype=torch.bfloat16, seed=7, requires_grad=True)
    w = torch.randn(2, 2, 130, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = attend_sdpa(q, k, v, spec)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    grads = torch.autograd.grad((out.double() * w).sum(), (q, k, v))
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attend_dense(*ref_in, spec)
    ref_grads = torch.autograd.grad((ref * w).sum(), ref_in)
    assert _rel_err(out, ref) <= BF16_TOLERANCE
    for label, g, r in zip("qkv", grads, ref_grads):
        assert g.dtype == torch.bfloat16 and torch.isfinite(g).all()
        assert _rel_err(g, r) <= 2 * BF16_TOLERANCE, f"d{label}: {_rel_err(g, r):.1e}"


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("scale", SCALES, ids=_ids)
def test_backward_matches_dense_in_float64(scale, qk_norm):
    spec = _softmax(scale, qk_norm)
    for T in (3, 17, 130):
        q, k, v = _qkv(T, D=16, requires_grad=True, seed=T)
        w = torch.randn(2, 2, T, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
        got = torch.autograd.grad((attend_sdpa(q, k, v, spec) * w).sum(), (q, k, v))
        expected = torch.autograd.grad((attend_dense(q, k, v, spec) * w).sum(), (q, k, v))
        for label, a, b in zip("qkv", got, expected):
            assert _rel_err(a, b) <= 1e-10, f"T={T} d{label}: {_rel_err(a, b):.2e}"


def test_backward_in_float32():
    spec = get_variant("softmax", scale="log_n", qk_norm=True)
    q, k, v = _qkv(130, dtype=torch.float32, requires_grad=True)
    got = torch.autograd.grad(attend_sdpa(q, k, v, spec).square().sum(), (q, k, v))
    expected = torch.autograd.grad(attend_dense(q, k, v, spec).square().sum(), (q, k, v))
    for a, b in zip(got, expected):
        assert _rel_err(a, b) <= 1e-4


def test_mixed_dtypes_and_value_head_dim():
    spec = get_variant("softmax", scale="log_n")
    q, k, _ = _qkv(20, 16, dtype=torch.float32)
    v = torch.randn(2, 2, 20, 32, dtype=torch.float64)
    out = attend_sdpa(q, k, v, spec)
    assert out.shape == (2, 2, 20, 32) and out.dtype == torch.float64
    assert _rel_err(out, attend_dense(q, k, v, spec)) <= 1e-5


# --- the model's choice ---------------------------------------------------------------------------------------------

def test_model_config_validates_attn_impl_against_backend():
    assert preset("tiny", attn_impl=Backend.SDPA).attn_impl == "sdpa"
    assert isinstance(preset("tiny", attn_impl=Backend.SDPA).attn_impl, str)
    assert preset("tiny").attn_impl == "auto"
    with pytest.raises(UserError, match="model.attn_impl='fused' is not allowed: use one of auto, dense, flex, sdpa"):
        preset("tiny", attn_impl="fused")
    with pytest.raises(UserError, match="model.attn_impl='sdpa' cannot compute attention 'lssar' exactly"):
        preset("tiny", attention="lssar", attn_impl="sdpa")


def test_model_with_sdpa_equals_the_dense_model():
    torch.manual_seed(0)
    cfg = preset("tiny", vocab_size=256, scale="log_n")
    model = GPT(cfg.replace(attn_impl="sdpa")).double()
    dense = GPT(cfg.replace(attn_impl="dense")).double()
    dense.load_state_dict(model.state_dict())
    idx = torch.randint(0, 256, (2, 65))
    _, loss = model(idx[:, :-1], idx[:, 1:])
    _, ref = dense(idx[:, :-1], idx[:, 1:])
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    loss.backward()
    ref.backward()
    g, r = model.blocks[0].attn.c_attn.weight.grad, dense.blocks[0].attn.c_attn.weight.grad
    assert _rel_err(g, r) <= 1e-10


# --- CUDA: FlashAttention against the reference (skipped without a GPU) -----------------------------------------------

def cuda(test):
    """Mark a test as a CUDA test (``pytest -m gpu`` selects them all) and skip it without a CUDA device."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    return pytest.mark.gpu(skip(test))


CUDA_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2}


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T", [1024, 4096])
@pytest.mark.parametrize("overrides", [{}, dict(scale="log_n"), dict(scale="logd_logn", qk_norm=True)], ids=_ids)
def test_cuda_auto_softmax_is_sdpa_and_matches_dense(overrides, T, dtype):
    spec = get_variant("softmax", **overrides)
    base = [t.to("cuda", dtype) for t in _qkv(T, 64, dtype=torch.float32, B=1, H=4)]
    w = torch.randn(1, 4, T, 64, device="cuda", dtype=torch.float64)

    def run(fn, tensors):
        tensors = [t.detach().clone().requires_grad_() for t in tensors]
        out = fn(*tensors)
        return out.detach(), torch.autograd.grad((out.double() * w).sum(), tensors)

    out, grads = run(lambda q, k, v: attend(q, k, v, spec), base)
    assert torch.equal(out, attend_sdpa(*base, spec))  # auto on CUDA is the SDPA path
    ref, ref_grads = run(lambda q, k, v: attend_dense(q, k, v, spec), [t.double() for t in base])
    tol = CUDA_TOLERANCE[dtype]
    assert out.dtype == dtype and _rel_err(out, ref) <= tol
    for label, g, r in zip("qkv", grads, ref_grads):
        assert torch.isfinite(g).all() and _rel_err(g, r) <= 2 * tol, f"d{label}: {_rel_err(g, r):.1e}"


@cuda
def test_cuda_bf16_sdpa_uses_a_flash_kernel():
    # The plain softmax case must stay on FlashAttention (no math fallback that materialises T x T).
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.to("cuda", torch.bfloat16) for t in _qkv(4096, 64, dtype=torch.float32, B=1, H=4))
    for overrides in ({}, dict(scale="log_n", qk_norm=True)):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            out = attend(q, k, v, get_variant("softmax", **overrides))
        assert torch.isfinite(out).all()
