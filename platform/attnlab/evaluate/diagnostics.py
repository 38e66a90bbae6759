"""Attention diagnostics per layer: mean row entropy and attention-sink mass (weight on the first token).

The model's ``on_attention`` hook hands over q and k after RoPE; the weights are recomputed with the dense
reference :func:`attnlab.attention.dense.weights_for_rows`, a block of query rows at a time, so a 16x window
never materialises the full ``T x T`` matrix. Definitions (per query row i, then averaged over rows, heads and
windows):

- ``w_i = |A_i| / sum_j |A_ij|`` (for l1-normalised non-negative variants, ``w_i = A_i``; variants with
  unnormalised or signed rows are measured on their normalised magnitudes);
- ``entropy = -sum_j w_ij ln w_ij`` (nats; row 0 has entropy 0, a uniform row ``ln(i + 1)``);
- ``sink_mass = w_i0``.

No Ray here; the weights of the model are only read.
"""

from __future__ import annotations

import numpy as np
import torch

from attnlab.attention.dense import weights_for_rows
from attnlab.model.scoring import autocast_context

DEFAULT_CHUNK_BYTES = 64 * 1024**2


def row_statistics(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(entropy, sink_mass)`` of each row of ``weights`` (..., R, K), as defined in the module docstring."""
    w = weights.abs()
    w = w / w.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)
    return torch.special.entr(w).sum(dim=-1), w[..., 0]


@torch.no_grad()
def attention_diagnostics(model, windows: np.ndarray, *, spec=None, rope_scaling: str = "none", device=None,
                          precision: str = "auto", chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[dict]:
    """Per layer ``{"layer", "entropy", "sink_mass", "n_tokens"}`` over the input positions of ``windows``
    ``(n, L + 1)`` (one window per forward), with attention ``spec`` (default: the trained one)."""
    device = device or next(model.parameters()).device
    spec = spec or model.spec
    sums: dict[int, list[float]] = {}

    def observe(layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        B, H, T, _ = q.shape
        rows = max(1, min(T, chunk_bytes // max(1, B * H * T * 4 * 4)))
        acc = sums.setdefault(layer, [0.0, 0.0, 0])
        for r0 in range(0, T, rows):
            r1 = min(T, r0 + rows)
            a = weights_for_rows(q[..., r0:r1, :], k[..., :r1, :], spec, row_start=r0, seq_len=T)
            entropy, sink = row_statistics(a)
            acc[0] += float(entropy.double().sum())
            acc[1] += float(sink.double().sum())
            acc[2] += entropy.numel() // H

    was_training = model.training
    model.eval()
    try:
        for window in np.asarray(windows, dtype=np.int64):
            x = torch.as_tensor(window[None, :-1], device=device)
            with autocast_context(torch.device(device), precision):
                model.hidden_states(x, rope_scaling=rope_scaling, attention=spec, on_attention=observe)
    finally:
        model.train(was_training)
    n_heads = model.cfg.n_head
    return [dict(layer=layer, entropy=s[0] / (s[2] * n_heads), sink_mass=s[1] / (s[2] * n_heads), n_tokens=s[2])
            for layer, s in sorted(sums.items())]
