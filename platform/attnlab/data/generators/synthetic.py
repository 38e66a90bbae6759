"""Synthetic mechanism probes: generated long-context tasks that stand in for text as a data source.

Owns the probes (``SYNTHETIC_TASKS``: ``copy_distractors``, ``mqar``, ``passkey_tokens``), named in a training
config or study as ``data: {synthetic: copy_distractors, vocab: 512, ...}``: :func:`open_task` returns a
:class:`SyntheticData` with the interface of real text (:class:`attnlab.data.source.DataSource`), so training,
validation and ``attnlab eval`` run unchanged. Every window of ``L + 1`` tokens comes with a mask of its target
positions, which alone count in loss and accuracy. A row is a pure function of its stream, seed, step (or
length) and index, so batches never depend on the worker count; every evaluation length gets about
``eval_targets`` targets.

It must never import Ray, nor build torch modules (torch only makes the returned batch tensors).

Details: docs/protocol.md#synthetic-probes (each task's layout and what it measures, determinism and evaluation
size).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from attnlab.data.batching import micro_batch_rows
from attnlab.errors import UserError
from attnlab.validation import parse

TRAIN_STREAM = 0x747261696E  # "train": the first word of every training row's seed
EVAL_STREAM = 0x6576616C  # "eval": the first word of every evaluation row's seed
DEFAULT_EVAL_TARGETS = 2048

PositiveInt = Annotated[int, Field(strict=True, gt=0)]


class SyntheticTask(BaseModel):
    """One probe's parameters, and how to draw one window of ``L + 1`` tokens with its target mask."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: ClassVar[str]

    vocab: Annotated[int, Field(strict=True, ge=4)] = 512
    eval_targets: PositiveInt = DEFAULT_EVAL_TARGETS

    def min_length(self) -> int:
        """The shortest L (input tokens) a window of this task fits in."""
        raise NotImplementedError

    def targets_per_sequence(self, length: int) -> int:
        raise NotImplementedError

    def window(self, rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens (L + 1,) int64, target_mask (L,) bool)``; ``target_mask[t]`` scores predicting
        ``tokens[t + 1]``."""
        raise NotImplementedError

    def check_length(self, length: int) -> None:
        if length < self.min_length():
            raise UserError(f"seq_len={length} is too short for synthetic {self.name} with {self.params_text()}: "
                            f"use seq_len >= {self.min_length()}")

    def params_text(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.model_dump().items())


class CopyDistractors(SyntheticTask):
    """Random distractors, a random block, (a gap,) the same block again; the repeat is scored."""

    name: ClassVar[str] = "copy_distractors"
    copy_len: PositiveInt = 32
    distance: PositiveInt = 32  # from the block's start to the repeat's start; when not given, copy_len

    @model_validator(mode="before")
    @classmethod
    def _distance_defaults_to_copy_len(cls, data: Any) -> Any:
        if isinstance(data, dict) and "distance" not in data and "copy_len" in data:
            data = {**data, "distance": data["copy_len"]}
        return data

    @model_validator(mode="after")
    def _distance_fits(self) -> "CopyDistractors":
        if self.distance < self.copy_len:
            raise ValueError(f"distance={self.distance} must be >= copy_len={self.copy_len} (the repeat may not "
                             f"overlap the block)")
        return self

    def min_length(self) -> int:
        return self.distance + self.copy_len - 1  # L + 1 tokens hold the block, the gap and the repeat

    def num_distractors(self, length: int) -> int:
        return length + 1 - self.distance - self.copy_len

    def targets_per_sequence(self, length: int) -> int:
        return self.copy_len

    def window(self, rng, length):
        tokens = rng.integers(0, self.vocab, size=length + 1, dtype=np.int64)
        repeat_at = length + 1 - self.copy_len
        block_at = repeat_at - self.distance
        tokens[repeat_at:] = tokens[block_at:block_at + self.copy_len]
        mask = np.zeros(length, dtype=bool)
        mask[repeat_at - 1:] = True  # position t predicts token t + 1
        return tokens, mask


class MQAR(SyntheticTask):
    """Key-value pairs, then each key queried once; the value after each query is scored.

    Random value tokens pad the front of the window (1 token when 4 divides L)."""

    name: ClassVar[str] = "mqar"
    max_pairs: PositiveInt = 256  # when not given, vocab // 2 (every key distinct)

    @model_validator(mode="before")
    @classmethod
    def _max_pairs_defaults_to_half_vocab(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_pairs" not in data and isinstance(data.get("vocab"), int):
            data = {**data, "max_pairs": data["vocab"] // 2}
        return data

    @model_validator(mode="after")
    def _enough_keys(self) -> "MQAR":
        if self.max_pairs > self.vocab // 2:
            raise ValueError(f"max_pairs={self.max_pairs} needs that many distinct keys but vocab={self.vocab} "
                             f"has {self.vocab // 2}: use max_pairs <= {self.vocab // 2}")
        return self

    def num_pairs(self, length: int) -> int:
        return min(length // 4, self.max_pairs)

    def min_length(self) -> int:
        return 4

    def targets_per_sequence(self, length: int) -> int:
        return self.num_pairs(length)

    def window(self, rng, length):
        n, half = self.num_pairs(length), self.vocab // 2
        filler = length + 1 - 4 * n
        keys = rng.choice(half, size=n, replace=False).astype(np.int64)
        values = rng.integers(half, self.vocab, size=n, dtype=np.int64)
        order = rng.permutation(n)
        tokens = np.empty(length + 1, dtype=np.int64)
        tokens[:filler] = rng.integers(half, self.vocab, size=filler, dtype=np.int64)
        tokens[filler:filler + 2 * n:2], tokens[filler + 1:filler + 2 * n:2] = keys, values
        queries = filler + 2 * n
        tokens[queries::2], tokens[queries + 1::2] = keys[order], values[order]
        mask = np.zeros(length, dtype=bool)
        mask[queries::2] = True  # the query position predicts its value
        return tokens, mask


class PasskeyTokens(SyntheticTask):
    """A key after ``KEY_MARK`` hidden in filler at ``depth``; ``QUERY_MARK`` at the end asks for it back."""

    name: ClassVar[str] = "passkey_tokens"
    KEY_MARK: ClassVar[int] = 0
    QUERY_MARK: ClassVar[int] = 1
    key_len: PositiveInt = 4
    depth: float | Literal["uniform"] = "uniform"

    @field_validator("depth", mode="before")
    @classmethod
    def _depth_allowed(cls, value: Any) -> Any:
        ok = value == "uniform" or (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1)
        if not ok:
            raise ValueError("use a number in [0, 1] (0 = start of the filler, 1 = its end) or 'uniform'")
        return value

    def num_filler(self, length: int) -> int:
        return length + 1 - 2 * (self.key_len + 1)

    def key_start(self, length: int, rng: np.random.Generator | None = None) -> int:
        """Where ``KEY_MARK`` sits: ``floor(depth * filler + 1/2)`` filler tokens precede it (``uniform``: a
        random number in 0..filler)."""
        filler = self.num_filler(length)
        if self.depth == "uniform":
            return int(rng.integers(0, filler + 1))
        return int(math.floor(self.depth * filler + 0.5))

    def min_length(self) -> int:
        return 2 * (self.key_len + 1) - 1

    def targets_per_sequence(self, length: int) -> int:
        return self.key_len

    def window(self, rng, length):
        tokens = rng.integers(2, self.vocab, size=length + 1, dtype=np.int64)
        key = tokens[-self.key_len:]  # the answer at the end; copy it into the hiding place
        at = self.key_start(length, rng)
        tokens[at] = self.KEY_MARK
        tokens[at + 1:at + 1 + self.key_len] = key
        tokens[-self.key_len - 1] = self.QUERY_MARK
        mask = np.zeros(length, dtype=bool)
        mask[-self.key_len:] = True  # QUERY_MARK and the first key_len - 1 key tokens predict the key
        return tokens, mask


SYNTHETIC_TASKS: dict[str, type[SyntheticTask]] = {t.name: t for t in (CopyDistractors, MQAR, PasskeyTokens)}


def _row_rng(*words: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(list(words)))


class SyntheticData:
    """A probe task as a data source (:class:`attnlab.data.source.DataSource`)."""

    def __init__(self, task: SyntheticTask):
        self.task = task
        self.vocab_size = task.vocab
        spec = {"synthetic": task.name, **task.model_dump()}
        self.spec = spec
        self.fingerprint = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()

    def describe(self) -> str:
        return f"synthetic {self.task.name}({self.task.params_text()})"

    def min_tokens(self) -> int:
        return 2**62  # generated on demand: never runs out

    def windows(self, stream: int, seed: int, key: int, rows: range, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``rows`` of the window set named by ``(stream, seed, key)``: ``(n, L + 1)`` int64, ``(n, L)`` bool."""
        self.task.check_length(length)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise UserError(f"data_seed={seed!r} is not allowed for synthetic data: use an integer >= 0")
        tokens = np.empty((len(rows), length + 1), dtype=np.int64)
        mask = np.empty((len(rows), length), dtype=bool)
        for out, row in enumerate(rows):
            tokens[out], mask[out] = self.task.window(_row_rng(stream, int(seed), int(key), row), length)
        return tokens, mask

    def train_batch(self, step, rank, world_size, micro, micro_batch, *, seq_len, global_batch, seed):
        """Rank ``rank``'s rows ``[(micro * world_size + rank) * micro_batch, ... + micro_batch)`` of step ``step``."""
        import torch

        rows = micro_batch_rows(rank, world_size, micro, micro_batch, global_batch)
        tokens, mask = self.windows(TRAIN_STREAM, seed, step, rows, seq_len)
        data = torch.from_numpy(tokens)
        return data[:, :-1].contiguous(), data[:, 1:].contiguous(), torch.from_numpy(mask)

    def eval_size(self, seq_len: int, max_tokens: int | None) -> int:
        """Sequences at length ``seq_len``: enough for ``eval_targets`` targets, at most ``max_tokens // seq_len``."""
        wanted = math.ceil(self.task.eval_targets / max(1, self.task.targets_per_sequence(seq_len)))
        return wanted if max_tokens is None else max(1, min(wanted, max_tokens // seq_len))

    def eval_set(self, seq_len: int, max_tokens: int | None, long_docs: bool = False, seed: int = 0):
        """``(windows (n, L + 1) int64, target_mask (n, L) bool)``: the fixed evaluation set at this length (a
        larger budget's set starts with a smaller one's).

        ``long_docs`` means nothing here (every sequence is exactly ``L + 1`` tokens); it is accepted for the
        interface's sake.
        """
        return self.windows(EVAL_STREAM, seed, seq_len, range(self.eval_size(seq_len, max_tokens)), seq_len)


def open_task(spec: dict[str, Any]) -> SyntheticData:
    """``{synthetic: <task name>, <param>: <value>, ...}`` -> the task as a data source; UserError on bad input."""
    return SyntheticData(synthetic_task(spec))


def synthetic_task(spec: dict[str, Any]) -> SyntheticTask:
    """``{synthetic: <task name>, <param>: <value>, ...}`` -> the task's validated parameters (nothing is
    generated); UserError on bad input."""
    if not isinstance(spec, dict) or "synthetic" not in spec:
        raise UserError(f"data={spec!r} is not a synthetic task: use a mapping like "
                        f"{{synthetic: copy_distractors, vocab: 512}}")
    params = dict(spec)
    name = params.pop("synthetic")
    if name not in SYNTHETIC_TASKS:
        raise UserError(f"data.synthetic={name!r} is not a known task: use one of {', '.join(SYNTHETIC_TASKS)}, "
                        "or orbits (simulated orbits)")
    return parse(SYNTHETIC_TASKS[name], params, prefix="data")


__all__ = ["SYNTHETIC_TASKS", "CopyDistractors", "MQAR", "PasskeyTokens", "SyntheticData", "SyntheticTask",
           "open_task", "synthetic_task"]
