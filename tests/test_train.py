"""Training: the recipe, the loop without Ray, and real Ray Train runs (DDP, fault injection, resume)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.errors import UserError
from attnlab.train import load_train_config
from attnlab.train.recipe import lr_at


def _fields(data, **over) -> dict:
    base = dict(preset="tiny", data=str(data), steps=20, tokens_per_step=1024, micro_batch=4, lr=3e-3,
                warmup_steps=3, log_every=2, val_every=10, val_tokens=4096, checkpoint_every=4, workers=2,
                cpus_per_worker=0.5, threads_per_worker=1, max_failures=2)
    base.update(over)
    return base


def _cfg(data, **over):
    return load_train_config(_fields(data, **over))


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_recipe_defaults_are_the_papers():
    cfg = load_train_config(dict(data="x"))
    assert (cfg.lr, cfg.beta1, cfg.beta2, cfg.weight_decay, cfg.grad_clip) == (6e-4, 0.9, 0.95, 0.1, 1.0)
    assert (cfg.tokens_per_step, cfg.steps, cfg.warmup_steps, cfg.seq_length) == (524_288, 18_865, 700, 1024)
    assert cfg.batch_plan(8) == (512, 1)  # 8 GPUs x 64 x 1024
    assert cfg.batch_plan(1) == (512, 8)  # one GPU reaches the same batch by accumulation
    assert lr_at(0, cfg) == pytest.approx(6e-4 / 700)
    assert lr_at(699, cfg) == pytest.approx(6e-4)
    assert lr_at(700 + (18_865 - 700) // 2, cfg) == pytest.approx(3e-4, rel=1e-3)
    assert lr_at(18_864, cfg) < 1e-8


def test_weight_decay_only_on_2d_weights():
    import torch

    from attnlab.model import GPT
    from attnlab.train.recipe import build_optimizer

    cfg = load_train_config(dict(preset="tiny", data="x"))
    model = GPT(cfg.gpt_config())
    decay, no_decay = build_optimizer(model, cfg, torch.device("cpu")).param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize("fields, match", [
    (dict(learning_rate=1e-3), r"train.learning_rate=.*is not a known field"),
    (dict(lr=-1.0), r"train.lr=-1.0: Input should be greater than 0"),
    (dict(preset="gpt9"), r"train.preset='gpt9': Value error, unknown preset"),
    (dict(attention="softmaxx"), r"attention='softmaxx' is unknown"),
    (dict(tokens_per_step=1000), r"not a multiple of seq_len=64"),
])
def test_bad_config_names_the_field(fields, match):
    with pytest.raises(UserError, match=match):
        load_train_config({"preset": "tiny", "data": "x", **fields})


def test_bad_config_cli_errors_before_any_worker(tmp_path, demo_bytes_dir, capsys):
    """In process (the command's own entry point), so no case pays for a Python start-up."""
    from attnlab.cli import main

    def cli(*args):
        code = main(["train", *args])
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, captured.out, captured.err)
    out = tmp_path / "run"
    cases = [
        (["--preset", "tiny", "--data", str(demo_bytes_dir), "--out", str(out), "--set", "lrate=1"], "lrate"),
        (["--preset", "tiny", "--data", str(demo_bytes_dir), "--out", str(out), "--set", "lr=-0.1"], "train.lr"),
        (["--preset", "tiny", "--data", str(demo_bytes_dir), "--out", str(out), "--seq-len", "100000000",
          "--tokens-per-step", "100000000"], "does not fit the data"),
        (["--preset", "tiny", "--data", str(tmp_path / "nowhere"), "--out", str(out)], "nowhere"),
    ]
    for args, needle in cases:
        res = cli(*args)
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("attnlab: error:") and needle in lines[0], res.stderr
        assert "Traceback" not in res.stderr
    assert not out.exists()


def _resume_fields(data) -> dict:
    return _fields(data, steps=8, tokens_per_step=512, log_every=1, val_every=8, val_tokens=2048, workers=1,
                   max_failures=0)


def _resume_cfg(data):
    return load_train_config(_resume_fields(data))


@pytest.fixture(scope="module")
def plain_reference(tmp_path_factory, demo_bytes_dir):
    """An uninterrupted plain-process run of the resume tests' config: the losses a resumed run must repeat."""
    from attnlab.train.loop import train_here

    ref = tmp_path_factory.mktemp("resume") / "ref"
    train_here(_resume_cfg(demo_bytes_dir), ref)
    return ref


def _crash_at_step_6(cfg, out) -> None:
    """A plain-process run (a study's one-worker trial, ``train --local``) that fails at step 6: its step-4
    checkpoint is what is left."""
    from attnlab.train.loop import train_here

    os.environ.update(ATTNLAB_FAIL_AT_STEP="6", ATTNLAB_FAIL_RANK="0")
    try:
        with pytest.raises(RuntimeError, match="injected worker failure at step 6"):
            train_here(cfg, out)
    finally:
        del os.environ["ATTNLAB_FAIL_AT_STEP"], os.environ["ATTNLAB_FAIL_RANK"]
    assert [m["step"] for m in _metrics(out)] == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0000004"]


def _same_losses(ref, resumed) -> None:
    a, b = _metrics(ref), _metrics(resumed)
    assert [m["step"] for m in b] == list(range(1, 9))  # the lost segment (steps 5-6) was replaced, not repeated
    for x, y in zip(a, b):
        assert x["train_loss"] == pytest.approx(y["train_loss"], rel=1e-6, abs=1e-6)
    assert a[-1]["val_loss"] == pytest.approx(b[-1]["val_loss"], rel=1e-6)


def test_local_loop_resumes_exactly_after_a_crash(tmp_path, demo_bytes_dir, plain_reference):
    """A plain-process run that failed at step 6 and is started again continues from its step-4 checkpoint with
    the same losses as an uninterrupted run."""
    from attnlab.train.loop import train_here

    cfg, crashed = _resume_cfg(demo_bytes_dir), tmp_path / "crashed"
    _crash_at_step_6(cfg, crashed)
    train_here(cfg, crashed)
    _same_losses(plain_reference, crashed)


@pytest.mark.ray
def test_ray_train_resumes_a_plain_process_runs_checkpoint_from_the_users_relative_folders(
        tmp_path, demo_bytes_dir, plain_reference, ray_session):
    """A run a plain process (a study's one-worker trial, ``train --local``) left at its step-4 checkpoint is
    resumed by Ray Train from there (Ray has no checkpoint of its own for it), with the losses of an uninterrupted
    run: switching ``resources.train_in_trial`` or the worker count never restarts a run from scratch.

    Resumed as docs/cli.md writes the command, ``attnlab train --data data/demo --out runs/crashed``: Ray Train
    workers run in their own folder, so the CLI resolves both against the user's directory before any worker sees
    them. The command joins the session's cluster (``RAY_ADDRESS``), whose workers run in another folder than the
    test's."""
    (tmp_path / "data").mkdir()
    os.symlink(demo_bytes_dir, tmp_path / "data" / "demo")
    fields = _resume_fields(tmp_path / "data" / "demo")  # the folder the relative flag means
    cfg, crashed = load_train_config(fields), tmp_path / "runs" / "crashed"
    _crash_at_step_6(cfg, crashed)
    (tmp_path / "resume.yaml").write_text(json.dumps({k: v for k, v in fields.items() if k != "data"}))
    res = subprocess.run([sys.executable, "-m", "attnlab.cli", "train", "--config", "resume.yaml",
                          "--data", "data/demo", "--out", "runs/crashed"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address})
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"run folder: {crashed}" in res.stdout and "status: finished; step 8" in res.stdout, res.stdout
    prov = json.loads((crashed / "provenance.json").read_text())
    assert prov["config"]["data"] == str(tmp_path / "data" / "demo")
    # Ray Train checkpointed step 8 only (from scratch it would have checkpointed step 4 too: keep_checkpoints 2)
    assert cfg.keep_checkpoints >= 2 and len([p for p in crashed.glob("checkpoint_*") if p.is_dir()]) == 1
    _same_losses(plain_reference, crashed)


DDP = dict(steps=12, val_every=12)  # checkpoints at 4, 8 and 12; the loss falls by over 1 nat in 12 steps


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory, demo_bytes_dir, ray_session):
    from attnlab.train.ray_train import run_training

    run_dir = tmp_path_factory.mktemp("ddp") / "reference"
    return run_training(_cfg(demo_bytes_dir, **DDP), run_dir)


@pytest.mark.ray
def test_two_workers_learn_and_stay_identical(ddp_reference):
    m = _metrics(ddp_reference.run_dir)
    assert ddp_reference.status == "finished" and m[-1]["step"] == 12
    start, end = m[0]["train_loss"], m[-1]["train_loss"]
    assert start > 4.5 and end < start - 1.0, (start, end)  # from near ln(256) (bytes) clearly down
    assert math.isfinite(m[-1]["val_loss"]) and m[-1]["val_loss"] < start - 1.0
    sums = {p.read_text() for p in (Path(ddp_reference.run_dir) / "replicas").glob("rank*.sha256")}
    assert len(list((Path(ddp_reference.run_dir) / "replicas").glob("rank*.sha256"))) == 2 and len(sums) == 1
    prov = json.loads((Path(ddp_reference.run_dir) / "provenance.json").read_text())
    assert prov["world_size"] == 2 and prov["grad_accum_steps"] == 2 and prov["tokens_per_step"] == 1024
    assert "config_hash" not in prov and len(prov["train_key"]) == 16
    assert prov["git"]["sha"] and prov["versions"]["torch"]
    cfg = load_train_config(prov["config"])
    assert prov["train_key"] == cfg.train_key(prov["data"]["fingerprint"], prov["data"]["vocab_size"])
    assert ddp_reference.train_key == prov["train_key"]
    assert prov["flops_per_step"] == pytest.approx(prov["flops_per_token"] * 1024)
    assert ddp_reference.checkpoint and "checkpoint_" in ddp_reference.checkpoint
    for key in ("lr", "grad_norm", "tokens_per_s", "mfu"):
        assert key in m[-1]
    assert m[-1]["mfu"] is None  # CPU: no peak-FLOPs figure rather than a wrong one


@pytest.mark.ray
def test_worker_failure_is_retried_and_resumes_exactly(ddp_reference, tmp_path, ray_session, monkeypatch):
    from attnlab.train.ray_train import run_training

    monkeypatch.setenv("ATTNLAB_FAIL_AT_STEP", "10")
    monkeypatch.setenv("ATTNLAB_FAIL_RANK", "1")
    monkeypatch.setenv("ATTNLAB_FAIL_ONCE_FILE", str(tmp_path / "failed-once"))
    result = run_training(_cfg(_data_of(ddp_reference), **DDP), tmp_path / "faulty")
    assert (tmp_path / "failed-once").exists(), "the failure was not injected"
    ref, got = _metrics(ddp_reference.run_dir), _metrics(result.run_dir)
    assert result.status == "finished" and got[-1]["step"] == 12
    assert [m["step"] for m in got] == [m["step"] for m in ref]
    for a, b in zip(ref, got):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5, abs=1e-5), (a["step"], a, b)
    assert got[-1]["val_loss"] == pytest.approx(ref[-1]["val_loss"], rel=1e-5)


def _data_of(outcome) -> str:
    return json.loads((Path(outcome.run_dir) / "provenance.json").read_text())["config"]["data"]


def test_divergence_stops_the_run_with_the_step_recorded(tmp_path, demo_bytes_dir):
    """lr = 1e6 makes the loss NaN at step 2: the run stops at the next step that reports, records step 2 and says
    why, and the CLI exits 1."""
    out = tmp_path / "diverged"
    res = subprocess.run([sys.executable, "-m", "attnlab.cli", "train", "--preset", "tiny", "--data", str(demo_bytes_dir),
                          "--out", str(out), "--steps", "20", "--tokens-per-step", "256", "--micro-batch", "4",
                          "--set", "lr=1e6", "--set", "warmup_steps=0", "--set", "log_every=5",
                          "--set", "val_tokens=256", "--set", "threads_per_worker=1", "--local"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr
    failure = json.loads((out / "failure.json").read_text())
    assert failure["kind"] == "diverged" and failure["step"] == 2 and "loss is nan at step 2" in failure["reason"]
    assert "failure: loss is nan at step 2" in res.stdout
    last = _metrics(out)[-1]  # found at step 5, the first step that reports (steps between make no collective)
    assert last["step"] == 5 and last["diverged"] is True and not math.isfinite(last["train_loss"])
    assert "seen at step 5" in failure["reason"] and not (out / "checkpoints").exists()


def test_micro_batch_auto_resolves_on_the_worker_and_keeps_the_step(tmp_path, demo_bytes_dir, capsys):
    """`--micro-batch auto` reaches the training loop resolved (on CPU: the largest divisor of the step's sequences
    up to 16; on a GPU: the largest that fits its memory), and the step keeps its tokens through accumulation."""
    from attnlab.cli import main

    out = tmp_path / "auto"
    code = main(["train", "--preset", "tiny", "--data", str(demo_bytes_dir), "--out", str(out), "--steps", "2",
                 "--tokens-per-step", "2048", "--micro-batch", "auto", "--set", "val_tokens=256", "--set",
                 "log_every=1", "--set", "threads_per_worker=1", "--local"])
    assert code == 0, capsys.readouterr().err
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["config"]["micro_batch"] == 16 and provenance["grad_accum_steps"] == 2  # 32 sequences of 64
    assert provenance["tokens_per_step"] == 2048 and [m["step"] for m in _metrics(out)] == [1, 2]
    with pytest.raises(SystemExit) as refused:  # argparse's own refusal: usage, then the one error line
        main(["train", "--preset", "tiny", "--data", "x", "--out", str(out), "--micro-batch", "big"])
    assert refused.value.code == 2
    assert "--micro-batch: expected a positive integer or auto, got 'big'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ the parts, each alone
COPY = {"synthetic": "copy_distractors", "vocab": 64, "copy_len": 8}


def _parts_cfg(**over):
    return load_train_config({**dict(preset="tiny", data=COPY, seq_len=32, steps=4, tokens_per_step=256, micro_batch=4,
                                     val_tokens=256, val_every=2, warmup_steps=1), **over})


class _TwoWorkers:
    """A session that stands for two identical workers: its all-reduce doubles every value."""

    rank, world_size, device = 0, 2, None

    def __init__(self):
        import torch

        self.device = torch.device("cpu")

    def all_reduce_sum(self, values):
        return [2 * v for v in values]


def test_train_data_yields_a_steps_micro_batches():
    import torch

    from attnlab.data.source import open_data
    from attnlab.train.parts import TrainData

    cfg = _parts_cfg()
    data = TrainData(open_data(cfg.data), cfg, rank=1, world_size=2, device=torch.device("cpu"))
    assert (data.global_batch, data.accum, data.tokens_per_step) == (8, 1, 256)  # 8 sequences: 4 per worker
    batches = list(data.micro_batches(3))
    assert len(batches) == 1
    x, y, mask = batches[0]
    assert x.shape == y.shape == mask.shape == (4, 32) and bool(mask.any())
    again = list(data.micro_batches(3))[0]
    assert torch.equal(x, again[0])  # a step's batch is a pure function of (seed, step, rank)


def test_the_validator_sums_the_workers_and_applies_the_stopping_rule():
    import torch

    from attnlab.data.source import open_data
    from attnlab.model import build_model
    from attnlab.states import StopReason
    from attnlab.train.parts import Validator

    session = _TwoWorkers()
    source = open_data(COPY)
    cfg = _parts_cfg(stop_when={"metric": "val_loss", "at_most": 1e9})
    torch.manual_seed(0)
    model = build_model(cfg.gpt_config(vocab_size=source.vocab_size)).eval()
    validator = Validator.build(source, cfg, session)
    metrics = validator.validate(model, done=2)
    assert metrics["stopped"] is StopReason.REACHED and "stop_reached" not in metrics  # one field
    assert metrics["val_tokens"] % 2 == 0 and 0 < metrics["val_loss"] < 10  # the doubled sums, divided alike
    never = Validator.build(source, _parts_cfg(stop_when={"metric": "val_acc", "at_least": 2.0}), session)
    assert "stopped" not in never.validate(model, done=2)
    assert never.validate(model, done=4)["stopped"] is StopReason.CAP  # the last step without the rule met
    assert never.finished({"stopped": "reached"}) and not never.finished({}) and not never.finished({"stopped": "cap"})
    assert never.finished({"stopped": "reached", "stop_reached": 1})  # a checkpoint written before the one field
    assert "stopped" not in Validator.build(source, _parts_cfg(), session).validate(model, done=4)


def test_steps_that_report_nothing_make_no_collective(tmp_path):
    """The loop reads the loss and all-reduces only on log, validation and checkpoint steps (a GPU then never
    waits for the host between them): 10 steps logging every 5 make 2 loss collectives and validation's 1."""
    from attnlab.train.loop import LocalSession, train_worker

    class Counting(LocalSession):
        calls: list = []

        def all_reduce_sum(self, values):
            self.calls.append(len(self.reports))  # the reports made so far: which reporting step asks
            return super().all_reduce_sum(values)

    session = Counting(tmp_path / "run", device="cpu")
    last = train_worker(_parts_cfg(steps=10, log_every=5, val_every=10, checkpoint_every=10), session,
                        tmp_path / "run")
    assert last["step"] == 10 and math.isfinite(last["train_loss"]) and "val_loss" in last
    assert [r["step"] for r in session.reports] == [5, 10]
    assert session.calls == [0, 1, 1]  # step 5's loss; step 10's loss, then its validation


def test_the_checkpointer_saves_with_a_report_and_resumes_a_fresh_model(tmp_path):
    import torch

    from attnlab.data.source import open_data
    from attnlab.states import StopReason
    from attnlab.train.loop import LocalSession
    from attnlab.train.parts import Checkpointer, ModelAndOptimizer

    session = LocalSession(tmp_path / "run", device="cpu")
    cfg = _parts_cfg()
    gpt = cfg.gpt_config(vocab_size=open_data(COPY).vocab_size)
    first = ModelAndOptimizer.build(cfg, gpt, session)
    checkpointer = Checkpointer(session, cfg, gpt)
    assert checkpointer.resume(first) == (0, {})  # nothing saved yet
    with torch.no_grad():
        next(first.model.parameters()).add_(1.0)
    checkpointer.report({"step": 2, "train_loss": 3.0, "stopped": StopReason.REACHED, "mfu": None}, first)
    checkpointer.report({"step": 3, "train_loss": 2.9}, None)  # a report without a checkpoint
    assert [r["step"] for r in session.reports] == [2, 3] and "mfu" not in session.reports[0]
    assert type(session.reports[0]["stopped"]) is str and session.reports[0]["stopped"] == "reached"  # Tune's
    second = ModelAndOptimizer.build(cfg, gpt, session)
    step, metrics = Checkpointer(session, cfg, gpt).resume(second)
    assert step == 2 and metrics == {"step": 2, "train_loss": 3.0, "stopped": "reached"}
    assert metrics["stopped"] is StopReason.REACHED
    for a, b in zip(first.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)


def test_the_metrics_writer_writes_rank_zeros_files_and_every_ranks_checksum(tmp_path):
    import torch

    from attnlab.data.source import open_data
    from attnlab.location import Location
    from attnlab.runfolder import read_metrics, recorded_train_key, replica_checksums
    from attnlab.train.parts import MetricsWriter, ModelAndOptimizer, TrainData

    run = Location.parse(tmp_path / "run")
    cfg, source = _parts_cfg(), open_data(COPY)
    model = ModelAndOptimizer.build(cfg, cfg.gpt_config(vocab_size=source.vocab_size), _TwoWorkers()).model
    data = TrainData(source, cfg, 0, 2, torch.device("cpu"))
    zero, one = MetricsWriter(run, 0, start=0), MetricsWriter(run, 1, start=0)
    one.provenance(cfg, model, source, 2, data)
    one.append({"step": 1}, force=True)
    one.failure("loss is nan", 1)
    assert not run.exists("provenance.json") and not run.exists("metrics.jsonl") and not run.exists("failure.json")
    zero.provenance(cfg, model, source, 2, data)
    assert recorded_train_key(run) == cfg.train_key(source.fingerprint, source.vocab_size)
    zero.append({"step": 1, "train_loss": 4.0}, force=True)
    zero.failure("loss is nan at step 1", 1)
    zero.finish(model)
    one.finish(model)
    assert read_metrics(run) == [{"step": 1, "train_loss": 4.0}]
    assert run.read_json("failure.json")["step"] == 1
    assert set(replica_checksums(run)) == {0, 1} and len(set(replica_checksums(run).values())) == 1
    MetricsWriter(run, 0, start=0)  # a run resumed from step 0 drops what the lost segment wrote
    assert read_metrics(run) == []
