"""Benchmark: end-to-end ``prepare`` throughput vs the raw tokeniser (not a test; prints figures).

Corpus: the offline demo texts cut into ~4 KB documents (FineWeb-like sizes), repeated ``--repeat`` times,
written to 8 parquet files (8 partitions). Prints

- single-core raw speed: one ``encode_ordinary`` loop over the same documents (tokens/s),
- ``prepare`` end-to-end with ``--workers`` Ray tasks on an already running local Ray (the cluster case),
- the same including the start of an embedded Ray (the one-shot CLI case),
- ratio = end-to-end / (workers x single-core); target >= 0.75,
- CPU seconds per token of the in-process pipeline vs the raw loop (meaningful even on a busy machine).

With ``--bucket s3://...`` it also copies the prepared folder there and times the first training batch from the
local folder, from the bucket with an empty shard cache (ranged reads) and once the cache holds the shards.

Run: ``python bench/data.py [--repeat 4] [--workers N] [--bucket s3://...]``. The machine header
(``bench/machine.py``) is printed with the figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.append(str(Path(__file__).resolve().parent))  # bench/machine.py, also when a test loads this file
import machine  # noqa: E402  (puts platform/ on sys.path)


def build_corpus(folder: Path, repeat: int, files: int = 8, doc_chars: int = 4000) -> list[str]:
    from attnlab.data.pipeline.demo_corpus import ensure_demo_corpus

    docs = []
    for f in sorted(ensure_demo_corpus().glob("*.txt")):
        text = f.read_text(encoding="utf-8")
        docs += [text[i : i + doc_chars] for i in range(0, len(text), doc_chars)]
    docs = [d for d in docs if d.strip()] * repeat
    folder.mkdir(parents=True, exist_ok=True)
    for k, chunk in enumerate(np.array_split(np.arange(len(docs)), files)):
        pq.write_table(pa.table({"text": [docs[i] for i in chunk]}), folder / f"{k:03d}.parquet")
    return docs


def first_batch_from_bucket(local: Path, bucket: str, tmp: Path) -> None:
    """Time to the first training batch (32 x 1025 windows): local folder, bucket with an empty node cache
    (ranged reads), and bucket once the shards are in the cache (memory-mapped)."""
    import torch  # noqa: F401  (imported before timing: the first batch builds tensors)

    from attnlab.data.readers.tokens import TokenShards, TrainSampler
    from attnlab.location import Location

    target = Location.parse(bucket).child(f"attnlab-bench-{os.getpid()}")
    target.parent.upload(str(local), target.name)
    os.environ["ATTNLAB_DATA_CACHE"] = str(tmp / "shard-cache")

    def first_batch(where: str) -> float:
        t = time.perf_counter()
        TrainSampler(TokenShards.open(where), seq_len=1024, global_batch=32, seed=0).batch(0)
        return time.perf_counter() - t

    try:
        local_s = first_batch(str(local))
        os.environ["ATTNLAB_DATA_PREFETCH"] = "0"
        cold_s = first_batch(target.uri)
        os.environ["ATTNLAB_DATA_PREFETCH"] = "1"
        shards = TokenShards.open(target.uri)
        t = time.perf_counter()
        shards.prefetch("train")
        fetch_s = time.perf_counter() - t
        cached_s = first_batch(target.uri)
        size = sum(os.path.getsize(p) for p in local.iterdir())
        print(f"first batch (32 x 1025 tokens): local {local_s * 1e3:.0f} ms, bucket cold (ranged reads) "
              f"{cold_s * 1e3:.0f} ms, bucket cached (memory-mapped) {cached_s * 1e3:.0f} ms; fetching the train split "
              f"({size / 2**20:.0f} MiB with val) into the cache took {fetch_s:.2f} s")
    finally:
        target.delete("")
        os.environ.pop("ATTNLAB_DATA_PREFETCH", None)


def main() -> int:
    for key, value in {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}.items():
        os.environ.setdefault(key, value)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=4, help="corpus copies (1 copy = ~2.1M tokens)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--bucket", default=None,
                    help="s3://... or gs://... prefix: also time the first batch read from there (cold, then cached)")
    args = ap.parse_args()

    import ray

    from attnlab.data import get_encoding, prepare

    tmp = Path(tempfile.mkdtemp(prefix="attnlab-bench-data-"))
    try:
        docs = build_corpus(tmp / "corpus", args.repeat)
        enc = get_encoding()
        enc.encode_ordinary("warm up")
        t, c = time.perf_counter(), time.process_time()
        n_raw = sum(len(enc.encode_ordinary(d)) for d in docs)
        raw_s, raw_cpu = time.perf_counter() - t, time.process_time() - c
        raw_tps = n_raw / raw_s

        kw = dict(val_tokens=1_000_000, seed=0, workers=args.workers, progress=False)
        # embedded Ray started (and stopped) by prepare itself: the one-shot CLI case
        t = time.perf_counter()
        cold = prepare("parquet", str(tmp / "corpus"), str(tmp / "out-cold"), **kw)
        cold_s = time.perf_counter() - t
        # a running Ray cluster (as under `ray job submit`): start it first, time prepare alone
        ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 object_store_memory=256 * 1024**2)
        try:
            prepare("parquet", str(tmp / "corpus"), str(tmp / "out-warmup"), **kw)  # warm the worker processes
            t = time.perf_counter()
            warm = prepare("parquet", str(tmp / "corpus"), str(tmp / "out-warm"), **kw)
            warm_s = time.perf_counter() - t
        finally:
            ray.shutdown()
        serial_t, serial_c = time.perf_counter(), time.process_time()
        prepare("parquet", str(tmp / "corpus"), str(tmp / "out-serial"), **{**kw, "workers": 1})
        serial_s, serial_cpu = time.perf_counter() - serial_t, time.process_time() - serial_c
        same = all(
            (tmp / "out-warm" / f.name).read_bytes() == f.read_bytes() for f in (tmp / "out-serial").iterdir()
        )

        tokens = warm["tokens"]
        ideal = args.workers * raw_tps
        machine.print_header(packages=("tiktoken", "pyarrow", "ray"))
        print(f"corpus: {len(docs):,} documents, {sum(map(len, docs)) / 1e6:.1f} MB text, {tokens:,} tokens "
              f"(incl. one EOT per document), 8 parquet files")
        print(f"single-core raw encode_ordinary loop : {raw_tps / 1e6:6.2f} M tokens/s ({raw_s:.2f} s)")
        print(f"prepare, workers=1 (no Ray)          : {tokens / serial_s / 1e6:6.2f} M tokens/s ({serial_s:.2f} s)")
        print(f"prepare, workers={args.workers}, running Ray     : {tokens / warm_s / 1e6:6.2f} M tokens/s ({warm_s:.2f} s)")
        print(f"prepare, workers={args.workers}, embedded Ray    : {cold['tokens'] / cold_s / 1e6:6.2f} M tokens/s "
              f"({cold_s:.2f} s incl. Ray start/stop)")
        print(f"ratio end-to-end / ({args.workers} x single-core): running Ray {tokens / warm_s / ideal:.2f}, "
              f"embedded Ray {cold['tokens'] / cold_s / ideal:.2f}, workers=1 {tokens / serial_s / raw_tps:.2f} "
              f"(of 1 x single-core); target >= 0.75")
        print(f"CPU time per token, pipeline (workers=1) vs raw loop: {serial_cpu / raw_cpu:.2f}x "
              f"(raw {n_raw / raw_cpu / 1e6:.2f} M tokens per CPU-second; robust to other load on the machine)")
        print(f"byte-identical shards, workers=1 vs {args.workers}: {same}")
        if args.bucket:
            first_batch_from_bucket(tmp / "out-serial", args.bucket, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
