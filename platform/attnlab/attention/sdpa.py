"""The fused softmax path: PyTorch's ``scaled_dot_product_attention`` (FlashAttention on CUDA) with the causal flag.

Owns :func:`attend_sdpa` for the softmax rows it computes exactly (``phi = exp``, ``norm = l1``, no
post-processing, sharpening or output LayerNorm): the scale and QK-norm (with a learned gain) are folded into q and
k before the kernel, a per-row constant bias is dropped (a softmax row does not see it). What it cannot compute
exactly, ALiBi included, is refused with a one-line ``ValueError`` (:func:`sdpa_unsupported_reason`).

It must never approximate silently, nor change the math without the dense reference (``dense.py`` is the oracle).
No Ray, no model code.

Details: docs/attention.md#the-sdpa-path (the folding, bf16 rounding), docs/attention.md#alibi (why not ALiBi).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attnlab.attention.dense import check_qk_gain, compute_dtype, length_scale, normalise_qk
from attnlab.attention.masks import visible_keys
from attnlab.attention.spec import AttentionSpec, PluginSpec


def sdpa_unsupported_reason(spec: AttentionSpec) -> str | None:
    """Why ``spec`` is not a softmax that SDPA computes exactly (None when it is)."""
    if isinstance(spec, PluginSpec):
        return "a plugin variant runs its own forms: its fused form (impl='flex') or its reference ('dense')"
    if spec.phi != "exp":
        return f"phi={spec.phi!r} is not exp, and SDPA computes only softmax"
    if spec.norm != "l1":
        return f"norm={spec.norm!r} leaves rows unnormalised, and SDPA always normalises them"
    if spec.post != "none":
        return f"post={spec.post!r} changes the rows after the softmax"
    if spec.p is not None:
        return f"p={spec.p:g} sharpens the rows (a second pass): use impl='flex'"
    if spec.out_norm != "none":
        return f"out_norm={spec.out_norm!r} normalises each head's output after A @ v"
    if spec.position_bias != "none":
        return (f"position_bias={spec.position_bias!r} would be a materialised (H, T, T) float mask: "
                "FlexAttention adds it in O(T) memory")
    return None


def is_sdpa_exact(spec: AttentionSpec) -> bool:
    """True when :func:`attend_sdpa` computes ``spec`` exactly (a softmax with any scale, QK-norm or row bias)."""
    return sdpa_unsupported_reason(spec) is None


def attend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
                qk_gain=None) -> torch.Tensor:
    """Causal softmax attention ``(B, H, T, Dv)`` in v's dtype with ``scaled_dot_product_attention``.

    Raises ValueError (one line, naming the variant and why) for a spec it cannot compute exactly.
    ``qk_gain``: the model's ``(gain_q, gain_k)`` for ``qk_norm_gain='learned'``.
    """
    check_qk_gain(spec, qk_gain, q)
    reason = sdpa_unsupported_reason(spec)
    if reason is not None:
        raise ValueError(f"impl='sdpa' cannot compute attention {spec.name!r} exactly: {reason}; "
                         "use impl='auto', 'flex' or 'dense'")
    out_dtype = v.dtype
    work = q.dtype if q.dtype == k.dtype == v.dtype else compute_dtype(q.dtype)
    d = q.shape[-1]
    if spec.scale == "inv_sqrt_d" and not spec.qk_norm:
        out = F.scaled_dot_product_attention(q.to(work), k.to(work), v.to(work), is_causal=True,
                                             scale=1.0 / math.sqrt(d))
        return out.to(out_dtype)

    dtype = compute_dtype(q.dtype)
    q, k = q.to(dtype), k.to(dtype)
    if spec.qk_norm:
        q, k = normalise_qk(spec, q, k, qk_gain)
    n = visible_keys(torch.arange(q.shape[-2], device=q.device), dtype).unsqueeze(-1)  # N_i, (T, 1)
    q = q * length_scale(spec, n, d)
    out = F.scaled_dot_product_attention(q.to(work), k.to(work), v.to(work), is_causal=True, scale=1.0)
    return out.to(out_dtype)
