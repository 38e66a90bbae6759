"""attnlab's attention variants, RoPE (with its scalings, at evaluation and in training) and ALiBi in plain PyTorch,
for a model folder written by ``attnlab export``.

This file is copied into the folder beside ``modeling_attnlab.py`` and imports torch only: the folder runs where
attnlab is not installed. Each function is a transcription of attnlab's dense reference, operation for operation in
the same order and dtypes, so an exported model's logits equal attnlab's (attnlab/attention/dense.py, chunked.py,
masks.py; attnlab/model/rope.py; the formulas: attnlab's docs/attention.md and docs/protocol.md#rope-scalings):

    A = post(norm(phi(S) * M)),  S = scale(N_i) * q . k (+ bias),  then sharpened when a power p is set:
    A <- l1norm(relu(N_i A_ij - O_i) ** p)  (O_i = 0 for the first three rows, 1 after)

Weights are computed in float32 (float64 for float64 inputs) whatever the model's dtype, in blocks of query rows
(rows are independent, so a block is exact) that keep one block's weights under ``CHUNK_BYTES``. A variant from an
attnlab plugin runs its own ``reference`` function (``plugin_attnlab.py`` loads it) on the same rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

SHARPEN_EXEMPT_ROWS = 3  # rows 0..2 are sharpened without the offset O_i
EXP_CLAMP = 80.0  # an unnormalised exp (scenario_ii) is clamped below fp32's overflow
CHUNK_BYTES = 256 * 1024**2  # query rows per block: at most this many bytes of weights and temporaries
BUILTIN_TEMPORARIES, PLUGIN_TEMPORARIES = 4, 8  # (rows x keys) tensors one row of weights is counted as
ROPE_SCALINGS = ("ntk", "none", "pi", "yarn", "yarn_paper", "dynamic")
YARN_ALPHA, YARN_BETA = 1.0, 32.0  # YaRN's ramp bounds (Peng et al. 2023, section 3.2; the reference's beta_slow, fast)


@dataclass(frozen=True)
class Spec:
    """One variant, as attnlab's ``AttentionSpec`` describes it (``plugin``: a plugin variant, whose forms are its
    own: only ``p`` and ``position_bias`` apply to it)."""

    name: str
    phi: str = "exp"
    norm: str = "l1"
    scale: str = "inv_sqrt_d"
    coef: float | None = None
    qk_norm: bool = False
    qk_norm_gain: str = "none"
    bias: str = "none"
    post: str = "none"
    p: float | None = None
    out_norm: str = "none"
    position_bias: str = "none"
    plugin: object = field(default=None, compare=False)

    @property
    def learned_qk_gain(self) -> bool:
        return self.qk_norm_gain == "learned"


# --- masks, positions, ALiBi (attnlab/attention/masks.py) -----------------------------------------------------------

def causal_rows(row_start: int, n_rows: int, n_keys: int, device):
    """Row indices ``(R, 1)`` of query rows ``row_start ..`` and which of the keys ``0 .. K - 1`` each sees ``(R, K)``."""
    rows = torch.arange(row_start, row_start + n_rows, device=device).unsqueeze(-1)
    cols = torch.arange(n_keys, device=device).unsqueeze(0)
    return rows, cols <= rows


def visible_keys(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """N_i = i + 1, the keys row i sees."""
    return (rows + 1).to(dtype)


def alibi_slope(head: torch.Tensor, n_head: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """ALiBi's slope m_h of the 0-based head index (Press et al. 2022; heads beyond a power of two as their code)."""
    c = 2 ** int(math.floor(math.log2(n_head)))
    h = head.to(dtype)
    exponent = torch.where(h < c, -8.0 * (h + 1.0) / c, -4.0 * (2.0 * (h - c) + 1.0) / c)
    return torch.exp2(exponent)


def alibi_bias(head, q_idx, kv_idx, n_head: int, dtype: torch.dtype) -> torch.Tensor:
    """``-m_h * (i - j)``."""
    return -alibi_slope(head, n_head, dtype) * (q_idx - kv_idx).to(dtype)


# --- RoPE and its scalings (attnlab/model/rope.py) ------------------------------------------------------------------

def inverse_frequencies(base: float, head_dim: int, device=None) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))


def check_scaling(scaling: str, field: str = "rope_scaling") -> tuple[str, float | None]:
    """``(method, factor)`` of an evaluation-time scaling: a name, or ``dynamic:F`` (only dynamic takes a factor
    here; the others' is the evaluated length over the trained one)."""
    method, _, text = str(scaling).partition(":")
    factor = None
    if _:
        try:
            factor = float(text)
        except ValueError:
            factor = math.nan
    if method not in ROPE_SCALINGS or (method == "dynamic") != (factor is not None) or not (factor or 1) >= 1:
        raise ValueError(f"{field}={scaling!r} is not allowed: use one of "
                         f"{', '.join(m for m in ROPE_SCALINGS if m != 'dynamic')} or dynamic:F (a factor F >= 1)")
    return method, factor


def ntk_base(base: float, head_dim: int, seq_len: int, train_len: int) -> float:
    """NTK's base for a forward of ``seq_len`` tokens by a model trained at ``train_len``: ``base * s ** (d / (d - 2))``
    beyond it, ``base`` up to it."""
    if seq_len <= train_len:
        return base
    return base * (seq_len / train_len) ** (head_dim / (head_dim - 2))


def dynamic_base(base: float, head_dim: int, seq_len: int, train_len: int, factor: float) -> float:
    """Dynamic NTK's base (transformers' rope_type dynamic): ``base * (f L / L_train - (f - 1)) ** (d / (d - 2))``,
    ``L`` at least ``train_len``."""
    length = max(seq_len, train_len)
    return base * (factor * length / train_len - (factor - 1)) ** (head_dim / (head_dim - 2))


def yarn_temperature(scale: float) -> float:
    return 0.1 * math.log(scale) + 1.0 if scale > 1 else 1.0


def yarn_frequencies(inv_freq: torch.Tensor, s: float, head_dim: int, base: float, original_len: int) -> torch.Tensor:
    """YaRN as its reference code and transformers compute it: the share kept is one minus a ramp linear in the pair
    index from ``floor(m(32))`` to ``ceil(m(1))``, ``m(r) = d ln(L / (2 pi r)) / (2 ln base)``."""
    def pair(rotations: float) -> float:
        return head_dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(pair(YARN_BETA)), 0), min(math.ceil(pair(YARN_ALPHA)), head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, device=inv_freq.device, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp
    return inv_freq / s * (1 - keep) + inv_freq * keep


def yarn_paper_frequencies(inv_freq: torch.Tensor, s: float, original_len: int) -> torch.Tensor:
    """The paper's ramp (yarn_paper): linear in ``r = original_len / lambda``, interpolated (``/ s``) below
    ``alpha``, kept above ``beta``."""
    ratio = original_len * inv_freq / (2 * math.pi)
    gamma = ((ratio - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0.0, 1.0)
    return (1 - gamma) * inv_freq / s + gamma * inv_freq


def scaled_frequencies(method: str, head_dim: int, base: float, original_len: int, factor: float, seq_len: int,
                       device=None):
    """``(inv_freq, logit multiplier)`` of ``method`` with scale ``factor`` for frequencies trained at
    ``original_len`` (only dynamic reads ``seq_len``)."""
    if method == "ntk":
        return inverse_frequencies(base * factor ** (head_dim / (head_dim - 2)), head_dim, device), 1.0
    if method == "dynamic":
        return inverse_frequencies(dynamic_base(base, head_dim, seq_len, original_len, factor), head_dim, device), 1.0
    inv_freq = inverse_frequencies(base, head_dim, device)
    if method == "pi":
        return inv_freq / factor, 1.0
    if method == "yarn":
        return yarn_frequencies(inv_freq, factor, head_dim, base, original_len), yarn_temperature(factor) ** 2
    if method == "yarn_paper":
        return yarn_paper_frequencies(inv_freq, factor, original_len), yarn_temperature(factor) ** 2
    return inv_freq, 1.0


def rope_frequencies(scaling: str, head_dim: int, seq_len: int, train_len: int, base: float, device=None,
                     trained: str = "none", original_len: int | None = None, trained_factor: float | None = None):
    """``(inv_freq, logit multiplier)`` of a forward of ``seq_len`` tokens: ``none``; ``ntk`` (base times
    ``s ** (d / (d - 2))``); ``pi`` (frequencies / s); ``yarn`` (the reference code's ramp, logits times
    ``(0.1 ln s + 1)^2``); ``yarn_paper`` (the paper's ramp, the same multiplier); ``dynamic:F`` (transformers'
    dynamic NTK with factor F); every scaling is ``none`` at ``seq_len <= train_len``.

    ``trained``: the scaling the model was fine-tuned with, from ``original_len`` to ``train_len`` with factor
    ``trained_factor`` (None: ``train_len / original_len``; ``none``: trained once, or fine-tuned with plain RoPE).
    At every length the model then uses that scaling's frequencies (and multiplier) for a model trained at
    ``original_len`` (static; dynamic's base follows the forward's length), and ``scaling`` acts on top of them
    beyond ``train_len``: ``ntk`` and ``dynamic`` change the base they start from, ``pi`` divides them by
    ``seq_len / train_len``, ``yarn`` and ``yarn_paper`` blend them with their ramp over ``train_len`` and multiply
    the multipliers."""
    method, factor = check_scaling(scaling)
    beyond = seq_len > train_len and method != "none"
    if trained != "none":
        if trained not in ROPE_SCALINGS:
            raise ValueError(f"trained_rope_scaling={trained!r} is not allowed: use one of {', '.join(ROPE_SCALINGS)}")
        start = base
        if beyond and method == "ntk":
            start = ntk_base(base, head_dim, seq_len, train_len)
        elif beyond and method == "dynamic":
            start = dynamic_base(base, head_dim, seq_len, train_len, factor)
        own = float(trained_factor) if trained_factor is not None else train_len / original_len
        inv_freq, multiplier = scaled_frequencies(trained, head_dim, start, original_len, own,
                                                  train_len if beyond else seq_len, device)
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
    return scaled_frequencies(method, head_dim, base, train_len, factor if method == "dynamic" else seq_len / train_len,
                              seq_len, device)


def rope_tables(scaling: str, seq_len: int, head_dim: int, train_len: int, base: float, device=None,
                trained: str = "none", original_len: int | None = None, trained_factor: float | None = None):
    """float32 cos and sin ``(seq_len, head_dim)`` (half-rotation layout), times ``sqrt(multiplier)``."""
    inv_freq, multiplier = rope_frequencies(scaling, head_dim, seq_len, train_len, base, device, trained,
                                            original_len, trained_factor)
    pos = torch.arange(seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(pos, inv_freq.to(device=device, dtype=torch.float64))
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if multiplier != 1.0:
        cos, sin = cos * math.sqrt(multiplier), sin * math.sqrt(multiplier)
    return cos.to(torch.float32), sin.to(torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


# --- the built-in variants (attnlab/attention/dense.py) -------------------------------------------------------------

def length_scale(spec: Spec, n: torch.Tensor, d: int):
    if spec.scale == "inv_sqrt_d":
        return 1.0 / math.sqrt(d)
    if spec.scale == "log_n":
        return torch.log(n) / math.sqrt(d)
    if spec.scale == "logd_logn":
        return math.log(d) * torch.log(n)
    return spec.coef * torch.log(n)  # coef*log_n


def normalise_qk(spec: Spec, q, k, qk_gain):
    """QK-norm: ``q / |q|``, or with a learned gain ``sqrt(d) * gain * q / |q|``; k alike."""
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    if spec.learned_qk_gain:
        d = q.shape[-1]
        gq, gk = (g.to(q.dtype) * math.sqrt(d) for g in qk_gain)
        gq, gk = (g.unsqueeze(-2) if g.dim() == 2 else g for g in (gq, gk))
        q, k = q * gq, k * gk
    return q, k


def phi(name: str, s: torch.Tensor) -> torch.Tensor:
    if name == "exp":
        return torch.exp(s.clamp(max=EXP_CLAMP))
    if name == "identity":
        return s
    if name == "relu":
        return F.relu(s)
    if name == "relu2":
        return F.relu(s) ** 2
    if name == "relu6":
        return F.relu6(s)
    if name == "gelu":
        return F.gelu(s)
    if name == "sigmoid":
        return torch.sigmoid(s)
    if name == "softplus":
        return F.softplus(s)
    if name == "mish":
        return F.mish(s)
    raise ValueError(f"attention phi={name!r} is unknown to this exported model")


def l1norm(x: torch.Tensor) -> torch.Tensor:
    total = x.abs().sum(dim=-1, keepdim=True)
    return x / total.clamp_min(torch.finfo(x.dtype).tiny)


def sharpen(a, n, rows, p):
    """``l1norm(relu(N_i A_ij - O_i) ** p)``; a row with no mass above rounding (256 ulps) keeps ``A``."""
    offset = (rows >= SHARPEN_EXEMPT_ROWS).to(a.dtype)
    x = F.relu(n * a - offset)
    row_max = x.amax(dim=-1, keepdim=True)
    has_mass = row_max > 256 * torch.finfo(a.dtype).eps
    if isinstance(p, torch.Tensor):
        p = p.to(a.dtype)
    x = (x / torch.where(has_mass, row_max, torch.ones_like(row_max))) ** p
    sharpened = x / x.sum(dim=-1, keepdim=True).clamp_min(1.0)
    return torch.where(has_mass, sharpened, a)


def builtin_weights(q, k, spec: Spec, row_start: int, seq_len: int, qk_gain=None, p=None) -> torch.Tensor:
    """Causal weights of query rows ``row_start ..`` over keys ``0 .. K - 1`` (compute dtype)."""
    dtype = q.dtype
    d = q.shape[-1]
    rows, visible = causal_rows(row_start, q.shape[-2], k.shape[-2], q.device)
    n = visible_keys(rows, dtype)
    if spec.qk_norm:
        q, k = normalise_qk(spec, q, k, qk_gain)
    s = length_scale(spec, n, d) * (q @ k.transpose(-1, -2))
    if spec.bias == "neg_log_t":
        s = s - math.log(seq_len)
    elif spec.bias == "neg_log_n":
        s = s - torch.log(n)
    if spec.position_bias == "alibi":
        n_head = q.shape[-3]
        heads = torch.arange(n_head, device=q.device).view(n_head, 1, 1)
        cols = torch.arange(k.shape[-2], device=q.device).unsqueeze(0)
        s = s + alibi_bias(heads, rows, cols, n_head, dtype)
    if spec.phi == "exp" and spec.norm == "l1":  # softmax
        a = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    else:
        a = torch.where(visible, phi(spec.phi, s), torch.zeros((), dtype=dtype, device=s.device))
        if spec.norm == "l1":
            a = l1norm(a)
        elif spec.norm == "count":
            a = a / n
    if spec.post == "negate":
        a = -a
    elif spec.post in ("recentre", "recentre_l1"):
        a = a - ((rows >= SHARPEN_EXEMPT_ROWS) & visible).to(dtype) / n
        if spec.post == "recentre_l1":
            a = l1norm(a)
    if spec.p is not None:
        a = sharpen(a, n, rows, spec.p if p is None else p)
    return a


# --- the row blocks (attnlab/attention/chunked.py) ------------------------------------------------------------------

def attend(q, k, v, spec: Spec, qk_gain=None, state=None, chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """Causal attention ``(B, H, T, D)`` in v's dtype: ``A @ v`` of blocks of query rows, computed in float32 (float64
    for float64 inputs), then the variant's output LayerNorm. ``state``: a plugin variant's layer state
    (``plugin_attnlab.PluginState``); its weights come from the plugin's reference."""
    T = q.shape[-2]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    temporaries = BUILTIN_TEMPORARIES if spec.plugin is None else PLUGIN_TEMPORARIES
    row_bytes = max(1, math.prod(q.shape[:-2]) * T * torch.finfo(dtype).bits // 8 * temporaries)
    chunk = max(1, min(T, chunk_bytes // row_bytes))
    p = None if spec.p is None else torch.tensor(spec.p, dtype=torch.float64, device=q.device)
    device_type = "cpu" if q.device.type == "meta" else q.device.type
    with torch.autocast(device_type=device_type, enabled=False):
        q, k, vv = q.to(dtype), k.to(dtype), v.to(dtype)
        outs = []
        for r0 in range(0, T, chunk):
            r1 = min(T, r0 + chunk)
            if spec.plugin is None:
                a = builtin_weights(q[..., r0:r1, :], k[..., :r1, :], spec, r0, T, qk_gain, p)
            else:
                a = spec.plugin.weights(q[..., r0:r1, :], k[..., :r1, :], spec, r0, T, state, p)
            outs.append(a @ vv[..., :r1, :])
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
        if spec.out_norm == "layernorm":
            out = F.layer_norm(out, out.shape[-1:])
    return out.to(v.dtype)
