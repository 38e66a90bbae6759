"""Watching a study and a run: the one-line plans, warnings and progress, the quiet console with its live view,
Optuna trials tied to their runs and steps, and the opt-in trackers (MLflow's file store, W&B offline)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from attnlab.states import TrialStatus
from attnlab.study.console import LiveView, trial_label
from attnlab.study.folder import StudyFolder, TrialRecord
from attnlab.train import load_train_config


def test_presets_carry_a_recipe_that_fits_them_and_bad_recipes_are_warned_about():
    tiny = load_train_config({"preset": "tiny", "data": "demo"})
    assert (tiny.tokens_per_step, tiny.micro_batch, tiny.steps, tiny.warmup_steps) == (1024, 16, 300, 20)
    assert tiny.warnings() == [] and "plan: tiny softmax, 300 steps x 1,024 tokens (16 x 64)" in tiny.plan()
    small = load_train_config({"preset": "gpt2-small", "data": "x"})
    assert (small.tokens_per_step, small.lr, small.warmup_steps) == (524_288, 6e-4, 700)  # llm.c's recipe
    explicit = load_train_config({"preset": "tiny", "data": "demo", "lr": 1e-4})
    assert explicit.lr == 1e-4 and "lr" in explicit.model_fields_set and "steps" not in explicit.model_fields_set
    bad = load_train_config({"preset": "tiny", "data": "demo", "steps": 20, "warmup_steps": 700,
                             "tokens_per_step": 524_288})
    warnings = bad.warnings()
    assert len(warnings) == 2
    assert warnings[0].startswith("warmup_steps=700 >= steps=20: the learning rate never leaves warm-up")
    assert "is 512 micro-steps of micro_batch=16" in warnings[1]


def test_the_live_view_prints_a_line_per_change(tmp_path):
    state = StudyFolder(str(tmp_path), "watch")
    state.write_status("k1", status="running", point={"attention": "lssar"}, steps=10, run_dir="x")
    state.run("k1").write_text("metrics.jsonl", json.dumps({"step": 2, "train_loss": 5.5}) + "\n")
    state.write_status("k2", status="failed", point={"attention": "softmax", "lr": 1e6}, reason="RuntimeError: boom")
    view = LiveView(state, interval=0.1)
    first = view.lines()
    assert len(first) == 2
    assert "running" in first[0] and "lssar" in first[0] and "step 2/10 · loss 5.5000" in first[0]
    assert "failed" in first[1] and "softmax lr=1000000.0" in first[1] and "RuntimeError: boom" in first[1]
    assert view.lines() == []  # nothing changed
    state.run("k1").write_text("metrics.jsonl", "".join(json.dumps({"step": s, "train_loss": 5.0, "val_loss": 5.2})
                                                        + "\n" for s in (2, 4)))
    (line,) = view.lines()
    assert "step 4/10 · loss 5.0000 · val 5.2000" in line
    state.write_status("k1", status="complete", objectives={"val_loss@4x": 5.1})
    (line,) = view.lines()
    assert "complete" in line and "val_loss@4x 5.1000" in line
    assert trial_label(TrialRecord.parse({"point": {"attention": "lssa", "p_train": False}})) == "lssa p_train=off"
    # a point without an attention axis: the variant its config resolved; an older file saying config_hash reads alike
    older = TrialRecord.parse({"config_hash": "k3", "point": {"seed": 1}, "attention": "softmax", "status": "cached"})
    assert (trial_label(older), older.train_key, older.status) == ("softmax seed=1", "k3", TrialStatus.CACHED)
    # every status an older file holds reads as its member; a file without one (or with one never written) as UNKNOWN
    for written in ("running", "complete", "cached", "diverged", "pruned", "failed"):
        assert TrialRecord.parse({"status": written}).status is TrialStatus(written)
    assert TrialRecord.parse({}).status is TrialStatus.read("queued") is TrialStatus.UNKNOWN
    state.write_status("k4", status=TrialStatus.PRUNED)  # written as its string
    assert json.loads(Path(state.loc.path, "trials", "k4.json").read_text())["status"] == "pruned"


def test_the_plan_line_names_the_ray_dashboard_and_the_study_records_it(tmp_path, monkeypatch):
    """No Ray: a stand-in ``ray`` module says which cluster this process joined; the GCS is not asked twice."""
    import types

    from attnlab import ray_runtime
    from attnlab.ray_runtime import Dashboard
    from attnlab.study.console import say
    from attnlab.study.runner import study_plan
    from attnlab.study.spec import StudySpec

    connected = {"gcs": None}
    fake = types.SimpleNamespace(
        is_initialized=lambda: connected["gcs"] is not None,
        get_runtime_context=lambda: types.SimpleNamespace(gcs_address=connected["gcs"]))
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(ray_runtime, "_dashboards", {"10.0.0.1:6379": Dashboard("http://127.0.0.1:40001")})
    asked = []
    answers = {"10.0.0.2:6379": (None, True), "10.0.0.3:6379": (None, False),
               "10.0.0.4:6379": ("http://10.0.0.4:8265", True)}
    monkeypatch.setattr(ray_runtime, "_ask_dashboard", lambda gcs: asked.append(gcs) or answers[gcs])

    assert ray_runtime.dashboard().line() == "Ray dashboard: none (not connected to a Ray cluster)"
    connected["gcs"] = "10.0.0.1:6379"  # an embedded cluster: the port ensure_ray chose, nothing asked
    assert ray_runtime.dashboard() == Dashboard("http://127.0.0.1:40001") and asked == []
    connected["gcs"] = "10.0.0.4:6379"  # RAY_ADDRESS or a Ray job: what the cluster's GCS records, asked once
    assert ray_runtime.dashboard().url == ray_runtime.dashboard().url == "http://10.0.0.4:8265"
    assert asked == ["10.0.0.4:6379"]
    connected["gcs"] = "10.0.0.2:6379"
    assert ray_runtime.dashboard().line() == "Ray dashboard: none (the cluster runs without one)"
    connected["gcs"] = "10.0.0.3:6379"
    assert ray_runtime.dashboard().line() == "Ray dashboard: none (unknown: the cluster's GCS at 10.0.0.3:6379 did " \
                                            "not answer)"

    spec = StudySpec.model_validate({"name": "planned", "train": {"preset": "tiny", "data": "demo", "steps": 6},
                                     "space": {"attention": ["softmax"]}, "objective": "val_loss@2x"})
    board = Dashboard("http://127.0.0.1:40001")
    line = study_plan(spec, board)
    assert line.startswith("plan: study planned: 1 trial(s)")
    assert line.endswith("; Ray dashboard: http://127.0.0.1:40001")
    assert "Ray dashboard" not in study_plan(spec)

    # the printing: the terminal, and the log file when there is one
    log = tmp_path / "ray.log"
    log.write_text("earlier Ray output\n")
    printed = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: printed.append(" ".join(map(str, a))))
    say(line, str(log))
    say("no log file here")
    assert printed == [line, "no log file here"]
    lines = log.read_text().splitlines()
    assert lines[0] == "earlier Ray output" and lines[1].endswith(f" attnlab: {line}") and len(lines) == 2

    # the record attnlab serve reads, next to the spec
    state = StudyFolder(str(tmp_path / "runs"), "planned")
    state.write_study({"name": "planned"}, "fp")
    assert state.saved_study().ray is None and "ray" not in state.loc.read_json("study.json")
    state.write_study({"name": "planned"}, "fp", ray=board.record())
    recorded = state.saved_study().ray
    assert recorded["dashboard"] == "http://127.0.0.1:40001" and recorded["note"] == ""
    assert state.saved_study().fingerprint == "fp"
    state.write_study({"name": "planned"}, "fp", ray=Dashboard(None, "the cluster runs without one").record())
    assert state.saved_study().ray["dashboard"] is None
    # read back typed: the objectives parsed once, an older study.json's Optuna "storage" still found
    state.write_study({"name": "planned", "search": {"engine": "optuna"}, "storage": "sqlite:////x.db",
                       "objective": ["val_loss@16x,p_eval=15", "not an objective", {"metric": "acc@4x"}]}, "fp")
    saved = state.saved_study()
    assert (saved.engine, saved.optuna_storage, saved.description) == ("optuna", "sqlite:////x.db", None)
    assert [o.key for o in saved.objectives] == ["val_loss@16x,p_eval=15", "acc@4x"]
    assert saved.objectives[0].parts.multiple == 16.0 and saved.objectives[1].mode == "max"


def test_train_prints_its_plan_warnings_and_progress(tmp_path, demo_bytes_dir):
    """The console of a run (bytes, a vocabulary of 256: with GPT-2's a tiny model's step costs ten times more, and
    what is printed is the same)."""
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "attnlab.cli", "train", "--preset", "tiny", "--data",
                          str(demo_bytes_dir), "--out", str(out), "--steps", "6", "--set", "log_every=1",
                          "--set", "val_tokens=256", "--set", "threads_per_worker=1", "--local"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    plan = r"plan: tiny (\([0-9.]+M params\) )?softmax, 6 steps x 1,024 tokens \(16 x 64\)"
    assert re.match(plan, lines[0]), lines[0]
    assert any(line.startswith("attnlab: warning: warmup_steps=20 >= steps=6") for line in lines)
    assert any("step 6/6" in line and "done" in line for line in lines), res.stdout


@pytest.mark.ray
@pytest.mark.slow
def test_a_quiet_study_with_optuna_and_trackers(ray_session, tmp_path):
    import mlflow
    import optuna

    study = {"name": "watched",
             "train": {"preset": "tiny", "data": {"synthetic": "copy_distractors", "vocab": 64, "copy_len": 16},
                       "steps": 6, "tokens_per_step": 256, "micro_batch": 4, "warmup_steps": 2, "log_every": 2,
                       "val_every": 2, "val_tokens": 512, "checkpoint_every": 6, "max_failures": 0,
                       "cpus_per_worker": 0.5},
             "resources": {"trial_cpus": 0.5}, "search": {"engine": "optuna", "num_samples": 2, "seed": 1},
             "space": {"attention": ["softmax", "lssar"]}, "objective": "val_loss@2x",
             "eval": {"multiples": [1, 2], "max_tokens": 512}, "trackers": ["mlflow", "wandb"]}
    path = tmp_path / "watched.yaml"
    path.write_text(yaml.safe_dump(study))
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address, "WANDB_MODE": "offline",
           "WANDB_DIR": str(tmp_path / "wandb"), "WANDB_SILENT": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)
    (tmp_path / "wandb").mkdir()
    started = time.time()
    # While it runs, the cluster's raylet-to-driver channel carries the raylet's worker-pool warning to every
    # driver (as the raylet does when many trials start workers): the quiet console must not print it.
    import threading

    from ray._private.utils import publish_error_to_driver

    warning = ("WARNING: 24 PYTHON worker processes have been started on node: test with address: 127.0.0.1. "
               "This could be a result of using a large number of actors")
    done = threading.Event()

    def warn() -> None:
        gcs = ray_session._private.worker.global_worker.gcs_client
        while not done.wait(1.0):
            publish_error_to_driver("worker_pool_large", warning, gcs_client=gcs)

    warner = threading.Thread(target=warn, daemon=True)
    warner.start()
    try:
        res = subprocess.run([sys.executable, "-m", "attnlab.cli", "study", "run", str(path), "--store",
                              str(tmp_path / "results"), "--runs", str(tmp_path / "runs")],
                             capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    finally:
        done.set()
        warner.join()
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    out = res.stdout
    assert "PYTHON worker processes have been started" not in out + res.stderr, (out + res.stderr)[-3000:]
    assert out.startswith("plan: study watched: 2 trial(s) (optuna), each 6 steps x 256 tokens")
    # the plan line ends with the dashboard of the cluster the study ran on (the session's), read from its GCS
    plan = out.splitlines()[0]
    assert plan.endswith(f"; Ray dashboard: {os.environ['RAY_API_SERVER_ADDRESS']}"), plan
    for noise in ("TrainController", "TrainingReport(", "+----", "Trial status", "(pid=", "Configuration for experiment",
                  "View detailed results here"):
        assert noise not in out, f"{noise!r} reached the terminal:\n{out}"
    log = next(line.split(": ", 1)[1].split(" (")[0] for line in out.splitlines()
               if line.startswith("Ray's and Tune's own output: "))
    assert Path(log).is_file() and Path(log).stat().st_size > 0
    assert f"attnlab: {plan}" in Path(log).read_text()  # the log file names the dashboard too
    assert f"(raylet) {warning}" in Path(log).read_text()  # the raylet's warning went there
    # a cluster the study joined (RAY_ADDRESS) is not its own: serve keeps linking its dashboard after the study
    recorded = StudyFolder(str(tmp_path / "runs"), "watched").saved_study().ray
    assert recorded["embedded"] is False and "stopped" not in recorded
    assert sum(" complete " in line for line in out.splitlines()) >= 1, out  # once failed in a full run: show why
    # TPE with seed 1 proposes lssar twice: the twin waits for the trial training it and reuses its run (one
    # training, never two at once in one run folder), and the summary counts both trials
    assert "study watched: 2 trial(s) on 1 distinct training run(s)" in out, out
    assert "1 complete; 1 trained this run" in out, out
    state = StudyFolder(str(tmp_path / "runs"), "watched")
    # Optuna: intermediate values at training steps, trials tied to their run and training key
    ot = optuna.load_study(study_name="watched", storage=state.optuna_url(None))
    # (the second lssar trial reuses the trained run and reports step 6 only)
    for trial in ot.trials:
        assert trial.user_attrs["train_key"] in trial.user_attrs["run"]
        assert 6 in trial.intermediate_values and set(trial.intermediate_values) <= {2, 4, 6}
    # training steps (6: the final one), not report counts
    assert any(set(t.intermediate_values) == {2, 4, 6} for t in ot.trials)
    # MLflow (file store next to the study): one run per trial, metrics by training step
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri(f"file://{state.loc.child('mlruns').path}")
    runs = mlflow.search_runs(experiment_names=["watched"])
    assert len(runs) == 2
    histories = [mlflow.MlflowClient().get_metric_history(run_id, "train_loss") for run_id in runs.run_id]
    assert max(sorted(m.step for m in history) for history in histories) == [2, 4]
    # W&B offline: a run folder per trial
    assert len(list((tmp_path / "wandb").rglob("offline-run-*"))) == 2
    assert time.time() - started < 900
