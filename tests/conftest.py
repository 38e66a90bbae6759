"""Shared test set-up: offline tokeniser and hub, quiet and fast Ray, one local Ray cluster per session, and an
S3-compatible server on loopback standing for a cloud bucket.

Environment variables are set before anything imports Ray, datasets or tiktoken, so every worker
inherits them (the S3 endpoint included: its port is chosen here, the server starts on first use).
Tests never touch the network beyond 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


S3_PORT = int(os.environ.get("ATTNLAB_TEST_S3_PORT") or _free_port())

from attnlab.ray_runtime import LOCAL_ENV  # noqa: E402

_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    **LOCAL_ENV,  # what attnlab's own local Ray sets (attnlab.ray_runtime imports neither Ray nor torch)
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    # The moto S3 server of the ``s3`` fixture (credentials are moto's dummies, never real ones).
    "AWS_ENDPOINT_URL": f"http://127.0.0.1:{S3_PORT}",
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
# Without a GPU, Triton's interpreter runs attnlab's Triton kernels on CPU tensors (tests/test_attention_triton.py); it is
# chosen when Triton is imported, so here, before anything imports it.
if shutil.which("nvidia-smi") is None:
    _ENV["TRITON_INTERPRET"] = "1"
for _k, _v in _ENV.items():
    os.environ.setdefault(_k, _v)
# Each test process its own moto server: pytest-xdist's workers inherit the controller's environment, and two workers
# on one port was a clash. Never a real endpoint from the environment either.
os.environ["AWS_ENDPOINT_URL"] = _ENV["AWS_ENDPOINT_URL"]
os.environ.setdefault("HF_HOME", os.path.join(tempfile.gettempdir(), "attnlab-test-hf-home"))
os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(tempfile.gettempdir(), "attnlab-test-tiktoken"))

import pytest  # noqa: E402

import fault_injection  # noqa: E402

pytest_plugins = ["conftest_data", "conftest_downstream"]
# The crash tests' fault injection (ATTNLAB_FAIL_*) in this process; the Ray workers get it from ray_session.
fault_injection.install()


@pytest.fixture(scope="session", autouse=True)
def _offline_tokenizer():
    """Seed tiktoken's cache from the GPT-2 BPE files a package ships, so get_encoding('gpt2') works offline."""
    from attnlab.data.tokenizer import seed_tiktoken_cache

    seed_tiktoken_cache()


@pytest.fixture(scope="module", autouse=True)
def _plugins_stay_in_their_test_file():
    """Attention plugins a test file loads are unloaded when it ends: a registered plugin variant is every command's
    variant (``variant_names()``), so one left over would change what later files test."""
    before = _loaded_plugin_hashes()
    yield
    if "attnlab.attention.plugin" in sys.modules:
        from attnlab.attention.plugin import loaded_plugins, unload_plugin

        for loaded in loaded_plugins():
            if loaded.source.sha256 not in before:
                unload_plugin(loaded)


def _loaded_plugin_hashes() -> set[str]:
    if "attnlab.attention.plugin" not in sys.modules:
        return set()
    from attnlab.attention.plugin import loaded_plugins

    return {loaded.source.sha256 for loaded in loaded_plugins()}


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the whole session (4 logical CPUs on 2 cores, small object store).

    The dashboard is on: Train V2's placement-group cleaner needs the State API, without which a Train
    run inside a Tune trial stopped by ASHA leaks its resources and hangs the next trial. Every worker installs the
    crash tests' fault injection as it starts (``fault_injection``, Ray's worker setup hook).
    """
    import ray

    if not ray.is_initialized():
        # This cluster's own dashboard, named for every process of it (as attnlab.ray_runtime does): another
        # Ray on this machine must not make Train's state queries ambiguous.
        port = _free_port()
        os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
        ray.init(
            num_cpus=4,
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            dashboard_port=port,
            object_store_memory=256 * 1024**2,
            log_to_driver=False,
            configure_logging=False,
            runtime_env={"worker_process_setup_hook": fault_injection.ray_setup_hook()},
        )
    yield ray
    ray.shutdown()


# The heaviest files first (seconds of a CI run on 2 cores, 2026-11-27): `make test` runs the suite on two
# pytest-xdist workers, a file at a time (``--dist loadfile``), handing each worker the next file in this order; a
# heavy file left for last would run alone while the other worker idles (`--no-loadscope-reorder` keeps this order).
# The rest keep their alphabetical order.
HEAVY_FIRST = ("test_multinode.py", "test_cuda_proxy_attention.py", "test_study_run.py", "test_study_outcomes.py",
               "test_train.py", "test_start_and_exit.py",
               "test_downstream.py", "test_bench_gpu.py", "test_trial_counts.py", "test_cluster.py",
               "test_serve_browser.py", "test_data_streaming.py", "test_attention_flex.py", "test_study_stages.py",
               "test_embedded_clusters.py", "test_evaluate.py", "test_study_watch.py", "test_model_compile.py",
               "test_model_plugins.py", "test_memory_plan.py", "test_attention_plugins.py",
               "test_attention_baselines.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


def wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float, failure: str) -> None:
    """Return once something listens on 127.0.0.1:``port``; RuntimeError(``failure``) if ``proc`` exits first or
    ``timeout_s`` passes."""
    deadline = time.time() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(failure) from None
            time.sleep(0.1)


@pytest.fixture(scope="session")
def s3_server():
    """An S3-compatible server (moto) on 127.0.0.1:S3_PORT for the whole session; yields its endpoint URL.

    moto's server keeps objects in memory and speaks the S3 REST API that pyarrow's S3 filesystem and boto3
    use, so the code under test talks to it exactly as to a cloud bucket (chosen over MinIO: a pip install,
    no binary download).
    """
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    log = open(os.path.join(tempfile.gettempdir(), f"attnlab-test-moto-{S3_PORT}.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(S3_PORT)],
                            stdout=log, stderr=subprocess.STDOUT)
    wait_for_port(S3_PORT, proc, 60, f"moto server did not start (see {log.name})")
    yield endpoint
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh, empty bucket on the moto server; yields its ``s3://name`` URI."""
    import boto3

    name = f"attnlab-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    yield f"s3://{name}"


def s3_keys(bucket_uri: str) -> list[str]:
    """Every object key in a bucket (for assertions on what landed there)."""
    import boto3

    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    keys, token = [], None
    while True:
        kwargs = {"Bucket": bucket_uri[len("s3://"):], **({"ContinuationToken": token} if token else {})}
        page = client.list_objects_v2(**kwargs)
        keys += [item["Key"] for item in page.get("Contents", [])]
        if not page.get("IsTruncated"):
            return sorted(keys)
        token = page["NextContinuationToken"]


MULTIPLE_INSTANCES = "Found multiple active Ray instances"


def multiple_instance_errors(text: str) -> list[str]:
    """Lines of ``text`` where Ray could not tell which of several clusters on this machine to use (see
    ``attnlab.ray_runtime``). Ray's job supervisor logs a warning with the same words when it picks its own cluster
    from its temp dir's address file ("... Connecting to latest cluster at ..."): that one found the right cluster
    and is not an error."""
    return [line for line in text.splitlines()
            if MULTIPLE_INSTANCES in line and "Connecting to latest cluster" not in line]


@contextlib.contextmanager
def without_api_server_env():
    """Ray's job and State API clients follow ``RAY_API_SERVER_ADDRESS`` over the address they are given, and
    ``ray_session`` points it at the session cluster: a test talking to a cluster of its own clears it meanwhile."""
    saved = os.environ.pop("RAY_API_SERVER_ADDRESS", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["RAY_API_SERVER_ADDRESS"] = saved
