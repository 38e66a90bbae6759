"""A study's space, enumerated once: validation, the cluster fit check, the runner and `study validate`'s printout
see the same points, each with its training config. No Ray here."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnlab.study.spec import load_spec
from attnlab.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]

# A sampled search whose conditional axis applies to two of three variants: every check must see it under both.
CONDITIONAL = {
    "name": "conditional",
    "train": {"preset": "tiny", "data": {"synthetic": "copy_distractors", "vocab": 64}, "steps": 10,
              "tokens_per_step": 256, "micro_batch": 4, "gpus_per_worker": 1},
    "search": {"engine": "random", "num_samples": 3, "seed": 0},
    "space": {"attention": ["softmax", "lssa", "lssar"],
              "lr": {"values": [1.0e-3, 3.0e-3], "when": ["lssa", "lssar"]},
              "p_train": {"values": [3, 15], "when": ["lssar", "softmax"]}},
    "objective": "val_loss@2x", "eval": {"multiples": [1, 2]},
}


def _configs_built(monkeypatch, action) -> set[tuple]:
    """The (attention, lr, p_train) of every training config validated while ``action`` runs."""
    seen: set[tuple] = set()
    validate = TrainConfig.model_validate.__func__

    def spy(cls, obj, *args, **kwargs):
        cfg = validate(cls, obj, *args, **kwargs)
        seen.add((cfg.attention, cfg.lr, str(cfg.p_train)))
        return cfg

    with monkeypatch.context() as patch:
        patch.setattr(TrainConfig, "model_validate", classmethod(spy))
        action()
    return seen


def test_validation_and_the_fit_check_see_the_same_points(monkeypatch):
    from attnlab.study.fit import check_study_fits

    holder = {}
    validated = _configs_built(monkeypatch, lambda: holder.setdefault("spec", load_spec(CONDITIONAL)))
    fitted = _configs_built(monkeypatch, lambda: check_study_fits(holder["spec"], ROOT / "cluster" / "aws.yaml"))
    assert validated == fitted
    # the axes under every one of their `when` names, not only the first
    assert {("lssar", 1.0e-3), ("lssar", 3.0e-3), ("lssa", 1.0e-3)} <= {(a, lr) for a, lr, _ in fitted}
    assert {("softmax", "3.0"), ("lssar", "15.0")} <= {(a, p) for a, _, p in fitted}


def test_the_study_spec_opens_no_data(monkeypatch):
    """Validating a study is reading its text: a generated source's parameters are checked, nothing is opened."""
    import attnlab.data.source as source

    opened = []
    real = source.open_data
    monkeypatch.setattr(source, "open_data", lambda *a, **k: opened.append(a) or real(*a, **k))
    spec = load_spec(CONDITIONAL)
    assert spec.name == "conditional" and opened == []
    bad = {**CONDITIONAL, "train": {**CONDITIONAL["train"], "data": {"synthetic": "orbits", "size": "huge"}}}
    from attnlab.errors import UserError

    with pytest.raises(UserError, match="data.size='huge' is not allowed"):
        load_spec(bad)
    assert opened == []


def test_the_checked_points_are_each_variant_then_each_axis_value_under_every_variant_it_applies_to():
    spec = load_spec({**CONDITIONAL, "space": {**CONDITIONAL["space"], "seeds": [0, 1],
                                               "model.n_layer": {"low": 1, "high": 3}}})
    points = spec.search_space().checked_points()
    assert points[:3] == [{"attention": "softmax"}, {"attention": "lssa"}, {"attention": "lssar"}]
    assert {"attention": "lssar", "lr": 1.0e-3} in points and {"attention": "softmax", "lr": 1.0e-3} not in points
    assert {"attention": "softmax", "model.n_layer": 1} in points and {"attention": "lssa", "model.n_layer": 3} in points
    assert not any("seed" in p for p in points)  # a seed never makes a config invalid
    assert len(points) == len({tuple(sorted(p.items())) for p in points})


def test_a_grid_is_checked_point_by_point_and_its_configs_are_the_points_applied_to_train():
    spec = load_spec({"name": "g", "train": {"preset": "tiny", "data": "demo", "model": {"n_head": 2}},
                      "space": {"attention": ["softmax", "lssar"], "lr": [1e-3, 3e-3], "seeds": [0, 1],
                                "model.n_layer": [1, 2]}})
    space = spec.search_space()
    assert space.size() == len(space.grid()) == 16
    assert space.checked_points() == [{k: v for k, v in p.items() if k != "seed"} for p in space.grid()][::2]
    point, cfg = space.checked()[3]
    assert point == {"attention": "softmax", "lr": 3e-3, "model.n_layer": 2}
    assert (cfg.attention, cfg.lr, cfg.model, cfg.data) == ("softmax", 3e-3, {"n_head": 2, "n_layer": 2}, "demo")
    assert cfg.steps == 300 and cfg.tokens_per_step == 1024  # fields the study did not write keep tiny's recipe
    assert space.config(point, data="/abs/demo").data == "/abs/demo"  # a trial's: with the resolved data


def test_optuna_suggests_points_of_the_same_space():
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = load_spec({**CONDITIONAL, "search": {"engine": "optuna", "num_samples": 8}}).search_space()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(12):
        point = space.suggest(study.ask())
        name = point["attention"]
        assert ("lr" in point) == (name in ("lssa", "lssar")) and ("p_train" in point) == (name in ("lssar", "softmax"))
        space.config(point)  # every suggestion is a valid training config
        seen.add(name)
    assert seen == {"softmax", "lssa", "lssar"}
