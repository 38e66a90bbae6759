"""The per-worker training loop, independent of Ray.

``train_worker(cfg, session, run)`` runs on every worker. A ``Session`` supplies what differs between a plain
process and a Ray Train worker: rank and world size, device, DDP wrapping, the latest checkpoint, reporting
(with an optional checkpoint), and all-reduce. ``LocalSession`` (here) runs one process with no Ray;
``attnlab.train.ray_train`` provides the Ray Train one. The run's own files (``attnlab.runfolder``) go straight
to the run location, local or object storage: rank 0 writes ``metrics.jsonl`` and ``provenance.json``, a
diverged run writes ``failure.json`` with the step and stops cleanly, every rank records its final weights'
checksum. Validation scores windows with :mod:`attnlab.model.scoring`, the function evaluation uses too.

With a stopping rule (``cfg.stop_when``), each validation point checks it on the all-reduced metric (so every
rank decides alike); the first point that meets it ends the run there with a checkpoint whose metrics say
``stopped: reached``, and a resumed run whose latest checkpoint says so trains no further. A run that reaches
``steps`` without meeting it ends with ``stopped: cap``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Iterator, Protocol

import torch

from attnlab.data.source import model_kind, open_data
from attnlab.location import Location
from attnlab.model import GPT, build_model, compile_model, is_compiled
from attnlab.model.checkpoint import META_FILE, find_latest_checkpoint, local_checkpoint, resume, save_checkpoint
from attnlab.model.scoring import autocast_context, mean_window_loss
from attnlab.provenance import git_info, hardware, package_versions
from attnlab.train.config import TrainConfig
from attnlab.train.recipe import build_optimizer, lr_at, peak_flops
from attnlab.runfolder import PROVENANCE_FILE, MetricsLog, write_failure, write_replica_checksum

# Test-only fault injection: rank FAIL_RANK raises at step FAIL_AT_STEP once (the marker file records it).
FAIL_AT_STEP_ENV, FAIL_RANK_ENV, FAIL_ONCE_FILE_ENV = "ATTNLAB_FAIL_AT_STEP", "ATTNLAB_FAIL_RANK", "ATTNLAB_FAIL_ONCE_FILE"


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

    def __init__(self, run: str | Path | Location, keep: int = 2, device: str | None = None):
        self.run = Location.parse(run, field="--out")
        self.keep = keep
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.reports: list[dict] = []

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
            self.run.upload(checkpoint_dir, f"checkpoints/step_{metrics['step']:07d}")
            for old in self.run.list_names("checkpoints", hidden=False)[:-self.keep]:
                self.run.delete(f"checkpoints/{old}")

    def all_reduce_sum(self, values):
        return list(values)


STOP_REACHED, STOP_CAP = "reached", "cap"  # how a run with a stopping rule ended (metrics' "stopped")


def _checkpoint_metrics(directory: str) -> dict:
    """The metrics a checkpoint recorded (``meta.json``); empty when it has none."""
    try:
        return dict(json.loads((Path(directory) / META_FILE).read_text()).get("metrics") or {})
    except (OSError, ValueError):
        return {}


def _maybe_inject_failure(step: int, rank: int) -> None:
    if os.environ.get(FAIL_AT_STEP_ENV) is None or int(os.environ[FAIL_AT_STEP_ENV]) != step:
        return
    if rank != int(os.environ.get(FAIL_RANK_ENV, "0")):
        return
    marker = os.environ.get(FAIL_ONCE_FILE_ENV)
    if marker:
        if os.path.exists(marker):
            return
        Path(marker).write_text(f"failed at step {step} on rank {rank}\n")
    raise RuntimeError(f"injected worker failure at step {step} on rank {rank} ({FAIL_AT_STEP_ENV})")


def write_provenance(run: Location, cfg: TrainConfig, model: GPT, data, world_size: int, global_batch: int,
                     accum: int) -> None:
    if run.exists(PROVENANCE_FILE):
        return
    tokens_per_step = global_batch * cfg.seq_length
    key = cfg.train_key(data.fingerprint, data.vocab_size)
    run.write_json(PROVENANCE_FILE, {
        "config": cfg.model_dump(mode="json"),
        "train_key": key,
        "config_hash": key,  # the results rows' column of the same name
        "identity": cfg.identity(data.fingerprint, data.vocab_size),
        "model": dataclasses.asdict(model.cfg),
        "compiled": is_compiled(model),
        "num_params": model.num_params(),
        "git": git_info(),
        "versions": package_versions(),
        "hardware": hardware(),
        "world_size": world_size,
        "grad_accum_steps": accum,
        "data": {"spec": cfg.data, "fingerprint": data.fingerprint, "vocab_size": data.vocab_size},
        "tokens_per_step": tokens_per_step,
        "flops_per_token": model.flops_per_token(cfg.seq_length),
        "flops_per_step": model.flops_per_token(cfg.seq_length) * tokens_per_step,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    })


def train_worker(cfg: TrainConfig, session: Session, run: str | Path | Location) -> dict:
    """Train ``cfg`` on this worker, the run's files going to ``run``. Returns the last metrics (rank 0's view)."""
    run = Location.parse(run, field="run")
    rank, world, device = session.rank, session.world_size, session.device
    if cfg.threads_per_worker:
        torch.set_num_threads(cfg.threads_per_worker)
    data = open_data(cfg.data)
    # micro_batch: auto becomes the largest micro-batch that fits this device's memory (docs/gpu-memory.md).
    budget = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    cfg = cfg.resolved(world, budget, vocab_size=data.vocab_size)
    gpt_cfg = cfg.gpt_config(vocab_size=data.vocab_size, kind=model_kind(data))
    global_batch, accum = cfg.batch_plan(world)
    T = cfg.seq_length
    val_windows, val_mask = data.eval_set(T, max_tokens=cfg.val_tokens, seed=cfg.data_seed)
    val_windows = val_windows[rank::world]
    val_mask = None if val_mask is None else val_mask[rank::world]

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = build_model(gpt_cfg).to(device)
    compile_model(model, cfg.compile)  # in place, before DDP wraps it (default: on for CUDA, off on CPU)
    optimizer = build_optimizer(model, cfg, device)
    start, resumed_meta = 0, {}
    with session.latest_checkpoint() as ckpt:
        if ckpt is not None:
            start = resume(ckpt, model, optimizer)
            resumed_meta = _checkpoint_metrics(ckpt)
    # The latest checkpoint met the stopping rule (the run was killed after it): the run is finished.
    finished = cfg.stop_when is not None and resumed_meta.get("stopped") == STOP_REACHED
    log = None
    if rank == 0:
        log = MetricsLog(run, keep_through_step=start)  # a resumed run drops what the lost segment wrote
        write_provenance(run, cfg, model, data, world, global_batch, accum)
    ddp = session.prepare_model(model)
    flops_per_token = model.flops_per_token(T)
    peak = peak_flops(device)
    cfg_json = cfg.model_dump(mode="json")
    gpt_json = dataclasses.asdict(gpt_cfg)

    last: dict = {"step": start, **({"stopped": STOP_REACHED} if finished else {})}
    t_last, tokens_since = time.perf_counter(), 0
    for step in range(start, start if finished else cfg.steps):
        _maybe_inject_failure(step, rank)
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        for micro in range(accum):
            x, y, mask = data.train_batch(step, rank, world, micro, cfg.micro_batch, seq_len=T,
                                          global_batch=global_batch, seed=cfg.data_seed)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            mask = None if mask is None else mask.to(device, non_blocking=True)
            sync = contextlib.nullcontext() if micro == accum - 1 or not hasattr(ddp, "no_sync") else ddp.no_sync()
            with sync, autocast_context(device, cfg.precision):
                _, loss = ddp(x, y, loss_mask=mask)
            (loss / accum).backward()
            loss_sum += loss.detach().float()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        tokens_since += global_batch * T

        log_now = done % cfg.log_every == 0 or done == cfg.steps
        val_now = done % cfg.val_every == 0 or done == cfg.steps
        ckpt_now = done % cfg.checkpoint_every == 0 or done == cfg.steps
        train_loss = session.all_reduce_sum([float(loss_sum) / accum])[0] / world
        diverged = not math.isfinite(train_loss)
        if not (log_now or val_now or ckpt_now or diverged):
            continue

        elapsed = time.perf_counter() - t_last
        tokens_per_s = tokens_since / max(elapsed, 1e-9)
        metrics = {"step": done, "tokens": done * global_batch * T, "train_loss": train_loss, "lr": lr,
                   "grad_norm": float(grad_norm), "tokens_per_s": tokens_per_s,
                   "tokens_per_s_per_worker": tokens_per_s / world,
                   "mfu": (flops_per_token * tokens_per_s / world / peak) if peak else "unknown"}
        if val_now and not diverged:
            total, count, correct = mean_window_loss(model, val_windows, batch_size=cfg.val_batch, device=device,
                                                     precision=cfg.precision, target_mask=val_mask)
            total, count, correct = session.all_reduce_sum([total, float(count), float(correct)])
            metrics["val_loss"] = total / max(count, 1.0)
            metrics["val_acc"] = correct / max(count, 1.0)
            metrics["val_tokens"] = int(count)
            if cfg.stop_when is not None:
                # decided from the all-reduced metric: every rank stops at the same step
                if cfg.stop_when.met(metrics):
                    metrics["stopped"], metrics["stop_reached"] = STOP_REACHED, 1
                    ckpt_now = True  # evaluation uses the weights that met the rule
                elif done == cfg.steps:
                    metrics["stopped"], metrics["stop_reached"] = STOP_CAP, 0
        if diverged:
            metrics["diverged"] = True
            reason = f"loss is {train_loss} at step {done} (attention={gpt_cfg.attention}, p_train={gpt_cfg.p_train})"
            if rank == 0:
                write_failure(run, reason, done)
        if log is not None:
            log.append(metrics, force=val_now or ckpt_now or diverged)
        checkpoint_dir = None
        with tempfile.TemporaryDirectory(prefix="attnlab-ckpt-") as tmp:
            if ckpt_now and not diverged and rank == 0:
                saved = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
                if "stopped" in metrics:
                    saved["stopped"] = metrics["stopped"]
                save_checkpoint(tmp, model=model, optimizer=optimizer, step=done, cfg=cfg_json, gpt_config=gpt_json,
                                metrics=saved)
                checkpoint_dir = tmp
            session.report({k: v for k, v in metrics.items() if not isinstance(v, str)}, checkpoint_dir)
        last = metrics
        t_last, tokens_since = time.perf_counter(), 0
        if diverged or metrics.get("stopped") == STOP_REACHED:
            break
    if log is not None:
        log.flush()
    write_replica_checksum(run, rank, weights_digest(model))
    return last


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of a model's weights: DDP replicas must end byte-identical."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
