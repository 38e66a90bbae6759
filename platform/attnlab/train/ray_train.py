"""The Ray Train wiring: a ``TorchTrainer`` whose workers run ``train_worker``. The only Ray code of training.

``run_training(cfg, run_dir)`` runs on the embedded local Ray or the cluster ``RAY_ADDRESS`` names; DDP over
gloo on CPU, NCCL on GPU; ``FailureConfig`` restarts a dead worker group from the latest checkpoint; calling it
again with the same ``run_dir`` resumes (Ray finds the run snapshot in the storage folder).
Inside a Tune trial pass ``callbacks=[TuneReportCallback()]`` so each report reaches Tune.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from attnlab.errors import UserError
from attnlab.model.checkpoint import find_latest_checkpoint
from attnlab.train.config import TrainConfig
from attnlab.train.loop import FAILURE_FILE, METRICS_FILE, train_worker


@dataclass
class TrainOutcome:
    run_dir: str
    status: str  # "finished" | "diverged"
    final: dict  # the last metrics line
    checkpoint: str | None
    failure: str | None = None


class RayTrainSession:
    """``Session`` for a Ray Train worker."""

    def __init__(self):
        import ray.train
        import ray.train.torch

        ctx = ray.train.get_context()
        self.rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device()

    def prepare_model(self, model):
        import ray.train.torch

        return ray.train.torch.prepare_model(model) if self.world_size > 1 else model

    @contextlib.contextmanager
    def latest_checkpoint(self):
        import ray.train

        ckpt = ray.train.get_checkpoint()
        if ckpt is None:
            yield None
        else:
            with ckpt.as_directory() as directory:
                yield directory

    def report(self, metrics, checkpoint_dir):
        import ray.train

        ckpt = ray.train.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
        ray.train.report(metrics, checkpoint=ckpt)

    def all_reduce_sum(self, values):
        import torch
        import torch.distributed as dist

        if self.world_size == 1 or not dist.is_initialized():
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t)
        return t.tolist()


def _worker(config: dict) -> None:
    cfg = TrainConfig.model_validate(config["cfg"])
    train_worker(cfg, RayTrainSession(), config["run_dir"])


def preflight(cfg: TrainConfig):
    """Check what can be checked before any worker starts: the data, and that seq_len fits it."""
    from attnlab.data.source import open_data

    if not cfg.data:
        raise UserError("train.data is required: a folder made by `attnlab data prepare`, or {synthetic: TASK}")
    data = open_data(cfg.data)
    if data.min_tokens() < cfg.seq_length + 1:
        raise UserError(f"train.seq_len={cfg.seq_length} does not fit the data: {data.describe()} has a split of "
                        f"{data.min_tokens()} tokens (needs at least seq_len + 1)")
    cfg.gpt_config(vocab_size=data.vocab_size)
    cfg.batch_plan(cfg.workers)
    return data


def run_training(cfg: TrainConfig, run_dir: str | Path, callbacks=(), run_name: str | None = None) -> TrainOutcome:
    """Train with ``cfg.workers`` Ray Train workers; checkpoints and metrics go to ``run_dir``."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from attnlab.raycluster import ensure_ray

    preflight(cfg)
    run_dir = Path(run_dir).resolve()
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    ensure_ray()
    resources = {"CPU": cfg.cpus_per_worker}
    if cfg.gpu:
        resources["GPU"] = cfg.gpus_per_worker
    trainer = TorchTrainer(
        _worker,
        train_loop_config={"cfg": cfg.model_dump(mode="json"), "run_dir": str(run_dir)},
        scaling_config=ray.train.ScalingConfig(num_workers=cfg.workers, use_gpu=cfg.gpu, resources_per_worker=resources),
        run_config=ray.train.RunConfig(
            name=run_name or run_dir.name,
            storage_path=str(run_dir.parent),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
            failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
            callbacks=list(callbacks),
            # attnlab's own settings (e.g. the test-only fault injection) reach the workers too
            worker_runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith("ATTNLAB_")}},
        ),
    )
    trainer.fit()
    return outcome(run_dir)


def outcome(run_dir: str | Path) -> TrainOutcome:
    """Read a run folder's result: its last metrics, latest checkpoint and failure reason, if any."""
    run_dir = Path(run_dir)
    lines = (run_dir / METRICS_FILE).read_text().splitlines() if (run_dir / METRICS_FILE).exists() else []
    final = json.loads(lines[-1]) if lines else {}
    failure = json.loads((run_dir / FAILURE_FILE).read_text())["reason"] if (run_dir / FAILURE_FILE).exists() else None
    try:
        ckpt = str(find_latest_checkpoint(run_dir))
    except UserError:
        ckpt = None
    return TrainOutcome(str(run_dir), "diverged" if failure else "finished", final, ckpt, failure)
