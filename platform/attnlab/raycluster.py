"""Connecting to Ray: the one place that decides which cluster attnlab runs on.

``ensure_ray()`` joins the cluster ``RAY_ADDRESS`` names (a ``ray job submit`` driver gets it set), or the one
this process already joined, or starts an embedded local Ray. Local clusters get auth disabled and usage stats
off unless the user chose otherwise.

Several embedded clusters on one machine (two studies at once, or a study and a ``train``): Ray's own helpers
that find "the" cluster without being told (the State API behind Train's placement-group cleaner) would see
several and fail with ``Found multiple active Ray instances``. So an embedded cluster's dashboard port is
chosen here, and ``RAY_API_SERVER_ADDRESS`` points at it before the cluster starts: every process of that
cluster inherits it and talks to its own cluster only.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import warnings

LOCAL_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0",
    "RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS": "0",
}
API_SERVER_ENV = "RAY_API_SERVER_ADDRESS"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_ray(num_cpus: int | None = None, object_store_mb: int = 512, dashboard: bool = True,
               log_to_driver: bool = True) -> bool:
    """Make sure this process is connected to Ray. Returns True if this call started a local cluster."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(configure_logging=False, log_to_driver=log_to_driver)
        return False
    for key, value in LOCAL_ENV.items():
        os.environ.setdefault(key, value)
    kwargs = {}
    if dashboard:
        port = _free_port()
        kwargs.update(dashboard_host="127.0.0.1", dashboard_port=port)
        os.environ[API_SERVER_ENV] = f"http://127.0.0.1:{port}"  # inherited by this cluster's processes only
    ray.init(address="local", num_cpus=num_cpus or max(4, os.cpu_count() or 1), include_dashboard=dashboard,
             object_store_memory=object_store_mb * 1024**2, configure_logging=False, log_to_driver=log_to_driver,
             **kwargs)
    return True


def log_file(folder: str, what: str) -> str:
    """A new log file path ``<folder>/<what>-<time>.log`` (the folder is created)."""
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{what}-{time.strftime('%Y%m%d-%H%M%S')}.log")


def quiet_ray(path: str) -> None:
    """Send Ray's, Tune's and Train's own logging, and Python warnings, to the file ``path`` instead of the
    terminal (``ensure_ray(log_to_driver=False)`` keeps the workers' output in Ray's session logs). Errors attnlab
    reports itself still reach the terminal, one line each."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.attnlab_quiet = True  # a later call (the demo's second study) replaces it
    for name in ("ray", "ray.tune", "ray.train", "ray.data", "optuna"):
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            if getattr(old, "attnlab_quiet", False) or not isinstance(old, logging.FileHandler):
                logger.removeHandler(old)
        logger.addHandler(handler)
        logger.propagate = False
    stream = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    def to_file(message, category, filename, lineno, file=None, line=None):
        stream.write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = to_file
