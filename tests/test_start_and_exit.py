"""Reliability rules of a start and an exit (issues 38, 53): a local Ray cluster that does not start in time is
started once more after a pause, then reported in one line naming Ray's logs; a failed start's processes and
session folder are gone before the next attempt; ``attnlab study run`` exits 1 when any trial failed, after its
summary and table.

The retry rules are checked with a stand-in for the ``ray`` module that raises Ray's exception
(:func:`attnlab.ray_runtime._start_local`); the clean-up with real starts that fail for real (the fault seam
``attnlab.faults.before_ray_start``: a dashboard port taken, a raylet stalled until Ray's 30 s pass); the exit code
with a stand-in for ``run_study`` returning a summary of two trials, one failed.
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
import time
from pathlib import Path

import psutil
import pytest
import yaml

from attnlab import ray_runtime
from attnlab.errors import UserError

TIMED_OUT = ("The current node timed out during startup. This could happen because some of the raylet failed to "
             "startup or the GCS has become overloaded.")


class FakeRay:
    def __init__(self, failures: int, error: str = TIMED_OUT):
        self.failures, self.error, self.calls = failures, error, []

    def init(self, **kwargs):
        self.calls.append("init")
        if self.calls.count("init") <= self.failures:
            raise Exception(self.error)  # noqa: TRY002 - what Ray raises

    def shutdown(self):
        self.calls.append("shutdown")


@pytest.fixture(autouse=True)
def no_pause(monkeypatch):
    monkeypatch.setattr(ray_runtime, "STARTUP_RETRY_PAUSE_S", 0.0)


def test_a_cluster_that_did_not_start_in_time_is_started_once_more(capsys):
    ray = FakeRay(failures=1)
    ray_runtime._start_local(ray, False, address="local", num_cpus=2)
    assert ray.calls == ["init", "shutdown", "init"]
    (line,) = capsys.readouterr().out.splitlines()  # one line: started again, and why
    assert "local Ray cluster was started again: it did not start in time" in line


def test_twice_is_one_line_naming_rays_logs():
    ray = FakeRay(failures=2)
    with pytest.raises(UserError) as info:
        ray_runtime._start_local(ray, False, address="local")
    message = str(info.value)
    assert "\n" not in message and "did not start in time, twice" in message
    assert "ray/session_latest/logs" in message and "RAY_ADDRESS" in message
    assert ray.calls == ["init", "shutdown", "init", "shutdown"]


def test_other_start_errors_are_not_retried():
    ray = FakeRay(failures=1, error="Ray has not been started yet")
    with pytest.raises(Exception, match="not been started"):
        ray_runtime._start_local(ray, False, address="local")
    assert ray.calls == ["init", "shutdown"]  # what that start launched is stopped all the same


@pytest.mark.parametrize("statuses, code", [(["complete", "failed"], 1), (["failed", "failed"], 1),
                                            (["complete", "diverged"], 0), (["complete", "cached"], 0), ([], 0)])
def test_study_run_exits_1_when_any_trial_failed(monkeypatch, statuses, code):
    from attnlab.study import cli, runner, spec

    summary = runner.StudySummary(name="s", state_dir="", store="", optuna_url=None,
                                  trials=[{"status": s} for s in statuses])
    monkeypatch.setattr(runner, "run_study", lambda *a, **k: summary)
    monkeypatch.setattr(spec, "load_spec", lambda *a, **k: object())
    args = argparse.Namespace(plugin_bundle=None, study="s.yaml", plugin=None, resume=False, fresh=False, store=None,
                              runs=None, curves=None, verbose=False, compact=True)
    assert cli._run(args) == code


# A process that starts a local Ray with the fault seam installed (tests/fault_injection.py: ATTNLAB_FAIL_RAY_START),
# then runs the attnlab command its arguments name.
FAULTY_ATTNLAB = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
import fault_injection
fault_injection.install()
from attnlab.cli import main
sys.exit(main())
"""
PORT_TAKEN_SCRIPT = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
import fault_injection
fault_injection.install()
import psutil, ray
from attnlab import ray_runtime

assert ray_runtime.ensure_ray(num_cpus=1, object_store_mb=80)
url = ray_runtime.dashboard().url
assert ray.get(ray.remote(num_cpus=0.1)(lambda: 7).remote()) == 7
tree = [p.name() for p in psutil.Process().children(recursive=True)]
print("busy", fault_injection._RAY_START["socket"].getsockname()[1], "dashboard", url, "gcs", tree.count("gcs_server"))
ray.shutdown()
"""


def _ray_env(tmp: str, **extra) -> dict:
    """The environment of a process that starts its own local Ray in the folder ``tmp`` (short: Ray's socket paths
    under it have a 107-byte limit), with the clusters of this session out of its sight."""
    env = {**os.environ, "RAY_TMPDIR": tmp, **extra}
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        env.pop(name, None)
    return env


def _sessions(tmp: str) -> list[str]:
    return sorted(n for n in os.listdir(Path(tmp, "ray")) if n.startswith("session_") and n != "session_latest")


def _recorded(record: Path) -> tuple[list[dict], list[int]]:
    """What tests/fault_injection.py recorded of the failed start: its processes, and those alive at the next start."""
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    return [x for x in lines if "pid" in x], next(x["alive_at_next_attempt"] for x in lines if "alive_at_next_attempt" in x)


def _alive(processes: list[dict]) -> list[dict]:
    """The recorded processes still running (a zombie is not: it has ended, only its exit status is left)."""
    out = []
    for p in processes:
        try:
            proc = psutil.Process(p["pid"])
            if proc.create_time() == p["created"] and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


def _names(procs: list) -> list[str]:
    """The names of the processes of ``procs`` still running."""
    out = []
    for proc in procs:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc.name())
        except psutil.Error:
            continue
    return out


@pytest.mark.ray
def test_a_dashboard_port_taken_before_ray_binds_it_is_chosen_again(tmp_path):
    """Two embedded clusters starting at once both pick free ports: the dashboard port chosen for one can be taken
    before its Ray binds it, and ``ray.init`` then fails with "already occupied" (seen in CI when two studies
    started side by side), after the GCS has started. The next free port is tried instead; the cluster starts,
    runs a task, and the URL the study records is the one it bound; the failed start's processes (its GCS among
    them) and its session folder are gone. Here the first port is held by the fault seam, listening."""
    tmp = tempfile.mkdtemp(prefix="rp", dir="/tmp")
    record = tmp_path / "start.jsonl"
    try:
        done = subprocess.run([sys.executable, "-c", PORT_TAKEN_SCRIPT], capture_output=True, text=True, timeout=300,
                              env=_ray_env(tmp, ATTNLAB_FAIL_RAY_START="port", ATTNLAB_FAIL_RAY_START_RECORD=str(record)))
        sessions = _sessions(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    words = next(line for line in done.stdout.splitlines() if line.startswith("busy ")).split()
    busy, url = words[words.index("busy") + 1], words[words.index("dashboard") + 1]
    assert url.startswith("http://127.0.0.1:") and not url.endswith(f":{busy}"), done.stdout
    launched, alive = _recorded(record)
    assert "gcs_server" in {p["name"] for p in launched}, launched  # the failed start had started its GCS
    assert alive == [] and words[words.index("gcs") + 1] == "1", (launched, alive, done.stdout)
    assert len(sessions) == 1, sessions
    retried = [line for line in done.stdout.splitlines() if "was started again" in line]
    assert len(retried) == 1 and f"its dashboard port {busy} was taken" in retried[0], done.stdout


STUDY = {"name": "restart", "train": {"preset": "tiny", "data": {"synthetic": "copy_distractors", "vocab": 64},
                                      "steps": 40, "tokens_per_step": 256, "micro_batch": 4, "log_every": 10,
                                      "val_every": 40, "val_tokens": 256, "checkpoint_every": 40},
         "search": {"engine": "grid"}, "space": {"attention": ["softmax"]}, "objective": "val_loss@1x",
         "eval": {"multiples": [1], "p_eval": ["none"], "max_tokens": 256}}


@pytest.mark.ray
def test_a_start_that_timed_out_leaves_no_process_behind(tmp_path):
    """A real ``attnlab study run`` whose first local Ray start times out for real (its raylet is stalled, so it
    never registers within Ray's 30 s): the start is made again, in one console line saying why; none of the failed
    start's processes (GCS, raylet, dashboard and its modules, monitors) is alive at the next attempt, nor while
    the study runs on the second cluster, whose process tree holds one GCS; the failed start's session folder is
    gone; the study completes. Before issue 53 every one of them ran on under the study."""
    tmp = tempfile.mkdtemp(prefix="rp", dir="/tmp")
    record, runs = tmp_path / "start.jsonl", tmp_path / "runs"
    path = tmp_path / "restart.yaml"
    path.write_text(yaml.safe_dump(STUDY))
    env = _ray_env(tmp, ATTNLAB_FAIL_RAY_START="stall", ATTNLAB_FAIL_RAY_START_RECORD=str(record))
    proc = subprocess.Popen([sys.executable, "-c", FAULTY_ATTNLAB, "study", "run", str(path), "--runs", str(runs),
                             "--store", str(tmp_path / "results")], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        status = runs / "restart" / "trials"
        deadline = time.time() + 400
        while proc.poll() is None and time.time() < deadline and not (status.exists() and any(status.iterdir())):
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read()[-3000:]  # checked while the study runs on its second cluster
        launched, alive = _recorded(record)
        tree = _names(psutil.Process(proc.pid).children(recursive=True))
        still = _alive(launched)
        sessions = _sessions(tmp)
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    assert {"gcs_server", "raylet"} <= {p["name"] for p in launched}, launched
    assert alive == [] and still == [], (alive, still)
    assert tree.count("gcs_server") == 1 and tree.count("raylet") == 1, tree
    assert len(sessions) == 1, sessions
    assert proc.returncode == 0, out[-3000:]
    retried = [line for line in out.splitlines() if "was started again" in line]
    assert len(retried) == 1 and "it did not start in time" in retried[0], out[-3000:]
