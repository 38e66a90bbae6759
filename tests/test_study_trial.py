"""A trial's shared context and its twin: the objects a trial receives, and a point the search proposes twice."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import uuid

import pytest

from attnlab.location import Location
from attnlab.results import ResultsStore
from attnlab.study.spec import StudySpec
from attnlab.study.folder import StudyFolder
from attnlab.study.claims import _parts, claim_point, release_point, start_registry
from attnlab.study.trial import StudyContext, StudyData, plan_trial


def _spec() -> StudySpec:
    return StudySpec.model_validate({
        "name": "twins", "train": {"preset": "tiny", "data": {"synthetic": "copy_distractors", "vocab": 64},
                                   "steps": 4, "tokens_per_step": 256, "micro_batch": 4},
        "search": {"engine": "optuna", "num_samples": 2, "seed": 1}, "space": {"attention": ["softmax", "lssar"]},
        "objective": "val_loss@2x", "eval": {"multiples": [1, 2]}})


def test_the_context_carries_objects_that_pickle_as_themselves(tmp_path):
    spec = _spec()
    state = StudyFolder(tmp_path / "runs", spec.name)
    data = StudyData(resolved={"synthetic": "copy"}, fingerprint="f" * 16, vocab_size=64, label="synthetic:copy",
                     min_tokens=2**62, described="synthetic copy")
    ctx = StudyContext(spec=spec, state=state, store=ResultsStore(tmp_path / "results"), data=data, claims="attnlab-claims:twins:0")
    back = pickle.loads(pickle.dumps(ctx))
    assert isinstance(back.spec, StudySpec) and back.spec == spec
    assert isinstance(back.state, StudyFolder) and back.state.loc == state.loc
    assert isinstance(back.store, ResultsStore) and back.store.uri == str(tmp_path / "results")
    assert back.claims == "attnlab-claims:twins:0"
    assert back.data == data
    plan = plan_trial(back, {"attention": "lssar"}, "trial_0")
    # one name per idea: the rows' trial is the Tune trial, the run's identity is its train_key
    assert plan.row_context["trial"] == "trial_0" and plan.row_context["train_key"] == plan.train_key
    assert "config_hash" not in plan.row_context
    assert isinstance(plan.run, Location)
    assert plan.run.uri == str(tmp_path / "runs" / "twins" / "runs" / plan.train_key)


# ------------------------------------------------------------------------------------------ twins
# A search may propose one point twice: its trials claim the training key in the study run's registry
# (attnlab.study.claims); a twin waits on the holder's hold, which ends when the holder releases or its process dies.
@pytest.fixture(scope="module")
def registry(ray_session):
    """One study run's claims for this file's twin tests (each uses keys of its own), in the driver's registry."""
    return start_registry("twins")


def _key() -> str:
    return uuid.uuid4().hex[:8]


def _claim_in_thread(registry: str, key: str, trial: str, found: dict, order: list) -> threading.Thread:
    def claim():
        found[trial] = claim_point(registry, key, trial)
        order.append(trial)

    thread = threading.Thread(target=claim, daemon=True)
    thread.start()
    return thread


@pytest.mark.ray
def test_a_twin_waits_for_the_trial_training_its_point(registry):
    k1 = _key()
    assert claim_point(registry, k1, "trial_a") == {}  # free: trial_a holds it
    found, order = {}, []
    waiter = _claim_in_thread(registry, k1, "trial_b", found, order)
    waiter.join(timeout=1.0)
    assert waiter.is_alive() and not order  # trial_b waits while trial_a trains
    order.append("trial_a released")
    release_point(registry, k1, "trial_a", "complete")
    waiter.join(timeout=60)
    assert order == ["trial_a released", "trial_b"]
    assert found["trial_b"] == {"trial": "trial_a", "status": "complete"}  # it reuses trial_a's run


@pytest.mark.ray
@pytest.mark.parametrize("case", ["own", "earlier run", "unknown key", "finished"])
def test_nothing_to_wait_for(registry, case):
    k1 = _key()
    if case == "own":
        claim_point(registry, k1, "trial_b")  # Tune restarted this very trial
    elif case == "earlier run":  # a study run killed before this one started: its registry is not this run's
        earlier = start_registry("twins")
        claim_point(earlier, k1, "trial_a")
    elif case == "finished":
        claim_point(registry, k1, "trial_a")
        release_point(registry, k1, "trial_a", "cached")
    found, order = {}, []
    _claim_in_thread(registry, k1, "trial_b", found, order).join(timeout=60)
    assert order == ["trial_b"]
    assert found["trial_b"] == ({"trial": "trial_a", "status": "cached"} if case == "finished" else {})


@pytest.mark.ray
def test_every_study_run_of_a_driver_has_its_own_claims_in_one_registry(registry):
    """A driver that runs several studies (run_study from Python) starts one registry actor, a process, not one per
    study run; a key claimed in one run is free in the next."""
    later = start_registry("twins")
    assert _parts(later)[0] == _parts(registry)[0] and later != registry  # the same actor, another run
    k1 = _key()
    claim_point(registry, k1, "trial_a")  # held in the first run, never released
    found, order = {}, []
    _claim_in_thread(later, k1, "trial_b", found, order).join(timeout=60)
    assert order == ["trial_b"] and found["trial_b"] == {}


OWNER = """
import sys, os, ray
from attnlab.study.claims import claim_point
ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
claim_point(sys.argv[2], sys.argv[3], "trial_a")
print(os.getpid(), flush=True)
sys.stdin.read()  # holds the point until killed
"""


@pytest.mark.ray
def test_a_twin_whose_process_died_is_taken_over_at_once(ray_session, registry, tmp_path):
    """The trial holding the point is killed without a word: its twin, waiting on it, takes the point over as soon
    as Ray knows the process died (it resumes the run from its checkpoint), not after a time-out."""
    k1 = _key()
    owner = subprocess.Popen([sys.executable, "-c", OWNER, ray_session.get_runtime_context().gcs_address, registry, k1],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        pid = int(owner.stdout.readline())  # trial_a holds k1
        found, order = {}, []
        waiter = _claim_in_thread(registry, k1, "trial_b", found, order)
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and not order  # trial_b waits on a live twin
        os.kill(pid, signal.SIGKILL)
        waiter.join(timeout=60)  # the old code waited 30 minutes of silence
        assert order == ["trial_b"] and found["trial_b"] == {}  # taken over: nothing was released
    finally:
        owner.kill()
        owner.wait()
    # trial_b holds it now: a third twin waits for trial_b, not for the dead trial_a
    third, after = {}, []
    waiter = _claim_in_thread(registry, k1, "trial_c", third, after)
    waiter.join(timeout=1.0)
    assert waiter.is_alive()
    release_point(registry, k1, "trial_b", "complete")
    waiter.join(timeout=60)
    assert third["trial_c"] == {"trial": "trial_b", "status": "complete"}


@pytest.mark.ray
def test_twins_that_start_together_train_once(registry):
    """Two trials of one point claim it at the same moment: one trains, the other waits for it and finds it done."""
    k1 = _key()
    order, found, gate = [], {}, threading.Barrier(2)

    def trial(name: str):
        gate.wait()
        found[name] = claim_point(registry, k1, name)
        order.append(name)  # "training"; the other waits until it is released
        order.append(f"{name} done")
        release_point(registry, k1, name, "complete")

    threads = [threading.Thread(target=trial, args=(name,)) for name in ("trial_a", "trial_b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    first, second = order[0], order[2]
    assert order == [first, f"{first} done", second, f"{second} done"]  # never two at once
    assert found[first] == {}  # the winner found the key free
    assert found[second] == {"trial": first, "status": "complete"}  # the other found it done


@pytest.mark.parametrize("gpus", [1.0, 0.0])
def test_a_gpu_evaluation_ends_its_worker_process(gpus):
    """The evaluation task's options, as the trial builds them (no GPU needed: nothing runs): with GPUs the worker
    process ends after the task (max_calls=1), so no CUDA context outlives an evaluation; on CPU workers stay pooled."""
    from attnlab.study.trial import evaluation_task
    from attnlab.train.config import TrainConfig

    cfg = TrainConfig(preset="tiny", data={"synthetic": "copy", "vocab": 64}, steps=2, gpus_per_worker=gpus,
                      cpus_per_worker=2)
    options = evaluation_task(cfg, "k1")._default_options
    assert options["num_gpus"] == gpus and options["num_cpus"] == 2
    assert options["max_calls"] == (1 if gpus else 0)
    assert options["name"] == "evaluate-k1"


def test_a_submitted_job_runs_the_study_with_the_submitters_compaction_choice():
    from attnlab.cli import build_parser
    from attnlab.study.submit import entrypoint

    command = entrypoint("studies/s.yaml", store="s3://b/r")
    assert command.endswith(" && attnlab study run studies/s.yaml --store s3://b/r")
    assert entrypoint("studies/s.yaml", compact=False).split()[-1] == "--no-compact"
    assert build_parser("study").parse_args(["study", "submit", "s.yaml", "--no-compact"]).compact is False
    assert build_parser("study").parse_args(["study", "submit", "s.yaml"]).compact is True


class _Submitted(Exception):
    pass


@pytest.fixture
def jobs(monkeypatch):
    """``submit_study`` up to the Jobs SDK: the study is a stand-in, and what would be submitted is recorded (or
    ``uploads`` stays empty where it was refused first)."""
    import ray.job_submission

    import attnlab.study.spec

    uploads = []

    class Client:
        def __init__(self, address):
            pass

        def submit_job(self, **job):
            uploads.append(job)
            return "job-1"

    class Spec:
        name, plugins = "s", ()

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", Client)
    monkeypatch.setattr(attnlab.study.spec, "load_spec", lambda *a, **k: Spec())
    return uploads


@pytest.mark.parametrize("flag", ["store", "runs"])
def test_submit_refuses_a_relative_location_for_a_remote_cluster_before_uploading(flag, jobs, tmp_path, monkeypatch):
    from attnlab.errors import UserError
    from attnlab.study.submit import submit_study

    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text("name: s\n")
    with pytest.raises(UserError) as refused:
        submit_study("s.yaml", "http://10.255.255.1:8265", **{flag: "results"})
    assert jobs == []
    message = str(refused.value)
    assert "\n" not in message and f"--{flag} 'results' is relative" in message and "s3://" in message
    for allowed in ("s3://bucket/attnlab/results", "gs://bucket/r", "/mnt/nfs/attnlab/results"):
        submit_study("s.yaml", "http://10.255.255.1:8265", **{flag: allowed})
        assert f"--{flag} {allowed}" in jobs[-1]["entrypoint"]


def test_submit_to_a_cluster_on_this_machine_makes_a_relative_location_absolute(jobs, tmp_path, monkeypatch):
    import socket

    from attnlab.study.submit import is_this_machine, submit_study

    here = ["auto", "localhost:8265", "http://[::1]:8265", f"http://{socket.gethostname()}:8265"]
    assert all(map(is_this_machine, here))
    assert not is_this_machine("http://10.255.255.1:8265")

    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text("name: s\n")
    submit_study("s.yaml", "http://127.0.0.1:8265", store="results", runs="runs")
    command = jobs[-1]["entrypoint"]
    assert f"--store {tmp_path / 'results'} --runs {tmp_path / 'runs'}" in command
    assert command.startswith(f"{sys.executable} -m attnlab study run s.yaml")  # this interpreter, not the PATH's


def test_a_job_entrypoint_does_not_depend_on_the_heads_path(tmp_path):
    """On this machine the job runs ``python -m attnlab`` with this interpreter; on another, a head whose PATH has no
    attnlab stops the job with one line that names the fix."""
    from attnlab.study.submit import PATH_ERROR, entrypoint

    bare = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),  # a head started from a venv that was not activated
            **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}}
    here = subprocess.run(entrypoint("s.yaml", python=sys.executable).replace("study run s.yaml", "--help"),
                          shell=True, env=bare, capture_output=True, text=True, timeout=120)
    assert here.returncode == 0 and "usage: attnlab" in here.stdout, here.stderr
    remote = subprocess.run(entrypoint("s.yaml"), shell=True, env=bare, capture_output=True, text=True, timeout=60)
    assert remote.returncode == 127 and remote.stderr.strip() == PATH_ERROR, remote.stderr
    assert "not found" not in remote.stderr
