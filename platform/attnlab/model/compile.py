"""Compiling the model with ``torch.compile``, for training and evaluation alike: one switch, one rule.

:func:`compile_model` compiles a :class:`~attnlab.model.GPT` **in place** and returns the same object, so its
``state_dict`` keys, checkpoints and attribute access do not change:

- ``model(...)`` (``forward``: the training loss, logits) is compiled as one graph (the LM head and the
  cross-entropy fuse with the blocks);
- every block is compiled too (regional compilation), so ``hidden_states`` and ``token_stats`` (evaluation:
  the LM head over chunks of positions stays eager, so 16x windows never materialise ``(B, T, vocab)``
  logits) run compiled blocks; the blocks take no layer index, so one compiled block serves all layers.

Shapes are static (``dynamic=False``): each distinct (batch, length, attention spec, RoPE scaling, grad mode,
autocast) is compiled once, the first time it is seen. The sharpening power is not part of it: the blocks get it
as a 0-d tensor (``model/gpt.py: power_as_tensor``), so an evaluation sweep over ``p_eval`` values compiles one
graph per (length, batch size) for the sharpened form and one for the unsharpened form. The dynamo recompile
limit is raised to :data:`RECOMPILE_LIMIT` per code object; should it still be reached, the blocks run eagerly,
and FlexAttention's own compiled instance refuses to run unfused on CUDA past a few thousand tokens
(``attention/flex.py: unfused_refusal``) rather than allocate ``(B, H, T, T)`` scores. FlexAttention inside a compiled model is compiled by the enclosing graph (see
``attention/flex.py``; ``tests/test_cuda_proxy_attention.py`` lowers that graph with inductor on CPU and counts
compilations over training steps and evaluation lengths); outside one it uses its own compiled instance. The
dense reference, where it still runs, is one chunk in a graph with gradients and an eager region without
(``attention/dense.py``), never a loop unrolled into the graph. An ``on_attention`` observer makes
``hidden_states`` run the blocks eagerly (diagnostics are not timed).

``enabled=None`` means on for a model on CUDA, off elsewhere (on CPU inductor builds with the machine's C++
compiler: minutes on a small machine). No Ray, no training loop here.
"""

from __future__ import annotations

import torch.nn as nn

# Per code object (the model's forward, the block's forward); flex.py raises it likewise for its kernels.
RECOMPILE_LIMIT = 64
ACCUMULATED_RECOMPILE_LIMIT = 512


def compile_enabled(model: nn.Module, enabled: bool | None = None) -> bool:
    """Whether :func:`compile_model` compiles: ``enabled``, or (None) whether the model's parameters are on CUDA."""
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"compile={enabled!r} is not allowed: use true, false or null (auto: on for CUDA)")
    if enabled is None:
        param = next(model.parameters(), None)
        return param is not None and param.device.type == "cuda"
    return enabled


def compile_model(model: nn.Module, enabled: bool | None = None, *, backend: str = "inductor",
                  mode: str | None = None) -> nn.Module:
    """Compile ``model`` in place (its ``forward`` and each of its ``blocks``) and return it.

    ``enabled``: True, False, or None (auto: on when the model is on CUDA). ``backend``/``mode`` go to
    ``torch.compile`` (``backend="aot_eager"`` checks the graph capture without generating code). Calling it
    again is harmless. Call it after moving the model to its device and before wrapping it in DDP.
    """
    if not compile_enabled(model, enabled):
        return model
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, ACCUMULATED_RECOMPILE_LIMIT)
    options = dict(dynamic=False, backend=backend, mode=mode)
    for block in getattr(model, "blocks", ()):
        block.compile(**options)
    model.compile(**options)
    return model


def is_compile_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is ``torch.compile`` failing to build a graph (a backend's failure, inductor's lowering), not
    an error of the computation itself: torch 2.11's inductor failed to lower LSSAR's evaluation graph on an H100 and
    an H200 (``LoweringException: ... convert FlexibleLayout to FixedLayout first``), which the same blocks run
    eagerly compute."""
    import torch._dynamo.exc

    kinds: tuple[type, ...] = (torch._dynamo.exc.BackendCompilerFailed,)
    try:
        from torch._inductor.exc import InductorError

        kinds += (InductorError,)
    except ImportError:  # pragma: no cover - older torch wraps it in BackendCompilerFailed
        pass
    return isinstance(exc, kinds)


def uncompile_model(model: nn.Module) -> nn.Module:
    """Undo :func:`compile_model` in place: the model and its blocks run eagerly again (the weights are shared)."""
    for module in (*getattr(model, "blocks", ()), model):
        module._compiled_call_impl = None
    return model


def is_compiled(model: nn.Module) -> bool:
    """True when ``model`` was compiled in place by :func:`compile_model` (or ``nn.Module.compile``)."""
    return getattr(model, "_compiled_call_impl", None) is not None
