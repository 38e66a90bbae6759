"""Benchmark: training from a prepared dataset in a bucket, 1 GiB against 50 MiB (not a test; prints figures and
one PASS/FAIL line per target).

Two datasets of random tokens (``--big-mib`` 1024 and ``--small-mib`` 50 of train tokens in 128 MiB shards, each
with a 4 MiB val split; written with the real shard writer, ``bench/streamkit``) are put in a bucket, and a real
2-worker Ray Train run (tiny preset, 3 steps, 0.5 CPU a worker, on a local Ray started here) trains from each,
with an empty shard cache each time (``ATTNLAB_DATA_CACHE``), after one warm-up run on the small one (imports and
Ray Train's start-up paths out of the way). A poller reads every Train worker's ``RssAnon`` from /proc every 50 ms,
and a counting proxy in front of the S3 endpoint (``streamkit.CountingProxy``) counts the bytes of every GET.

Printed per run: the time to the first steps (``run_training`` called to ``metrics.jsonl`` first holding a step),
each worker's RssAnon peak, its RssAnon at the first step and its growth after it, this process's (the driver's)
RssAnon growth during the run, the shard GET bytes against the dataset's size and what the cache holds at the end.
The targets (docs/data.md: no process holds a dataset in memory; a large dataset starts as fast as a small one):

- a worker's anonymous memory grows during the steps by less than 10% of the 1 GiB dataset beyond what the same run
  grows on 50 MiB (each measured from the worker's own first step: the steps add ~300 MB whatever the data), and
  its memory at the first step is within that same 10% of the 50 MiB run's;
- the driver's anonymous memory grows by less than 10% of the dataset during the 1 GiB run;
- the time to the first steps on 1 GiB is within 1.5x of that on 50 MiB;
- each shard is downloaded at most once on this node (its GET bytes below its size + 1 MiB of ranged reads).

With ``--repeat N`` each size is measured N times and the targets compare the best run of each (a worker's peak
varies by ~100 MB between runs and ranks; wall-clock on a shared 2-core machine varies more).

The bucket: without ``--bucket`` a moto S3 server is started on 127.0.0.1 (as the tests' conftest does) with a
bucket of its own. With ``--bucket s3://name[/prefix]`` (or ``gs://``) the datasets are written there (under
``attnlab-bench-streaming-<pid>/``, deleted at the end) with the credentials of the environment; GET bytes are
counted only where the endpoint is plain HTTP (``AWS_ENDPOINT_URL=http://...``, e.g. a MinIO): the proxy cannot
front TLS.

Run: ``python bench/streaming.py [--bucket s3://...] [--repeat 1] [--big-mib 1024] [--small-mib 50]`` (about 3
minutes on 2 cores with the loopback server: ~35 s writing the 1 GiB, then three Train runs of 30-50 s; 4 with
``--repeat 2``). The machine header (``bench/machine.py``) is printed first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (str(ROOT / "bench"), str(ROOT / "platform")):
    if _path not in sys.path:
        sys.path.insert(0, _path)  # streamkit, and this checkout's attnlab

import machine  # noqa: E402
from streamkit import CountingProxy, WorkerRss, rss_anon_mb, shard_sizes, start_moto, write_dataset  # noqa: E402

MIB = 2**20
TOKENS_PER_MIB = MIB // 2  # uint16 tokens
GROWTH_BOUND = 0.10  # of the big dataset's size
FIRST_STEP_BOUND = 1.5  # x the small dataset's time to the first steps
RANGED_ALLOWANCE = MIB  # a shard's GET bytes beyond one download: metadata heads and windows


def mb_list(values) -> str:
    return "[" + ", ".join(f"{v:.0f}" for v in sorted(values)) + "]"


class Runner:
    """Ray Train runs of the tiny preset from a dataset, each with a shard cache of its own."""

    def __init__(self, workdir: Path, proxy: CountingProxy | None, steps: int):
        self.workdir, self.proxy, self.steps = workdir, proxy, steps

    def run(self, name: str, uri: str, sizes: dict[str, int]) -> dict:
        from attnlab.train import load_train_config
        from attnlab.train.ray_train import run_training

        cache = self.workdir / f"cache-{name}"
        os.environ["ATTNLAB_DATA_CACHE"] = str(cache)  # forwarded to the workers (ATTNLAB_*)
        cfg = load_train_config(dict(preset="tiny", data=uri, steps=self.steps, tokens_per_step=1024, micro_batch=4,
                                     lr=3e-3, warmup_steps=1, log_every=1, val_every=self.steps, val_tokens=2048,
                                     checkpoint_every=self.steps, workers=2, cpus_per_worker=0.5,
                                     threads_per_worker=1, max_failures=0))
        mark = self.proxy.mark() if self.proxy else 0
        driver_before = rss_anon_mb()
        # this run's workers only (their environment holds this run's cache): the machine may run other Trains
        poll = WorkerRss(str(self.workdir / name / "metrics.jsonl"), environ_has=f"ATTNLAB_DATA_CACHE={cache}")
        result = run_training(cfg, self.workdir / name)
        wall = time.perf_counter() - poll.t0
        peaks = poll.stop()
        driver_growth = rss_anon_mb() - driver_before
        if result.status != "finished" or poll.first_step is None:
            raise RuntimeError(f"run {name} did not train: {result}")
        if len(poll.at_first_step) != 2:
            raise RuntimeError(f"run {name}: {len(poll.at_first_step)} Train workers seen at the first step, not 2")
        got = self.proxy.get_bytes(mark, ".arrow") if self.proxy else None
        cached = [p for p in cache.glob("*.arrow")] if cache.exists() else []
        out = dict(name=name, first_step=poll.first_step, wall=wall, peaks=list(peaks.values()),
                   at_first=list(poll.at_first_step.values()), growth=list(poll.growth_after_first_step().values()),
                   driver_growth=driver_growth, got=got, cached_bytes=sum(p.stat().st_size for p in cached),
                   cached_shards=len(cached), dataset_bytes=sum(sizes.values()), sizes=sizes)
        shutil.rmtree(cache, ignore_errors=True)
        return out


def describe(r: dict) -> str:
    line = (f"{r['name']:>8}: first steps {r['first_step']:.1f} s (run {r['wall']:.1f} s); worker RssAnon peaks "
            f"{mb_list(r['peaks'])} MB, at the first step {mb_list(r['at_first'])} MB, growth after it "
            f"{mb_list(r['growth'])} MB; driver growth {r['driver_growth']:.0f} MB; ")
    if r["got"] is None:
        line += "shard GET bytes not counted; "
    else:
        line += (f"shard GET bytes {sum(r['got'].values()) / MIB:.0f} MiB of {r['dataset_bytes'] / MIB:.0f} MiB "
                 f"({len(r['got'])} of {len(r['sizes'])} shards touched); ")
    return line + f"cache at the end {r['cached_bytes'] / MIB:.0f} MiB in {r['cached_shards']} shards"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report(small: list[dict], big: list[dict], small_label: str, big_label: str) -> list[str]:
    size_mb = big[0]["dataset_bytes"] / MIB
    bound = GROWTH_BOUND * size_mb
    best = "best of each" if len(big) > 1 else "one run each"
    growth_small = min(max(r["growth"]) for r in small)
    growth_big = min(max(r["growth"]) for r in big)
    first_small = min(max(r["at_first"]) for r in small)
    first_big = min(max(r["at_first"]) for r in big)
    driver = min(r["driver_growth"] for r in big)
    t_small = min(r["first_step"] for r in small)
    t_big = min(r["first_step"] for r in big)
    lines = [
        f"{verdict(growth_big - growth_small < bound)}: worker growth after the first step (the larger worker, "
        f"{best}): {big_label} {growth_big:.0f} MB, {small_label} {growth_small:.0f} MB: the data adds "
        f"{growth_big - growth_small:.0f} MB, target < {bound:.0f} MB (10% of {size_mb:.0f} MiB)",
        f"{verdict(first_big - first_small < bound)}: worker RssAnon at the first step: {big_label} {first_big:.0f} MB, "
        f"{small_label} {first_small:.0f} MB: {first_big - first_small:+.0f} MB, target < {bound:.0f} MB",
        f"{verdict(driver < bound)}: driver growth during the {big_label} run {driver:.0f} MB, target < {bound:.0f} MB",
        f"{verdict(t_big < FIRST_STEP_BOUND * t_small)}: first steps {big_label} {t_big:.1f} s, {small_label} "
        f"{t_small:.1f} s: {t_big / t_small:.2f}x, target < {FIRST_STEP_BOUND}x",
    ]
    counted = [r for r in small + big if r["got"] is not None]
    if counted:
        over = max((n - r["sizes"][k] for r in counted for k, n in r["got"].items()), default=0)
        lines.append(f"{verdict(over < RANGED_ALLOWANCE)}: each shard downloaded at most once: the most GET bytes of "
                     f"one shard beyond its size {over / MIB:+.2f} MiB, target < {RANGED_ALLOWANCE / MIB:.0f} MiB "
                     "(a second download adds a whole shard)")
    else:
        lines.append("----: each shard downloaded at most once: not counted (no plain-HTTP endpoint to proxy)")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bucket", default=None,
                    help="s3://name[/prefix] or gs://... to write the datasets to (default: a moto server on "
                         "127.0.0.1 started here)")
    ap.add_argument("--big-mib", type=int, default=1024, help="train tokens of the big dataset, MiB (uint16)")
    ap.add_argument("--small-mib", type=int, default=50, help="train tokens of the small dataset, MiB")
    ap.add_argument("--shard-mib", type=int, default=128, help="shard size, MiB")
    ap.add_argument("--val-mib", type=int, default=4, help="val split of each dataset, MiB")
    ap.add_argument("--steps", type=int, default=3, help="training steps of each run")
    ap.add_argument("--repeat", type=int, default=1, help="measured runs of each size (the best of each is compared)")
    args = ap.parse_args()

    os.environ.pop("RAY_ADDRESS", None)  # a local Ray: the workers' memory is read from this machine's /proc
    for key, value in {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_DEDUP_LOGS": "0",
                       "RAY_TRAIN_METRICS_ENABLED": "0", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                       "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}.items():
        os.environ.setdefault(key, value)
    # the Ray workers import this checkout's attnlab (they inherit the environment of the cluster started here)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "platform")] + [p for p in
                                                os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    machine.print_header(packages=("ray", "pyarrow", "moto"))

    workdir = Path(tempfile.mkdtemp(prefix="attnlab-bench-streaming-"))
    moto_proc = proxy = None
    base = None
    try:
        if args.bucket:
            base = f"{args.bucket.rstrip('/')}/attnlab-bench-streaming-{os.getpid()}"
            endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
            where = f"{args.bucket} (endpoint {endpoint or 'the default'})"
        else:
            moto_proc, endpoint = start_moto(str(workdir / "moto.log"))
            os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                              AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
            import boto3

            bucket = f"attnlab-bench-streaming-{os.getpid()}"
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
            base = f"s3://{bucket}"
            where = f"a moto S3 server on {endpoint}, started here"
        print(f"# bucket: {where}", flush=True)

        shard_tokens, val_tokens = args.shard_mib * TOKENS_PER_MIB, args.val_mib * TOKENS_PER_MIB
        data = {}
        for label, mib, seed in (("small", args.small_mib, 2), ("big", args.big_mib, 1)):
            uri = f"{base}/{label}"
            t = time.perf_counter()
            manifest = write_dataset(uri, mib * TOKENS_PER_MIB, shard_tokens=shard_tokens, val_tokens=val_tokens,
                                     seed=seed)
            sizes = shard_sizes(uri, manifest)
            data[label] = (uri, sizes)
            print(f"wrote {label}: {uri}, {sum(sizes.values()) / MIB:.0f} MiB in {len(sizes)} shards "
                  f"({time.perf_counter() - t:.1f} s)", flush=True)

        if base.startswith("s3://") and endpoint.startswith("http://"):
            # written directly; read through the proxy (this process and, forwarded, every Train worker)
            proxy = CountingProxy(endpoint, str(workdir / "requests.log"))
            os.environ["AWS_ENDPOINT_URL"] = proxy.url

        from attnlab.ray_runtime import ensure_ray

        ensure_ray(log_to_driver=False)
        runner = Runner(workdir, proxy, args.steps)
        small_label, big_label = f"{args.small_mib} MiB", f"{args.big_mib} MiB"
        print(describe(runner.run("warm-up", *data["small"])) + " (not compared)", flush=True)
        small, big = [], []
        for i in range(args.repeat):
            small.append(runner.run(f"small-{i + 1}", *data["small"]))
            print(describe(small[-1]), flush=True)
            big.append(runner.run(f"big-{i + 1}", *data["big"]))
            print(describe(big[-1]), flush=True)
        print()
        for line in report(small, big, small_label, big_label):
            print(line)
        print(f"\nload average at the end: {' / '.join(f'{x:.1f}' for x in os.getloadavg())} (1 / 5 / 15 min)")
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if proxy is not None:
            proxy.close()
            os.environ["AWS_ENDPOINT_URL"] = endpoint
        if args.bucket and base:
            from attnlab.location import Location

            try:
                Location.parse(base).delete("")
            except Exception as exc:  # noqa: BLE001 - say what is left behind
                print(f"could not delete {base}: {exc}")
        if moto_proc is not None:
            moto_proc.terminate()
            moto_proc.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
