"""The on-disk token-shard format: Arrow IPC shard files plus ``manifest.json``, written atomically.

A prepared data folder (local path or any URI pyarrow can open: ``s3://``, ``gs://``) holds

- ``train-NNNNN.arrow`` / ``val-NNNNN.arrow``: uncompressed Arrow IPC files with ONE record batch of ONE
  column ``tokens: large_list<uint16>``. Each row is a run of one document's tokens, so the flattened
  values are the shard's contiguous token stream (memory-mapped, zero copy) and the list offsets are the
  document boundaries. Every document starts with the end-of-text token. A shard holds exactly
  ``shard_tokens`` tokens (the last one of a split fewer), so a document may run on into the next shard:
  then that shard's first row continues it (schema metadata ``first_doc_continues = "true"``) and is not a
  document start.
- ``manifest.json``: tokeniser, vocab size, EOT id, source, seed, shuffle, budgets, and per shard its split,
  token count, document count (documents *starting* in it) and the sha256 of the file's bytes.

Every file is written under a temporary name and renamed, so a reader never sees half a shard.
``verify(dir)`` re-reads everything and names each missing or corrupt shard.

Never imports Ray, torch or ``datasets``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from attnlab.errors import UserError
from attnlab.location import Location

FORMAT = "attnlab-token-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
TOKENS_COLUMN = "tokens"
_SCHEMA = pa.schema([pa.field(TOKENS_COLUMN, pa.large_list(pa.uint16()))])


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.arrow"


# ------------------------------------------------------------------------------------------- shard files
def encode_shard(tokens: np.ndarray, doc_starts: np.ndarray, first_doc_continues: bool) -> pa.Buffer:
    """The bytes of one shard file. ``doc_starts``: offsets (into ``tokens``) of documents starting here."""
    tokens = np.ascontiguousarray(tokens, dtype=np.uint16)
    n = len(tokens)
    cuts = [np.asarray(doc_starts, dtype=np.int64)]
    if first_doc_continues or n == 0:
        cuts.append(np.array([0], dtype=np.int64))
    cuts.append(np.array([n], dtype=np.int64))
    offsets = np.unique(np.concatenate(cuts))
    if n == 0:
        offsets = np.array([0], dtype=np.int64)
    if offsets[0] != 0:
        raise ValueError("a shard must start at a document start unless first_doc_continues")
    column = pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), pa.array(tokens, pa.uint16()))
    meta = {b"first_doc_continues": b"true" if first_doc_continues else b"false", b"format": FORMAT.encode()}
    batch = pa.record_batch([column], schema=_SCHEMA.with_metadata(meta))
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, batch.schema) as writer:  # IPC file format, no compression
        writer.write_batch(batch)
    return sink.getvalue()


@dataclass
class ShardData:
    """A shard's tokens (uint16, zero-copy view) and the offsets of documents starting in it."""

    tokens: np.ndarray
    doc_starts: np.ndarray
    first_doc_continues: bool


def decode_shard(source: Any, name: str = "shard") -> ShardData:
    """Read a shard from a path (memory-mapped), a pyarrow Buffer or a NativeFile."""
    try:
        if isinstance(source, (str, os.PathLike)):
            source = pa.memory_map(os.fspath(source), "r")
        reader = ipc.open_file(source)
        if reader.num_record_batches != 1 or reader.schema.names != [TOKENS_COLUMN]:
            raise pa.ArrowInvalid("expected one record batch with one column 'tokens'")
        batch = reader.get_batch(0)
        column = batch.column(0)
        if column.type != pa.large_list(pa.uint16()):
            raise pa.ArrowInvalid(f"column 'tokens' has type {column.type}, expected large_list<uint16>")
    except (pa.ArrowInvalid, OSError) as exc:
        raise UserError(f"shard {name} is not a valid token shard: {str(exc).splitlines()[0]}") from exc
    meta = reader.schema.metadata or {}
    continues = meta.get(b"first_doc_continues") == b"true"
    offsets = column.offsets.to_numpy()
    values = column.values
    tokens = values.to_numpy(zero_copy_only=True) if len(values) else np.zeros(0, dtype=np.uint16)
    base = int(offsets[0])
    starts = offsets[:-1] - base
    if continues:
        starts = starts[1:]
    return ShardData(tokens[base : int(offsets[-1])], starts.astype(np.int64), continues)


def read_shard(loc: Location, name: str) -> ShardData:
    """Memory-map a local shard; read a remote one into memory."""
    if not loc.exists(name):
        raise UserError(f"shard {name} is missing from {loc.uri}")
    if loc.is_local:
        return decode_shard(loc.join(name), name)
    return decode_shard(pa.py_buffer(loc.read_bytes(name)), name)


def sha256_hex(data: bytes | pa.Buffer | memoryview) -> str:
    return hashlib.sha256(memoryview(data)).hexdigest()


def file_sha256(loc: Location, name: str) -> str:
    h = hashlib.sha256()
    with loc.fs.open_input_stream(loc.join(name)) as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ manifest
def manifest_bytes(manifest: dict) -> bytes:
    """Canonical JSON (sorted keys): the same manifest is always the same bytes."""
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()


def read_manifest(loc: Location) -> tuple[dict, bytes]:
    """The manifest dict and its raw bytes; UserError if the folder is not a prepared data folder."""
    if not loc.is_dir():
        raise UserError(f"data folder {loc.uri} does not exist; create it with: attnlab data prepare --out ...")
    if not loc.exists(MANIFEST):
        raise UserError(
            f"data folder {loc.uri} has no {MANIFEST} (not a prepared data folder, or prepare did not finish; "
            f"re-run attnlab data prepare)"
        )
    raw = loc.read_bytes(MANIFEST)
    try:
        manifest = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UserError(f"{loc.join(MANIFEST)} is not valid JSON: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(f"{loc.join(MANIFEST)}: field 'format' must be {FORMAT!r}")
    if manifest.get("version") != FORMAT_VERSION:
        raise UserError(
            f"{loc.join(MANIFEST)}: format version {manifest.get('version')!r} is not supported "
            f"(this attnlab reads version {FORMAT_VERSION})"
        )
    for key in ("tokenizer", "vocab_size", "eot_id", "shards"):
        if key not in manifest:
            raise UserError(f"{loc.join(MANIFEST)}: missing field {key!r}")
    return manifest, raw


def verify(path: str | os.PathLike) -> dict:
    """Re-check every shard's presence, sha256, token and document counts against the manifest.

    Returns a summary ``{"shards": n, "tokens": {"train": ..., "val": ...}, "docs": {...}}``; raises a
    one-line UserError naming every missing or corrupt shard.
    """
    loc = Location.parse(path, field="data")
    manifest, _ = read_manifest(loc)
    problems: list[str] = []
    tokens = {s: 0 for s in SPLITS}
    docs = {s: 0 for s in SPLITS}
    for entry in manifest["shards"]:
        name = entry["name"]
        if not loc.exists(name):
            problems.append(f"{name} is missing")
            continue
        if file_sha256(loc, name) != entry["sha256"]:
            problems.append(f"{name} sha256 mismatch (corrupt or changed)")
            continue
        try:
            data = read_shard(loc, name)
        except UserError as exc:
            problems.append(str(exc))
            continue
        if len(data.tokens) != entry["num_tokens"] or len(data.doc_starts) != entry["num_docs"]:
            problems.append(
                f"{name} holds {len(data.tokens)} tokens / {len(data.doc_starts)} docs, manifest says "
                f"{entry['num_tokens']} / {entry['num_docs']}"
            )
            continue
        if len(data.tokens) and int(data.tokens.max()) >= manifest["vocab_size"]:
            problems.append(f"{name} holds a token id >= vocab_size {manifest['vocab_size']}")
            continue
        tokens[entry["split"]] += entry["num_tokens"]
        docs[entry["split"]] += entry["num_docs"]
    if problems:
        raise UserError(f"verify {loc.uri}: {len(problems)} problem(s): " + "; ".join(problems))
    return {"shards": len(manifest["shards"]), "tokens": tokens, "docs": docs}
