"""What training and evaluation need from a data source, whether real text shards or a synthetic probe.

``open_data(spec)``: a string is a folder made by ``attnlab data prepare`` (``TextData``); a mapping with a
``synthetic`` key is a generated probe task (``attnlab.data.synthetic.open_task``). Both offer:

- ``vocab_size``, ``fingerprint`` (manifest hash or task hash), ``describe()``;
- ``train_batch(step, rank, world_size, micro, micro_batch, seq_len, global_batch, seed)``
  -> ``(x, y, loss_mask or None)`` torch tensors ``(B, T)``;
- ``eval_set(seq_len, max_tokens, long_docs=False, seed=0)`` -> ``(windows (n, L+1) int64, target_mask (n, L) bool
  or None)``: for text, non-overlapping windows over the validation split; for a probe, generated sequences
  at that length whose mask marks the scored positions.

No Ray here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnlab.data import TokenShards, TrainSampler


class TextData:
    """Real text from prepared Arrow shards."""

    def __init__(self, path: str):
        self.path = path
        self.shards = TokenShards.open(path)
        self.vocab_size = self.shards.vocab_size
        self.fingerprint = self.shards.manifest_sha256
        self._samplers: dict = {}

    def describe(self) -> str:
        return str(self.path)

    def min_tokens(self) -> int:
        return min(self.shards.num_tokens("train"), self.shards.num_tokens("val"))

    def train_batch(self, step, rank, world_size, micro, micro_batch, *, seq_len, global_batch, seed):
        key = (seq_len, global_batch, seed)
        if key not in self._samplers:
            self._samplers[key] = TrainSampler(self.shards, seq_len=seq_len, global_batch=global_batch, seed=seed)
        x, y = self._samplers[key].batch(step, rank, world_size, micro=micro, micro_batch=micro_batch)
        return x, y, None

    def eval_set(self, seq_len: int, max_tokens: int | None, long_docs: bool = False, seed: int = 0):
        windows = self.shards.eval_windows("val", seq_len=seq_len, max_tokens=max_tokens, long_docs=long_docs)
        return np.asarray(windows, dtype=np.int64), None


def open_data(spec: str | dict[str, Any]):
    if isinstance(spec, dict):
        from attnlab.data.synthetic import open_task

        return open_task(spec)
    return TextData(spec)
