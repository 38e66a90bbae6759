"""Attention diagnostics per layer: mean row entropy and attention-sink mass (weight on the first token).

Owns the diagnostics of an evaluated model: :func:`attention_diagnostics` (entropy and sink mass per layer,
averaged over rows, heads and windows; :func:`row_statistics` per row) and :func:`offset_profile` (where the mass
lands, by how far back the key is, per layer and head, on chosen query rows). The model's ``on_attention`` hook
hands over q and k after RoPE (and a plugin layer's state); the weights are recomputed with the dense reference
(:func:`attnlab.attention.weights_for_rows`, a plugin's own reference form) a block of query rows at a time, so a
16x window never materialises the full ``T x T`` matrix. Unnormalised or signed rows are measured on their
normalised magnitudes.

It must never change the model (its weights are only read) or import Ray.

Details: docs/protocol.md#attention-diagnostics (the definitions),
docs/choices.md#diagnostics-on-normalised-magnitudes.
"""

from __future__ import annotations

import numpy as np
import torch

from attnlab.attention import weights_for_rows
from attnlab.model.scoring import autocast_context

DEFAULT_CHUNK_BYTES = 64 * 1024**2


def row_statistics(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(entropy, sink_mass)`` of each row of ``weights`` (..., R, K), as docs/protocol.md#attention-diagnostics
    defines them."""
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

    def observe(layer: int, q: torch.Tensor, k: torch.Tensor, qk_gain=None, state=None) -> None:
        B, H, T, _ = q.shape
        rows = max(1, min(T, chunk_bytes // max(1, B * H * T * 4 * 4)))
        acc = sums.setdefault(layer, [0.0, 0.0, 0])
        for r0 in range(0, T, rows):
            r1 = min(T, r0 + rows)
            a = weights_for_rows(q[..., r0:r1, :], k[..., :r1, :], spec, row_start=r0, seq_len=T, qk_gain=qk_gain,
                                 state=state)
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


def _rows_mask(mask: np.ndarray | None, n: int, length: int) -> np.ndarray:
    if mask is None:
        return np.ones((n, length), dtype=bool)
    mask = np.asarray(mask, dtype=bool)
    if mask.shape != (n, length):
        raise ValueError(f"rows mask has shape {mask.shape}; expected {(n, length)} (windows x input positions)")
    return mask


@torch.no_grad()
def offset_profile(model, windows: np.ndarray, rows: np.ndarray | None = None, *, max_offset: int | None = None,
                   spec=None, rope_scaling: str = "none", device=None, precision: str = "auto",
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[dict]:
    """Where attention lands, by how far back the key is, per layer and head, on the query rows ``rows``.

    ``windows`` ``(n, L + 1)`` (one window per forward, input = the first L tokens); ``rows`` ``(n, L)`` bool,
    the query positions to average over (default all; for a probe, its target mask). ``max_offset`` defaults to
    the model's training length. Returns one dict per (layer, head): ``layer``, ``head``, ``profile`` (float64
    array of ``max_offset``: mean normalised weight ``d`` keys back, 0 where a row has no such key), ``beyond``
    (mean mass ``max_offset`` or more back), ``top`` (array of ``max_offset``: fraction of rows whose largest
    weight is ``d`` back) and ``top_beyond`` (the fraction whose largest weight is farther), ``sink_mass``
    (key 0), ``entropy`` (nats) and ``n_rows``. Weights are normalised magnitudes, as in :func:`row_statistics`,
    so ``sum(profile) + beyond = 1``.

    On the copy probe (``copy_distractors``, copy distance ``D``) the key holding the token to copy is ``D - 1``
    back from each scored row, and with ``max_offset`` the training length ``beyond`` is the mass on keys farther
    back than training ever showed (the distractors met only at evaluation). ``top`` tells more than ``profile``
    there: a row can keep its largest weight on the copy source while most of its mass is spread over distractors.
    """
    device = device or next(model.parameters()).device
    spec = spec or model.spec
    windows = np.asarray(windows, dtype=np.int64)
    length = windows.shape[1] - 1
    rows = _rows_mask(rows, len(windows), length)
    max_offset = int(max_offset or model.cfg.train_len)
    sums: dict[int, dict] = {}
    current: dict = {}

    def observe(layer: int, q: torch.Tensor, k: torch.Tensor, qk_gain=None, state=None) -> None:
        B, H, T, _ = q.shape
        wanted = torch.as_tensor(np.nonzero(current["rows"])[0], device=q.device)
        if len(wanted) == 0:
            return
        acc = sums.setdefault(layer, dict(profile=torch.zeros(H, max_offset, dtype=torch.float64),
                                          total=torch.zeros(H, dtype=torch.float64),
                                          top=torch.zeros(H, max_offset + 1, dtype=torch.float64),
                                          sink=torch.zeros(H, dtype=torch.float64),
                                          entropy=torch.zeros(H, dtype=torch.float64), n=0))
        step = max(1, min(T, chunk_bytes // max(1, B * H * T * 4 * 4)))
        offsets = torch.arange(max_offset, device=q.device)
        for r0 in range(0, T, step):
            r1 = min(T, r0 + step)
            inside = wanted[(wanted >= r0) & (wanted < r1)]
            if len(inside) == 0:
                continue
            a = weights_for_rows(q[..., r0:r1, :], k[..., :r1, :], spec, row_start=r0, seq_len=T,
                                 qk_gain=qk_gain, state=state)[0]  # (H, R, r1)
            a = a[:, inside - r0, :]
            w = a.abs()
            w = w / w.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)
            keys = inside[:, None] - offsets[None, :]  # (R', max_offset): the key d back from each row
            present = (keys >= 0).to(w.dtype)
            picked = torch.gather(w, -1, keys.clamp_min(0).expand(H, -1, -1)) * present
            acc["profile"] += picked.double().sum(dim=1).cpu()
            acc["total"] += w.double().sum(dim=(1, 2)).cpu()
            acc["sink"] += w[..., 0].double().sum(dim=1).cpu()
            acc["entropy"] += torch.special.entr(w).sum(dim=-1).double().sum(dim=1).cpu()
            top = (inside[None, :] - w.argmax(dim=-1)).clamp_max(max_offset)  # (H, R'); max_offset = beyond
            acc["top"] += torch.nn.functional.one_hot(top, max_offset + 1).double().sum(dim=1).cpu()
        acc["n"] += int(len(wanted))

    was_training = model.training
    model.eval()
    try:
        for window, row_mask in zip(windows, rows):
            current["rows"] = row_mask
            x = torch.as_tensor(window[None, :-1], device=device)
            with autocast_context(torch.device(device), precision):
                model.hidden_states(x, rope_scaling=rope_scaling, attention=spec, on_attention=observe)
    finally:
        model.train(was_training)
    out = []
    for layer, acc in sorted(sums.items()):
        n = max(1, acc["n"])
        for head in range(acc["profile"].shape[0]):
            profile = (acc["profile"][head] / n).numpy()
            top = (acc["top"][head] / n).numpy()
            out.append(dict(layer=layer, head=head, profile=profile,
                            beyond=float(acc["total"][head] / n) - float(profile.sum()),
                            top=top[:max_offset], top_beyond=float(top[max_offset]),
                            sink_mass=float(acc["sink"][head] / n), entropy=float(acc["entropy"][head] / n),
                            n_rows=acc["n"]))
    return out
