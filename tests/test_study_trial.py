"""A trial's shared context and its twin: the objects a trial receives, and a point the search proposes twice."""

from __future__ import annotations

import pickle
import threading
import time

import pytest

from attnlab.location import Location
from attnlab.results import ResultsStore
from attnlab.study.spec import StudySpec
from attnlab.study.state import StudyState
from attnlab.study.trial import StudyContext, StudyData, claim_point, plan_trial, wait_for_twin


def _spec() -> StudySpec:
    return StudySpec.model_validate({
        "name": "twins", "train": {"preset": "tiny", "data": {"synthetic": "copy_distractors", "vocab": 64},
                                   "steps": 4, "tokens_per_step": 256, "micro_batch": 4},
        "search": {"engine": "optuna", "num_samples": 2, "seed": 1}, "space": {"attention": ["softmax", "lssar"]},
        "objective": "val_loss@2x", "eval": {"multiples": [1, 2]}})


def test_the_context_carries_objects_that_pickle_as_themselves(tmp_path):
    spec = _spec()
    state = StudyState(tmp_path / "runs", spec.name)
    data = StudyData(resolved={"synthetic": "copy"}, fingerprint="f" * 16, vocab_size=64, label="synthetic:copy",
                     min_tokens=2**62, described="synthetic copy")
    ctx = StudyContext(spec=spec, state=state, store=ResultsStore(tmp_path / "results"), data=data, launched=12.5)
    back = pickle.loads(pickle.dumps(ctx))
    assert isinstance(back.spec, StudySpec) and back.spec == spec
    assert isinstance(back.state, StudyState) and back.state.loc == state.loc
    assert isinstance(back.store, ResultsStore) and back.store.uri == str(tmp_path / "results")
    assert back.launched == 12.5
    assert back.data == data
    plan = plan_trial(back, {"attention": "lssar"}, "trial_0")
    # one name per idea: the rows' trial is the Tune trial, the run's identity is its train_key
    assert plan.row_context["trial"] == "trial_0" and plan.row_context["train_key"] == plan.train_key
    assert "config_hash" not in plan.row_context
    assert isinstance(plan.run, Location)
    assert plan.run.uri == str(tmp_path / "runs" / "twins" / "runs" / plan.train_key)


def _running(state: StudyState, key: str, trial: str, started: float) -> None:
    state.write_status(key, status="running", trial=trial, started=started)


def test_a_twin_waits_for_the_trial_training_its_point(tmp_path):
    state = StudyState(tmp_path / "runs", "twins")
    launched = time.time()
    _running(state, "k1", "trial_a", launched + 1)

    def finish():
        time.sleep(0.6)
        state.write_status("k1", status="complete", finished=time.time())

    threading.Thread(target=finish).start()
    t0 = time.monotonic()
    record = wait_for_twin(state, "k1", launched, "trial_b", poll=0.05)
    assert time.monotonic() - t0 >= 0.5
    assert record["status"] == "complete" and record["finished"] >= launched


@pytest.mark.parametrize("case", ["own", "earlier run", "unknown key", "finished"])
def test_nothing_to_wait_for(tmp_path, case):
    state = StudyState(tmp_path / "runs", "twins")
    launched = time.time()
    if case == "own":
        _running(state, "k1", "trial_b", launched + 1)  # Tune restarted this very trial
    elif case == "earlier run":
        _running(state, "k1", "trial_a", launched - 100)  # a study run killed before this one started
    elif case == "finished":
        state.write_status("k1", status="cached", trial="trial_a", started=launched + 1)
    t0 = time.monotonic()
    record = wait_for_twin(state, "k1", launched, "trial_b", poll=5.0)
    assert time.monotonic() - t0 < 1.0
    assert record.get("status") == {"own": "running", "earlier run": "running", "unknown key": None,
                                    "finished": "cached"}[case]


def test_a_twin_that_went_silent_is_no_longer_waited_for(tmp_path):
    state = StudyState(tmp_path / "runs", "twins")
    launched = time.time()
    _running(state, "k1", "trial_a", launched + 1)
    t0 = time.monotonic()
    record = wait_for_twin(state, "k1", launched, "trial_b", poll=0.05, stale=0.4)
    assert 0.4 <= time.monotonic() - t0 < 3.0
    assert record["status"] == "running"  # as found: this trial resumes the run from its checkpoint


def test_twins_that_start_together_train_once(tmp_path):
    """Two trials of one point claim it at the same moment: one trains, the other waits for it and finds it done."""
    state = StudyState(tmp_path / "runs", "twins")
    launched = time.time()
    order, found, gate = [], {}, threading.Barrier(2)

    def trial(name: str):
        gate.wait()  # both read the key as free before either claims it
        found[name] = claim_point(state, "k1", launched, {"trial": name, "point": {}}, settle=0.3)
        order.append(name)  # "training"
        time.sleep(0.5)
        state.write_status("k1", status="complete", trial=name, finished=time.time())

    threads = [threading.Thread(target=trial, args=(name,)) for name in ("trial_a", "trial_b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    first, second = order
    assert found[first] == {}  # the winner found the key free
    assert found[second]["status"] == "complete" and found[second]["trial"] == first  # the other found it done


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
