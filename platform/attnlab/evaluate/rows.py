"""Turning measured scores into results-store rows: one function per cell kind, nothing else.

Every row of a cell carries the checkpoint's identity (``base``: study, trial, attention, scale, p_train, step,
tokens, train_len, seed, config_hash = the training run's key, git_sha, preset, data, ...), the cell's own
settings (p_eval, rope_scaling, eval_len, window_mode) and the cell's key (``eval_key``). Metrics:

- windows: ``val_loss`` (mean cross-entropy over the scored tokens, nats), ``acc`` (probes with target masks),
  ``bpb`` (GPT-2 text), ``loss_bucket`` per early / middle / late third of the window positions;
- passkey: ``passkey_acc`` per depth and over all depths, ``passkey_rank`` over all depths;
- diagnostics: ``entropy`` and ``sink_mass`` per layer.

No Ray, no torch, no store access here.
"""

from __future__ import annotations

from attnlab.evaluate.measure import BUCKETS, WindowScores, bits_per_byte
from attnlab.evaluate.plan import EvalCell


def _row(base: dict, cell: EvalCell, eval_key: str, *, metric: str, value: float, n_tokens: int, bucket=None,
         layer=None) -> dict:
    row = dict(base)
    row.update(p_eval=cell.p_eval, rope_scaling=cell.rope, eval_len=int(cell.length), window_mode=cell.window_mode,
               metric=metric, value=float(value), n_tokens=int(n_tokens), eval_key=eval_key)
    if bucket is not None:
        row["bucket"] = bucket
    if layer is not None:
        row["layer"] = int(layer)
    return row


def window_rows(base: dict, cell: EvalCell, eval_key: str, s: WindowScores, gpt2_text: bool) -> list[dict]:
    rows = [_row(base, cell, eval_key, metric="val_loss", value=s.loss, n_tokens=s.count)]
    if s.masked:
        rows.append(_row(base, cell, eval_key, metric="acc", value=s.acc, n_tokens=s.count))
    if gpt2_text:
        rows.append(_row(base, cell, eval_key, metric="bpb", value=bits_per_byte(s.total, s.n_bytes),
                         n_tokens=s.count))
    for i, name in enumerate(BUCKETS):
        if s.bucket_count[i]:
            rows.append(_row(base, cell, eval_key, metric="loss_bucket", value=s.bucket_total[i] / s.bucket_count[i],
                             n_tokens=s.bucket_count[i], bucket=name))
    return rows


def passkey_rows(base: dict, cell: EvalCell, eval_key: str, records: list[dict]) -> list[dict]:
    rows = []
    for record in records:
        bucket = None if record["depth"] is None else f"depth={record['depth']:g}"
        rows.append(_row(base, cell, eval_key, metric=record["metric"], value=record["value"],
                         n_tokens=record["n_prompts"] * cell.length, bucket=bucket))
    return rows


def diagnostic_rows(base: dict, cell: EvalCell, eval_key: str, layers: list[dict]) -> list[dict]:
    return [_row(base, cell, eval_key, metric=metric, value=stats[metric], n_tokens=stats["n_tokens"],
                 layer=stats["layer"])
            for stats in layers for metric in ("entropy", "sink_mass")]


def rows_for(base: dict, cell: EvalCell, eval_key: str, scores, gpt2_text: bool = False) -> list[dict]:
    """The rows of one measured cell."""
    if cell.kind == "windows":
        return window_rows(base, cell, eval_key, scores, gpt2_text)
    if cell.kind == "passkey":
        return passkey_rows(base, cell, eval_key, scores)
    return diagnostic_rows(base, cell, eval_key, scores)


def nan_rows(base: dict, cell: EvalCell, eval_key: str) -> list[dict]:
    """A diverged training run's cell: NaN ``val_loss`` (tables show it, and the cell is not retried)."""
    return [_row(base, cell, eval_key, metric="val_loss", value=float("nan"), n_tokens=0)]
