"""Benchmark: what a cheap trial costs (issue 31, item 3): an N-trial study of tiny 2-step trials, end to end (not a
test; prints figures).

The study (written here): the ``tiny`` preset on the synthetic copy probe (vocabulary 64), 2 steps of 4 x 64 tokens,
one evaluation cell (1x, p_eval none, 256 tokens), Optuna TPE over a log-uniform ``lr`` (every trial a new point),
no scheduler, one trial at a time (``--concurrent``), run as a user runs it: ``python -m attnlab.cli study run``
in a child process on its own embedded Ray, with the code under ``--code`` (default this checkout's ``platform/``)
on ``PYTHONPATH``. Printed:

- per-trial wall time, from the trial's process start to its final status (median, p90), and the study's wall time
  per trial (the driver's whole run divided by N, Ray's start and the final report included);
- the breakdown of a trial, from the ``timing`` its status records (``attnlab.study.trial.study_trial``) and the
  run folder's files: the Tune trial's start (process start to the trainable's first line; in a process Tune
  reused, the previous trial's end to it), the claim, the Train
  run's start (to ``provenance.json``: controller, worker group, data open, model), the training itself (to the end
  of ``run_training``), the evaluation task, the report; and the gap Tune leaves between one trial's end and the
  next one's process start;
- the driver's RSS over time (sampled every 2 s from ``/proc``: first, at each tenth of the run, peak);
- Optuna's suggestion time at the end: ``ask()`` of a TPE sampler on a copy of the study's N trials, median of 5,
  and on 500 and 2,000 made-up finished trials of the same space (in SQLite, as a study keeps them);
- the console's size (the driver's stdout and stderr, in bytes and lines);
- the study page with N trials (``attnlab serve``, read only): time and size of ``/study/<name>`` and the two
  APIs the page reads on load.

The machine header (``bench/machine.py``: its load average is taken before the run) comes first (2 shared cores:
the seconds are indicative; say whether the cores were shared). Run: ``python bench/trials.py [--trials 50]
[--concurrent 1] [--code DIR] [--workdir DIR]`` (set PYTHONPATH=platform or install the project).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/machine.py, also when a test loads this file
import machine  # noqa: E402

ROOT = machine.ROOT
NAME = "trials"
ISSUE_FIGURE = "~14 s per trial (6 two-step trials in 85 s of study time)"  # issue 31, same machine


def study_yaml(trials: int, concurrent: int, in_trial: bool = True) -> dict:
    return {
        "name": NAME,
        "train": {"preset": "tiny", "data": {"synthetic": "copy_distractors", "vocab": 64, "copy_len": 16},
                  "steps": 2, "tokens_per_step": 256, "micro_batch": 4, "warmup_steps": 1, "log_every": 2,
                  "val_every": 2, "val_tokens": 256, "checkpoint_every": 2, "keep_checkpoints": 1,
                  "cpus_per_worker": 1},
        "eval": {"multiples": [1], "p_eval": ["none"], "max_tokens": 256},
        "search": {"engine": "optuna", "num_samples": trials, "seed": 0},
        "space": {"lr": {"low": 1.0e-4, "high": 1.0e-2, "log": True}},
        "objective": "val_loss@1x",
        "resources": {"max_concurrent_trials": concurrent, **({} if in_trial else {"train_in_trial": False})},
    }


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run_study(code: Path, work: Path, trials: int, concurrent: int, in_trial: bool = True) -> dict:
    import yaml

    path = work / f"{NAME}.yaml"
    path.write_text(yaml.safe_dump(study_yaml(trials, concurrent, in_trial)))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(code), RAY_USAGE_STATS_ENABLED="0")
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "attnlab.cli", "study", "run", str(path), "--store",
                             str(work / "results"), "--runs", str(work / "runs")], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    rss: list[tuple[float, float]] = []
    out: dict[str, bytes] = {}

    def drain(name, stream):
        out[name] = stream.read()

    readers = [threading.Thread(target=drain, args=(n, s)) for n, s in (("out", proc.stdout), ("err", proc.stderr))]
    for reader in readers:
        reader.start()
    while proc.poll() is None:
        value = _rss_mib(proc.pid)
        if value is not None:
            rss.append((time.time() - started, value))
        time.sleep(2.0)
    for reader in readers:
        reader.join()
    wall = time.time() - started
    if proc.returncode != 0:
        sys.exit(f"the study failed ({proc.returncode}):\n{(out['out'] + out['err']).decode()[-3000:]}")
    return {"wall": wall, "rss": rss, "stdout": out["out"], "stderr": out["err"]}


def breakdown(runs: Path) -> tuple[list[dict], list[float]]:
    """Each trial's phases (seconds) from its status's ``timing`` and its run's ``provenance.json``; and the gaps
    between a trial's end and the next trial's process start."""
    trials = []
    for status in sorted((runs / NAME / "trials").glob("*.json")):
        record = json.loads(status.read_text())
        t = record.get("timing") or {}
        if not t.get("reported"):
            continue
        provenance = runs / NAME / "runs" / record["train_key"] / "provenance.json"
        ready = provenance.stat().st_mtime if provenance.exists() else None
        # the first trial of a process counts the process's start; a reused process's trial starts when the trial
        # before it ended (set below, one trial at a time)
        first = t.get("trial_in_process", 1) == 1
        start = (t.get("process") or t["entered"]) if first else None
        phases = {"tune trial start": None, "claim": t["claimed"] - t["entered"]}
        if ready and t["claimed"] <= ready <= t["trained"]:
            phases["train run start"] = ready - t["claimed"]
            phases["training"] = t["trained"] - ready
        else:
            phases["train run start"], phases["training"] = t["trained"] - t["claimed"], 0.0
        phases["evaluation"] = t["evaluated"] - t["trained"]
        phases["report"] = t["reported"] - t["evaluated"]
        trials.append({"start": start, "entered": t["entered"], "end": t["reported"], "phases": phases,
                       "reused": not first})
    trials.sort(key=lambda x: x["entered"])
    for before, trial in zip([None, *trials], trials):
        if trial["start"] is None:  # a reused process: from the end of the trial before
            trial["start"] = before["end"] if before else trial["entered"]
        trial["phases"]["tune trial start"] = trial["entered"] - trial["start"]
        trial["wall"] = trial["end"] - trial["start"]
    gaps = [b["start"] - a["end"] for a, b in zip(trials, trials[1:])]
    return trials, gaps


def optuna_ask_seconds(runs: Path) -> float | None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    db = runs / NAME / "optuna.db"
    if not db.exists():
        return None
    saved = optuna.load_study(study_name=NAME, storage=f"sqlite:///{db}")
    study = optuna.create_study(study_name="again", sampler=optuna.samplers.TPESampler(seed=1),
                                direction=saved.direction)  # in memory: the asks below change nothing stored
    study.add_trials(saved.trials)
    distributions = {"lr": optuna.distributions.FloatDistribution(1.0e-4, 1.0e-2, log=True)}
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        trial = study.ask(distributions)
        times.append(time.perf_counter() - t0)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
    return statistics.median(times)


def optuna_ask_seconds_at(trials: int) -> float:
    """TPE's ``ask()`` after ``trials`` finished trials of the same space (made up here, with values of the kind a
    study reports, in an SQLite file as a study keeps them): the suggestion time of a study that size, without
    running it."""
    import random

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    distributions = {"lr": optuna.distributions.FloatDistribution(1.0e-4, 1.0e-2, log=True)}
    folder = tempfile.mkdtemp(prefix="attnlab-bench-optuna-")
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=1), storage=f"sqlite:///{folder}/optuna.db")
    rng = random.Random(0)
    study.add_trials([optuna.trial.create_trial(params={"lr": 10 ** rng.uniform(-4, -2)}, distributions=distributions,
                                                value=rng.uniform(3.0, 4.5)) for _ in range(trials)])
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        trial = study.ask(distributions)
        times.append(time.perf_counter() - t0)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
    shutil.rmtree(folder, ignore_errors=True)
    return statistics.median(times)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def page_figures(code: Path, work: Path) -> list[tuple[str, float, int]]:
    """Time and size of the page and the APIs it reads on load, from ``attnlab serve`` (read only)."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(code)}
    proc = subprocess.Popen([sys.executable, "-m", "attnlab.cli", "serve", "--runs", str(work / "runs"), "--store",
                             str(work / "results"), "--port", str(port)], cwd=work, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    return []
                time.sleep(0.5)
        out = []
        for path in (f"/study/{NAME}", f"/api/study/{NAME}/trials", f"/api/study/{NAME}/results"):
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=120) as response:
                    size = len(response.read())
            except OSError as exc:
                out.append((f"{path} ({type(exc).__name__})", time.perf_counter() - t0, 0))
                continue
            out.append((path, time.perf_counter() - t0, size))
        return out
    finally:
        proc.terminate()
        proc.wait()


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def code_line(code: Path) -> str:
    """The code the study runs (``--code``: this checkout's ``platform/`` or another) and its git sha."""
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=code, capture_output=True, text=True)
    return f"- code: {code} ({sha.stdout.strip() or 'not a git checkout'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--concurrent", type=int, default=1)
    parser.add_argument("--code", type=Path, default=ROOT / "platform", help="the platform folder to run")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the study here (default: a temporary one)")
    parser.add_argument("--no-page", action="store_true")
    parser.add_argument("--ray-train", action="store_true",
                        help="train with Ray Train (resources.train_in_trial: false), as every trial did before")
    args = parser.parse_args()
    lines = machine.lines(machine.header(packages=("ray",))) + [code_line(args.code.resolve())]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="attnlab-bench-trials-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        run = run_study(args.code.resolve(), work, args.trials, args.concurrent, in_trial=not args.ray_train)
        trials, gaps = breakdown(work / "runs")
        walls = [t["wall"] for t in trials]
        how = "Ray Train (train_in_trial: false)" if args.ray_train else "in the Tune trial's process"
        lines += [f"- study: {args.trials} trials of 2 steps, {args.concurrent} at once, trained {how}; "
                  "issue 31's figure: "
                  f"{ISSUE_FIGURE}", "",
                  "| figure | value |", "|---|---|",
                  f"| trials with a timing | {len(trials)} |",
                  f"| per-trial wall (process start to status), median | {statistics.median(walls):.2f} s |",
                  f"| per-trial wall, p90 | {_pct(walls, 0.9):.2f} s |",
                  f"| study wall / trials (Ray start and final report included) | {run['wall'] / args.trials:.2f} s |",
                  f"| study wall | {run['wall']:.0f} s |"]
        if gaps:
            lines.append(f"| gap between trials (Tune), median | {statistics.median(gaps):.2f} s |")
        lines.append(f"| trials run in a reused Tune process | {sum(t['reused'] for t in trials)} |")
        for phase in ("tune trial start", "claim", "train run start", "training", "evaluation", "report"):
            values = [t["phases"][phase] for t in trials]
            lines.append(f"| {phase}, median (p90) | {statistics.median(values):.2f} s ({_pct(values, 0.9):.2f} s) |")
        rss = run["rss"]
        if rss:
            marks = [rss[min(len(rss) - 1, int(i * len(rss) / 10))] for i in range(10)] + [rss[-1]]
            lines.append("| driver RSS over time (s: MiB) | " + ", ".join(f"{t:.0f}: {m:.0f}" for t, m in marks)
                         + f"; peak {max(m for _, m in rss):.0f} MiB |")
        ask = optuna_ask_seconds(work / "runs")
        if ask is not None:
            lines.append(f"| Optuna TPE ask() after this study's {len(trials)} trials, median of 5 | "
                         f"{ask * 1000:.1f} ms |")
        for size in (500, 2000):
            lines.append(f"| Optuna TPE ask() after {size} made-up trials of this space, median of 5 | "
                         f"{optuna_ask_seconds_at(size) * 1000:.1f} ms |")
        console = run["stdout"] + run["stderr"]
        newlines = console.count(b"\n")
        lines.append(f"| console (stdout + stderr) | {len(console):,} bytes, {newlines:,} lines |")
        if not args.no_page:
            for path, seconds, size in page_figures(args.code.resolve(), work):
                lines.append(f"| page: GET {path} | {seconds:.2f} s, {size:,} bytes |")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
