"""The CUDA attention path, checked on CPU: inductor's lowering of the compiled FlexAttention training graph, and
the number of compilations of a compiled model over training steps and evaluation lengths.

Lowering: ``flex.cuda_code_path()`` makes a ``torch.compile`` trace of the fused path on CPU tensors take its
CUDA branch (FlexAttention's higher-order op with LSE, row maximum and gradients), AOTAutograd splits forward and
backward, and both graphs go through inductor's lowering (``compile_fx_inner``). Inductor's FlexAttention
lowerings are run in full up to the point where they need the GPU: the Triton kernel template (``No module
named 'triton'``) or the device's properties for its configurations (``Torch not compiled with CUDA
enabled``). That stop is caught per FlexAttention call, the call's outputs are replaced by empty buffers of the
right shapes, and lowering continues with the rest of the graph, so that every FlexAttention call of the graph
(up to two per graph) is lowered, not only the first; code generation is then stopped. The pipeline is
``compile_fx``, as ``torch.compile``'s inductor backend runs it (joint-graph passes, partition, post-grad passes),
with its inner compiler stopped after lowering. The forward lowering
takes inductor's CUDA branch by reporting the call's inputs as CUDA tensors (on CPU inductor would pick its C++
template, which has no LSE); the score_mod and mask subgraphs are lowered before the stop. Any other exception
(a ``LoweringException`` of our graph, e.g. a FlexAttention backward with no output gradient) fails the test.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import numpy as np
import pytest
import torch

from attnlab.attention import attend, get_variant
from attnlab.attention import flex

pytestmark = pytest.mark.cuda_proxy

# Where lowering needs a GPU (the only stops allowed).
_GPU_STOPS = ("Torch not compiled with CUDA enabled", "Found no NVIDIA driver", "0 active drivers")


class _LoweredUpToCodegen(Exception):
    """Raised instead of generating code, once a graph is lowered."""


def _chain(exc):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def _is_gpu_stop(exc) -> bool:
    for e in _chain(exc):
        if isinstance(e, ModuleNotFoundError) and e.name == "triton":
            return True
        if isinstance(e, (AssertionError, RuntimeError)) and any(s in str(e) for s in _GPU_STOPS):
            return True
    return False


@contextlib.contextmanager
def _lowering_up_to_the_gpu(stops: list[str]):
    """Inductor's FlexAttention lowerings, each run until it needs the GPU (``stops`` records ``fw``/``bw``)."""
    from torch._inductor import graph as inductor_graph
    from torch._inductor import ir
    from torch._inductor.lowering import empty_strided, lowerings
    from torch.utils._pytree import tree_leaves

    fw_op, bw_op = torch.ops.higher_order.flex_attention, torch.ops.higher_order.flex_attention_backward
    lower_fw, lower_bw = lowerings[fw_op], lowerings[bw_op]

    def empty(size, dtype, like):
        return empty_strided(size, None, dtype=dtype, device=like.get_device())

    def as_cuda(args):
        # Every IR node of the call's inputs reports a CUDA device: inductor takes its Triton (CUDA) branch.
        nodes, seen = [], set()
        for node in tree_leaves(list(args)):
            while isinstance(node, ir.IRNode) and not isinstance(node, ir.Loops) and id(node) not in seen:
                seen.add(id(node))
                nodes.append(node)
                node = getattr(node, "data", None)
        for node in nodes:
            object.__setattr__(node, "get_device", lambda: torch.device("cuda", 0))  # some IR nodes are frozen
        return nodes

    def fw(*args, **kwargs):
        query, _, value = args[:3]
        B, H, T, _ = query.get_size()
        device, dtype = query.get_device(), query.get_dtype()
        nodes = as_cuda(args)
        try:
            lower_fw(*args, **kwargs)
            raise AssertionError("FlexAttention's forward lowered without needing a GPU")
        except Exception as exc:
            if not _is_gpu_stop(exc):
                raise
            stops.append("fw")
        finally:
            for node in nodes:
                object.__delattr__(node, "get_device")
        out = empty_strided([B, H, T, value.get_size()[-1]], None, dtype=dtype, device=device)
        stats = [empty_strided([B, H, T], None, dtype=torch.float32, device=device) for _ in range(2)]
        return (out, *stats)

    def bw(*args, **kwargs):
        query, key, value = args[:3]
        try:
            lower_bw(*args, **kwargs)
            raise AssertionError("FlexAttention's backward lowered without needing a GPU")
        except Exception as exc:
            if not _is_gpu_stop(exc):
                raise
            stops.append("bw")
        captured = args[-2]  # score_mod_other_buffers
        return (empty(query.get_size(), query.get_dtype(), query), empty(key.get_size(), key.get_dtype(), key),
                empty(value.get_size(), value.get_dtype(), value),
                tuple(empty(b.get_size(), b.get_dtype(), b) for b in captured))

    def stop_before_codegen(self, *args, **kwargs):
        raise _LoweredUpToCodegen()

    compile_to_module = inductor_graph.GraphLowering.compile_to_module
    lowerings[fw_op], lowerings[bw_op] = fw, bw
    inductor_graph.GraphLowering.compile_to_module = stop_before_codegen
    try:
        yield
    finally:
        lowerings[fw_op], lowerings[bw_op] = lower_fw, lower_bw
        inductor_graph.GraphLowering.compile_to_module = compile_to_module


def _lowering_backend(lowered: list[str]):
    """Inductor as ``torch.compile`` runs it (``compile_fx``: decompositions, joint-graph passes, AOTAutograd's
    partition), with each graph lowered and stopped before code generation.

    The forward graph then runs eagerly (the backward needs its outputs); the backward raises
    :class:`_LoweredUpToCodegen` after lowering.
    """
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.output_code import MockFXGraphCacheOutput

    def inner_compile(gm, example_inputs, **kwargs):
        which = "bw" if kwargs.get("is_backward") else "fw"
        try:
            compile_fx_inner(gm, example_inputs, **kwargs)
        except Exception as exc:
            if not any(isinstance(e, _LoweredUpToCodegen) for e in _chain(exc)):
                raise
        else:
            raise AssertionError("code generation was not stopped")
        lowered.append(which)
        if which == "bw":
            raise _LoweredUpToCodegen()
        return MockFXGraphCacheOutput(gm=make_boxed_func(gm.forward))  # the graph, run eagerly

    return lambda gm, example_inputs: compile_fx(gm, example_inputs, inner_compile=inner_compile)


@pytest.fixture
def fresh_dynamo():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


# name, p, head dim, dtype: the softmax-free variants of Table 4 (sharpened and not), sharpened softmax, and the
# sign split of Tables 1-3; bf16 as training runs under autocast.
LOWERED = [("lssa", None, 16, torch.float32), ("lssar", 15, 64, torch.float32), ("lssar", 15, 16, torch.bfloat16),
           ("softmax", 3, 16, torch.float32), ("relu_l1", None, 16, torch.float32),
           ("sigmoid_l1", None, 16, torch.float32), ("sigmoid_ramapuram", None, 16, torch.float32),
           ("sigmoid_ramapuram_b", None, 16, torch.float32), ("relu_wortsman", None, 16, torch.float32),
           ("relu_shen", None, 16, torch.float32), ("gelu", None, 16, torch.float32),
           ("scenario_ii", None, 16, torch.float32), ("softmax_recentred", None, 16, torch.float32),
           ("softmax_recentred_l1", None, 16, torch.float32)]
# The modern softmax baselines (their learned QK-norm gains are inputs of the graph, with gradients) and ALiBi
# (position_bias='alibi': one more term of every score_mod, sharpening's second pass included).
LOWERED_BASELINES = [("softmax_qknorm", {}, 16, torch.float32), ("softmax_logn", {}, 16, torch.float32),
                     ("softmax_qknorm_logn", {}, 16, torch.bfloat16),
                     ("softmax", dict(position_bias="alibi"), 16, torch.float32),
                     ("lssa", dict(position_bias="alibi"), 16, torch.float32),
                     ("lssar", dict(position_bias="alibi"), 16, torch.bfloat16),
                     ("softmax_qknorm_logn", dict(position_bias="alibi"), 16, torch.float32)]


# On a GPU node lowering does not stop where these tests expect it to (Triton is there): the compiled path itself
# runs instead, in test_compiled_training_on_the_gpu below (pytest -m gpu).
_CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(),
                               reason="on a GPU node the real compiled path runs: test_compiled_training_on_the_gpu")


@_CPU_ONLY
@pytest.mark.parametrize("name, p, D, dtype", LOWERED, ids=lambda x: str(x).replace("torch.", ""))
def test_compiled_training_graph_lowers_up_to_the_gpu(name, p, D, dtype, fresh_dynamo):
    _check_lowering(get_variant(name, p=p), D, dtype)


@_CPU_ONLY
@pytest.mark.parametrize("name, overrides, D, dtype", LOWERED_BASELINES, ids=lambda x: str(x).replace("torch.", ""))
def test_baseline_and_alibi_training_graphs_lower_up_to_the_gpu(name, overrides, D, dtype, fresh_dynamo):
    _check_lowering(get_variant(name, **overrides), D, dtype)


def _check_lowering(spec, D, dtype):
    assert flex.is_fusable(spec)
    two = spec.p is not None or spec.post == "recentre_l1" or flex.parts_of(spec) != ("whole",)
    calls = 2 if two else 1  # FlexAttention calls
    T, H = 128, 2
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, H, T, D, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    # The model's learned QK-norm gains (float32 parameters, as under autocast), per head for q, shared for k.
    gains = (1 + 0.1 * torch.randn(H, D, generator=gen), 1 + 0.1 * torch.randn(D, generator=gen))
    gains = tuple(g.requires_grad_() for g in gains) if spec.learned_qk_gain else None
    lowered, stops = [], []
    fn = torch.compile(lambda q, k, v, gains: attend(q, k, v, spec, impl="flex", qk_gain=gains),
                       backend=_lowering_backend(lowered), fullgraph=True, dynamic=False)
    with flex.cuda_code_path(), _lowering_up_to_the_gpu(stops):
        out = fn(q, k, v, gains)
        assert out.shape == (2, 2, T, D) and out.dtype == dtype
        with pytest.raises(_LoweredUpToCodegen):
            out.float().sum().backward()
    assert lowered == ["fw", "bw"]
    assert stops == ["fw"] * calls + ["bw"] * calls  # every call of both graphs lowered up to the GPU


def test_on_cuda_no_registered_variant_uses_the_dense_reference():
    from attnlab.attention import Backend, resolve_backend, variant_names

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        chosen = {name: resolve_backend(get_variant(name), "cuda") for name in variant_names()}
    assert set(chosen.values()) <= {Backend.FLEX, Backend.SDPA}, chosen


def test_the_switch_changes_nothing_outside_a_compiled_graph():
    spec = get_variant("lssar")
    q, k, v = (torch.randn(1, 2, 20, 16, dtype=torch.float64) for _ in range(3))
    with flex.cuda_code_path():
        inside = flex.attend_flex(q, k, v, spec)
    assert torch.equal(inside, flex.attend_flex(q, k, v, spec)) and not flex._cuda_code_path_on_cpu


# --- recompiles of a compiled model ---------------------------------------------------------------------------

def test_training_steps_and_evaluation_compile_once_per_shape(fresh_dynamo):
    from torch._dynamo.testing import CompileCounter

    from attnlab.model import GPT, compile_model, preset
    from attnlab.model.scoring import window_token_stats

    torch.manual_seed(0)
    model = GPT(preset("tiny", attention="lssar", vocab_size=128))
    eager = copy.deepcopy(model)
    counter = CompileCounter()
    compile_model(model, True, backend=counter)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 128, (2, 65), generator=torch.Generator().manual_seed(1))
    frames = []
    for _ in range(4):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames == [frames[0]] * 4, frames  # step 1 compiles, steps 2-4 do not

    eager.load_state_dict(model.state_dict())  # the trained weights, uncompiled
    rng = np.random.default_rng(0)
    windows = {L: rng.integers(0, 128, size=(3, L + 1)) for L in (32, 64, 128)}
    per_length = []
    for L, w in windows.items():  # evaluation: scoring's batches of 2 (and a last batch of 1)
        before = counter.frame_count
        got = torch.cat([loss for _, loss, _, _ in window_token_stats(model, w, batch_size=2)])
        per_length.append(counter.frame_count - before)
        want = torch.cat([loss for _, loss, _, _ in window_token_stats(eager, w, batch_size=2)])
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    total = counter.frame_count
    for w in windows.values():  # the same lengths again: nothing new
        list(window_token_stats(model, w, batch_size=2))
    assert counter.frame_count == total
    # One block graph per (length, batch size): 2 and 1 here (the last batch is short); nothing per layer/call.
    assert per_length == [2, 2, 2], per_length
    _, loss = model(idx[:, :-1], idx[:, 1:])  # training again after evaluation: the step's graph is reused
    loss.backward()
    assert counter.frame_count == total


@_CPU_ONLY
def test_compiled_model_training_graph_lowers_up_to_the_gpu(fresh_dynamo):
    # The whole compiled GPT (LSSAR through FlexAttention, under bf16 autocast as training runs on CUDA): one
    # graph, the block mask built in it, two FlexAttention calls per layer, forward and backward lowered.
    from attnlab.model import GPT, compile_model, preset

    torch.manual_seed(0)
    model = GPT(preset("tiny", attention="lssar", vocab_size=128, attn_impl="flex"))
    lowered, stops = [], []
    compile_model(model, True, backend=_lowering_backend(lowered))
    idx = torch.randint(0, 128, (2, 129), generator=torch.Generator().manual_seed(1))
    with flex.cuda_code_path(), _lowering_up_to_the_gpu(stops):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx[:, :-1], idx[:, 1:])
        with pytest.raises(_LoweredUpToCodegen):
            loss.backward()
    layers = len(model.blocks)
    assert lowered == ["fw", "bw"]
    assert stops == ["fw"] * (2 * layers) + ["bw"] * (2 * layers)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (inductor's Triton kernels)")
@pytest.mark.parametrize("name", ["lssar", "lssa", "softmax", "relu_wortsman", "gelu", "softmax_recentred_l1"])
def test_compiled_training_on_the_gpu(name, fresh_dynamo):
    """What the lowering tests stand in for, on a GPU: the compiled model (inductor, bf16 autocast, the variant on
    its CUDA path) takes two training steps with finite losses and gradients, its first loss that of the eager
    model within bf16 rounding."""
    from attnlab.model import GPT, compile_model, preset

    torch.manual_seed(0)
    cfg = preset("tiny", attention=name, vocab_size=256, train_len=256)
    eager, compiled = GPT(cfg).cuda(), GPT(cfg).cuda()
    compiled.load_state_dict(eager.state_dict())
    compile_model(compiled, True)
    idx = torch.randint(0, 256, (4, 257), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    losses = {}
    for label, model in (("eager", eager), ("compiled", compiled)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None), label
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.setdefault(label, []).append(loss.item())
    assert all(np.isfinite(losses["compiled"]))
    assert abs(losses["compiled"][0] - losses["eager"][0]) <= 2e-2 * abs(losses["eager"][0])
