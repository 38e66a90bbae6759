"""How a study ends when it does not simply finish (issue 53): a trial that dies before it records its run still
leaves a status saying why; a study stopped by SIGINT or SIGTERM says so in its last line, calls its running trials
interrupted (never pruned), and the same command resumes it.

Real components throughout: the trials die for real in Ray workers of the session's cluster (a plugin that only the
driver can import, a plugin that SIGKILLs the worker that loads it, one whose allocation fails); the signals go to a
real ``attnlab study run`` in a child process, and the same command is run again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from attnlab.cli import main
from attnlab.states import TrialStatus
from attnlab.study.runner import run_study, study_state
from attnlab.study.spec import load_spec

pytestmark = pytest.mark.ray

DATA = {"synthetic": "copy_distractors", "vocab": 64, "copy_len": 16}
TINY = {"preset": "tiny", "data": DATA, "steps": 4, "tokens_per_step": 256, "micro_batch": 4, "log_every": 2,
        "val_every": 4, "val_tokens": 256, "checkpoint_every": 4, "keep_checkpoints": 1, "max_failures": 0}
EVAL = {"multiples": [1], "p_eval": ["none"], "max_tokens": 256}

# A variant whose plugin file, run in a Ray worker (not in the driver, whose pid the test forwards), fails there as
# the case says, before the trial can record its run.
REFERENCE = '''
import math, os, torch
from attnlab.attention.plugin import Variant

def reference(q, k, rows, ctx):
    s = q @ k.transpose(-1, -2) / math.sqrt(ctx.head_dim)
    return torch.softmax(s.masked_fill(~rows.visible, float("-inf")), dim=-1)

IN_A_WORKER = os.environ.get("ATTNLAB_TEST_DRIVER_PID") not in (None, str(os.getpid()))
'''
DIES = {  # case: (what the plugin does in a worker, the reason's words)
    "import": ("import attnlab_test_driver_only_helper  # on the driver's sys.path only\n",
               r"^an import error in the trial's worker: PluginError: plugin .*dies_import.py:\d+: "
               r"ModuleNotFoundError: No module named 'attnlab_test_driver_only_helper'$"),
    "killed": ("if IN_A_WORKER:\n    import signal\n    os.kill(os.getpid(), signal.SIGKILL)\n",
               r"^the trial's process died \(pid \d+\): killed, or crashed \(Ray: .+\)$"),
    "memory": ("if IN_A_WORKER:\n    bytearray(1 << 52)  # 4 PiB: the allocation fails\n",
               r"^the trial's process ran out of memory: PluginError: plugin .*dies_memory.py:\d+: MemoryError"),
}


@pytest.mark.parametrize("case", sorted(DIES))
def test_a_trial_that_dies_before_recording_its_run_leaves_a_status(ray_session, tmp_path, monkeypatch, capsys, case):
    """The trial dies in its worker while loading the study's plugins, before it plans or records anything. Its
    status file is written by the driver (failed, with why: an import error in the worker, killed, out of memory),
    keyed by the run's key; the summary counts it, `study run` would exit 1, and the page and `attnlab study status`
    show it. Before issue 53 it was only a line in the summary, with no status file."""
    from attnlab.serve.data import open_sources, trials

    code, words = DIES[case]
    plugin = tmp_path / f"dies_{case}.py"
    plugin.write_text(REFERENCE + code + f"\nVARIANTS = [Variant(name='dies_{case}', reference=reference)]\n")
    helper = tmp_path / "driver_only"
    helper.mkdir()
    (helper / "attnlab_test_driver_only_helper.py").write_text("")
    monkeypatch.syspath_prepend(str(helper))  # this process imports it; the session's workers never had it
    monkeypatch.setenv("ATTNLAB_TEST_DRIVER_PID", str(os.getpid()))  # forwarded to the trials (ATTNLAB_*)
    study = {"name": f"dies-{case}", "plugins": [str(plugin)], "train": TINY, "search": {"engine": "grid"},
             "space": {"attention": [f"dies_{case}"]}, "objective": "val_loss@1x", "scheduler": "none", "eval": EVAL}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    spec = load_spec(path)
    runs, store = tmp_path / "runs", tmp_path / "results"
    summary = run_study(spec, store=str(store), runs=str(runs), verbose=0)

    (trial,) = summary.trials
    assert trial["status"] == "failed" and re.search(words, trial["reason"]), trial
    assert trial["point"] == {"attention": f"dies_{case}"} and trial["recorded_by"] == "driver"
    state = study_state(spec, str(runs))
    assert state.status(trial["train_key"])["reason"] == trial["reason"]  # the file, keyed by the run's key
    assert summary.count(TrialStatus.FAILED) == 1  # `study run` exits 1

    capsys.readouterr()
    assert main(["study", "status", str(path), "--runs", str(runs)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"study dies-{case}: 1 trial(s): 1 failed"), out
    assert out[1].split()[:3] == ["failed", f"dies_{case}", trial["train_key"]] and trial["reason"][:60] in out[1]

    page = trials(open_sources(str(store), str(runs)), f"dies-{case}")
    (shown,) = page["trials"]
    assert shown["status"] == "failed" and shown["reason"] == trial["reason"] and page["counts"]["failed"] == 1


# ------------------------------------------------------------------------------------------ a stopped study
STOPPED = {"name": "stopped", "train": {**TINY, "steps": 150, "log_every": 10, "val_every": 150, "checkpoint_every": 25},
           "search": {"engine": "grid"}, "space": {"attention": ["softmax", "lssar"]}, "objective": "val_loss@1x",
           "scheduler": "none", "resources": {"max_concurrent_trials": 1}, "eval": EVAL}
HOW = {  # the signal, and how it is sent: to the study's process group, as a terminal's Ctrl-C and `timeout` send
    # theirs; Ctrl-C to a study on a running cluster (RAY_ADDRESS): Tune stops and saves its state
    "SIGINT": (signal.SIGINT, True),
    # `timeout` to a study on its own embedded cluster: the signal ends the cluster's processes too
    "SIGTERM": (signal.SIGTERM, False),
}


def _trained_to(state, step: int) -> bool:
    for record in state.statuses():
        if record.get("status") == "running" and record.get("run_dir"):
            metrics = Path(record["run_dir"], "metrics.jsonl")
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            if lines and json.loads(lines[-1]).get("step", 0) >= step:
                return True
    return False


def _group_gone(pgid: int, timeout: float = 30.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("how", sorted(HOW))
def test_a_stopped_study_says_so_in_its_last_line_and_the_same_command_resumes_it(ray_session, tmp_path, how):
    """A real ``attnlab study run`` is sent SIGINT or SIGTERM mid-training (past its first checkpoint). It ends with
    exit status 128 + the signal, nothing native dumped, its last line saying the study was interrupted and giving
    the same command to resume it; its trial is interrupted (never pruned) in its status file, on the page and in
    ``attnlab study status``; nothing of its process group is left. The same command then resumes the trial and
    finishes the study. Before issue 53 SIGINT called the trial pruned and exited 0, and SIGTERM printed Ray's
    "*** SIGTERM received at time=..." dump and aborted."""
    from attnlab.serve.data import open_sources, trials

    sig, on_running_cluster = HOW[how]
    path = tmp_path / "stopped.yaml"
    path.write_text(yaml.safe_dump(STOPPED))
    runs, store = tmp_path / "runs", tmp_path / "results"
    words = ["study", "run", str(path), "--store", str(store), "--runs", str(runs)]
    cluster = {"RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    env = {**os.environ, **cluster} if on_running_cluster else {
        k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    state = study_state(load_spec(path), str(runs))
    proc = subprocess.Popen([sys.executable, "-m", "attnlab.cli", *words], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 400
        while proc.poll() is None and time.time() < deadline and not _trained_to(state, 30):
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        os.killpg(proc.pid, sig)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [line for line in out.splitlines() if line.strip()]
    assert proc.returncode == 128 + sig, out[-3000:]
    assert lines[-1] == (f"attnlab: study stopped was interrupted ({how}); the same command resumes it: attnlab "
                         + " ".join(words)), out[-3000:]
    assert "received at time" not in out and "PC: @" not in out and "pruned" not in out, out[-3000:]
    assert _group_gone(proc.pid), "a process of the stopped study is still running"
    (stopped,) = [t for t in state.statuses() if t["status"] != "complete"]
    assert stopped["status"] == "interrupted" and stopped["reason"].startswith(f"interrupted ({how}) at step ")
    assert f"interrupted: {stopped['train_key']}" in out  # the summary's line for it
    page = trials(open_sources(str(store), str(runs)), "stopped")
    assert [t["status"] for t in page["trials"] if t["key"] == stopped["train_key"]] == ["interrupted"]
    shown = subprocess.run([sys.executable, "-m", "attnlab.cli", "study", "status", str(path), "--runs", str(runs)],
                           capture_output=True, text=True, timeout=120)
    assert re.search(rf"^  interrupted +softmax +{stopped['train_key']} +interrupted \({how}\)", shown.stdout,
                     re.M), shown.stdout

    again = subprocess.run([sys.executable, "-m", "attnlab.cli", *words], cwd=tmp_path, env={**os.environ, **cluster},
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "attnlab: resuming study 'stopped'" in again.stdout
    assert sorted(t["status"] for t in state.statuses()) == ["complete", "complete"]
    events = [state.loc.read_json(f"events/{name}") for name in state.loc.list_names("events")]
    assert sum(1 for e in events if e["train_key"] == stopped["train_key"]) == 2  # trained on, from its checkpoint
