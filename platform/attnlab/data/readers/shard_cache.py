"""Shards of a prepared folder on object storage: served by ranged reads at once, fetched once per node.

Owns :class:`RemoteShard` (a shard's byte ranges from its Arrow IPC metadata; each window one ranged read until
the shard is on this node's disk, then a slice of its memory map), :func:`fetch` (a shard into the node's cache,
at most once per node: under a lock, checked against the manifest's sha256, renamed into place as
``<sha256>.arrow``), :class:`Prefetcher` (a split's shards fetched on one background thread per process, once its
first windows are served) and the cache folder (:func:`cache_root`).

It must never read a shard whole into memory, cache bytes that fail their sha256, or import Ray, torch or
``datasets``.

Details: docs/data.md#reading-attnlabdatareaderstokenstokenshards, docs/data.md#the-shard-cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import struct
import threading
import time
import uuid

import numpy as np
import pyarrow.fs as pafs

from attnlab.errors import UserError
from attnlab.location import Location, atomic_output

CACHE_ENV = "ATTNLAB_DATA_CACHE"
PREFETCH_ENV = "ATTNLAB_DATA_PREFETCH"  # "0": never fetch in the background (ranged reads only)
_CHUNK = 8 << 20
_HEAD = 64 << 10  # the schema and record-batch metadata of a shard fit in this many leading bytes


def cache_root() -> str:
    """This node's shard cache folder (created on first use)."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        from attnlab.cache import cache_dir

        root = str(cache_dir() / "shards")
    return os.path.abspath(os.path.expanduser(root))


def cached_path(sha256: str, root: str | None = None) -> str:
    return os.path.join(root or cache_root(), f"{sha256}.arrow")


# ------------------------------------------------------------------------------------------ IPC layout
def _table(buf: bytes, pos: int) -> tuple[int, int, int]:
    """(table position, vtable position, vtable size) of the flatbuffer table at ``pos``."""
    vt = pos - struct.unpack_from("<i", buf, pos)[0]
    return pos, vt, struct.unpack_from("<H", buf, vt)[0]


def _field(buf: bytes, table: tuple[int, int, int], index: int) -> int | None:
    pos, vt, size = table
    at = 4 + 2 * index
    if at + 2 > size:
        return None
    off = struct.unpack_from("<H", buf, vt + at)[0]
    return pos + off if off else None


def _deref(buf: bytes, at: int) -> int:
    return at + struct.unpack_from("<I", buf, at)[0]


def _read_message(buf: bytes, pos: int) -> tuple[int, int]:
    """(metadata start, metadata length) of the encapsulated IPC message at ``pos``."""
    cont, length = struct.unpack_from("<Ii", buf, pos)
    if cont != 0xFFFFFFFF:  # pre-1.0 format: no continuation marker
        return pos + 4, cont
    return pos + 8, length


def token_layout(head: bytes) -> dict:
    """Where a shard's buffers lie, from the first bytes of its Arrow IPC file: ``{"offsets": (pos, len),
    "values": (pos, len)}`` (absolute file positions of the list offsets and the uint16 token values)."""
    if head[:6] != b"ARROW1":
        raise ValueError("not an Arrow IPC file")
    meta, length = _read_message(head, 8)  # the schema message
    meta, length = _read_message(head, meta + length)  # the record batch message
    body = meta + length
    if body > len(head):
        raise ValueError("record batch metadata beyond the head read")
    msg = memoryview(head)[meta:body].tobytes()
    root = _table(msg, _deref(msg, 0))
    if struct.unpack_from("<B", msg, _field(msg, root, 1))[0] != 3:  # MessageHeader.RecordBatch
        raise ValueError("the second message is not a record batch")
    batch = _table(msg, _deref(msg, _field(msg, root, 2)))
    if _field(msg, batch, 3) is not None:
        raise ValueError("compressed record batch")
    vec = _deref(msg, _field(msg, batch, 2))
    n = struct.unpack_from("<I", msg, vec)[0]
    buffers = [struct.unpack_from("<qq", msg, vec + 4 + 16 * i) for i in range(n)]
    if n != 4:  # list validity, list offsets, values validity, values
        raise ValueError(f"expected 4 buffers, found {n}")
    return {"offsets": (body + buffers[1][0], buffers[1][1]), "values": (body + buffers[3][0], buffers[3][1])}


# ------------------------------------------------------------------------------------------------ fetching
def _lock(path: str, blocking: bool):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def fetch(loc: Location, name: str, sha256: str, *, root: str | None = None, blocking: bool = True) -> str | None:
    """The local path of shard ``name`` (sha256 ``sha256``) in the node's cache, fetching it if absent.

    Returns None when ``blocking=False`` and another process of this node holds the shard's lock (it is
    fetching it). UserError when the object's bytes do not match ``sha256``."""
    root = root or cache_root()
    final = cached_path(sha256, root)
    if os.path.exists(final):
        return final
    os.makedirs(root, exist_ok=True)
    fd = _lock(os.path.join(root, f"{sha256}.lock"), blocking)
    if fd is None:
        return None
    try:
        if os.path.exists(final):  # another process fetched it while we waited
            return final
        for stale in os.listdir(root):  # left by a process killed while fetching this shard
            if stale.startswith(f".{sha256}.tmp-"):
                os.unlink(os.path.join(root, stale))
        h = hashlib.sha256()
        # One ranged GET per chunk, read into one buffer reused for every chunk: a new 8 MB object per chunk left
        # the fetching thread's malloc arena holding ~100 MB of freed chunks (anonymous memory).
        buffer = bytearray(_CHUNK)
        with loc.fs.open_input_file(loc.join(name)) as src, atomic_output(
                pafs.LocalFileSystem(), final, temporary=f".{sha256}.tmp-{uuid.uuid4().hex[:12]}") as out:
            size = src.size()
            while src.tell() < size:
                n = src.readinto(memoryview(buffer)[: min(_CHUNK, size - src.tell())])
                if n <= 0:
                    raise OSError(f"{loc.join(name)} ended at byte {src.tell()} of {size}")
                chunk = memoryview(buffer)[:n]
                h.update(chunk)
                out.write(chunk)
            if h.hexdigest() != sha256:  # before the rename: nothing is cached
                raise UserError(f"shard {name} in {loc.uri} does not match its manifest sha256 (changed or corrupt); "
                                f"run: attnlab data verify {loc.uri}")
        return final
    finally:
        os.close(fd)


class RemoteShard:
    """One shard on object storage as a uint16 sequence: ranged reads until the node's cache has it, then
    a memory map of the cached file. Supports ``len``, ``[int]``, ``[a:b]`` (a numpy array)."""

    dtype = np.dtype(np.uint16)

    def __init__(self, loc: Location, entry: dict, root: str | None = None):
        self.loc, self.name, self.sha256 = loc, entry["name"], entry["sha256"]
        self.num_tokens = int(entry["num_tokens"])
        self.first_doc_continues = bool(entry.get("first_doc_continues", False))
        self.root = root or cache_root()
        self.path = cached_path(self.sha256, self.root)
        self._local: np.ndarray | None = None
        self._file = None
        self._layout: dict | None = None
        self._checked = 0.0
        self._mutex = threading.Lock()
        self.ranged_reads = 0

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def shape(self) -> tuple[int]:
        return (self.num_tokens,)

    # -- the local copy
    def local(self, force_check: bool = False) -> np.ndarray | None:
        """The memory-mapped tokens when the shard is in this node's cache (checked at most once a second)."""
        if self._local is None:
            now = time.monotonic()
            if force_check or now - self._checked > 1.0:
                self._checked = now
                if os.path.exists(self.path):
                    from attnlab.data.shards import decode_shard

                    data = decode_shard(self.path, self.name)
                    if len(data.tokens) != self.num_tokens:
                        raise UserError(f"shard {self.name} holds {len(data.tokens)} tokens but the manifest says "
                                        f"{self.num_tokens}; run: attnlab data verify {self.loc.uri}")
                    self._doc_starts = data.doc_starts
                    self._local = data.tokens
                    self._file = None
        return self._local

    # -- ranged reads
    def _open(self):
        with self._mutex:
            if self._file is None:
                f = self.loc.fs.open_input_file(self.loc.join(self.name))
                head = bytes(f.read_at(min(_HEAD, f.size()), 0))
                try:
                    layout = token_layout(head)
                except (ValueError, struct.error, TypeError) as exc:
                    raise UserError(f"shard {self.name} in {self.loc.uri} is not a valid token shard: {exc}") from None
                # the values of a freshly written shard start at list offset 0 (encode_shard writes no slices)
                if layout["values"][1] < 2 * self.num_tokens:
                    raise UserError(f"shard {self.name} in {self.loc.uri} holds fewer tokens than its manifest says; "
                                    f"run: attnlab data verify {self.loc.uri}")
                self._layout, self._file = layout, f
            return self._file

    def _read(self, start: int, length: int) -> np.ndarray:
        f = self._open()
        pos = self._layout["values"][0] + 2 * start
        self.ranged_reads += 1
        return np.frombuffer(f.read_at(2 * length, pos), dtype=np.uint16)

    def __getitem__(self, key):
        local = self.local()
        if local is not None:
            return local[key]
        if isinstance(key, slice):
            start, stop, step = key.indices(self.num_tokens)
            out = self._read(start, max(0, stop - start))
            return out if step == 1 else out[::step]
        if isinstance(key, (int, np.integer)):
            i = int(key) + (self.num_tokens if key < 0 else 0)
            if not 0 <= i < self.num_tokens:
                raise IndexError(key)
            return self._read(i, 1)[0]
        raise TypeError(f"RemoteShard indices must be ints or slices, not {type(key).__name__}")

    def doc_starts(self) -> np.ndarray:
        """int64 offsets of documents starting in this shard (from the cache, else one ranged read)."""
        if self.local() is not None:
            return self._doc_starts
        f = self._open()
        pos, length = self._layout["offsets"]
        offsets = np.frombuffer(f.read_at(length, pos), dtype=np.int64)
        starts = offsets[:-1] - offsets[0]
        return (starts[1:] if self.first_doc_continues else starts).astype(np.int64)


class Prefetcher:
    """Fetches a list of shards into the node's cache on one daemon thread (see :func:`fetch`), starting when
    ``start`` is set (the process served its first windows: start-up reads go first) or after ``START_AFTER_S``."""

    START_AFTER_S = 10.0

    def __init__(self, shards: list[RemoteShard], start: threading.Event | None = None):
        self.shards = shards
        self.start = start
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="attnlab-shard-fetch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if self.start is not None:
            self.start.wait(self.START_AFTER_S)
        waiting = []
        # start at a process-dependent shard so a node's processes fetch different shards first
        k = os.getpid() % max(1, len(self.shards))
        for shard in self.shards[k:] + self.shards[:k]:
            if not self._one(shard, blocking=False):
                waiting.append(shard)
        for shard in waiting:
            self._one(shard, blocking=True)

    def _one(self, shard: RemoteShard, blocking: bool) -> bool:
        try:
            path = fetch(shard.loc, shard.name, shard.sha256, root=shard.root, blocking=blocking)
        except BaseException as exc:  # noqa: BLE001 - reads fall back to ranged reads; kept for inspection
            self.errors.append(exc)
            return True
        if path is not None:
            shard.local(force_check=True)
        return path is not None

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)


def prefetch_enabled() -> bool:
    return os.environ.get(PREFETCH_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
