"""A study's stages: training runs that start from the final weights of another stage's runs, e.g. a context
extension fine-tuned at a longer length with a RoPE scaling in training.

Owns the schema of one entry of a study's ``stages:`` (:class:`Stage`; the study's own ``train:``/``space:`` are
the root stage, :data:`ROOT`, ``pretrain``), the order of the stages and their checks (:func:`check_stages`: a grid,
no pruning scheduler, no cycle), and :class:`StagedSpace`: the root's points, then each stage's in dependency order
(a child point per parent point and combination of the stage's axes, its axes prefixed by the stage's name), and a
child's training config from its parent's (the stage's fields set, ``original_len`` the lineage's first length,
``init_from`` once the parent's key is known: the weights only, a fresh optimiser and schedule).

A stage must never change what makes the parent's weights fit (the model, the attention) or what the study sets
(the seeds, the lineage: :data:`NOT_IN_STAGE`). It must never do I/O or import Ray: finding and waiting for a
parent's run is :mod:`attnlab.study.trial`'s.

Details: docs/stages.md (the schema, a child point, identity and reuse, bad input),
docs/protocol.md#rope-scaling-in-training.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from attnlab.errors import UserError
from attnlab.names import STUDY_NAME, STUDY_NAME_RULE
from attnlab.study.space import SearchSpace, Space
from attnlab.train.config import TrainConfig, load_train_config

ROOT = "pretrain"  # the study's own train:/space: as a stage
STAGE_KEY = "stage"  # a child point's stage
# Training fields a stage may not change: what makes the parent's weights fit the model (the architecture and the
# attention), what the study sets (the seed of the lineage, the lineage itself).
NOT_IN_STAGE = {"preset": "a stage keeps its parent's model", "model": "a stage keeps its parent's model",
                "attention": "a stage keeps its parent's attention (when: picks the parents)",
                "scale": "a stage keeps its parent's attention", "plugin": "a stage keeps its parent's attention",
                "seed": "the seeds are the parents' (space.seeds)", "init_from": "set by the study from from:",
                "original_len": "set by the study from from:"}


class Stage(BaseModel):
    """One entry of ``stages:`` (its fields: docs/stages.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, serialize_by_alias=True)

    name: str
    parent: str = Field(alias="from")
    when: list[str] | None = None
    train: dict[str, Any] = Field(default_factory=dict)
    space: Space = Field(default_factory=Space)

    @field_validator("name")
    @classmethod
    def _name(cls, value):
        if not STUDY_NAME.match(value) or value == ROOT:
            raise ValueError(f"{value!r} is not allowed: use {STUDY_NAME_RULE}, other than {ROOT!r} (the study's "
                             "own train: and space:)")
        return value

    @field_validator("when", mode="before")
    @classmethod
    def _when(cls, value):
        value = [value] if isinstance(value, str) else value
        if value is not None and not value:
            raise ValueError("must list at least one attention variant (leave it out for every parent)")
        return value

    @field_validator("train")
    @classmethod
    def _train(cls, value):
        for key in value:
            if key in NOT_IN_STAGE:
                raise ValueError(f"{key} cannot be set in a stage: {NOT_IN_STAGE[key]}")
            if key not in TrainConfig.model_fields and key != "tokens":
                raise ValueError(f"{key} is not a training field")
        return value

    @model_validator(mode="after")
    def _own_axes(self) -> Stage:
        if self.space.attention is not None:
            raise ValueError("space.attention cannot be set in a stage: when: picks the parents' variants")
        if self.space.seeds is not None:
            raise ValueError("space.seeds cannot be set in a stage: its runs take their parents' seeds")
        for key in self.space.knobs():
            if key in NOT_IN_STAGE or key.startswith("model."):
                raise ValueError(f"space.{key} cannot be searched in a stage: "
                                 f"{NOT_IN_STAGE.get(key, 'a stage keeps its parent model')}")
            if key in self.train:
                raise ValueError(f"{key} is set both in the stage's train and in its space: keep one")
        return self

    def axis_key(self, key: str) -> str:
        """A stage axis's key in a child point: ``<stage>.<axis>``."""
        return f"{self.name}.{key}"


def check_stages(stages: list[Stage], attentions: list[str], engine: str, scheduler: str) -> list[Stage]:
    """The stages in the order their parents run (each after its ``from``); ValueError, one line, for an unknown
    parent, a cycle, a name given twice, a ``when`` naming no variant of the study, or a search that is not a
    grid."""
    if not stages:
        return []
    if engine != "grid":
        raise ValueError(f"stages: a study with stages runs every point of every stage: use search.engine: grid (not "
                         f"{engine})")
    if scheduler != "none":
        raise ValueError("stages: a study with stages trains every parent to its end: use scheduler: none")
    names = [s.name for s in stages]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ValueError(f"stages[{i}].name: {name!r} names two stages")
    by_name = {s.name: s for s in stages}
    for i, stage in enumerate(stages):
        if stage.parent != ROOT and stage.parent not in by_name:
            raise ValueError(f"stages[{i}].from: {stage.parent!r} is not a stage; use {ROOT} (the study's own "
                             f"train: and space:) or one of {', '.join(names)}")
        for name in stage.when or []:
            if name not in attentions:
                raise ValueError(f"stages[{i}].when names {name!r}, which is not among the study's attention "
                                 f"variants ({', '.join(attentions)})")
    ordered: list[Stage] = []
    placed = {ROOT}
    while len(ordered) < len(stages):
        ready = [s for s in stages if s.name not in placed and s.parent in placed]
        if not ready:
            cycle = [s.name for s in stages if s.name not in placed]
            raise ValueError(f"stages: {' -> '.join(cycle)} start from each other (a cycle): every stage must lead "
                             f"back to {ROOT}")
        ordered += ready
        placed |= {s.name for s in ready}
    return ordered


def stage_of(point: dict) -> str:
    """The stage a point belongs to (:data:`ROOT` for the study's own points)."""
    return point.get(STAGE_KEY) or ROOT


class StagedSpace(SearchSpace):
    """The search space of a study with stages: the root's points (:class:`SearchSpace`), then each stage's, in
    dependency order. :meth:`config` builds a child's training config from its parent's (docs/stages.md), without
    ``init_from``: the study sets it when it knows the parent's key (:meth:`with_parent`)."""

    def __init__(self, train: TrainConfig, space: Space, stages: list[Stage], engine: str = "grid",
                 num_samples: int | None = None, seed: int = 0):
        super().__init__(train, space, engine, num_samples, seed)
        self.stages = stages  # in dependency order (check_stages)
        self.by_name = {s.name: s for s in stages}

    # ------------------------------------------------------------------------------------------ the points
    def children(self, parent_points: list[dict], stage: Stage) -> list[dict]:
        """The child points ``stage`` makes of its parents' points (those whose attention ``when`` names)."""
        out = []
        knobs = stage.space.knobs()
        for parent in parent_points:
            attention = self.attention_of(parent)
            if stage.when is not None and attention not in stage.when:
                continue
            keys = [k for k, a in knobs.items() if a.applies_to(attention)]
            combos = [[]]
            for key in keys:
                combos = [[*c, (key, v)] for c in combos for v in knobs[key].values]
            for combo in combos:
                out.append({**{k: v for k, v in parent.items() if k != STAGE_KEY}, STAGE_KEY: stage.name,
                            **{stage.axis_key(k): v for k, v in combo}})
        return out

    def _expand(self, root_points: list[dict]) -> list[dict]:
        by_stage = {ROOT: root_points}
        for stage in self.stages:
            by_stage[stage.name] = self.children(by_stage[stage.parent], stage)
        return [p for points in by_stage.values() for p in points]

    def grid(self) -> list[dict]:
        """Every root point, then every stage's points in dependency order (a child after every parent)."""
        return self._expand(super().grid())

    def checked_points(self) -> list[dict]:
        # the root's checked points (SearchSpace's, whose grid is this one's: children left out), then the stages'
        return self._expand([p for p in super().checked_points() if STAGE_KEY not in p])

    def size(self) -> int:
        return len(self.grid())

    def stage_sizes(self) -> dict[str, int]:
        """Points per stage, root first."""
        out = {ROOT: 0, **{s.name: 0 for s in self.stages}}
        for point in self.grid():
            out[stage_of(point)] += 1
        return out

    def max_steps(self) -> int:
        return max(self.config(p).steps for p in self.checked_points())

    def attention_of(self, point: dict) -> str:
        return point.get("attention") or self.attentions()[0]

    def parent_point(self, point: dict) -> dict | None:
        """The point of the run ``point``'s run starts from; None for a root point."""
        name = stage_of(point)
        if name == ROOT:
            return None
        stage = self.by_name[name]
        parent = {k: v for k, v in point.items() if k != STAGE_KEY and not k.startswith(f"{name}.")}
        if stage.parent != ROOT:
            parent[STAGE_KEY] = stage.parent
        return parent

    # ------------------------------------------------------------------------------------------ the configs
    def config(self, point: dict, data: str | dict | None = None) -> TrainConfig:
        """The point's training config (a child's without ``init_from``: :meth:`with_parent`). UserError naming
        the stage and field."""
        name = stage_of(point)
        if name == ROOT:
            return super().config(point, data)
        stage = self.by_name.get(name)
        if stage is None:
            raise UserError(f"point {point}: stage {name!r} is not one of the study's stages")
        parent = self.config(self.parent_point(point), data)
        fields = parent.model_dump(mode="json", exclude_unset=True)
        fields.pop("init_from", None)
        if "tokens" in stage.train:  # a token budget replaces the parent's step count
            fields.pop("steps", None)
        axes = {k[len(name) + 1:]: v for k, v in point.items() if k.startswith(f"{name}.")}
        if "rope_scaling" in stage.train or "rope_scaling" in axes:  # the stage's scaling brings its own factor
            fields.pop("rope_factor", None)
        fields.update(stage.train)
        fields.update(axes)
        fields["original_len"] = parent.base_length
        if data is not None and "data" not in stage.train:
            fields["data"] = data
        try:
            cfg = load_train_config(fields)
        except UserError as exc:
            raise UserError(f"stages.{name}: {exc}") from None
        if cfg.seq_length <= parent.seq_length:
            raise UserError(f"stages.{name}.train.seq_len={cfg.seq_length} is not above its parent's "
                            f"({parent.seq_length}, stage {stage.parent}): a stage fine-tunes at a longer length")
        return cfg

    @staticmethod
    def with_parent(cfg: TrainConfig, train_key: str, run: str, step: int, lineage_tokens: int) -> TrainConfig:
        """``cfg`` starting from the parent run ``train_key`` (at ``run``) at its final ``step``."""
        from attnlab.train.config import InitFrom

        init = InitFrom(train_key=train_key, run=run, step=step, lineage_tokens=lineage_tokens)
        return cfg.model_copy(update={"init_from": init})

    def describe(self) -> str:
        sizes = self.stage_sizes()
        stages = "; ".join(f"stage {s.name} from {s.parent}"
                           + (f" when {'/'.join(s.when)}" if s.when else "")
                           + (f", axes {', '.join(s.space.knobs())}" if s.space.knobs() else "")
                           + f": {sizes[s.name]} run(s)" for s in self.stages)
        return f"{super().describe()} ({sizes[ROOT]} run(s)); {stages}"


__all__ = ["NOT_IN_STAGE", "ROOT", "STAGE_KEY", "Stage", "StagedSpace", "check_stages", "stage_of"]
