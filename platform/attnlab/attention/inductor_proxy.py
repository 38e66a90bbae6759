"""How far inductor lowers a compiled training graph on a machine without a GPU (the ``cuda_proxy`` way).

:func:`lowered_training_graph` compiles a function with ``torch.compile`` (inductor's ``compile_fx``: decompositions,
joint-graph passes, AOTAutograd's partition into a forward and a backward graph), lowers each graph and stops
before code generation. Inside :func:`attnlab.attention.flex.cuda_code_path` a FlexAttention call traces as on CUDA,
and its lowering (forward and backward) runs with its inputs reporting a CUDA device until the point where it needs
the GPU (Triton or the driver); docs/gpu.md says what only a GPU can show. ``tests/test_cuda_proxy_attention.py``
checks the built-in variants this way; ``attnlab attention check`` checks plugins with it.

It relies on inductor's private lowering table and ``GraphLowering`` (torch 2.13); never use it for results: the
forward graph runs eagerly and the backward stops after lowering. No Ray, no model code.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from attnlab.attention.flex import cuda_code_path

# Where lowering needs a GPU (the only stops allowed).
GPU_STOPS = ("Torch not compiled with CUDA enabled", "Found no NVIDIA driver", "0 active drivers")


class LoweredUpToCodegen(Exception):
    """Raised instead of generating code, once a graph is lowered."""


def _chain(exc):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_gpu_stop(exc: BaseException) -> bool:
    """True when ``exc`` is lowering asking for a GPU (no Triton, no CUDA driver), not a lowering failure."""
    for e in _chain(exc):
        if isinstance(e, ModuleNotFoundError) and e.name == "triton":
            return True
        if isinstance(e, (AssertionError, RuntimeError)) and any(s in str(e) for s in GPU_STOPS):
            return True
    return False


@contextlib.contextmanager
def flex_lowering_up_to_the_gpu(stops: list[str]):
    """Inductor's FlexAttention lowerings, each run until it needs the GPU (``stops`` records ``fw``/``bw``)."""
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
        Bq, Hq, Tq, _ = query.get_size()
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
        out = empty_strided([Bq, Hq, Tq, value.get_size()[-1]], None, dtype=dtype, device=device)
        stats = [empty_strided([Bq, Hq, Tq], None, dtype=torch.float32, device=device) for _ in range(2)]
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

    lowerings[fw_op], lowerings[bw_op] = fw, bw
    try:
        yield
    finally:
        lowerings[fw_op], lowerings[bw_op] = lower_fw, lower_bw


@contextlib.contextmanager
def _stop_before_codegen():
    from torch._inductor import graph as inductor_graph

    def stop(self, *args, **kwargs):
        raise LoweredUpToCodegen()

    compile_to_module = inductor_graph.GraphLowering.compile_to_module
    inductor_graph.GraphLowering.compile_to_module = stop
    try:
        yield
    finally:
        inductor_graph.GraphLowering.compile_to_module = compile_to_module


def lowering_backend(lowered: list[str]) -> Callable:
    """A ``torch.compile`` backend: inductor as ``torch.compile`` runs it, each graph lowered and stopped before
    code generation (``lowered`` records ``forward``/``backward``). The forward graph then runs eagerly (the
    backward needs its outputs); the backward raises :class:`LoweredUpToCodegen` after lowering."""
    import torch._inductor.config
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.output_code import MockFXGraphCacheOutput

    def inner_compile(gm, example_inputs, **kwargs):
        which = "backward" if kwargs.get("is_backward") else "forward"
        try:  # no FX graph cache: a graph compiled for real before (here or on disk) would skip lowering
            with _stop_before_codegen(), torch._inductor.config.patch(fx_graph_cache=False,
                                                                       fx_graph_remote_cache=False):
                compile_fx_inner(gm, example_inputs, **kwargs)
        except Exception as exc:
            if not any(isinstance(e, LoweredUpToCodegen) for e in _chain(exc)):
                raise
        else:
            raise AssertionError("code generation was not stopped")
        lowered.append(which)
        if which == "backward":
            raise LoweredUpToCodegen()
        return MockFXGraphCacheOutput(gm=make_boxed_func(gm.forward))  # the graph, run eagerly

    return lambda gm, example_inputs: compile_fx(gm, example_inputs, inner_compile=inner_compile)


def lowered_training_graph(fn: Callable, args: tuple) -> tuple[list[str], list[str]]:
    """Compile ``fn(*args)`` (tensors that require grad), run its forward and the backward of ``out.sum()``, each graph
    lowered by inductor and stopped before code generation, FlexAttention calls taking their CUDA branch up to the
    GPU. Returns ``(graphs, stops)``: the graphs lowered (``["forward", "backward"]``) and the FlexAttention lowerings
    that reached the GPU (``fw``/``bw`` per call). Raises what lowering raised when it fails before that."""
    import torch._dynamo

    graphs, stops = [], []
    torch._dynamo.reset()
    try:
        compiled = torch.compile(fn, backend=lowering_backend(graphs), fullgraph=True, dynamic=False)
        with cuda_code_path(), flex_lowering_up_to_the_gpu(stops):
            out = compiled(*args)
            try:
                out.float().sum().backward()
            except Exception as exc:
                if not any(isinstance(e, LoweredUpToCodegen) for e in _chain(exc)):
                    raise
            else:
                raise AssertionError("the backward graph was not lowered")
    finally:
        torch._dynamo.reset()
    return graphs, stops
