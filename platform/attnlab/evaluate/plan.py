"""What to evaluate: the typed evaluation config, and the cells it expands into, each with its own identity.

``EvalConfig`` is the one evaluation configuration: a study file's ``eval:`` block is one, and ``attnlab eval``
builds one from its flags. For a model trained at ``train_len`` it expands into :class:`EvalCell`\\ s, one per
(kind, length, p_eval, RoPE scaling, window mode): ``windows`` cells give val_loss / acc / bpb / loss buckets,
``passkey`` cells passkey accuracy, ``diagnostics`` cells per-layer attention entropy and sink mass, and a
``force`` cell (orbit models, ``force_probe:``) the force probe and the law recovered from it
(:mod:`attnlab.evaluate.force_probe`).

A cell's key (:meth:`EvalCell.key`) hashes the training run's key, the checkpoint step, the evaluation data's
fingerprint and everything that changes the cell's numbers (length, p_eval, rope, window mode, token budget,
passkey trials); every results row carries it (``eval_key``), so adding a p_eval value, a length or a RoPE
setting to a study evaluates only the new cells, and re-running an unchanged study evaluates nothing.

Token budget (docs/protocol.md#evaluation): ``max_tokens`` target tokens at every length, whatever the
device (default :data:`DEFAULT_EVAL_TOKENS`): ``max_tokens // L`` non-overlapping windows at length ``L`` (fewer
when the validation split runs out; each row records ``n_tokens``). With lengths that are powers of two times
the training length and a power-of-two budget, every length scores the same tokens.

No Ray, no torch here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from attnlab.names import DEFAULT_MULTIPLES, ROPE_SCALINGS, is_none_word, parse_length, parse_optional_number

DEFAULT_EVAL_TOKENS = 2**18  # target tokens scored at every length unless a study or --max-tokens says otherwise
WINDOW_MODES = ("nonoverlap", "long_docs")
CELL_KINDS = ("windows", "passkey", "diagnostics", "force")


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


class EvalConfig(BaseModel):
    """The evaluation of one trained checkpoint at several lengths x p_eval x RoPE scaling."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    multiples: list[float] | None = None  # multiples of the training length (default 1, 2, 4, 8, 16)
    lengths: list[int] | None = None  # or lengths in tokens
    # p_eval: none = the attention exactly as trained (an LSSAR model keeps its p); a number = that sharpening
    # power at evaluation, replacing p_train (the weights are never touched)
    p_eval: list[float | None] = Field(default_factory=lambda: [None])
    rope_scaling: list[Literal["ntk", "none"]] = Field(default_factory=lambda: ["ntk"])
    max_tokens: int = Field(default=DEFAULT_EVAL_TOKENS, gt=0)
    long_docs: bool = False  # also windows inside documents of at least L + 1 tokens (window_mode long_docs)
    passkey: bool = False
    passkey_trials: int = Field(default=4, gt=0)
    diagnostics: bool = False
    diagnostic_windows: int = Field(default=2, gt=0)
    force_probe: ForceProbeConfig | None = None  # orbit models: the force probe + symbolic regression
    batch_size: int | None = Field(default=None, gt=0)  # windows per forward; how, not what: not in any key
    compile: bool | None = None  # torch.compile the model (None: on for CUDA, off on CPU); not in any key

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
            out += list(ROPE_SCALINGS) if item == "both" else [item]
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
        for mode in modes:
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
        return out


@dataclass(frozen=True)
class EvalCell:
    """One measured cell: what kind, at which length, with which p_eval, RoPE scaling, window mode and budget."""

    kind: str  # windows | passkey | diagnostics | force
    length: int
    p_eval: float | None
    rope: str
    window_mode: str
    max_tokens: int
    extra: tuple = ()  # passkey: (trials,); diagnostics: (windows,); force: the probe's settings as (name, value)

    def key(self, train_key: str, step: int, data_fingerprint: str) -> str:
        """The cell's identity (16 hex digits) for this checkpoint and evaluation data."""
        payload = [train_key, int(step), str(data_fingerprint), self.kind, self.length, self.p_eval, self.rope,
                   self.window_mode, self.max_tokens, list(self.extra)]
        return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]

    def describe(self) -> str:
        p = "none" if self.p_eval is None else f"{self.p_eval:g}"
        return f"{self.kind} L={self.length} mode={self.window_mode} rope={self.rope} p_eval={p}"


def p_eval_label(p) -> str:
    return "none" if is_none_word(p) else f"{float(p):g}"


__all__ = ["CELL_KINDS", "DEFAULT_EVAL_TOKENS", "EvalCell", "EvalConfig", "ForceProbeConfig", "WINDOW_MODES", "p_eval_label"]
