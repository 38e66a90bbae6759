"""Validation at longer lengths while a run trains: a study's ``eval.during_training``, the training config's
``val_extrapolation`` (one type, :class:`attnlab.runfolder.ValExtrapolation`), ``val_loss_at`` in metrics.jsonl.

Tiny preset on a small synthetic copy probe (vocabulary 64, 32-token sequences): a run of 6 steps costs seconds.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
import yaml

from attnlab.errors import UserError
from attnlab.runfolder import VAL_LOSS_AT, ValExtrapolation
from attnlab.study.spec import load_spec
from attnlab.train import load_train_config

COPY = {"synthetic": "copy_distractors", "vocab": 64, "copy_len": 8}
TRAIN = dict(preset="tiny", data=COPY, seq_len=32, steps=6, tokens_per_step=256, micro_batch=4, lr=3e-3,
             warmup_steps=1, log_every=2, val_every=6, val_tokens=256, checkpoint_every=6, threads_per_worker=1)
ON = {"multiples": [2, 4], "every": 3}  # 64 and 128 tokens, after steps 3 and 6


def _study(**eval_block) -> dict:
    return {"name": "during", "train": {k: v for k, v in TRAIN.items() if k != "threads_per_worker"},
            "search": {"engine": "grid"}, "space": {"attention": ["softmax"]}, "objective": "val_loss@2x",
            "eval": {"multiples": [1, 2], "max_tokens": 256, **eval_block}}


# ------------------------------------------------------------------------------------------ a training run
def test_a_run_measures_the_longer_lengths_at_its_steps_and_trains_the_same_weights(tmp_path, capsys):
    """``attnlab train --config FILE`` with val_extrapolation: steps 3 and 6 carry val_loss_at for 64 and 128
    tokens (step 3 is written for it: it logs nothing else); the same run without it has no such key, and both
    train the same weights (each rank's checksum), with the same losses and the same training key."""
    from attnlab.cli import main
    from attnlab.location import Location
    from attnlab.runfolder import read_metrics, recorded_train_key, replica_checksums

    runs = {}
    for name, extra in (("off", {}), ("on", {"val_extrapolation": ON})):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**TRAIN, **extra}))
        assert main(["train", "--config", str(path), "--out", str(tmp_path / name), "--local"]) == 0
        runs[name] = Location.parse(tmp_path / name)
    assert "validation also at 64, 128 tokens every 3 steps" in capsys.readouterr().out  # the plan line
    on, off = read_metrics(runs["on"]), read_metrics(runs["off"])
    assert [m["step"] for m in on] == [2, 3, 4, 6] and [m["step"] for m in off] == [2, 4, 6]
    measured = {m["step"]: m[VAL_LOSS_AT] for m in on if VAL_LOSS_AT in m}
    assert sorted(measured) == [3, 6]
    for values in measured.values():
        assert list(values) == ["64", "128"]  # lengths in tokens, as strings (JSON), shortest first
        assert all(isinstance(v, float) and math.isfinite(v) and 0 < v < 20 for v in values.values()), values
    assert measured[3] != measured[6]  # measured again, on the weights of that step
    assert not any(VAL_LOSS_AT in m for m in off)
    raw = [json.loads(line) for line in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    assert raw[-1][VAL_LOSS_AT] == on[-1][VAL_LOSS_AT]  # read back as written

    # the same weights, losses and key
    assert replica_checksums(runs["on"]) == replica_checksums(runs["off"]) and replica_checksums(runs["off"])
    assert {m["step"]: m["train_loss"] for m in on if m["step"] != 3} == {m["step"]: m["train_loss"] for m in off}
    assert on[-1]["val_loss"] == off[-1]["val_loss"]
    assert recorded_train_key(runs["on"]) == recorded_train_key(runs["off"])
    provenance = json.loads((tmp_path / "on" / "provenance.json").read_text())
    assert provenance["config"]["val_extrapolation"] == {"multiples": [2.0, 4.0], "every": 3}  # recorded
    assert load_train_config(provenance["config"]).val_extrapolation == ValExtrapolation(**ON)  # read back whole


def test_the_measurement_leaves_the_model_and_the_random_state_as_they_were(monkeypatch):
    """The model is scored in eval mode without gradients and handed back in training mode; the random
    generators' state is restored even when scoring draws from them; the loss is the mean over every worker's
    windows (a session of two identical workers doubles the sums: the mean is unchanged)."""
    import torch

    import attnlab.train.parts as parts
    from attnlab.data.source import open_data
    from attnlab.model import build_model

    class Workers:
        rank, device = 0, torch.device("cpu")

        def __init__(self, world_size):
            self.world_size = world_size

        def all_reduce_sum(self, values):
            return [self.world_size * v for v in values]

    source = open_data(COPY)
    cfg = load_train_config({**TRAIN, "val_extrapolation": ON})
    torch.manual_seed(0)
    model = build_model(cfg.gpt_config(vocab_size=source.vocab_size)).train()
    one = parts.Validator.build(source, cfg, Workers(1))
    assert sorted(one.longer) == [64, 128]
    real = parts.mean_window_loss

    def drawing(*args, **kwargs):  # a scorer that uses the random generator (dropout would)
        torch.rand(3)
        return real(*args, **kwargs)

    monkeypatch.setattr(parts, "mean_window_loss", drawing)
    seen = []  # (gradients on, training mode) of every block call
    model.blocks[0].register_forward_pre_hook(lambda block, _: seen.append((torch.is_grad_enabled(), block.training)))
    before = torch.get_rng_state()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    first = one.at_lengths(model)
    assert torch.equal(torch.get_rng_state(), before) and model.training
    assert seen and set(seen) == {(False, False)}  # scored in eval mode, without gradients
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert list(first) == ["64", "128"] and all(0 < v < 20 for v in first.values())
    assert one.at_lengths(model) == first  # deterministic
    # rank 0 of two workers scores every other window; the all-reduced mean is over both halves
    two = parts.Validator.build(source, cfg, Workers(2))
    assert all(len(two.longer[L][0]) == (len(one.longer[L][0]) + 1) // 2 for L in (64, 128))
    off = parts.Validator.build(source, load_train_config(TRAIN), Workers(1))
    assert off.longer == {} and off.at_lengths(model) == {}


def test_a_length_the_split_cannot_fill_is_left_out_and_each_asks_for_a_whole_window():
    """Each length asks the data for at least one window's tokens (``max(val_tokens, L)``: the token reader gives
    no window when ``max_tokens < L``); a length whose split has no whole window is left out, on every rank."""
    import torch

    from attnlab.data.source import open_data
    from attnlab.train.parts import Validator

    real = open_data(COPY)
    asked = []

    class Short:  # a validation split of 100 tokens
        def eval_set(self, seq_len, max_tokens, long_docs=False, seed=0):
            asked.append((seq_len, max_tokens))
            if seq_len >= 100:
                return np.zeros((0, seq_len + 1), dtype=np.int64), None
            return real.eval_set(seq_len, max_tokens, seed=seed)

    class Session:
        rank, world_size, device = 0, 1, torch.device("cpu")

    cfg = load_train_config({**TRAIN, "val_tokens": 32, "val_extrapolation": {"multiples": [2, 4], "every": 1}})
    validator = Validator.build(Short(), cfg, Session())
    assert asked == [(32, 32), (64, 64), (128, 128)]
    assert sorted(validator.longer) == [64]


def test_the_setting_changes_no_key():
    """A run setting: the training key and identity, the study's search fingerprint and every evaluation cell's key
    are those of the same study without it."""
    off, on = load_train_config(TRAIN), load_train_config({**TRAIN, "val_extrapolation": ON})
    assert on.train_key("fp", 64) == off.train_key("fp", 64) and on.identity("fp", 64) == off.identity("fp", 64)
    plain, during = load_spec(_study()), load_spec(_study(during_training=ON))
    assert during.eval.during_training == ValExtrapolation(**ON)
    assert "while training: val loss at [64, 128] every 3 steps" in during.describe()  # attnlab study validate
    assert "while training" not in plain.describe()
    assert during.search_fingerprint() == plain.search_fingerprint()
    # and the same fingerprint as before the field existed: the training config's copy is not hashed
    blob = plain.model_dump(mode="json", exclude={"eval", "description", "store", "plugins"})
    del blob["train"]["plugin"], blob["train"]["val_extrapolation"]
    for key in ("rope_scaling", "rope_factor", "original_len", "init_from"):  # stages' fields, unset: not hashed
        del blob["train"][key]
    del blob["stages"]
    assert plain.search_fingerprint() == hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]
    train_len = during.train.seq_length
    assert during.eval.cells(train_len) == plain.eval.cells(train_len)
    assert [c.key("k", 6, "fp") for c in during.eval.cells(train_len)] == \
        [c.key("k", 6, "fp") for c in plain.eval.cells(train_len)]


def test_the_study_copies_the_setting_into_every_trials_training_config(tmp_path):
    """plan_trial gives each trial's training config the study's eval.during_training, a config read back from a
    status file (made before the setting) included; the trial's key stays the same."""
    from attnlab.results import ResultsStore
    from attnlab.study.folder import StudyFolder
    from attnlab.study.trial import StudyContext, StudyData, plan_trial

    def context(spec):
        data = StudyData(resolved=COPY, fingerprint="f" * 16, vocab_size=64, label="synthetic:copy",
                         min_tokens=2**62, described="synthetic copy")
        return StudyContext(spec=spec, state=StudyFolder(tmp_path / "runs", spec.name),
                            store=ResultsStore(tmp_path / "results"), data=data)

    plain, during = load_spec(_study()), load_spec(_study(during_training=ON))
    a = plan_trial(context(plain), {"attention": "softmax"}, "trial_0")
    b = plan_trial(context(during), {"attention": "softmax"}, "trial_0")
    assert a.cfg.val_extrapolation is None and b.cfg.val_extrapolation == ValExtrapolation(**ON)
    assert a.train_key == b.train_key and [k for _, k in a.cells] == [k for _, k in b.cells]
    c = plan_trial(context(during), {"attention": "softmax"}, "trial_0", cfg=a.cfg)  # a status file's config
    assert c.cfg.val_extrapolation == ValExtrapolation(**ON) and c.train_key == a.train_key


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("block, where, allowed", [
    ({"multiples": [0.5], "every": 10}, "eval.during_training.multiples=[0.5]", "distinct numbers > 1"),
    ({"multiples": [1, 2], "every": 10}, "eval.during_training.multiples=[1, 2]", "distinct numbers > 1"),
    ({"multiples": [], "every": 10}, "eval.during_training.multiples=[]", "a non-empty list"),
    ({"multiples": [2, 2], "every": 10}, "eval.during_training.multiples=[2, 2]", "repeats a value"),
    ({"multiples": [2], "every": 0}, "eval.during_training.every=0", "a positive integer"),
    ({"multiples": [2], "every": 2.5}, "eval.during_training.every=2.5", "a positive integer"),
    ({"multiples": [2]}, "eval.during_training.every", "is required"),
    ({"multiples": [2], "every": 5, "lengths": [128]}, "eval.during_training.lengths=[128]", "not a known field"),
    (100, "eval.during_training=100", "a mapping like {multiples: [2, 4, 8], every: 100}"),
])
def test_bad_input_is_one_line_naming_the_field(block, where, allowed):
    with pytest.raises(UserError) as exc:
        load_spec(_study(during_training=block))
    message = str(exc.value)
    assert "\n" not in message and where in message and allowed in message, message
    with pytest.raises(UserError) as exc:  # the training config's own field says the same of itself
        load_train_config({**TRAIN, "val_extrapolation": block})
    assert "\n" not in str(exc.value) and where.replace("eval.during_training", "train.val_extrapolation") in \
        str(exc.value), exc.value


def test_a_study_sets_it_in_eval_not_train():
    study = _study()
    study["train"]["val_extrapolation"] = ON
    with pytest.raises(UserError, match=r"train.val_extrapolation is set by the study's eval.during_training"):
        load_spec(study)


# ------------------------------------------------------------------------------------------ a real study
@pytest.mark.ray
def test_a_study_with_during_training_writes_the_rows_to_its_runs_metrics(ray_session, tmp_path):
    """One tiny trial on the session's Ray cluster: its run's metrics.jsonl has val_loss_at at steps 3 and 6, and
    the results store has the study's evaluation cells only (the lines are not cells)."""
    from attnlab.results import ResultsStore
    from attnlab.runfolder import read_metrics
    from attnlab.study.runner import run_study, study_state
    study = _study(during_training=ON)
    study["train"].update(cpus_per_worker=0.5, max_failures=0, keep_checkpoints=1)
    study["resources"] = {"trial_cpus": 0.5}
    store, runs = str(tmp_path / "results"), str(tmp_path / "runs")
    spec = load_spec(study)
    summary = run_study(spec, store=store, runs=runs, verbose=0)
    [trial] = summary.trials
    assert trial["status"] == "complete", trial
    lines = read_metrics(study_state(spec, runs).run(trial["train_key"]))
    measured = {m["step"]: m[VAL_LOSS_AT] for m in lines if VAL_LOSS_AT in m}
    assert sorted(measured) == [3, 6] and all(list(v) == ["64", "128"] for v in measured.values())
    assert all(math.isfinite(x) and x > 0 for v in measured.values() for x in v.values())
    rows = ResultsStore(store).read(study="during", metric="val_loss")
    assert sorted(rows.eval_len) == [32, 64]  # eval.multiples [1, 2]: the study's cells, nothing else
