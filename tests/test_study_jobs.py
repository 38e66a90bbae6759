"""A study submitted as a Ray Job to a head started by the test: `ray job submit` and `attnlab study submit`.

The head runs on loopback with its own temp dir and ports (so it never touches the session's ``ray_session``
cluster or anyone else's), and is stopped by ending exactly the processes of that head's session: every
process whose command line names the test's temp dir (``ray stop`` would stop every Ray cluster of the user).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from attnlab.results import ResultsStore
from conftest import without_api_server_env

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STUDY = {"name": "job-tiny",
         "train": {"preset": "tiny", "data": {"synthetic": "copy_distractors", "vocab": 64, "copy_len": 16},
                   "steps": 8, "tokens_per_step": 256, "micro_batch": 4, "lr": 3.0e-3, "warmup_steps": 2,
                   "log_every": 4, "val_every": 4, "val_tokens": 1024, "checkpoint_every": 8, "max_failures": 0,
                   "cpus_per_worker": 0.5},
         "resources": {"trial_cpus": 0.5}, "search": {"engine": "grid"},
         "space": {"attention": ["softmax"]}, "objective": "val_loss@2x",
         "eval": {"multiples": [1, 2], "p_eval": ["none", 3], "max_tokens": 512}}


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _session_pids(temp_dir: str) -> list[int]:
    """Processes whose command line names ``temp_dir``: the Ray processes of the head this test started."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if temp_dir in cmdline:
            pids.append(int(entry.name))
    return pids


def _job_client(address: str):
    from ray.job_submission import JobSubmissionClient

    with without_api_server_env():
        return JobSubmissionClient(address)


@pytest.fixture
def ray_head():
    temp_dir = tempfile.mkdtemp(prefix="rjob", dir="/tmp")  # short: Ray's unix socket paths must stay < 108 chars
    gcs, dash, client, agent, metrics, agent_grpc, runtime_env, node_manager, object_manager = _free_ports(9)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", RAY_AUTH_MODE="disabled",
               RAY_USAGE_STATS_ENABLED="0")
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
           f"--dashboard-agent-listen-port={agent}", f"--metrics-export-port={metrics}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={runtime_env}",
           f"--node-manager-port={node_manager}", f"--object-manager-port={object_manager}",
           "--num-cpus=4", "--object-store-memory=200000000", f"--temp-dir={temp_dir}", "--include-dashboard=true"]
    log = open(Path(temp_dir) / "head.log", "w")
    head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.time() + 120
        while True:
            try:  # the job server itself (a JobSubmissionClient here would follow RAY_API_SERVER_ADDRESS elsewhere)
                with urllib.request.urlopen(f"{address}/api/version", timeout=5) as response:
                    json.loads(response.read())
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.time() > deadline or head.poll() is not None:
                    raise RuntimeError(f"the test's Ray head did not come up: {(Path(temp_dir) / 'head.log').read_text()[-2000:]}")
                time.sleep(1)
        yield {"address": address, "env": env, "temp_dir": temp_dir}
    finally:
        pids = _session_pids(temp_dir)
        for pid in [head.pid, *pids]:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            head.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(2)
        for pid in _session_pids(temp_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_job_submit_runs_a_study_and_only_our_head_is_stopped(ray_session, ray_head, tmp_path):
    study = tmp_path / "job-tiny.yaml"
    study.write_text(yaml.safe_dump(STUDY))
    store, storage = tmp_path / "results", tmp_path / "runs"
    excludes = json.dumps({"excludes": [".venv", "runs", "results", "data", ".git", "*.egg-info"]})
    proc = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", ray_head["address"], "--working-dir", str(ROOT),
         "--runtime-env-json", excludes, "--", "attnlab", "study", "run", str(study), "--store", str(store),
         "--storage", str(storage)],
        env=ray_head["env"], capture_output=True, text=True, timeout=420, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "succeeded" in out.lower()
    assert "study job-tiny: 1 trial(s) 1 complete" in out  # Tune's progress and our summary reach the job log
    rows = ResultsStore(str(store)).read(study="job-tiny", metric="val_loss")
    assert sorted(set(rows.eval_len)) == [64, 128] and len(rows) == 4  # 2 lengths x p_eval {none, 3}

    # The same study through `attnlab study submit --no-wait`: the job finds the trial complete and trains nothing.
    proc = subprocess.run(
        [str(BIN / "attnlab"), "study", "submit", "job-tiny.yaml", "--address", ray_head["address"],
         "--store", str(store), "--storage", str(storage), "--no-wait"],  # working dir: tmp_path (runs/, results/ left out)
        env=ray_head["env"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.split("job id: ")[1].split()[0]
    assert f"ray job logs --address {ray_head['address']} {job_id} -f" in proc.stdout
    client = _job_client(ray_head["address"])
    deadline = time.time() + 300
    while str(client.get_job_status(job_id)).split(".")[-1] not in ("SUCCEEDED", "FAILED", "STOPPED"):
        assert time.time() < deadline, client.get_job_logs(job_id)[-3000:]
        time.sleep(2)
    logs = client.get_job_logs(job_id)
    assert str(client.get_job_status(job_id)).endswith("SUCCEEDED"), logs[-3000:]
    assert "0 trained this run" in logs
    assert len(ResultsStore(str(store)).read(study="job-tiny", metric="val_loss")) == 4
    assert ray_session.is_initialized() and ray_session.cluster_resources().get("CPU") == 4.0


def test_stopping_our_head_leaves_the_session_cluster_alive(ray_session, ray_head):
    assert _session_pids(ray_head["temp_dir"])  # our head's processes are findable by their temp dir
    assert ray_session.get(ray_session.remote(lambda: 41 + 1).remote()) == 42
