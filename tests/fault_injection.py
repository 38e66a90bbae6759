"""Test-only fault injection: rank ``ATTNLAB_FAIL_RANK`` (default 0) raises at optimizer step
``ATTNLAB_FAIL_AT_STEP``, once when ``ATTNLAB_FAIL_ONCE_FILE`` names a marker file (written as it fails; a restart
finds it and trains on). With ``ATTNLAB_FAIL_HOW=exit`` the process dies there instead (``os._exit``, as one killed
for its memory would), before any handler can record why.

The production code only exposes the seam (:func:`attnlab.faults.before_train_step`, a no-op); :func:`install`
puts :func:`fail_at_step` there. These variables are read here, by test code, on every step of a process where it
is installed:

- the pytest process (``conftest.py`` installs it at import): training in the test's own process;
- every worker of the test session's Ray cluster (``conftest.ray_session`` passes :func:`install` as Ray's
  ``worker_process_setup_hook``, shipped by value): Ray Train workers and Tune trials. The variables reach them as
  attnlab forwards every ``ATTNLAB_*`` variable to its workers (Ray Train's ``worker_runtime_env``, a study's
  trial context);
- a subprocess whose script calls :func:`install` (it puts this folder on ``sys.path`` first).

A local Ray start (:func:`attnlab.faults.before_ray_start`, in the process that starts the cluster):
``ATTNLAB_FAIL_RAY_START=port`` makes the first attempt lose its dashboard port (held here, listening, as another
cluster starting at the same moment would), ``stall`` makes it time out for real (its raylet is stopped with SIGSTOP
as it appears, so it never registers within Ray's 30 s). ``ATTNLAB_FAIL_RAY_START_RECORD`` names a file that gets
the processes the failed attempt launched (``{"pid", "created", "name"}`` per line, seen every 0.05 s while it ran)
and, at the next attempt, a line ``{"alive_at_next_attempt": [pids]}``: those of them still running then.

The seams that need no variable are set directly by the test that wants them: :func:`slowed` starts a script with
data preparation slowed down (the kill-and-resume tests); the compaction crash tests set
:func:`attnlab.faults.compaction_step` in the child process they kill.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

FAIL_AT_STEP_ENV, FAIL_RANK_ENV, FAIL_ONCE_FILE_ENV = "ATTNLAB_FAIL_AT_STEP", "ATTNLAB_FAIL_RANK", "ATTNLAB_FAIL_ONCE_FILE"
FAIL_HOW_ENV = "ATTNLAB_FAIL_HOW"
RAY_START_ENV, RAY_START_RECORD_ENV = "ATTNLAB_FAIL_RAY_START", "ATTNLAB_FAIL_RAY_START_RECORD"
HERE = str(Path(__file__).resolve().parent)


def fail_at_step(step: int, rank: int) -> None:
    if os.environ.get(FAIL_AT_STEP_ENV) is None or int(os.environ[FAIL_AT_STEP_ENV]) != step:
        return
    if rank != int(os.environ.get(FAIL_RANK_ENV, "0")):
        return
    marker = os.environ.get(FAIL_ONCE_FILE_ENV)
    if marker:
        if os.path.exists(marker):
            return
        Path(marker).write_text(f"failed at step {step} on rank {rank}\n")
    if os.environ.get(FAIL_HOW_ENV) == "exit":
        os._exit(3)
    raise RuntimeError(f"injected worker failure at step {step} on rank {rank} ({FAIL_AT_STEP_ENV})")


class _StartWatch:
    """This process's descendants that appear during one Ray start attempt (pid -> (created, name)); with ``stall``,
    its raylet is stopped as it appears."""

    def __init__(self, stall: bool):
        import psutil

        self.me = psutil.Process()
        self.before = {p.pid for p in self.me.children(recursive=True)}
        self.seen: dict[int, tuple[float, str]] = {}
        self.stall, self.done = stall, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True, name="fault-ray-start")
        self.thread.start()

    def _watch(self) -> None:
        import psutil

        while not self.done.is_set():
            for proc in self.me.children(recursive=True):
                if proc.pid in self.before:
                    continue
                try:  # named again each time: a process is first its parent's fork, then what it executes
                    name, known = proc.name(), self.seen.get(proc.pid, (None, None))[1]
                    self.seen[proc.pid] = (proc.create_time(), name)
                    if self.stall and name == "raylet" and known != "raylet":
                        os.kill(proc.pid, signal.SIGSTOP)
                except psutil.Error:
                    continue
            time.sleep(0.05)

    def finish(self, record: str | None) -> None:
        import psutil

        self.done.set()
        self.thread.join()
        alive = []
        for pid, (created, _) in self.seen.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.Error:
                continue
        if record:
            with open(record, "a") as out:
                for pid, (created, name) in self.seen.items():
                    out.write(json.dumps({"pid": pid, "created": created, "name": name}) + "\n")
                out.write(json.dumps({"alive_at_next_attempt": alive}) + "\n")


_RAY_START: dict = {}  # what the failed attempt holds: its watch, the port's socket


def fail_ray_start(attempt: int, dashboard_port: int | None) -> None:
    """The first attempt to start a local Ray fails as ``ATTNLAB_FAIL_RAY_START`` says (see the module docstring)."""
    how = os.environ.get(RAY_START_ENV)
    if "watch" in _RAY_START:  # the failed attempt is over: record what it ran, and what of it still runs
        _RAY_START.pop("watch").finish(os.environ.get(RAY_START_RECORD_ENV))
    if not how or attempt != 0:
        return
    if how == "port":
        import socket

        held = socket.socket()
        held.bind(("127.0.0.1", dashboard_port))
        held.listen()
        _RAY_START["socket"] = held  # held until this process ends
    elif how != "stall":
        raise ValueError(f"{RAY_START_ENV}={how!r}: port or stall")
    _RAY_START["watch"] = _StartWatch(stall=how == "stall")


def install() -> None:
    """Put :func:`fail_at_step` in the training loop's seam of this process and :func:`fail_ray_start` in a local Ray
    start's (imports nothing heavy)."""
    import attnlab.faults

    attnlab.faults.before_train_step = fail_at_step
    attnlab.faults.before_ray_start = fail_ray_start


def slow_data_items(seconds: float) -> None:
    """Make data preparation in this process sleep ``seconds`` after each work item
    (:func:`attnlab.faults.after_data_item`)."""
    import time

    import attnlab.faults

    attnlab.faults.after_data_item = lambda: time.sleep(seconds)


def slowed(code: str, seconds: float) -> str:
    """``code`` (a Python script) run after :func:`slow_data_items`: each work item of data preparation then takes
    ``seconds`` more, so a test can kill the script midway."""
    install_here = f"import sys; sys.path.insert(0, {HERE!r}); import fault_injection"
    return f"{install_here}; fault_injection.slow_data_items({seconds!r})\n{code}"


def ray_setup_hook():
    """``install`` as Ray's ``worker_process_setup_hook`` (a callable Ray pickles): by value, so a worker needs no
    path to this folder."""
    import sys

    from ray import cloudpickle  # the pickler Ray ships functions with

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return install
