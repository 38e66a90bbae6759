"""What to evaluate: the typed evaluation config, and the cells it expands into, each with its own identity.

Owns :class:`EvalConfig`, the one evaluation configuration (a study file's ``eval:`` block is one, ``attnlab
eval`` builds one from its flags) with its defaults (:data:`DEFAULT_EVAL_TOKENS` target tokens at every length,
whatever the device), and :class:`EvalCell`: one per (kind, length, p_eval, RoPE scaling, window mode), of the kinds
``windows``, ``passkey``, ``diagnostics``, ``force`` and ``downstream``. A cell's key (:meth:`EvalCell.key`, the
rows' ``eval_key``) hashes the training run's key, the checkpoint step, the evaluation data's fingerprint and
everything that changes the cell's numbers, so a study re-run measures only cells with no rows.

Whatever changes a cell's numbers must be in its key. ``during_training`` is no cell: the training run measures it
(:class:`attnlab.runfolder.ValExtrapolation`). This module must never import Ray or torch, nor measure anything:
that is :mod:`attnlab.evaluate.measure`'s.

Details: docs/protocol.md#evaluation (the cells and their keys), docs/protocol.md#token-budget,
docs/protocol.md#steps-and-identities.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from attnlab.names import check_scaling, rope_identity
from attnlab.names import DEFAULT_MULTIPLES, ROPE_BOTH, is_none_word, parse_length, parse_optional_number
from attnlab.runfolder import ValExtrapolation

DEFAULT_EVAL_TOKENS = 2**18  # target tokens scored at every length unless a study or --max-tokens says otherwise
WINDOW_MODES = ("nonoverlap", "long_docs")
CELL_KINDS = ("windows", "passkey", "diagnostics", "force", "downstream")


class ForceProbeConfig(BaseModel):
    """The orbit study's force probe (docs/orbits.md): Vafa et al.'s fine-tuned force head (``finetune``) or a
    ridge probe on frozen hidden states (``linear``), on two-body sequences of the training length, then
    symbolic regression of the predicted forces against (r, m1, m2). Vafa et al.: n_train 9000, n_test 1000,
    10,000 steps at batch 64; symbolic regression on 1000 points with 3 restarts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["finetune", "linear"] = "finetune"
    n_train: int = Field(default=256, gt=0)  # two-body sequences whose every planet token is a target
    n_test: int = Field(default=64, gt=0)  # held-out sequences (test_shots planet tokens of each are targets too)
    test_shots: int = Field(default=2, ge=0)
    steps: int = Field(default=300, gt=0)  # finetune: AdamW steps
    batch_size: int = Field(default=16, gt=0)
    lr: float = Field(default=3e-4, gt=0)
    alpha: float = Field(default=1.0, ge=0)  # linear: ridge penalty
    n_points: int = Field(default=1000, ge=10)  # symbolic regression: points (a random subsample)
    restarts: int = Field(default=3, gt=0)
    population: int = Field(default=1000, ge=10)
    generations: int = Field(default=20, gt=0)
    seed: int = Field(default=0, ge=0)

    def sr_kwargs(self) -> dict:
        return dict(restarts=self.restarts, population=self.population, generations=self.generations)


class DownstreamConfig(BaseModel):
    """lm-evaluation-harness tasks (docs/downstream.md): a study's ``eval.downstream: [task, ...]`` or the full
    form. ``data``: a folder (path or s3:// / gs:// URI) of task configs in the harness's YAML format with their
    data files, prepared ahead (paths in a task's YAML are relative to that folder); tasks not found there are
    the harness's own (their data must already be in the ``datasets`` cache when ``HF_DATASETS_OFFLINE=1``).
    Each task is scored at ``lengths`` tokens of context (default: the training length), for every
    ``eval.rope_scaling`` and ``eval.p_eval``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tasks: list[str]
    data: str | None = None  # where the tasks' configs and data are (how, not what: not in any key)
    num_fewshot: int = Field(default=0, ge=0)
    limit: int | None = Field(default=None, gt=0)  # at most this many documents per task (a quick look)
    lengths: list[int] | None = None  # context lengths in tokens (default: the training length)
    multiples: list[float] | None = None  # or multiples of the training length

    @model_validator(mode="after")
    def _one_way(self) -> DownstreamConfig:
        if self.lengths is not None and self.multiples is not None:
            raise ValueError("give lengths or multiples, not both")
        if self.multiples is not None and (not self.multiples or any(m <= 0 for m in self.multiples)):
            raise ValueError("multiples must be > 0")
        return self

    @field_validator("tasks", mode="before")
    @classmethod
    def _tasks(cls, value):
        items = [t.strip() for t in value.split(",")] if isinstance(value, str) else value
        if not isinstance(items, list) or not items or not all(isinstance(t, str) and t.strip() for t in items):
            raise ValueError("give task names, e.g. [hellaswag, arc_easy, lambada_openai]")
        items = [t.strip() for t in items]
        if len(set(items)) != len(items):
            raise ValueError(f"tasks={items} repeats a task")
        return items

    @field_validator("data")
    @classmethod
    def _data(cls, value):
        import os

        if value is None or "://" in value:
            return value
        return os.path.abspath(os.path.expanduser(value))  # a study's evaluation task may run in another folder

    @field_validator("lengths", mode="before")
    @classmethod
    def _lengths(cls, value):
        if value is None:
            return None
        out = []
        for item in value if isinstance(value, list) else [value]:
            length = parse_length(item)
            if length is None or length < 1:
                raise ValueError(f"{item!r} is not a positive length (use e.g. 1024 or 1k)")
            out.append(length)
        if len(set(out)) != len(out):
            raise ValueError(f"lengths={out} repeats a value")
        return sorted(out)

    def eval_lengths(self, train_len: int) -> list[int]:
        if self.multiples is not None:
            return sorted({int(round(m * train_len)) for m in self.multiples})
        return self.lengths or [int(train_len)]


class EvalConfig(BaseModel):
    """The evaluation of one trained checkpoint at several lengths x p_eval x RoPE scaling."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    multiples: list[float] | None = None  # multiples of the training length (default 1, 2, 4, 8, 16)
    lengths: list[int] | None = None  # or lengths in tokens
    # p_eval: none = the attention exactly as trained (an LSSAR model keeps its p); a number = that sharpening
    # power at evaluation, replacing p_train (the weights are never touched)
    p_eval: list[float | None] = Field(default_factory=lambda: [None])
    # RoPE scalings (names.ROPE_SCALINGS: ntk, none, pi, yarn, yarn_paper, dynamic:F; both = ntk and none), each a
    # cell without retraining; a model without RoPE (position nope/alibi) ignores it and records it as given
    rope_scaling: list[str] = Field(default_factory=lambda: ["ntk"])
    max_tokens: int = Field(default=DEFAULT_EVAL_TOKENS, gt=0)
    long_docs: bool = False  # also windows inside documents of at least L + 1 tokens (window_mode long_docs)
    passkey: bool = False
    passkey_trials: int = Field(default=4, gt=0)
    diagnostics: bool = False
    diagnostic_windows: int = Field(default=2, gt=0)
    force_probe: ForceProbeConfig | None = None  # orbit models: the force probe + symbolic regression
    downstream: DownstreamConfig | None = None  # lm-evaluation-harness tasks (a list of names, or the full form)
    windows: bool = True  # false: no validation-window cells (e.g. `attnlab eval --downstream` alone)
    batch_size: int | None = Field(default=None, gt=0)  # windows per forward; how, not what: not in any key
    compile: bool | None = None  # torch.compile the model (None: on for CUDA, off on CPU); not in any key
    # validation loss at longer lengths while each run trains, e.g. {multiples: [2, 4, 8], every: 100}: copied into
    # every trial's training config (val_extrapolation), lines in its metrics.jsonl, not cells; not in any key
    during_training: ValExtrapolation | None = None

    @field_validator("lengths", mode="before")
    @classmethod
    def _lengths(cls, value):
        if value is None:
            return None
        items = value if isinstance(value, list) else [value]
        out = []
        for item in items:
            length = parse_length(item)
            if length is None or length < 1:
                raise ValueError(f"{item!r} is not a positive length (use e.g. 1024 or 1k)")
            out.append(length)
        return out

    @field_validator("downstream", mode="before")
    @classmethod
    def _downstream(cls, value):
        if isinstance(value, (list, str)):
            return {"tasks": value}
        return value

    @field_validator("p_eval", mode="before")
    @classmethod
    def _p_eval(cls, value):
        items = value if isinstance(value, list) else [value]
        out = []
        for item in items:
            if isinstance(item, str) and item.strip().lower() == "train":
                item = None  # an alias: the power trained with
            try:
                out.append(parse_optional_number(item, "p_eval", minimum=1.0))
            except ValueError as exc:
                raise ValueError(str(exc).replace("none or a number", "none (as trained) or a number")) from None
        return out

    @field_validator("rope_scaling", mode="before")
    @classmethod
    def _rope(cls, value):
        items = value if isinstance(value, list) else [value]
        out = []
        for item in items:
            if item == "both":
                out += list(ROPE_BOTH)
                continue
            try:
                out.append(check_scaling(item, "rope_scaling").label)
            except ValueError as exc:
                raise ValueError(f"{exc} (or both: ntk and none)") from None
        return out

    @model_validator(mode="after")
    def _coherent(self) -> EvalConfig:
        if self.multiples is not None and self.lengths is not None:
            raise ValueError("give multiples or lengths, not both")
        for name in ("multiples", "lengths", "p_eval", "rope_scaling"):
            value = getattr(self, name)
            if value is not None and not value:
                raise ValueError(f"{name} must not be empty")
            if value is not None and len(set(map(str, value))) != len(value):
                raise ValueError(f"{name}={value} repeats a value")
        if any(m <= 0 for m in self.multiples or []):
            raise ValueError("multiples must be > 0")
        return self

    def eval_lengths(self, train_len: int) -> list[int]:
        if self.lengths is not None:
            return sorted(self.lengths)
        multiples = self.multiples if self.multiples is not None else DEFAULT_MULTIPLES
        return sorted({int(round(m * train_len)) for m in multiples})

    def cells(self, train_len: int) -> list[EvalCell]:
        """Every cell, in the order they are measured (by length, so each length's windows load once)."""
        out = []
        modes = ["nonoverlap"] + (["long_docs"] if self.long_docs else [])
        for mode in modes if self.windows else []:
            for length in self.eval_lengths(train_len):
                for rope in self.rope_scaling:
                    for p in self.p_eval:
                        out.append(EvalCell("windows", length, p, rope, mode, self.max_tokens))
                        if self.diagnostics and mode == "nonoverlap":
                            out.append(EvalCell("diagnostics", length, p, rope, mode, self.max_tokens,
                                                (self.diagnostic_windows,)))
        if self.passkey:
            for length in self.eval_lengths(train_len):
                for rope in self.rope_scaling:
                    for p in self.p_eval:
                        out.append(EvalCell("passkey", length, p, rope, "passkey", 0, (self.passkey_trials,)))
        if self.force_probe is not None:
            probe = self.force_probe
            out.append(EvalCell("force", train_len, None, "none", f"force_{probe.kind}", 0,
                                tuple(sorted(probe.model_dump().items()))))
        if self.downstream is not None:
            down = self.downstream
            mode = "downstream" if down.num_fewshot == 0 else f"downstream_{down.num_fewshot}shot"
            for length in down.eval_lengths(train_len):
                for rope in self.rope_scaling:
                    for p in self.p_eval:
                        for task in down.tasks:
                            out.append(EvalCell("downstream", length, p, rope, mode, 0,
                                                (task, down.num_fewshot, down.limit)))
        return out


@dataclass(frozen=True)
class EvalCell:
    """One measured cell: what kind, at which length, with which p_eval, RoPE scaling, window mode and budget."""

    kind: str  # windows | passkey | diagnostics | force | downstream
    length: int
    p_eval: float | None
    rope: str
    window_mode: str
    max_tokens: int
    extra: tuple = ()  # passkey: (trials,); diagnostics: (windows,); force: the probe's settings as (name, value);
    # downstream: (task, num_fewshot, limit)

    def key(self, train_key: str, step: int, data_fingerprint: str) -> str:
        """The cell's identity (16 hex digits) for this checkpoint and evaluation data."""
        payload = [train_key, int(step), str(data_fingerprint), self.kind, self.length, self.p_eval, rope_identity(self.rope),
                   self.window_mode, self.max_tokens, list(self.extra)]
        return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]

    def describe(self) -> str:
        p = p_eval_label(self.p_eval)
        if self.kind == "downstream":
            return f"downstream {self.extra[0]} L={self.length} rope={self.rope} p_eval={p}"
        return f"{self.kind} L={self.length} mode={self.window_mode} rope={self.rope} p_eval={p}"


def p_eval_label(p) -> str:
    return "none" if is_none_word(p) else f"{float(p):g}"


__all__ = ["CELL_KINDS", "DEFAULT_EVAL_TOKENS", "DownstreamConfig", "EvalCell", "EvalConfig", "ForceProbeConfig", "WINDOW_MODES", "p_eval_label"]
