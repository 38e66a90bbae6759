"""Extrapolation evaluation of one checkpoint: load it, plan its cells, skip those already stored, measure the
rest, turn them into rows, write them. A thin orchestration of :mod:`~attnlab.evaluate.plan` (what),
:mod:`~attnlab.evaluate.measure` (scores) and :mod:`~attnlab.evaluate.cell_rows` (rows).

What it reads of the training run is typed: the checkpoint's recorded training config as a
:class:`attnlab.runfolder.TrainRecord` (precision, validation batch, data seed, identity columns; TrainConfig owns
their defaults, none is restated here) and the run's key from its provenance
(:func:`attnlab.runfolder.recorded_train_key`).

The protocol (docs/protocol.md#evaluation) is recorded in every row: window mode, token count, RoPE setting,
``p_eval`` and the cell's key. No Ray here: a study runs this inside a Ray task that has the resources of one
training worker (``attnlab.study.trial``), so a GPU-trained model is evaluated on a GPU.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnlab.errors import UserError, one_line
from attnlab.evaluate.measure import measure, text_tokenizer
from attnlab.evaluate.plan import EvalCell, EvalConfig, p_eval_label
from attnlab.evaluate.cell_rows import rows_for
from attnlab.location import Location
from attnlab.model.rope import TrainedScaling
from attnlab.names import recorded_rope_method
from attnlab.runfolder import TrainRecord, recorded_train_key

if TYPE_CHECKING:
    from attnlab.results.store import ResultsStore

DEFAULT_STUDY = "adhoc"


@dataclass
class LoadedCheckpoint:
    """A model with the training config it came from (typed), as ``attnlab.model.checkpoint.load_model`` reads it."""

    model: torch.nn.Module
    train_config: TrainRecord
    meta: dict  # {"step", "checkpoint": its location}

    @property
    def run(self) -> Location | None:
        from attnlab.model.checkpoint import run_of_checkpoint

        path = self.meta.get("checkpoint")
        return run_of_checkpoint(Location.parse(path)) if path else None


def load_checkpoint(checkpoint, device) -> LoadedCheckpoint:
    """A path or URI (checkpoint or run folder), a ``(model, train_config, meta)`` tuple (the config recorded, or a
    ``TrainConfig``), or a LoadedCheckpoint."""
    if isinstance(checkpoint, LoadedCheckpoint):
        return checkpoint
    if isinstance(checkpoint, tuple) and len(checkpoint) == 3:
        model, cfg, meta = checkpoint
        return LoadedCheckpoint(model, TrainRecord.parse(cfg, where="checkpoint"), meta)
    if not isinstance(checkpoint, (str, Location)) and not hasattr(checkpoint, "__fspath__"):
        raise UserError(f"checkpoint must be a checkpoint or run folder (path or URI), got {type(checkpoint).__name__}")
    from attnlab.model.checkpoint import load_model

    model, cfg, meta = load_model(checkpoint, device=device)
    return LoadedCheckpoint(model, TrainRecord.parse(cfg, where=f"checkpoint {meta['checkpoint']}"), meta)


def train_key_of(loaded: LoadedCheckpoint) -> str:
    """The training run's key, as its provenance records it (``attnlab.train`` writes it); for a model that
    comes without a run folder, a hash of the training config it carries."""
    run = loaded.run
    key = recorded_train_key(run) if run is not None else None
    if key:
        return key
    blob = json.dumps(loaded.train_config.record, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def default_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"device={device!r} is not a torch device; use cpu, cuda or cuda:N") from None


def base_row(loaded: LoadedCheckpoint, source, train_key: str, context: dict | None) -> dict:
    """The identity columns every row of this checkpoint carries (``context`` overrides, e.g. study/trial)."""
    from attnlab.data.source import data_label
    from attnlab.provenance import git_info
    from attnlab.results.schema import STORED_NAMES

    context = dict(context or {})
    unknown = sorted(set(context) - set(STORED_NAMES))
    if unknown:
        raise UserError(f"context: {unknown[0]!r} is not a results column; allowed: {', '.join(STORED_NAMES)}")
    gpt, cfg = loaded.model.cfg, loaded.train_config
    attention = gpt.attention_spec()
    step = int(loaded.meta.get("step", 0))
    run = loaded.run
    row = {
        "study": DEFAULT_STUDY,
        "trial": run.name if run is not None else "checkpoint",
        "attention": gpt.attention,
        "scale": attention.scale_label,
        "p_train": attention.p,  # the power actually trained with (lssar: 15 by default)
        "step": step,
        "tokens": step * cfg.tokens_per_step,
        "train_len": int(getattr(gpt, "base_len", gpt.train_len)),  # a stage's: its lineage's first length
        "seed": cfg.seed,
        "train_key": train_key,
        "git_sha": git_info().get("sha") or "unknown",
        "preset": cfg.preset,
        "data": data_label(getattr(source, "spec", None) or source.describe()),
        "plugin_sha256": cfg.plugin_sha256,  # the plugin's code, for a plugin's variant (null for a built-in)
        **lineage_columns(cfg.record, step),
    }
    row.update(context)
    return row


def lineage_columns(record: dict, step: int) -> dict:
    """The lineage columns of a run's rows at ``step`` (docs/stages.md), from its recorded training config: empty
    for a run trained from scratch; for one started from a parent's weights (``init_from``), the parent's key, the
    RoPE scaling applied in training, its own length and tokens, and the lineage's tokens."""
    parent = record.get("init_from")
    if not parent:
        return {}
    own = int(step) * int(record["tokens_per_step"])
    method = recorded_rope_method(record)  # an older record's yarn is the paper's ramp
    ext_len = int(record.get("seq_len") or 0) or None
    factor = None
    if method != "none" and ext_len and record.get("original_len"):  # the factor set, or ext_len / original_len
        factor = TrainedScaling(method, int(record["original_len"]), record.get("rope_factor")).scale(ext_len)
    return {"parent_key": parent["train_key"], "extension": method, "ext_factor": factor, "ext_len": ext_len,
            "ext_tokens": own, "lineage_tokens": int(parent.get("lineage_tokens") or 0) + own}


def evaluate_checkpoint(checkpoint, config: EvalConfig | None = None, *, data: str | dict | None = None,
                        context: dict | None = None, store: ResultsStore | str | Location | None = None, device=None,
                        skip: set[str] | None = None, log: Callable[[str], None] | None = None,
                        source=None) -> list[dict]:
    """Evaluate one checkpoint over the cells of ``config``; return the rows of the cells measured.

    ``checkpoint``: a checkpoint folder, a run folder (its latest checkpoint), a path or a URI, or an already
    loaded ``(model, train_config, meta)`` (the config as a run records it, or a ``TrainConfig``). ``data``: a
    prepared folder or a generated source's mapping (default: the training data). ``context``: row fields the
    caller fixes (``study`` defaults to ``adhoc``, ``trial`` to the run folder name). ``store``: a
    ``ResultsStore`` (or where one is: a path or a URI) to write the rows to, one file per length, named by the
    cells' keys (a retry replaces, never duplicates). ``skip``: cell keys already measured (not measured again).
    ``source``: ``data`` already opened in this process (a trial that trained here), instead of opening it again.
    The model's weights are never modified. Raises UserError on bad input.
    """
    from attnlab.data.source import open_data
    from attnlab.results.schema import validate_row

    config = config or EvalConfig()
    say = log or (lambda message: None)
    dev = default_device(device)
    loaded = load_checkpoint(checkpoint, dev)
    model, cfg = loaded.model, loaded.train_config
    gpt = model.cfg
    data = cfg.data if data is None else data
    if source is None:
        if not data:
            raise UserError("data: the checkpoint's config names no data; pass --data DIR")
        source = open_data(data)
    check_tokenizer(source, gpt.vocab_size)
    base_len = int(getattr(gpt, "base_len", gpt.train_len))  # a stage's multiples count from its lineage's first length
    lengths = config.eval_lengths(base_len)
    if config.windows and config.max_tokens < max(lengths):
        raise UserError(f"max_tokens={config.max_tokens} is not allowed: use at least the largest length "
                        f"({max(lengths)} tokens), so every length scores whole windows")
    train_key = train_key_of(loaded)
    base = base_row(loaded, source, train_key, context)
    from attnlab.model import compile_model, is_compile_failure, is_compiled, uncompile_model

    compile_model(model, config.compile)  # in place; the weights are unchanged (checkpoints load eagerly)
    step = base["step"]
    skip = set(skip or ())
    todo = [(cell, key) for cell in config.cells(base_len)
            if (key := cell.key(train_key, step, source.fingerprint)) not in skip]
    keys = {cell: key for cell, key in todo}
    scored_text = text_tokenizer(source) is not None  # bits per byte too
    target = None
    if store is not None:  # a ResultsStore, or where one is (path or URI)
        from attnlab.results.store import ResultsStore

        target = store if isinstance(store, ResultsStore) else ResultsStore(store)

    if config.downstream is not None and any(cell.kind == "downstream" for cell, _ in todo):
        from attnlab.evaluate.downstream import check_tasks

        check_tasks(config.downstream.tasks, config.downstream.data)  # a missing folder or task: one line, now
    rows: list[dict] = []
    pending: list[dict] = []
    pending_cells: list[EvalCell] = []
    say(plan_line(config, todo, lengths, source, step, loaded.meta.get("checkpoint")))
    progress = CellProgress([cell for cell, _ in todo])

    def flush():
        if target is not None and pending:
            digest = hashlib.sha256("".join(sorted(keys[c] for c in pending_cells)).encode()).hexdigest()[:12]
            target.write(pending, key=("eval", train_key, int(pending_cells[0].length), digest))
        rows.extend(pending)
        pending.clear()
        pending_cells.clear()

    done: set[EvalCell] = set()
    while True:
        try:
            for cell, scores in measure(model, source, [c for c, _ in todo if c not in done], device=dev,
                                        precision=cfg.precision, batch_size=config.batch_size,
                                        batch_at_train_len=cfg.val_batch, data_seed=cfg.data_seed, log=say,
                                        downstream=config.downstream):
                if pending_cells and pending_cells[0].length != cell.length:
                    flush()  # one file per length: what was measured is kept if a longer length fails
                say(progress.done(cell))
                new = rows_for(base, cell, keys[cell], scores, scored_text)
                for i, row in enumerate(new):  # refuse to return rows the store would refuse
                    validate_row(row, i)
                pending.extend(new)
                pending_cells.append(cell)
                done.add(cell)
            break
        except Exception as exc:  # noqa: BLE001 - only a compile failure is handled; anything else is raised
            if not (is_compiled(model) and is_compile_failure(exc)):
                raise
            # The graph did not build (torch 2.11's inductor on LSSAR's evaluation graph, on an H100 and an H200):
            # the same blocks eagerly compute the same scores. The cells measured so far are kept.
            say(f"eval: the compiled model failed to compile ({one_line(exc, 300)}); scoring the remaining "
                f"{len(todo) - len(done)} cell(s) with the blocks eager (eval.compile: false skips the compile)")
            uncompile_model(model)
    flush()
    return rows


def check_tokenizer(source, model_vocab: int) -> None:
    """Refuse data the model cannot read: a larger vocabulary, or text of another tokeniser (a GPT-2 model on byte
    data reads every byte as a GPT-2 token id without an error, and its losses would mean nothing)."""
    tokenizer = text_tokenizer(source)
    if tokenizer is not None and tokenizer.vocab_size != model_vocab:
        from attnlab.data.tokenizer import TOKENIZERS

        trained = next((t.key for t in TOKENIZERS.values() if t.vocab_size == model_vocab), None)
        raise UserError(f"data {source.describe()}: tokenised with {tokenizer.key} ({tokenizer.vocab_size:,} ids) but "
                        f"the model was trained on a {model_vocab:,}-id vocabulary"
                        f"{f' ({trained})' if trained else ''}; evaluate on data of the model's tokeniser")
    if source.vocab_size > model_vocab:
        raise UserError(f"data {source.describe()}: vocabulary {source.vocab_size} exceeds the model's "
                        f"{model_vocab}; evaluate on the data the model was trained on")


def plan_line(config: EvalConfig, todo, lengths, source, step: int, checkpoint) -> str:
    p_evals = ", ".join(p_eval_label(p) for p in config.p_eval)
    if not config.windows and config.downstream is not None:
        return (f"plan: evaluate {checkpoint or 'the model'} (step {step}): {len(todo)} downstream cell(s) "
                f"(tasks {', '.join(config.downstream.tasks)}, p_eval {p_evals}, rope {', '.join(config.rope_scaling)})")
    return (f"plan: evaluate {checkpoint or 'the model'} (step {step}) on {source.describe()}: {len(todo)} cell(s) "
            f"(lengths {lengths}, p_eval {p_evals}, rope {', '.join(config.rope_scaling)}), "
            f"{config.max_tokens:,} target tokens per length")


class CellProgress:
    """``[i/n] cell ... ETA``: the time left is estimated from the time per token-length so far (a cell's cost
    grows with its length: the same tokens, longer attention rows)."""

    def __init__(self, cells: list[EvalCell]):
        self.weights = {cell: float(cell.length) for cell in cells}
        self.total = sum(self.weights.values()) or 1.0
        self.done_weight = 0.0
        self.count = 0
        self.started = time.monotonic()

    def done(self, cell: EvalCell) -> str:
        from attnlab.names import format_duration

        self.count += 1
        self.done_weight += self.weights.get(cell, 0.0)
        elapsed = time.monotonic() - self.started
        left = elapsed * (self.total - self.done_weight) / max(self.done_weight, 1e-9)
        eta = "done" if self.count >= len(self.weights) else f"ETA {format_duration(left)}"
        return f"eval: [{self.count}/{len(self.weights)}] {cell.describe()} · {format_duration(elapsed)} · {eta}"


__all__ = ["DEFAULT_STUDY", "LoadedCheckpoint", "base_row", "default_device", "evaluate_checkpoint",
           "load_checkpoint", "train_key_of"]
