"""Extrapolation evaluation: validation loss at 1x..16x length for every p_eval and RoPE scaling, passkey
retrieval, attention diagnostics; rows for the results store. No Ray here (callers wrap it in their tasks).

Public API:
- ``evaluate_checkpoint(checkpoint, *, data, lengths, multiples, p_evals, rope_scalings, max_tokens, long_docs,
  passkey, diagnostics, batch_size, device, context, store, key) -> list[dict]`` (``extrapolation.py``).
- ``core``: ``window_token_stats``, ``mean_window_loss`` (shared with training's validation).
- ``passkey``: ``build_prompt``, ``passkey_accuracy``, ``model_logprob``; ``diagnostics``: ``attention_diagnostics``.
"""

from attnlab.model.scoring import mean_window_loss, window_token_stats
from attnlab.evaluate.extrapolation import (
    BUCKETS,
    LoadedCheckpoint,
    bits_per_byte,
    bucket_bounds,
    evaluate_checkpoint,
    parse_lengths,
    parse_p_evals,
    parse_rope_scalings,
    plan_token_budget,
    score_windows,
)

__all__ = [
    "BUCKETS",
    "LoadedCheckpoint",
    "bits_per_byte",
    "bucket_bounds",
    "evaluate_checkpoint",
    "mean_window_loss",
    "parse_lengths",
    "parse_p_evals",
    "parse_rope_scalings",
    "plan_token_budget",
    "score_windows",
    "window_token_stats",
]
