"""The Triton kernels (``impl='triton'``) against the float64 dense reference, forward and every gradient.

Without a GPU, Triton's interpreter runs the same kernels on CPU tensors (conftest sets ``TRITON_INTERPRET=1``
before Triton is imported; ``make test`` installs Triton where torch's build lacks it); on a GPU node they run
compiled on CUDA. The interpreter has no bfloat16 (NumPy has none): bf16 is checked on a GPU only
(``test_cuda_bf16_matches_dense_and_repeats_bit_for_bit``). Each case is small (T <= 256) because the interpreter
runs every program of the grid in NumPy, one after another.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from attnlab.attention import attend, get_variant, variant_names  # noqa: E402
from attnlab.attention.backends import Backend, choose_backend  # noqa: E402
from attnlab.attention.kernels import ops, unsupported_reason  # noqa: E402
from attnlab.errors import UserError  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not ops.interpreting(),
                                reason="no GPU and Triton's interpreter is off (TRITON_INTERPRET=1 before import)")
# float32: the kernels compute in float32, the reference in float64; sharpening with p = 15 amplifies the rounding
# of the scores (measured largest errors: 1.2e-5 at T = 256, p = 15)
TOLERANCE = {torch.float32: 5e-5, torch.float16: 2e-2}


def _inputs(B, H, T, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(3)]


def _run(spec, q, k, v, impl, dtype, device, p=None, weight=None):
    leaves = [t.detach().to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]
    out = attend(*leaves, spec, impl=impl, p=p)
    if weight is None:
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (out.double() * weight.to(device)).sum().backward()
    return out.detach().double().cpu(), [t.grad.double().cpu() for t in leaves], weight


def assert_matches_dense(spec, q, k, v, p=None, dtype=torch.float32):
    """The kernels on ``dtype`` inputs against the float64 dense reference on the same (rounded) inputs."""
    q, k, v = (t.to(dtype).double() for t in (q, k, v))
    ref_out, ref_grads, weight = _run(spec, q, k, v, "dense", torch.float64, "cpu", p=p)
    out, grads, _ = _run(spec, q, k, v, "triton", dtype, DEVICE, p=p, weight=weight)
    tol = TOLERANCE[dtype]
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    err = (out - ref_out).abs().max().item()
    assert err <= tol * max(1.0, ref_out.abs().max().item()), f"forward: max |diff| {err:.2e}"
    for name, g, ref in zip("qkv", grads, ref_grads):
        rel = ((g - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()  # some gradients are 0 (uniform rows)
        assert rel <= tol, f"d{name}: max |diff| {rel:.2e} of the largest gradient (or of 1)"


@pytest.mark.parametrize("name, overrides, shape", [
    ("lssa", {}, (1, 2, 70)),             # tiles that do not divide T (32-row tiles under the interpreter)
    ("lssar", {}, (2, 1, 64)),            # tiles that divide T; p = 15
    ("lssar", {"p": 1}, (1, 2, 45)),
    ("lssar", {"p": 3}, (1, 2, 45)),
    ("lssar", {"p": 2.5}, (1, 2, 45)),    # a power that is not an integer: exp2(p log2 x)
    ("lssar", {}, (1, 1, 3)),             # rows 0-2 only: no offset, every row has mass
    ("softmax", {"p": 3}, (1, 2, 50)),    # Table 4's sharpened softmax rows
    ("softmax", {"p": 15}, (1, 2, 50)),
    ("softmax", {}, (1, 2, 40)),          # the online-rescaled first stage alone
    ("sigmoid_l1", {"p": 3}, (1, 2, 40)),
    ("softplus", {}, (1, 1, 40)),         # no QK-norm, scale 1/sqrt(d)
    ("lssa", {"scale": "coef*log_n", "coef": 2.5}, (1, 1, 40)),
])
def test_forward_and_gradients_match_dense_in_float32(name, overrides, shape):
    spec = get_variant(name, **overrides)
    assert_matches_dense(spec, *_inputs(*shape))


def test_a_long_row_block_at_256_tokens():
    assert_matches_dense(get_variant("lssar"), *_inputs(1, 1, 256, D=32))


@pytest.mark.parametrize("as_tensor", [False, True])
def test_p_eval_given_at_call_time_differs_from_p_train(as_tensor):
    spec = get_variant("lssar")  # trained with p = 15
    q, k, v = _inputs(1, 2, 40)
    p = torch.tensor(3.0, dtype=torch.float64) if as_tensor else 3.0
    out, grads, weight = _run(spec, q, k, v, "triton", torch.float32, DEVICE,
                              p=p.to(DEVICE) if as_tensor else p)
    ref_out, ref_grads, _ = _run(get_variant("lssar", p=3), q, k, v, "dense", torch.float64, "cpu", weight=weight)
    assert (out - ref_out).abs().max() < 5e-5
    assert all(((g - r).abs().max() / r.abs().max()) < 5e-5 for g, r in zip(grads, ref_grads))


@pytest.mark.parametrize("name", ["lssar", "softmax_p"])
def test_rows_without_mass_keep_the_unsharpened_row(name):
    """Identical keys make every row uniform: rows >= 3 have no weight above the mean, and keep plain averaging."""
    spec = get_variant("lssar") if name == "lssar" else get_variant("softmax", p=15)
    q, k, v = _inputs(1, 2, 40)
    k = k[:, :, :1].expand_as(k).clone()
    out, _, _ = _run(spec, q, k, v, "triton", torch.float32, DEVICE)
    mean = torch.cumsum(v, dim=-2) / torch.arange(1, 41, dtype=torch.float64)[:, None]
    assert (out[:, :, 3:] - mean[:, :, 3:]).abs().max() < 1e-5
    assert_matches_dense(spec, q, k, v)


def test_qk_norm_with_zero_vectors():
    q, k, v = _inputs(1, 2, 40)
    q[:, :, 5] = 0.0
    k[:, :, 0] = 0.0
    k[:, :, 17] = 0.0
    for spec in (get_variant("lssa"), get_variant("lssar")):
        assert_matches_dense(spec, q, k, v)


def test_value_head_dim_and_strided_inputs():
    """v with its own head dimension, and q, k, v as the model passes them: views of one projection."""
    spec = get_variant("lssar")
    qkv = torch.randn(1, 40, 2, 16 + 16 + 32, dtype=torch.float64)
    q, k, v = (t.transpose(1, 2) for t in qkv.split([16, 16, 32], dim=-1))
    assert not q.is_contiguous()
    assert_matches_dense(spec, q, k, v)


@pytest.mark.parametrize("name, overrides", [("lssar", {}), ("softmax", {"p": 3}), ("lssa", {})])
def test_float16(name, overrides):
    assert_matches_dense(get_variant(name, **overrides), *_inputs(1, 2, 40), dtype=torch.float16)


def test_rows_and_keys_in_tiles_of_different_sizes(monkeypatch):
    """16-row by 32-key tiles: the dK/dV kernel starts its rows at the tile holding its first key."""
    monkeypatch.setattr(ops, "_block_override", {name: (16, 32 if bn else 0, 1, 1)
                                                 for name, (_, bn, _, _) in ops.GPU_BLOCKS.items()})
    assert_matches_dense(get_variant("lssar"), *_inputs(1, 1, 70))


def test_compiled_graph_keeps_the_operators_and_their_gradients():
    """torch.compile keeps the operators in one graph (fullgraph: a break would raise) and runs the same kernels."""
    spec = get_variant("lssar")
    q, k, v = (t.float().to(DEVICE) for t in _inputs(1, 2, 40))
    p = torch.tensor(3.0, device=DEVICE)

    def step(q, k, v, p):
        return attend(q, k, v, spec, impl="triton", p=p)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, p)
        out.square().sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    for eager, traced in zip(*results):
        assert torch.equal(eager, traced)


# --- the dispatch --------------------------------------------------------------------------------------------------



def test_auto_picks_the_kernels_on_cuda_wherever_they_apply():
    for name in variant_names():
        spec = get_variant(name)
        backend, _ = choose_backend(spec, "cuda")
        if backend is Backend.SDPA:
            continue
        applies = unsupported_reason(spec) is None
        assert (backend is Backend.TRITON) == applies, (name, backend, unsupported_reason(spec))
        if spec.phi in ("exp", "sigmoid") and spec.norm == "l1" and spec.bias == "none" and spec.post == "none" \
                and spec.position_bias == "none" and spec.out_norm == "none" and spec.qk_norm_gain == "none":
            sharpened = spec.replace(p=3.0)
            assert choose_backend(sharpened, "cuda")[0] is Backend.TRITON, name
    assert choose_backend(get_variant("lssar"), "cuda")[0] is Backend.TRITON
    assert choose_backend(get_variant("lssa"), "cuda")[0] is Backend.TRITON
    assert choose_backend(get_variant("softmax", p=15), "cuda")[0] is Backend.TRITON
    assert choose_backend(get_variant("softmax"), "cuda")[0] is Backend.SDPA
    assert choose_backend(get_variant("relu_l1"), "cuda")[0] is Backend.FLEX
    assert choose_backend(get_variant("lssar"), "cuda", dtype=torch.float64)[0] is Backend.FLEX
    assert choose_backend(get_variant("lssar"), "cpu")[0] is Backend.DENSE


def test_triton_refuses_what_it_does_not_compute_in_one_line():
    q, k, v = (t.float() for t in _inputs(1, 1, 8))
    for spec in (get_variant("relu_l1"), get_variant("lssar", position_bias="alibi"), get_variant("softmax_qknorm")):
        with pytest.raises(ValueError, match=r"^impl='triton' cannot compute attention .*; use impl='auto'") as info:
            attend(q, k, v, spec, impl="triton")
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="float64"):
        attend(*_inputs(1, 1, 8), get_variant("lssar"), impl="triton")


def test_the_model_config_refuses_triton_for_other_variants():
    from attnlab.model import preset

    with pytest.raises(UserError, match=r"model.attn_impl='triton' cannot compute attention 'relu_l1'"):
        preset("tiny", attention="relu_l1", attn_impl="triton")
    assert preset("tiny", attention="lssar", attn_impl="triton").attn_impl == "triton"


def test_attention_list_shows_the_gpu_path_of_every_variant(capsys):
    from attnlab.cli import main

    assert main(["attention", "list"]) == 0
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(lines) == set(variant_names())
    assert lines["lssar"][1:] == ["15", "triton", "triton"]
    assert lines["lssa"][2] == "triton" and lines["relu_l1"][2] == "flex"
    assert lines["softmax"][2:] == ["sdpa", "triton"]  # sharpened softmax: Table 4's p = 3 and p = 15 rows


# --- the kernels a GPU runs, compiled here -------------------------------------------------------------------------

@pytest.mark.cuda_proxy
@pytest.mark.parametrize("name", ["lssar", "lssa"])
def test_the_kernels_compile_for_an_h100_without_spilling(name):
    """The FAST twin (lg2.approx) compiled for sm_90 by Triton and its ptxas, as a GPU node would, for GPT-2's head
    dimension in bf16: every kernel builds, and none spills registers to local memory at its block sizes. In a process
    of its own: this one runs Triton's interpreter, which interprets Triton's language too."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "attnlab.attention.kernels.aot", "--variant", name, "--arch", "90",
                           "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    builds = [json.loads(line) for line in done.stdout.splitlines()]
    expected = (["stats_kernel", "sharpened_fwd_kernel"] if name == "lssar" else ["plain_fwd_kernel"]) + \
        ["preprocess_kernel", "dq_kernel", "dkdv_kernel"]
    assert [b["kernel"] for b in builds] == expected
    for build in builds:
        assert build["spill_bytes"] == 0, build
        assert build["shared_bytes"] <= 227 * 1024, build  # an H100's shared memory per block


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name, overrides", [("lssar", {}), ("lssa", {}), ("softmax", {"p": 15})])
def test_cuda_bf16_matches_dense_and_repeats_bit_for_bit(name, overrides):
    """On a GPU: bf16 at 1,024 tokens within the quick check's bf16 tolerance, and the same call twice giving the same
    gradients bit for bit (no atomics)."""
    spec = get_variant(name, **overrides)
    q, k, v = _inputs(1, 4, 1024, D=64)
    q, k, v = (t.to(torch.bfloat16).double() for t in (q, k, v))
    ref_out, ref_grads, weight = _run(spec, q, k, v, "dense", torch.float64, "cpu")
    runs = [_run(spec, q, k, v, "triton", torch.bfloat16, "cuda", weight=weight) for _ in range(2)]
    out, grads, _ = runs[0]
    assert (out - ref_out).abs().max() <= 5e-2 * ref_out.abs().max()
    for g, ref in zip(grads, ref_grads):
        assert (g - ref).abs().max() <= 5e-2 * ref.abs().max()
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
