"""Measuring: a model, a data source and evaluation cells in, scores out. No rows, no store, no Ray here.

For every ``windows`` cell the validation windows of that length (``data.eval_set``) are scored with
:func:`attnlab.model.scoring.window_token_stats` (the function training's validation uses, so the two agree
exactly): summed cross-entropy, correct argmax predictions, UTF-8 bytes of the scored tokens (GPT-2 text) and
per-position-bucket sums. ``passkey`` cells give passkey records (:mod:`attnlab.evaluate.passkey`),
``diagnostics`` cells per-layer attention statistics (:mod:`attnlab.evaluate.diagnostics`), the ``force`` cell
of an orbit model its force probe and recovered law (:mod:`attnlab.evaluate.force_probe`), ``downstream`` cells
lm-evaluation-harness task scores (:mod:`attnlab.evaluate.downstream`; one harness run per length, RoPE scaling
and p_eval scores all of its tasks). Coordinate tokens
(orbits) also sum the distance between the predicted and the target bins. p_eval is the
attention spec passed to the forward; the weights are never touched, and a compiled model compiles no graph per
p_eval (the model hands the power to the attention as a tensor: one graph per length and sharpening mode). At L <= train_len no RoPE scaling changes
anything, and a model without RoPE (position nope/alibi) ignores the scaling, so identical forwards (same
:func:`attnlab.model.rope.forward_key` and p) are computed once; each cell still records its own rope_scaling.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from attnlab.errors import UserError
from attnlab.evaluate.plan import EvalCell
from attnlab.model.rope import forward_key
from attnlab.model.scoring import window_token_stats

BUCKETS = ("early", "middle", "late")
# Sequences per batch at the training length; longer windows get proportionally fewer (>= 1).
DEFAULT_BATCH_AT_TRAIN_LEN = 8


def text_tokenizer(source):
    """The tokeniser of a prepared text source (:class:`attnlab.data.tokenizer.Tokenizer`), or None for a probe task
    or an unknown tokeniser: text sources get bits per byte, from the tokeniser's bytes per token."""
    from attnlab.data.tokenizer import tokenizer_of_manifest

    shards = getattr(source, "shards", None)
    return None if shards is None else tokenizer_of_manifest(shards.manifest)


def bucket_bounds(length: int) -> list[tuple[str, int, int]]:
    """``(name, start, stop)`` of the early / middle / late thirds of window positions ``0 .. length-1``."""
    cuts = [0, length // 3, 2 * length // 3, length]
    return [(name, cuts[i], cuts[i + 1]) for i, name in enumerate(BUCKETS)]


def bits_per_byte(total_nats: float, n_bytes: int) -> float:
    """Loss in bits (nats / ln 2) per UTF-8 byte of the scored text."""
    return total_nats / math.log(2) / n_bytes if n_bytes > 0 else float("nan")


@dataclass
class WindowScores:
    """Sums over all scored target tokens of a set of windows (what the rows are computed from)."""

    length: int
    total: float = 0.0  # summed cross-entropy, nats
    count: int = 0
    correct: int = 0
    n_bytes: int = 0
    masked: bool = False  # scored only target-mask positions (a probe)
    distance: float | None = None  # coordinate tokens: summed distance between predicted and target bins
    bin_width: float | None = None  # coordinate tokens: the bins' width in the data's unit (AU for orbits)
    bucket_total: list = dataclasses.field(default_factory=lambda: [0.0] * len(BUCKETS))
    bucket_count: list = dataclasses.field(default_factory=lambda: [0] * len(BUCKETS))

    @property
    def loss(self) -> float:
        return self.total / max(self.count, 1)

    @property
    def acc(self) -> float:
        return self.correct / max(self.count, 1)

    @property
    def coord_err(self) -> float | None:
        """Mean distance (bins) between the predicted and the target coordinate bins; None for text."""
        return None if self.distance is None else self.distance / max(self.count, 1)

    def add(self, loss: torch.Tensor, correct: torch.Tensor, targets: np.ndarray, keep: np.ndarray | None,
            token_bytes: np.ndarray | None, distance: torch.Tensor | None = None) -> None:
        """Accumulate one batch: ``loss``/``correct``/``distance`` ``(b, L)``, ``targets`` ``(b, L)``, ``keep``
        mask or None."""
        keep_t = None if keep is None else torch.as_tensor(keep, dtype=torch.bool)
        if distance is not None:
            kept = distance if keep_t is None else distance[keep_t]
            self.distance = (self.distance or 0.0) + float(kept.double().sum())
        if keep_t is None:
            self.total += float(loss.double().sum())  # as scoring.mean_window_loss sums, for exact agreement
            self.count += loss.numel()
            self.correct += int(correct.sum())
        else:
            self.masked = True
            self.total += float(loss[keep_t].double().sum())
            self.count += int(keep_t.sum())
            self.correct += int(correct[keep_t].sum())
        if token_bytes is not None:
            counted = token_bytes[targets] if keep is None else token_bytes[targets][keep]
            self.n_bytes += int(counted.sum())
        for i, (_, a, b) in enumerate(bucket_bounds(self.length)):
            part = loss[:, a:b]
            if keep_t is None:
                self.bucket_total[i] += float(part.double().sum())
                self.bucket_count[i] += part.numel()
            else:
                self.bucket_total[i] += float(part[keep_t[:, a:b]].double().sum())
                self.bucket_count[i] += int(keep_t[:, a:b].sum())


def score_windows(model, windows: np.ndarray, target_mask: np.ndarray | None = None, *,
                  token_bytes: np.ndarray | None = None, batch_size: int = 8, device=None,
                  precision: str = "auto", **forward_kwargs) -> WindowScores:
    """Score windows ``(n, L + 1)`` (inputs ``[:, :-1]``, targets ``[:, 1:]``), counting only ``target_mask``
    positions when given."""
    windows = np.asarray(windows, dtype=np.int64)
    scores = WindowScores(length=windows.shape[1] - 1)
    for r0, loss, correct, distance in window_token_stats(model, windows, batch_size=batch_size, device=device,
                                                          precision=precision, **forward_kwargs):
        rows = slice(r0, r0 + len(loss))
        keep = None if target_mask is None else np.asarray(target_mask[rows], dtype=bool)
        scores.add(loss, correct, windows[rows, 1:], keep, token_bytes, distance)
    return scores


def attention_spec_for(model, p_eval):
    """The attention of a p_eval cell: as trained (None), or the trained variant with sharpening power p."""
    try:
        return model.cfg.attention_spec(p="train" if p_eval is None else p_eval)
    except ValueError as exc:
        raise UserError(f"p_eval={p_eval!r}: {exc}") from None


def measure(model, source, cells: Iterable[EvalCell], *, device: torch.device, precision: str = "auto",
            batch_size: int | None = None, batch_at_train_len: int = DEFAULT_BATCH_AT_TRAIN_LEN,
            data_seed: int = 0, log: Callable[[str], None] | None = None,
            downstream=None) -> Iterator[tuple[EvalCell, object]]:
    """Yield ``(cell, scores)`` for each cell that has data, as it is measured; a cell without windows is skipped
    (with a log line). ``scores``: :class:`WindowScores` (windows), a list of passkey records (passkey), a list of
    per-layer statistics (diagnostics), ``[(metric, value, stderr, documents), ...]`` (downstream; ``downstream``:
    the :class:`attnlab.evaluate.plan.DownstreamConfig` saying where the tasks are)."""
    say = log or (lambda message: None)
    gpt = model.cfg
    train_len = int(gpt.train_len)
    tokenizer = text_tokenizer(source)
    token_bytes = None if tokenizer is None else tokenizer.token_bytes()
    windows_cache: dict = {}
    forwards: dict = {}  # (mode, length, RoPE forward key, p) -> WindowScores: any scaling == none at L <= train_len
    cells = list(cells)
    tasks = _DownstreamRuns(model, cells, downstream, device=device, precision=precision, say=say)

    def windows_at(cell: EvalCell):
        key = (cell.window_mode, cell.length, cell.max_tokens)
        if key not in windows_cache:
            windows_cache.clear()  # one length at a time: 16x windows are the largest arrays here
            windows, mask = source.eval_set(cell.length, max_tokens=cell.max_tokens,
                                            long_docs=cell.window_mode == "long_docs", seed=data_seed)
            windows = np.asarray(windows)[: cell.max_tokens // cell.length]
            mask = None if mask is None else np.asarray(mask)[: len(windows)]
            windows_cache[key] = (windows, mask)
        return windows_cache[key]

    for cell in cells:
        batch = batch_size or max(1, batch_at_train_len * train_len // cell.length)
        spec = attention_spec_for(model, cell.p_eval)
        if cell.kind == "passkey":
            yield cell, _passkey(model, cell, spec, device=device, precision=precision, batch=batch, say=say)
            continue
        if cell.kind == "force":
            yield cell, _force_probe(model, source, cell, device=device, say=say)
            continue
        if cell.kind == "downstream":
            yield cell, tasks.scores(cell, spec, batch)
            continue
        windows, mask = windows_at(cell)
        if len(windows) == 0 and cell.window_mode == "nonoverlap":
            raise UserError(f"lengths: {cell.length} does not fit one window in the validation split of "
                            f"{source.describe()}; use shorter lengths or more validation data")
        if len(windows) == 0:
            say(f"eval: no {cell.window_mode} windows of {cell.length} tokens in {source.describe()}; skipped")
            continue
        if cell.kind == "diagnostics":
            from attnlab.evaluate.diagnostics import attention_diagnostics

            yield cell, attention_diagnostics(model, windows[: cell.extra[0]], spec=spec, rope_scaling=cell.rope,
                                              device=device, precision=precision)
            continue
        key = (cell.window_mode, cell.length, _rope_key(gpt, cell), cell.p_eval)
        if key not in forwards:
            forwards[key] = score_windows(model, windows, mask, token_bytes=token_bytes, batch_size=batch,
                                          device=device, precision=precision, rope_scaling=cell.rope, attention=spec)
            forwards[key].bin_width = getattr(source, "bin_width", None)
        yield cell, forwards[key]


def _rope_key(gpt, cell: EvalCell) -> tuple:
    """What the cell's forward depends on through positions (:func:`attnlab.model.rope.forward_key`): every
    scaling equals none up to the training length, and a model without RoPE ignores the scaling."""
    return forward_key(cell.rope, gpt.rope_base, gpt.head_dim, cell.length, int(gpt.train_len),
                       getattr(gpt, "position", "rope"), getattr(gpt, "trained_scaling", None))


class _DownstreamRuns:
    """Harness runs shared by downstream cells: one per (length, RoPE forward key, p_eval, few-shot, limit) scores
    every task of the cells with those settings (every scaling equals none at lengths up to the training length)."""

    def __init__(self, model, cells: list[EvalCell], config, *, device, precision, say):
        self.model, self.config, self.device, self.precision, self.say = model, config, device, precision, say
        self.cells = [c for c in cells if c.kind == "downstream"]
        self.runs: dict = {}
        self.task_set = None

    def _group(self, cell: EvalCell):
        return (cell.length, _rope_key(self.model.cfg, cell), cell.p_eval, cell.extra[1], cell.extra[2])

    def scores(self, cell: EvalCell, spec, batch: int) -> list:
        from attnlab.evaluate.downstream import open_tasks, run_tasks

        if self.config is None:
            raise UserError("eval.downstream: downstream cells need the downstream settings (tasks, data)")
        group = self._group(cell)
        if group not in self.runs:
            tasks = sorted({c.extra[0] for c in self.cells if self._group(c) == group})
            self.say(f"eval: lm-evaluation-harness: {', '.join(tasks)} at L={cell.length} rope={cell.rope}")
            with open_tasks(tasks, self.config.data) as task_set:
                self.runs[group] = run_tasks(self.model, task_set, tasks, length=cell.length, rope_scaling=cell.rope,
                                             attention=spec, num_fewshot=cell.extra[1], limit=cell.extra[2],
                                             device=self.device, precision=self.precision, batch_size=batch,
                                             say=self.say)
        return self.runs[group][cell.extra[0]]


def _force_probe(model, source, cell: EvalCell, *, device, say):
    """The force probe of an orbit model and the law recovered from it (:mod:`attnlab.evaluate.force_probe`)."""
    from attnlab.evaluate.force_probe import finetune_force_probe, linear_force_probe
    from attnlab.evaluate.plan import ForceProbeConfig

    if not hasattr(source, "probe_set") or not hasattr(model, "coord_stats"):
        raise UserError("eval.force_probe: needs a model trained on orbits (train.data: {synthetic: orbits}); "
                        "drop force_probe for other data")
    probe = ForceProbeConfig(**dict(cell.extra))
    say(f"eval: force probe ({probe.kind}) on {probe.n_train} + {probe.n_test} two-body sequences of "
        f"{cell.length} tokens, then symbolic regression")
    common = dict(seq_len=cell.length, n_train=probe.n_train, n_test=probe.n_test, test_shots=probe.test_shots,
                  seed=probe.seed, n_points=probe.n_points, sr_kwargs=probe.sr_kwargs(), device=device,
                  batch_size=probe.batch_size)
    if probe.kind == "finetune":
        return finetune_force_probe(model, source, steps=probe.steps, lr=probe.lr, **common)
    return linear_force_probe(model, source, alpha=probe.alpha, **common)


def _passkey(model, cell: EvalCell, spec, *, device, precision, batch, say) -> list[dict]:
    from attnlab.evaluate.passkey import DEFAULT_DEPTHS, DEFAULT_DISTRACTORS, min_prompt_length, model_logprob
    from attnlab.evaluate.passkey import passkey_accuracy
    from attnlab.names import GPT2_VOCAB

    if model.cfg.vocab_size != GPT2_VOCAB:
        raise UserError("passkey: needs a model trained on GPT-2 tokenised text (the prompt is English); "
                        "drop passkey for probe tasks")
    if cell.length < min_prompt_length():
        say(f"passkey: length {cell.length} is shorter than the passkey prompt ({min_prompt_length()} tokens); "
            "skipped")
        return []
    logprob = model_logprob(model, rope_scaling=cell.rope, attention=spec, device=device, precision=precision,
                            batch_size=batch)
    # The same prompts for every checkpoint (seed 0): configurations compare on equal ground.
    return passkey_accuracy(logprob, [cell.length], depths=DEFAULT_DEPTHS, trials=cell.extra[0],
                            n_distractors=DEFAULT_DISTRACTORS, seed=0)


__all__ = ["BUCKETS", "WindowScores", "attention_spec_for", "bits_per_byte", "bucket_bounds", "measure", "score_windows", "text_tokenizer"]
