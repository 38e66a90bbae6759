"""Attention variants for length-extrapolation studies.

Owns the package's public API, a contract that tests and docs rely on: :func:`variant_names` and
:func:`get_variant` (an :class:`AttentionSpec` from the registry, ``variants.py``, or a :class:`PluginSpec` of a
loaded plugin), :func:`attention_weights` and :func:`weights_for_rows` (dense causal weights), and :func:`attend`
(the output, through the backend :func:`resolve_backend` picks). ``q`` and ``k`` come in after RoPE; the spec
applies QK-norm, the scale and sharpening.

Where each part lives: the reference math ``dense.py``, the fused FlexAttention path ``flex.py`` (mask and
positions: ``masks.py``), SDPA ``sdpa.py``, the Triton kernels ``kernels/`` (imported on first use), the choice
among them ``backends.py``, plugins ``plugin.py``. Nothing in this package may import Ray or model code.

Details: docs/attention.md (the math), docs/library.md#the-library (the API in use), docs/plugins.md.
"""

from __future__ import annotations

import torch

from attnlab.attention import dense
from attnlab.attention.backends import Backend, resolve_backend
from attnlab.attention.dense import attend_dense, check_power
from attnlab.attention.flex import attend_flex
from attnlab.attention.kernels import attend_triton
from attnlab.attention.plugin import PluginState, attend_plugin, load_plugin, reference_weights
from attnlab.attention.sdpa import attend_sdpa
from attnlab.attention.spec import AttentionSpec, PluginSpec, parse_scale
from attnlab.attention.variants import get_variant, variant_names

__all__ = ["AttentionSpec", "Backend", "PluginSpec", "PluginState", "attend", "attention_weights", "get_variant",
           "load_plugin", "parse_scale", "resolve_backend", "variant_names", "weights_for_rows"]

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
    """Raise ValueError unless q, k (and v) are ``(B, H, T, D)`` tensors of matching shapes and float dtypes."""
    named = [("q", q), ("k", k)] + ([("v", v)] if v is not None else [])
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor of shape (B, H, T, D), got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (B, H, T, D), got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}: use float32, float64, bfloat16 or float16")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape (B, H, T, D), got {tuple(q.shape)} and {tuple(k.shape)}")
    if v is not None and v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must share (B, H, T) with q, got {tuple(v.shape)} and {tuple(q.shape)}")


def _check_spec(spec, qk_gain=None, state=None) -> None:
    if not isinstance(spec, (AttentionSpec, PluginSpec)):
        raise ValueError(f"spec must be an AttentionSpec or PluginSpec from get_variant(name), got "
                         f"{type(spec).__name__}")
    if isinstance(spec, PluginSpec) and qk_gain is not None:
        raise ValueError(f"qk_gain is given but attention {spec.name!r} is a plugin variant: pass its layer's "
                         "state=PluginState(...) instead")
    if isinstance(spec, AttentionSpec) and state is not None:
        raise ValueError(f"state is given but attention {spec.name!r} is not a plugin variant: pass state=None")


def weights_for_rows(q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec | PluginSpec, row_start: int = 0,
                     seq_len: int | None = None, qk_gain=None, state: PluginState | None = None) -> torch.Tensor:
    """Causal weights ``(..., R, K)`` of query rows ``row_start .. row_start + R - 1`` over keys ``0 .. K - 1`` in
    the compute dtype (``dense.weights_for_rows`` for a built-in, the variant's reference for a plugin)."""
    _check_spec(spec, qk_gain, state)
    if isinstance(spec, PluginSpec):
        return reference_weights(q, k, spec, row_start, seq_len, state)
    return dense.weights_for_rows(q, k, spec, row_start, seq_len, qk_gain=qk_gain)


def attention_weights(q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec | PluginSpec, qk_gain=None,
                      state: PluginState | None = None) -> torch.Tensor:
    """Dense causal attention weights ``(B, H, T, T)``, in float32 (float64 for float64 inputs)."""
    check_qkv(q, k)
    return weights_for_rows(q, k, spec, qk_gain=qk_gain, state=state)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec | PluginSpec,
           impl: Backend | str = Backend.AUTO, qk_gain=None, state: PluginState | None = None, p=None) -> torch.Tensor:
    """Causal attention output ``(B, H, T, D)`` in v's dtype.

    ``impl`` (a :class:`Backend` or its value): ``dense`` (the reference, chunked over query rows for long
    sequences), ``flex`` (FlexAttention in O(T) memory on CUDA; variants without a fused form use the dense
    reference after a one-time warning), ``sdpa`` (``scaled_dot_product_attention``, softmax variants only:
    ValueError for the others), ``triton`` (attnlab's Triton kernels: LSSA, LSSAR, sharpened softmax; on CUDA, or
    on CPU under ``TRITON_INTERPRET=1``; ValueError for the others) or ``auto``: on CUDA the fastest exact one of
    these for ``spec``, elsewhere ``dense`` (see :mod:`attnlab.attention.backends`). ``qk_gain``: the model's ``(gain_q, gain_k)`` for a
    spec with ``qk_norm_gain='learned'``, else None (ValueError, one line, when it does not fit the spec).
    ``state``: a plugin variant's layer state (:class:`PluginState`); a plugin's ``flex`` is its fused form.
    ``p``: for a sharpened spec, the power to use instead of ``spec.p``: a number >= 1 or a 0-d tensor (a
    tensor does not specialise a compiled graph, so one graph serves every power: the model passes ``p_eval``
    this way); None: ``spec.p``.
    """
    check_qkv(q, k, v)
    _check_spec(spec, qk_gain, state)
    check_power(spec, p)
    backend = resolve_backend(spec, q.device, impl, q.dtype)
    if isinstance(spec, PluginSpec):
        return attend_plugin(q, k, v, spec, backend.value, state, p=p)
    if backend is Backend.SDPA:
        return attend_sdpa(q, k, v, spec, qk_gain=qk_gain)
    if backend is Backend.TRITON:
        return attend_triton(q, k, v, spec, p=p)
    if backend is Backend.FLEX:
        return attend_flex(q, k, v, spec, qk_gain=qk_gain, p=p)
    return attend_dense(q, k, v, spec, qk_gain=qk_gain, p=p)
