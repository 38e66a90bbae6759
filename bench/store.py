"""Benchmark: the results store at 150,000 rows in 5,000 written files, locally and on an S3 server (not a test;
prints figures beside today's).

The store is filled as evaluation fills it: one write per run and evaluation length, 30 rows each (6 cells: RoPE
none / ntk / yarn x p_eval none / 15, each with val_loss, bpb and the three position buckets' loss_bucket; the
columns ``attnlab.evaluate.extrapolation.base_row`` and the study's row context set), keyed
``("eval", train_key, length, digest)``; 1,000 runs x 5 lengths (5 attention variants, 3 learning rates, seeds).

Every figure is measured twice: with this checkout's code, and with today's, the code of ``--baseline`` (default
:data:`BASELINE_REF`, main before the store's layout 2) exported by ``git archive`` into a temporary folder; each
version writes its own store with the same rows and is run the same way (child processes with that version on
``PYTHONPATH``). Measured:

- ``attnlab results table --study big`` as the user runs it: a child process (``python -m attnlab.cli``), its
  wall time, CPU time and peak RSS (``os.wait4``); before compaction (5,000 written files; target 5 s) and after
  ``attnlab results compact`` (targets 2 s and 400 MB);
- ``ResultsStore.read_table("big")``, every column, in a child;
- a run's skip-done check, ``ResultsStore.stored_eval_keys(study, train_key)`` with a new store object each time
  (a trial's first check), median of 7: in a study of 500 files and one of 5,000 (target 50 ms), and on the S3
  server its requests (target: the same count at both sizes);
- on the S3 server (moto on 127.0.0.1, started here; requests counted from the server's own request log, one
  line per request): the same table, read and skip-done figures, and the compaction's time and requests.

- the study page's results refresh (``attnlab serve``; target 1 s, reading only what changed): this checkout's
  ``ResultsStore.read_since`` after one run's key was written again (its rows, a new version: one new file), with
  the rows as a frame, then with the page's tables made from them (``attnlab.serve.data.results``), and a
  refresh with nothing changed (files opened, requests); median of 3. Today's page re-read the whole study at
  each refresh: its figure is one ``attnlab.serve.data.results`` call (the second in its process).

The two versions' table outputs are compared (they must be identical). The machine header (``bench/machine.py``:
date, machine, load average, versions) is printed first: on a shared machine the wall times are only indicative,
the CPU times say more.

Run: ``python bench/store.py [--files 5000] [--small 500] [--baseline REF] [--no-s3] [--no-baseline]
[--only refresh]`` (``--only refresh``: the page refresh's figures alone)
(about 15 minutes on 2 busy cores with the S3 part; set PYTHONPATH=platform or install the project).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/machine.py, also when a test loads this file
import machine  # noqa: E402  (puts platform/ on sys.path)

ROOT = machine.ROOT
BASELINE_REF = "b80448e"  # main before layout 2: one flat folder per study, every read lists and opens every file
STUDY, SMALL_STUDY = "big", "small"
LENGTHS = (128, 256, 512, 1024, 2048)
ROWS_PER_FILE = 30
ISSUE_FIGURES = {"table": "20.6 s / 1.09 GB", "read_table": "6.1 s", "skip": "2.2 s"}  # issue 31's, same machine


# ---------------------------------------------------------------------------------------------- rows
def _hex(*parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def run_writes(study: str, run: int) -> list[tuple[list[dict], tuple]]:
    """One run's five evaluation writes (one per length), 30 rows each, and their keys."""
    rnd = random.Random(run)
    attention = ("softmax", "lssa", "lssar", "softmax_logn", "softmax_qknorm")[run % 5]
    lr = (1e-3, 3e-3, 6e-4)[(run // 20) % 3]
    key = _hex("run", run)
    base = dict(study=study, trial=key, attention=attention,
                scale="logd_logn" if attention.startswith("lssa") else "inv_sqrt_d",
                p_train=15.0 if attention == "lssar" else None, step=400, tokens=400 * 4096, train_len=128,
                seed=(run // 5) % 4, config_hash=key, git_sha="b80448e", preset="byte-4x128", data="demo-bytes",
                knobs=f"lr={lr:g},model.n_layer=4")
    writes = []
    for length in LENGTHS:
        rows = []
        for rope in ("none", "ntk", "yarn"):
            for p_eval in (None, 15.0):
                cell = _hex(key, length, rope, p_eval)
                loss = 2.0 + 0.05 * (length / 128) ** 0.5 * (attention != "lssar") + 0.1 * rnd.random()
                common = dict(base, p_eval=p_eval, rope_scaling=rope, eval_len=length, window_mode="nonoverlap",
                              eval_key=cell, n_tokens=65536)
                rows.append(dict(common, metric="val_loss", value=loss))
                rows.append(dict(common, metric="bpb", value=loss / 0.6931))
                for bucket in ("early", "middle", "late"):
                    rows.append(dict(common, metric="loss_bucket", bucket=bucket, value=loss + 0.02 * rnd.random(),
                                     n_tokens=21845))
        digest = hashlib.sha256("".join(sorted(r["eval_key"] for r in rows[::5])).encode()).hexdigest()[:12]
        writes.append((rows, ("eval", key, length, digest)))
    return writes


# ---------------------------------------------------------------------------------------------- children
def _moto_lines(log: str | None) -> int:
    if not log:
        return 0
    with open(log, errors="replace") as handle:
        return sum(1 for line in handle if '"' in line and " HTTP/1." in line)


def child(args) -> None:
    """Runs inside a child process with one version of attnlab on PYTHONPATH; prints one JSON line."""
    from attnlab.results import ResultsStore

    out: dict = {}
    if args.child == "write":
        import concurrent.futures

        store = ResultsStore(args.root)
        writes = [w for run in range(args.first // len(LENGTHS), args.files // len(LENGTHS))
                  for w in run_writes(args.study, run)]
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(8 if args.root.startswith("s3://") else 2) as pool:
            list(pool.map(lambda w: store.write(w[0], key=w[1]), writes))
        out = {"files": len(writes), "seconds": time.perf_counter() - start}
    elif args.child == "read_table":
        start, cpu = time.perf_counter(), time.process_time()
        table = ResultsStore(args.root).read_table(args.study)
        out = {"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu, "rows": table.num_rows}
    elif args.child == "skip":
        key = _hex("run", 3)  # a run of both studies
        times, requests, cells = [], [], 0
        for _ in range(7):
            before = _moto_lines(args.moto_log)
            start = time.perf_counter()
            cells = len(ResultsStore(args.root).stored_eval_keys(args.study, key))  # a trial's own store
            times.append(time.perf_counter() - start)
            requests.append(_moto_lines(args.moto_log) - before)
        out = {"ms": 1000 * statistics.median(times), "first_ms": 1000 * times[0], "requests": requests,
               "cells": cells}
    elif args.child == "refresh":
        out = refresh_figures(args)
    elif args.child == "compact":
        before = _moto_lines(args.moto_log)
        start = time.perf_counter()
        result = ResultsStore(args.root).compact(args.study)
        out = {"seconds": time.perf_counter() - start, "requests": _moto_lines(args.moto_log) - before,
               "merged": result.merged, "rows": result.rows}
    print(json.dumps(out))


def refresh_figures(args) -> dict:
    """The study page's results refresh (in a child): this checkout's ``read_since`` after one run changed, and
    with nothing changed; today's code (no ``read_since``): one whole ``data.results``."""
    from attnlab.results import ResultsStore
    from attnlab.serve import data

    store = ResultsStore(args.root)
    sources = data.open_sources(args.root, tempfile.mkdtemp(prefix="attnlab-bench-runs-"))
    if not hasattr(store, "read_since"):  # today's page: the whole study again (a warm process: the second call)
        data.results(sources, args.study)
        start, cpu = time.perf_counter(), time.process_time()
        data.results(sources, args.study)
        return {"today_s": time.perf_counter() - start, "today_cpu": time.process_time() - cpu}
    start = time.perf_counter()
    rows = store.read_since(args.study)
    rows.frame()
    out: dict = {"first_s": time.perf_counter() - start, "rows": rows.rows}
    changed, frames, pages, opened, requests, cpus = [], [], [], [], [], []
    for i in range(3):
        rows_written, key = run_writes(args.study, 3)[i]  # the same rows again: a new version, one new file
        store.write(rows_written, key=key)
        before = _moto_lines(args.moto_log)
        start, cpu = time.perf_counter(), time.process_time()
        new = store.read_since(args.study, rows)
        changed.append(time.perf_counter() - start)
        requests.append(_moto_lines(args.moto_log) - before)
        new.frame()
        frames.append(time.perf_counter() - start)
        data.results(sources, args.study, rows=new)
        pages.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
        opened.append(new.files_read)
        rows = new
    before = _moto_lines(args.moto_log)
    start = time.perf_counter()
    same = store.read_since(args.study, rows)
    out.update(changed_s=statistics.median(changed), frame_s=statistics.median(frames),
               page_s=statistics.median(pages), page_cpu=statistics.median(cpus), files_read=opened, requests=requests,
               unchanged_ms=1000 * (time.perf_counter() - start), unchanged_files=same.files_read,
               unchanged_requests=_moto_lines(args.moto_log) - before)
    return out


# ---------------------------------------------------------------------------------------------- parent
class Version:
    """One version of the code: its platform folder (PYTHONPATH of its children) and its name."""

    def __init__(self, name: str, platform_dir: Path):
        self.name, self.platform_dir = name, platform_dir

    def env(self, extra: dict | None = None) -> dict:
        env = {**os.environ, "PYTHONPATH": str(self.platform_dir), **(extra or {})}
        env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        return env

    def run_child(self, task: str, root: str, study: str = STUDY, extra: dict | None = None, **options) -> dict:
        command = [sys.executable, str(Path(__file__).resolve()), "--child", task, "--root", root, "--study", study]
        for name, value in options.items():
            if value is not None:
                command += [f"--{name.replace('_', '-')}", str(value)]
        proc = subprocess.run(command, env=self.env(extra), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{self.name} {task} failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def table(self, root: str, out_path: Path, extra: dict | None = None) -> dict:
        """``attnlab results table`` as a child process: wall, CPU (user + sys) and peak RSS from wait4."""
        command = [sys.executable, "-m", "attnlab.cli", "results", "table", "--store", root, "--study", STUDY]
        with open(out_path, "w") as stdout, tempfile.TemporaryFile() as stderr:
            start = time.perf_counter()
            proc = subprocess.Popen(command, env=self.env(extra), stdout=stdout, stderr=stderr,
                                    cwd=tempfile.gettempdir())
            _, status, usage = os.wait4(proc.pid, 0)
            wall = time.perf_counter() - start
            proc.returncode = os.waitstatus_to_exitcode(status)
            if proc.returncode != 0:
                stderr.seek(0)
                raise RuntimeError(f"{self.name} results table failed: {stderr.read().decode()[-2000:]}")
        return {"seconds": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss_mb": usage.ru_maxrss / 1024}


def export_baseline(ref: str, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "platform"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder / "platform"


def start_moto(log_path: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"moto server did not start (see {log_path})") from None
            time.sleep(0.2)
    return proc, f"http://127.0.0.1:{port}"


def measure(version: Version, where: str, root: str, files: int, small: int, workdir: Path, moto: dict | None,
            compact: bool, only: str | None = None) -> dict:
    """Every figure of one version on one store location (local folder or s3:// URI); ``only="refresh"``: the
    page refresh's alone."""
    extra = moto["env"] if moto else None
    log = moto["log"] if moto else None
    figures: dict = {}
    say = lambda text: print(f"  [{version.name}, {where}] {text}", flush=True)  # noqa: E731
    for study, count in ((SMALL_STUDY, small), (STUDY, files)):
        if only == "refresh" and study == SMALL_STUDY:
            continue
        written = version.run_child("write", root, study, extra, files=count, first=0)
        say(f"wrote {written['files']} files to study {study} in {written['seconds']:.1f} s")
    figures["refresh"] = version.run_child("refresh", root, STUDY, extra, moto_log=log)
    say(f"page refresh: {figures['refresh']}")
    if only == "refresh":
        return figures
    for study in (SMALL_STUDY, STUDY):
        figures[f"skip_{study}"] = version.run_child("skip", root, study, extra, moto_log=log)
        say(f"skip-done in {study}: {figures[f'skip_{study}']}")
    figures["read_table"] = version.run_child("read_table", root, STUDY, extra)
    say(f"read_table: {figures['read_table']}")
    figures["table"] = version.table(root, workdir / f"table-{version.name}-{where}.md", extra)
    say(f"results table: {figures['table']}")
    if compact:
        for study in (SMALL_STUDY, STUDY):
            figures[f"compact_{study}"] = version.run_child("compact", root, study, extra, moto_log=log)
            say(f"compact {study}: {figures[f'compact_{study}']}")
            figures[f"skip_after_{study}"] = version.run_child("skip", root, study, extra, moto_log=log)
            say(f"skip-done in {study} after compaction: {figures[f'skip_after_{study}']}")
        figures["read_table_after"] = version.run_child("read_table", root, STUDY, extra)
        say(f"read_table after compaction: {figures['read_table_after']}")
        figures["table_after"] = version.table(root, workdir / f"table-{version.name}-{where}-after.md", extra)
        say(f"results table after compaction: {figures['table_after']}")
    return figures


def report(results: dict, files: int, small: int, baseline: str | None, outputs_same: dict) -> list[str]:
    def table_cell(f):
        return f"{f['seconds']:.2f} s (CPU {f['cpu']:.2f} s), {f['rss_mb']:.0f} MB" if f else "–"

    def seconds(f):
        return f"{f['seconds']:.2f} s (CPU {f['cpu']:.2f} s)" if f else "–"

    def skip(f):
        if not f:
            return "–"
        requests = f", {f['requests'][-1]} requests" if any(f["requests"]) else ""
        return f"{f['ms']:.1f} ms (first {f['first_ms']:.1f}){requests}"

    lines = [f"| measure | target | today ({baseline or 'not run'}) | this checkout |", "|---|---|---|---|"]
    for where in ("local", "s3"):
        today, now = results.get(("today", where), {}), results.get(("now", where), {})
        if not now:
            continue
        lines += [
            f"| {where}: results table, {files:,} written files | <= 5 s | {table_cell(today.get('table'))} | "
            f"{table_cell(now.get('table'))} |",
            f"| {where}: results table after compaction | <= 2 s, <= 400 MB | (no compaction) | "
            f"{table_cell(now.get('table_after'))} |",
            f"| {where}: read_table (every column), {files:,} files | | {seconds(today.get('read_table'))} | "
            f"{seconds(now.get('read_table'))} |",
            f"| {where}: read_table after compaction | | | {seconds(now.get('read_table_after'))} |",
            f"| {where}: skip-done, study of {small:,} files | <= 50 ms, O(1) requests | "
            f"{skip(today.get(f'skip_{SMALL_STUDY}'))} | {skip(now.get(f'skip_{SMALL_STUDY}'))} |",
            f"| {where}: skip-done, study of {files:,} files | <= 50 ms, O(1) requests | "
            f"{skip(today.get(f'skip_{STUDY}'))} | {skip(now.get(f'skip_{STUDY}'))} |",
            f"| {where}: skip-done after compaction, {small:,} / {files:,} files | | | "
            f"{skip(now.get(f'skip_after_{SMALL_STUDY}'))} / {skip(now.get(f'skip_after_{STUDY}'))} |",
            f"| {where}: compaction of {files:,} files | | | {seconds_only(now.get(f'compact_{STUDY}'))} |",
            f"| {where}: page refresh, one run changed ({files:,} files): rows read / as a frame / with the page's "
            f"tables | <= 1 s, only what changed | {refresh_today(today.get('refresh'))} | "
            f"{refresh_now(now.get('refresh'))} |",
            f"| {where}: page refresh, nothing changed | no file read | | {refresh_unchanged(now.get('refresh'))} |",
        ]
    lines.append("")
    lines.append(f"issue 31's figures for today's code on this machine: table {ISSUE_FIGURES['table']}, read_table "
                 f"{ISSUE_FIGURES['read_table']}, skip-done {ISSUE_FIGURES['skip']}")
    for where, (versions_same, compaction_same) in outputs_same.items():
        words = {True: "identical", False: "DIFFERENT", None: "not compared"}
        lines.append(f"{where}: `results table` output, today's code vs this checkout's: {words[versions_same]}; "
                     f"before vs after compaction: {words[compaction_same]}")
    return lines


def refresh_today(f) -> str:
    if not f or "today_s" not in f:
        return "–"
    cpu = f", CPU {f['today_cpu']:.2f} s" if "today_cpu" in f else ""
    return f"{f['today_s']:.2f} s{cpu} (the whole study, every refresh)"


def refresh_now(f) -> str:
    if not f or "changed_s" not in f:
        return "–"
    requests = f", {f['requests'][-1]} requests" if any(f["requests"]) else ""
    cpu = f", CPU {f['page_cpu']:.2f} s in all" if "page_cpu" in f else ""
    return (f"{f['changed_s']:.2f} s / {f['frame_s']:.2f} s / {f['page_s']:.2f} s ({f['files_read'][-1]} file "
            f"read{requests}{cpu}; first load {f['first_s']:.1f} s)")


def refresh_unchanged(f) -> str:
    if not f or "unchanged_ms" not in f:
        return "–"
    requests = f", {f['unchanged_requests']} requests" if f["unchanged_requests"] else ""
    return f"{f['unchanged_ms']:.0f} ms, {f['unchanged_files']} files read{requests}"


def seconds_only(f) -> str:
    if not f:
        return "–"
    requests = f", {f['requests']:,} requests" if f.get("requests") else ""
    return f"{f['seconds']:.1f} s{requests}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=5000, help="written files of the big study (30 rows each)")
    parser.add_argument("--small", type=int, default=500, help="written files of the small study (skip-done's "
                                                               "second size)")
    parser.add_argument("--baseline", default=BASELINE_REF, help="git ref of today's code (default %(default)s)")
    parser.add_argument("--no-baseline", action="store_true", help="measure this checkout only")
    parser.add_argument("--no-s3", action="store_true", help="local folders only")
    parser.add_argument("--keep", default=None, metavar="DIR", help="build the stores in DIR and keep them")
    parser.add_argument("--only", choices=["refresh"], default=None,
                        help="measure only the study page's refresh (the big study alone)")
    # internal: a child's task
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--root", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--study", default=STUDY, help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--moto-log", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    machine.print_header(packages=("pyarrow", "pandas", "moto"))
    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="attnlab-bench-store-"))
    workdir.mkdir(parents=True, exist_ok=True)
    versions = [Version("now", ROOT / "platform")]
    if not args.no_baseline:
        versions.insert(0, Version("today", export_baseline(args.baseline, workdir / "baseline")))
    moto_proc = None
    results: dict = {}
    outputs_same: dict = {}
    try:
        places = [("local", None)]
        if not args.no_s3:
            log = str(workdir / "moto.log")
            moto_proc, endpoint = start_moto(log)
            env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                   "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
            bucket = f"attnlab-bench-{os.getpid()}"
            import boto3

            boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                         region_name="us-east-1").create_bucket(Bucket=bucket)
            places.append(("s3", {"env": env, "log": log, "bucket": bucket}))
        for where, moto in places:
            for version in versions:
                root = f"s3://{moto['bucket']}/{version.name}" if moto else str(workdir / f"store-{version.name}")
                print(f"{version.name}, {where}: {root}", flush=True)
                results[(version.name, where)] = measure(version, where, root, args.files, args.small, workdir,
                                                         moto, compact=version.name == "now", only=args.only)
            if args.only:
                continue
            now = (workdir / f"table-now-{where}.md").read_text()
            after = (workdir / f"table-now-{where}-after.md").read_text()
            today_file = workdir / f"table-today-{where}.md"
            outputs_same[where] = (today_file.read_text() == now if today_file.exists() else None, now == after)
    finally:
        if moto_proc is not None:
            moto_proc.terminate()
            moto_proc.wait(timeout=30)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    for line in report(results, args.files, args.small, None if args.no_baseline else args.baseline, outputs_same):
        if args.only and line.startswith("| ") and "page refresh" not in line and not line.startswith("| measure"):
            continue  # a figure not measured this time
        print(line)
    print(f"\nload average at the end: {' / '.join(f'{x:.1f}' for x in os.getloadavg())} (1 / 5 / 15 min)")


if __name__ == "__main__":
    main()
