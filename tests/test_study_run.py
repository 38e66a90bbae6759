"""Studies on a real local Ray: Optuna + ASHA completes, a re-run trains nothing, a killed study resumes.

Tiny preset on a small synthetic copy probe (vocabulary 64, so a step costs milliseconds), 12 steps of 4 x 64
tokens, evaluated at 1x and 4x with p_eval none and 15. Uses the session's ``ray_session`` cluster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from attnlab.results import ResultsStore
from attnlab.states import TrialStatus
from attnlab.study.runner import run_study, study_state
from attnlab.study.spec import load_spec
from attnlab.study.trial import plan_trial

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]

DATA = {"synthetic": "copy_distractors", "vocab": 64, "copy_len": 16}
TRAIN = {"preset": "tiny", "data": DATA, "steps": 12, "tokens_per_step": 256, "micro_batch": 4, "lr": 3.0e-3,
         "warmup_steps": 2, "log_every": 4, "val_every": 4, "val_tokens": 1024, "checkpoint_every": 12,
         "keep_checkpoints": 1, "max_failures": 0, "cpus_per_worker": 0.5}
EVAL = {"multiples": [1, 4], "p_eval": ["none", 15], "max_tokens": 1024}


def _write(tmp_path: Path, study: dict) -> Path:
    path = tmp_path / f"{study['name']}.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


def _val_rows(store: ResultsStore, study: str, h: str):
    return store.read(study=study, train_key=h, metric="val_loss")


def _run_dirs(state) -> set[str]:
    return set(state.loc.list_names("runs", hidden=False))


def test_optuna_asha_study_completes_and_a_rerun_trains_nothing(ray_session, tmp_path):
    import optuna

    train = {k: v for k, v in TRAIN.items() if k != "lr"}
    study = {"name": "optuna-asha", "train": train, "resources": {"trial_cpus": 0.5},
             "search": {"engine": "optuna", "num_samples": 4, "seed": 0},
             "space": {"attention": ["softmax", "lssa"], "p_train": {"values": [3, 15], "when": ["lssa"]},
                       "lr": [1.0e-3, 3.0e-3]},
             "objective": ["val_loss@4x", "val_loss@1x"],
             "scheduler": {"type": "asha", "grace_period": 4, "reduction_factor": 2}, "eval": EVAL}
    spec = load_spec(_write(tmp_path, study))
    store_uri, runs = str(tmp_path / "results"), str(tmp_path / "runs")
    summary = run_study(spec, store=store_uri, runs=runs, verbose=0)
    state = study_state(spec, runs)
    # the study's results were compacted when it ended: one compacted file, no written file left
    study_dir = tmp_path / "results" / "study=optuna-asha"
    assert summary.compacted and "merged" in summary.compacted
    assert len(list((study_dir / "_compacted").glob("*.parquet"))) == 1
    assert not list(study_dir.glob("train_key=*/*.parquet"))

    # 4 Tune trials; Optuna may propose one configuration twice: the second finds it complete and trains nothing
    assert 2 <= len(summary.trials) <= 4
    assert summary.trained == len(summary.trials)
    statuses = [t["status"] for t in summary.trials]
    assert set(statuses) <= {"complete", "pruned", "cached"}, summary.trials
    assert "complete" in statuses  # the first trial always reaches the end (ASHA has nothing to compare yet)
    store = ResultsStore(store_uri)
    for trial in summary.trials:
        rows = _val_rows(store, "optuna-asha", trial["train_key"])
        if trial["status"] in ("complete", "cached"):  # cached: Optuna proposed a finished point again
            # every length x p_eval, exactly once
            cells = sorted((int(r.eval_len), -1.0 if r.p_eval != r.p_eval else r.p_eval) for r in rows.itertuples())
            assert cells == [(64, -1.0), (64, 15.0), (256, -1.0), (256, 15.0)]  # -1: p_eval none
            assert len(store.stored_eval_keys("optuna-asha", trial["train_key"])) == 4
            assert set(trial["objectives"]) == {"val_loss@4x", "val_loss@1x"}
            at_4x = rows[(rows.eval_len == 256) & rows.p_eval.isna()].value.iloc[0]
            assert trial["objectives"]["val_loss@4x"] == pytest.approx(at_4x)
        else:
            assert len(rows) == 0 and "stopped by asha at step" in trial["reason"]

    ot = optuna.load_study(study_name="optuna-asha", storage=summary.optuna_url)
    assert summary.optuna_url == f"sqlite:///{state.loc.child('optuna.db').path}"
    assert len(ot.trials) == 4
    states = sorted(t.state.name for t in ot.trials)
    assert set(states) <= {"COMPLETE", "PRUNED"}  # none left RUNNING: stopped trials are PRUNED
    assert states.count("COMPLETE") >= statuses.count("complete")
    assert states.count("PRUNED") >= statuses.count("pruned")
    for t in ot.trials:
        if t.state.name == "COMPLETE":
            assert len(t.values) == 2 and all(v > 0 for v in t.values)
    assert list(Path(state.tune.path).rglob("events.out.tfevents.*")), "TensorBoard event files in Tune's folder"
    assert Path(summary.curves["png"]).stat().st_size > 0

    rows_before = len(store.read(study="optuna-asha"))
    runs_before = _run_dirs(state)
    again = run_study(spec, store=store_uri, runs=runs, verbose=0)
    assert again.restored and again.trained == 0 and again.evaluated == 0
    assert _run_dirs(state) == runs_before
    assert len(store.read(study="optuna-asha")) == rows_before


def test_a_grown_evaluation_evaluates_existing_checkpoints_and_trains_nothing(ray_session, tmp_path):
    """The paper's point is that sharpening needs no retraining: a study that adds a p_eval value and a 16x length
    after it finished measures only the new cells; a cached trial reports the objective of its exact cell."""
    study = {"name": "grow", "train": {**TRAIN, "steps": 4, "checkpoint_every": 4}, "search": {"engine": "grid"},
             "space": {"attention": ["softmax", "lssar"]}, "objective": "val_loss@4x",
             "eval": {"multiples": [1, 4], "p_eval": ["none"], "max_tokens": 1024}}
    store_uri, runs = str(tmp_path / "results"), str(tmp_path / "runs")
    first = run_study(load_spec(study), store=store_uri, runs=runs, verbose=0)
    assert first.trained == 2 and [t["status"] for t in first.trials] == ["complete"] * 2
    # no scheduler: Tune ran the second trial in the first one's process (a process start and its imports saved)
    assert sorted(t["timing"]["trial_in_process"] for t in first.trials) == [1, 2]
    store = ResultsStore(store_uri)
    before = store.read(study="grow", metric="val_loss")
    assert len(before) == 2 * 2

    grown = {**study, "eval": {"multiples": [1, 4, 16], "p_eval": ["none", 3], "max_tokens": 1024}}
    second = run_study(load_spec(grown), store=store_uri, runs=runs, verbose=0)
    assert second.trained == 0 and second.restored  # the search is unchanged: the Tune state resumes
    assert second.evaluated == 2 * (6 - 2)  # per trial: 3 lengths x 2 p_eval, minus the 2 cells it had
    after = store.read(study="grow", metric="val_loss")
    assert len(after) == 2 * 3 * 2
    assert after.groupby(["train_key", "eval_len", "p_eval"], dropna=False).size().max() == 1
    old = before.set_index(["train_key", "eval_len"])["value"]
    kept = after[after.p_eval.isna() & after.eval_len.isin([64, 256])].set_index(["train_key", "eval_len"])["value"]
    assert kept.sort_index().tolist() == old.sort_index().tolist()  # old cells were not measured again

    third = run_study(load_spec(grown), store=store_uri, runs=runs, verbose=0)
    assert third.trained == 0 and third.evaluated == 0
    assert len(store.read(study="grow")) == len(store.read(study="grow"))  # and nothing was written
    fresh = run_study(load_spec(grown), store=store_uri, runs=runs, resume=False, verbose=0)
    assert fresh.trained == 0 and [t["status"] for t in fresh.trials] == ["cached"] * 2
    for trial in fresh.trials:  # the cached report is the objective's own cell (4x, p_eval none, ntk)
        rows = after[(after.train_key == trial["train_key"]) & (after.eval_len == 256) & after.p_eval.isna()]
        assert trial["objectives"]["val_loss@4x"] == pytest.approx(rows["value"].iloc[0])


def test_killed_study_resumes_without_duplicates(ray_session, tmp_path):
    study = {"name": "grid-resume", "train": TRAIN, "resources": {"trial_cpus": 0.5}, "search": {"engine": "grid"},
             "space": {"attention": ["softmax", "lssar"]}, "objective": "val_loss@4x", "eval": EVAL}
    path = _write(tmp_path, study)
    spec = load_spec(path)
    store_uri, runs = str(tmp_path / "results"), str(tmp_path / "runs")
    state = study_state(spec, runs)
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    proc = subprocess.Popen([sys.executable, "-m", "attnlab.cli", "study", "run", str(path), "--store", store_uri,
                             "--runs", runs], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    first_done = None
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            done = [t for t in state.statuses() if t["status"] == "complete"]
            if done:
                first_done = done[0]["train_key"]
                break
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver dies mid-study
        proc.wait()
    assert first_done is not None, "the first trial never completed"

    summary = run_study(spec, store=store_uri, runs=runs, verbose=0)
    statuses = {t["train_key"]: t["status"] for t in summary.trials}
    # the trial that finished before the kill is done (complete, or cached when Tune re-ran it and found it done)
    assert len(statuses) == 2 and set(statuses.values()) <= {"complete", "cached"}, summary.trials
    store = ResultsStore(store_uri)
    val = store.read(study="grid-resume", metric="val_loss")
    assert len(val) == 2 * 4  # 2 trials x 2 lengths x 2 p_eval: no duplicates
    assert val.groupby(["train_key", "eval_len", "p_eval"], dropna=False).size().max() == 1
    events = [state.loc.read_json(f"events/{name}") for name in state.loc.list_names("events")]
    assert sum(1 for e in events if e["train_key"] == first_done) == 1  # the finished trial never retrained
    assert len(_run_dirs(state)) == 2


def test_diverged_and_crashed_trials_are_recorded_and_the_study_goes_on(ray_session, tmp_path, monkeypatch):
    """lr = 1e6 makes the loss NaN within a few steps (a real divergence, not a mock); a trial whose worker raises with
    no retries left fails. Both are recorded with their reason, and the good trial still completes."""
    monkeypatch.setenv("ATTNLAB_FAIL_AT_STEP", "3")
    monkeypatch.setenv("ATTNLAB_FAIL_RANK", "0")
    # log_every 1: the loop finds a divergence on the steps that report, before step 3's injected failure
    train = {**{k: v for k, v in TRAIN.items() if k != "lr"}, "steps": 6, "checkpoint_every": 6, "log_every": 1}
    study = {"name": "failures", "train": train, "resources": {"trial_cpus": 0.5},
             "search": {"engine": "grid"}, "space": {"attention": ["softmax"], "lr": [1.0e6]},
             "objective": "val_loss@4x", "scheduler": "none", "eval": EVAL}
    spec = load_spec(_write(tmp_path, study))
    store_uri, runs = str(tmp_path / "results"), str(tmp_path / "runs")
    summary = run_study(spec, store=store_uri, runs=runs, verbose=0)
    (diverged,) = summary.trials
    assert diverged["status"] == "diverged" and "loss is nan at step" in diverged["reason"]
    rows = ResultsStore(store_uri).read(study="failures", metric="val_loss")
    assert len(rows) > 0 and rows["value"].isna().all()  # tables show the diverged run, not a hole

    # a crash beyond the retries (max_failures 0): the injected failure at step 3 is not absorbed
    study2 = {**study, "name": "crash", "space": {"attention": ["softmax", "lssa"]}, "train": {**train, "lr": 3e-3}}
    monkeypatch.setenv("ATTNLAB_FAIL_ONCE_FILE", str(tmp_path / "crashed-once"))
    summary = run_study(load_spec(_write(tmp_path, study2)), store=store_uri, runs=runs, verbose=0)
    by_status = sorted(t["status"] for t in summary.trials)
    assert by_status == ["complete", "failed"], summary.trials
    failed = next(t for t in summary.trials if t["status"] == "failed")
    assert "injected worker failure at step 3" in failed["reason"]

    # a trial whose process dies (no exception the trial could record: killed, out of memory, its node gone) is
    # failed too, with Tune's error as the reason, and counted as such (study run then exits 1); it was left
    # "running" and the study reported success
    monkeypatch.setenv("ATTNLAB_FAIL_HOW", "exit")
    monkeypatch.setenv("ATTNLAB_FAIL_ONCE_FILE", str(tmp_path / "died-once"))
    study3 = {**study2, "name": "died", "space": {"attention": ["softmax"]}}
    summary = run_study(load_spec(_write(tmp_path, study3)), store=store_uri, runs=runs, verbose=0)
    (died,) = summary.trials
    assert died["status"] == "failed" and "the trial's process died" in died["reason"], died
    assert summary.count(TrialStatus.FAILED) == 1


def test_a_trial_that_died_before_recording_a_run_is_counted_failed(tmp_path):
    """A Tune trial that errored before it wrote its run's status (its node removed by the autoscaler before the
    trial started there, as a loaded CI machine once showed) gets a status file all the same, written by the driver
    under its point's run key: failed, with the error, and counted (tests/test_study_outcomes.py has trials that
    die for real in their workers)."""
    from types import SimpleNamespace

    from attnlab.results import ResultsStore
    from attnlab.study.runner import _record_died, study_context

    spec = load_spec({"name": "lost", "train": TRAIN, "search": {"engine": "grid"},
                      "space": {"attention": ["softmax"], "seeds": [0, 1]}, "objective": "val_loss@1x", "eval": EVAL})
    state = study_state(spec, str(tmp_path / "runs"))
    ctx = study_context(spec, state, ResultsStore(str(tmp_path / "results")))
    error = RuntimeError("The actor died because its node has died. Terminated by autoscaler.")
    # Tune's results, as ResultGrid holds them: the one that ended well is the trial's own to record
    _record_died(ctx, [SimpleNamespace(error=None, config={"point": {"attention": "softmax", "seed": 0}}, metrics={}),
                       SimpleNamespace(error=error, config={"point": {"attention": "softmax", "seed": 1}},
                                       metrics={"trial_id": "abc_00001"})])
    (record,) = state.statuses()
    assert record["status"] == "failed" and record["point"] == {"attention": "softmax", "seed": 1}
    assert record["reason"] == ("the trial's process died: killed, or crashed (RuntimeError: The actor died because "
                                "its node has died. Terminated by autoscaler.)")
    assert record["train_key"] == plan_trial(ctx, record["point"], "x").train_key and record["trial"] == "abc_00001"


def _queue_actors() -> int:
    """How many of Ray's queue actors this cluster has started (alive or not)."""
    from ray.util.state import list_actors

    return len(list_actors(filters=[("class_name", "=", "_QueueActor")], limit=10_000, raise_on_missing_output=False))


def test_a_one_worker_trial_trains_in_its_own_process_as_the_plain_loop_would(ray_session, tmp_path, monkeypatch):
    """The default one-worker CPU trial trains and evaluates in its Tune trial's process (resources.train_in_trial):
    a failure restarts it from its latest checkpoint (max_failures), and its losses and results equal those of the
    same config trained uninterrupted by the plain loop in this process and evaluated here. (The plain loop's losses
    are Ray Train's: tests/test_train.py resumes a plain run with Ray Train. A study whose trials train with Ray
    Train is tests/test_trial_counts.py's and tests/test_multinode.py's.)"""
    from ray.util.queue import Queue

    from attnlab.evaluate import evaluate_checkpoint
    from attnlab.location import Location
    from attnlab.runfolder import read_metrics
    from attnlab.train import load_train_config
    from attnlab.train.loop import train_here

    # one thread in the trial and here: the same computation on the same shapes, compared exactly
    train = {**TRAIN, "steps": 8, "log_every": 2, "val_every": 4, "checkpoint_every": 4, "max_failures": 1,
             "threads_per_worker": 1}
    spec = load_spec({"name": "in-trial", "train": train, "search": {"engine": "grid"},
                      "space": {"attention": ["lssar"]}, "objective": "val_loss@4x", "eval": EVAL})
    store_uri, runs = str(tmp_path / "results"), str(tmp_path / "runs")
    queues = [_queue_actors()]
    monkeypatch.setenv("ATTNLAB_FAIL_AT_STEP", "5")  # once, after the step-4 checkpoint: one restart absorbs it
    monkeypatch.setenv("ATTNLAB_FAIL_ONCE_FILE", str(tmp_path / "failed-once"))
    here = run_study(spec, store=store_uri, runs=runs, verbose=0)
    queues.append(_queue_actors())
    assert (tmp_path / "failed-once").exists()
    (trial,) = here.trials
    assert trial["status"] == "complete"
    folder = Location.parse(f"{runs}/in-trial/runs/{trial['train_key']}")
    assert not any(n.startswith("checkpoint_") for n in folder.list_names(hidden=False))  # no Ray Train checkpoint
    assert folder.list_names("checkpoints", hidden=False) == ["step_0000008"]  # keep_checkpoints 1
    # Ray Train's reports reach Tune through a queue actor (TuneReportCallback makes it); a trial that trains in its
    # own process reports to Tune directly and starts none (it started one per trial, a process each, unused). The
    # count sees a queue actor when there is one:
    Queue()
    queues.append(_queue_actors())
    assert queues[1] == queues[0] and queues[2] == queues[1] + 1, queues

    monkeypatch.delenv("ATTNLAB_FAIL_AT_STEP")
    cfg = load_train_config(folder.read_json("provenance.json")["config"])
    reference = tmp_path / "plain"
    train_here(cfg, reference)

    def losses(run):
        return {(m["step"], k): m[k] for m in read_metrics(run) for k in ("train_loss", "val_loss") if k in m}

    assert losses(folder) == losses(Location.parse(str(reference))) and len(losses(folder)) == 6
    cells = ["eval_len", "p_eval", "metric"]
    ours = pd.DataFrame(evaluate_checkpoint(reference, spec.eval, data=cfg.data, device="cpu"))
    theirs = ResultsStore(store_uri).read(study="in-trial")
    ours, theirs = (frame.sort_values(cells)[cells + ["value"]].reset_index(drop=True) for frame in (ours, theirs))
    assert len(theirs) > 0 and theirs.equals(ours), (theirs, ours)
