"""Compiling the model with ``torch.compile``, for training and evaluation alike: one switch, one rule.

Owns :func:`compile_model`: a :class:`~attnlab.model.GPT` compiled **in place** (its ``forward`` as one graph and
each block on its own, with static shapes), so ``state_dict`` keys, checkpoints and attribute access never change;
the rule for ``enabled=None`` (on for a model on CUDA, off elsewhere); and dynamo's recompile limits
(:data:`RECOMPILE_LIMIT`). One compiled block serves every layer and every ``p_eval`` because the blocks take no
layer index and get the power as a 0-d tensor (``model/gpt.py: power_as_tensor``): keep it so.

It must never change the model's weights or its modules' names. No Ray, no training loop here.

Details: docs/gpu.md#compilation; what the CPU tests check of the compiled graphs:
docs/gpu.md#what-is-checked-on-cpu-and-what-is-left-to-the-gpu.
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
