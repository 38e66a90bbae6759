"""Scoring token windows with a model: the one function that training's validation and ``attnlab eval``
share, so the two agree exactly on the same windows. No Ray here.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch


def autocast_context(device: torch.device, precision: str):
    """bf16 autocast on CUDA when precision is ``bf16``/``auto``; nothing on CPU or for ``fp32``."""
    if device.type == "cuda" and precision in ("bf16", "auto"):
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def window_token_stats(model, windows: np.ndarray, *, batch_size: int = 8, device=None, precision: str = "auto",
                       **forward_kwargs):
    """Yield ``(first_row, token_loss (b, L), token_correct (b, L), distance (b, L) or None)`` for batches of
    windows ``(n, L + 1)`` (or ``(n, L + 1, C)`` coordinate tokens).

    Each window's first L tokens are the input and its last L the targets. ``forward_kwargs`` go to the model
    (``rope_scaling``, ``attention`` for p_eval, ``impl``, ``on_attention``). ``distance``: for models of
    coordinate tokens (``coord_stats``, :class:`attnlab.model.orbit.OrbitGPT`) how far the predicted bins are from
    the target bins (in bins); None for text models.
    """
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for r0 in range(0, len(windows), batch_size):
            chunk = torch.as_tensor(np.asarray(windows[r0:r0 + batch_size], dtype=np.int64), device=device)
            distance = None
            with autocast_context(device, precision):
                if hasattr(model, "coord_stats"):
                    loss, correct, distance = model.coord_stats(chunk[:, :-1], chunk[:, 1:], **forward_kwargs)
                    distance = distance.float().cpu()
                else:
                    loss, correct = model.token_stats(chunk[:, :-1], chunk[:, 1:], **forward_kwargs)
            yield r0, loss.float().cpu(), correct.cpu(), distance
    finally:
        model.train(was_training)


def mean_window_loss(model, windows: np.ndarray, target_mask: np.ndarray | None = None,
                     **kwargs) -> tuple[float, int, int]:
    """``(sum of token losses, number of scored tokens, number of correct argmax predictions)`` over all
    windows, counting only positions where ``target_mask`` is true when given (sums, so ranks can all-reduce)."""
    total, count, correct = 0.0, 0, 0
    for r0, loss, right, _ in window_token_stats(model, windows, **kwargs):
        if target_mask is not None:
            keep = torch.as_tensor(np.asarray(target_mask[r0:r0 + len(loss)], dtype=bool))
            loss, right = loss[keep], right[keep]
        total += float(loss.double().sum())
        count += loss.numel()
        correct += int(right.sum())
    return total, count, correct
