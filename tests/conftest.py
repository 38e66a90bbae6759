"""Shared test set-up: offline tokeniser and hub, quiet and fast Ray, one local Ray cluster per session.

Environment variables are set before anything imports Ray, datasets or tiktoken, so every worker
inherits them. Tests never touch the network.
"""

from __future__ import annotations

import os
import tempfile

_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0",
    "RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS": "0",
    "RAY_DEDUP_LOGS": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}
for _k, _v in _ENV.items():
    os.environ.setdefault(_k, _v)
os.environ.setdefault("HF_HOME", os.path.join(tempfile.gettempdir(), "attnlab-test-hf-home"))
os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(tempfile.gettempdir(), "attnlab-test-tiktoken"))

import pytest  # noqa: E402

pytest_plugins = ["conftest_data"]


@pytest.fixture(scope="session", autouse=True)
def _offline_tokenizer():
    """Seed tiktoken's cache from the GPT-2 BPE files a package ships, so get_encoding('gpt2') works offline."""
    from attnlab.data.tokenizer import seed_tiktoken_cache

    seed_tiktoken_cache()


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the whole session (4 logical CPUs on 2 cores, small object store).

    The dashboard is on: Train V2's placement-group cleaner needs the State API, without which a Train
    run inside a Tune trial stopped by ASHA leaks its resources and hangs the next trial.
    """
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=4,
            include_dashboard=True,
            object_store_memory=256 * 1024**2,
            log_to_driver=False,
            configure_logging=False,
        )
    yield ray
    ray.shutdown()
