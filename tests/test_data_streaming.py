"""Prepared data in a bucket: opened by its manifest, streamed by ranged reads, fetched once per node, memory-mapped.

A counting HTTP proxy on 127.0.0.1 (``bench/streamkit``) sits in front of the session's moto S3 server and records
every request's method, key and response bytes, so the tests count what really went over the wire. The dataset
(10 MiB: 4 train shards and a val shard of 2 MiB) is written with the real shard writer (random uint16 tokens with
document starts; no tokenising) and uploaded once per module. How memory and the time to the first steps scale
with the dataset's size (1 GiB against 50 MiB) is measured by ``bench/streaming.py``, not here.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from attnlab.data.shards import MANIFEST, encode_shard, sha256_hex
from attnlab.location import Location

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from streamkit import CountingProxy, shard_sizes, write_dataset  # noqa: E402

SHARD_TOKENS = 2**20  # 2 MiB shards: a second download of one shows above the ranged reads' 1 MiB allowance
TRAIN_SHARDS = 4  # windows of a batch fall in different shards, and the two workers' fetches start at different ones
TRAIN_TOKENS = TRAIN_SHARDS * SHARD_TOKENS
VAL_TOKENS = SHARD_TOKENS


@pytest.fixture(scope="module")
def proxy(s3_server, tmp_path_factory):
    p = CountingProxy(s3_server, str(tmp_path_factory.mktemp("proxy") / "requests.log"))
    saved = os.environ["AWS_ENDPOINT_URL"]
    os.environ["AWS_ENDPOINT_URL"] = p.url  # this process and (forwarded AWS_*) every Train worker go through it
    yield p
    os.environ["AWS_ENDPOINT_URL"] = saved
    p.close()


@pytest.fixture(scope="module")
def dataset(s3_server):
    """(uri, manifest, {bucket/key: size in bytes}) of a 10 MiB dataset in a bucket of its own."""
    import boto3

    bucket = f"attnlab-stream-{os.getpid()}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/data"
    manifest = write_dataset(uri, TRAIN_TOKENS, shard_tokens=SHARD_TOKENS, val_tokens=VAL_TOKENS, seed=1)
    return uri, manifest, shard_sizes(uri, manifest)


# ---------------------------------------------------------------------------------------------- tests
def test_opening_reads_the_manifest_only_and_windows_match_the_shards(dataset, proxy, tmp_path, monkeypatch):
    """Opening a bucket folder GETs only the manifest; windows served by ranged reads equal those read from the
    cached, memory-mapped copy; a split is read when first used."""
    from attnlab.data.readers.tokens import TokenShards, TrainSampler
    from attnlab.data.readers.shard_cache import cached_path

    uri, manifest, _ = dataset
    monkeypatch.setenv("ATTNLAB_DATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ATTNLAB_DATA_PREFETCH", "0")
    mark = proxy.mark()
    shards = TokenShards.open(uri)
    assert shards.num_tokens("train") == TRAIN_TOKENS and shards.num_tokens("val") == VAL_TOKENS
    read = proxy.get_bytes(mark)
    assert f"{uri[5:]}/{MANIFEST}" in read and not proxy.get_bytes(mark, ".arrow")  # the manifest, no shard

    sampler = TrainSampler(shards, seq_len=64, global_batch=32, seed=3)
    x_remote, _ = sampler.batch(5)
    got = proxy.get_bytes(mark, ".arrow")
    assert len(got) > 1  # the batch's windows fell in more than one shard
    assert sum(got.values()) < 32 * 1024 + 64 * 1024 * TRAIN_SHARDS  # windows plus one metadata head per touched shard
    assert not any("val-" in k for k in got)  # the val split was never touched
    assert not os.path.exists(tmp_path / "cache") or not os.listdir(tmp_path / "cache")

    monkeypatch.setenv("ATTNLAB_DATA_PREFETCH", "1")
    fetched = TokenShards.open(uri)
    fetched.prefetch("train")
    for e in manifest["shards"]:
        if e["split"] == "train":
            assert os.path.exists(cached_path(e["sha256"], str(tmp_path / "cache")))
    x_local, _ = TrainSampler(fetched, seq_len=64, global_batch=32, seed=3).batch(5)
    assert (x_local == x_remote).all()
    local_part = fetched.tokens("train").parts[0]
    assert local_part.local() is not None and isinstance(local_part.local(), np.memmap | np.ndarray)
    assert (shards.doc_offsets("train") == fetched.doc_offsets("train")).all()


def test_a_changed_shard_is_refused_not_cached(s3_bucket, proxy, tmp_path):
    """A shard whose bytes do not match the manifest's sha256 never lands in the cache."""
    from attnlab.data.readers.shard_cache import fetch
    from attnlab.errors import UserError

    loc = Location.parse(f"{s3_bucket}/tiny")
    data = encode_shard(np.arange(100, dtype=np.uint16), np.array([0]), False)
    loc.write_bytes("train-00000.arrow", data)
    with pytest.raises(UserError, match="does not match its manifest sha256"):
        fetch(loc, "train-00000.arrow", "0" * 64, root=str(tmp_path))
    assert os.listdir(tmp_path) == ["0" * 64 + ".lock"]
    path = fetch(loc, "train-00000.arrow", sha256_hex(data), root=str(tmp_path))
    assert hashlib.sha256(open(path, "rb").read()).hexdigest() == sha256_hex(data)


@pytest.mark.ray
def test_training_from_a_bucket_streams_and_fetches_each_shard_once(dataset, proxy, ray_session, tmp_path,
                                                                     monkeypatch):
    """A real 2-worker Ray Train run from the bucket finishes; each shard is downloaded at most once on this node
    (the two workers' background fetches share the node's cache), and every shard in the cache is whole."""
    from attnlab.train import load_train_config
    from attnlab.train.ray_train import run_training

    uri, manifest, sizes = dataset
    cache = tmp_path / "cache"
    monkeypatch.setenv("ATTNLAB_DATA_CACHE", str(cache))
    cfg = load_train_config(dict(preset="tiny", data=uri, steps=3, tokens_per_step=1024, micro_batch=4, lr=3e-3,
                                 warmup_steps=1, log_every=1, val_every=3, val_tokens=2048, checkpoint_every=3,
                                 workers=2, cpus_per_worker=0.5, threads_per_worker=1, max_failures=0))
    mark = proxy.mark()
    result = run_training(cfg, tmp_path / "run")
    assert result.status == "finished", result
    got = proxy.get_bytes(mark, ".arrow")
    assert got and set(got) <= set(sizes), got
    for key, n in got.items():  # one download plus small ranged reads (metadata heads, windows); never two
        assert n < sizes[key] + 2**20, (key, n, sizes[key])
    names = os.listdir(cache)
    arrows = [n for n in names if n.endswith(".arrow")]
    by_sha = {e["sha256"]: f"{uri[5:]}/{e['name']}" for e in manifest["shards"]}
    assert arrows, names  # the workers fetched into the cache (else the count above proves nothing)
    for n in arrows:  # every cached shard is whole (its sha256 was checked before the rename)
        assert os.path.getsize(cache / n) == sizes[by_sha[n[:-len(".arrow")]]], n


def test_prepare_into_a_bucket_reads_no_intermediate_file_back_and_resumes(s3_bucket, proxy, tmp_path):
    """``data prepare --out s3://...`` (the demo corpus, ~2.1M tokens in 8 shards: tokenising more would take
    minutes, and the count it guards grows with the number of shards, not their size): killed while writing
    shards and run again, it downloads less than the dataset's size in all, uploads only the shards and the
    manifest, and writes the same bytes as a local run."""
    from attnlab.data import prepare, verify
    from attnlab.data.pipeline.prepare import local_work_dir
    from conftest import s3_keys
    from fault_injection import slowed

    kw = dict(shard_tokens=300_000, val_tokens=150_000, seed=7)
    ref = tmp_path / "ref"
    prepare("demo", out=str(ref), workers=1, progress=False, **kw)
    out = f"{s3_bucket}/demo"
    mark = proxy.mark()
    code = ("import sys; from attnlab.data import prepare; "
            f"prepare('demo', out={out!r}, workers=1, progress=False, **{kw!r})")
    proc = subprocess.Popen([sys.executable, "-c", slowed(code, 0.3)])
    try:
        deadline = time.time() + 120
        while "demo/train-00001.arrow" not in s3_keys(s3_bucket):
            assert proc.poll() is None and time.time() < deadline, "prepare finished or died before it was killed"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
    assert "demo/manifest.json" not in s3_keys(s3_bucket)
    result = prepare("demo", out=out, workers=1, progress=False, **kw)
    assert result["skipped_partitions"] >= 1 and result["skipped_shards"] >= 1  # train-00000 kept, not re-read
    got = proxy.get_bytes(mark)
    loc = Location.parse(out)
    names = sorted(p.name for p in ref.iterdir())
    size = sum(loc.fs.get_file_info(loc.join(n)).size for n in names)
    assert sum(got.values()) < size, got
    assert not [k for k in got if "/_work/" in k]
    # only the shards and the manifest (and the empty folder marker pyarrow's create_dir leaves)
    assert [k for k in s3_keys(s3_bucket) if not k.endswith("/")] == [f"demo/{n}" for n in names]
    for n in names:
        assert loc.read_bytes(n) == (ref / n).read_bytes(), n
    assert not os.path.exists(local_work_dir(loc).path)
    verify(out)
