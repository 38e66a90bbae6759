"""Rotary position embeddings (RoPE) and their scalings beyond the training length, at evaluation or in training.

Owns what every RoPE scaling of :data:`attnlab.names.ROPE_SCALINGS` (``none``, ``ntk``, ``pi``, ``yarn`` as its
reference code computes it, ``yarn_paper`` as the paper's equation reads, ``dynamic``) gives a forward of ``L``
tokens by a model trained at ``L_train``: the inverse frequencies and the logit multiplier
(:func:`rope_frequencies`), and the cos/sin tables with ``sqrt(multiplier)`` folded into both (:func:`rope_tables`),
so every attention variant and backend sees the multiplied logits. One function serves evaluation and training: a
stage's scaling in training (:class:`TrainedScaling`) is static at every length (``dynamic`` excepted), and an
evaluation-time scaling beyond the stage's length applies on top of it, relative to that length. At ``L <=
L_train`` every scaling is ``none``.

A change to what a scaling's name computes must raise its version in :data:`attnlab.names.ROPE_SEMANTICS`, so a
run or a row of the older meaning is never found as one of the new. It must never import Ray or attention math.

Details: docs/protocol.md#rope-scalings (the formulas and their sources), docs/protocol.md#rope-scaling-in-training,
docs/protocol.md#yarn (the two ramps compared); tests/test_rope_reference.py holds them to transformers'.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from attnlab.names import ROPE_SCALINGS, check_scaling

# YaRN's ramp bounds for Llama-family models (Peng et al. 2023, section 3.2; the reference code's beta_slow and
# beta_fast): alpha = 1, beta = 32 rotations over the original length.
YARN_ALPHA = 1.0
YARN_BETA = 32.0

def ntk_base(base: float, head_dim: int, seq_len: int, train_len: int) -> float:
    """The RoPE base for a forward pass of ``seq_len`` tokens by a model trained at ``train_len``."""
    if seq_len <= train_len:
        return base
    return base * (seq_len / train_len) ** (head_dim / (head_dim - 2))


def dynamic_base(base: float, head_dim: int, seq_len: int, train_len: int, factor: float) -> float:
    """Dynamic NTK's base (transformers' ``_compute_dynamic_ntk_parameters``) for a forward of ``seq_len`` tokens by
    a model trained at ``train_len``: ``base * (f L / L_train - (f - 1)) ** (d / (d - 2))``, ``L`` at least
    ``L_train`` (the trained base up to it)."""
    length = max(seq_len, train_len)
    return base * (factor * length / train_len - (factor - 1)) ** (head_dim / (head_dim - 2))


def inverse_frequencies(base: float, head_dim: int, device=None) -> torch.Tensor:
    """``base^(-2m/d)``, ``m = 0 .. d/2 - 1``, float64."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))


def yarn_temperature(scale: float) -> float:
    """YaRN's ``sqrt(1/t) = 0.1 ln(s) + 1`` (1 for ``s <= 1``): the reference's ``get_mscale``, transformers'
    ``attention_factor``."""
    return 0.1 * math.log(scale) + 1.0 if scale > 1 else 1.0


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


def _correction_pair(rotations: float, head_dim: int, base: float, original_len: int) -> float:
    """The (fractional) pair index whose wavelength turns ``rotations`` times over ``original_len``: the
    reference's ``find_correction_dim``."""
    return head_dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))


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


def yarn_frequencies(inv_freq: torch.Tensor, s: float, head_dim: int, base: float, original_len: int) -> torch.Tensor:
    """YaRN's frequencies as its reference code computes them: ``theta / s`` blended with ``theta`` by
    :func:`yarn_keep` (over ``original_len``, the length the frequencies were trained at)."""
    keep = yarn_keep(head_dim, base, original_len, inv_freq.device)
    return inv_freq / s * (1 - keep) + inv_freq * keep


def yarn_paper_frequencies(inv_freq: torch.Tensor, s: float, original_len: int) -> torch.Tensor:
    """The paper's equation (``yarn_paper``): gamma = 0 (interpolate, theta / s) for wavelengths longer than
    L / alpha, 1 (keep) for those shorter than L / beta, linear in r = L / lambda in between (L = ``original_len``)."""
    ratio = original_len * inv_freq / (2 * math.pi)
    gamma = ((ratio - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0.0, 1.0)
    return (1 - gamma) * inv_freq / s + gamma * inv_freq


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


def scaled_rope_tables(scaling, seq_len: int, head_dim: int, train_len: int, base: float, device=None,
                       dtype=torch.float32, trained: TrainedScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables of one forward: :func:`rope_frequencies` then :func:`rope_tables`."""
    inv_freq, multiplier = rope_frequencies(scaling, head_dim, seq_len, train_len, base, device=device,
                                            trained=trained)
    return rope_tables(seq_len, head_dim, base, device, dtype, inv_freq=inv_freq, multiplier=multiplier)


def forward_key(scaling, base: float, head_dim: int, seq_len: int, train_len: int,
                position: str = "rope", trained: TrainedScaling | None = None) -> tuple:
    """What a forward's positions depend on, hashable: two settings with equal keys compute the same forward
    (every scaling equals ``none`` at ``L <= L_train``; a model without RoPE ignores the scaling)."""
    rope = check_scaling(scaling)
    if position != "rope":
        return (position,)
    beyond = seq_len > train_len and rope.method != "none"
    if trained is not None and trained.method != "none":
        tag = ("trained", trained.method, int(trained.original_len), trained.scale(train_len), int(train_len),
               float(base))
        if trained.method == "dynamic" and not beyond:  # its base follows the forward's length
            tag = (*tag, dynamic_base(base, head_dim, seq_len, trained.original_len, trained.scale(train_len)))
        return tag if not beyond else (*tag, rope.label, seq_len)
    if not beyond:
        return ("rope", float(base), 1.0)
    if rope.method == "ntk":
        return ("rope", ntk_base(base, head_dim, seq_len, train_len), 1.0)
    if rope.method == "dynamic":
        return ("rope", dynamic_base(base, head_dim, seq_len, train_len, rope.factor), 1.0)
    return (rope.method, float(base), seq_len, train_len)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(B, H, T, D)``; the rotation keeps each vector's norm (times ``sqrt(multiplier)``
    for tables made with one)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
