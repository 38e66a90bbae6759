"""Extrapolation evaluation: validation loss at 1x..16x length for every p_eval and RoPE scaling, passkey
retrieval, attention diagnostics; rows for the results store. No Ray here (a study wraps it in its own task).

- ``plan``: ``EvalConfig`` (a study's ``eval:`` block; ``attnlab eval``'s flags) and the cells it expands into,
  each with its own key;
- ``measure``: model + data + cells -> scores (``score_windows``, ``bits_per_byte``, ``bucket_bounds``);
- ``cell_rows``: a measured cell's scores -> results-store rows;
- ``extrapolation``: ``evaluate_checkpoint(checkpoint, config, *, data, context, store, device, skip) -> rows``;
- ``passkey`` and ``diagnostics``: the two extra measurements;
- ``downstream`` (with ``harness_lm``): lm-evaluation-harness tasks (the ``downstream`` extra), one cell per task.
"""

from attnlab.evaluate.extrapolation import LoadedCheckpoint, evaluate_checkpoint
from attnlab.evaluate.measure import BUCKETS, bits_per_byte, bucket_bounds, score_windows
from attnlab.evaluate.plan import DEFAULT_EVAL_TOKENS, DownstreamConfig, EvalCell, EvalConfig

__all__ = [
    "BUCKETS",
    "DEFAULT_EVAL_TOKENS",
    "DownstreamConfig",
    "EvalCell",
    "EvalConfig",
    "LoadedCheckpoint",
    "bits_per_byte",
    "bucket_bounds",
    "evaluate_checkpoint",
    "score_windows",
]
