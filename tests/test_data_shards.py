"""The shard file format, the manifest and ``verify``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnlab.data import TokenShards, prepare, verify
from attnlab.data.shards import decode_shard, encode_shard
from attnlab.location import Location
from attnlab.errors import UserError
from conftest_data import small_text_corpus  # noqa: F401  (fixture)


def test_shard_roundtrip_keeps_tokens_and_document_starts(tmp_path):
    tokens = np.array([50256, 1, 2, 3, 50256, 4, 5, 50256, 6], dtype=np.uint16)
    data = encode_shard(tokens, np.array([0, 4, 7]), first_doc_continues=False)
    (tmp_path / "x.arrow").write_bytes(data.to_pybytes())
    back = decode_shard(str(tmp_path / "x.arrow"))
    assert back.tokens.tolist() == tokens.tolist()
    assert back.doc_starts.tolist() == [0, 4, 7]
    assert back.first_doc_continues is False
    assert back.tokens.dtype == np.uint16 and not back.tokens.flags.owndata  # a view of the mapped file

    # a shard whose first tokens continue the previous shard's last document
    cont = decode_shard(encode_shard(tokens[2:], np.array([2, 5]), first_doc_continues=True))
    assert cont.tokens.tolist() == tokens[2:].tolist()
    assert cont.doc_starts.tolist() == [2, 5] and cont.first_doc_continues is True
    # the same bytes for the same content
    assert encode_shard(tokens, np.array([0, 4, 7]), False).to_pybytes() == data.to_pybytes()


def test_garbage_file_is_a_user_error(tmp_path):
    (tmp_path / "bad.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(UserError, match="bad.arrow is not a valid token shard"):
        decode_shard(str(tmp_path / "bad.arrow"), "bad.arrow")


@pytest.fixture()
def prepared(tmp_path, small_text_corpus):  # noqa: F811
    folder, _ = small_text_corpus
    out = tmp_path / "out"
    prepare("text", str(folder), str(out), shard_tokens=4000, val_tokens=3000, seed=3, workers=1, progress=False)
    return out


def test_manifest_records_tokeniser_source_seed_and_every_shard(prepared):
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["tokenizer"] == "tiktoken:gpt2"
    assert manifest["vocab_size"] == 50257 and manifest["eot_id"] == 50256 and manifest["seed"] == 3
    assert manifest["source"]["kind"] == "text"
    names = sorted(p.name for p in prepared.glob("*.arrow"))
    assert [e["name"] for e in manifest["shards"]] == [n for n in names if n.startswith("train")] + [
        n for n in names if n.startswith("val")
    ]
    train = [e for e in manifest["shards"] if e["split"] == "train"]
    assert len(train) >= 3 and all(e["num_tokens"] == 4000 for e in train[:-1]) and train[-1]["num_tokens"] <= 4000
    assert sum(e["num_tokens"] for e in train) == manifest["splits"]["train"]["num_tokens"]
    assert 0 < manifest["splits"]["val"]["num_tokens"] <= 3000
    summary = verify(prepared)
    assert summary["tokens"] == {s: manifest["splits"][s]["num_tokens"] for s in ("train", "val")}
    assert not (prepared / "_work").exists()


def test_verify_names_a_flipped_byte_and_a_missing_shard(prepared):
    target = prepared / "train-00001.arrow"
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    target.write_bytes(bytes(raw))
    with pytest.raises(UserError, match=r"train-00001\.arrow sha256 mismatch") as info:
        verify(prepared)
    assert "\n" not in str(info.value) and "train-00000" not in str(info.value)
    (prepared / "val-00000.arrow").unlink()
    with pytest.raises(UserError, match=r"2 problem\(s\).*train-00001\.arrow.*val-00000\.arrow is missing"):
        verify(prepared)


def test_open_and_verify_refuse_folders_that_are_not_prepared(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        TokenShards.open(tmp_path / "nope")
    with pytest.raises(UserError, match="no manifest.json"):
        verify(tmp_path)
    (tmp_path / "manifest.json").write_text("{broken")
    with pytest.raises(UserError, match="not valid JSON"):
        TokenShards.open(tmp_path)


def test_file_uri_output_is_the_same_as_a_path(tmp_path, small_text_corpus, prepared):  # noqa: F811
    folder, _ = small_text_corpus
    out = tmp_path / "via-uri"
    prepare("text", str(folder), f"file://{out}", shard_tokens=4000, val_tokens=3000, seed=3, workers=1,
            progress=False)
    for f in prepared.glob("*.arrow"):
        assert (out / f.name).read_bytes() == f.read_bytes()
    assert Location.parse(f"file://{out}").path == str(out)
