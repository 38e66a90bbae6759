"""Benchmark: a small study on a busy machine, once with a retried Ray start, once with a trial process killed
(issue 53, item 4; not a test: it prints figures).

The study (written here): the ``tiny`` preset on the synthetic copy probe (vocabulary 64), 3 trials (softmax, LSSA,
LSSAR), each 200 steps of 4 x 64 tokens with a checkpoint every 50 and one torch thread, evaluated at 1x and 4x with
p_eval none and 15. Every ``attnlab study run`` is run as a user runs it: ``python -m attnlab.cli study run`` in a
child process on its own embedded Ray (``RAY_TMPDIR`` its own folder), with this checkout's ``platform/`` on
``PYTHONPATH``. Three runs, each in a fresh folder:

1. **unloaded**: the reference results.
2. **loaded, retried start**: under the load generator, and the study's first local Ray start fails on purpose,
   through the tests' fault seam (``tests/fault_injection.py``: ``ATTNLAB_FAIL_RAY_START``): ``stall`` stops its
   raylet as it appears, so Ray's 30 s pass and the start times out for real (``--fail port``: its dashboard port is
   taken instead). The start is made again.
3. **loaded, killed trial**: under the load generator; once the first trial has trained past its first checkpoint,
   its process (the Tune trial's Ray worker) is killed with SIGKILL, as the kernel's OOM killer would. The study
   records the trial failed and exits 1. The same command is then run again, which resumes it.

The load generator is started and stopped here, by process id. It is two CPU burners (busy loops) and one process
that allocates and frees memory (``--alloc-mb``, default 1,024 MiB, in 64 MiB blocks whose pages it touches, then
frees, over and over). It is all local: no network, no other machine.

Printed per run:

- the wall time and trials completed;
- retried starts (the console's "was started again" lines);
- the failed start's processes still running when the next start began (the fault seam records them);
- processes left running 5 s after the study exited (every process seen in the study's tree, sampled every 0.5 s; must
  be 0);
- Ray ``session_*`` folders left (one per cluster that started);
- the peak resident memory of the study's process tree (RSS summed over its processes, sampled every 0.5 s: pages
  that processes share are counted in each);
- whether the results equal the unloaded run's bit for bit (every row's value, by its measurement's identity).

The machine header (``bench/machine.py``: the date, the machine, its load average, the versions) is printed. Run:
``python bench/soak.py [--fail stall|port] [--alloc-mb 1024] [--workdir DIR]`` (PYTHONPATH=platform, or the
project installed; about 15 minutes on 2 shared cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/machine.py, also when a test loads this file
import machine  # noqa: E402  (puts platform/ on sys.path)

ROOT = Path(__file__).resolve().parents[1]
NAME = "soak"
RETRIED = "the local Ray cluster was started again"
STUDY = {
    "name": NAME,
    "train": {"preset": "tiny", "data": {"synthetic": "copy_distractors", "vocab": 64, "copy_len": 16},
              "steps": 200, "tokens_per_step": 256, "micro_batch": 4, "lr": 3.0e-3, "warmup_steps": 10,
              "log_every": 10, "val_every": 100, "val_tokens": 1024, "checkpoint_every": 50, "keep_checkpoints": 1,
              "max_failures": 0, "threads_per_worker": 1},
    "resources": {"max_concurrent_trials": 1},
    "search": {"engine": "grid"},
    "space": {"attention": ["softmax", "lssa", "lssar"]},
    "objective": "val_loss@4x",
    "scheduler": "none",
    "eval": {"multiples": [1, 4], "p_eval": ["none", 15], "max_tokens": 2048},
}
# A study's driver with the tests' fault seam installed (its first local Ray start fails as ATTNLAB_FAIL_RAY_START
# says), then the attnlab command its arguments name.
FAULTY_DRIVER = f"""
import sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import fault_injection
fault_injection.install()
from attnlab.cli import main
sys.exit(main())
"""
# A row's measurement, apart from when and by which Tune trial it was made.
IDENTITY = ("train_key", "eval_key", "metric", "eval_len", "p_eval", "rope_scaling", "window_mode", "bucket", "layer")


# ------------------------------------------------------------------------------------------------ the load
BURN = "while True:\n    pass\n"
CHURN = """
import sys, time
total, block = int(sys.argv[1]) << 20, 64 << 20
while True:
    held = []
    for _ in range(max(1, total // block)):
        buf = bytearray(block)
        buf[::4096] = b"x" * len(buf[::4096])  # touch every page: resident, not only reserved
        held.append(buf)
    del held
    time.sleep(0.2)
"""


class Load:
    """Two CPU burners and a memory churner, child processes of this one, stopped by their process ids."""

    def __init__(self, alloc_mb: int):
        self.alloc_mb = alloc_mb
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Load:
        for code, args in ((BURN, []), (BURN, []), (CHURN, [str(self.alloc_mb)])):
            self.procs.append(subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL))
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ------------------------------------------------------------------------------------------------ a study run
class Watch:
    """The study's process tree, sampled every 0.5 s: every process seen (pid -> create time) and the peak of its
    summed RSS; on request, the Tune trial's worker process (``ray::ImplicitFunc``) to kill."""

    def __init__(self, pid: int):
        import psutil

        self.root = psutil.Process(pid)
        self.seen: dict[int, float] = {}
        self.peak_rss = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def tree(self) -> list:
        import psutil

        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return []

    def _run(self) -> None:
        import psutil

        while not self.done.wait(0.5):
            total = 0
            for proc in self.tree():
                try:
                    self.seen.setdefault(proc.pid, proc.create_time())
                    total += proc.memory_info().rss
                except psutil.Error:
                    continue
            self.peak_rss = max(self.peak_rss, total)

    def trial_process(self):
        import psutil

        for proc in self.tree():
            try:
                if proc.name().startswith("ray::ImplicitFunc") or " ".join(proc.cmdline()).startswith(
                        "ray::ImplicitFunc"):
                    return proc
            except psutil.Error:
                continue
        return None

    def left_alive(self) -> list[int]:
        """The processes seen in the study's tree that still run (a zombie has ended)."""
        import psutil

        self.done.set()
        self.thread.join()
        alive = []
        for pid, created in self.seen.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.Error:
                continue
        return alive


def _trained_to(work: Path, step: int) -> bool:
    for status in (work / "runs" / NAME / "trials").glob("*.json"):
        try:
            record = json.loads(status.read_text())
            metrics = Path(record.get("run_dir") or "", "metrics.jsonl")
            lines = metrics.read_text().splitlines() if record.get("status") == "running" and metrics.exists() else []
        except (OSError, ValueError):
            continue
        if lines and json.loads(lines[-1]).get("step", 0) >= step:
            return True
    return False


def study_run(work: Path, ray_tmp: Path, fail: str | None = None, kill_at: int | None = None) -> dict:
    """One ``attnlab study run`` of the study in ``work``; ``fail``: its first Ray start fails that way;
    ``kill_at``: the running trial's process is killed once its run reaches that step."""
    path = work / f"{NAME}.yaml"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    ray_tmp.mkdir(parents=True, exist_ok=True)
    env.update(PYTHONPATH=str(ROOT / "platform"), RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=str(ray_tmp))
    record = work / f"start-{time.time_ns()}.jsonl"
    command = [sys.executable, "-m", "attnlab.cli"]
    if fail:
        env.update(ATTNLAB_FAIL_RAY_START=fail, ATTNLAB_FAIL_RAY_START_RECORD=str(record))
        command = [sys.executable, "-c", FAULTY_DRIVER]
    started = time.time()
    proc = subprocess.Popen([*command, "study", "run", str(path), "--store", str(work / "results"), "--runs",
                             str(work / "runs")], cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    watch = Watch(proc.pid)
    output: list[bytes] = []
    reader = threading.Thread(target=lambda: output.append(proc.stdout.read()))
    reader.start()
    killed = None
    while proc.poll() is None:
        if kill_at is not None and killed is None and _trained_to(work, kill_at):
            victim = watch.trial_process()
            if victim is not None:
                os.kill(victim.pid, signal.SIGKILL)
                killed = victim.pid
        time.sleep(0.5)
    reader.join()
    wall = time.time() - started
    time.sleep(5.0)
    left = watch.left_alive()
    out = b"".join(output).decode(errors="replace")
    failed_start = []
    if record.exists():
        lines = [json.loads(line) for line in record.read_text().splitlines()]
        failed_start = next((x["alive_at_next_attempt"] for x in lines if "alive_at_next_attempt" in x), [])
    statuses = [json.loads(p.read_text()) for p in (work / "runs" / NAME / "trials").glob("*.json")]
    return {"wall": wall, "rc": proc.returncode, "out": out, "killed": killed, "left": left,
            "retried": sum(1 for line in out.splitlines() if RETRIED in line),
            "retried_lines": [line for line in out.splitlines() if RETRIED in line],
            "failed_start_alive": failed_start, "peak_rss_mib": watch.peak_rss / 2**20,
            "complete": sum(1 for s in statuses if s.get("status") in ("complete", "cached")),
            "statuses": sorted(s.get("status") for s in statuses),
            "sessions": sorted(n for n in os.listdir(ray_tmp / "ray") if n.startswith("session_")
                               and n != "session_latest") if (ray_tmp / "ray").exists() else []}


def results(work: Path):
    """The study's rows, as (identity, value) sorted: what bit-for-bit equality compares."""
    from attnlab.results import ResultsStore

    df = ResultsStore(str(work / "results")).read(study=NAME)
    cols = [c for c in IDENTITY if c in df.columns]
    df = df[cols + ["value"]].copy()
    for col in cols:
        df[col] = df[col].astype(str)
    return df.sort_values(cols).reset_index(drop=True)


def same_bits(a: Path, b: Path) -> str:
    import numpy as np

    x, y = results(a), results(b)
    if len(x) != len(y) or not x.drop(columns="value").equals(y.drop(columns="value")):
        return f"no: different rows ({len(x)} vs {len(y)})"
    vx, vy = x["value"].to_numpy(np.float64), y["value"].to_numpy(np.float64)
    equal = (vx.view(np.uint64) == vy.view(np.uint64))
    if equal.all():
        return f"yes ({len(x)} rows)"
    return f"no: {int((~equal).sum())} of {len(x)} values differ (max |diff| {np.nanmax(np.abs(vx - vy)):.3g})"


# ------------------------------------------------------------------------------------------------ report
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fail", choices=("stall", "port"), default="stall",
                        help="how the retried run's first Ray start fails (default: stall, a real time-out)")
    parser.add_argument("--alloc-mb", type=int, default=1024, help="what the memory churner allocates and frees")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    import yaml

    lines = machine.lines(machine.header(packages=("ray",)))
    base = args.workdir or Path(tempfile.mkdtemp(prefix="attnlab-bench-soak-"))
    ray_base = Path(tempfile.mkdtemp(prefix="sk", dir="/tmp"))  # short: Ray's socket paths have a 107-byte limit
    runs = {}
    try:
        for name in ("unloaded", "retried", "killed"):
            (base / name).mkdir(parents=True, exist_ok=True)
            (base / name / f"{NAME}.yaml").write_text(yaml.safe_dump(STUDY))
        print("run 1/3: unloaded", flush=True)
        runs["unloaded"] = study_run(base / "unloaded", ray_base / "u")
        with Load(args.alloc_mb):
            print(f"run 2/3: loaded, first Ray start fails ({args.fail})", flush=True)
            runs["retried"] = study_run(base / "retried", ray_base / "r", fail=args.fail)
            print("run 3/3: loaded, a trial process killed at step 60, then the same command again", flush=True)
            runs["killed"] = study_run(base / "killed", ray_base / "k", kill_at=60)
            runs["killed, resumed"] = study_run(base / "killed", ray_base / "k2")
        lines += [f"- study: {len(STUDY['space']['attention'])} trials of {STUDY['train']['steps']} steps x "
                  f"{STUDY['train']['tokens_per_step']} tokens (tiny, synthetic copy probe, 1 torch thread), one at a "
                  "time, evaluated at 1x and 4x with p_eval none and 15",
                  f"- load (runs 2 and 3): 2 CPU burners + a process allocating and freeing {args.alloc_mb} MiB",
                  "", "| run | exit | wall | trials completed | retried starts | failed start's processes alive at "
                  "the next start | processes left 5 s after exit | Ray session folders | peak RSS of the study's "
                  "tree | results = unloaded, bit for bit |", "|---|---|---|---|---|---|---|---|---|---|"]
        for name, run in runs.items():
            folder = base / name.split(",")[0]
            equal = "(the reference)" if name == "unloaded" else (
                same_bits(base / "unloaded", folder) if run["rc"] == 0 else "(not finished: see the next row)")
            lines.append(f"| {name} | {run['rc']} | {run['wall']:.0f} s | {run['complete']} of "
                         f"{len(STUDY['space']['attention'])} | {run['retried']} | "
                         f"{len(run['failed_start_alive']) if name == 'retried' else '-'} | {len(run['left'])} | "
                         f"{len(run['sessions'])} | {run['peak_rss_mib']:,.0f} MiB | {equal} |")
        lines.append("")
        for line in runs["retried"]["retried_lines"]:
            lines.append(f"- retried start's console line: `{line.strip()}`")
        if runs["killed"]["killed"]:
            killed = [line for line in runs["killed"]["out"].splitlines() if "died" in line and "failed" in line]
            lines.append(f"- killed trial: pid {runs['killed']['killed']}; the study's summary said: "
                         f"`{killed[0].strip() if killed else 'nothing'}`")
        else:
            lines.append("- killed trial: no trial process was found to kill (the study finished first)")
    finally:
        shutil.rmtree(ray_base, ignore_errors=True)
        if args.workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
