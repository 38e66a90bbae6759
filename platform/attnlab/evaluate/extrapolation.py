"""Extrapolation evaluation of one checkpoint: validation loss at 1x..16x the training length, for every
evaluation-time sharpening power ``p_eval`` and RoPE scaling, as results-store rows.

Protocol (SPEC.md section 7), recorded in every row:

- **Windows**: non-overlapping windows of L tokens over the validation split (``data.eval_set``), each
  target token scored exactly once; ``window_mode="nonoverlap"``, or ``"long_docs"`` (only windows inside
  documents of at least L + 1 tokens).
- **Same token budget at every length**: ``max_tokens`` (default: everything the largest length allows,
  capped at :data:`CPU_MAX_TOKENS` on CPU / :data:`CUDA_MAX_TOKENS` on CUDA, a multiple of the largest
  length) is cut into ``max_tokens // L`` whole windows at each length L; ``n_tokens`` records the count.
- **Metrics**: ``val_loss`` (mean next-token cross-entropy, nats), ``acc`` (probes with target masks only:
  argmax accuracy on the scored positions), ``bpb`` (GPT-2 text only: the loss in bits divided by the UTF-8
  bytes of the scored tokens; the EOT separator counts 0 bytes), ``loss_bucket`` with ``bucket`` early /
  middle / late (thirds of the window positions ``[0, L//3)``, ``[L//3, 2L//3)``, ``[2L//3, L)``), optional
  passkey rows (:mod:`attnlab.evaluate.passkey`) and attention diagnostics
  (:mod:`attnlab.evaluate.diagnostics`).
- **p_eval**: ``model.cfg.attention_spec(p=p)`` passed to the forward; the weights are never touched.
  ``None`` (``none``) = no evaluation-time change: the attention exactly as trained (an LSSAR model trained with
  ``p_train = 15`` keeps its p = 15); a number = that sharpening power at evaluation, replacing ``p_train``.
  ``"train"`` is accepted as an alias of ``none``.

No Ray here (the study runner calls :func:`evaluate_checkpoint` inside its own Ray tasks).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from attnlab.errors import UserError
from attnlab.model.scoring import window_token_stats

DEFAULT_MULTIPLES = (1, 2, 4, 8, 16)
CPU_MAX_TOKENS = 2**17  # default token budget per length on CPU
CUDA_MAX_TOKENS = 2**22  # default token budget per length on CUDA
BUCKETS = ("early", "middle", "late")
WINDOW_MODES = ("nonoverlap", "long_docs")
ROPE_CHOICES = ("ntk", "none")
DEFAULT_STUDY = "adhoc"
# Sequences per batch at the training length; longer windows get proportionally fewer (>= 1).
DEFAULT_BATCH_AT_TRAIN_LEN = 8


# ---------------------------------------------------------------------------------------- parsing
def parse_lengths(value) -> list[int]:
    """Evaluation lengths from ``"1024,2048"``, ``"1k,2k"`` or an iterable of ints; sorted, de-duplicated."""
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",")]
    elif isinstance(value, Iterable):
        items = list(value)
    else:
        items = [value]
    if not items or items == [""]:
        raise UserError("lengths: give at least one evaluation length, e.g. --lengths 1024,2048")
    out = set()
    for item in items:
        length = _parse_length(item)
        if length is None or length < 1:
            raise UserError(f"lengths: {item!r} is not a positive integer length (use e.g. 1024,2048 or 1k,2k)")
        out.add(length)
    return sorted(out)


def _parse_length(item) -> int | None:
    if isinstance(item, bool):
        return None
    if isinstance(item, (int, np.integer)):
        return int(item)
    if isinstance(item, float):
        return int(item) if item.is_integer() else None
    text = str(item).strip().lower().replace("_", "")
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(k?)", text)
    if not match:
        return None
    number = float(match.group(1)) * (1024 if match.group(2) else 1)
    return int(number) if number.is_integer() else None


def parse_p_evals(value) -> list:
    """Sharpening powers from ``"none,3,15"`` or an iterable: ``None`` (as trained; ``train`` is an alias) or a
    number >= 1 applied at evaluation. Order kept, duplicates dropped."""
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    if not items:
        raise UserError("p_eval: give at least one value, e.g. --p-eval none,3,15")
    out: list = []
    for item in items:
        if item is None or (isinstance(item, str) and item.lower() in ("none", "null", "")):
            p = None
        elif isinstance(item, str) and item.lower() == "train":
            p = None
        else:
            try:
                p = float(item)
            except (TypeError, ValueError):
                raise UserError(f"p_eval: {item!r} is not allowed; use none, train or a number >= 1") from None
            if isinstance(item, bool) or not math.isfinite(p) or p < 1:
                raise UserError(f"p_eval: {item!r} is not allowed; use none, train or a number >= 1")
        if p not in out:
            out.append(p)
    return out


def parse_rope_scalings(value) -> list[str]:
    """``"ntk"``, ``"none"``, ``"both"``, ``"ntk,none"`` or an iterable of those."""
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    out: list[str] = []
    for item in items:
        names = list(ROPE_CHOICES) if item == "both" else [item]
        for name in names:
            if name not in ROPE_CHOICES:
                raise UserError(f"rope: {item!r} is not allowed; use ntk, none or both")
            if name not in out:
                out.append(name)
    if not out:
        raise UserError("rope: give ntk, none or both")
    return out


# ---------------------------------------------------------------------------------------- window scoring
@functools.lru_cache(maxsize=1)
def gpt2_token_bytes() -> np.ndarray:
    """UTF-8 byte length of every GPT-2 token (int64, 50257 entries); the EOT separator counts 0 bytes."""
    from attnlab.data.tokenizer import EOT_ID, get_encoding

    enc = get_encoding()
    lengths = np.array([len(enc.decode_single_token_bytes(i)) for i in range(enc.n_vocab)], dtype=np.int64)
    lengths[EOT_ID] = 0
    return lengths


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
    bucket_total: list = dataclasses.field(default_factory=lambda: [0.0] * len(BUCKETS))
    bucket_count: list = dataclasses.field(default_factory=lambda: [0] * len(BUCKETS))

    @property
    def loss(self) -> float:
        return self.total / max(self.count, 1)

    @property
    def acc(self) -> float:
        return self.correct / max(self.count, 1)

    def add(self, loss: torch.Tensor, correct: torch.Tensor, targets: np.ndarray, keep: np.ndarray | None,
            token_bytes: np.ndarray | None) -> None:
        """Accumulate one batch: ``loss``/``correct`` ``(b, L)``, ``targets`` ``(b, L)``, ``keep`` mask or None."""
        keep_t = None if keep is None else torch.as_tensor(keep, dtype=torch.bool)
        if keep_t is None:
            self.total += float(loss.double().sum())  # as core.mean_window_loss sums, for exact agreement
            self.count += loss.numel()
            self.correct += int(correct.sum())
        else:
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
    """Score windows ``(n, L + 1)`` (inputs ``[:, :-1]``, targets ``[:, 1:]``) with
    :func:`attnlab.model.scoring.window_token_stats`, counting only ``target_mask`` positions when given."""
    windows = np.asarray(windows, dtype=np.int64)
    scores = WindowScores(length=windows.shape[1] - 1)
    for r0, loss, correct in window_token_stats(model, windows, batch_size=batch_size, device=device,
                                                precision=precision, **forward_kwargs):
        rows = slice(r0, r0 + len(loss))
        keep = None if target_mask is None else np.asarray(target_mask[rows], dtype=bool)
        scores.add(loss, correct, windows[rows, 1:], keep, token_bytes)
    return scores


def plan_token_budget(data, lengths: list[int], max_tokens: int | None, *, long_docs: bool = False,
                      cap: int = CPU_MAX_TOKENS, seed: int = 0) -> int:
    """The number of target tokens to score at every length.

    Given ``max_tokens``: that. Otherwise what the largest length allows (its whole windows), capped at
    ``cap`` and rounded down to a multiple of the largest length, so that lengths dividing it all score the
    same tokens. UserError when the largest length does not fit a single window.
    """
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or int(max_tokens) < max(lengths):
            raise UserError(f"max_tokens={max_tokens!r} is not allowed: use at least the largest length "
                            f"({max(lengths)} tokens), so every length scores whole windows")
        return int(max_tokens)
    top = max(lengths)
    windows, _ = data.eval_set(top, max_tokens=max(cap, top), long_docs=long_docs, seed=seed)
    n = min(len(windows), max(cap, top) // top)
    if n == 0:
        what = "long documents (>= L + 1 tokens)" if long_docs else "validation split"
        raise UserError(f"lengths: the largest length {top} does not fit one window in the {what} of "
                        f"{data.describe()}; use shorter --lengths or more validation data")
    return n * top


# ---------------------------------------------------------------------------------------- checkpoint identity
@dataclass
class LoadedCheckpoint:
    """A model with the training config it came from, as ``attnlab.model.checkpoint.load_model`` returns it."""

    model: torch.nn.Module
    train_config: dict
    meta: dict

    @property
    def run_dir(self) -> Path | None:
        path = self.meta.get("checkpoint")
        if not path:
            return None
        path = Path(path)
        return path.parent.parent if path.parent.name == "checkpoints" else path.parent


def load_checkpoint(checkpoint, device) -> LoadedCheckpoint:
    """A path (checkpoint or run folder), a ``(model, train_config, meta)`` tuple, or a LoadedCheckpoint."""
    if isinstance(checkpoint, LoadedCheckpoint):
        return checkpoint
    if isinstance(checkpoint, tuple) and len(checkpoint) == 3:
        return LoadedCheckpoint(*checkpoint)
    if not isinstance(checkpoint, (str, Path)):
        raise UserError(f"checkpoint must be a checkpoint or run folder path, got {type(checkpoint).__name__}")
    from attnlab.model.checkpoint import load_model

    model, cfg, meta = load_model(checkpoint, device=device)
    return LoadedCheckpoint(model, cfg, meta)


def _config_hash(loaded: LoadedCheckpoint) -> str:
    run_dir = loaded.run_dir
    if run_dir is not None and (run_dir / "provenance.json").exists():
        try:
            return str(json.loads((run_dir / "provenance.json").read_text())["config_hash"])
        except (OSError, ValueError, KeyError):
            pass
    try:
        from attnlab.train import load_train_config

        return load_train_config(loaded.train_config).config_hash()
    except (ValueError, TypeError):
        blob = json.dumps(loaded.train_config, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _default_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"device={device!r} is not a torch device; use cpu, cuda or cuda:N") from None


def _evaluation_key(study: str, trial: str, step: int, settings: dict) -> tuple:
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return ("eval", study, trial, int(step), digest)


# ---------------------------------------------------------------------------------------- the evaluation
def evaluate_checkpoint(checkpoint, *, data=None, lengths=None, multiples=DEFAULT_MULTIPLES, p_evals=(None,),
                        rope_scalings=("ntk",), max_tokens=None, long_docs=False, passkey=False,
                        diagnostics=False, batch_size=None, device=None, context=None, store=None, key=None,
                        passkey_trials: int = 4, passkey_depths=None, passkey_distractors: int = 9,
                        diagnostic_windows: int = 2, log: Callable[[str], None] | None = None) -> list[dict]:
    """Evaluate one checkpoint at several lengths x ``p_evals`` x ``rope_scalings``; return results rows.

    ``checkpoint``: a checkpoint folder, a run folder (its latest checkpoint), or an already loaded
    ``(model, train_config, meta)``. ``data``: a prepared folder or a probe spec (default: the training data).
    ``lengths`` (default ``multiples`` x the training length); ``max_tokens``: the token budget at every
    length (see :func:`plan_token_budget`). ``context``: row fields the caller fixes (``study`` defaults to
    ``"adhoc"``, ``trial`` to the run folder name; also seed, config_hash, git_sha, ...). ``store``: a
    ``ResultsStore`` (or URI) to write the rows to, under ``key`` (default ``("eval", study, trial, step,
    hash of the settings)``, so a retried evaluation replaces its file). The model's weights are never
    modified. Raises UserError on bad input.
    """
    from attnlab.provenance import git_info
    from attnlab.results.schema import COLUMN_NAMES, validate_row
    from attnlab.data.source import open_data

    say = log or (lambda message: None)
    dev = _default_device(device)
    loaded = load_checkpoint(checkpoint, dev)
    model, cfg = loaded.model, loaded.train_config
    gpt = model.cfg
    train_len = int(gpt.train_len)
    if lengths is None:
        try:
            lengths = parse_lengths([int(m) * train_len for m in multiples])
        except (TypeError, ValueError):
            raise UserError(f"multiples: {multiples!r} must be positive integers, e.g. 1,2,4,8,16") from None
    else:
        lengths = parse_lengths(lengths)
    p_list = parse_p_evals(p_evals)
    ropes = parse_rope_scalings(rope_scalings)
    context = dict(context or {})
    unknown = sorted(set(context) - set(COLUMN_NAMES))
    if unknown:
        raise UserError(f"context: {unknown[0]!r} is not a results column; allowed: {', '.join(COLUMN_NAMES)}")
    specs = {}
    for p in p_list:
        try:
            specs[p] = gpt.attention_spec(p="train" if p is None else p)
        except ValueError as exc:
            raise UserError(f"p_eval={p!r}: {exc}") from None

    data_spec = cfg.get("data") if data is None else data
    if not data_spec:
        raise UserError("data: the checkpoint's config names no data; pass --data DIR")
    source = open_data(str(data_spec) if isinstance(data_spec, Path) else data_spec)
    if getattr(source, "vocab_size", gpt.vocab_size) > gpt.vocab_size:
        raise UserError(f"data {source.describe()}: vocabulary {source.vocab_size} exceeds the model's "
                        f"{gpt.vocab_size}; evaluate on the data the model was trained on")
    shards = getattr(source, "shards", None)
    from attnlab.data.tokenizer import TOKENIZER_NAME

    is_gpt2_text = shards is not None and shards.manifest.get("tokenizer") == TOKENIZER_NAME
    token_bytes = gpt2_token_bytes() if is_gpt2_text else None
    data_seed = int(cfg.get("data_seed", 0))
    precision = cfg.get("precision", "auto")
    cap = CUDA_MAX_TOKENS if dev.type == "cuda" else CPU_MAX_TOKENS
    modes = ["nonoverlap"] + (["long_docs"] if long_docs else [])
    budgets = {"nonoverlap": plan_token_budget(source, lengths, max_tokens, cap=cap, seed=data_seed)}
    if long_docs:
        budgets["long_docs"] = _long_doc_budget(source, lengths, max_tokens, cap, data_seed, say)

    step = int(loaded.meta.get("step", 0))
    spec0 = specs[p_list[0]]
    run_dir = loaded.run_dir
    base_row = {
        "study": DEFAULT_STUDY,
        "trial": run_dir.name if run_dir is not None else "checkpoint",
        "attention": gpt.attention,
        "scale": spec0.scale_label,
        "p_train": gpt.attention_spec().p,  # the power actually trained with (lssar: 15 by default)
        "step": step,
        "tokens": step * int(cfg.get("tokens_per_step", 0)),
        "train_len": train_len,
        "seed": int(cfg.get("seed", 0)),
        "config_hash": _config_hash(loaded),
        "git_sha": git_info().get("sha") or "unknown",
        "preset": cfg.get("preset"),
        "data": source.describe(),
    }
    base_row.update(context)

    rows: list[dict] = []

    def emit(*, p, rope, length, mode, metric, value, n_tokens, bucket=None, layer=None):
        row = dict(base_row)
        row.update(p_eval=p, rope_scaling=rope, eval_len=int(length),
                   window_mode=mode, metric=metric, value=float(value), n_tokens=int(n_tokens))
        if bucket is not None:
            row["bucket"] = bucket
        if layer is not None:
            row["layer"] = int(layer)
        rows.append(row)

    from attnlab.model.rope import rope_base

    head_dim = gpt.head_dim
    for mode in modes:
        for length in lengths:
            windows, mask = source.eval_set(length, max_tokens=budgets[mode], long_docs=(mode == "long_docs"),
                                            seed=data_seed)
            windows = np.asarray(windows)[: budgets[mode] // length]
            mask = None if mask is None else np.asarray(mask)[: len(windows)]
            if len(windows) == 0:
                say(f"eval: no {mode} windows of {length} tokens in {source.describe()}; skipped")
                continue
            batch = batch_size or max(1, int(cfg.get("val_batch", DEFAULT_BATCH_AT_TRAIN_LEN)) * train_len // length)
            done: dict = {}  # NTK == none at L <= train_len: reuse identical forwards
            for rope in ropes:
                base = rope_base(rope, gpt.rope_base, head_dim, length, train_len)
                for p in p_list:
                    cache_key = (base, p)
                    if cache_key not in done:
                        say(f"eval: L={length} mode={mode} rope={rope} p_eval={p} windows={len(windows)}")
                        done[cache_key] = score_windows(
                            model, windows, mask, token_bytes=token_bytes, batch_size=batch, device=dev,
                            precision=precision, rope_scaling=rope, attention=specs[p])
                    s = done[cache_key]
                    common = dict(p=p, rope=rope, length=length, mode=mode)
                    emit(**common, metric="val_loss", value=s.loss, n_tokens=s.count)
                    if mask is not None:
                        emit(**common, metric="acc", value=s.acc, n_tokens=s.count)
                    if token_bytes is not None:
                        emit(**common, metric="bpb", value=bits_per_byte(s.total, s.n_bytes), n_tokens=s.count)
                    for i, name in enumerate(BUCKETS):
                        if s.bucket_count[i]:
                            emit(**common, metric="loss_bucket", value=s.bucket_total[i] / s.bucket_count[i],
                                 n_tokens=s.bucket_count[i], bucket=name)
                    if diagnostics and mode == "nonoverlap":
                        from attnlab.evaluate.diagnostics import attention_diagnostics

                        diag_key = ("diag", base, p)
                        if diag_key not in done:
                            done[diag_key] = attention_diagnostics(
                                model, windows[:diagnostic_windows], spec=specs[p], rope_scaling=rope,
                                device=dev, precision=precision)
                        for layer_stats in done[diag_key]:
                            for metric in ("entropy", "sink_mass"):
                                emit(**common, metric=metric, value=layer_stats[metric],
                                     n_tokens=layer_stats["n_tokens"], layer=layer_stats["layer"])

    if passkey:
        rows.extend(_passkey_rows(model, lengths, p_list, specs, ropes, gpt=gpt, dev=dev, precision=precision,
                                  base_row=base_row, trials=passkey_trials, depths=passkey_depths,
                                  distractors=passkey_distractors, batch_size=batch_size, say=say))

    for i, row in enumerate(rows):  # refuse to return rows the store would refuse
        validate_row(row, i)
    if store is not None:
        from attnlab.results.store import ResultsStore

        target = store if isinstance(store, ResultsStore) else ResultsStore(store)
        settings = dict(lengths=lengths, p_evals=p_list, ropes=ropes, budgets=budgets, long_docs=long_docs,
                        passkey=passkey, diagnostics=diagnostics, data=base_row["data"])
        write_key = key if key is not None else _evaluation_key(base_row["study"], base_row["trial"], step,
                                                                 settings)
        if rows:
            target.write(rows, key=write_key)
    return rows


def _long_doc_budget(source, lengths, max_tokens, cap, seed, say) -> int:
    """The long-document budget: ``max_tokens``, else what the largest length with a long document allows."""
    if max_tokens is not None:
        return int(max_tokens)
    for length in sorted(lengths, reverse=True):
        try:
            return plan_token_budget(source, [length], None, long_docs=True, cap=cap, seed=seed)
        except UserError:
            say(f"eval: no document of >= {length + 1} tokens; no long_docs rows at {length}")
    return 0


def _passkey_rows(model, lengths, p_list, specs, ropes, *, gpt, dev, precision, base_row, trials, depths,
                  distractors, batch_size, say) -> list[dict]:
    from attnlab.data.tokenizer import GPT2_VOCAB
    from attnlab.evaluate.passkey import DEFAULT_DEPTHS, min_prompt_length, model_logprob, passkey_accuracy

    if gpt.vocab_size != GPT2_VOCAB:
        raise UserError("passkey: needs a model trained on GPT-2 tokenised text (the prompt is English); "
                        "drop --passkey for probe tasks")
    depths = tuple(DEFAULT_DEPTHS if depths is None else depths)
    out = []
    for length in lengths:
        if length < min_prompt_length():
            say(f"passkey: length {length} is shorter than the passkey prompt ({min_prompt_length()} tokens); "
                "skipped")
            continue
        batch = batch_size or max(1, DEFAULT_BATCH_AT_TRAIN_LEN * gpt.train_len // length)
        for rope in ropes:
            for p in p_list:
                logprob = model_logprob(model, rope_scaling=rope, attention=specs[p], device=dev,
                                        precision=precision, batch_size=batch)
                say(f"passkey: L={length} rope={rope} p_eval={p} trials={trials} x {len(depths)} depths")
                # The same prompts for every checkpoint (seed 0): configurations compare on equal ground.
                results = passkey_accuracy(logprob, [length], depths=depths, trials=trials,
                                           n_distractors=distractors, seed=0)
                for record in results:
                    row = dict(base_row)
                    row.update(p_eval=p, rope_scaling=rope, eval_len=length,
                               window_mode="passkey", metric=record["metric"], value=record["value"],
                               n_tokens=record["n_prompts"] * length)
                    if record["depth"] is not None:
                        row["bucket"] = f"depth={record['depth']:g}"
                    out.append(row)
    return out
