"""Two reliability rules (issue 38): a local Ray cluster that does not start in time is started once more after a
pause, then reported in one line naming Ray's logs; ``attnlab study run`` exits 1 when any trial failed, after its
summary and table.

Ray's own start-up time-out (its raylet's 30 s to register) cannot be caused on demand, so the first two tests hand
:func:`attnlab.ray_runtime._start_local` a stand-in for the ``ray`` module that raises Ray's exception; the study
test stands in for ``run_study`` with a summary of two trials, one failed.
"""

from __future__ import annotations

import argparse

import pytest

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


def test_a_cluster_that_did_not_start_in_time_is_started_once_more():
    ray = FakeRay(failures=1)
    ray_runtime._start_local(ray, address="local", num_cpus=2)
    assert ray.calls == ["init", "shutdown", "init"]


def test_twice_is_one_line_naming_rays_logs():
    ray = FakeRay(failures=2)
    with pytest.raises(UserError) as info:
        ray_runtime._start_local(ray, address="local")
    message = str(info.value)
    assert "\n" not in message and "did not start in time, twice" in message
    assert "ray/session_latest/logs" in message and "RAY_ADDRESS" in message
    assert ray.calls == ["init", "shutdown", "init", "shutdown"]


def test_other_start_errors_are_not_retried():
    ray = FakeRay(failures=1, error="Ray has not been started yet")
    with pytest.raises(Exception, match="not been started"):
        ray_runtime._start_local(ray, address="local")
    assert ray.calls == ["init"]


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


PORT_TAKEN_SCRIPT = """
import socket, sys
import ray
from attnlab import ray_runtime

taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen()
busy = taken.getsockname()[1]
ports = [busy]
real = ray_runtime._free_port
ray_runtime._free_port = lambda: ports.pop() if ports else real()
assert ray_runtime.ensure_ray(num_cpus=1, object_store_mb=80)
url = ray_runtime.dashboard().url
assert ray.get(ray.remote(num_cpus=0.1)(lambda: 7).remote()) == 7
print("busy", busy, "dashboard", url)
ray.shutdown()
"""


@pytest.mark.ray
def test_a_dashboard_port_taken_before_ray_binds_it_is_chosen_again():
    """Two embedded clusters starting at once both pick free ports: the dashboard port chosen for one can be taken
    before its Ray binds it, and ``ray.init`` then fails with "already occupied" (seen in CI when two studies
    started side by side). The next free port is tried instead; the cluster starts, runs a task, and the URL the
    study records is the one it bound. Here the first port offered is held by this test."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    tmp = tempfile.mkdtemp(prefix="rp", dir="/tmp")  # short: Ray's socket paths under it have a 107-byte limit
    env = {**os.environ, "RAY_TMPDIR": tmp}
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        env.pop(name, None)
    try:
        done = subprocess.run([sys.executable, "-c", PORT_TAKEN_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=300)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    words = done.stdout.split()
    busy, url = words[words.index("busy") + 1], words[words.index("dashboard") + 1]
    assert url.startswith("http://127.0.0.1:") and not url.endswith(f":{busy}"), done.stdout
