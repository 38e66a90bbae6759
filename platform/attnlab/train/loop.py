"""The per-worker training loop, independent of Ray.

Owns :func:`train_worker` (on every worker: :func:`attnlab.train.parts.build_parts` builds the parts, then
:func:`train_loop` steps them), :func:`train_here` (one plain process) and the :class:`Session` protocol: what
differs between a plain process (:class:`LocalSession`, here) and a Ray Train worker
(``attnlab.train.ray_train``): rank and world size, device, DDP wrapping, the latest checkpoint, reporting and
all-reduce. The run's own files (``attnlab.runfolder``) go straight to the run location, local or object storage.

It must never import Ray, nor make the host wait on a step that neither logs, validates nor checkpoints.

Details: docs/architecture.md#one-owner-for-each-fact (the parts and the sessions), docs/protocol.md#training
(the recipe, validation at longer lengths, the stopping rule).
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Callable, Iterator, Protocol

import torch

import attnlab.faults as faults
from attnlab.data.source import DataSource
from attnlab.errors import UserError
from attnlab.location import Location
from attnlab.model.checkpoint import META_FILE, find_latest_checkpoint, local_checkpoint
from attnlab.runfolder import VAL_LOSS_AT
from attnlab.states import StopReason
from attnlab.train.config import TrainConfig
from attnlab.train.parts import TrainParts, build_parts
from attnlab.train.recipe import lr_at, peak_flops


class Session(Protocol):
    rank: int
    world_size: int
    device: torch.device

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module: ...
    def latest_checkpoint(self) -> contextlib.AbstractContextManager[str | None]: ...
    def report(self, metrics: dict, checkpoint_dir: str | None) -> None: ...
    def all_reduce_sum(self, values: list[float]) -> list[float]: ...


class LocalSession:
    """One plain process, no Ray: checkpoints go to ``RUN/checkpoints/step_NNNNNNN`` (local or object storage)."""

    rank, world_size = 0, 1

    def __init__(self, run: str | Path | Location, keep: int = 2, device: str | None = None,
                 on_report: Callable[[dict], None] | None = None):
        self.run = Location.parse(run, field="run")
        self.keep = keep
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.reports: list[dict] = []
        self.on_report = on_report  # e.g. a Tune trial's report of each step's metrics

    def prepare_model(self, model):
        return model

    @contextlib.contextmanager
    def latest_checkpoint(self) -> Iterator[str | None]:
        try:
            find_latest_checkpoint(self.run)
        except ValueError:
            yield None
            return
        with local_checkpoint(self.run) as directory:
            yield str(directory)

    def report(self, metrics, checkpoint_dir):
        self.reports.append(metrics)
        if checkpoint_dir is not None:
            # meta.json last: a checkpoint only counts once it is whole (find_latest_checkpoint reads its step there)
            self.run.upload(checkpoint_dir, f"checkpoints/step_{metrics['step']:07d}", last=META_FILE)
            for old in self.run.list_names("checkpoints", hidden=False)[:-self.keep]:
                self.run.delete(f"checkpoints/{old}")
        if self.on_report is not None:
            self.on_report(metrics)

    def all_reduce_sum(self, values):
        return list(values)


def train_worker(cfg: TrainConfig, session: Session, run: str | Path | Location,
                 source: DataSource | None = None) -> dict:
    """Train ``cfg`` on this worker, the run's files going to ``run``; ``source``: the data when this process has
    already opened it. Returns the last metrics (rank 0's view)."""
    return train_loop(build_parts(cfg, session, Location.parse(run, field="run"), source))


def train_here(cfg: TrainConfig, run: str | Path | Location, source: DataSource | None = None,
               on_report: Callable[[dict], None] | None = None, device: str | None = None) -> dict:
    """Train ``cfg`` as one worker in this process, no Ray Train (``attnlab train --local``, and a study's one-worker
    CPU trial, which trains in its Tune trial's process). As Ray Train's ``FailureConfig`` does, an error restarts
    the run from its latest checkpoint, up to ``cfg.max_failures`` times; a ``UserError`` (bad input: it would fail
    again) is never retried. Returns the last metrics."""
    run = Location.parse(run, field="run")
    for attempt in range(cfg.max_failures + 1):
        try:
            return train_worker(cfg, LocalSession(run, keep=cfg.keep_checkpoints, device=device, on_report=on_report),
                                run, source=source)
        except UserError:
            raise
        except Exception as exc:
            if attempt == cfg.max_failures:
                raise
            print(f"attnlab: training run {run.name} failed ({type(exc).__name__}: {str(exc)[:200]}); restarting "
                  f"from its latest checkpoint ({attempt + 1} of max_failures={cfg.max_failures})", flush=True)
    raise AssertionError("unreachable")


def train_loop(parts: TrainParts) -> dict:
    """Step the parts from where the run stands to ``steps`` (or the stopping rule, or a divergence): log every
    ``log_every`` steps, validate every ``val_every``, checkpoint every ``checkpoint_every`` and at the end.

    The loss is read on the host, and all-reduced, only on the steps that log, validate or checkpoint: the steps
    between queue their work and never wait (a GPU keeps running while the CPU fetches the next batch). A diverged
    run (a non-finite loss) is found on the first such step after it, writes ``failure.json`` with the step its
    loss first went non-finite, and stops cleanly, before any checkpoint of its non-finite weights. With
    ``cfg.stop_when`` the first validation point that meets it ends the run there, with a checkpoint whose metrics
    say ``stopped: reached`` (``stopped: cap`` at ``steps``); ``cfg.val_extrapolation``'s steps also measure the
    validation loss at longer lengths. Before every step the fault seam :func:`attnlab.faults.before_train_step`
    is called (a no-op unless a crash test replaced it)."""
    cfg, session, data, model = parts.cfg, parts.session, parts.data, parts.model
    rank, world = session.rank, session.world_size
    flops_per_token, peak = model.model.flops_per_token(cfg.seq_length), peak_flops(session.device)
    last: dict = {"step": parts.start, **({"stopped": StopReason.REACHED} if parts.finished else {})}
    t_last, tokens_since = time.perf_counter(), 0
    # The first step (1-based) whose loss was not finite on this rank, 0 while none: kept on the device, so steps
    # that log nothing never wait for the host (no .item(), no collective); read on the steps that report.
    bad_at = torch.zeros((), dtype=torch.int64, device=session.device)
    bad_loss = torch.zeros((), device=session.device)  # that step's loss
    for step in range(parts.start, parts.start if parts.finished else cfg.steps):
        faults.before_train_step(step, rank)
        lr = lr_at(step, cfg)
        loss_sum, grad_norm = model.step(data.micro_batches(step), data.accum, lr, cfg.grad_clip)
        done = step + 1
        tokens_since += data.tokens_per_step
        first = (bad_at == 0) & ~torch.isfinite(loss_sum)
        bad_at, bad_loss = torch.where(first, done, bad_at), torch.where(first, loss_sum / data.accum, bad_loss)
        log_now = done % cfg.log_every == 0 or done == cfg.steps
        val_now = done % cfg.val_every == 0 or done == cfg.steps
        ckpt_now = done % cfg.checkpoint_every == 0 or done == cfg.steps
        extrap_now = cfg.val_extrapolation is not None and cfg.val_extrapolation.due(done, cfg.steps)
        if not (log_now or val_now or ckpt_now or extrap_now):
            continue
        # one collective on the steps that report: the loss, and whether any rank has seen a non-finite loss since
        # the run started (so every rank decides alike that it diverged)
        first_bad = int(bad_at)
        loss_total, ranks_bad = session.all_reduce_sum([float(loss_sum) / data.accum, float(first_bad > 0)])
        train_loss = loss_total / world
        diverged = ranks_bad > 0 or not math.isfinite(train_loss)
        tokens_per_s = tokens_since / max(time.perf_counter() - t_last, 1e-9)
        metrics = {"step": done, "tokens": done * data.tokens_per_step, "train_loss": train_loss, "lr": lr,
                   "grad_norm": float(grad_norm), "tokens_per_s": tokens_per_s,
                   "tokens_per_s_per_worker": tokens_per_s / world,
                   "mfu": (flops_per_token * tokens_per_s / world / peak) if peak else None}  # None: no peak known
        if val_now and not diverged:
            metrics.update(parts.validator.validate(model.model, done))
            # evaluation uses the weights that met the rule
            ckpt_now = ckpt_now or metrics.get("stopped") is StopReason.REACHED
        # validation at longer lengths: every val_extrapolation.every steps, the last step, and a step that stops
        extrap_now = extrap_now or (cfg.val_extrapolation is not None and metrics.get("stopped") is StopReason.REACHED)
        if extrap_now and not diverged:
            at = parts.validator.at_lengths(model.model)
            if at:
                metrics[VAL_LOSS_AT] = at
        if diverged:
            metrics["diverged"] = True
            gpt = model.model.cfg
            # where this rank's loss first left the finite numbers (or, where only another rank's did, this step)
            at, loss = (first_bad, float(bad_loss)) if first_bad else (done, train_loss)
            seen = "" if at == done else f"; seen at step {done}, the first step since that reports"
            parts.writer.failure(f"loss is {loss} at step {at} (attention={gpt.attention}, p_train={gpt.p_train}"
                                 f"{seen})", at)
        parts.writer.append(metrics, force=val_now or ckpt_now or extrap_now or diverged)
        parts.checkpointer.report(metrics, model if ckpt_now and not diverged and rank == 0 else None)
        last = metrics
        t_last, tokens_since = time.perf_counter(), 0
        if diverged or metrics.get("stopped") is StopReason.REACHED:
            break
    parts.writer.finish(model.model)
    return last


__all__ = ["LocalSession", "Session", "train_here", "train_loop", "train_worker"]
