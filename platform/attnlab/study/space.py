"""A study's search space: the schema of its ``space:`` block (:class:`Axis`, :class:`Space`) and the one place
its points are enumerated, each with the training config it trains (:class:`SearchSpace`).

Owns what a point is (a plain mapping ``{axis: value}``, what Tune hands a trial and its status file records), its
training config (the study's ``train:`` block with the point's fields set, validated once:
:meth:`SearchSpace.config`; :class:`SearchPoint` is the typed pair), the points a search runs
(:meth:`SearchSpace.points`, Optuna's :meth:`SearchSpace.suggest`) and the points checked before a study runs
(:meth:`SearchSpace.checked`). The study's validation, the cluster fit check, the runner, ``attnlab study
validate`` and each trial ask here, so they all see the same points.

No other module enumerates points; this one must never do I/O or import Ray.

Details: docs/studies.md#the-search-space, docs/architecture.md#one-owner-for-each-fact.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from typing import Any, NamedTuple

import pydantic
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from attnlab.errors import UserError
from attnlab.names import is_none_word
from attnlab.train.config import AUTO, RUN_SETTINGS, TrainConfig, load_train_config
from attnlab.validation import describe

# Space axes with their own field; any other key is a training field or model.<field>.
NAMED_AXES = ("attention", "scale", "p_train", "seeds")
# Training fields a search axis may not set: the named axes' own, the data and model blocks, and how a run is
# executed (RUN_SETTINGS: they do not change the weights).
NOT_SEARCHED = {"preset": "train.preset", "model": "model.<field> axes", "data": "train.data",
                "seed": "space.seeds", "attention": "space.attention", "plugin": "the study's plugins:",
                "init_from": "a stage's from: (set by the study)", "original_len": "a stage's from: (set by the study)",
                **{k: f"train.{k}" for k in RUN_SETTINGS}}
MODEL_NOT_SEARCHED = ("attention", "p_train", "scale", "train_len", "attn_impl", "vocab_size", "rope_scaling",
                      "original_len")
# A grid up to this many points is checked point by point; a larger one axis by axis.
MAX_CHECKED_GRID = 4096


class Axis(BaseModel):
    """One search axis: a choice (``values``) or a range (``low``/``high``), optionally only ``when`` the
    attention variant is one of a list."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    values: list[Any] | None = None
    low: int | float | None = None  # both ints: an int range; otherwise a float range
    high: int | float | None = None
    log: bool = False
    step: int | float | None = None
    when: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data):
        if isinstance(data, (list, tuple)):
            return {"values": list(data)}
        if isinstance(data, (str, int, float)) or data is None:
            return {"values": [data]}
        return data

    @model_validator(mode="after")
    def _one_kind(self) -> "Axis":
        is_range = self.low is not None or self.high is not None
        if self.values is not None and is_range:
            raise ValueError("give either values: [...] or low/high, not both")
        if self.values is None and not is_range:
            raise ValueError("give values: [...] (a choice) or low/high (a range)")
        if self.values is not None:
            if not self.values:
                raise ValueError("values must not be empty")
            object.__setattr__(self, "values", [None if is_none_word(v) else v for v in self.values])
        else:
            if self.low is None or self.high is None:
                raise ValueError("a range needs both low and high")
            if not self.low < self.high:
                raise ValueError(f"low={self.low:g} must be below high={self.high:g}")
            if self.log and self.low <= 0:
                raise ValueError("a log range needs low > 0")
        if self.step is not None and (self.values is not None or self.step <= 0):
            raise ValueError("step must be > 0 and only goes with a low/high range")
        if self.when is not None and not self.when:
            raise ValueError("when must list at least one attention name")
        return self

    @property
    def is_range(self) -> bool:
        return self.values is None

    @property
    def is_int_range(self) -> bool:
        return self.is_range and all(isinstance(v, int) for v in (self.low, self.high)) and \
            (self.step is None or isinstance(self.step, int))

    def applies_to(self, attention: str | None) -> bool:
        return self.when is None or attention in self.when

    def ends(self) -> list:
        """The values a check tries: every choice, or a range's two ends."""
        if not self.is_range:
            return list(self.values)
        return [int(self.low), int(self.high)] if self.is_int_range else [self.low, self.high]

    def sample(self, rng: random.Random):
        """One value drawn with ``rng`` (uniform choice; uniform or log-uniform range, snapped to ``step``)."""
        if not self.is_range:
            return rng.choice(self.values)
        lo, hi = float(self.low), float(self.high)
        x = math.exp(rng.uniform(math.log(lo), math.log(hi))) if self.log else rng.uniform(lo, hi)
        if self.is_int_range:
            step = int(self.step or 1)
            return int(lo + step * round((x - lo) / step))
        if self.step:
            x = lo + self.step * round((x - lo) / self.step)
        return min(max(x, lo), hi)

    def suggest(self, trial, key: str):
        """The value Optuna's define-by-run ``trial`` suggests for this axis, named ``key``."""
        if not self.is_range:
            return trial.suggest_categorical(key, list(self.values))
        if self.is_int_range:
            return trial.suggest_int(key, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(key, float(self.low), float(self.high), step=self.step, log=self.log)


class Space(BaseModel):
    """The ``space:`` block. Named axes plus any training field that changes the weights (``lr``) or a model field
    (``model.n_layer``)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    attention: list[str] | None = None
    scale: Axis | None = None
    p_train: Axis | None = None
    seeds: list[int] | None = None

    @field_validator("attention", mode="before")
    @classmethod
    def _attention_list(cls, value):
        return [value] if isinstance(value, str) else value

    @field_validator("attention")
    @classmethod
    def _known_attention(cls, value):
        if value is None:
            return value
        if not value:
            raise ValueError("must list at least one attention variant")
        from attnlab.attention import variant_names

        names = variant_names()
        for i, name in enumerate(value):
            if name not in names:
                raise ValueError(f"{name!r} (item {i}) is not an attention variant; use one of {', '.join(names)}")
        if len(set(value)) != len(value):
            raise ValueError("lists the same variant twice")
        return value

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, value):
        if value is not None and (not value or len(set(value)) != len(value)):
            raise ValueError("must be a non-empty list of distinct integers")
        return value

    @model_validator(mode="after")
    def _extra_knobs(self) -> "Space":
        from attnlab.model.config import GPTConfig

        model_fields = {f.name for f in dataclasses.fields(GPTConfig)} - set(MODEL_NOT_SEARCHED)
        parsed = {}
        for key, raw in (self.model_extra or {}).items():
            if key.startswith("model."):
                if key[6:] not in model_fields:
                    raise ValueError(f"{key} is not a searchable model field; use model.<one of "
                                     f"{', '.join(sorted(model_fields))}>")
            elif key in NOT_SEARCHED:
                raise ValueError(f"{key} cannot be searched here (set {NOT_SEARCHED[key]})")
            elif key not in TrainConfig.model_fields:
                raise ValueError(f"{key} is not a search axis: use attention, scale, p_train, seeds, a training field "
                                 "(lr, steps, ...) or model.<field>")
            try:
                parsed[key] = Axis.model_validate(raw)
            except pydantic.ValidationError as exc:
                raise ValueError(describe(exc, key).replace("Value error, ", "")) from None
        object.__setattr__(self, "__pydantic_extra__", parsed)
        return self

    def knobs(self) -> dict[str, Axis]:
        """Every training axis (not attention/seeds), by its point key."""
        out = {}
        if self.scale is not None:
            out["scale"] = self.scale
        if self.p_train is not None:
            out["p_train"] = self.p_train
        out.update(self.model_extra or {})
        return out

    def searched_fields(self) -> list[str]:
        """The training fields and ``model.<field>`` axes beyond attention, scale, p_train and seeds."""
        return list(self.model_extra or {})


class SearchPoint(NamedTuple):
    """A point of the search and the training config it trains."""

    point: dict
    config: TrainConfig

    def label(self) -> str:
        """``attention=lssar, lr=0.001``: the point as one line."""
        return ", ".join(f"{k}={v}" for k, v in self.point.items())


class SearchSpace:
    """The points a study searches over: its ``train:`` block (every trial's config before its point is applied),
    its ``space:`` block and its search engine. Built from a validated study (``StudySpec.search_space()``);
    cheap, holds nothing it computes."""

    def __init__(self, train: TrainConfig, space: Space, engine: str = "grid", num_samples: int | None = None,
                 seed: int = 0):
        self.train, self.space = train, space
        self.engine, self.num_samples, self.seed = engine, num_samples, seed

    # ------------------------------------------------------------------------------------------ the axes
    def attentions(self) -> list[str]:
        """The attention variants searched (the base config's own when ``space.attention`` is not set)."""
        if self.space.attention:
            return list(self.space.attention)
        return [self.train.attention or "softmax"]

    def _base(self, attention: str) -> dict:
        return {"attention": attention} if self.space.attention else {}

    def size(self) -> int:
        """Trials the search runs (before any is found already done)."""
        if self.engine == "grid":
            total = 0
            for name in self.attentions():
                n = len(self.space.seeds or [0])
                for axis in self.space.knobs().values():
                    if axis.applies_to(name):
                        n *= len(axis.values)
                total += n
            return total
        seeds = len(self.space.seeds or [0]) if self.engine == "random" else 1
        return (self.num_samples or 1) * seeds

    def max_steps(self) -> int:
        """The largest training step count any trial can have (ASHA's max_t)."""
        axis = (self.space.model_extra or {}).get("steps")
        if axis is None:
            return self.train.steps
        return int(max(axis.values) if not axis.is_range else axis.high)

    # ------------------------------------------------------------------------------------------ the points
    def grid(self) -> list[dict]:
        """Every point of the grid (conditional axes only where their ``when`` holds), in a stable order."""
        points = []
        knobs = self.space.knobs()
        for name in self.attentions():
            keys = [k for k, a in knobs.items() if a.applies_to(name)]
            for values in itertools.product(*(knobs[k].values for k in keys)):
                for seed in self.space.seeds or [None]:
                    point = {**self._base(name), **dict(zip(keys, values))}
                    if seed is not None:
                        point["seed"] = seed
                    points.append(point)
        return points

    def sampled(self) -> list[dict]:
        """``num_samples`` points drawn with the search's seed, each run with every seed of ``space.seeds``."""
        rng = random.Random(self.seed)
        points = []
        for _ in range(self.num_samples or 1):
            name = rng.choice(self.space.attention) if self.space.attention else self.attentions()[0]
            point = self._base(name)
            for key, axis in self.space.knobs().items():
                if axis.applies_to(name):
                    point[key] = axis.sample(rng)
            for seed in self.space.seeds or [None]:
                points.append(point if seed is None else {**point, "seed": seed})
        return points

    def points(self) -> list[dict]:
        """The points a grid or random search runs (an Optuna search suggests its own: :meth:`suggest`)."""
        if self.engine == "optuna":
            raise UserError("an optuna search suggests its points trial by trial (SearchSpace.suggest)")
        return self.grid() if self.engine == "grid" else self.sampled()

    def suggest(self, trial) -> dict:
        """The point an Optuna define-by-run ``trial`` suggests (conditional axes only for their variants)."""
        name = self.attentions()[0]
        point = {}
        if self.space.attention:
            name = point["attention"] = trial.suggest_categorical("attention", list(self.space.attention))
        for key, axis in self.space.knobs().items():
            if axis.applies_to(name):
                point[key] = axis.suggest(trial, key)
        if self.space.seeds:
            point["seed"] = trial.suggest_categorical("seed", list(self.space.seeds))
        return point

    def checked_points(self) -> list[dict]:
        """The points every check sees (docs/studies.md#the-search-space): a grid's every point without its seed,
        or each variant alone then each axis value (a range's ends) under every variant the axis applies to; no
        duplicates."""
        if self.engine == "grid" and self.size() <= MAX_CHECKED_GRID:
            points = [{k: v for k, v in p.items() if k != "seed"} for p in self.grid()]
        else:
            points = [self._base(name) for name in self.attentions()]
            for key, axis in self.space.knobs().items():
                for name in self.attentions():
                    if axis.applies_to(name):
                        points += [{**self._base(name), key: value} for value in axis.ends()]
        unique = {}
        for point in points:
            unique.setdefault(tuple(sorted((k, repr(v)) for k, v in point.items())), point)
        return list(unique.values())

    # ------------------------------------------------------------------------------------------ the configs
    def config(self, point: dict, data: str | dict | None = None) -> TrainConfig:
        """The point's training config: the study's ``train:`` block as written with the point's fields set
        (``model.<field>`` into its model overrides) and, when given, the resolved data, validated once. Raises
        UserError naming the bad field."""
        fields = self.train.model_dump(exclude_unset=True)
        model = dict(fields.get("model") or {})
        for key, value in point.items():
            if key.startswith("model."):
                model[key[6:]] = value
            else:
                fields[key] = value
        if model:
            fields["model"] = model
        if data is not None:
            fields["data"] = data
        return load_train_config(fields)

    def checked(self, batches: bool = False) -> list[SearchPoint]:
        """Every checked point with its config (:meth:`checked_points`); UserError for the first that is not a
        valid training config, or with ``batches`` whose batch does not divide over its workers (what every trial
        would refuse inside Tune: a study's validation refuses it before anything runs)."""
        out = []
        for point in self.checked_points():
            try:
                cfg = self.config(point)
                if batches and cfg.micro_batch != AUTO:
                    cfg.batch_plan(cfg.workers)
            except UserError as exc:
                shown = ", ".join(f"{k}={v}" for k, v in point.items())
                raise UserError(f"the trial ({shown}) is not a valid training config: {exc}") from None
            out.append(SearchPoint(point, cfg))
        return out

    def distinct(self) -> list[SearchPoint]:
        """The checked points with distinct training configs (for checks that need every trial's model and batch)."""
        out, seen = [], set()
        for searched in self.checked():
            key = searched.config.model_dump_json()
            if key not in seen:
                seen.add(key)
                out.append(searched)
        return out

    def describe(self) -> str:
        """``attention: softmax, lssar; axes: p_train when lssar; seeds: [0, 1]`` for ``attnlab study validate``."""
        axes = ", ".join(f"{k}{' when ' + '/'.join(a.when) if a.when else ''}" for k, a in self.space.knobs().items())
        return (f"attention: {', '.join(self.attentions())}; axes: {axes or 'none'}"
                + (f"; seeds: {self.space.seeds}" if self.space.seeds else ""))


__all__ = ["Axis", "MAX_CHECKED_GRID", "NAMED_AXES", "SearchPoint", "SearchSpace", "Space"]
