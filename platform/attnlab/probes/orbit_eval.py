"""Orbit prediction error at 1x..16x the training length, as results rows: the orbit study's extrapolation
table.

What it is for: score an :class:`attnlab.model.orbit.OrbitGPT` on the orbit source's validation windows at each
evaluation length (longer windows = more observed steps of the same kind of system), for each RoPE scaling and
evaluation-time sharpening power, like the text studies' ``val_loss`` rows. Metrics per (length, rope, p_eval):

- ``val_loss``: mean over every target token of the mean per-coordinate cross-entropy (nats);
- ``acc``: the fraction of tokens whose argmax bins are right in both coordinates;
- ``coord_bin_err``: mean Euclidean distance between the argmax bins and the target bins (bins);
- ``coord_err_au``: the same in AU (bins x the source's ``bin_width``);
- ``loss_bucket`` and ``coord_err_au`` with ``bucket`` early / middle / late: the thirds of the window positions
  (the late third of a 16x window is far past anything seen in training).

Every length scores the first ``min(n_val_systems, max_tokens // L)`` validation systems (``max_tokens``
defaults to the largest length times 64). No Ray; it must never modify the model's weights.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from attnlab.errors import UserError

BUCKETS = ("early", "middle", "late")
ORBIT_METRICS: dict[str, tuple[bool, str]] = {
    "coord_bin_err": (False, "orbit tokens: mean distance between the argmax (x, y) bins and the target bins (bins)"),
    "coord_err_au": (False, "orbit tokens: mean distance between the argmax bin centres and the target's (AU)"),
}


def register_orbit_metrics() -> None:
    """Add :data:`ORBIT_METRICS` to the results schema's registry (idempotent)."""
    from attnlab.results.schema import register_metric

    for name, (higher, doc) in ORBIT_METRICS.items():
        register_metric(name, higher, doc)


def _thirds(length: int) -> list[tuple[str, int, int]]:
    cuts = [0, length // 3, 2 * length // 3, length]
    return [(name, cuts[i], cuts[i + 1]) for i, name in enumerate(BUCKETS)]


@torch.no_grad()
def orbit_scores(model, windows: np.ndarray, *, bin_width: float, batch_size: int = 8, device=None,
                 **forward_kwargs) -> dict:
    """Sums over windows ``(n, L + 1, 2)`` -> ``{val_loss, acc, coord_bin_err, coord_err_au, n_tokens,
    buckets: {name: {loss, coord_err_au, n_tokens}}}`` (means over all target tokens)."""
    windows = np.asarray(windows, dtype=np.int64)
    if windows.ndim != 3 or windows.shape[-1] != 2:
        raise UserError(f"orbit windows must be (n, L + 1, 2), got shape {windows.shape}")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    L = windows.shape[1] - 1
    loss_sum = correct = dist_sum = 0.0
    parts = {name: [0.0, 0.0, 0] for name in BUCKETS}
    was_training = model.training
    model.eval()
    try:
        for r0 in range(0, len(windows), batch_size):
            chunk = torch.as_tensor(windows[r0:r0 + batch_size], device=device)
            ctx = (torch.autocast(device_type="cuda", dtype=torch.bfloat16) if device.type == "cuda"
                   else contextlib.nullcontext())
            with ctx:
                loss, right, dist = model.coord_stats(chunk[:, :-1], chunk[:, 1:], **forward_kwargs)
            loss, dist = loss.double().cpu(), dist.double().cpu()
            loss_sum += float(loss.sum())
            correct += float(right.sum())
            dist_sum += float(dist.sum())
            for name, a, b in _thirds(L):
                parts[name][0] += float(loss[:, a:b].sum())
                parts[name][1] += float(dist[:, a:b].sum())
                parts[name][2] += loss[:, a:b].numel()
    finally:
        model.train(was_training)
    n = len(windows) * L
    return {
        "val_loss": loss_sum / n, "acc": correct / n, "coord_bin_err": dist_sum / n,
        "coord_err_au": dist_sum / n * bin_width, "n_tokens": n,
        "buckets": {name: {"loss": s[0] / s[2], "coord_err_au": s[1] / s[2] * bin_width, "n_tokens": s[2]}
                    for name, s in parts.items() if s[2]},
    }


def orbit_length_rows(model, source, *, base_row: dict, lengths=None, multiples=(1, 2, 4, 8, 16),
                      rope_scalings=("ntk",), p_evals=(None,), max_tokens: int | None = None, seed: int = 0,
                      batch_size: int | None = None, device=None) -> list[dict]:
    """Rows (``base_row`` + ``eval_len``, ``rope_scaling``, ``p_eval``, ``window_mode="nonoverlap"``, ``metric``,
    ``value``, ``n_tokens``, ``bucket``) of :func:`orbit_scores` at each length (default: ``multiples`` x the
    model's training length). ``p_evals``: None = the attention as trained, a number = that sharpening power
    at evaluation."""
    register_orbit_metrics()
    train_len = int(model.cfg.train_len)
    lengths = sorted({int(m) * train_len for m in multiples} if lengths is None else {int(x) for x in lengths})
    if not lengths or lengths[0] < 1:
        raise UserError(f"lengths={lengths!r} is not allowed: use positive integers")
    max_tokens = max_tokens or 64 * lengths[-1]
    rows: list[dict] = []
    for length in lengths:
        windows, _ = source.eval_set(length, max_tokens=max_tokens, seed=seed)
        batch = batch_size or max(1, 8 * train_len // length)
        for rope in rope_scalings:
            for p in p_evals:
                spec = model.cfg.attention_spec(p="train" if p is None else p)
                s = orbit_scores(model, windows, bin_width=source.bin_width, batch_size=batch, device=device,
                                 rope_scaling=rope, attention=spec)

                cell = dict(base_row, eval_len=length, rope_scaling=rope, p_eval=p, window_mode="nonoverlap")
                for metric in ("val_loss", "acc", "coord_bin_err", "coord_err_au"):
                    rows.append(_row(cell, metric, s[metric], s["n_tokens"]))
                for name, b in s["buckets"].items():
                    rows.append(_row(cell, "loss_bucket", b["loss"], b["n_tokens"], name))
                    rows.append(_row(cell, "coord_err_au", b["coord_err_au"], b["n_tokens"], name))
    return rows


def _row(cell: dict, metric: str, value: float, n_tokens: int, bucket: str | None = None) -> dict:
    row = dict(cell, metric=metric, value=float(value), n_tokens=int(n_tokens))
    if bucket is not None:
        row["bucket"] = bucket
    return row


__all__ = ["ORBIT_METRICS", "orbit_length_rows", "orbit_scores", "register_orbit_metrics"]
