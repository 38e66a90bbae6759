"""The dense reference implementation of every variant, written to read like docs/attention.md.

It materialises the ``(B, H, T, T)`` weights in float32 (float64 for float64 inputs; autocast is switched off
inside) and is the oracle the fused path is tested against. Rows are independent, so :func:`attend_dense` can process query rows in chunks
(exactly: the first-three-rows rule and ``N_i`` use absolute row indices), which bounds memory at long lengths.
No Ray, no model code here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attnlab.attention.chunked import DEFAULT_CHUNK_BYTES, attend_chunked, compute_dtype
from attnlab.attention.masks import alibi_bias, causal_rows, visible_keys
from attnlab.attention.spec import SHARPEN_EXEMPT_ROWS, AttentionSpec

# A peaked unnormalised exp (Table 2, scenario II) would overflow fp32 past e^88; it is clamped here.
EXP_CLAMP = 80.0
# One query row of the dense path is counted as this many (rows x keys) tensors: the weights and their temporaries.
DENSE_TEMPORARIES = 4


def length_scale(spec: AttentionSpec, n: torch.Tensor, d: int) -> torch.Tensor | float:
    """The scale factor of the scores, per row: ``n`` holds N_i, the number of visible keys of each row."""
    if spec.scale == "inv_sqrt_d":
        return 1.0 / math.sqrt(d)
    if spec.scale == "log_n":  # Chiang & Cholak: ln(N_i) / sqrt(d)
        return torch.log(n) / math.sqrt(d)
    if spec.scale == "logd_logn":  # LSSA: ln(d) * ln(N_i)
        return math.log(d) * torch.log(n)
    return spec.coef * torch.log(n)  # coef*log_n


def check_qk_gain(spec: AttentionSpec, qk_gain, q: torch.Tensor) -> None:
    """Raise ValueError (one line) unless ``qk_gain`` fits ``spec`` and ``q`` ``(..., H, T, d)``.

    ``qk_norm_gain='learned'`` needs ``qk_gain=(gain_q, gain_k)``, each of shape ``(d,)`` (shared by the heads)
    or ``(H, d)`` (per head); other specs take ``qk_gain=None``.
    """
    if not spec.learned_qk_gain:
        if qk_gain is not None:
            raise ValueError(f"qk_gain is given but attention {spec.name!r} has qk_norm_gain="
                             f"{spec.qk_norm_gain!r}: pass qk_gain=None")
        return
    d, heads = q.shape[-1], (q.shape[-3] if q.dim() >= 3 else None)
    allowed = f"a pair (gain_q, gain_k) of tensors of shape ({d},) or ({heads}, {d})"
    if not isinstance(qk_gain, (tuple, list)) or len(qk_gain) != 2:
        raise ValueError(f"attention {spec.name!r} has qk_norm_gain='learned': pass qk_gain={allowed} "
                         f"(got {type(qk_gain).__name__})")
    for which, g in zip(("gain_q", "gain_k"), qk_gain):
        if not isinstance(g, torch.Tensor) or tuple(g.shape) not in ((d,), (heads, d)):
            shape = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
            raise ValueError(f"qk_gain {which} has shape {shape}: use {allowed}")


def check_power(spec: AttentionSpec, p) -> None:
    """Raise ValueError (one line) unless ``p`` (a sharpening power given instead of ``spec.p``) fits ``spec``:
    None, or for a sharpened spec a number >= 1 or a 0-d tensor (whose value is not read: it may live on a GPU
    or inside a compiled graph)."""
    if p is None:
        return
    if spec.p is None:
        raise ValueError(f"p={p!r} is given but attention {spec.name!r} is not sharpened (spec.p is None): pass "
                         "p=None, or a spec with a power")
    if isinstance(p, torch.Tensor):
        if p.dim() != 0 or not p.is_floating_point():
            raise ValueError(f"p must be a number >= 1 or a 0-d floating-point tensor, got a tensor of shape "
                             f"{tuple(p.shape)} and dtype {p.dtype}")
    elif isinstance(p, bool) or not isinstance(p, (int, float)) or not p >= 1:
        raise ValueError(f"p={p!r} is not allowed: use a number >= 1 or a 0-d tensor")


def gain_factor(gain: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
    """``sqrt(d) * gain`` shaped to multiply ``(..., H, T, d)`` (a ``(H, d)`` gain gets a T axis)."""
    g = gain.to(dtype) * math.sqrt(d)
    return g.unsqueeze(-2) if g.dim() == 2 else g


def normalise_qk(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, qk_gain=None):
    """QK-norm: ``q / |q|`` (L2), or with a learned gain the RMSNorm ``sqrt(d) * gain * q / |q|``; k alike."""
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    if spec.learned_qk_gain:
        d = q.shape[-1]
        q, k = q * gain_factor(qk_gain[0], d, q.dtype), k * gain_factor(qk_gain[1], d, k.dtype)
    return q, k


def phi(spec: AttentionSpec, s: torch.Tensor) -> torch.Tensor:
    """The non-linearity f of ``A = l1norm(f(S) * M)`` (for ``exp`` + l1norm, softmax is used instead)."""
    if spec.phi == "exp":
        return torch.exp(s.clamp(max=EXP_CLAMP))
    if spec.phi == "identity":
        return s
    if spec.phi == "relu":
        return F.relu(s)
    if spec.phi == "relu2":
        return F.relu(s) ** 2
    if spec.phi == "relu6":
        return F.relu6(s)
    if spec.phi == "gelu":
        return F.gelu(s)
    if spec.phi == "sigmoid":
        return torch.sigmoid(s)
    if spec.phi == "softplus":
        return F.softplus(s)
    return F.mish(s)


def l1norm(x: torch.Tensor) -> torch.Tensor:
    """Divide each row by the sum of its absolute values (an all-zero row stays zero instead of 0/0)."""
    total = x.abs().sum(dim=-1, keepdim=True)
    return x / total.clamp_min(torch.finfo(x.dtype).tiny)


def sharpen_tolerance(dtype: torch.dtype) -> float:
    """How far ``max_j N_i A_ij`` must exceed ``O_i`` for row ``i`` to have mass: 256 ulps of 1 in ``dtype``.

    A (nearly) uniform row has ``N_i A_ij = 1`` up to rounding; within this margin its excess is rounding noise,
    and sharpening it would give all the weight to whichever keys the noise favoured (FlexAttention's pass 2
    recomputes ``A_ij = exp(log f - log Z)``, whose error is a few ulps of the log-scores). Such a row keeps ``A``
    like an exactly uniform one. A row whose true excess is larger is sharpened as the formula says."""
    return 256 * torch.finfo(dtype).eps


def sharpen(a: torch.Tensor, n: torch.Tensor, rows: torch.Tensor, p: float | torch.Tensor) -> torch.Tensor:
    """Re-weighting (docs/attention.md#sharpening): ``l1norm(relu(N_i * A_ij - O_i) ** p)``.

    ``O_i = 1`` for rows ``i >= 3`` and 0 for the first three rows. Each row of ``relu(...)`` is divided by
    its maximum before the power (exact after the second normalisation; avoids fp32 overflow of (N*A)^p).
    Fallback: a row whose ``relu(...)`` is all zero (e.g. a perfectly uniform row at ``i >= 3``), or no larger
    than rounding (:func:`sharpen_tolerance`), keeps the un-sharpened row ``A`` rather than becoming 0/0 or noise.
    """
    offset = (rows >= SHARPEN_EXEMPT_ROWS).to(a.dtype)
    x = F.relu(n * a - offset)
    row_max = x.amax(dim=-1, keepdim=True)
    has_mass = row_max > sharpen_tolerance(a.dtype)
    if isinstance(p, torch.Tensor):
        p = p.to(a.dtype)
    x = (x / torch.where(has_mass, row_max, torch.ones_like(row_max))) ** p
    sharpened = x / x.sum(dim=-1, keepdim=True).clamp_min(1.0)  # the row max is 1, so the sum is >= 1
    return torch.where(has_mass, sharpened, a)


def weights_for_rows(q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec, row_start: int = 0,
                     seq_len: int | None = None, qk_gain=None, p=None) -> torch.Tensor:
    """Causal weights of query rows ``row_start .. row_start + Tq - 1`` over keys ``0 .. Tk - 1``.

    ``q``: ``(..., Tq, d)``, ``k``: ``(..., Tk, d)``; ``seq_len`` is the full sequence length T (for the
    ``-ln T`` bias), by default ``Tk``. Returns ``(..., Tq, Tk)`` in the compute dtype. ``qk_gain``: the
    model's ``(gain_q, gain_k)`` for ``qk_norm_gain='learned'`` (see :func:`check_qk_gain`). ALiBi needs the
    head axis: ``q`` is then ``(..., H, Tq, d)``. ``p``: the sharpening power of a sharpened spec instead of
    ``spec.p`` (a number or a 0-d tensor, see :func:`check_power`).
    """
    check_qk_gain(spec, qk_gain, q)
    check_power(spec, p)
    if spec.position_bias == "alibi" and q.dim() < 3:
        raise ValueError(f"position_bias='alibi' needs q of shape (..., H, T, d), got {tuple(q.shape)}")
    with torch.autocast(device_type=q.device.type, enabled=False):  # float32 (or float64) under autocast too
        return _weights_for_rows(q, k, spec, row_start, seq_len, qk_gain, p)


def _weights_for_rows(q, k, spec: AttentionSpec, row_start: int, seq_len: int | None, qk_gain=None,
                      p=None) -> torch.Tensor:
    dtype = compute_dtype(q.dtype)
    q, k = q.to(dtype), k.to(dtype)
    d = q.shape[-1]
    seq_len = k.shape[-2] if seq_len is None else seq_len
    rows, visible = causal_rows(row_start, q.shape[-2], k.shape[-2], q.device)
    n = visible_keys(rows, dtype)  # N_i: the keys row i sees

    if spec.qk_norm:
        q, k = normalise_qk(spec, q, k, qk_gain)
    s = length_scale(spec, n, d) * (q @ k.transpose(-1, -2))
    if spec.bias == "neg_log_t":
        s = s - math.log(seq_len)
    elif spec.bias == "neg_log_n":
        s = s - torch.log(n)
    if spec.position_bias == "alibi":  # - m_h * (i - j), head h on axis -3 (docs/attention.md#alibi)
        n_head = q.shape[-3]
        heads = torch.arange(n_head, device=q.device).view(n_head, 1, 1)
        cols = torch.arange(k.shape[-2], device=q.device).unsqueeze(0)
        s = s + alibi_bias(heads, rows, cols, n_head, dtype)

    if spec.phi == "exp" and spec.norm == "l1":  # softmax: exp with the row max subtracted, then l1norm
        a = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    else:
        a = torch.where(visible, phi(spec, s), torch.zeros((), dtype=dtype, device=s.device))
        if spec.norm == "l1":
            a = l1norm(a)
        elif spec.norm == "count":
            a = a / n

    if spec.post == "negate":
        a = -a
    elif spec.post in ("recentre", "recentre_l1"):
        recentre = (rows >= SHARPEN_EXEMPT_ROWS) & visible
        a = a - recentre.to(dtype) / n
        if spec.post == "recentre_l1":
            a = l1norm(a)

    if spec.p is not None:
        a = sharpen(a, n, rows, spec.p if p is None else p)
    return a


def attend_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, qk_gain=None, p=None) -> torch.Tensor:
    """``A @ v`` (plus the variant's output LayerNorm) with query rows processed in memory-bounded chunks.

    Computed in float32 (float64 for float64 inputs) whatever autocast is active: autocast is switched off
    inside and the inputs are upcast, so the products ``q k^T`` and ``A v`` are not rounded to bf16. The chunks, and
    how they run under ``torch.compile``, are :func:`attnlab.attention.chunked.attend_chunked`'s (shared with
    plugin references).

    ``qk_gain``: the model's ``(gain_q, gain_k)`` for ``qk_norm_gain='learned'`` (see :func:`check_qk_gain`).
    ``p``: the sharpening power of a sharpened spec instead of ``spec.p`` (see :func:`check_power`).
    """
    check_qk_gain(spec, qk_gain, q)
    check_power(spec, p)
    return attend_chunked(q, k, v, spec, weights_for_rows, temporaries=DENSE_TEMPORARIES, chunk_bytes=chunk_bytes,
                          qk_gain=qk_gain, p=p)
