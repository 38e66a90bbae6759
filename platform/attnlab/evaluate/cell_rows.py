"""Turning measured scores into results-store rows: one function per cell kind, nothing else.

Every row of a cell carries the checkpoint's identity (``base``: study, trial, attention, scale, p_train, step,
tokens, train_len, seed, train_key = the training run's key, git_sha, preset, data, and for a run with a stopping
rule ``stopped`` (reached / cap) and ``stop_rule``; ``step`` is then the step training stopped at), the cell's own
settings (p_eval, rope_scaling, eval_len, window_mode) and the cell's key (``eval_key``). Metrics:

- windows: ``val_loss`` (mean cross-entropy over the scored tokens, nats), ``acc`` (probes with target masks,
  and coordinate tokens), ``bpb`` (GPT-2 text), ``coord_err`` / ``coord_err_au`` (coordinate tokens: distance of
  the predicted bins from the target's), ``loss_bucket`` per early / middle / late third of the window positions;
- passkey: ``passkey_acc`` per depth and over all depths, ``passkey_rank`` over all depths;
- diagnostics: ``entropy`` and ``sink_mass`` per layer;
- force: every metric of :data:`attnlab.evaluate.force_probe.FORCE_METRICS`; the ``force_newton_dist`` row
  carries the recovered law in ``expression``;
- downstream: one row per lm-evaluation-harness task and metric (``acc``, ``acc_norm``, ``perplexity``, ``bpb``,
  ...), with ``task``, the harness's ``stderr`` and the number of documents in ``n_tokens``'s place left null.

No Ray, no torch, no store access here.
"""

from __future__ import annotations

from attnlab.evaluate.measure import BUCKETS, WindowScores, bits_per_byte
from attnlab.evaluate.plan import EvalCell
from attnlab.results.schema import LAW_METRIC


def _row(base: dict, cell: EvalCell, eval_key: str, *, metric: str, value: float, n_tokens: int, bucket=None,
         layer=None, expression=None, task=None, stderr=None) -> dict:
    row = dict(base)
    row.update(p_eval=cell.p_eval, rope_scaling=cell.rope, eval_len=int(cell.length), window_mode=cell.window_mode,
               metric=metric, value=float(value), n_tokens=None if n_tokens is None else int(n_tokens),
               eval_key=eval_key)
    if bucket is not None:
        row["bucket"] = bucket
    if layer is not None:
        row["layer"] = int(layer)
    if expression is not None:
        row["expression"] = expression
    if task is not None:
        row["task"] = task
    if stderr is not None:
        row["stderr"] = float(stderr)
    return row


def window_rows(base: dict, cell: EvalCell, eval_key: str, s: WindowScores, gpt2_text: bool) -> list[dict]:
    rows = [_row(base, cell, eval_key, metric="val_loss", value=s.loss, n_tokens=s.count)]
    if s.masked or s.coord_err is not None:
        rows.append(_row(base, cell, eval_key, metric="acc", value=s.acc, n_tokens=s.count))
    if s.coord_err is not None:
        rows.append(_row(base, cell, eval_key, metric="coord_err", value=s.coord_err, n_tokens=s.count))
        if s.bin_width is not None:
            rows.append(_row(base, cell, eval_key, metric="coord_err_au", value=s.coord_err * s.bin_width,
                             n_tokens=s.count))
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


def force_rows(base: dict, cell: EvalCell, eval_key: str, result) -> list[dict]:
    """A force probe's rows (``result``: :class:`attnlab.evaluate.force_probe.ForceProbeResult`)."""
    from attnlab.evaluate.force_probe import force_values

    return [_row(base, cell, eval_key, metric=metric, value=value, n_tokens=n,
                 expression=result.law.expression if metric == LAW_METRIC else None)
            for metric, (value, n) in force_values(result).items()]


def downstream_rows(base: dict, cell: EvalCell, eval_key: str, scores: list) -> list[dict]:
    """A harness task's rows (``scores``: ``[(metric, value, stderr, documents), ...]``)."""
    return [_row(base, cell, eval_key, metric=metric, value=value, n_tokens=None, task=cell.extra[0], stderr=stderr)
            for metric, value, stderr, _ in scores]


def rows_for(base: dict, cell: EvalCell, eval_key: str, scores, gpt2_text: bool = False) -> list[dict]:
    """The rows of one measured cell."""
    if cell.kind == "windows":
        return window_rows(base, cell, eval_key, scores, gpt2_text)
    if cell.kind == "passkey":
        return passkey_rows(base, cell, eval_key, scores)
    if cell.kind == "force":
        return force_rows(base, cell, eval_key, scores)
    if cell.kind == "downstream":
        return downstream_rows(base, cell, eval_key, scores)
    return diagnostic_rows(base, cell, eval_key, scores)


def nan_rows(base: dict, cell: EvalCell, eval_key: str) -> list[dict]:
    """A diverged training run's cell: NaN ``val_loss`` (a force cell: NaN
    :data:`~attnlab.results.schema.LAW_METRIC`), so tables show it and the cell is not retried (a downstream cell:
    NaN ``acc`` of its task)."""
    if cell.kind == "downstream":
        return [_row(base, cell, eval_key, metric="acc", value=float("nan"), n_tokens=0, task=cell.extra[0])]
    metric = LAW_METRIC if cell.kind == "force" else "val_loss"
    return [_row(base, cell, eval_key, metric=metric, value=float("nan"), n_tokens=0)]
