"""The one typed training configuration: every knob of a run, validated, with errors naming the field.

Owns :class:`TrainConfig` and every default (the paper's recipe, llm.c's GPT-2 124M, and each preset's own in
:data:`PRESET_RECIPES`): nothing else restates one. A study's ``train:`` block is one (each trial's searched fields set
by :meth:`attnlab.study.space.SearchSpace.config`), ``attnlab train --config FILE`` reads the same fields, and a
checkpoint stores it. It also owns a run's identity, :attr:`TrainConfig.train_key`, over what changes the weights
(run settings such as ``micro_batch`` and the worker count are not part of it), and resolves ``micro_batch: auto``
from the memory plan (:mod:`attnlab.model.memory`) and the GPU a worker finds.

Between processes the object itself travels, pickled; its one serialised form is ``model_dump(mode="json")``, every
field written, which ``provenance.json``, every checkpoint and a study's status files record, and
``model_validate`` reads back whole (evaluation reads it as :class:`attnlab.runfolder.TrainRecord`). It must never
import Ray, nor evaluation code.

Details: docs/protocol.md#training (the defaults), docs/gpu-memory.md#micro_batch-auto,
docs/stages.md#identity-and-reuse (what a key promises), docs/architecture.md#one-owner-for-each-fact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, InstanceOf, field_serializer, field_validator, model_validator

from attnlab.errors import UserError
from attnlab.attention import Backend, get_variant
from attnlab.attention.plugin import PluginError, PluginSource, load_recorded
from attnlab.attention.spec import P_TRAIN_DEFAULT, PluginSpec, parse_p_train
from attnlab.attention.variants import plugin_spec
from attnlab.model import PRESETS, GPTConfig, preset, with_kind
from attnlab.names import rope_identity
from attnlab.names import GPT2_VOCAB
from attnlab.runfolder import ValExtrapolation, data_order_seed
from attnlab.validation import parse


# Fields that do not change the trained weights: how a run is executed, logged and checkpointed. A training
# run's identity (``train_key``) leaves them out, so e.g. more workers or another log cadence reuse a run.
RUN_SETTINGS = frozenset({
    "workers", "gpus_per_worker", "cpus_per_worker", "worker_resources", "threads_per_worker", "micro_batch",
    "log_every", "val_every", "val_tokens", "val_batch", "checkpoint_every", "keep_checkpoints", "max_failures",
    "compile", "attn_impl", "val_extrapolation",
})


class InitFrom(BaseModel):
    """The run a stage's training starts from (docs/stages.md): its parent's training key (part of this run's
    identity), where the parent's run folder is (a path or URI: not identity, the parent may live in another
    study's folder) and the step of the final checkpoint whose weights it takes. Filled in by the study when it
    plans the stage; only the weights are taken: a fresh optimiser, this run's own schedule."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    train_key: str
    run: str
    step: int = Field(gt=0)
    lineage_tokens: int = Field(default=0, ge=0)  # the parent's lineage's training tokens to that step (a label)


# A stopping rule's metrics (train.stop_when.metric): what the training loop measures at each validation point,
# all-reduced over the workers.
STOP_METRICS = ("val_acc", "val_loss")
STOP_BOUNDS = ("at_least", "at_most")


class StopWhen(BaseModel):
    """``stop_when: {metric: val_acc, at_least: 0.99}``: stop training at the first validation point whose
    ``metric`` is at least (or at most) the threshold; ``steps`` is then the cap. Checked every ``val_every``
    steps (docs/protocol.md#stopping-rule)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: Literal["val_acc", "val_loss"]
    at_least: float | None = None
    at_most: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_bound(cls, data):
        """Every problem as one ValueError naming the field and what is allowed (one line via validation.parse)."""
        if isinstance(data, StopWhen):
            return data
        if not isinstance(data, dict):
            raise ValueError("must be a mapping like {metric: val_acc, at_least: 0.99}")
        unknown = sorted(set(data) - {"metric", *STOP_BOUNDS})
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not a known field; allowed: metric, at_least, at_most")
        metric = data.get("metric")
        if metric not in STOP_METRICS:
            raise ValueError(f"metric={metric!r} is not allowed; use one of {', '.join(STOP_METRICS)}")
        bounds = [b for b in STOP_BOUNDS if data.get(b) is not None]
        if len(bounds) != 1:
            raise ValueError(f"give exactly one of at_least or at_most (got {' and '.join(bounds) or 'neither'})")
        value = data[bounds[0]]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{bounds[0]}={value!r} must be a finite number (the threshold)")
        return {"metric": metric, bounds[0]: float(value)}

    @property
    def threshold(self) -> float:
        return self.at_least if self.at_least is not None else self.at_most

    def met(self, metrics: dict) -> bool:
        """Whether the validation ``metrics`` (a report of the loop) meet the rule; False when not measured."""
        value = metrics.get(self.metric)
        if value is None or not math.isfinite(value):
            return False
        return value >= self.at_least if self.at_least is not None else value <= self.at_most

    def describe(self) -> str:
        """``val_acc >= 0.99``."""
        return f"{self.metric} {'>=' if self.at_least is not None else '<='} {self.threshold:g}"


# The version of what each built-in attention variant computes in training (absent: 1). Raise a variant's version
# in the change that alters what it computes, not merely how it rounds: its train key changes with it (identity), so
# a run trained under the older meaning is never found by key as a run of the new one
# (docs/stages.md#identity-and-reuse). tests/test_train_golden.py pins the first training losses of every variant and fails until it is raised.
# A plugin's variant needs none: its key holds its code's sha256.
ATTENTION_SEMANTICS: dict[str, int] = {}


def semantics_version(variant: str) -> int:
    """The version of what built-in attention ``variant`` (a registered name or alias) computes
    (:data:`ATTENTION_SEMANTICS`)."""
    return ATTENTION_SEMANTICS.get(get_variant(variant).name, 1)


# What ``micro_batch: auto`` resolves to without a GPU (capped to a divisor of the sequences per worker).
CPU_AUTO_MICRO_BATCH = 16
AUTO = "auto"

# Recipe defaults that fit each preset's size: fields a config leaves unset take them (a field set by the user
# always wins). The class defaults are llm.c's GPT-2 124M recipe (docs/protocol.md#training), which would make
# the CPU-sized presets take 524,288 tokens per step; gpt2-medium takes llm.c's 350M learning rate.
PRESET_RECIPES: dict[str, dict[str, Any]] = {
    "tiny": dict(steps=300, tokens_per_step=1024, micro_batch=16, lr=3e-3, warmup_steps=20, log_every=10,
                 val_every=100, val_tokens=16_384, checkpoint_every=300),
    "tiny-4l": dict(steps=1000, tokens_per_step=4096, micro_batch=32, lr=2e-3, warmup_steps=50, log_every=10,
                    val_every=250, val_tokens=65_536, checkpoint_every=500),
    "tiny-llama": dict(steps=300, tokens_per_step=1024, micro_batch=16, lr=3e-3, warmup_steps=20, log_every=10,
                       val_every=100, val_tokens=16_384, checkpoint_every=300),  # tiny's recipe, Llama block
    # 355M: micro-batch 64 x 1024 needs ~93 GiB, more than an 80 GB GPU (docs/gpu-memory.md); auto picks what fits.
    "gpt2-medium": dict(lr=3e-4, micro_batch=AUTO),
}
# A step needing more micro-steps than this (per worker) is warned about before a run starts.
MANY_ACCUMULATION_STEPS = 64


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # model
    preset: str = "gpt2-small"
    model: dict[str, Any] = Field(default_factory=dict)  # overrides of the preset (n_layer, n_embd, ...)
    attention: str | None = None  # None: the preset's (softmax)
    # The source (file bytes and sha256) of the plugin that defines `attention`, filled in from the loaded plugin
    # (docs/plugins.md#plugins-in-training-and-studies); None for a built-in variant. It travels with the config
    # (Ray workers, checkpoints, provenance), so every process runs the bytes the run was keyed by.
    plugin: InstanceOf[PluginSource] | None = None
    # default: the variant's own sharpening (lssar: p = 15); off (or none): no sharpening; or a number >= 1
    p_train: float | str | None = P_TRAIN_DEFAULT
    scale: str | float | None = None  # None: the variant's own scale
    # data
    data: str | dict[str, Any] = ""  # a prepared folder, or {synthetic: <task>, ...} for a probe
    seq_len: int | None = Field(default=None, gt=0)  # default: the preset's train_len
    # Context extension (a study's stages: docs/stages.md). The RoPE scaling applied in training (none, pi, ntk,
    # yarn, yarn_paper, dynamic) with factor rope_factor, None: seq_len / original_len (``rope_scaling: yarn:16`` or
    # ``{method: yarn, factor: 16}`` sets both); original_len: the length the lineage was first trained at (None:
    # seq_len), from which evaluation multiples count; init_from: the parent run whose final weights this one starts
    # from (set by the study).
    rope_scaling: str = "none"
    rope_factor: float | None = None
    original_len: int | None = Field(default=None, gt=0)
    init_from: InitFrom | None = None
    # budget and batch
    steps: int = Field(default=18_865, gt=0)  # with stop_when: the cap
    # a stopping rule checked at each validation point, e.g. {metric: val_acc, at_least: 0.99}; None: train `steps`
    stop_when: StopWhen | None = None
    tokens_per_step: int = Field(default=524_288, gt=0)
    # sequences per worker per micro-step, or auto: the largest that fits the GPU (docs/gpu-memory.md#micro_batch-auto)
    micro_batch: int | Literal["auto"] = 64
    # optimiser (llm.c recipe)
    lr: float = Field(default=6e-4, gt=0)
    min_lr_frac: float = Field(default=0.0, ge=0, le=1)
    warmup_steps: int = Field(default=700, ge=0)
    weight_decay: float = Field(default=0.1, ge=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-8, gt=0)
    grad_clip: float = Field(default=1.0, ge=0)  # 0 disables clipping
    seed: int = 1337
    # the order training batches are drawn in (a prepared corpus's validation windows never depend on it): a number,
    # or ``seed``, the run's own seed, so that seeds vary the data order as well as the initial draw
    data_seed: int | Literal["seed"] = 0
    # reporting and checkpoints
    log_every: int = Field(default=10, gt=0)
    val_every: int = Field(default=250, gt=0)
    val_tokens: int = Field(default=10_485_760, gt=0)  # llm.c/modded-nanogpt's first 10,485,760 val tokens
    val_batch: int = Field(default=8, gt=0)
    # validation at longer lengths while training, e.g. {multiples: [2, 4, 8], every: 100} (a study's
    # eval.during_training sets it); None: only at the training length. A run setting: no weights change.
    val_extrapolation: ValExtrapolation | None = None
    checkpoint_every: int = Field(default=1000, gt=0)
    keep_checkpoints: int = Field(default=2, gt=0)
    max_failures: int = Field(default=2, ge=0)  # worker-group restarts from the latest checkpoint
    # hardware
    workers: int = Field(default=1, gt=0)
    gpus_per_worker: float = Field(default=0.0, ge=0)  # 0: CPU workers (gloo); > 0: GPU workers (NCCL)
    cpus_per_worker: float = Field(default=1.0, gt=0)
    # Ray custom resources each worker (and the evaluation of the trained model) also asks for, e.g.
    # {accelerator_type:H100: 0.001} or a node label resource; empty: none.
    worker_resources: dict[str, float] = Field(default_factory=dict)
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    compile: bool | None = None  # torch.compile the model; None: on for CUDA workers, off on CPU
    attn_impl: str = "auto"  # the attention backend: attnlab.attention.Backend (auto, dense, flex, sdpa, triton)
    threads_per_worker: int | None = Field(default=None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _tokens_budget(cls, data):
        """``tokens: N`` is a training budget: ``steps = ceil(N / tokens_per_step)``."""
        if isinstance(data, dict) and "tokens" in data:
            data = dict(data)
            tokens = data.pop("tokens")
            if "steps" in data:
                raise ValueError("give steps or tokens (a budget), not both")
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
                raise ValueError(f"tokens={tokens!r} must be a positive integer (a budget of training tokens)")
            recipe = PRESET_RECIPES.get(data.get("preset", cls.model_fields["preset"].default), {})
            per_step = data.get("tokens_per_step", recipe.get("tokens_per_step",
                                                              cls.model_fields["tokens_per_step"].default))
            data["steps"] = max(1, math.ceil(tokens / per_step)) if isinstance(per_step, int) and per_step > 0 else 1
        return data

    @field_validator("stop_when", mode="before")
    @classmethod
    def _stop_when(cls, value):
        if value is None or isinstance(value, StopWhen):
            return value
        try:
            return StopWhen.model_validate(value)
        except pydantic.ValidationError as exc:  # the rule's own one-line message, not pydantic's wrapping
            raise ValueError(exc.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")) from None

    @field_validator("plugin", mode="before")
    @classmethod
    def _plugin_source(cls, value):
        """A recorded source (``PluginSource.to_dict``) or the object; a path or module name is the study's
        ``plugins:`` or ``--plugin``, never this field."""
        if value is None or isinstance(value, PluginSource):
            return value
        if isinstance(value, dict):
            try:
                return PluginSource.from_dict(value)
            except (KeyError, TypeError, AttributeError, UnicodeError) as exc:
                raise ValueError(f"is not a recorded plugin source ({type(exc).__name__}: {exc})") from None
            except PluginError as exc:
                raise ValueError(str(exc)) from None
        raise ValueError(f"{value!r:.80} is not allowed: the plugin is filled in from the one that defines attention; "
                         "load it with --plugin FILE_OR_MODULE (a study: plugins: [...])")

    @field_serializer("plugin")
    def _plugin_record(self, value):
        return None if value is None else value.to_dict()

    @model_validator(mode="before")
    @classmethod
    def _rope_scaling(cls, data):
        """``rope_scaling`` as a name, ``NAME:FACTOR`` or ``{method: NAME, factor: F}``: the method in
        ``rope_scaling``, the factor in ``rope_factor`` (one line, naming the field, for a factor below 1 or one on
        ``none``)."""
        if not isinstance(data, dict) or ("rope_scaling" not in data and data.get("rope_factor") is None):
            return data
        from attnlab.names import parse_rope

        given = data.get("rope_scaling")
        try:
            rope = parse_rope(given, "rope_scaling")
            alone = parse_rope({"method": rope.method, "factor": data.get("rope_factor")}, "rope_factor")
        except UserError as exc:
            raise ValueError(str(exc)) from None
        if rope.factor is not None and alone.factor is not None and rope.factor != alone.factor:
            raise ValueError(f"rope_scaling={given!r} and rope_factor={alone.factor:g} give two factors: give one")
        return {**data, "rope_scaling": rope.method, "rope_factor": rope.factor if rope.factor is not None
                else alone.factor}

    @field_validator("micro_batch", mode="before")
    @classmethod
    def _micro_batch(cls, value):
        if value == AUTO:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError("is not allowed: use a positive integer or auto (the largest that fits the GPU)")
        return value

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str) -> str:
        if value not in PRESETS:
            raise ValueError(f"unknown preset; use one of {', '.join(sorted(PRESETS))}")
        return value

    @field_validator("attn_impl")
    @classmethod
    def _backend(cls, value: str) -> str:
        return Backend.parse(value, field="attn_impl").value

    @field_validator("p_train", mode="before")
    @classmethod
    def _p_train(cls, value):
        return parse_p_train(value)

    @field_validator("model")
    @classmethod
    def _no_attention_in_model(cls, value: dict) -> dict:
        for key in ("attention", "p_train", "scale", "train_len", "attn_impl", "rope_scaling", "rope_factor",
                    "original_len"):
            if key in value:
                where = "seq_len" if key == "train_len" else key
                raise ValueError(f"model.{key} is set by the training config's own field: use {where}")
        return value

    @property
    def gpu(self) -> bool:
        """Whether the workers use GPUs (``gpus_per_worker > 0``)."""
        return self.gpus_per_worker > 0

    @model_validator(mode="after")
    def _preset_recipe(self) -> "TrainConfig":
        """Unset fields take the preset's recipe (:data:`PRESET_RECIPES`); they stay 'unset', so a study can
        still search them."""
        for key, value in PRESET_RECIPES.get(self.preset, {}).items():
            if key not in self.model_fields_set:
                object.__setattr__(self, key, value)
        return self

    @model_validator(mode="after")
    def _one_gpu_per_rank(self) -> "TrainConfig":
        """Ranks of one run each need a GPU of their own: NCCL refuses two ranks on one GPU."""
        if 0 < self.gpus_per_worker < 1 and self.workers > 1:
            raise ValueError(f"gpus_per_worker={self.gpus_per_worker:g} with workers={self.workers} is not allowed: "
                             "NCCL refuses two ranks of a run on one GPU; use gpus_per_worker: 1 (or more), or "
                             "workers: 1 to share a GPU between trials")
        return self

    @model_validator(mode="after")
    def _model_builds(self) -> "TrainConfig":
        try:
            self.gpt_config(vocab_size=self.model.get("vocab_size", GPT2_VOCAB))
        except UserError as exc:
            raise ValueError(str(exc)) from None
        if self.tokens_per_step % self.seq_length:
            raise ValueError(f"tokens_per_step={self.tokens_per_step} is not a multiple of seq_len={self.seq_length}")
        return self

    @model_validator(mode="after")
    def _attention_plugin(self) -> "TrainConfig":
        """``plugin`` is the source of the plugin ``attention`` comes from: filled in from the loaded plugin, and
        refused next to a built-in variant."""
        registered = plugin_spec(self.attention) if self.attention else None
        if registered is None:
            if self.plugin is not None:
                raise ValueError(f"plugin {self.plugin.origin} is given but attention={self.attention!r} is not one of "
                                 "its variants: leave plugin out (it is filled in for a plugin's variant)")
        elif self.plugin is None:
            object.__setattr__(self, "plugin", registered.source)
        return self

    @field_validator("data_seed", mode="before")
    @classmethod
    def _data_seed(cls, value):
        if value == "seed" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return value
        raise ValueError("is not allowed: use an integer >= 0, or seed (the run's own seed)")

    @property
    def data_order_seed(self) -> int:
        """The seed training batches are drawn with: ``data_seed``, or the run's ``seed`` for ``data_seed: seed``
        (:func:`attnlab.runfolder.data_order_seed`)."""
        return data_order_seed(self.data_seed, self.seed)

    @property
    def seq_length(self) -> int:
        return self.seq_len or PRESETS[self.preset]["train_len"]

    @property
    def base_length(self) -> int:
        """The length evaluation multiples count from: the lineage's first training length (``original_len``),
        ``seq_len`` for a run trained once."""
        return self.original_len or self.seq_length

    def gpt_config(self, vocab_size: int | None = None, kind: str = "gpt") -> GPTConfig:
        """The model config: the preset, its overrides, the attention choice, and the data's vocabulary; ``kind``
        is the data's model kind (``attnlab.data.source.model_kind``: ``orbit`` for coordinate tokens). A config
        whose attention is a plugin's loads that plugin's recorded bytes first (in a Ray worker: the only copy)."""
        if self.plugin is not None:
            load_recorded(self.plugin, holder=f"the training config of attention {self.attention!r}")
        overrides = dict(self.model)
        if self.attention is not None:
            overrides["attention"] = self.attention
        if self.scale is not None:
            overrides["scale"] = self.scale
        overrides["p_train"] = self.p_train
        overrides["train_len"] = self.seq_length
        overrides["attn_impl"] = self.attn_impl
        overrides["rope_scaling"] = self.rope_scaling
        overrides["rope_factor"] = self.rope_factor
        overrides["original_len"] = self.original_len
        if vocab_size is not None:
            overrides["vocab_size"] = vocab_size
        return with_kind(preset(self.preset, **overrides), kind)

    # ------------------------------------------------------------------ memory (attnlab.model.memory)
    def memory_settings(self, world_size: int | None = None) -> dict:
        """``precision``/``compiled``/``backend``/``ddp`` as :func:`attnlab.model.memory.estimate_train_step`
        takes them, for GPU workers (bf16 unless fp32; compiled unless ``compile: false``; DDP's buckets with
        more than one worker)."""
        return {"precision": "fp32" if self.precision == "fp32" else "bf16", "compiled": self.compile is not False,
                "backend": self.attn_impl, "ddp": (world_size or self.workers) > 1}

    def step_memory(self, micro_batch: int | None = None, vocab_size: int | None = None):
        """The estimated per-GPU peak of one training micro-step (a :class:`attnlab.model.memory.MemoryEstimate`)."""
        from attnlab.model.memory import estimate_train_step

        batch = micro_batch or self.micro_batch
        if batch == AUTO:
            raise UserError("micro_batch is auto: give micro_batch, or resolve it (TrainConfig.resolved)")
        return estimate_train_step(self.gpt_config(vocab_size=vocab_size), self.seq_length, batch,
                                   **self.memory_settings())

    def fitting_micro_batch(self, budget_bytes: int, world_size: int | None = None,
                            vocab_size: int | None = None) -> int:
        """The largest micro-batch that divides the sequences per worker per step and whose estimate fits
        ``budget_bytes``, one GPU's memory, of which a worker with ``gpus_per_worker`` below 1 gets that fraction
        (0: not even one sequence fits)."""
        from attnlab.model.memory import largest_micro_batch

        per_worker = self._sequences_per_worker(world_size or self.workers)
        s = self.memory_settings(world_size)
        if 0 < self.gpus_per_worker < 1:  # the GPU is shared (with another trial): this worker's part of it
            budget_bytes = int(budget_bytes * self.gpus_per_worker)
        return largest_micro_batch(self.gpt_config(vocab_size=vocab_size), self.seq_length, budget_bytes,
                                   precision=s["precision"], compiled=s["compiled"], backend=s["backend"],
                                   ddp=s["ddp"], divisor_of=per_worker)

    def _sequences_per_worker(self, world_size: int) -> int:
        global_batch = self.tokens_per_step // self.seq_length
        if global_batch % world_size:
            raise UserError(f"tokens_per_step={self.tokens_per_step} gives {global_batch} sequences of "
                            f"{self.seq_length}, not a multiple of workers={world_size}; adjust one of them")
        return global_batch // world_size

    def auto_micro_batch(self, world_size: int | None = None, budget_bytes: int | None = None,
                         vocab_size: int | None = None) -> int:
        """What ``micro_batch: auto`` resolves to: the largest fitting divisor of the sequences per worker for
        ``budget_bytes`` (default: this process's CUDA device's ``total_memory`` when the config uses GPUs and
        one is visible); without a GPU the largest divisor <= :data:`CPU_AUTO_MICRO_BATCH`. UserError when not
        even one sequence fits."""
        world = world_size or self.workers
        per_worker = self._sequences_per_worker(world)
        if budget_bytes is None and self.gpu:
            import torch

            if torch.cuda.is_available():
                budget_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        if budget_bytes is None:
            return max(b for b in range(1, min(CPU_AUTO_MICRO_BATCH, per_worker) + 1) if per_worker % b == 0)
        best = self.fitting_micro_batch(budget_bytes, world, vocab_size)
        if best < 1:
            raise UserError(f"micro_batch=auto: not even 1 sequence of {self.seq_length} tokens fits "
                            f"{budget_bytes / 1024**3:.1f} GiB (estimate {self.step_memory(1, vocab_size).describe()})")
        return best

    def resolved(self, world_size: int | None = None, budget_bytes: int | None = None,
                 vocab_size: int | None = None) -> "TrainConfig":
        """This config with ``micro_batch: auto`` replaced by :meth:`auto_micro_batch` (itself when an integer)."""
        if self.micro_batch != AUTO:
            return self
        batch = self.auto_micro_batch(world_size, budget_bytes, vocab_size)
        return self.model_copy(update={"micro_batch": batch})

    def batch_plan(self, world_size: int) -> tuple[int, int]:
        """``(global_batch_sequences, grad_accum_steps)`` for ``world_size`` workers; UserError if it doesn't divide.
        ``micro_batch: auto`` is resolved first (:meth:`auto_micro_batch`)."""
        global_batch = self.tokens_per_step // self.seq_length
        micro_batch = self.auto_micro_batch(world_size) if self.micro_batch == AUTO else self.micro_batch
        per_micro = micro_batch * world_size
        if global_batch % per_micro:
            raise UserError(
                f"tokens_per_step={self.tokens_per_step} gives {global_batch} sequences of {self.seq_length}, "
                f"not a multiple of micro_batch={micro_batch} x workers={world_size}; adjust one of them")
        return global_batch, global_batch // per_micro

    def check_fits_data(self, vocab_size: int, min_tokens: int, described: str) -> None:
        """Refuse (one UserError line) data this config cannot train on: a split shorter than ``seq_len + 1`` tokens,
        or a vocabulary the model cannot be built for. The arguments are what opening the data told
        (``DataSource.vocab_size``, ``min_tokens()``, ``describe()``): whoever opened it checks, and nothing
        opens it again for this."""
        if min_tokens < self.seq_length + 1:
            raise UserError(f"train.seq_len={self.seq_length} does not fit the data: {described} has a split of "
                            f"{min_tokens} tokens (needs at least seq_len + 1)")
        self.gpt_config(vocab_size=vocab_size)

    def warnings(self, world_size: int | None = None) -> list[str]:
        """One line per setting that makes a run pointless or very slow (shown before it starts)."""
        out = []
        if self.warmup_steps >= self.steps:
            out.append(f"warmup_steps={self.warmup_steps} >= steps={self.steps}: the learning rate never leaves "
                       f"warm-up (it peaks at {self.lr * self.steps / max(self.warmup_steps, 1):.2g}, not lr={self.lr:g}); "
                       "lower warmup_steps")
        extra = self.val_extrapolation
        if extra is not None and not extra.lengths(self.seq_length):
            out.append(f"val_extrapolation.multiples={extra.multiples} round to no length above seq_len="
                       f"{self.seq_length}: nothing is measured; use larger multiples")
        workers = world_size or self.workers
        try:
            global_batch, accum = self.batch_plan(workers)
        except UserError:
            return out
        if accum > MANY_ACCUMULATION_STEPS:
            out.append(f"tokens_per_step={self.tokens_per_step:,} is {accum} micro-steps of micro_batch="
                       f"{global_batch // accum // workers} x {self.seq_length} tokens per worker ({workers} worker(s)) for every "
                       "optimizer step: a step will be slow; lower tokens_per_step or raise micro_batch / workers")
        return out

    def plan(self, world_size: int | None = None, num_params: int | None = None) -> str:
        """The run in one line: model, attention, steps x tokens, batch split, workers, data."""
        workers = world_size or self.workers
        global_batch, accum = self.batch_plan(workers)
        gpt = self.gpt_config()
        variant = gpt.attention_spec()
        attention = variant.name + ("" if variant.p is None else f" (p={variant.p:g})")
        if isinstance(variant, PluginSpec):
            attention += f" (plugin {variant.origin}, sha256 {variant.sha256[:12]})"
        size = f" ({num_params / 1e6:.1f}M params)" if num_params else ""
        data = self.data if isinstance(self.data, str) else f"synthetic:{self.data.get('synthetic')}"
        device = f"{self.gpus_per_worker:g} GPU" if self.gpu else f"{self.cpus_per_worker:g} CPU"
        batch = global_batch // accum // workers
        batch = f"auto (here {batch})" if self.micro_batch == AUTO else batch
        return (f"plan: {self.preset}{size} {attention}, {self.steps:,} steps x {self.tokens_per_step:,} tokens "
                f"({global_batch} x {self.seq_length}) = {self.steps * self.tokens_per_step:,} tokens; {workers} "
                f"worker(s) of {device}, micro-batch {batch}, grad accumulation {accum}; data {data}"
                + (f"; stop when {self.stop_when.describe()} (checked every {self.val_every} steps; "
                   f"{self.steps:,} is the cap)" if self.stop_when is not None else "")
                + (f"; validation also at {', '.join(map(str, self.val_extrapolation.lengths(self.seq_length)))} "
                   f"tokens every {self.val_extrapolation.every} steps" if self.val_extrapolation is not None else ""))

    def identity(self, data_fingerprint: str, vocab_size: int | None = None) -> dict:
        """What determines the trained weights: the resolved model (attention spec included; a plugin's variant by
        its plugin's sha256 too), the data by its content fingerprint, and the recipe. Execution settings
        (:data:`RUN_SETTINGS`) are left out."""
        gpt = self.gpt_config(vocab_size=vocab_size)
        variant = gpt.attention_spec()
        model = dataclasses.asdict(gpt)
        for key in ("attention", "p_train", "scale", "attn_impl"):
            model.pop(key)
        for key, default in (("position", "rope"), ("block", "gpt2"), ("original_len", None),
                             ("rope_scaling", "none"), ("rope_factor", None)):  # added later: old keys stay the same
            if model.get(key) == default:
                model.pop(key)
        if "rope_scaling" in model:  # by what it computes: yarn_paper is the yarn of older keys (ROPE_SEMANTICS)
            model["rope_scaling"] = rope_identity(model["rope_scaling"])
        model["attention"] = {"variant": get_variant(variant.name).name, "scale": variant.scale_label, "p": variant.p}
        if isinstance(variant, PluginSpec):  # the plugin's code by its bytes; a built-in variant's key is unchanged
            model["attention"]["plugin"] = variant.sha256
        elif semantics_version(variant.name) > 1:  # what it computes has changed since its first keys
            model["attention"]["semantics"] = semantics_version(variant.name)
        recipe = {k: v for k, v in self.model_dump(mode="json").items()
                  if k not in RUN_SETTINGS and k not in ("preset", "model", "attention", "p_train", "scale", "data",
                                                         "seq_len", "stop_when", "plugin", "rope_scaling",
                                                         "rope_factor", "original_len", "init_from")}
        recipe["data_seed"] = self.data_order_seed  # data_seed: seed trains what that number does
        if self.stop_when is not None:
            # The rule decides the trained weights (the step they stop at), and so does where it is checked:
            # val_every and val_tokens are run settings without a rule, part of the identity with one. steps (the cap) stays in
            # the recipe: it sets the learning-rate schedule. A config without a rule keeps its old key.
            recipe["stop_when"] = {**self.stop_when.model_dump(mode="json", exclude_none=True),
                                   "every": self.val_every, "val_tokens": self.val_tokens}
        identity = {"model": model, "data": str(data_fingerprint), "recipe": recipe}
        if self.init_from is not None:  # a stage: its parent's identity, and the step whose weights it starts from
            identity["parent"] = {"train_key": self.init_from.train_key, "step": self.init_from.step}
        return identity

    def train_key(self, data_fingerprint: str, vocab_size: int | None = None) -> str:
        """The training run's identity (16 hex digits): names its run folder, goes into its provenance and into
        every results row (``train_key``). Two configs with the same key train the same weights: the same
        computation (what each attention variant and RoPE scaling computes carries a version,
        :data:`ATTENTION_SEMANTICS` and :data:`attnlab.names.ROPE_SEMANTICS`, raised when it changes), so on one
        machine and one build of torch the same bits. Across CPUs the promise is weaker: float32 rounds by the
        kernel path (torch's CPU capability, AVX2 or AVX512, recorded in provenance), and LSSAR's sharpening
        amplifies the difference step by step into another draw (proxy_text's LSSAR seed 3: 2.0515 at 16x on the
        AVX512 path, 2.0198 on AVX2, five seeds' spread; softmax seed 4: 2.4119 and 2.4113): a key then names the same
        training, not the same weights (docs/stages.md#identity-and-reuse)."""
        payload = json.dumps(self.identity(data_fingerprint, vocab_size), sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def load_train_config(fields: dict[str, Any] | None = None, **overrides) -> TrainConfig:
    """Build a TrainConfig from a dict (e.g. a YAML file) plus overrides, raising UserError on bad fields."""
    merged = {**(fields or {}), **{k: v for k, v in overrides.items() if v is not None}}
    return parse(TrainConfig, merged, prefix="train")


__all__ = ["InitFrom", "TrainConfig", "load_train_config", "pydantic"]
