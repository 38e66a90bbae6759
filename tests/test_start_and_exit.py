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
