"""Rotary position embeddings (RoPE) with NTK-aware scaling for lengths beyond the training length.

docs/protocol.md#ntk-aware-scaling (and docs/choices.md#ntk-formula): base 10000; at evaluation length ``L > L_train`` NTK-aware scaling sets the base to
``base * (L / L_train) ** (d / (d - 2))`` (inferred formula), for every variant alike; ``none`` keeps the base.
No Ray, no attention math here.
"""

from __future__ import annotations

import torch

from attnlab.names import ROPE_SCALINGS


def ntk_base(base: float, head_dim: int, seq_len: int, train_len: int) -> float:
    """The RoPE base for a forward pass of ``seq_len`` tokens by a model trained at ``train_len``."""
    if seq_len <= train_len:
        return base
    return base * (seq_len / train_len) ** (head_dim / (head_dim - 2))


def rope_base(scaling: str, base: float, head_dim: int, seq_len: int, train_len: int) -> float:
    if scaling not in ROPE_SCALINGS:
        raise ValueError(f"rope_scaling={scaling!r} is not allowed: use one of {', '.join(ROPE_SCALINGS)}")
    return ntk_base(base, head_dim, seq_len, train_len) if scaling == "ntk" else base


def rope_tables(seq_len: int, head_dim: int, base: float, device=None,
                dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``(seq_len, head_dim)`` for positions ``0 .. seq_len - 1`` (half-rotation layout)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
    pos = torch.arange(seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(pos, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(B, H, T, D)``; the rotation keeps each vector's norm."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
