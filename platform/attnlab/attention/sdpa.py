"""The fused softmax path: PyTorch's ``scaled_dot_product_attention`` (FlashAttention on CUDA) with the causal flag.

It computes exactly the softmax variants: ``phi = exp``, ``norm = l1``, no post-processing, no sharpening, no
output LayerNorm. Every scale override and QK-norm keep a softmax row a softmax row, so they are done on q
before the kernel:

- the scale is a per-query-row factor (``1/sqrt(d)``, ``ln N_i / sqrt(d)``, ``ln d * ln N_i``,
  ``coef * ln N_i``): ``(c_i q_i) . k_j == c_i (q_i . k_j)``, so it is folded into q (in float32, or float64
  for float64 inputs) and the kernel runs with ``scale=1``; the plain ``1/sqrt(d)`` without QK-norm is passed
  to the kernel as its own scale, so the standard case is the standard kernel call;
- QK-norm L2-normalises q and k first (as ``F.normalize``, the dense reference's choice), and with a learned
  gain (``qk_norm_gain='learned'``) multiplies them by ``sqrt(d) * gain`` (the RMSNorm of
  ``softmax_qknorm``; the gains come from the model through ``qk_gain``);
- a per-row constant bias (``neg_log_n``, ``neg_log_t``) adds the same number to every score of a row, which
  a softmax row does not see: it is dropped.

ALiBi (``position_bias='alibi'``) is not served here: it would be an additive ``(H, T, T)`` float mask, which
SDPA materialises (8 GB at 16K tokens and 8 heads) and which takes FlashAttention off; FlexAttention adds it in
its ``score_mod`` in O(T) memory, so ``auto`` routes ALiBi specs to ``flex`` on CUDA.

In bf16 the scaled, normalised q is rounded back to bf16 before the kernel: one more rounding of the logits
(relative 2^-9, i.e. about 0.08 at LSSA-sized logits of 40) than the dense path has; the equivalence tests
state the tolerance. Variants this path cannot compute exactly are refused with a one-line ``ValueError``
(see :func:`sdpa_unsupported_reason`): nothing here silently approximates.

No Ray, no model code; never change the math without the dense reference (``dense.py`` is the oracle).
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
