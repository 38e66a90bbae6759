"""Experiment trackers a study logs to (``trackers: [mlflow, wandb]``): Ray Tune's own logger callbacks, one run
per trial and training steps as steps, each adapted in one class here.

- :class:`StudyMLflowCallback`: MLflow metric names take no ``@``, ``,`` or ``=`` (and ``/`` would nest them under
  ``val_loss``'s own file): ``val_loss@16x,p_eval=15`` is logged as ``val_loss:16x:p_eval-15``.
- :class:`StudyWandbCallback`: Ray forwards only ``WANDB_API_KEY`` to its logging actors, which run in the
  cluster's worker processes; every ``WANDB_*`` setting of the submitting shell (``WANDB_MODE=offline``,
  ``WANDB_DIR``, ``WANDB_ENTITY``, ...) is forwarded too, so the study logs where its user asked. This overrides
  Ray 2.60's ``WandbLoggerCallback._start_logging_actor``, a private method: ``tests/test_study_watch.py`` runs a
  study with W&B offline through it, so a Ray upgrade that changes it fails there.

A Ray module (the study's thin layer): imported by :mod:`attnlab.study.runner` only.
"""

from __future__ import annotations

import importlib.util
import os

import ray
from ray.air.integrations import wandb as ray_wandb
from ray.air.integrations.mlflow import MLflowLoggerCallback

from attnlab.errors import UserError
from attnlab.study.spec import StudySpec
from attnlab.study.folder import StudyFolder

_PACKAGES = {"mlflow": ("mlflow", "mlflow-skinny"), "wandb": ("wandb", "wandb")}


class StudyMLflowCallback(MLflowLoggerCallback):
    """MLflow's logger with metric names MLflow accepts (see the module docstring)."""

    def log_trial_result(self, iteration, trial, result):
        names = {k: k.replace("@", ":").replace(",", ":").replace("=", "-") for k in result}
        super().log_trial_result(iteration, trial, {names[k]: v for k, v in result.items()})


class StudyWandbCallback(ray_wandb.WandbLoggerCallback):
    """W&B's logger whose logging actors see the submitting shell's ``WANDB_*`` settings."""

    def _start_logging_actor(self, trial, exclude_results, **wandb_init_kwargs):
        if not self._remote_logger_class:
            env_vars = {k: v for k, v in os.environ.items() if k.startswith("WANDB_")}
            self._remote_logger_class = ray.remote(
                num_cpus=0, **ray_wandb._force_on_current_node(), runtime_env={"env_vars": env_vars},
                max_restarts=-1, max_task_retries=-1)(self._logger_actor_cls)
        super()._start_logging_actor(trial, exclude_results, **wandb_init_kwargs)


def _require(tracker: str) -> None:
    module, package = _PACKAGES[tracker]
    if importlib.util.find_spec(module) is None:
        raise UserError(f"trackers: {tracker} needs the {package} package ({module} is missing): pip install {package}")


def mlflow_callback(spec: StudySpec, state: StudyFolder) -> StudyMLflowCallback:
    _require("mlflow")
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri and not state.loc.is_local:
        raise UserError("trackers: mlflow with a bucket as runs folder (--runs) needs MLFLOW_TRACKING_URI (an MLflow "
                        "server or a shared file:// folder)")
    if not uri:  # MLflow's local file store next to the study (MLflow 3 asks for an explicit opt-in)
        uri = f"file://{state.loc.child('mlruns').path}"
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    print(f"attnlab: MLflow: {uri} (experiment {spec.name!r})", flush=True)
    return StudyMLflowCallback(tracking_uri=uri, experiment_name=spec.name, save_artifact=False)


def wandb_callback(spec: StudySpec) -> StudyWandbCallback:
    _require("wandb")
    project = os.environ.get("WANDB_PROJECT", spec.name)
    print(f"attnlab: W&B: project {project!r}" + (" (offline)" if os.environ.get("WANDB_MODE") == "offline" else ""),
          flush=True)
    return StudyWandbCallback(project=project, group=spec.name, log_config=True)


def tracker_callbacks(spec: StudySpec, state: StudyFolder) -> list:
    """Ray Tune's logger callbacks for the study's ``trackers`` (each run = one trial, steps = training steps)."""
    return [mlflow_callback(spec, state) if tracker == "mlflow" else wandb_callback(spec) for tracker in spec.trackers]
