"""The parts a training worker is built from, in torchtitan's way: a builder (:func:`build_parts`) hands the loop
(:mod:`attnlab.train.loop`) its components, each built once and testable alone:

- :class:`TrainData`: the opened data source as the loop reads it (this rank's micro-batches of a step);
- :class:`ModelAndOptimizer`: the model (compiled when asked, DDP-wrapped by the session), its AdamW, and one
  optimizer step over a step's micro-batches;
- :class:`Validator`: validation at the training length on this rank's share of the windows, all-reduced over the
  workers, and the stopping rule (``train.stop_when``) decided from the all-reduced metric; with
  ``val_extrapolation`` also the validation loss at longer lengths (:meth:`Validator.at_lengths`);
- :class:`Checkpointer`: resumes from the session's latest checkpoint, and saves a checkpoint (rank 0) with the
  report of a step;
- :class:`MetricsWriter`: the run's own files (:mod:`attnlab.runfolder`): rank 0's ``metrics.jsonl``,
  ``provenance.json`` and ``failure.json``, every rank's final weights' checksum.

A ``Session`` (:class:`attnlab.train.loop.Session`) supplies what differs between a plain process and a Ray Train
worker. Validation scores windows with :mod:`attnlab.model.scoring`, the function evaluation uses too. No Ray here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from attnlab.data.source import DataSource, model_kind, open_data
from attnlab.location import Location
from attnlab.model import GPT, build_model, compile_model, is_compiled
from attnlab.model.checkpoint import META_FILE, load_weights, resume, save_checkpoint
from attnlab.model.scoring import autocast_context, mean_window_loss
from attnlab.provenance import git_info, hardware, package_versions
from attnlab.runfolder import (PROVENANCE_FILE, MetricsLog, decode_metrics, write_failure,
                               write_replica_checksum)
from attnlab.states import StopReason
from attnlab.train.config import TrainConfig
from attnlab.train.recipe import build_optimizer


class TrainData:
    """The data source as the loop reads it: rank ``rank``'s micro-batches of each optimizer step, on ``device``."""

    def __init__(self, source: DataSource, cfg: TrainConfig, rank: int, world_size: int, device: torch.device):
        self.source, self.cfg, self.rank, self.world_size, self.device = source, cfg, rank, world_size, device
        self.global_batch, self.accum = cfg.batch_plan(world_size)  # sequences per step, micro-steps per step

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.cfg.seq_length

    def micro_batches(self, step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """``(x, y, loss_mask or None)`` of each micro-step of optimizer step ``step``, on the device."""
        cfg = self.cfg
        for micro in range(self.accum):
            x, y, mask = self.source.train_batch(step, self.rank, self.world_size, micro, cfg.micro_batch,
                                                 seq_len=cfg.seq_length, global_batch=self.global_batch,
                                                 seed=cfg.data_order_seed)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            yield x, y, None if mask is None else mask.to(self.device, non_blocking=True)


class ModelAndOptimizer:
    """The model, its optimizer and the model as the loop calls it (:meth:`wrap`: the session's DDP wrapper, once
    the weights are resumed); :meth:`step` is one optimizer step."""

    def __init__(self, model: GPT, optimizer: torch.optim.Optimizer, device: torch.device, precision: str):
        self.model, self.optimizer, self.device, self.precision = model, optimizer, device, precision
        self.ddp: torch.nn.Module = model

    def wrap(self, session) -> None:
        """DDP over the session's workers (the model itself for one worker)."""
        self.ddp = session.prepare_model(self.model)

    @classmethod
    def build(cls, cfg: TrainConfig, gpt_config, session) -> ModelAndOptimizer:
        """Identical initial weights on every rank (``cfg.seed``), compiled in place before DDP wraps it."""
        torch.manual_seed(cfg.seed)
        model = build_model(gpt_config).to(session.device)
        compile_model(model, cfg.compile)  # default: on for CUDA, off on CPU
        return cls(model, build_optimizer(model, cfg, session.device), session.device, cfg.precision)

    def step(self, batches, accum: int, lr: float, grad_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Accumulate the gradients of ``accum`` micro-batches, clip, step. Returns (sum of the micro-batches'
        losses, gradient norm), both tensors on the device."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        for micro, (x, y, mask) in enumerate(batches):
            last = micro == accum - 1
            sync = contextlib.nullcontext() if last or not hasattr(self.ddp, "no_sync") else self.ddp.no_sync()
            with sync, autocast_context(self.device, self.precision):
                _, loss = self.ddp(x, y, loss_mask=mask)
            (loss / accum).backward()
            loss_sum += loss.detach().float()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip if grad_clip > 0 else math.inf)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm


class Validator:
    """Validation at the training length on this rank's share of the windows, summed over the workers, and the
    stopping rule: the first validation point whose all-reduced metric meets it ends the run (every rank decides
    alike), and a run that reaches ``steps`` without meeting it ends with ``stopped: cap``.

    With ``cfg.val_extrapolation`` it also holds windows at each longer length (built once, here: the first
    ``max(val_tokens, L)`` validation tokens at length ``L``, so every length has at least one window where the
    split is long enough; a length whose split has no whole window is left out) and measures them
    (:meth:`at_lengths`) with the batch scaled down so a forward holds about ``val_batch x seq_len`` tokens."""

    def __init__(self, windows, mask, cfg: TrainConfig, session, longer: dict | None = None):
        self.windows, self.mask, self.session = windows, mask, session
        self.batch_size, self.precision, self.rule, self.steps = cfg.val_batch, cfg.precision, cfg.stop_when, cfg.steps
        self.seq_len = cfg.seq_length
        self.longer = longer or {}  # length -> (this rank's windows, their target mask or None)

    @classmethod
    def build(cls, source: DataSource, cfg: TrainConfig, session) -> Validator:
        rank, world = session.rank, session.world_size
        windows, mask = source.eval_set(cfg.seq_length, max_tokens=cfg.val_tokens, seed=cfg.data_order_seed)
        longer = {}
        extra = cfg.val_extrapolation
        for length in extra.lengths(cfg.seq_length) if extra is not None else ():
            long_windows, long_mask = source.eval_set(length, max_tokens=max(cfg.val_tokens, length),
                                                      seed=cfg.data_order_seed)
            if len(long_windows):  # the same on every rank: each leaves the same lengths out
                longer[length] = (long_windows[rank::world], None if long_mask is None else long_mask[rank::world])
        return cls(windows[rank::world], None if mask is None else mask[rank::world], cfg, session, longer)

    def validate(self, model: torch.nn.Module, done: int) -> dict:
        """``val_loss``, ``val_acc`` and ``val_tokens`` over every worker's windows, after step ``done``; with a
        stopping rule also ``stopped`` (:class:`StopReason`: reached, or cap at the last step)."""
        total, count, correct = mean_window_loss(model, self.windows, batch_size=self.batch_size,
                                                 device=self.session.device, precision=self.precision,
                                                 target_mask=self.mask)
        total, count, correct = self.session.all_reduce_sum([total, float(count), float(correct)])
        metrics = {"val_loss": total / max(count, 1.0), "val_acc": correct / max(count, 1.0),
                   "val_tokens": int(count)}
        if self.rule is not None:
            if self.rule.met(metrics):
                metrics["stopped"] = StopReason.REACHED
            elif done == self.steps:
                metrics["stopped"] = StopReason.CAP
        return metrics

    def at_lengths(self, model: torch.nn.Module) -> dict[str, float]:
        """The mean validation loss at each longer length over every worker's windows, ``{"<length>": loss}``
        (:data:`attnlab.runfolder.VAL_LOSS_AT`): the model as trained (RoPE and p as trained), in eval mode without
        gradients, its training mode and the random generators' states left as they were (a run trains the same
        weights with this on or off). One all-reduce for all the lengths."""
        if not self.longer:
            return {}
        device = self.session.device
        sums = []
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for length, (windows, mask) in self.longer.items():
                batch = max(1, self.batch_size * self.seq_len // length)
                total, count, _ = mean_window_loss(model, windows, batch_size=batch, device=device,
                                                   precision=self.precision, target_mask=mask)
                sums += [total, float(count)]
        sums = self.session.all_reduce_sum(sums)
        return {str(length): sums[2 * i] / sums[2 * i + 1]
                for i, length in enumerate(self.longer) if sums[2 * i + 1] > 0}

    def finished(self, resumed: dict) -> bool:
        """Whether a resumed run is already over: its latest checkpoint met the rule (the run died after it)."""
        return self.rule is not None and StopReason.of(resumed) is StopReason.REACHED


class Checkpointer:
    """Resumes a run from the session's latest checkpoint, and reports each step's metrics through the session with
    a checkpoint when one is due (saved by rank 0: model, optimizer, step, RNG states, the run's config)."""

    def __init__(self, session, cfg: TrainConfig, gpt_config):
        self.session = session
        self.config_record, self.gpt_record = cfg.model_dump(mode="json"), dataclasses.asdict(gpt_config)

    def resume(self, parts: ModelAndOptimizer) -> tuple[int, dict]:
        """``(steps already done, the metrics the checkpoint recorded)``; ``(0, {})`` for a new run."""
        with self.session.latest_checkpoint() as directory:
            if directory is None:
                return 0, {}
            return resume(directory, parts.model, parts.optimizer), checkpoint_metrics(directory)

    def report(self, metrics: dict, parts: ModelAndOptimizer | None) -> None:
        """Report ``metrics`` (numbers, and how the run stopped as its string: what Tune hears of a step); with
        ``parts`` (rank 0, a checkpoint due) save a checkpoint alongside that records them."""
        checkpoint_dir = None
        reported = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if isinstance(metrics.get("stopped"), StopReason):
            reported["stopped"] = metrics["stopped"].value
        with tempfile.TemporaryDirectory(prefix="attnlab-ckpt-") as tmp:
            if parts is not None:
                save_checkpoint(tmp, model=parts.model, optimizer=parts.optimizer, step=metrics["step"],
                                cfg=self.config_record, gpt_config=self.gpt_record, metrics=reported)
                checkpoint_dir = tmp
            self.session.report(reported, checkpoint_dir)


def checkpoint_metrics(directory: str) -> dict:
    """The metrics a checkpoint recorded (``meta.json``, read as :func:`attnlab.runfolder.decode_metrics` reads
    them); empty when it has none."""
    try:
        return decode_metrics(json.loads((Path(directory) / META_FILE).read_text()).get("metrics") or {})
    except (OSError, ValueError):
        return {}


class MetricsWriter:
    """The run's own files: rank 0 writes ``metrics.jsonl`` (a resumed run drops what the lost segment wrote),
    ``provenance.json`` and, on divergence, ``failure.json``; every rank its final weights' checksum."""

    def __init__(self, run: Location, rank: int, start: int):
        self.run, self.rank = run, rank
        self.log = MetricsLog(run, keep_through_step=start) if rank == 0 else None

    def provenance(self, cfg: TrainConfig, model: GPT, source: DataSource, world_size: int, data: TrainData) -> None:
        """``provenance.json`` once per run (rank 0): config, train key, code (a plugin's origin and sha256 too: its
        bytes are in the config), versions, hardware, data, FLOPs."""
        if self.rank != 0 or self.run.exists(PROVENANCE_FILE):
            return
        flops = model.flops_per_token(cfg.seq_length)
        self.run.write_json(PROVENANCE_FILE, {
            "config": cfg.model_dump(mode="json"),
            "train_key": cfg.train_key(source.fingerprint, source.vocab_size),
            "identity": cfg.identity(source.fingerprint, source.vocab_size),
            "model": dataclasses.asdict(model.cfg),
            "compiled": is_compiled(model),
            "num_params": model.num_params(),
            "git": git_info(),
            **({"plugin": {"origin": cfg.plugin.origin, "sha256": cfg.plugin.sha256, "attention": cfg.attention}}
               if cfg.plugin is not None else {}),
            "versions": package_versions(),
            "hardware": hardware(),
            "world_size": world_size,
            "grad_accum_steps": data.accum,
            "data": {"spec": cfg.data, "fingerprint": source.fingerprint, "vocab_size": source.vocab_size},
            "tokens_per_step": data.tokens_per_step,
            "flops_per_token": flops,
            "flops_per_step": flops * data.tokens_per_step,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        })

    def append(self, metrics: dict, force: bool) -> None:
        if self.log is not None:
            self.log.append(metrics, force=force)

    def failure(self, reason: str, step: int) -> None:
        if self.rank == 0:
            write_failure(self.run, reason, step)

    def finish(self, model: torch.nn.Module) -> None:
        if self.log is not None:
            self.log.flush()
        write_replica_checksum(self.run, self.rank, weights_digest(model))


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of a model's weights: DDP replicas must end byte-identical."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclasses.dataclass
class TrainParts:
    """What the loop is handed: the resolved config and the built components."""

    cfg: TrainConfig  # micro_batch: auto resolved for this device
    session: object
    data: TrainData
    model: ModelAndOptimizer
    validator: Validator
    checkpointer: Checkpointer
    writer: MetricsWriter
    start: int  # optimizer steps already done (a resumed run)
    finished: bool  # a resumed run whose latest checkpoint met the stopping rule


def build_parts(cfg: TrainConfig, session, run: Location, source: DataSource | None = None) -> TrainParts:
    """Build every part of a training worker for ``cfg`` on this session's rank. ``source``: the data already
    opened in this process (``attnlab train --local``); otherwise the worker opens ``cfg.data`` itself, once."""
    if cfg.threads_per_worker:
        torch.set_num_threads(cfg.threads_per_worker)
    source = source if source is not None else open_data(cfg.data)
    device = session.device
    # micro_batch: auto becomes the largest micro-batch that fits this device's memory (docs/gpu-memory.md).
    budget = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    cfg = cfg.resolved(session.world_size, budget, vocab_size=source.vocab_size)
    gpt_config = cfg.gpt_config(vocab_size=source.vocab_size, kind=model_kind(source))
    data = TrainData(source, cfg, session.rank, session.world_size, device)
    validator = Validator.build(source, cfg, session)
    model = ModelAndOptimizer.build(cfg, gpt_config, session)
    checkpointer = Checkpointer(session, cfg, gpt_config)
    start, resumed = checkpointer.resume(model)
    if start == 0 and cfg.init_from is not None:
        # a stage's first start: its parent's final weights (a restart resumes from this run's own checkpoint)
        load_weights(cfg.init_from.run, cfg.init_from.step, model.model, field="init_from")
    writer = MetricsWriter(run, session.rank, start)
    writer.provenance(cfg, model.model, source, session.world_size, data)
    model.wrap(session)
    return TrainParts(cfg, session, data, model, validator, checkpointer, writer, start, validator.finished(resumed))


__all__ = ["Checkpointer", "MetricsWriter", "ModelAndOptimizer", "TrainData",
           "TrainParts", "Validator", "build_parts", "checkpoint_metrics", "weights_digest"]
