"""Prepared data in a bucket: opened by its manifest, streamed by ranged reads, fetched once per node, memory-mapped.

A counting HTTP proxy on 127.0.0.1 sits in front of the session's moto S3 server and records every request's
method, key and response bytes, so the tests count what really went over the wire. The 1 GB dataset is written
with the real shard writer (random uint16 tokens with document starts; no tokenising) and uploaded once per module.
The proxy, the writer and the memory pollers are ``bench/streamkit``'s, shared with the benchmarks.
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
from streamkit import CountingProxy, WorkerRss, rss_anon_mb, write_dataset  # noqa: E402

BIG_TOKENS = 512 * 2**20  # 1 GiB of uint16 tokens, train split
SMALL_TOKENS = 25 * 2**20  # 50 MiB
SHARD_TOKENS = 64 * 2**20  # 128 MiB shards: the big dataset has 8 train shards
VAL_TOKENS = 2**21  # 4 MiB: a second download of it would show above the ranged reads' 1 MiB allowance


@pytest.fixture(scope="module")
def proxy(s3_server, tmp_path_factory):
    p = CountingProxy(s3_server, str(tmp_path_factory.mktemp("proxy") / "requests.log"))
    saved = os.environ["AWS_ENDPOINT_URL"]
    os.environ["AWS_ENDPOINT_URL"] = p.url  # this process and (forwarded AWS_*) every Train worker go through it
    yield p
    os.environ["AWS_ENDPOINT_URL"] = saved
    p.close()


@pytest.fixture(scope="module")
def datasets(s3_server):
    """(big uri, small uri, big manifest, big size in bytes): 1 GiB and 50 MiB datasets in one bucket."""
    import boto3

    bucket = f"attnlab-stream-{os.getpid()}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    big, small = f"s3://{bucket}/big", f"s3://{bucket}/small"
    manifest = write_dataset(big, BIG_TOKENS, shard_tokens=SHARD_TOKENS, val_tokens=VAL_TOKENS, seed=1)
    write_dataset(small, SMALL_TOKENS, shard_tokens=SHARD_TOKENS, val_tokens=VAL_TOKENS, seed=2)
    size = sum(Location.parse(big).fs.get_file_info(f"{bucket}/big/{e['name']}").size for e in manifest["shards"])
    return big, small, manifest, size


# ---------------------------------------------------------------------------------------------- tests
def test_opening_reads_the_manifest_only_and_windows_match_the_shards(datasets, proxy, tmp_path, monkeypatch):
    """Opening a bucket folder GETs only the manifest; windows served by ranged reads equal those read from the
    cached, memory-mapped copy; a split is read when first used."""
    from attnlab.data.readers.tokens import TokenShards, TrainSampler
    from attnlab.data.readers.shard_cache import cached_path

    big, _, manifest, size = datasets
    monkeypatch.setenv("ATTNLAB_DATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ATTNLAB_DATA_PREFETCH", "0")
    mark = proxy.mark()
    shards = TokenShards.open(big)
    assert shards.num_tokens("train") == BIG_TOKENS and shards.num_tokens("val") == VAL_TOKENS
    read = proxy.get_bytes(mark)
    assert f"{big[5:]}/{MANIFEST}" in read and not proxy.get_bytes(mark, ".arrow")  # the manifest, no shard

    sampler = TrainSampler(shards, seq_len=64, global_batch=32, seed=3)
    x_remote, _ = sampler.batch(5)
    got = proxy.get_bytes(mark, ".arrow")
    assert sum(got.values()) < 32 * 1024 + 64 * 1024 * 8  # windows plus one metadata head per touched shard
    assert not any("val-" in k for k in got)  # the val split was never touched
    assert not os.path.exists(tmp_path / "cache") or not os.listdir(tmp_path / "cache")

    monkeypatch.setenv("ATTNLAB_DATA_PREFETCH", "1")
    fetched = TokenShards.open(big)
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
def test_training_from_a_bucket_streams_and_fetches_each_shard_once(datasets, proxy, ray_session, tmp_path,
                                                                     monkeypatch):
    """A real 2-worker Ray Train run on 1 GiB in the bucket: the driver's and each worker's anonymous memory grow
    by less than 10% of the dataset during the steps (beyond what the same run grows on 50 MiB), each shard is downloaded at most
    once on this node, and the run's time to its first steps is within 1.5x of the 50 MiB run's."""
    from attnlab.train import load_train_config
    from attnlab.train.ray_train import run_training

    big, small, manifest, size = datasets
    cache = tmp_path / "cache"
    monkeypatch.setenv("ATTNLAB_DATA_CACHE", str(cache))

    def run(data, name):
        cfg = load_train_config(dict(preset="tiny", data=data, steps=3, tokens_per_step=1024, micro_batch=4,
                                     lr=3e-3, warmup_steps=1, log_every=1, val_every=3, val_tokens=2048,
                                     checkpoint_every=3, workers=2, cpus_per_worker=0.5, threads_per_worker=1,
                                     max_failures=0))
        poll = WorkerRss(str(tmp_path / name / "metrics.jsonl"))
        result = run_training(cfg, tmp_path / name)
        peaks = poll.stop()
        assert result.status == "finished" and poll.first_step is not None, result
        return poll.first_step, (peaks, poll.growth_after_first_step(), poll.at_first_step)

    run(small, "warm")  # imports, Ray Train start-up paths and the small dataset's cache, out of the way
    t_small, rss_small = run(small, "small")
    driver_before = rss_anon_mb()
    mark = proxy.mark()
    t_big, rss_big = run(big, "big")
    driver_growth = driver_before and rss_anon_mb() - driver_before
    got = proxy.get_bytes(mark, ".arrow")
    (peaks_small, growth_small, first_small), (peaks_big, growth_big, first_big) = rss_small, rss_big
    print(f"\nfirst steps: 50 MiB {t_small:.1f} s, 1 GiB {t_big:.1f} s; worker RssAnon peaks 50 MiB "
          f"{sorted(peaks_small.values())}, 1 GiB {sorted(peaks_big.values())} MB; growth after the first step "
          f"50 MiB {sorted(round(g) for g in growth_small.values())}, 1 GiB "
          f"{sorted(round(g) for g in growth_big.values())} MB; at the first step 50 MiB "
          f"{sorted(round(g) for g in first_small.values())}, 1 GiB {sorted(round(g) for g in first_big.values())} MB; "
          f"driver growth {driver_growth:.0f} MB; "
          f"shard GET bytes {sum(got.values()) / 2**20:.0f} MiB of {size / 2**20:.0f} MiB")

    tenth_mb = 0.1 * size / 2**20
    assert driver_growth < tenth_mb
    # Each worker's anonymous memory during the training steps, while the 1 GiB is fetched into the cache (the shard
    # GET bytes below). A worker's peak varies by ~100 MB from run to run and rank to rank, and the steps themselves
    # add ~300 MB after the first (optimiser state, checkpoint, validation) whatever the data: what the data adds is
    # the growth on 1 GiB beyond the growth on 50 MiB, each measured from the worker's own first step. Opening the
    # data (before the first step) reads no shard into memory: the workers' anonymous memory at the first step is
    # that of the 50 MiB run (it read every shard whole before: +1 GiB per worker).
    assert len(growth_big) == 2 and len(growth_small) == 2
    growth = {"50 MiB": [max(growth_small.values())], "1 GiB": [max(growth_big.values())]}
    first = {"50 MiB": [max(first_small.values())], "1 GiB": [max(first_big.values())]}
    if growth["1 GiB"][0] - growth["50 MiB"][0] >= tenth_mb or first["1 GiB"][0] - first["50 MiB"][0] >= tenth_mb:
        # Within the run-to-run spread of ~100 MB of the bound (a clean-clone CI measured 107 MB against 103 MB once):
        # measure both once more, the 1 GiB run from an empty cache again, and compare the lesser of each, as
        # benchmarks do. Reading the data whole would add ~1 GiB per worker to every run, however often measured.
        for data, name, label in ((small, "small-mem", "50 MiB"), (big, "big-mem", "1 GiB")):
            if label == "1 GiB":
                monkeypatch.setenv("ATTNLAB_DATA_CACHE", str(tmp_path / "cache-mem"))
            _, (_, again, at_first) = run(data, name)
            growth[label].append(max(again.values()))
            first[label].append(max(at_first.values()))
        print(f"again: growth after the first step {growth}, at the first step {first} (MB, per run)")
        monkeypatch.setenv("ATTNLAB_DATA_CACHE", str(cache))
    assert min(growth["1 GiB"]) - min(growth["50 MiB"]) < tenth_mb, growth
    assert min(first["1 GiB"]) - min(first["50 MiB"]) < tenth_mb, first
    if t_big >= 1.5 * t_small:
        # A wall-clock comparison on a 2-core machine that also runs the bucket server: measure both once more
        # (an empty cache again for the 1 GiB run) and compare the faster of each, as benchmarks do.
        monkeypatch.setenv("ATTNLAB_DATA_CACHE", str(tmp_path / "cache-again"))
        t_small = min(t_small, run(small, "small-again")[0])
        t_big = min(t_big, run(big, "big-again")[0])
        print(f"again: first steps 50 MiB {t_small:.1f} s, 1 GiB {t_big:.1f} s (the faster of two runs each)")
    assert t_big < 1.5 * t_small
    sizes = {f"{big[5:]}/{e['name']}": None for e in manifest["shards"]}
    fs = Location.parse(big).fs
    for key in sizes:
        sizes[key] = fs.get_file_info(key).size
    for key, n in got.items():  # one download plus small ranged reads (metadata heads, windows); never two
        assert n < sizes[key] + 2**20, (key, n, sizes[key])
    names = os.listdir(cache) if cache.exists() else []
    arrows = [n for n in names if n.endswith(".arrow")]
    assert len(arrows) == len(set(arrows))
    by_sha = {e["sha256"]: f"{big[5:]}/{e['name']}" for e in manifest["shards"]}
    for n in arrows:  # every cached shard of the big dataset is whole (its sha256 was checked before the rename)
        if n[:-len(".arrow")] in by_sha:
            assert os.path.getsize(cache / n) == sizes[by_sha[n[:-len(".arrow")]]]


def test_prepare_into_a_bucket_reads_no_intermediate_file_back_and_resumes(s3_bucket, proxy, tmp_path):
    """``data prepare --out s3://...`` (the demo corpus, ~2.1M tokens in 8 shards: tokenising more would take
    minutes, and the count it guards grows with the number of shards, not their size): killed while writing
    shards and run again, it downloads less than the dataset's size in all, uploads only the shards and the
    manifest, and writes the same bytes as a local run."""
    from attnlab.data import prepare, verify
    from attnlab.data.pipeline.prepare import local_work_dir
    from conftest import s3_keys

    kw = dict(shard_tokens=300_000, val_tokens=150_000, seed=7)
    ref = tmp_path / "ref"
    prepare("demo", out=str(ref), workers=1, progress=False, **kw)
    out = f"{s3_bucket}/demo"
    mark = proxy.mark()
    code = ("import sys; from attnlab.data import prepare; "
            f"prepare('demo', out={out!r}, workers=1, progress=False, **{kw!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "ATTNLAB_DATA_THROTTLE_S": "0.3"})
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
