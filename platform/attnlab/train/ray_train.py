"""The Ray Train wiring: a ``TorchTrainer`` whose workers run ``train_worker``. The only Ray code of training.

``run_training(cfg, run)`` runs on the embedded local Ray or the cluster ``RAY_ADDRESS`` names; DDP over gloo on
CPU, NCCL on GPU; ``FailureConfig`` restarts a dead worker group from the latest checkpoint; calling it again
with the same ``run`` resumes (Ray finds the run snapshot in the storage). ``run`` is a local folder or an
object-storage URI: it is Ray Train's ``storage_path/name`` itself, so checkpoints and the run's own files
(``attnlab.runfolder``) all end up there, whichever node rank 0 ran on. The training config and the run's location
reach every worker as the objects they are (Ray pickles them), never as dicts or strings parsed again; the
caller has already checked the config against its data (``TrainConfig.check_fits_data``): this process opens none.
Inside a Tune trial pass ``callbacks=[TuneReportCallback()]`` so each report reaches Tune.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from attnlab.location import Location
from attnlab.train.config import TrainConfig
from attnlab.train.loop import LocalSession, train_worker
from attnlab.runfolder import TrainOutcome, outcome

# Environment variables every worker gets (attnlab's own settings, e.g. the storage prefix and the cache, and
# the object-storage endpoint and credentials pyarrow reads).
FORWARDED_ENV_PREFIXES = ("ATTNLAB_", "AWS_", "GOOGLE_")


def forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}


class RayTrainSession:
    """``Session`` for a Ray Train worker of the run at ``run``."""

    def __init__(self, run: Location):
        import ray.train
        import ray.train.torch

        self.run = run
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
            # none of Ray Train's: a run that trained in one process (a study's one-worker trial, ``train --local``)
            # left its checkpoints under ``checkpoints/`` of the same folder
            with LocalSession(self.run).latest_checkpoint() as directory:
                yield directory
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
    """A Ray Train worker: ``config`` holds the ``TrainConfig`` and the run's ``Location`` themselves."""
    train_worker(config["cfg"], RayTrainSession(config["run"]), config["run"])


def worker_resources(cfg: TrainConfig) -> dict[str, float]:
    """What one training worker asks Ray for (an evaluation of the trained model asks for the same)."""
    resources = {"CPU": cfg.cpus_per_worker, **cfg.worker_resources}
    if cfg.gpu:
        resources["GPU"] = cfg.gpus_per_worker
    return resources


def run_training(cfg: TrainConfig, run: str | Path | Location, callbacks=()) -> TrainOutcome:
    """Train with ``cfg.workers`` Ray Train workers; checkpoints and the run's files go to ``run``."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from attnlab.ray_runtime import ensure_ray

    run = Location.parse(run, field="run")
    run.parent.mkdir()
    ensure_ray()
    storage_path, storage_filesystem = run.parent.ray_storage()
    trainer = TorchTrainer(
        _worker,
        train_loop_config={"cfg": cfg, "run": run},
        scaling_config=ray.train.ScalingConfig(num_workers=cfg.workers, use_gpu=cfg.gpu,
                                               resources_per_worker=worker_resources(cfg)),
        run_config=ray.train.RunConfig(
            name=run.name,
            storage_path=storage_path,
            storage_filesystem=storage_filesystem,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
            failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
            callbacks=list(callbacks),
            worker_runtime_env={"env_vars": forwarded_env()},
        ),
    )
    trainer.fit()
    return outcome(run, steps=cfg.steps)
