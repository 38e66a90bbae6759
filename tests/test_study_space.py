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
