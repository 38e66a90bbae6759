"""The stopping rule (train.stop_when): it stops a run at the first validation point that meets it, a capped run
says so, resuming never trains past a met rule, a study's rows and table mark capped trials, bad rules are one line.

A tiny copy task (vocabulary 16, 4 copied tokens, 16-token windows) that the tiny preset learns in ~40 steps of a
second; plain-process runs (``LocalSession``, no Ray) except the one study.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnlab.errors import UserError
from attnlab.location import Location
from attnlab.states import RunStatus, StopReason
from attnlab.train import load_train_config
from attnlab.train.loop import LocalSession, train_worker
from attnlab.runfolder import outcome

DATA = {"synthetic": "copy_distractors", "vocab": 16, "copy_len": 4}
TRAIN = dict(preset="tiny", data=DATA, seq_len=16, steps=300, tokens_per_step=512, micro_batch=32, lr=3e-3,
             warmup_steps=5, log_every=10, val_every=10, val_tokens=1024, checkpoint_every=300, precision="fp32",
             threads_per_worker=1, stop_when={"metric": "val_acc", "at_least": 0.99})


def _cfg(**over):
    return load_train_config({**TRAIN, **over})


def _train(cfg, run: Path) -> dict:
    return train_worker(cfg, LocalSession(run, keep=cfg.keep_checkpoints), run)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def reached(tmp_path_factory):
    """One uninterrupted run that meets val_acc >= 0.99 well before its 300-step cap."""
    run = tmp_path_factory.mktemp("stop") / "reached"
    last = _train(_cfg(), run)
    return run, last


def test_the_rule_stops_the_run_where_it_is_met(reached):
    run, last = reached
    lines = _metrics(run)
    stop = last["step"]
    assert last["stopped"] == "reached" and last["val_acc"] >= 0.99
    assert stop < 300 and stop % 10 == 0  # at a validation point, before the cap
    assert lines[-1]["step"] == stop and lines[-1]["stopped"] == "reached"
    assert all(m.get("val_acc", 0) < 0.99 for m in lines[:-1])  # the first point that met it
    assert _checkpoints(run)[-1] == f"step_{stop:07d}"  # evaluation reads the weights that met the rule
    done = outcome(run, steps=300)
    assert (done.status, done.stopped, done.steps_trained) == ("finished", "reached", stop)
    assert (done.status, done.stopped) == (RunStatus.FINISHED, StopReason.REACHED)
    assert "stop_reached" not in lines[-1] and lines[-1]["mfu"] is None  # one field; no peak FLOPs on a CPU
    meta = json.loads((run / "checkpoints" / _checkpoints(run)[-1] / "meta.json").read_text())
    assert meta["metrics"]["stopped"] == "reached" and "stop_reached" not in meta["metrics"]


def test_tune_hears_no_report_of_the_step_that_met_the_rule():
    """The report that met the rule (its one ``stopped`` field, as the string Ray carries) is the trial's last: Tune
    hears the objective after the evaluation instead (and so does a report of the step cap)."""
    from attnlab.study.trial import progress_report

    assert progress_report({"step": 10, "stopped": "reached"}, 300, "k") is None
    assert progress_report({"step": 300, "stopped": "cap"}, 300, "k") is None
    assert progress_report({"step": 10}, 300, "k") == {"step": 10, "train_key": "k", "timesteps_total": 10}


@pytest.mark.parametrize("old_fields", [{"stopped": "reached", "stop_reached": 1}, {"stop_reached": 1}])
def test_a_run_folder_written_before_stopped_was_one_field_reads_the_same(reached, tmp_path, monkeypatch, old_fields):
    """Runs written before ``stopped`` was the one field also said ``stop_reached`` (and ``mfu: "unknown"`` without
    a peak-FLOPs figure), in metrics.jsonl and in the checkpoint: read back they are the same run, met rule and all
    (the second case, a line with ``stop_reached`` alone, was never written: it reads too)."""
    import shutil

    from attnlab.runfolder import Progress, read_metrics

    run = tmp_path / "old"
    shutil.copytree(reached[0], run)
    stop = reached[1]["step"]
    lines = _metrics(run)
    old = {k: v for k, v in lines[-1].items() if k != "stopped"}
    lines[-1] = {**old, **old_fields, "mfu": "unknown"}
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    meta_file = run / "checkpoints" / _checkpoints(run)[-1] / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["metrics"] = {**{k: v for k, v in meta["metrics"].items() if k != "stopped"}, **old_fields}
    meta_file.write_text(json.dumps(meta))
    done = outcome(run, steps=300)
    assert (done.status, done.stopped, done.steps_trained) == (RunStatus.FINISHED, StopReason.REACHED, stop)
    last = read_metrics(Location.parse(run))[-1]
    assert last["stopped"] is StopReason.REACHED and "stop_reached" not in last and last["mfu"] is None
    progress = Progress(300)
    progress.update(read_metrics(Location.parse(run)))
    assert progress.line().endswith("stopping rule met: done")
    # resumed, the old checkpoint's met rule still ends the run: the failure injected at the next step never fires
    monkeypatch.setenv("ATTNLAB_FAIL_AT_STEP", str(stop))
    again = _train(_cfg(), run)
    assert again["step"] == stop and again["stopped"] is StopReason.REACHED


def test_a_run_that_never_meets_the_rule_ends_at_the_cap(tmp_path):
    run = tmp_path / "cap"
    last = _train(_cfg(steps=30, checkpoint_every=30, stop_when={"metric": "val_acc", "at_least": 1.01}), run)
    assert (last["step"], last["stopped"]) == (30, "cap")
    done = outcome(run, steps=30)
    assert (done.status, done.stopped, done.steps_trained) == ("finished", "cap", 30)
    assert "stopped" not in _metrics(run)[-2]  # only the last report says how the run ended


def test_a_run_resumed_after_the_rule_was_met_trains_no_further(reached, tmp_path, monkeypatch):
    """Restarted on its folder (as after a kill once the rule was met), the run finds the met rule in its latest
    checkpoint: the injected failure at the next step never fires and nothing is written."""
    import shutil

    run = tmp_path / "again"
    shutil.copytree(reached[0], run)
    before_metrics, before_ckpts = (run / "metrics.jsonl").read_text(), _checkpoints(run)
    stop = reached[1]["step"]
    monkeypatch.setenv("ATTNLAB_FAIL_AT_STEP", str(stop))  # any step after the stop would raise
    last = _train(_cfg(), run)
    assert last["step"] == stop and last["stopped"] == "reached"
    assert (run / "metrics.jsonl").read_text() == before_metrics and _checkpoints(run) == before_ckpts


def test_a_run_killed_before_the_rule_is_met_resumes_and_stops_at_the_same_step(reached, tmp_path, monkeypatch):
    run = tmp_path / "crashed"
    cfg = _cfg(checkpoint_every=10)
    monkeypatch.setenv("ATTNLAB_FAIL_AT_STEP", "25")
    monkeypatch.setenv("ATTNLAB_FAIL_ONCE_FILE", str(tmp_path / "failed-once"))
    with pytest.raises(RuntimeError, match="injected worker failure at step 25"):
        _train(cfg, run)
    assert outcome(run, steps=300).status == "incomplete"  # checkpoint at 20, rule not met yet
    last = _train(cfg, run)  # resumes from step 20 (the marker file keeps the failure from firing again)
    ref = _metrics(reached[0])
    assert last["step"] == reached[1]["step"] and last["stopped"] == "reached"
    assert last["val_acc"] == pytest.approx(reached[1]["val_acc"])
    assert [m["step"] for m in _metrics(run)] == [m["step"] for m in ref]
    assert _metrics(run)[-1]["train_loss"] == pytest.approx(ref[-1]["train_loss"], rel=1e-5)


@pytest.mark.parametrize("rule, match", [
    ({"metric": "val_accuracy", "at_least": 0.99}, r"^train\.stop_when: .*metric='val_accuracy' is not allowed; "
                                                   r"use one of val_acc, val_loss$"),
    ({"metric": "val_acc", "at_least": 0.9, "at_most": 1.0}, r"exactly one of at_least or at_most \(got at_least and at_most\)"),
    ({"metric": "val_acc"}, r"exactly one of at_least or at_most \(got neither\)"),
    ({"metric": "val_loss", "at_most": "low"}, r"at_most='low' must be a finite number"),
    ({"metric": "val_acc", "at_least": True}, r"at_least=True must be a finite number"),
    ({"metric": "val_acc", "above": 0.9}, r"'above' is not a known field; allowed: metric, at_least, at_most"),
    ("val_acc", r"train\.stop_when='val_acc': .*must be a mapping like \{metric: val_acc, at_least: 0.99\}"),
])
def test_a_bad_rule_is_one_line_naming_the_field(rule, match):
    with pytest.raises(UserError, match=match) as err:
        _cfg(stop_when=rule)
    assert "\n" not in str(err.value)


def test_the_rule_belongs_to_the_runs_identity():
    plain, ruled = load_train_config({**TRAIN, "stop_when": None}), _cfg()
    key = lambda cfg: cfg.train_key("data", 16)  # noqa: E731
    assert key(plain) != key(ruled)
    assert key(ruled) != key(_cfg(stop_when={"metric": "val_acc", "at_least": 0.9}))
    assert key(ruled) != key(_cfg(steps=200))  # the cap sets the learning-rate schedule
    assert key(ruled) != key(_cfg(val_every=20))  # where the rule is checked decides where it stops
    assert key(plain) == key(load_train_config({**TRAIN, "stop_when": None, "val_every": 20}))  # a run setting
    assert "stop_when" not in plain.identity("data", 16)["recipe"]  # keys of runs without a rule are unchanged
    assert ruled.identity("data", 16)["recipe"]["stop_when"] == {"metric": "val_acc", "at_least": 0.99, "every": 10,
                                                                 "val_tokens": 1024}


@pytest.mark.ray
def test_a_study_marks_capped_trials_in_rows_and_table(ray_session, tmp_path):
    """Two trials of one rule: a 10-step cap that cannot meet it and a 100-step cap that does. Rows carry
    stopped and stop_rule, the table marks the capped trial's cells with a footnote."""
    from attnlab.results import ResultsStore, reports
    from attnlab.study.runner import run_study
    from attnlab.study.spec import load_spec

    train = {k: v for k, v in TRAIN.items() if k not in ("steps", "threads_per_worker")}
    study = {"name": "stoprule", "train": {**train, "cpus_per_worker": 0.5, "keep_checkpoints": 1, "max_failures": 0},
             "resources": {"trial_cpus": 0.5}, "search": {"engine": "grid"}, "space": {"steps": [10, 100]},
             "objective": "acc@4x", "eval": {"multiples": [1, 4], "p_eval": ["none"], "rope_scaling": ["none"],
                                             "max_tokens": 1024}}
    store_uri = str(tmp_path / "results")
    summary = run_study(load_spec(study), store=store_uri, runs=str(tmp_path / "runs"), verbose=0)
    assert [t["status"] for t in summary.trials] == ["complete"] * 2, summary.trials
    # the evaluation's cells are keyed by the step the run stopped at: a re-run finds them all, measures nothing
    again = run_study(load_spec(study), store=store_uri, runs=str(tmp_path / "runs"), verbose=0)
    assert again.trained == 0 and again.evaluated == 0
    rows = ResultsStore(store_uri).read(study="stoprule", metric="acc")
    ended = {(int(r.tokens) // 512 <= 10, r.stopped, r.stop_rule, int(r.step)) for r in rows.itertuples()}
    assert {(capped, stopped) for capped, stopped, _, _ in ended} == {(True, "cap"), (False, "reached")}
    assert {rule for _, _, rule, _ in ended} == {"val_acc >= 0.99"}
    assert all(step == 10 for capped, _, _, step in ended if capped)
    assert all(10 < step < 100 for capped, _, _, step in ended if not capped)  # rows hold the step it stopped at

    rows = ResultsStore(store_uri).read(study="stoprule")
    rows = rows.assign(knobs=rows["step"].map(lambda s: "cap=10" if s == 10 else "cap=100"))  # one row per trial
    text = reports.to_markdown(reports.table(rows, metric="acc"))
    capped_line = next(line for line in text.splitlines() if line.startswith("| cap=10 "))
    reached_line = next(line for line in text.splitlines() if line.startswith("| cap=100 "))
    assert capped_line.count(reports.CAP_MARK) == 2 and reports.CAP_MARK not in reached_line
    assert text.splitlines()[-1].startswith("† training hit the step cap before val_acc >= 0.99: cap=10 seed 1337")


def test_old_rows_without_stopped_read_as_null_and_mark_nothing(tmp_path):
    """A store written before schema v5 (no stopped / stop_rule columns) reads them as null; its table has no mark."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from attnlab.results import ResultsStore, reports
    from attnlab.results.schema import ARROW_SCHEMA

    row = {"study": "old", "trial": "t", "attention": "softmax", "scale": "inv_sqrt_d", "rope_scaling": "none",
           "step": 10, "tokens": 100, "eval_len": 64, "train_len": 64, "window_mode": "nonoverlap", "metric": "acc",
           "value": 0.5, "seed": 0, "config_hash": "h", "git_sha": "x", "schema_version": 4}
    (tmp_path / "study=old").mkdir()
    fields = [pa.field(n, pa.string(), nullable=False) if n == "config_hash" else ARROW_SCHEMA.field(n) for n in row]
    pq.write_table(pa.Table.from_pylist([row], schema=pa.schema(fields)),  # schema 4 called train_key config_hash
                   str(tmp_path / "study=old" / "v4.parquet"))
    store = ResultsStore(str(tmp_path))
    frame = store.read(study="old")
    assert frame["stopped"].isna().all() and frame["stop_rule"].isna().all()
    store.write([{**row, "trial": "t2", "seed": 1, "stopped": "cap", "stop_rule": "val_acc >= 0.99",
                  "schema_version": None}], key=("new",))
    text = reports.to_markdown(reports.table(store.read(study="old"), metric="acc"), per_seed=True)
    assert reports.CAP_MARK + " |" in text and "softmax seed 1" in text.splitlines()[-1]
    with pytest.raises(UserError, match="column 'stopped' is 'maybe'; allowed: reached, cap or null"):
        store.write([{**row, "stopped": "maybe", "schema_version": None}], key=("bad",))
