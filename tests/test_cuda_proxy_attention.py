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
from attnlab.attention.inductor_proxy import LoweredUpToCodegen, _chain, is_gpu_stop

pytestmark = pytest.mark.cuda_proxy

@contextlib.contextmanager
def _lowering_up_to_the_gpu(stops: list[str], scatters: list[str] | None = None):
    """Inductor's FlexAttention lowerings, each run until it needs the GPU (``stops`` records ``fw``/``bw``).

    ``scatters`` records every gradient of a captured buffer that a FlexAttention backward lowers: inductor lowers
    it as a ``Scatter`` with ``scatter_mode="atomic_add"`` into a zeroed buffer (``zeros_and_scatter``), i.e.
    ``tl.atomic_add`` inside the backward kernel, non-deterministic on a GPU (pytorch/pytorch#137452).
    """
    from torch._inductor import graph as inductor_graph
    from torch._inductor import ir
    from torch._inductor.kernel.flex import common as flex_common
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
            if not is_gpu_stop(exc):
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
            if not is_gpu_stop(exc):
                raise
            stops.append("bw")
        captured = args[-2]  # score_mod_other_buffers
        return (empty(query.get_size(), query.get_dtype(), query), empty(key.get_size(), key.get_dtype(), key),
                empty(value.get_size(), value.get_dtype(), value),
                tuple(empty(b.get_size(), b.get_dtype(), b) for b in captured))

    def stop_before_codegen(self, *args, **kwargs):
        raise LoweredUpToCodegen()

    scatter_lowering = flex_common.zeros_and_scatter_lowering

    def recorded_scatter(shape, indices, values):
        buffer = scatter_lowering(shape, indices, values)
        if scatters is not None:
            scatters.append(f"{buffer.data.scatter_mode} into a captured buffer of shape {list(shape)}")
        return buffer

    compile_to_module = inductor_graph.GraphLowering.compile_to_module
    lowerings[fw_op], lowerings[bw_op] = fw, bw
    inductor_graph.GraphLowering.compile_to_module = stop_before_codegen
    flex_common.zeros_and_scatter_lowering = recorded_scatter
    try:
        yield
    finally:
        lowerings[fw_op], lowerings[bw_op] = lower_fw, lower_bw
        inductor_graph.GraphLowering.compile_to_module = compile_to_module
        flex_common.zeros_and_scatter_lowering = scatter_lowering


def _lowering_backend(lowered: list[str]):
    """Inductor as ``torch.compile`` runs it (``compile_fx``: decompositions, joint-graph passes, AOTAutograd's
    partition), with each graph lowered and stopped before code generation.

    The forward graph then runs eagerly (the backward needs its outputs); the backward raises
    :class:`LoweredUpToCodegen` after lowering.
    """
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.output_code import MockFXGraphCacheOutput

    def inner_compile(gm, example_inputs, **kwargs):
        which = "bw" if kwargs.get("is_backward") else "fw"
        try:
            compile_fx_inner(gm, example_inputs, **kwargs)
        except Exception as exc:
            if not any(isinstance(e, LoweredUpToCodegen) for e in _chain(exc)):
                raise
        else:
            raise AssertionError("code generation was not stopped")
        lowered.append(which)
        if which == "bw":
            raise LoweredUpToCodegen()
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
# sign split of Tables 1-3. LSSAR (p = 15) in bf16, as training runs under autocast, is lowered through the whole
# model below: not a second time here.
LOWERED = [("lssa", None, 16, torch.float32), ("lssar", 15, 64, torch.float32),
           ("softmax", 3, 16, torch.float32), ("relu_l1", None, 16, torch.float32),
           ("sigmoid_l1", None, 16, torch.float32), ("sigmoid_ramapuram", None, 16, torch.float32),
           ("sigmoid_ramapuram_b", None, 16, torch.float32), ("relu_wortsman", None, 16, torch.float32),
           ("relu_shen", None, 16, torch.float32), ("gelu", None, 16, torch.float32),
           ("scenario_ii", None, 16, torch.float32), ("softmax_recentred", None, 16, torch.float32),
           ("softmax_recentred_l1", None, 16, torch.float32)]
# The modern softmax baselines (their learned QK-norm gains are inputs of the graph, with gradients) and ALiBi
# (position_bias='alibi': one more term of every score_mod, sharpening's second pass included). ALiBi in bf16 is
# lowered with softmax_qknorm_logn, LSSAR with ALiBi in float32 (9 s; in bf16 it took 36 s, and LSSAR in bf16 is
# the whole model's test below).
LOWERED_BASELINES = [("softmax_qknorm", {}, 16, torch.float32), ("softmax_logn", {}, 16, torch.float32),
                     ("softmax_qknorm_logn", {}, 16, torch.bfloat16),
                     ("softmax", dict(position_bias="alibi"), 16, torch.float32),
                     ("lssa", dict(position_bias="alibi"), 16, torch.float32),
                     ("lssar", dict(position_bias="alibi"), 16, torch.float32),
                     ("softmax_qknorm_logn", dict(position_bias="alibi"), 16, torch.bfloat16)]


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
    two_passes = spec.p is not None or spec.post == "recentre_l1"
    calls = 2 if two_passes or flex.parts_of(spec) != ("whole",) else 1  # FlexAttention calls with a backward
    # The two passes' backward needs one more call in the forward, without gradient (the direction of pass 1's
    # LSE gradient: docs/attention.md#the-backward-of-the-two-passes).
    forward_calls = calls + 1 if two_passes else calls
    T, H = 128, 2
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, H, T, D, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    # The model's learned QK-norm gains (float32 parameters, as under autocast), per head for q, shared for k.
    gains = (1 + 0.1 * torch.randn(H, D, generator=gen), 1 + 0.1 * torch.randn(D, generator=gen))
    gains = tuple(g.requires_grad_() for g in gains) if spec.learned_qk_gain else None
    lowered, stops, scatters = [], [], []
    fn = torch.compile(lambda q, k, v, gains: attend(q, k, v, spec, impl="flex", qk_gain=gains),
                       backend=_lowering_backend(lowered), fullgraph=True, dynamic=False)
    with flex.cuda_code_path(), _lowering_up_to_the_gpu(stops, scatters):
        out = fn(q, k, v, gains)
        assert out.shape == (2, 2, T, D) and out.dtype == dtype
        with pytest.raises(LoweredUpToCodegen):
            out.float().sum().backward()
    assert lowered == ["fw", "bw"]
    # No backward kernel scatters a captured buffer's gradient with atomics: deterministic on the GPU.
    assert scatters == []
    assert stops == ["fw"] * forward_calls + ["bw"] * calls  # every call of both graphs lowered up to the GPU


def test_on_cuda_no_registered_variant_uses_the_dense_reference():
    from attnlab.attention import Backend, resolve_backend, variant_names

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        chosen = {name: resolve_backend(get_variant(name), "cuda") for name in variant_names()}
    assert set(chosen.values()) <= {Backend.FLEX, Backend.SDPA, Backend.TRITON}, chosen


def test_the_switch_changes_nothing_outside_a_compiled_graph():
    spec = get_variant("lssar")
    q, k, v = (torch.randn(1, 2, 20, 16, dtype=torch.float64) for _ in range(3))
    with flex.cuda_code_path():
        inside = flex.attend_flex(q, k, v, spec)
    assert torch.equal(inside, flex.attend_flex(q, k, v, spec)) and not flex._cuda_code_path_on_cpu


# --- no silent fall back to the unfused O(T^2) path -------------------------------------------------------------

def test_unfused_flex_attention_is_refused_on_cuda_past_a_few_thousand_tokens():
    assert flex.unfused_refusal("cuda", 12, 4096) is None and flex.unfused_refusal("cpu", 12, 16384) is None
    reason = flex.unfused_refusal("cuda", 12, 16384)
    assert "\n" not in reason and "T=16384" in reason and "12.0 GiB per call" in reason and "recompile_limit" in reason


def test_an_eager_fallback_of_the_compiled_instance_stops_before_allocating():
    # What runs when dynamo gives up on the compiled FlexAttention instance (its recompile limit): the function it
    # compiles, eagerly. On CUDA tensors (fake ones: nothing is allocated) at 16K tokens it stops with the reason
    # instead of calling FlexAttention's unfused implementation.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from attnlab.errors import UserError

    with FakeTensorMode():
        q, k, v = (torch.empty(1, 12, 16384, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        with pytest.raises(UserError) as info:
            flex._flex_attention_or_refuse(q, k, v, score_mod=None, block_mask=None, scale=1.0)
    assert str(info.value) == flex.unfused_refusal("cuda", 12, 16384)


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


def _sweep_config(attention: str):
    from attnlab.model import preset

    return preset("tiny", attention=attention, vocab_size=128, train_len=16, n_layer=1, attn_impl="flex")


# studies/p_sweep.yaml's grid as an evaluation-time sweep: p_eval none (as trained) and ten powers, at five lengths
# (the tiny model's multiples 1..16 of a 16-token training length).
P_SWEEP = (None, 1, 3, 5, 7, 9, 11, 13, 15, 31, 63)
SWEEP_LENGTHS = (16, 32, 64, 128, 256)


def _sweep_compiles(attention: str, lengths=SWEEP_LENGTHS) -> tuple[int, dict]:
    """Graphs compiled by an evaluation sweep over P_SWEEP x ``lengths`` of a compiled one-layer tiny model on its
    CUDA path (FlexAttention traced into the blocks: ``cuda_code_path``), 2 windows per length scored together, as
    ``attnlab eval`` scores them (``measure``: ``attention_spec_for`` + ``score_windows``). Returns the count and the
    summed loss of each (length, p_eval). (A batch-size tail is one more graph per length and mode:
    ``test_training_steps_and_evaluation_compile_once_per_shape`` counts those.)"""
    from torch._dynamo.testing import CompileCounter

    from attnlab.evaluate.measure import attention_spec_for, score_windows
    from attnlab.model import GPT, compile_model, preset

    torch.manual_seed(0)
    model = GPT(_sweep_config(attention))
    counter = CompileCounter()
    compile_model(model, True, backend=counter)
    rng = np.random.default_rng(0)
    losses = {}
    with flex.cuda_code_path():
        for L in lengths:
            windows = rng.integers(0, 128, size=(2, L + 1))
            for p in P_SWEEP:
                scores = score_windows(model, windows, batch_size=2, attention=attention_spec_for(model, p))
                losses[L, p] = scores.total
    return counter.frame_count, losses


def test_a_p_eval_sweep_compiles_one_graph_per_length_and_sharpening_mode(fresh_dynamo):
    # A model trained without sharpening: p_eval none is its one-pass form, every number the two-pass form. What
    # is counted: compiled block graphs (the blocks are what evaluation runs compiled; the LM head is eager), one
    # per (length, sharpening mode) at one batch size: 5 lengths x 2 modes. Before the power reached the attention
    # as a tensor, every p_eval was a graph of its own (55 here; with a batch tail 110, past dynamo's recompile
    # limit of 64, after which the blocks ran eagerly and FlexAttention unfused).
    graphs, losses = _sweep_compiles("softmax")
    assert graphs == len(SWEEP_LENGTHS) * 2, graphs
    # The graph shared by the powers reads each power: the losses differ, and match the eager model's.
    L = SWEEP_LENGTHS[1]
    assert len({losses[L, p] for p in P_SWEEP}) == len(P_SWEEP)
    from attnlab.evaluate.measure import attention_spec_for, score_windows
    from attnlab.model import GPT

    torch.manual_seed(0)
    eager = GPT(_sweep_config("softmax"))
    rng = np.random.default_rng(0)
    w = [rng.integers(0, 128, size=(2, length + 1)) for length in SWEEP_LENGTHS[:2]][-1]  # the sweep's windows at L
    for p in (None, 3, 63):
        want = score_windows(eager, w, batch_size=2, attention=attention_spec_for(eager, p)).total
        assert losses[L, p] == pytest.approx(want, rel=1e-5), p


def test_p_eval_none_of_a_sharpened_model_shares_the_sharpened_graph(fresh_dynamo):
    # A model trained with sharpening (LSSAR, p_train 15): p_eval none is the power it was trained with, one power
    # among the others, so the whole sweep is one graph per length.
    graphs, _ = _sweep_compiles("lssar", lengths=SWEEP_LENGTHS[:1])
    assert graphs == 1, graphs


@_CPU_ONLY
def test_compiled_model_training_graph_lowers_up_to_the_gpu(fresh_dynamo):
    # The whole compiled GPT (LSSAR through FlexAttention, under bf16 autocast as training runs on CUDA): one
    # graph, the block mask built in it, three FlexAttention calls per layer forward (the two passes and the
    # direction of pass 1's LSE gradient) and two backward, lowered without a captured-buffer scatter.
    from attnlab.model import GPT, compile_model, preset

    torch.manual_seed(0)
    # one layer: what is counted is per layer, and lowering a second layer's copy of the same graph cost ~35 s
    model = GPT(preset("tiny", attention="lssar", vocab_size=128, attn_impl="flex", n_layer=1))
    lowered, stops, scatters = [], [], []
    compile_model(model, True, backend=_lowering_backend(lowered))
    idx = torch.randint(0, 128, (2, 129), generator=torch.Generator().manual_seed(1))
    with flex.cuda_code_path(), _lowering_up_to_the_gpu(stops, scatters):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx[:, :-1], idx[:, 1:])
        with pytest.raises(LoweredUpToCodegen):
            loss.backward()
    layers = len(model.blocks)
    assert lowered == ["fw", "bw"]
    assert scatters == []
    assert stops == ["fw"] * (3 * layers) + ["bw"] * (2 * layers)


@_CPU_ONLY
def test_evaluation_graph_with_the_power_as_an_input_lowers_up_to_the_gpu(fresh_dynamo):
    # An evaluation forward (no gradient) of a compiled LSSAR model at a p_eval: the power is an input of the block
    # graph (a 0-d tensor read by pass 2's score_mod), lowered with both FlexAttention calls of each layer.
    from attnlab.evaluate.measure import attention_spec_for
    from attnlab.model import GPT, compile_model, preset

    torch.manual_seed(0)
    model = GPT(preset("tiny", attention="lssar", vocab_size=128, n_layer=1, attn_impl="flex")).eval()
    lowered, stops, scatters = [], [], []
    compile_model(model, True, backend=_lowering_backend(lowered))
    idx = torch.randint(0, 128, (1, 129), generator=torch.Generator().manual_seed(1))
    with flex.cuda_code_path(), _lowering_up_to_the_gpu(stops, scatters), torch.no_grad():
        model.token_stats(idx[:, :-1], idx[:, 1:], attention=attention_spec_for(model, 3.0))
    assert lowered == ["fw"] and stops == ["fw", "fw"] and scatters == []


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
