"""attnlab's attention math, RoPE and ALiBi for a model folder written by ``attnlab export``: attnlab's own code.

Every block under a ``# Copied from attnlab.MODULE.NAME`` line is that function, class or constant of attnlab,
verbatim (``python -m attnlab.export.copies`` checks them, ``make fix-copies`` rewrites them): what a variant is
(attention/spec.py), the causal mask, N_i and ALiBi (attention/masks.py), the query rows in chunks
(attention/chunked.py), the dense reference of every built-in variant (attention/dense.py), and RoPE with its
scalings (model/rope.py, names.py). So an exported model computes attnlab's dense backend operation for operation,
and its logits are attnlab's. This folder's own code: ``check_scaling`` (a ValueError where attnlab raises its
UserError). Imports torch only: the folder runs where attnlab is not installed.

The formulas: attnlab's docs/attention.md and docs/protocol.md#rope-scalings; the copies:
docs/export.md#the-modeling-code.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F


# --- what a variant is (attnlab/attention/spec.py) -------------------------------------------------------------

# Copied from attnlab.attention.spec.PHIS
PHIS = ("exp", "identity", "relu", "relu2", "relu6", "gelu", "sigmoid", "softplus", "mish")

# Copied from attnlab.attention.spec.NORMS
NORMS = ("l1", "none", "count")  # count: divide by the number of visible keys N_i (relu_wortsman)

# Copied from attnlab.attention.spec.SCALES
SCALES = ("inv_sqrt_d", "log_n", "logd_logn", "coef*log_n")

# Copied from attnlab.attention.spec.BIASES
BIASES = ("none", "neg_log_t", "neg_log_n")

# Copied from attnlab.attention.spec.POSTS
POSTS = ("none", "negate", "recentre", "recentre_l1")

# Copied from attnlab.attention.spec.OUT_NORMS
OUT_NORMS = ("none", "layernorm")

# Copied from attnlab.attention.spec.QK_NORM_GAINS
QK_NORM_GAINS = ("none", "learned")

# Copied from attnlab.attention.spec.POSITION_BIASES
POSITION_BIASES = ("none", "alibi")

# Copied from attnlab.attention.spec.SHARPEN_EXEMPT_ROWS
SHARPEN_EXEMPT_ROWS = 3


# Copied from attnlab.attention.spec.AttentionSpec
@dataclass(frozen=True)
class AttentionSpec:
    """One attention variant. Build it with :func:`attnlab.attention.get_variant`.

    Fields:
        name: registry name (``lssa``, ``softmax``, ...).
        phi: the non-linearity ``f`` applied to the scores.
        norm: ``l1`` (divide each row by its sum of absolute values), ``none``, or ``count`` (divide by N_i).
        scale: ``inv_sqrt_d`` = 1/sqrt(d); ``log_n`` = ln(N_i)/sqrt(d) (Chiang & Cholak);
            ``logd_logn`` = ln(d)*ln(N_i) (LSSA); ``coef*log_n`` = coef*ln(N_i).
        coef: the coefficient of ``coef*log_n`` (None otherwise).
        qk_norm: L2-normalise q and k per token before the scores (no learnable gain unless ``qk_norm_gain``).
        qk_norm_gain: ``none`` (QK-norm is the L2 normalisation) or ``learned``: QK-norm is an RMSNorm with a
            learned per-channel gain, ``sqrt(d) * gain * x / |x|`` for q and k (needs ``qk_norm``); the model
            holds the gains and passes them as ``attend(..., qk_gain=(gain_q, gain_k))``.
        bias: additive score bias: ``neg_log_t`` = -ln(T) (T = sequence length), ``neg_log_n`` = -ln(N_i).
        post: ``negate`` (-A, Table 1 inverse), ``recentre`` (subtract 1/N_i from visible entries of rows >= 3),
            ``recentre_l1`` (that, then l1norm).
        p: sharpening power (docs/attention.md#sharpening); None = no sharpening.
        out_norm: ``layernorm``: parameter-free LayerNorm over the head dimension of each head's output
            ``A @ v`` (relu_shen), applied inside :func:`attnlab.attention.attend` before heads are merged.
        position_bias: ``none`` or ``alibi``: ``- m_h * (i - j)`` added to the scores of head ``h`` before
            ``phi`` (Press et al. 2022; slopes: :func:`attnlab.attention.masks.alibi_slopes`).
        source: where the variant comes from in the paper (documentation only).
    """

    name: str
    phi: str = "exp"
    norm: str = "l1"
    scale: str = "inv_sqrt_d"
    coef: float | None = None
    qk_norm: bool = False
    bias: str = "none"
    post: str = "none"
    p: float | None = None
    out_norm: str = "none"
    source: str = ""
    qk_norm_gain: str = "none"
    position_bias: str = "none"

    def __post_init__(self) -> None:
        _check_choice("phi", self.phi, PHIS)
        _check_choice("norm", self.norm, NORMS)
        _check_choice("scale", self.scale, SCALES)
        _check_choice("bias", self.bias, BIASES)
        _check_choice("post", self.post, POSTS)
        _check_choice("out_norm", self.out_norm, OUT_NORMS)
        _check_choice("qk_norm_gain", self.qk_norm_gain, QK_NORM_GAINS)
        _check_choice("position_bias", self.position_bias, POSITION_BIASES)
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"qk_norm={self.qk_norm!r} is not allowed: use true or false")
        if self.qk_norm_gain != "none" and not self.qk_norm:
            raise ValueError(f"qk_norm_gain={self.qk_norm_gain!r} needs qk_norm=true: use qk_norm_gain='none' "
                             "without QK-norm")
        if self.scale == "coef*log_n":
            if self.coef is None:
                raise ValueError("scale='coef*log_n' needs coef: a positive float, e.g. coef=4.16")
            object.__setattr__(self, "coef", _check_float("coef", self.coef, minimum=0.0, strict=True))
        elif self.coef is not None:
            raise ValueError(f"coef={self.coef!r} is only allowed with scale='coef*log_n' (scale is {self.scale!r})")
        if self.p is not None:
            object.__setattr__(self, "p", _check_float("p", self.p, minimum=1.0))

    @property
    def sharpened(self) -> bool:
        return self.p is not None

    @property
    def scale_label(self) -> str:
        """The scale as one string, as the results store records it (``coef*log_n:4.16`` for a coefficient)."""
        return f"coef*log_n:{self.coef:g}" if self.scale == "coef*log_n" else self.scale

    @property
    def learned_qk_gain(self) -> bool:
        """True when attention needs the model's QK-norm gains (``attend(..., qk_gain=(gain_q, gain_k))``)."""
        return self.qk_norm_gain == "learned"

    def replace(self, **changes) -> "AttentionSpec":
        return dataclasses.replace(self, **changes)


# Copied from attnlab.attention.spec._check_choice
def _check_choice(field: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{field}={value!r} is not allowed: use one of {', '.join(allowed)}")


# Copied from attnlab.attention.spec._check_float
def _check_float(field: str, value, minimum: float, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{field}={value!r} is not a number: use a float "
                         f"{'>' if strict else '>='} {minimum:g}")
    value = float(value)
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        raise ValueError(f"{field}={value!r} is out of range: use a finite number "
                         f"{'>' if strict else '>='} {minimum:g}")
    return value


# Copied from attnlab.attention.spec.PluginSpec
@dataclass(frozen=True)
class PluginSpec:
    """A variant from a plugin (docs/plugins.md), as the model, evaluation, diagnostics and the memory plan use it.

    Built by :func:`attnlab.attention.get_variant` for a loaded plugin's name (never by hand). Fields:
        name: the variant's name (unique among the built-ins and every loaded plugin).
        variant: the :class:`attnlab.attention.plugin.Variant` (its forms, parameters and declarations).
        p: sharpening power (docs/attention.md#sharpening), only for a variant declared ``normalised``.
        position_bias: ``none`` or ``alibi`` (the context offers ALiBi's bias to the variant's forms).
        origin, sha256: where the plugin came from (a path or a module name) and the hash of its source bytes.
        source: the :class:`attnlab.attention.plugin.PluginSource` it was loaded from (``plugin.py`` makes a spec
            pickle as its source and name, so it is rebuilt in a process that cannot read the plugin's files).
    """

    name: str
    variant: object = dataclasses.field(repr=False)
    p: float | None = None
    position_bias: str = "none"
    origin: str = ""
    sha256: str = ""
    source: object = dataclasses.field(default=None, repr=False, compare=False)

    # What the rest of attnlab reads off a spec: a plugin has no QK-norm gain, no output LayerNorm and no
    # scale field of its own (its scale, if any, is part of its forms).
    qk_norm = False
    learned_qk_gain = False
    out_norm = "none"

    def __post_init__(self) -> None:
        _check_choice("position_bias", self.position_bias, POSITION_BIASES)
        if self.p is not None:
            object.__setattr__(self, "p", _check_float("p", self.p, minimum=1.0))
            if not getattr(self.variant, "normalised", False):
                raise ValueError(f"p={self.p:g} is not allowed for attention {self.name!r}: sharpening needs "
                                 "normalised rows, and the plugin does not declare normalised=True; use p=None")

    @property
    def sharpened(self) -> bool:
        return self.p is not None

    @property
    def scale_label(self) -> str:
        """``plugin``: the variant's scale is part of its own forms (the results store's ``scale`` column)."""
        return "plugin"

    def replace(self, **changes) -> "PluginSpec":
        return dataclasses.replace(self, **changes)

    def unfusable_reason(self) -> str | None:
        """Why this spec runs the variant's reference rather than a fused form (None when it has one)."""
        if self.variant.log_score is None and self.variant.fused is None:
            return "the plugin gives a reference form only"
        if self.p is not None and self.variant.log_score is None:
            # A log_score is sharpened by the two passes of flex.attend_log_scores; a fused function has no
            # second pass to sharpen with.
            return "sharpening is fused for a plugin's log_score form only, and this plugin gives a fused function"
        return None


# --- the causal mask, N_i and ALiBi (attnlab/attention/masks.py) -----------------------------------------------

# Copied from attnlab.attention.masks.causal_mask_mod
def causal_mask_mod(b, h, q_idx, kv_idx):
    """FlexAttention ``mask_mod``: query row ``i`` sees keys ``j <= i`` (as ``dense.causal_rows``)."""
    return kv_idx <= q_idx


# Copied from attnlab.attention.masks.visible_keys
def visible_keys(q_idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """N_i, the number of keys row ``i`` sees under :func:`causal_mask_mod`, as a ``dtype`` tensor."""
    return (q_idx + 1).to(dtype)


# Copied from attnlab.attention.masks.causal_rows
def causal_rows(row_start: int, n_rows: int, n_keys: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices ``i`` (shape ``(R, 1)``) of query rows ``row_start ..`` and their visibility mask over keys
    ``0 .. n_keys - 1`` (shape ``(R, K)``), as dense tensors for the reference implementation."""
    rows = torch.arange(row_start, row_start + n_rows, device=device).unsqueeze(-1)
    cols = torch.arange(n_keys, device=device).unsqueeze(0)
    return rows, causal_mask_mod(None, None, rows, cols)


# Copied from attnlab.attention.masks.alibi_slope
def alibi_slope(head: torch.Tensor, n_head: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ALiBi slope ``m_h`` of the 0-based head index ``head`` (a tensor, any shape) among ``n_head`` heads.

    Press et al. 2022: for ``H`` a power of two, ``m_h = 2^(-8 h / H)`` for ``h = 1..H`` (H = 8: 1/2, 1/4, ...,
    1/256). Otherwise, with ``c`` the largest power of two below ``H``: the ``c`` slopes of ``c`` heads, then
    every other slope of ``2c`` heads (``2^(-8 (2j + 1) / (2c))``, j = 0..H-c-1), as the paper's code does.
    Written with tensor ops so that a FlexAttention ``score_mod`` computes it from its head index.
    """
    if isinstance(n_head, bool) or not isinstance(n_head, int) or n_head < 1:
        raise ValueError(f"n_head={n_head!r} is not allowed: ALiBi needs a positive number of heads")
    c = 2 ** int(math.floor(math.log2(n_head)))
    h = head.to(dtype)
    exponent = torch.where(h < c, -8.0 * (h + 1.0) / c, -4.0 * (2.0 * (h - c) + 1.0) / c)
    return torch.exp2(exponent)


# Copied from attnlab.attention.masks.alibi_bias
def alibi_bias(head: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, n_head: int,
               dtype: torch.dtype) -> torch.Tensor:
    """``-m_h * (i - j)``: the ALiBi bias of query ``i = q_idx`` and key ``j = kv_idx`` in head ``h`` (broadcast)."""
    return -alibi_slope(head, n_head, dtype) * (q_idx - kv_idx).to(dtype)


# --- query rows in chunks (attnlab/attention/chunked.py) -------------------------------------------------------

# Copied from attnlab.attention.chunked.DEFAULT_CHUNK_BYTES
DEFAULT_CHUNK_BYTES = 256 * 1024**2


# Copied from attnlab.attention.chunked.compute_dtype
def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Weights are computed in float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# Copied from attnlab.attention.chunked.autocast_off
def autocast_off(device: torch.device):
    """Autocast switched off (weights are computed in float32 or float64); meta tensors (the memory plan) as CPU
    ones (``torch.autocast`` has no meta device)."""
    return torch.autocast(device_type="cpu" if device.type == "meta" else device.type, enabled=False)


# Copied from attnlab.attention.chunked.row_bytes
def row_bytes(q: torch.Tensor, temporaries: int) -> int:
    """Bytes of one query row's weights and temporaries (``temporaries`` tensors of ``(rows x keys)``), all heads and
    batch entries, in the compute dtype."""
    return _row_bytes(math.prod(q.shape[:-2]), q.shape[-2], q.dtype, temporaries)


# Copied from attnlab.attention.chunked.chunk_rows
def chunk_rows(q: torch.Tensor, chunk_bytes: int, temporaries: int) -> int:
    """How many query rows one chunk holds within ``chunk_bytes`` (at least 1, at most T)."""
    return rows_per_chunk(math.prod(q.shape[:-2]), q.shape[-2], q.dtype, chunk_bytes, temporaries)


# Copied from attnlab.attention.chunked.rows_per_chunk
def rows_per_chunk(batch: int, seq_len: int, dtype: torch.dtype, chunk_bytes: int, temporaries: int) -> int:
    """:func:`chunk_rows` from sizes alone (``batch``: every leading axis, heads included): for a memory plan."""
    return max(1, min(seq_len, chunk_bytes // _row_bytes(batch, seq_len, dtype, temporaries)))


# Copied from attnlab.attention.chunked._row_bytes
def _row_bytes(batch: int, seq_len: int, dtype: torch.dtype, temporaries: int) -> int:
    return max(1, batch * seq_len * torch.finfo(compute_dtype(dtype)).bits // 8 * temporaries)


# Copied from attnlab.attention.chunked.attend_chunked
def attend_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec, weights: Callable, *, temporaries: int,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES, **kwargs) -> torch.Tensor:
    """``A @ v`` (and ``spec``'s output LayerNorm, if it has one) with query rows in memory-bounded chunks, in v's
    dtype; computed in float32 (float64 for float64 inputs) whatever autocast is active.

    ``weights(q_rows, k_keys, spec, row_start=r0, seq_len=T, **kwargs)`` gives the causal weights of the query rows
    ``r0 ..`` over the keys ``0 .. K - 1`` (the last row + 1) in the compute dtype; ``q``, ``k`` and ``v`` are upcast
    once, before the loop.

    Under ``torch.compile`` the row-chunk loop is not traced chunk by chunk (one graph body per chunk: dozens per
    layer at B=64, T=1024): with gradients the whole sequence is one chunk, since autograd saves every chunk's weights
    for the backward anyway and chunking bounds nothing there; without gradients (long evaluation windows, where
    chunking is what bounds memory) a sequence that needs several chunks runs as one ``torch.compiler.disable``d
    region, eagerly and chunked, between two graphs.
    """
    if torch.compiler.is_compiling():
        if torch.is_grad_enabled():
            chunk_bytes = max(chunk_bytes, row_bytes(q, temporaries) * q.shape[-2])
        elif chunk_rows(q, chunk_bytes, temporaries) < q.shape[-2]:
            return _attend_chunked_eager(q, k, v, spec, weights, temporaries, chunk_bytes, kwargs)
    return _attend_chunked(q, k, v, spec, weights, temporaries, chunk_bytes, kwargs)


# Copied from attnlab.attention.chunked._attend_chunked
def _attend_chunked(q, k, v, spec, weights: Callable, temporaries: int, chunk_bytes: int,
                    kwargs: dict) -> torch.Tensor:
    T = q.shape[-2]
    dtype = compute_dtype(q.dtype)
    chunk = chunk_rows(q, chunk_bytes, temporaries)
    with autocast_off(q.device):
        q, k, vv = q.to(dtype), k.to(dtype), v.to(dtype)
        outs = []
        for r0 in range(0, T, chunk):
            r1 = min(T, r0 + chunk)
            a = weights(q[..., r0:r1, :], k[..., :r1, :], spec, row_start=r0, seq_len=T, **kwargs)
            outs.append(a @ vv[..., :r1, :])
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
        if spec.out_norm == "layernorm":
            out = F.layer_norm(out, out.shape[-1:])
    return out.to(v.dtype)


# Copied from attnlab.attention.chunked._attend_chunked_eager
_attend_chunked_eager = torch._disable_dynamo(_attend_chunked)


# --- the built-in variants (attnlab/attention/dense.py) --------------------------------------------------------

# Copied from attnlab.attention.dense.EXP_CLAMP
EXP_CLAMP = 80.0

# Copied from attnlab.attention.dense.DENSE_TEMPORARIES
DENSE_TEMPORARIES = 4


# Copied from attnlab.attention.dense.length_scale
def length_scale(spec: AttentionSpec, n: torch.Tensor, d: int) -> torch.Tensor | float:
    """The scale factor of the scores, per row: ``n`` holds N_i, the number of visible keys of each row."""
    if spec.scale == "inv_sqrt_d":
        return 1.0 / math.sqrt(d)
    if spec.scale == "log_n":  # Chiang & Cholak: ln(N_i) / sqrt(d)
        return torch.log(n) / math.sqrt(d)
    if spec.scale == "logd_logn":  # LSSA: ln(d) * ln(N_i)
        return math.log(d) * torch.log(n)
    return spec.coef * torch.log(n)  # coef*log_n


# Copied from attnlab.attention.dense.check_qk_gain
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


# Copied from attnlab.attention.dense.check_power
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


# Copied from attnlab.attention.dense.gain_factor
def gain_factor(gain: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
    """``sqrt(d) * gain`` shaped to multiply ``(..., H, T, d)`` (a ``(H, d)`` gain gets a T axis)."""
    g = gain.to(dtype) * math.sqrt(d)
    return g.unsqueeze(-2) if g.dim() == 2 else g


# Copied from attnlab.attention.dense.normalise_qk
def normalise_qk(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, qk_gain=None):
    """QK-norm: ``q / |q|`` (L2), or with a learned gain the RMSNorm ``sqrt(d) * gain * q / |q|``; k alike."""
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    if spec.learned_qk_gain:
        d = q.shape[-1]
        q, k = q * gain_factor(qk_gain[0], d, q.dtype), k * gain_factor(qk_gain[1], d, k.dtype)
    return q, k


# Copied from attnlab.attention.dense.phi
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


# Copied from attnlab.attention.dense.l1norm
def l1norm(x: torch.Tensor) -> torch.Tensor:
    """Divide each row by the sum of its absolute values (an all-zero row stays zero instead of 0/0)."""
    total = x.abs().sum(dim=-1, keepdim=True)
    return x / total.clamp_min(torch.finfo(x.dtype).tiny)


# Copied from attnlab.attention.dense.sharpen_tolerance
def sharpen_tolerance(dtype: torch.dtype) -> float:
    """How far ``max_j N_i A_ij`` must exceed ``O_i`` for row ``i`` to have mass: 256 ulps of 1 in ``dtype``.

    A (nearly) uniform row has ``N_i A_ij = 1`` up to rounding; within this margin its excess is rounding noise,
    and sharpening it would give all the weight to whichever keys the noise favoured (FlexAttention's pass 2
    recomputes ``A_ij = exp(log f - log Z)``, whose error is a few ulps of the log-scores). Such a row keeps ``A``
    like an exactly uniform one. A row whose true excess is larger is sharpened as the formula says."""
    return 256 * torch.finfo(dtype).eps


# Copied from attnlab.attention.dense.sharpen
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


# Copied from attnlab.attention.dense.weights_for_rows
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


# Copied from attnlab.attention.dense._weights_for_rows
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


# Copied from attnlab.attention.dense.attend_dense
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


# --- RoPE and its scalings (attnlab/names.py, attnlab/model/rope.py) -------------------------------------------

# Copied from attnlab.names.ROPE_SCALINGS
ROPE_SCALINGS = ("ntk", "none", "pi", "yarn", "yarn_paper", "dynamic")


# Copied from attnlab.names.RopeScaling
class RopeScaling(NamedTuple):
    """A RoPE scaling (:data:`ROPE_SCALINGS`) and its scale factor: None for the default (in training
    ``seq_len / original_len``; at evaluation the evaluated length over the trained one), else a number >= 1.
    Its text form, :attr:`label`, is ``yarn`` or ``dynamic:2``: how configs, evaluation cells and results rows
    spell it."""

    method: str
    factor: float | None = None

    @property
    def label(self) -> str:
        return self.method if self.factor is None else f"{self.method}:{self.factor:g}"


def check_scaling(scaling, field: str = "rope_scaling") -> RopeScaling:
    """An evaluation-time scaling as attnlab's ``names.check_scaling`` reads it: a name of ROPE_SCALINGS, or
    ``dynamic:F`` with a factor F >= 1 (only dynamic takes one). A one-line ValueError naming ``field`` otherwise
    (where attnlab raises its UserError, which this folder does not have)."""
    method, colon, text = str(scaling).strip().partition(":")
    factor = None
    if colon:
        try:
            factor = float(text)
        except ValueError:
            factor = math.nan
    if method not in ROPE_SCALINGS or (method == "dynamic") != (factor is not None) or not (factor or 1) >= 1:
        raise ValueError(f"{field}={scaling!r} is not allowed: use one of "
                         f"{', '.join(m for m in ROPE_SCALINGS if m != 'dynamic')} or dynamic:F (a factor F >= 1)")
    return RopeScaling(method, factor)


# Copied from attnlab.model.rope.YARN_ALPHA
YARN_ALPHA = 1.0

# Copied from attnlab.model.rope.YARN_BETA
YARN_BETA = 32.0


# Copied from attnlab.model.rope.ntk_base
def ntk_base(base: float, head_dim: int, seq_len: int, train_len: int) -> float:
    """The RoPE base for a forward pass of ``seq_len`` tokens by a model trained at ``train_len``."""
    if seq_len <= train_len:
        return base
    return base * (seq_len / train_len) ** (head_dim / (head_dim - 2))


# Copied from attnlab.model.rope.dynamic_base
def dynamic_base(base: float, head_dim: int, seq_len: int, train_len: int, factor: float) -> float:
    """Dynamic NTK's base (transformers' ``_compute_dynamic_ntk_parameters``) for a forward of ``seq_len`` tokens by
    a model trained at ``train_len``: ``base * (f L / L_train - (f - 1)) ** (d / (d - 2))``, ``L`` at least
    ``L_train`` (the trained base up to it)."""
    length = max(seq_len, train_len)
    return base * (factor * length / train_len - (factor - 1)) ** (head_dim / (head_dim - 2))


# Copied from attnlab.model.rope.inverse_frequencies
def inverse_frequencies(base: float, head_dim: int, device=None) -> torch.Tensor:
    """``base^(-2m/d)``, ``m = 0 .. d/2 - 1``, float64."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))


# Copied from attnlab.model.rope.yarn_temperature
def yarn_temperature(scale: float) -> float:
    """YaRN's ``sqrt(1/t) = 0.1 ln(s) + 1`` (1 for ``s <= 1``): the reference's ``get_mscale``, transformers'
    ``attention_factor``."""
    return 0.1 * math.log(scale) + 1.0 if scale > 1 else 1.0


# Copied from attnlab.model.rope.TrainedScaling
class TrainedScaling(NamedTuple):
    """The RoPE scaling a model was fine-tuned with: ``method`` (pi, ntk, yarn, yarn_paper, dynamic) from
    ``original_len`` to the model's ``train_len`` with ``factor`` (None: ``train_len / original_len``) (module
    docstring). ``none`` is no scaling: the plain frequencies at the new length."""

    method: str
    original_len: int
    factor: float | None = None

    def scale(self, train_len: int) -> float:
        """The factor it was trained with: the one set, else ``train_len / original_len``."""
        return float(self.factor) if self.factor is not None else train_len / self.original_len


# Copied from attnlab.model.rope._correction_pair
def _correction_pair(rotations: float, head_dim: int, base: float, original_len: int) -> float:
    """The (fractional) pair index whose wavelength turns ``rotations`` times over ``original_len``: the
    reference's ``find_correction_dim``."""
    return head_dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))


# Copied from attnlab.model.rope.yarn_keep
def yarn_keep(head_dim: int, base: float, original_len: int, device=None) -> torch.Tensor:
    """The share of each pair's frequency YaRN keeps (1: extrapolate, the trained frequency; 0: interpolate,
    ``theta / s``), ``(d/2,)`` float64: one minus the reference's ramp, linear in the pair index from
    ``low = floor(m(beta))`` to ``high = ceil(m(alpha))``, both clamped to ``[0, d - 1]`` (``find_correction_range``,
    ``linear_ramp_mask``; ``high`` nudged by 0.001 when they meet)."""
    low = max(math.floor(_correction_pair(YARN_BETA, head_dim, base, original_len)), 0)
    high = min(math.ceil(_correction_pair(YARN_ALPHA, head_dim, base, original_len)), head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, device=device, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)
    return 1.0 - ramp


# Copied from attnlab.model.rope.yarn_frequencies
def yarn_frequencies(inv_freq: torch.Tensor, s: float, head_dim: int, base: float, original_len: int) -> torch.Tensor:
    """YaRN's frequencies as its reference code computes them: ``theta / s`` blended with ``theta`` by
    :func:`yarn_keep` (over ``original_len``, the length the frequencies were trained at)."""
    keep = yarn_keep(head_dim, base, original_len, inv_freq.device)
    return inv_freq / s * (1 - keep) + inv_freq * keep


# Copied from attnlab.model.rope.yarn_paper_frequencies
def yarn_paper_frequencies(inv_freq: torch.Tensor, s: float, original_len: int) -> torch.Tensor:
    """The paper's equation (``yarn_paper``): gamma = 0 (interpolate, theta / s) for wavelengths longer than
    L / alpha, 1 (keep) for those shorter than L / beta, linear in r = L / lambda in between (L = ``original_len``)."""
    ratio = original_len * inv_freq / (2 * math.pi)
    gamma = ((ratio - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0.0, 1.0)
    return (1 - gamma) * inv_freq / s + gamma * inv_freq


# Copied from attnlab.model.rope.scaled_frequencies
def scaled_frequencies(method: str, head_dim: int, base: float, original_len: int, factor: float, seq_len: int,
                       device=None) -> tuple[torch.Tensor, float]:
    """``(inv_freq, logit multiplier)`` of ``method`` with scale ``factor`` for frequencies trained at
    ``original_len`` from ``base``, in a forward of ``seq_len`` tokens (only ``dynamic`` reads it)."""
    if method == "ntk":
        return inverse_frequencies(base * factor ** (head_dim / (head_dim - 2)), head_dim, device), 1.0
    if method == "dynamic":
        return inverse_frequencies(dynamic_base(base, head_dim, seq_len, original_len, factor), head_dim, device), 1.0
    inv_freq = inverse_frequencies(base, head_dim, device)
    if method == "none":
        return inv_freq, 1.0
    if method == "pi":
        return inv_freq / factor, 1.0
    if method == "yarn":
        return yarn_frequencies(inv_freq, factor, head_dim, base, original_len), yarn_temperature(factor) ** 2
    if method == "yarn_paper":
        return yarn_paper_frequencies(inv_freq, factor, original_len), yarn_temperature(factor) ** 2
    raise ValueError(f"rope_scaling={method!r} is not allowed: use one of {', '.join(ROPE_SCALINGS)}")


# Copied from attnlab.model.rope.rope_frequencies
def rope_frequencies(scaling, head_dim: int, seq_len: int, train_len: int, base: float = 10000.0,
                     device=None, trained: TrainedScaling | None = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq (d/2,) float64, logit multiplier)`` of a forward of ``seq_len`` tokens by a model trained at
    ``train_len`` with RoPE ``base`` and the evaluation-time ``scaling`` asked for (a name or ``dynamic:F``; module
    docstring). The multiplier is 1 except for YaRN beyond the training length: ``(0.1 ln s + 1)^2``, applied to
    ``q . k``. ``trained``: the scaling the model was fine-tuned with (to ``train_len`` from
    ``trained.original_len``), applied at every length, ``scaling`` then acting beyond ``train_len`` on top of it."""
    rope = check_scaling(scaling)
    method = rope.method
    beyond = seq_len > train_len and method != "none"
    if trained is not None and trained.method != "none":
        start = base
        if beyond and method == "ntk":
            start = ntk_base(base, head_dim, seq_len, train_len)
        elif beyond and method == "dynamic":
            start = dynamic_base(base, head_dim, seq_len, train_len, rope.factor)
        # the fine-tune's own frequencies: its method and factor for a model trained at L_original (dynamic at the
        # forward's length as trained; at L_new under a scaling on top)
        inv_freq, multiplier = scaled_frequencies(trained.method, head_dim, start, trained.original_len,
                                                  trained.scale(train_len), train_len if beyond else seq_len, device)
        if not beyond or method in ("ntk", "dynamic"):
            return inv_freq, multiplier
        s = seq_len / train_len
        if method == "pi":
            return inv_freq / s, multiplier
        if method == "yarn":
            return yarn_frequencies(inv_freq, s, head_dim, base, train_len), multiplier * yarn_temperature(s) ** 2
        return yarn_paper_frequencies(inv_freq, s, train_len), multiplier * yarn_temperature(s) ** 2
    if not beyond:
        return inverse_frequencies(base, head_dim, device), 1.0
    factor = rope.factor if method == "dynamic" else seq_len / train_len
    return scaled_frequencies(method, head_dim, base, train_len, factor, seq_len, device)


# Copied from attnlab.model.rope.rope_tables
def rope_tables(seq_len: int, head_dim: int, base: float, device=None, dtype=torch.float32, *,
                inv_freq: torch.Tensor | None = None, multiplier: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``(seq_len, head_dim)`` for positions ``0 .. seq_len - 1`` (half-rotation layout),
    from ``base`` or the given ``inv_freq``; both times ``sqrt(multiplier)`` (the logit multiplier of YaRN)."""
    if inv_freq is None:
        inv_freq = inverse_frequencies(base, head_dim, device)
    pos = torch.arange(seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(pos, inv_freq.to(device=device, dtype=torch.float64))
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if multiplier != 1.0:
        cos, sin = cos * math.sqrt(multiplier), sin * math.sqrt(multiplier)
    return cos.to(dtype), sin.to(dtype)


# Copied from attnlab.model.rope.scaled_rope_tables
def scaled_rope_tables(scaling, seq_len: int, head_dim: int, train_len: int, base: float, device=None,
                       dtype=torch.float32, trained: TrainedScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables of one forward: :func:`rope_frequencies` then :func:`rope_tables`."""
    inv_freq, multiplier = rope_frequencies(scaling, head_dim, seq_len, train_len, base, device=device,
                                            trained=trained)
    return rope_tables(seq_len, head_dim, base, device, dtype, inv_freq=inv_freq, multiplier=multiplier)


# Copied from attnlab.model.rope.apply_rope
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(B, H, T, D)``; the rotation keeps each vector's norm (times ``sqrt(multiplier)``
    for tables made with one)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
