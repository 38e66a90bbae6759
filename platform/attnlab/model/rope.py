"""Rotary position embeddings (RoPE) and their extensions beyond the training length, at evaluation or in training.

docs/protocol.md#rope and #rope-scalings: base 10000, ``inv_freq_m = base^(-2m/d)``. At an evaluation
length ``L > L_train`` (``s = L / L_train``) the RoPE scalings (:data:`attnlab.names.ROPE_SCALINGS`) change it:

- ``none``: the trained frequencies;
- ``ntk`` (docs/protocol.md#ntk-aware-scaling, docs/choices.md#ntk-formula): the base becomes
  ``base * s ** (d / (d - 2))`` (inferred formula);
- ``pi`` (docs/protocol.md#position-interpolation; Chen et al. 2023, arXiv 2306.15595): positions scaled by
  ``1 / s``, i.e. every frequency divided by ``s``;
- ``yarn`` (docs/protocol.md#yarn; Peng et al. 2023, arXiv 2309.00071): NTK-by-parts
  interpolation with the ramp ``alpha = 1``, ``beta = 32`` over ``r_m = L_train / lambda_m`` (wavelength
  ``lambda_m = 2 pi / inv_freq_m``), and the attention logits multiplied by ``(0.1 ln s + 1)^2``.

At ``L <= L_train`` every scaling is ``none``.

**In training** (a context-extension stage, docs/stages.md): a model fine-tuned at ``L_new`` from a parent trained
at ``L_original`` with scaling ``m`` uses, at every length, the frequencies (and YaRN's multiplier) that the formulas
above give for a forward of ``L_new`` tokens by a model trained at ``L_original``: the static scaling with factor
``s = L_new / L_original``, as YaRN's and PI's fine-tunes use it (:class:`TrainedScaling`). It is what such a
model is evaluated with "as trained" (evaluation ``none``). An evaluation-time scaling beyond ``L_new`` is applied
on top of it, relative to ``L_new``: ``ntk`` changes the base the trained scaling starts from, ``pi`` divides the
trained frequencies by ``L / L_new``, ``yarn`` ramps them over ``r = L_new / lambda`` and multiplies the logits
again. One function serves training and evaluation.

:func:`rope_frequencies` gives the inverse frequencies and the
logit multiplier of one forward; :func:`rope_tables` turns them into the cos/sin tables, with
``sqrt(multiplier)`` folded into both (so ``q . k`` after RoPE carries the multiplier for every attention
variant and backend, as YaRN's reference code and transformers' ``attention_factor`` do).
No Ray, no attention math here.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from attnlab.names import ROPE_SCALINGS

# YaRN's ramp bounds for Llama-family models (Peng et al. 2023, section 3.2): alpha = 1, beta = 32 rotations.
YARN_ALPHA = 1.0
YARN_BETA = 32.0


def ntk_base(base: float, head_dim: int, seq_len: int, train_len: int) -> float:
    """The RoPE base for a forward pass of ``seq_len`` tokens by a model trained at ``train_len``."""
    if seq_len <= train_len:
        return base
    return base * (seq_len / train_len) ** (head_dim / (head_dim - 2))


def check_scaling(scaling: str) -> str:
    if scaling not in ROPE_SCALINGS:
        raise ValueError(f"rope_scaling={scaling!r} is not allowed: use one of {', '.join(ROPE_SCALINGS)}")
    return scaling


def rope_base(scaling: str, base: float, head_dim: int, seq_len: int, train_len: int) -> float:
    """The base of the frequencies: NTK's for ``ntk`` (beyond ``train_len``), the trained one otherwise (``pi``
    and ``yarn`` keep the base and change the frequencies: :func:`rope_frequencies`)."""
    check_scaling(scaling)
    return ntk_base(base, head_dim, seq_len, train_len) if scaling == "ntk" else base


def inverse_frequencies(base: float, head_dim: int, device=None) -> torch.Tensor:
    """``base^(-2m/d)``, ``m = 0 .. d/2 - 1``, float64."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))


def yarn_temperature(scale: float) -> float:
    """YaRN's ``sqrt(1/t) = 0.1 ln(s) + 1`` (1 for ``s <= 1``)."""
    return 0.1 * math.log(scale) + 1.0 if scale > 1 else 1.0


class TrainedScaling(NamedTuple):
    """The RoPE scaling a model was fine-tuned with: ``method`` (pi, ntk, yarn) from ``original_len`` to the model's
    ``train_len`` (module docstring). ``none`` is no scaling: the plain frequencies at the new length."""

    method: str
    original_len: int


def _yarn(inv_freq: torch.Tensor, s: float, train_len: int) -> torch.Tensor:
    """YaRN's NTK-by-parts frequencies: gamma = 0 (interpolate, theta / s) for wavelengths longer than
    L_train / alpha, 1 (keep) for those shorter than L_train / beta, linear in r = L_train / lambda in between."""
    ratio = train_len * inv_freq / (2 * math.pi)
    gamma = ((ratio - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0.0, 1.0)
    return (1 - gamma) * inv_freq / s + gamma * inv_freq


def rope_frequencies(scaling: str, head_dim: int, seq_len: int, train_len: int, base: float = 10000.0,
                     device=None, trained: TrainedScaling | None = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq (d/2,) float64, logit multiplier)`` of a forward of ``seq_len`` tokens by a model trained at
    ``train_len`` with RoPE ``base`` and the ``scaling`` asked for (module docstring). The multiplier is 1
    except for ``yarn`` beyond the training length: ``(0.1 ln s + 1)^2``, applied to ``q . k``. ``trained``: the
    scaling the model was fine-tuned with (to ``train_len`` from ``trained.original_len``), applied at every length,
    ``scaling`` then acting beyond ``train_len`` on top of it."""
    check_scaling(scaling)
    if trained is not None and trained.method != "none":
        check_scaling(trained.method)
        beyond = seq_len > train_len and scaling != "none"
        start = ntk_base(base, head_dim, seq_len, train_len) if beyond and scaling == "ntk" else base
        # the fine-tune's own frequencies: the formula at L_new for a model trained at L_original (static)
        inv_freq, multiplier = rope_frequencies(trained.method, head_dim, train_len, trained.original_len, start,
                                                device=device)
        if not beyond or scaling == "ntk":
            return inv_freq, multiplier
        s = seq_len / train_len
        if scaling == "pi":
            return inv_freq / s, multiplier
        return _yarn(inv_freq, s, train_len), multiplier * yarn_temperature(s) ** 2
    if scaling == "ntk":
        return inverse_frequencies(ntk_base(base, head_dim, seq_len, train_len), head_dim, device), 1.0
    inv_freq = inverse_frequencies(base, head_dim, device)
    if scaling == "none" or seq_len <= train_len:
        return inv_freq, 1.0
    s = seq_len / train_len
    if scaling == "pi":
        return inv_freq / s, 1.0
    return _yarn(inv_freq, s, train_len), yarn_temperature(s) ** 2


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


def scaled_rope_tables(scaling: str, seq_len: int, head_dim: int, train_len: int, base: float, device=None,
                       dtype=torch.float32, trained: TrainedScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables of one forward: :func:`rope_frequencies` then :func:`rope_tables`."""
    inv_freq, multiplier = rope_frequencies(scaling, head_dim, seq_len, train_len, base, device=device,
                                            trained=trained)
    return rope_tables(seq_len, head_dim, base, device, dtype, inv_freq=inv_freq, multiplier=multiplier)


def forward_key(scaling: str, base: float, head_dim: int, seq_len: int, train_len: int,
                position: str = "rope", trained: TrainedScaling | None = None) -> tuple:
    """What a forward's positions depend on, hashable: two settings with equal keys compute the same forward
    (every scaling equals ``none`` at ``L <= L_train``; a model without RoPE ignores the scaling)."""
    check_scaling(scaling)
    if position != "rope":
        return (position,)
    if trained is not None and trained.method != "none":
        tag = ("trained", trained.method, int(trained.original_len), int(train_len), float(base))
        return tag if seq_len <= train_len or scaling == "none" else (*tag, scaling, seq_len)
    if seq_len <= train_len or scaling == "none":
        return ("rope", float(base), 1.0)
    if scaling == "ntk":
        return ("rope", ntk_base(base, head_dim, seq_len, train_len), 1.0)
    return (scaling, float(base), seq_len, train_len)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(B, H, T, D)``; the rotation keeps each vector's norm (times ``sqrt(multiplier)``
    for tables made with one)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
