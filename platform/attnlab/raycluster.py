"""Connecting to Ray: the one place that decides which cluster attnlab runs on.

``ensure_ray()`` joins the cluster ``RAY_ADDRESS`` names (a ``ray job submit`` driver gets it set), or the one
this process already joined, or starts an embedded local Ray. Local clusters get auth disabled and usage stats
off unless the user chose otherwise.
"""

from __future__ import annotations

import os

LOCAL_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0",
    "RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS": "0",
}


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
    ray.init(address="local", num_cpus=num_cpus or max(4, os.cpu_count() or 1), include_dashboard=dashboard,
             object_store_memory=object_store_mb * 1024**2, configure_logging=False, log_to_driver=log_to_driver)
    return True
