"""Batch readers over a prepared data folder: the trainer's and the evaluator's only way into the tokens.

- :class:`TokenShards` opens a folder by its manifest alone and a split when it is first used: local shards
  are memory-mapped (zero copy); shards on object storage are served by ranged reads until this node's
  cache holds them, then memory-mapped from there (:mod:`attnlab.data.readers.shard_cache`), never read whole into
  memory. It exposes each split as one token stream, its document start offsets, and
  :meth:`TokenShards.eval_windows` (non-overlapping evaluation windows).
- :class:`TrainSampler` draws the training windows of optimizer step ``s`` from ``(seed, s)`` alone, and
  hands rank ``r`` / micro-step ``m`` its own disjoint rows of them: the global batch does not depend on
  the worker count, and a run resumed at step ``s`` sees exactly the batches an uninterrupted run would.
- :class:`TextData`: a prepared folder as a :class:`attnlab.data.source.DataSource`.

No Ray here; torch is imported only by :meth:`TrainSampler.batch`.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from attnlab.data.batching import micro_batch_rows
from attnlab.data.readers.shard_cache import Prefetcher, RemoteShard, prefetch_enabled
from attnlab.data.shards import SPLITS, read_manifest, read_shard, sha256_hex
from attnlab.errors import UserError
from attnlab.location import Location


class ConcatTokens:
    """Several shards' uint16 token views seen as one sequence (slicing may cross shard ends)."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = [p for p in parts if len(p)]
        self.ends = np.cumsum([len(p) for p in self.parts], dtype=np.int64)
        self.starts = self.ends - np.array([len(p) for p in self.parts], dtype=np.int64)
        self.dtype = np.dtype(np.uint16)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self[start:stop][::step]
            return self.window(start, max(0, stop - start))
        if isinstance(key, (int, np.integer)):
            i = int(key) + (len(self) if key < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(key)
            k = int(np.searchsorted(self.ends, i, side="right"))
            return self.parts[k][i - self.starts[k]]
        return np.asarray(self)[key]

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)``: a zero-copy view inside one shard, else a copy."""
        if length == 0:
            return np.zeros(0, dtype=np.uint16)
        k = int(np.searchsorted(self.ends, start, side="right"))
        local = start - int(self.starts[k])
        if local + length <= len(self.parts[k]):
            return self.parts[k][local : local + length]
        pieces, need = [], length
        while need > 0:
            piece = self.parts[k][local : local + need]
            pieces.append(piece)
            need -= len(piece)
            k, local = k + 1, 0
        return np.concatenate(pieces)

    @property
    def remote(self) -> bool:
        """True while some part is served by ranged reads from object storage (not yet in the node's cache)."""
        return any(isinstance(p, RemoteShard) and p.local() is None for p in self.parts)

    def __array__(self, dtype=None, copy=None):
        out = np.concatenate([p[:] for p in self.parts]) if self.parts else np.zeros(0, dtype=np.uint16)
        return out if dtype is None else out.astype(dtype)


def _gather(tokens, starts: np.ndarray, length: int) -> np.ndarray:
    """Windows ``tokens[s : s + length]`` for every ``s`` in ``starts`` as an (n, length) int64 array."""
    starts = np.asarray(starts, dtype=np.int64)
    out = np.empty((len(starts), length), dtype=np.int64)
    if isinstance(tokens, np.ndarray):
        offsets = np.arange(length, dtype=np.int64)[None, :]
        rows = max(1, (1 << 22) // max(1, length))  # bound the index array to ~32 MB
        for i in range(0, len(starts), rows):
            out[i : i + rows] = tokens[starts[i : i + rows, None] + offsets]
        return out
    if getattr(tokens, "remote", False) and len(starts) > 1:  # ranged reads: overlap their latency
        def fill(row: int) -> None:
            out[row] = tokens.window(int(starts[row]), length)

        with ThreadPoolExecutor(min(8, len(starts))) as pool:
            list(pool.map(fill, range(len(starts))))
        return out
    for row, s in enumerate(starts):
        out[row] = tokens.window(int(s), length)
    return out


class TokenShards:
    """A prepared data folder opened for reading (token counts from the manifest; shards opened per split on
    first use)."""

    def __init__(self, location: Location, manifest: dict, manifest_raw: bytes):
        """Reads nothing but the manifest: a split's shards are opened when it is first used."""
        self.location = location
        self.manifest = manifest
        self.manifest_sha256 = sha256_hex(manifest_raw)
        self.vocab_size = int(manifest["vocab_size"])
        self.eot_id = int(manifest["eot_id"])
        self._entries = {
            split: sorted((e for e in manifest["shards"] if e["split"] == split), key=lambda e: e["index"])
            for split in SPLITS
        }
        self._num_tokens = {split: sum(int(e["num_tokens"]) for e in self._entries[split]) for split in SPLITS}
        self._tokens: dict[str, np.ndarray | ConcatTokens] = {}
        self._parts: dict[str, list] = {}
        self._doc_offsets: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        self.prefetchers: dict[str, Prefetcher] = {}
        self._served_events: dict[str, threading.Event] = {}

    def prefetch(self, split: str, wait: bool = True) -> None:
        """Fetch a bucket split's shards into this node's cache now (``wait``: until done); no-op for a local
        folder. Raises the first fetch error (e.g. a sha256 mismatch)."""
        split = self._split(split)
        self.tokens(split)
        prefetcher = self.prefetchers.get(split)
        if prefetcher is None:
            if self.location.is_local:
                return
            prefetcher = self.prefetchers[split] = Prefetcher(self._parts[split])
        self._served(split).set()
        if wait:
            prefetcher.join()
            if prefetcher.errors:
                raise prefetcher.errors[0]

    def _served(self, split: str) -> threading.Event:
        """Set once this process has served its first windows of ``split``: the background fetch of a bucket's
        shards starts then, so the first batch's ranged reads never queue behind it."""
        return self._served_events.setdefault(split, threading.Event())

    def _load(self, split: str) -> None:
        """Open a split's shards: memory-mapped in place (local folder), else :class:`RemoteShard` s served by
        ranged reads until the node's cache holds them (fetched in the background, :mod:`shard_cache`)."""
        with self._lock:
            if split in self._tokens:
                return
            parts: list = []
            if self.location.is_local:
                for entry in self._entries[split]:
                    data = read_shard(self.location, entry["name"])
                    if len(data.tokens) != entry["num_tokens"]:
                        raise UserError(
                            f"shard {entry['name']} holds {len(data.tokens)} tokens but the manifest says "
                            f"{entry['num_tokens']}; run: attnlab data verify {self.location.uri}"
                        )
                    parts.append(data)
                views = [d.tokens for d in parts]
            else:
                parts = [RemoteShard(self.location, entry) for entry in self._entries[split]]
                views = parts
                if parts and prefetch_enabled():
                    self.prefetchers[split] = Prefetcher(parts, start=self._served(split))
            self._parts[split] = parts
            self._tokens[split] = (
                views[0] if len(views) == 1 and isinstance(views[0], np.ndarray) else ConcatTokens(views)
            )

    @classmethod
    def open(cls, path: str | os.PathLike) -> TokenShards:
        """Open a folder written by ``attnlab data prepare``; UserError if it is missing or not one."""
        location = Location.parse(path, field="data")
        manifest, raw = read_manifest(location)
        return cls(location, manifest, raw)

    def _split(self, split: str) -> str:
        if split not in SPLITS:
            raise UserError(f"split {split!r} is unknown; allowed: {', '.join(SPLITS)}")
        return split

    def num_tokens(self, split: str) -> int:
        """The split's token count, from the manifest (opens no shard)."""
        return self._num_tokens[self._split(split)]

    def tokens(self, split: str):
        """The split's tokens: a zero-copy uint16 view (one local shard) or a :class:`ConcatTokens`."""
        split = self._split(split)
        if split not in self._tokens:
            self._load(split)
        return self._tokens[split]

    def doc_offsets(self, split: str) -> np.ndarray:
        """int64 offsets (into ``tokens(split)``) where documents start (each at its EOT token)."""
        split = self._split(split)
        if split not in self._doc_offsets:
            self.tokens(split)
            starts, base = [], 0
            for part in self._parts[split]:
                starts.append((part.doc_starts() if isinstance(part, RemoteShard) else part.doc_starts) + base)
                base += len(part) if isinstance(part, RemoteShard) else len(part.tokens)
            self._doc_offsets[split] = (
                np.concatenate(starts).astype(np.int64) if starts else np.zeros(0, dtype=np.int64)
            )
        return self._doc_offsets[split]

    def doc_lengths(self, split: str) -> np.ndarray:
        starts = self.doc_offsets(split)
        return np.diff(np.append(starts, self.num_tokens(split)))

    def window(self, split: str, start: int, length: int) -> np.ndarray:
        tokens = self.tokens(split)
        if isinstance(tokens, ConcatTokens):
            return tokens.window(start, length)
        return tokens[start : start + length]

    def eval_windows(
        self, split: str = "val", seq_len: int = 1024, max_tokens: int | None = None, long_docs: bool = False
    ) -> np.ndarray:
        """Non-overlapping evaluation windows, an (n, seq_len + 1) int64 array.

        Window k covers tokens ``[k*L, k*L + L]``: its last token is the next window's first, so each
        token after the first is predicted exactly once. ``max_tokens`` caps the predicted tokens (whole
        windows: ``n <= max_tokens // L``). ``long_docs=True`` keeps only windows lying inside documents
        of at least ``L + 1`` tokens (windows counted from each such document's start).
        """
        split = self._split(split)
        if seq_len < 1:
            raise UserError(f"seq_len must be >= 1, got {seq_len}")
        n_tokens = self.num_tokens(split)
        if long_docs:
            starts_list = []
            for doc_start, doc_len in zip(self.doc_offsets(split), self.doc_lengths(split)):
                count = (int(doc_len) - 1) // seq_len
                if count > 0:
                    starts_list.append(int(doc_start) + seq_len * np.arange(count, dtype=np.int64))
            starts = np.concatenate(starts_list) if starts_list else np.zeros(0, dtype=np.int64)
        else:
            starts = seq_len * np.arange(max(0, (n_tokens - 1) // seq_len), dtype=np.int64)
        if max_tokens is not None:
            starts = starts[: max(0, int(max_tokens) // seq_len)]
        windows = _gather(self.tokens(split), starts, seq_len + 1)
        self._served(split).set()
        return windows

    def __repr__(self) -> str:
        return (
            f"TokenShards({self.location.uri!r}, train={self.num_tokens('train')}, "
            f"val={self.num_tokens('val')})"
        )


class TrainSampler:
    """Deterministic distributed sampler of random ``seq_len + 1``-token training windows.

    The ``global_batch`` window starts of step ``s`` come from ``np.random.Generator(PCG64([seed, s]))``
    alone, uniform over ``[0, N - seq_len - 1]``; each rank and micro-step takes its rows of them by
    :func:`attnlab.data.batching.micro_batch_rows`.
    """

    def __init__(self, shards: TokenShards, seq_len: int, global_batch: int, seed: int = 0, split: str = "train"):
        self.shards = shards
        self.split = shards._split(split)
        self.seq_len = int(seq_len)
        self.global_batch = int(global_batch)
        self.seed = int(seed)
        n = shards.num_tokens(self.split)
        if self.seq_len < 1 or self.global_batch < 1:
            raise UserError(f"seq_len and global_batch must be >= 1, got {seq_len} and {global_batch}")
        if self.seq_len + 1 > n:
            raise UserError(
                f"seq_len {self.seq_len} + 1 exceeds the {n} tokens of split {self.split!r} in "
                f"{shards.location.uri}; use a shorter seq_len or prepare more data"
            )
        self._num_starts = n - self.seq_len  # starts 0 .. n - seq_len - 1 inclusive

    def step_starts(self, step: int) -> np.ndarray:
        """The ``global_batch`` window start offsets of optimizer step ``step``."""
        rng = np.random.Generator(np.random.PCG64([self.seed, int(step)]))
        return rng.integers(0, self._num_starts, size=self.global_batch, dtype=np.int64)

    def batch(self, step: int, rank: int = 0, world_size: int = 1, micro: int = 0, micro_batch: int | None = None):
        """``(x, y)`` torch.long tensors of shape (B, seq_len) for this rank and micro-step."""
        import torch

        if micro_batch is None:
            micro_batch = self.global_batch // world_size
        rows = micro_batch_rows(rank, world_size, micro, micro_batch, self.global_batch)
        windows = _gather(self.shards.tokens(self.split), self.step_starts(step)[rows.start:rows.stop],
                          self.seq_len + 1)
        self.shards._served(self.split).set()
        data = torch.from_numpy(windows)
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()


class TextData:
    """Real text from prepared Arrow shards (local or on object storage)."""

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
