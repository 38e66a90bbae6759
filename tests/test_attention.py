"""The attention library against an independent, row-by-row implementation of docs/attention.md, plus invariants."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnlab.attention import attend, attention_weights, get_variant, variant_names

REQUIRED = ("softmax softmax_inverse softmax_recentred softmax_recentred_l1 scenario_i scenario_ii scenario_iii "
            "relu relu2 relu6 gelu sigmoid softplus mish exp sigmoid_ramapuram sigmoid_ramapuram_b "
            "sigmoid_ramapuram_b_l1 sigmoid_l1 relu_wortsman relu_l1 relu_shen lssa lssar").split()
NORMALISED = ("softmax exp scenario_iv scenario_iii relu relu2 relu6 sigmoid softplus sigmoid_ramapuram_b_l1 "
              "sigmoid_l1 relu_l1 lssa lssar").split()


# --- an independent implementation: plain Python floats, one row at a time, straight from docs/attention.md ---

def _softplus(x):
    return math.log1p(math.exp(-abs(x))) + max(x, 0.0)


def _gelu(x):
    return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))


PHI = {
    "identity": lambda x: x, "relu": lambda x: max(x, 0.0), "relu2": lambda x: max(x, 0.0) ** 2,
    "relu6": lambda x: min(max(x, 0.0), 6.0), "gelu": _gelu, "sigmoid": lambda x: 1 / (1 + math.exp(-x)),
    "softplus": _softplus, "mish": lambda x: x * math.tanh(_softplus(x)), "exp": math.exp,
}
# name -> (phi, norm, scale, qk_norm, bias, post), written out again from docs/attention.md#variants
TABLE = {
    "softmax": ("exp", "l1", "inv", False, None, None),
    "softmax_inverse": ("exp", "l1", "inv", False, None, "negate"),
    "softmax_recentred": ("exp", "l1", "inv", False, None, "recentre"),
    "softmax_recentred_l1": ("exp", "l1", "inv", False, None, "recentre_l1"),
    "scenario_i": ("identity", None, "inv", False, None, None),
    "scenario_ii": ("exp", None, "inv", False, None, None),
    "scenario_iii": ("identity", "l1", "inv", False, None, None),
    **{n: (n, "l1", "inv", False, None, None) for n in "relu relu2 relu6 gelu sigmoid softplus mish".split()},
    "sigmoid_ramapuram": ("sigmoid", None, "inv", False, "T", None),
    "sigmoid_ramapuram_b": ("sigmoid", None, "inv", False, "N", None),
    "sigmoid_ramapuram_b_l1": ("sigmoid", "l1", "inv", False, "N", None),
    "sigmoid_l1": ("sigmoid", "l1", "inv", False, None, None),
    "relu_wortsman": ("relu", "count", "inv", False, None, None),
    "relu_l1": ("relu", "l1", "inv", False, None, None),
    "relu_shen": ("relu", None, "inv", False, None, None),
    "lssa": ("softplus", "l1", "lssa", True, None, None),
    "lssar": ("softplus", "l1", "lssa", True, None, None),
}
TABLE["exp"] = TABLE["scenario_iv"] = TABLE["softmax"]


def reference_weights(q, k, name, p=None, scale=None):
    """q, k: (T, d) numpy float64 for one head. Returns the (T, T) weights of docs/attention.md."""
    f, norm, sc, qk_norm, bias, post = TABLE[name]
    T, d = q.shape
    if qk_norm:
        q = q / np.linalg.norm(q, axis=-1, keepdims=True)
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    out = np.zeros((T, T))
    for i in range(T):
        n = i + 1
        if scale is not None:
            s_i = scale(n, d)
        elif sc == "inv":
            s_i = 1 / math.sqrt(d)
        else:
            s_i = math.log(d) * math.log(n)
        row = []
        for j in range(n):
            s = s_i * float(q[i] @ k[j])
            if bias == "T":
                s -= math.log(T)
            elif bias == "N":
                s -= math.log(n)
            row.append(PHI[f](s))
        if norm == "l1":
            tot = sum(abs(x) for x in row)
            row = [x / tot if tot > 0 else 0.0 for x in row]
        elif norm == "count":
            row = [x / n for x in row]
        if post == "negate":
            row = [-x for x in row]
        elif post in ("recentre", "recentre_l1") and i >= 3:
            row = [x - 1 / n for x in row]
            if post == "recentre_l1":
                tot = sum(abs(x) for x in row)
                row = [x / tot if tot > 0 else 0.0 for x in row]
        if p is not None:
            o = 1.0 if i >= 3 else 0.0
            x = [max(n * a - o, 0.0) ** p for a in row]
            tot = sum(x)
            if tot > 0:
                row = [v / tot for v in x]
        out[i, :n] = row
    return out


def _qkv(T=5, d=8, B=2, H=2, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, d, generator=g, dtype=dtype) for _ in range(3)]


def test_every_required_name_is_registered():
    names = variant_names()
    for name in REQUIRED:
        assert name in names
    assert get_variant("lssar").p == 15
    assert get_variant("lssa").p is None
    assert get_variant("exp") == get_variant("softmax")


@pytest.mark.parametrize("name", sorted(TABLE))
@pytest.mark.parametrize("p", [None, 1, 3, 15])
def test_weights_match_independent_reference(name, p):
    q, k, _ = _qkv()
    spec = get_variant(name, p=p) if (p is not None or name != "lssar") else get_variant(name)
    p_ref = spec.p
    got = attention_weights(q, k, spec)
    assert got.shape == (2, 2, 5, 5) and got.dtype == torch.float64
    for b in range(2):
        for h in range(2):
            want = reference_weights(q[b, h].numpy(), k[b, h].numpy(), name, p=p_ref)
            np.testing.assert_allclose(got[b, h].numpy(), want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", REQUIRED)
def test_causal_and_normalised(name):
    q, k, _ = _qkv(T=7, d=16, dtype=torch.float32)
    for p in (None, 3):
        w = attention_weights(q, k, get_variant(name, p=p))
        assert torch.all(torch.triu(w, diagonal=1) == 0), "weight above the diagonal"
        if name in NORMALISED:  # l1norm: the absolute values of each row sum to 1 (sharpening re-normalises)
            rows = w.abs().sum(-1)
            if name.startswith("relu"):  # a row whose scores are all <= 0 has no mass at all: it stays zero
                rows = torch.where(rows == 0, torch.ones_like(rows), rows)
            assert torch.allclose(rows, torch.ones_like(rows), atol=1e-5), rows
    if name == "softmax_inverse":  # all weights <= 0: relu(N*A - O) is all zero, so every row falls back to A
        assert torch.equal(attention_weights(q, k, get_variant(name, p=3)), attention_weights(q, k, get_variant(name)))


def test_hand_worked_lssa_rows():
    # d = 4; row 1 sees k0 orthogonal to q1 (cos 0) and k1 equal to q1 (cos 1).
    q = torch.tensor([[1.0, 0, 0, 0], [0, 2.0, 0, 0]], dtype=torch.float64).view(1, 1, 2, 4)
    k = torch.tensor([[3.0, 0, 0, 0], [0, 0.5, 0, 0]], dtype=torch.float64).view(1, 1, 2, 4)
    w = attention_weights(q, k, get_variant("lssa"))[0, 0]
    scale1 = math.log(4) * math.log(2)
    a, b = math.log(2.0), math.log1p(math.exp(scale1))  # softplus(0), softplus(scale * 1)
    assert w[0, 0].item() == pytest.approx(1.0)  # row 0: log 1 = 0 -> softplus(0)/softplus(0)
    assert w[1, 0].item() == pytest.approx(a / (a + b), rel=1e-12)
    assert w[1, 1].item() == pytest.approx(b / (a + b), rel=1e-12)


def test_lssa_scale_is_ln_d_times_ln_n():
    # With every key equal to the query (cosine 1), row i holds softplus(ln d * ln N_i) at each visible key, so
    # weights are uniform; with one key orthogonal, the ratio of weights recovers the scale exactly.
    d, T = 64, 9
    e0, e1 = torch.zeros(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
    e0[0], e1[1] = 1.0, 1.0
    q = e0.expand(T, d).clone().view(1, 1, T, d)
    k = torch.stack([e1] + [e0] * (T - 1)).view(1, 1, T, d)  # key 0 orthogonal, the rest aligned
    w = attention_weights(q, k, get_variant("lssa"))[0, 0]
    for i in range(1, T):
        ratio = (w[i, 1] / w[i, 0]).item()  # softplus(scale_i) / softplus(0)
        scale_i = math.log(math.expm1(ratio * math.log(2)))
        assert scale_i == pytest.approx(math.log(d) * math.log(i + 1), rel=1e-9)
    assert math.log(64) * math.log(1024) == pytest.approx(28.8, abs=0.05)


def test_first_three_rows_rule():
    # Uniform rows: every N_i * A_ij = 1. Rows 0-2 have no offset (stay uniform under any p); rows >= 3 have
    # relu(1 - 1) = 0 everywhere, so they fall back to the un-sharpened (uniform) row instead of NaN.
    T, d = 6, 4
    q = torch.zeros(1, 1, T, d, dtype=torch.float64)
    k = torch.randn(1, 1, T, d, dtype=torch.float64)
    w = attention_weights(q, k, get_variant("softmax", p=15))[0, 0]
    for i in range(T):
        np.testing.assert_allclose(w[i, : i + 1].numpy(), np.full(i + 1, 1 / (i + 1)), rtol=1e-12)
    assert not torch.isnan(w).any()
    # Rows >= 3 threshold at the row mean: only above-average weights survive.
    q, k, _ = _qkv(T=8, d=8, B=1, H=1, seed=3)
    a = attention_weights(q, k, get_variant("softmax"))[0, 0]
    s = attention_weights(q, k, get_variant("softmax", p=1))[0, 0]
    for i in range(3, 8):
        above = a[i, : i + 1] > 1 / (i + 1)
        assert torch.all((s[i, : i + 1] > 0) == above)
    # Row 0..2 with p = 1 are the first-stage rows unchanged (no offset, power 1).
    np.testing.assert_allclose(s[:3].numpy(), a[:3].numpy(), rtol=1e-12)


def test_large_p_approaches_argmax():
    q, k, _ = _qkv(T=12, d=8, B=1, H=2, seed=5)
    for name in ("lssa", "softmax", "sigmoid_l1"):
        a = attention_weights(q, k, get_variant(name))
        hard = F.one_hot(a.argmax(-1), a.shape[-1]).to(a.dtype)
        gaps = [(attention_weights(q, k, get_variant(name, p=p)) - hard).abs().max().item() for p in (3, 15, 400)]
        assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 1e-3, (name, gaps)


def test_softmax_matches_sdpa():
    q, k, v = _qkv(T=33, d=16, dtype=torch.float32)
    out = attend(q, k, v, get_variant("softmax"))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(out, ref, atol=1e-5)


def test_scale_overrides():
    q, k, _ = _qkv(T=6, d=8)
    ln = lambda n, d: math.log(n) / math.sqrt(d)  # noqa: E731
    w = attention_weights(q, k, get_variant("softmax", scale="log_n"))
    np.testing.assert_allclose(w[0, 0].numpy(), reference_weights(q[0, 0].numpy(), k[0, 0].numpy(), "softmax",
                                                                   scale=ln), rtol=1e-9)
    for spelled in ("2.5*log_n", 2.5, "coef*log_n:2.5"):
        w = attention_weights(q, k, get_variant("lssa", scale=spelled))
        ref = reference_weights(q[1, 1].numpy(), k[1, 1].numpy(), "lssa", scale=lambda n, d: 2.5 * math.log(n))
        np.testing.assert_allclose(w[1, 1].numpy(), ref, rtol=1e-9)
    assert get_variant("lssa", scale="coef*log_n", coef=4.0).coef == 4.0
    assert get_variant("lssa", scale="logd_logn").scale_label == "logd_logn"
    assert get_variant("lssa", scale=1.5).scale_label == "coef*log_n:1.5"
    # lssa at coef = ln(64) is lssa
    q64, k64, _ = _qkv(T=6, d=64)
    assert torch.allclose(attention_weights(q64, k64, get_variant("lssa", scale=math.log(64))),
                          attention_weights(q64, k64, get_variant("lssa")))


def test_relu_shen_layernorm_on_head_output():
    q, k, v = _qkv(T=6, d=8)
    out = attend(q, k, v, get_variant("relu_shen"))
    raw = attention_weights(q, k, get_variant("relu_shen")) @ v
    assert torch.allclose(out, F.layer_norm(raw, (8,)))
    assert torch.allclose(out.mean(-1), torch.zeros(2, 2, 6, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("bad, match", [
    (dict(name="softmaxx"), "unknown: use one of"),
    (dict(name="lssa", p=0.5), "p=0.5 is out of range"),
    (dict(name="lssa", p=-3), "out of range"),
    (dict(name="lssa", p="15"), "not a number"),
    (dict(name="lssa", scale="abc*log_n"), "not a number"),
    (dict(name="lssa", scale="sqrt_n"), "inv_sqrt_d, log_n, logd_logn"),
    (dict(name="lssa", scale="coef*log_n", coef="x"), "not a number"),
    (dict(name="lssa", temperature=2.0), "override 'temperature' is unknown"),
])
def test_bad_parameters_name_what_is_allowed(bad, match):
    with pytest.raises(ValueError, match=match):
        get_variant(**bad)


def test_bad_tensors():
    q, k, v = _qkv()
    spec = get_variant("lssa")
    with pytest.raises(ValueError, match=r"4 dimensions \(B, H, T, D\)"):
        attend(q[0], k[0], v[0], spec)
    with pytest.raises(ValueError, match="same shape"):
        attention_weights(q, k[..., :3, :], spec)
    with pytest.raises(ValueError, match="dtype"):
        attend(q.long(), k, v, spec)
    with pytest.raises(ValueError, match="impl="):
        attend(q, k, v, spec, impl="cuda-magic")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtypes_and_chunking_are_exact(dtype):
    from attnlab.attention.dense import attend_dense

    q, k, v = _qkv(T=50, d=16, dtype=dtype)
    for name in ("lssar", "sigmoid_ramapuram", "softmax_recentred_l1", "relu_shen"):
        spec = get_variant(name)
        whole = attend_dense(q, k, v, spec)
        chunked = attend_dense(q, k, v, spec, chunk_bytes=1)  # one query row at a time
        assert whole.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # only the summation order of A @ v differs
        assert torch.allclose(whole.float(), chunked.float(), atol=tol), name
    assert attention_weights(q, k, get_variant("lssa")).dtype == torch.float32


def test_long_length_stability_t16384():
    """T = 16384, p = 15 and 100, with a deliberately peaked row: no NaN or inf (chunked dense path). LSSAR's
    whole output; the other variants' weights for the last 512 rows, over all 16,384 keys (each row is computed
    alone, so the longest rows are where a length-dependent overflow would show: 9 s instead of 36 s)."""
    from attnlab.attention.dense import weights_for_rows

    T, d = 16384, 64
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, T, d, generator=g)
    k = torch.randn(1, 1, T, d, generator=g)
    v = torch.randn(1, 1, T, d, generator=g)
    k[..., 7, :] = q[..., -1, :] * 50  # the last row is extremely peaked on key 7
    assert torch.isfinite(attend(q, k, v, get_variant("lssar", p=15))).all()
    for name, p in (("lssa", 100), ("softmax", 15), ("softmax", 100), ("sigmoid_l1", 100)):
        weights = weights_for_rows(q[..., -512:, :], k, get_variant(name, p=p), row_start=T - 512)
        assert torch.isfinite(weights).all() and torch.isfinite(weights @ v).all(), (name, p)
    # the peaked row, computed for the last rows only (the full T x T weights are not needed)
    rows = weights_for_rows(q[..., -2:, :], k, get_variant("lssar", p=100), row_start=T - 2)
    assert torch.isfinite(rows).all()
    assert rows[0, 0, -1, 7].item() == pytest.approx(1.0, abs=1e-6)
    assert rows.sum(-1).sub(1).abs().max().item() < 1e-4


def test_importing_from_repo_root_does_not_shadow_platform():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", "import platform; print(platform.system())"], cwd=root,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == __import__("platform").system() and out in ("Linux", "Darwin", "Windows")
    assert not (root / "platform" / "__init__.py").exists()


@pytest.mark.parametrize("name", ["lssar", "relu_wortsman", "softmax_recentred_l1"])
def test_dense_reference_is_float32_under_bf16_autocast(name):
    # Under autocast the reference's q k^T and A v must not be rounded to bf16: the same float32 result.
    from attnlab.attention.dense import attend_dense

    q, k, v = _qkv(T=40, d=16, dtype=torch.float32)
    spec = get_variant(name)
    want = attend_dense(q, k, v, spec)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attend_dense(q, k, v, spec)
        weights = attention_weights(q, k, spec)
    assert got.dtype == torch.float32 and weights.dtype == torch.float32
    assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max().item()
    assert torch.allclose(weights, attention_weights(q, k, spec), rtol=0, atol=1e-7)


def test_dense_chunk_loop_does_not_unroll_under_compile():
    # A 40-row sequence that needs 40 chunks: traced with gradients it is one chunk (2 matmuls, not 80);
    # without gradients it runs as one eager region outside the graph (no matmul traced at all).
    import torch._dynamo
    from attnlab.attention.dense import attend_dense

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def matmuls(gm):
        return sum(node.op == "call_function" and "matmul" in str(node.target) for node in gm.graph.nodes)

    spec = get_variant("lssar")
    q, k, v = _qkv(T=40, d=16, dtype=torch.float32)
    fn = torch.compile(lambda q, k, v: attend_dense(q, k, v, spec, chunk_bytes=1), backend=backend,
                       dynamic=False)
    torch._dynamo.reset()
    try:
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out = fn(qg, kg, vg)
        assert len(graphs) == 1 and matmuls(graphs[0]) == 2
        assert torch.allclose(out, attend_dense(q, k, v, spec), atol=1e-6)
        out.sum().backward()
        assert torch.isfinite(qg.grad).all()
        graphs.clear()
        with torch.no_grad():
            out = fn(q, k, v)
        assert sum(matmuls(gm) for gm in graphs) == 0
        assert torch.allclose(out, attend_dense(q, k, v, spec, chunk_bytes=1), atol=1e-6)
    finally:
        torch._dynamo.reset()
