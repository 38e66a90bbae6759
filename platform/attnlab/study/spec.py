"""The study spec: the schema of one YAML file in ``studies/`` (:class:`StudySpec`, pydantic v2, extra fields
refused) and its loading (:func:`load_spec`).

Owns what a study file may say. It embeds the two configurations the rest of attnlab uses rather than a second
language remapped into them: ``train:`` is a :class:`attnlab.train.config.TrainConfig`, ``eval:`` an
:class:`attnlab.evaluate.plan.EvalConfig`. Around them: the trials' resources, the search engine, the objectives
(:func:`parse_objective`), the scheduler, the stores and trackers, and the ``plugins:``, read into their sources and
loaded before the rest is validated. The search space is :mod:`attnlab.study.space`'s (with stages,
:mod:`attnlab.study.stages`'s): :meth:`StudySpec.search_space` hands it the blocks, and validation asks it whether
every checked point makes a valid training config.

Every problem is one line naming the field, the value and what is allowed (``UserError``), YAML syntax errors
included. It must never import Ray or Optuna, touch the network, or read anything but the YAML file and its
plugins: its validators open no data (``train.data`` is checked from its text alone).

Details: docs/studies.md#every-field, docs/studies.md#the-search-space, docs/plugins.md#plugins-in-studies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pydantic
import yaml
from pydantic import (BaseModel, ConfigDict, Field, InstanceOf, PrivateAttr, field_serializer, field_validator,
                      model_validator)

from attnlab.attention.plugin import PluginError, PluginSource, load_recorded, load_source, parse_ref, read_source
from attnlab.errors import UserError
from attnlab.evaluate.plan import EvalConfig
from attnlab.names import (
    STUDY_NAME,
    STUDY_NAME_RULE,
    check_scaling,
    parse_at,
    parse_optional_number,
    resolve_at,
)
from attnlab.study.space import Axis, SearchSpace, Space
from attnlab.study.stages import Stage, StagedSpace, check_stages
from attnlab.train.config import TrainConfig
from attnlab.validation import describe

ENGINES = ("grid", "random", "optuna")
SAMPLERS = ("tpe", "random", "nsgaii")
# Where the blocks of the earlier study layout went: refused with a pointer, never silently remapped.
_MOVED = {
    "model": "the model is part of the training config: write train.preset and train.model (overrides)",
    "data": "the data is part of the training config: write train.data",
    "resources.workers_per_trial": "write train.workers",
    "resources.gpus_per_worker": "write train.gpus_per_worker (0 = CPU workers)",
    "resources.cpus_per_worker": "write train.cpus_per_worker",
    "space.rope_scaling": "every trial is evaluated with all RoPE settings: write eval.rope_scaling (a RoPE scaling in "
                          "training belongs to a stage that fine-tunes a parent: stages[].space.rope_scaling)",
    "storage": "the Optuna RDB URL is now optuna_storage (the runs folder is the --runs flag)",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Resources(_Strict):
    """What a study asks for beyond its trials' training workers (those are ``train.workers`` & co)."""

    max_concurrent_trials: int = Field(default=1, ge=1)
    trial_cpus: float = Field(default=0.5, gt=0)  # the Tune trial (the Train driver) itself
    # A one-worker CPU trial trains and evaluates in its Tune trial's own process, which then also holds the
    # worker's resources: no Ray Train worker group to start (most of a cheap trial's cost: bench/trials.py). The
    # same weights and losses; false: Ray Train always (e.g. to see the run in the dashboard's Train view).
    train_in_trial: bool = True


class Search(_Strict):
    engine: Literal["grid", "random", "optuna"] = "grid"
    num_samples: int | None = Field(default=None, ge=1)
    seed: int = 0
    sampler: Literal["tpe", "random", "nsgaii"] | None = None

    @model_validator(mode="after")
    def _fits_engine(self) -> "Search":
        if self.engine == "grid" and self.num_samples not in (None, 1):
            raise ValueError(f"num_samples={self.num_samples} does not apply to a grid (every point runs once; "
                             "use space.seeds for repeats)")
        if self.sampler is not None and self.engine != "optuna":
            raise ValueError(f"sampler={self.sampler!r} only applies to engine: optuna")
        return self


class Scheduler(_Strict):
    type: Literal["asha", "none"] = "none"
    grace_period: int = Field(default=20, ge=1)  # training steps before a trial can be pruned
    reduction_factor: float = Field(default=2.0, gt=1)
    metric: str = "val_loss"  # a metric the training reports along the way (val_loss, train_loss)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data):
        if data is None or (isinstance(data, str) and data.lower() in ("none", "null")):
            return {"type": "none"}
        if isinstance(data, str):
            return {"type": data}
        return data

    @field_validator("metric")
    @classmethod
    def _reported(cls, value):
        if value not in ("val_loss", "train_loss", "val_acc"):
            raise ValueError("use val_loss, train_loss or val_acc (what training reports along the way)")
        return value


@dataclass(frozen=True)
class ObjectiveParts:
    """An objective's text ``METRIC@AT[,p_eval=P][,rope=R]`` parsed (:func:`parse_objective`): the one cell of a
    trial's rows it reads. ``AT`` is either a multiple of the training length or a length in tokens."""

    metric: str
    multiple: float | None  # AT as a multiple of the training length (16x) ...
    length: int | None  # ... or as a length in tokens (1024, 16k): exactly one of the two is set
    p_eval: float | None  # None: the variant as trained
    rope: str | None  # None: the study's first eval.rope_scaling
    key: str  # the canonical spelling: the Tune metric name

    def eval_len(self, train_len: int) -> int:
        """The evaluation length in tokens for a model trained at ``train_len``."""
        at = ("multiple", self.multiple) if self.multiple is not None else ("length", self.length)
        return resolve_at(at, train_len)

    def as_dict(self) -> dict:
        """The fields as JSON (the web page's ``objective``)."""
        return dataclasses.asdict(self)


class Objective(_Strict):
    """One objective: ``METRIC@AT[,p_eval=P][,rope=R]`` and a mode; parsed once, when validated (:attr:`parts`)."""

    metric: str
    mode: Literal["min", "max"] | None = None
    _parts: ObjectiveParts | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data):
        return {"metric": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _parse(self) -> "Objective":
        self._parts = parse_objective(self.metric)  # raises ValueError
        if self.mode is None:
            from attnlab.results.schema import METRICS

            object.__setattr__(self, "mode", "max" if METRICS[self._parts.metric].higher_is_better else "min")
        return self

    @property
    def parts(self) -> ObjectiveParts:
        return self._parts

    @property
    def key(self) -> str:
        """The Tune metric name (canonical spelling)."""
        return self._parts.key


_OBJECTIVE = re.compile(r"^(?P<metric>[a-z][a-z0-9_]*)@(?P<at>\d+(?:\.\d+)?x|\d+k?)(?P<opts>(?:,[a-z_]+=[^,]+)*)$")


def parse_objective(text: str) -> ObjectiveParts:
    """``"val_loss@16x,p_eval=15"`` -> its :class:`ObjectiveParts`; ValueError saying what is allowed."""
    from attnlab.results.schema import COMPLETE_METRIC, METRICS


    match = _OBJECTIVE.match(str(text).replace(" ", ""))
    if not match:
        raise ValueError("use METRIC@AT[,p_eval=P][,rope=R], e.g. val_loss@16x, val_loss@1024,p_eval=15")
    metric = match["metric"]
    if metric not in METRICS or metric == COMPLETE_METRIC:
        raise ValueError(f"metric {metric!r} is unknown; use one of "
                         f"{', '.join(sorted(set(METRICS) - {COMPLETE_METRIC}))}")
    at = match["at"]
    out: dict = {"metric": metric, "multiple": None, "length": None, "p_eval": None, "rope": None}
    kind, number = parse_at(at, field="objective")
    out[kind] = number
    for opt in filter(None, (match["opts"] or "").split(",")):
        name, value = opt.split("=", 1)
        if name == "p_eval":
            out["p_eval"] = parse_optional_number(value, "p_eval")
        elif name == "rope":
            out["rope"] = check_scaling(value, "rope").label
        else:
            raise ValueError(f"option {name!r} is unknown; use p_eval=P or rope=R")
    key = f"{metric}@{at}"
    if out["p_eval"] is not None:
        key += f",p_eval={out['p_eval']:g}"
    if out["rope"] is not None:
        key += f",rope={out['rope']}"
    return ObjectiveParts(key=key, **out)


class StudySpec(_Strict):
    name: str
    description: str = ""
    # Attention plugins (read into their sources by load_spec; validated and loaded before train and space).
    plugins: list[InstanceOf[PluginSource]] = Field(default_factory=list)
    train: TrainConfig
    eval: EvalConfig = Field(default_factory=EvalConfig)
    resources: Resources = Field(default_factory=Resources)
    search: Search = Field(default_factory=Search)
    space: Space = Field(default_factory=Space)
    # Stages that train from other stages' final weights (attnlab.study.stages, docs/stages.md); empty: one stage
    stages: list[Stage] = Field(default_factory=list)
    objective: list[Objective] = Field(default_factory=lambda: [Objective(metric="val_loss@1x")])
    scheduler: Scheduler = Field(default_factory=Scheduler)
    optuna_storage: str | None = None  # Optuna RDB URL
    store: str | None = None  # results store (path or URI)
    # Also log every trial where a lab already looks, through Ray Tune's own logger callbacks (opt-in):
    # mlflow (MLFLOW_TRACKING_URI, default <runs>/<study>/mlruns) and wandb (WANDB_PROJECT, default the study)
    trackers: list[Literal["mlflow", "wandb"]] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _earlier_layout(cls, data):
        """Blocks of the earlier study layout are refused with where they went (:data:`_MOVED`)."""
        if not isinstance(data, dict):
            return data
        for key in ("model", "data", "storage"):
            if key in data:
                raise ValueError(f"{key}: {_MOVED[key]}")
        for block in ("resources", "space"):
            inner = data.get(block)
            if isinstance(inner, dict):
                for key in inner:
                    if f"{block}.{key}" in _MOVED:
                        raise ValueError(f"{block}.{key}: {_MOVED[f'{block}.{key}']}")
        return data

    @field_validator("plugins", mode="before")
    @classmethod
    def _plugin_sources(cls, value):
        """Paths or module names (read here, relative to the working directory), recorded sources
        (``PluginSource.to_dict``) or sources; each is loaded, so the fields after it may name its variants."""
        if value is None:
            return []
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{value!r:.80} is not allowed: give a list of .py paths or module names, e.g. "
                             "[plugins/fox.py]")
        try:
            sources = [_source_of(item, i) for i, item in enumerate(value)]
            for source in sources:
                load_source(source)
        except (UserError, KeyError, TypeError) as exc:
            raise ValueError(str(exc)) from None
        return sources

    @field_serializer("plugins")
    def _plugin_records(self, value):
        return [source.to_dict() for source in value]

    @field_validator("name")
    @classmethod
    def _name(cls, value):
        if not STUDY_NAME.match(value):
            raise ValueError(f"use {STUDY_NAME_RULE}")
        return value

    @field_validator("train", mode="before")
    @classmethod
    def _train_needs(cls, value):
        if isinstance(value, dict):
            data_rule = "demo, a folder made by `attnlab data prepare` (path or URI), or {synthetic: TASK, ...}"
            if "preset" not in value:
                raise ValueError("train.preset is required: a model preset, e.g. tiny or gpt2-small")
            if "val_extrapolation" in value:
                raise ValueError("train.val_extrapolation is set by the study's eval.during_training (every trial "
                                 "gets it): write eval.during_training: {multiples: [2, 4, 8], every: 100}")
            data = value.get("data")
            if data is None or (isinstance(data, str) and not data.strip()):
                raise ValueError(f"train.data is required: {data_rule}")
            if isinstance(data, dict) and "synthetic" not in data:
                raise ValueError("train.data: a data mapping needs a synthetic: TASK key")
            if not isinstance(data, (str, dict)):
                raise ValueError(f"train.data={data!r} is not allowed: use {data_rule}")
            from attnlab.data.source import check_data

            try:  # from the text alone: a generated source's parameters, a bucket URI's form; nothing is opened
                check_data(data, "train.data")
            except UserError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("objective", mode="before")
    @classmethod
    def _objective_list(cls, value):
        if isinstance(value, (str, dict)):
            return [value]
        return value

    @field_validator("objective")
    @classmethod
    def _objective_distinct(cls, value):
        if not value:
            raise ValueError("give at least one objective, e.g. val_loss@16x")
        keys = [o.key for o in value]
        if len(set(keys)) != len(keys):
            raise ValueError(f"{keys} repeats an objective")
        return value

    @field_validator("optuna_storage")
    @classmethod
    def _optuna_storage(cls, value):
        if value is not None and "://" not in value:
            raise ValueError("must be an Optuna RDB URL such as sqlite:////abs/path/optuna.db or "
                             "postgresql+psycopg2://user@host/db")
        return value

    # ------------------------------------------------------------------------------------------ checks
    @model_validator(mode="after")
    def _coherent(self) -> StudySpec:
        set_in_train = self.train.model_fields_set
        for axis in ("attention", "scale", "p_train"):
            if getattr(self.space, axis) is not None and axis in set_in_train:
                raise ValueError(f"train.{axis} and space.{axis} are both set: keep one")
        if self.space.seeds is not None and "seed" in set_in_train:
            raise ValueError("train.seed and space.seeds are both set: keep one")
        for key in self.space.model_extra or {}:
            if key in set_in_train or (key.startswith("model.") and key[6:] in self.train.model):
                raise ValueError(f"{key} is set both in space and in train: keep one")
        space = self.search_space()
        names = space.attentions()
        check_stages(self.stages, names, self.search.engine, self.scheduler.type)
        for key, axis in self.space.knobs().items():
            for name in axis.when or []:
                if name not in names:
                    raise ValueError(f"space.{key}.when names {name!r}, which is not among the study's attention "
                                     f"variants ({', '.join(names)})")
            if self.search.engine == "grid" and axis.is_range:
                raise ValueError(f"space.{key} is a low/high range; a grid needs values: [...] (or use engine: "
                                 "random or optuna)")
        if len(self.objective) > 1 and self.search.engine != "optuna":
            raise ValueError(f"objective lists {len(self.objective)} metrics; several objectives (a Pareto front) "
                             "need search.engine: optuna")
        if self.search.engine in ("random", "optuna") and self.search.num_samples is None:
            raise ValueError(f"search.num_samples is required with engine: {self.search.engine}")
        lengths = self.eval.eval_lengths(self.train.seq_length)
        for obj in self.objective:
            parts = obj.parts
            if parts.p_eval not in self.eval.p_eval:
                raise ValueError(f"objective {obj.metric}: p_eval={parts.p_eval} is not evaluated "
                                 f"(eval.p_eval: {self.eval.p_eval})")
            if parts.rope is not None and parts.rope not in self.eval.rope_scaling:
                raise ValueError(f"objective {obj.metric}: rope={parts.rope} is not evaluated "
                                 f"(eval.rope_scaling: {self.eval.rope_scaling})")
            if parts.eval_len(self.train.seq_length) not in lengths:
                raise ValueError(f"objective {obj.metric}: that length is not evaluated (eval lengths: {lengths})")
            if parts.metric.startswith("passkey") and not self.eval.passkey:
                raise ValueError(f"objective {obj.metric} needs eval.passkey: true")
        if self.eval.downstream is not None and isinstance(self.train.data, dict):
            raise ValueError("eval.downstream scores English tasks: it needs train.data of GPT-2 text (demo or a "
                             "prepared folder), not a synthetic task; drop eval.downstream for probe studies")
        # Every point must make a valid training config (the space's checked points: attnlab.study.space).
        try:
            space.checked(batches=True)
        except UserError as exc:
            raise ValueError(str(exc)) from None
        if self.scheduler.type == "asha" and self.scheduler.grace_period >= space.max_steps():
            raise ValueError(f"scheduler.grace_period={self.scheduler.grace_period} must be below the training "
                             f"steps ({space.max_steps()}), or ASHA can never prune")
        return self

    # --------------------------------------------------------------------------------------- queries
    def search_space(self) -> SearchSpace:
        """The study's points and each one's training config (:mod:`attnlab.study.space`; with stages a
        :class:`attnlab.study.stages.StagedSpace`: the root's points, then every stage's)."""
        if self.stages:
            ordered = check_stages(self.stages, SearchSpace(self.train, self.space).attentions(), self.search.engine,
                                   self.scheduler.type)
            return StagedSpace(self.train, self.space, ordered, self.search.engine, self.search.num_samples,
                               self.search.seed)
        return SearchSpace(self.train, self.space, self.search.engine, self.search.num_samples, self.search.seed)

    def resource_request(self) -> dict:
        """The request :func:`attnlab.cluster.fit.check_fits` takes (its one shape)."""
        from attnlab.cluster.fit import normalise_request

        t, r = self.train, self.resources
        # a trial that trains in its own process is one bundle on one node: the worker's CPUs and the driver's
        cpus = t.cpus_per_worker + (r.trial_cpus if self.trains_in_trial() else 0.0)
        return normalise_request({"workers": t.workers, "gpus_per_worker": t.gpus_per_worker,
                                  "cpus_per_worker": cpus,
                                  "max_concurrent_trials": r.max_concurrent_trials, "trial_cpus": r.trial_cpus})

    def trial_resources(self) -> dict:
        """What one running trial holds: the driver plus its Train workers."""
        t = self.train
        return {"CPU": self.resources.trial_cpus + t.workers * t.cpus_per_worker, "GPU": t.workers * t.gpus_per_worker}

    def trains_in_trial(self) -> bool:
        """Whether each trial trains in its Tune trial's process (``resources.train_in_trial``): one CPU worker only
        (a GPU worker keeps Ray Train, whose worker process ends with the run; several workers need its DDP group).
        Workers, GPUs and CPUs are study-wide (no search axis sets them), so this holds for every trial."""
        return self.resources.train_in_trial and self.train.workers == 1 and not self.train.gpu

    def trial_bundle(self) -> dict:
        """What the Tune trial asks Ray for: its driver's CPUs, plus one training worker's resources when it trains
        in its own process (:meth:`trains_in_trial`)."""
        if not self.trains_in_trial():
            return {"CPU": self.resources.trial_cpus}
        return {**self.train.worker_resources, "CPU": self.resources.trial_cpus + self.train.cpus_per_worker}

    def to_json(self) -> dict:
        """The spec as the user wrote it (unset fields left out), so that validating it again checks the same
        things: e.g. ``train.attention`` set next to ``space.attention`` is only an error when the user set it."""
        return self.model_dump(mode="json", exclude_unset=True)

    def search_fingerprint(self) -> str:
        """A hash of what defines the search (not the evaluation): a resumed Tune experiment must search the
        same space. Evaluation settings may change between runs: new cells are evaluated, nothing retrains. Plugins
        count by their bytes (an edited plugin is a changed search; a moved one is not); a study without plugins
        hashes as before they existed."""
        blob = self.model_dump(mode="json", exclude={"eval", "description", "store", "plugins"})
        blob["train"].pop("plugin", None)  # a plugin's bytes count once, below
        blob["train"].pop("val_extrapolation", None)  # eval.during_training's copy: a run setting, never searched
        # fields added later hash only when set: a study written before them keeps its fingerprint (and its resume)
        for key, default in (("rope_scaling", "none"), ("rope_factor", None), ("original_len", None),
                             ("init_from", None)):
            if blob["train"].get(key) == default:
                blob["train"].pop(key, None)
        if not blob.get("stages"):
            blob.pop("stages", None)
        if self.plugins:
            blob["plugins"] = self.plugin_hashes()
        return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]

    def plugin_hashes(self) -> dict[str, str]:
        """``{origin: sha256}`` of the study's plugins."""
        return {source.origin: source.sha256 for source in self.plugins}

    def load_plugins(self) -> None:
        """Load the study's plugins from the bytes the spec carries (a Tune trial's process: it reads no file)."""
        for source in self.plugins:
            load_recorded(source, holder=f"study {self.name}")

    def describe(self) -> str:
        """A few lines for ``attnlab study validate``."""
        req = self.trial_resources()
        space = self.search_space()
        t = self.train
        data = t.data if isinstance(t.data, str) else f"{{synthetic: {t.data.get('synthetic')}, ...}}"
        lines = [
            f"study {self.name}: engine {self.search.engine}, {space.size()} trial(s)"
            + (f" (num_samples {self.search.num_samples})" if self.search.engine != "grid" else ""),
            f"train: preset {t.preset}{f' {t.model}' if t.model else ''}, data {data}, {t.steps} steps of "
            f"{t.tokens_per_step} tokens at {t.seq_length}",
            space.describe(),
            f"objective: {', '.join(f'{o.key} ({o.mode})' for o in self.objective)}; scheduler: {self.scheduler.type}",
            f"eval: lengths {self.eval.eval_lengths(t.seq_length)}, p_eval "
            f"{['none' if p is None else f'{p:g}' for p in self.eval.p_eval]}, rope {self.eval.rope_scaling}, "
            f"{self.eval.max_tokens} tokens per length"
            + (f"; while training: val loss at {self.eval.during_training.lengths(t.seq_length)} every "
               f"{self.eval.during_training.every} steps" if self.eval.during_training is not None else ""),
            f"resources per trial: {req['CPU']:g} CPU, {req['GPU']:g} GPU ({t.workers} worker(s)); at most "
            f"{self.resources.max_concurrent_trials} trial(s) at once",
        ]
        if self.plugins:
            lines.insert(1, "plugins: " + ", ".join(f"{source.origin} (sha256 {source.short_hash})"
                                                    for source in self.plugins))
        return "\n".join(lines)


def load_spec(source: str | Path | dict, plugins: list[str] | tuple = (), bundle: dict | None = None) -> StudySpec:
    """Load a study from a YAML file (or an already-parsed mapping). Every error is one ``UserError`` line.

    ``plugins``: more plugin paths or module names (``--plugin``), after the study's own ``plugins:``. ``bundle``:
    ``{path or module name as written: PluginSource}`` read elsewhere (``attnlab study submit`` ships them to the
    job's driver, which then reads no plugin file)."""
    where, folder = "study", None
    if isinstance(source, dict):
        data = source
    else:
        path = Path(source)
        folder = path.parent
        where = str(path)
        if not path.is_file():
            raise UserError(f"{path}: no such study file")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise UserError(f"{path}: not valid YAML{at}: {problem}") from None
        except UnicodeDecodeError:
            raise UserError(f"{path}: not a UTF-8 text file") from None
    if not isinstance(data, dict):
        raise UserError(f"{where}: a study must be a YAML mapping with at least `name:`")
    refs = data.get("plugins") or []
    if isinstance(refs, (list, tuple)) and all(isinstance(r, str) for r in refs) and (refs or plugins):
        try:  # read here: the study's folder is known (ambiguous relative paths are refused)
            data = {**data, "plugins": read_plugins([*refs, *plugins], folder, bundle)}
        except UserError as exc:
            raise UserError(f"{where}: {exc}") from None
    elif plugins:
        raise UserError(f"{where}: plugins: must be a list of .py paths or module names to add --plugin to")
    try:
        return StudySpec.model_validate(data)
    except pydantic.ValidationError as exc:
        raise UserError(f"{where}: {_one_line(exc)}") from None
    except UserError as exc:  # raised by a nested config's own checks
        raise UserError(f"{where}: {exc}") from None


def read_plugins(refs: list[str], folder: Path | None = None, bundle: dict | None = None) -> list[PluginSource]:
    """Each plugin path or module name read into its source and loaded (a ``:NAME`` must be one of its variants).
    ``bundle`` supplies sources by the path or name as written. A relative path is relative to the working
    directory; with the study's ``folder``, one found only next to the study, or different there, is refused."""
    out = []
    for i, ref in enumerate(refs):
        target, name = parse_ref(ref) if isinstance(ref, str) else (ref, None)
        if bundle is not None and target in bundle:
            source = bundle[target]
        else:
            _refuse_ambiguous(target, folder, i)
            source = read_source(ref)
        loaded = load_source(source)
        if name is not None and name not in loaded.names:
            raise PluginError(f"plugins[{i}]: plugin {target} has no variant {name!r}: it defines "
                              f"{', '.join(loaded.names)}")
        out.append(source)
    return out


def _refuse_ambiguous(target: str, folder: Path | None, i: int) -> None:
    """A relative plugin path is the working directory's; refuse one that is only, or differently, next to the
    study file."""
    if folder is None or not (target.endswith(".py") or "/" in target) or Path(target).is_absolute():
        return
    here, there = Path(target), folder / target
    if not there.is_file() or (here.is_file() and here.resolve() == there.resolve()):
        return
    if not here.is_file():
        raise UserError(f"plugins[{i}]: {target} is not in the working directory {Path.cwd()} (paths in a study are "
                        f"relative to it, as train.data); it is next to the study as {there}: write {there}")
    if here.read_bytes() != there.read_bytes():
        raise UserError(f"plugins[{i}]: {target} is ambiguous: {here.resolve()} (the working directory's, which a "
                        f"relative path means) and {there.resolve()} (next to the study) differ; write the path of the "
                        "one you mean from the working directory, or an absolute path")


def _source_of(item, i: int) -> PluginSource:
    """A plugins entry as a source: a path or module name (read), a recorded source (``to_dict``) or a source."""
    if isinstance(item, str):
        return read_source(item)
    if isinstance(item, dict):
        return PluginSource.from_dict(item)
    if isinstance(item, PluginSource):
        return item
    raise UserError(f"plugins[{i}]={item!r:.60} is not allowed: give a .py path or a module name")


def _one_line(exc: pydantic.ValidationError) -> str:
    """``describe`` without pydantic's "Value error, " noise, and a field-less error said plainly."""
    text = describe(exc).replace("Value error, ", "").replace("Assertion failed, ", "")
    return text[2:] if text.startswith(": ") else text


__all__ = ["Axis", "Objective", "Resources", "Scheduler", "Search", "Space", "StudySpec", "load_spec", "read_plugins",
           "parse_objective"]
