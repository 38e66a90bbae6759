"""The GPT-2 tokeniser works offline from the packaged BPE files and gives the real GPT-2 ids."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np

from attnlab.data.tokenizer import EOT_ID, GPT2_VOCAB, encode_document, get_encoding, seed_tiktoken_cache


def test_real_gpt2_ids():
    enc = get_encoding()
    assert enc.name == "gpt2" and enc.n_vocab == GPT2_VOCAB == 50257 and enc.eot_token == EOT_ID == 50256
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.encode_ordinary(" Hello world") == [18435, 995]
    assert enc.encode_ordinary("The quick brown fox jumps over the lazy dog.") == [
        464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13
    ]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]


def test_encode_document_prepends_eot_and_treats_special_strings_as_text():
    enc = get_encoding()
    text = "Hello world <|endoftext|> naïve 🙂"
    doc = encode_document(text)
    assert doc.dtype == np.uint16
    assert doc.tolist() == [EOT_ID] + enc.encode_ordinary(text)
    assert doc.tolist()[:3] == [50256, 15496, 995]
    assert EOT_ID not in doc.tolist()[1:]  # the literal string is ordinary text
    assert enc.decode(doc.tolist()[1:]) == text
    assert encode_document("").tolist() == [EOT_ID]


def test_seed_is_idempotent_and_writes_the_hashed_files(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    assert seed_tiktoken_cache() is True
    assert seed_tiktoken_cache() is True
    names = sorted(os.listdir(tmp_path))
    assert names == ["6c7ea1a7e38e3a7f062df639a5b80947f075ffe6", "6d1cbeee0f20b3d9449abfede4726ed8212e3aee"]
    digests = {hashlib.sha256((tmp_path / n).read_bytes()).hexdigest() for n in names}
    assert digests == {
        "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
        "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    }


def test_fresh_process_loads_gpt2_with_network_blocked(tmp_path):
    """A new process, an empty cache and every HTTP(S) request sent to a dead proxy: still works."""
    code = (
        "from attnlab.data.tokenizer import get_encoding\n"
        "print(get_encoding().encode_ordinary('Hello world'))\n"
    )
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(tmp_path / "cache"), HTTPS_PROXY="http://127.0.0.1:9",
               HTTP_PROXY="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9", http_proxy="http://127.0.0.1:9")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[15496, 995]"
