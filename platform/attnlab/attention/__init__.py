"""Attention variants for length-extrapolation studies (docs/attention.md).

Public API (a contract: tests and docs rely on it):

- :func:`variant_names`, :func:`get_variant` -> :class:`AttentionSpec` (the registry is ``variants.py``).
- :func:`attention_weights` ``(q, k, spec, qk_gain=None) -> (B, H, T, T)`` dense causal weights (float32 or
  better).
- :func:`attend` ``(q, k, v, spec, impl="auto", qk_gain=None, p=None) -> (B, H, T, D)``; ``impl`` is a
  :class:`Backend` or its value (``auto``, ``dense``, ``flex``, ``sdpa``), resolved per call by
  :func:`resolve_backend`. ``qk_gain``: for a spec with ``qk_norm_gain='learned'`` (``softmax_qknorm``,
  ``softmax_qknorm_logn``) the model's learned QK-norm gains ``(gain_q, gain_k)``, each ``(D,)`` or ``(H, D)``
  (docs/attention.md#modern-softmax-baselines); None for every other spec. ``p``: a sharpened spec's power
  given as a number or a 0-d tensor instead of ``spec.p`` (one compiled graph for every power).

``q`` and ``k`` are given after RoPE; the spec applies QK-norm, the scale factor and sharpening. The dense
reference is ``dense.py``; the fused FlexAttention path is ``flex.py`` (its mask and positions: ``masks.py``);
the softmax path through ``scaled_dot_product_attention`` is ``sdpa.py``; which one runs is ``backends.py``.
No Ray imports anywhere in this package.
"""

from __future__ import annotations

import torch

from attnlab.attention.backends import Backend, resolve_backend
from attnlab.attention.dense import attend_dense, check_power, weights_for_rows
from attnlab.attention.flex import attend_flex
from attnlab.attention.sdpa import attend_sdpa
from attnlab.attention.spec import AttentionSpec, parse_scale
from attnlab.attention.variants import get_variant, variant_names

__all__ = ["AttentionSpec", "Backend", "attend", "attention_weights", "get_variant", "parse_scale",
           "resolve_backend", "variant_names"]

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


def _check_spec(spec) -> None:
    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"spec must be an AttentionSpec from get_variant(name), got {type(spec).__name__}")


def attention_weights(q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec, qk_gain=None) -> torch.Tensor:
    """Dense causal attention weights ``(B, H, T, T)``, in float32 (float64 for float64 inputs)."""
    check_qkv(q, k)
    _check_spec(spec)
    return weights_for_rows(q, k, spec, qk_gain=qk_gain)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
           impl: Backend | str = Backend.AUTO, qk_gain=None, p=None) -> torch.Tensor:
    """Causal attention output ``(B, H, T, D)`` in v's dtype.

    ``impl`` (a :class:`Backend` or its value): ``dense`` (the reference, chunked over query rows for long
    sequences), ``flex`` (FlexAttention in O(T) memory on CUDA; variants without a fused form use the dense
    reference after a one-time warning), ``sdpa`` (``scaled_dot_product_attention``, softmax variants only:
    ValueError for the others) or ``auto``: on CUDA the fastest exact one of these for ``spec``, elsewhere
    ``dense`` (see :mod:`attnlab.attention.backends`). ``qk_gain``: the model's ``(gain_q, gain_k)`` for a
    spec with ``qk_norm_gain='learned'``, else None (ValueError, one line, when it does not fit the spec).
    ``p``: for a sharpened spec, the power to use instead of ``spec.p``: a number >= 1 or a 0-d tensor (a
    tensor does not specialise a compiled graph, so one graph serves every power: the model passes ``p_eval``
    this way); None: ``spec.p``.
    """
    check_qkv(q, k, v)
    _check_spec(spec)
    check_power(spec, p)
    backend = resolve_backend(spec, q.device, impl)
    if backend is Backend.SDPA:
        return attend_sdpa(q, k, v, spec, qk_gain=qk_gain)
    if backend is Backend.FLEX:
        return attend_flex(q, k, v, spec, qk_gain=qk_gain, p=p)
    return attend_dense(q, k, v, spec, qk_gain=qk_gain, p=p)
