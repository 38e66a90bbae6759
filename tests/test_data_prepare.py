"""``prepare``: real tokens in the recorded order, determinism across workers, kill-and-resume, bad input,
the fineweb source's real code path on a local folder laid out like the hub dataset, and the CLI."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from attnlab.data import EOT_ID, TokenShards, get_encoding, prepare, verify
from attnlab.errors import UserError
from conftest_data import small_text_corpus  # noqa: F401  (fixture)
from fault_injection import slowed

DEMO_KW = dict(shard_tokens=300_000, val_tokens=150_000, seed=7)


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _expected_stream(docs: list[str], seed: int, val_tokens: int) -> tuple[list[int], list[int]]:
    """The documented recipe, computed independently: EOT + tokens per doc, PCG64(seed) order, val prefix."""
    enc = get_encoding()
    encoded = [[EOT_ID] + enc.encode_ordinary(d) for d in docs]
    order = np.random.Generator(np.random.PCG64(seed)).permutation(len(encoded))
    val, train, used, in_val = [], [], 0, True
    for i in order:
        if in_val and used + len(encoded[i]) <= val_tokens:
            val += encoded[i]
            used += len(encoded[i])
        else:
            in_val = False
            train += encoded[i]
    return train, val


def test_shards_hold_tiktokens_encoding_of_the_documents_in_the_recorded_order(tmp_path, small_text_corpus):  # noqa: F811
    folder, docs = small_text_corpus
    out = tmp_path / "out"
    result = prepare("text", str(folder), str(out), shard_tokens=2500, val_tokens=4000, seed=42, workers=1,
                     progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["seed"] == 42 and manifest["val_tokens"] == 4000
    train, val = _expected_stream(docs, seed=manifest["seed"], val_tokens=manifest["val_tokens"])
    ds = TokenShards.open(out)
    assert np.asarray(ds.tokens("train")).tolist() == train
    assert np.asarray(ds.tokens("val")).tolist() == val
    assert result["tokens"] == len(train) + len(val) == sum(len(get_encoding().encode_ordinary(d)) + 1 for d in docs)
    # another seed: same documents, another order
    other = prepare("text", str(folder), str(tmp_path / "seed43"), shard_tokens=2500, val_tokens=4000, seed=43,
                    workers=1, progress=False)
    ds43 = TokenShards.open(tmp_path / "seed43")
    assert np.asarray(ds43.tokens("train")).tolist() != train
    assert other["tokens"] == result["tokens"]


@pytest.fixture(scope="module")
def demo_reference(tmp_path_factory):
    """The demo corpus prepared serially (workers=1), uninterrupted: the bytes every other run must match."""
    out = tmp_path_factory.mktemp("ref") / "demo"
    prepare("demo", out=str(out), workers=1, progress=False, **DEMO_KW)
    return out


@pytest.mark.ray
def test_two_ray_workers_write_the_same_bytes_as_one(tmp_path, demo_reference, ray_session):
    ref = _files(demo_reference)
    assert len([n for n in ref if n.startswith("train-")]) >= 6
    out = tmp_path / "parallel"
    result = prepare("demo", out=str(out), workers=2, progress=False, **DEMO_KW)
    assert result["tokens_per_s"] > 0
    assert _files(out) == ref


def _spawn(out, log):
    code = (
        "import sys; from attnlab.data import prepare\n"
        f"prepare('demo', out={str(out)!r}, workers=1, progress=False, shard_tokens={DEMO_KW['shard_tokens']}, "
        f"val_tokens={DEMO_KW['val_tokens']}, seed={DEMO_KW['seed']})\n"
    )
    return subprocess.Popen([sys.executable, "-c", slowed(code, 0.3)], stdout=log, stderr=log)


def _kill_when(proc, condition, timeout=90.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return
        assert proc.poll() is None, "prepare finished or died before it could be killed"
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("timed out waiting to kill prepare")


def test_resume_after_sigkill_gives_byte_identical_shards(tmp_path, demo_reference):
    out = tmp_path / "killed"
    with open(tmp_path / "log.txt", "w") as log:
        # 1st run: killed while tokenising (after two of the partitions are written)
        proc = _spawn(out, log)
        _kill_when(proc, lambda: len(list((out / "_work").glob("part-*.arrow"))) >= 2)
        assert proc.returncode == -signal.SIGKILL
        assert not (out / "manifest.json").exists()
        # 2nd run: resumes, killed while writing shards (after train-00001 exists)
        proc = _spawn(out, log)
        _kill_when(proc, lambda: (out / "train-00001.arrow").exists())
        assert not (out / "manifest.json").exists()
    # 3rd run, in this process: finishes the job, skipping what is done
    result = prepare("demo", out=str(out), workers=1, progress=False, **DEMO_KW)
    assert result["skipped_partitions"] >= 2 and result["skipped_shards"] >= 2
    assert _files(out) == _files(demo_reference)
    assert not (out / "_work").exists() and not [p for p in out.iterdir() if ".tmp-" in p.name]
    verify(out)
    # a 4th run with the same arguments has nothing to do
    assert prepare("demo", out=str(out), workers=1, progress=False, **DEMO_KW)["already_prepared"] is True


# ---------------------------------------------------------------------------------------------- bad input
def test_missing_path_and_unknown_source(tmp_path):
    with pytest.raises(UserError, match=r"--path .*nope.* does not exist"):
        prepare("text", str(tmp_path / "nope"), str(tmp_path / "out"))
    with pytest.raises(UserError, match="glob matches no files"):
        prepare("parquet", str(tmp_path / "*.parquet"), str(tmp_path / "out"))
    with pytest.raises(UserError, match="--source 'csv' is unknown; allowed: fineweb, parquet, jsonl, text, demo"):
        prepare("csv", str(tmp_path), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_empty_corpus_writes_nothing(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    with pytest.raises(UserError, match="empty corpus, the folder holds no .txt/.md files"):
        prepare("text", str(corpus), str(tmp_path / "out"))
    (corpus / "a.txt").write_text("   \n")
    (corpus / "b.md").write_text("")
    with pytest.raises(UserError, match="empty corpus") as info:
        prepare("text", str(corpus), str(tmp_path / "out"), workers=1, progress=False)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_missing_text_column_parquet_and_jsonl(tmp_path, small_text_corpus):  # noqa: F811
    _, docs = small_text_corpus
    pq.write_table(pa.table({"content": docs[:10], "id": list(range(10))}), tmp_path / "a.parquet")
    with pytest.raises(UserError, match=r"text column 'text' is missing in .*a\.parquet; its columns are \['content', 'id'\]"):
        prepare("parquet", str(tmp_path / "a.parquet"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    result = prepare("parquet", str(tmp_path / "a.parquet"), str(tmp_path / "out"), text_column="content",
                     val_tokens=0, workers=1, progress=False)
    assert result["tokens"] == sum(len(get_encoding().encode_ordinary(d)) + 1 for d in docs[:10])
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"body": d}) for d in docs[:5]))
    with pytest.raises(UserError, match=r"text column 'text' is missing in .*b\.jsonl:1; its columns are \['body'\]"):
        prepare("jsonl", str(tmp_path / "b.jsonl"), str(tmp_path / "out2"))
    assert not (tmp_path / "out2").exists()


def test_jsonl_source_reads_the_named_column(tmp_path, small_text_corpus):  # noqa: F811
    _, docs = small_text_corpus
    for k in range(3):
        with open(tmp_path / f"part{k}.jsonl", "w") as f:
            for d in docs[k * 20 : (k + 1) * 20]:
                f.write(json.dumps({"body": d, "id": 1}) + "\n")
    out = tmp_path / "out"
    prepare("jsonl", str(tmp_path / "part*.jsonl"), str(out), text_column="body", val_tokens=0, seed=1, workers=1,
            progress=False)
    train, _ = _expected_stream(docs[:60], seed=1, val_tokens=0)
    assert np.asarray(TokenShards.open(out).tokens("train")).tolist() == train


def test_hub_dataset_without_network_suggests_a_local_source(tmp_path):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    with pytest.raises(UserError, match="cannot reach the Hugging Face hub .*HuggingFaceFW/fineweb.*--source parquet") as info:
        prepare("fineweb", None, str(tmp_path / "out"))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_output_folder_from_another_seed_or_tokeniser_is_refused_and_kept(tmp_path, small_text_corpus):  # noqa: F811
    folder, _ = small_text_corpus
    out = tmp_path / "out"
    kw = dict(shard_tokens=5000, val_tokens=2000, workers=1, progress=False)
    prepare("text", str(folder), str(out), seed=0, **kw)
    before = _files(out)
    with pytest.raises(UserError, match=r"already holds shards prepared with seed=0 \(this run: seed=1\)"):
        prepare("text", str(folder), str(out), seed=1, **kw)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["tokenizer"] = "tiktoken:cl100k_base"
    (out / "manifest.json").write_text(json.dumps(manifest))
    before["manifest.json"] = (out / "manifest.json").read_bytes()
    with pytest.raises(UserError, match=r'tokenizer="tiktoken:cl100k_base" \(this run: tokenizer="tiktoken:gpt2"\)'):
        prepare("text", str(folder), str(out), seed=0, **kw)
    assert _files(out) == before
    # shards with no manifest or plan: unknown origin
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "train-00000.arrow").write_bytes(before["train-00000.arrow"])
    with pytest.raises(UserError, match="without a manifest or plan"):
        prepare("text", str(folder), str(stray), seed=0, **kw)


# ------------------------------------------------------------------------------------------------ fineweb
FINEWEB_README = """---
configs:
- config_name: sample-10BT
  data_files:
  - split: train
    path: sample/10BT/*
dataset_info:
  features:
  - {name: text, dtype: string}
  - {name: id, dtype: string}
  - {name: dump, dtype: string}
  - {name: url, dtype: string}
  - {name: date, dtype: string}
  - {name: file_path, dtype: string}
  - {name: language, dtype: string}
  - {name: language_score, dtype: float64}
  - {name: token_count, dtype: int64}
---
"""


def _fineweb_table(docs: list[str], offset: int) -> pa.Table:
    n = len(docs)
    enc = get_encoding()
    return pa.table({
        "text": docs,
        "id": [f"<urn:uuid:{offset + i:08d}-0000-0000-0000-000000000000>" for i in range(n)],
        "dump": ["CC-MAIN-2024-10"] * n,
        "url": [f"https://example.org/{offset + i}" for i in range(n)],
        "date": ["2024-02-20T00:00:00Z"] * n,
        "file_path": ["s3://commoncrawl/x.warc.gz"] * n,
        "language": ["en"] * n,
        "language_score": pa.array([0.95] * n, pa.float64()),
        "token_count": pa.array([len(enc.encode_ordinary(d)) for d in docs], pa.int64()),
    })


def test_fineweb_source_on_a_local_folder_laid_out_like_the_hub(tmp_path, small_text_corpus):  # noqa: F811
    _, docs = small_text_corpus
    repo = tmp_path / "fineweb_local"
    (repo / "sample" / "10BT").mkdir(parents=True)
    (repo / "README.md").write_text(FINEWEB_README)
    pq.write_table(_fineweb_table(docs[:50], 0), repo / "sample" / "10BT" / "000_00000.parquet")
    pq.write_table(_fineweb_table(docs[50:], 50), repo / "sample" / "10BT" / "001_00000.parquet")
    assert os.environ.get("HF_DATASETS_OFFLINE") == "1"
    out = tmp_path / "fw"
    prepare("fineweb", str(repo), str(out), name="sample-10BT", val_tokens=3000, seed=9, workers=1, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"] == {"kind": "fineweb", "path": str(repo), "name": "sample-10BT", "text_column": "text"}
    train, val = _expected_stream(docs, seed=9, val_tokens=3000)
    ds = TokenShards.open(out)
    assert np.asarray(ds.tokens("train")).tolist() == train and np.asarray(ds.tokens("val")).tolist() == val
    # the same files through the plain parquet source give the same shards
    prepare("parquet", str(repo / "sample" / "10BT" / "*.parquet"), str(tmp_path / "pq"), val_tokens=3000, seed=9,
            workers=1, progress=False)
    fw, pqf = _files(out), _files(tmp_path / "pq")
    assert {k: v for k, v in fw.items() if k.endswith(".arrow")} == {k: v for k, v in pqf.items() if k.endswith(".arrow")}
    with pytest.raises(UserError, match=r"--name 'sample-100BT' is not a config of dataset .*sample-10BT"):
        prepare("fineweb", str(repo), str(tmp_path / "bad"), name="sample-100BT")


# ---------------------------------------------------------------------------------------------------- CLI
def _cli(argv: list[str]) -> int:
    from attnlab.data.cli import add_parser

    parser = argparse.ArgumentParser(prog="attnlab")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_prepare_and_verify(tmp_path, small_text_corpus, capsys):  # noqa: F811
    folder, _ = small_text_corpus
    out = tmp_path / "cli"
    assert _cli(["data", "prepare", "--source", "text", "--path", str(folder), "--out", str(out), "--shard-tokens",
                 "1e4", "--val-tokens", "2000", "--seed", "4", "--workers", "1", "--quiet"]) == 0
    assert "tokens/s" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["shard_tokens"] == 10_000 and manifest["seed"] == 4
    assert _cli(["data", "verify", str(out)]) == 0
    assert capsys.readouterr().out.startswith("ok: ")
    with pytest.raises(UserError, match="no manifest.json"):
        _cli(["data", "verify", str(tmp_path)])
    with pytest.raises(SystemExit) as info:
        _cli(["data", "prepare", "--help"])
    assert info.value.code == 0
    assert "--val-tokens" in capsys.readouterr().out


def test_split_and_shard_plan_by_hand():
    from attnlab.data.pipeline.prepare import plan_shards, split_documents

    lengths = np.array([5, 3, 8, 2, 6], dtype=np.int64)
    order = np.random.Generator(np.random.PCG64(0)).permutation(5).tolist()
    val, train = split_documents(lengths, seed=0, val_tokens=9)
    cum = np.cumsum(lengths[order]).tolist()
    k = sum(1 for c in cum if c <= 9)
    assert val.tolist() == order[:k] and train.tolist() == order[k:]
    # a budget below the first document takes the first one in shuffled order that fits
    val, train = split_documents(np.array([10, 10, 2, 10]), seed=1, val_tokens=3)
    assert val.tolist() == [2] and sorted(train.tolist()) == [0, 1, 3]
    with pytest.raises(UserError, match="smaller than every document"):
        split_documents(np.array([10, 10]), seed=1, val_tokens=3)
    # docs 0..2 of lengths 5, 3, 8 cut into 6-token shards: [0:6) [6:12) [12:16)
    shards = plan_shards("train", np.array([0, 1, 2]), np.array([5, 3, 8]), 6)
    assert [s["num_tokens"] for s in shards] == [6, 6, 4]
    assert [s["doc_ids"].tolist() for s in shards] == [[0, 1], [1, 2], [2]]
    assert [s["piece_lo"].tolist() for s in shards] == [[0, 0], [1, 0], [4]]
    assert [s["piece_hi"].tolist() for s in shards] == [[5, 1], [3, 4], [8]]
    assert [s["first_doc_continues"] for s in shards] == [False, True, True]
    assert [s["name"] for s in shards] == ["train-00000.arrow", "train-00001.arrow", "train-00002.arrow"]


# ------------------------------------------------------------------------------------------------ bytes
def test_byte_tokens_are_the_documents_utf8_bytes_in_the_recorded_order(tmp_path, small_text_corpus):  # noqa: F811
    """``--tokenizer bytes``: every document is 256 + its UTF-8 bytes, the same shuffle and split as GPT-2 data,
    and the manifest (so the data fingerprint) names the tokeniser."""
    from attnlab.data.readers.tokens import TextData
    from attnlab.data.tokenizer import decode_bytes

    folder, docs = small_text_corpus
    kw = dict(shard_tokens=20_000, val_tokens=12_000, seed=42, workers=1, progress=False)
    prepare("text", str(folder), str(tmp_path / "bytes"), tokenizer="bytes", **kw)
    manifest = json.loads((tmp_path / "bytes" / "manifest.json").read_text())
    assert (manifest["tokenizer"], manifest["vocab_size"], manifest["eot_id"]) == ("bytes:utf-8", 257, 256)
    encoded = [[256] + list(d.encode("utf-8")) for d in docs]  # the recipe, by hand
    order = np.random.Generator(np.random.PCG64(42)).permutation(len(encoded))
    val, train, in_val = [], [], True
    for i in order:
        if in_val and len(val) + len(encoded[i]) <= 12_000:
            val += encoded[i]
        else:
            in_val = False
            train += encoded[i]
    ds = TokenShards.open(tmp_path / "bytes")
    assert np.asarray(ds.tokens("train")).tolist() == train and np.asarray(ds.tokens("val")).tolist() == val
    # round trip: the separators cut the stream back into the documents, byte for byte (multi-byte UTF-8 too)
    stream = np.asarray(ds.tokens("val")).tolist() + np.asarray(ds.tokens("train")).tolist()
    cut = np.flatnonzero(np.asarray(stream) == 256).tolist() + [len(stream)]
    texts = [decode_bytes(stream[a:b]) for a, b in zip(cut[:-1], cut[1:])]
    assert sorted(texts) == sorted(docs) and any("東京" in t for t in texts)
    # the same folder with GPT-2 tokens: another fingerprint, and neither run may reuse the other's folder
    prepare("text", str(folder), str(tmp_path / "gpt2"), **kw)
    assert TextData(str(tmp_path / "gpt2")).fingerprint != TextData(str(tmp_path / "bytes")).fingerprint
    assert TextData(str(tmp_path / "bytes")).vocab_size == 257
    before = _files(tmp_path / "bytes")
    with pytest.raises(UserError, match=r'tokenizer="bytes:utf-8" \(this run: tokenizer="tiktoken:gpt2"\)'):
        prepare("text", str(folder), str(tmp_path / "bytes"), **kw)
    assert _files(tmp_path / "bytes") == before
    with pytest.raises(UserError, match=r"^--tokenizer='bpe' is not allowed: use one of gpt2, bytes$"):
        prepare("text", str(folder), str(tmp_path / "bad"), tokenizer="bpe", **kw)
    assert not (tmp_path / "bad").exists()


def test_cli_prepares_bytes_and_refuses_an_unknown_tokenizer(tmp_path, small_text_corpus, capsys):  # noqa: F811
    from attnlab.cli import main

    folder, _ = small_text_corpus
    assert main(["data", "prepare", "--source", "text", "--path", str(folder), "--out", str(tmp_path / "b"),
                 "--tokenizer", "bytes", "--workers", "1", "--quiet"]) == 0
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["tokenizer"] == "bytes:utf-8"
    with pytest.raises(SystemExit):
        main(["data", "prepare", "--source", "text", "--path", str(folder), "--out", str(tmp_path / "c"),
              "--tokenizer", "bpe"])
    assert "argument --tokenizer: invalid choice: 'bpe' (choose from 'gpt2', 'bytes')" in capsys.readouterr().err
