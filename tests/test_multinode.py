"""A multi-node study shown on one machine: a head and a worker node started as separate ``ray start``
processes, an S3-compatible server (moto, the ``s3_server`` fixture) standing for the bucket, and studies sent
with ``ray job submit``, exactly as on a cloud cluster.

The two nodes carry distinct custom resources: the head ``{"head_node": 1}``, the worker ``{"worker_node": 1}``,
and each ``{"slot": 1}``. A study whose ``train.worker_resources`` asks for ``worker_node`` must train and
evaluate on the worker node; a training run whose two workers each ask for ``slot: 1`` has one DDP rank per node.
Where things ran is read from Ray's State API (the Train worker actors of a job, the ``evaluate-<train_key>``
tasks), not from the host name (both nodes are this machine).

One cluster serves the whole module (its ``ATTNLAB_STORAGE`` is a bucket prefix, as `cluster/*.yaml` set it on
every node); each test has its own bucket or prefix. The cluster's processes are found by their session id (each
``ray start`` runs in a new session), their command line naming a temp dir, or their working dir inside one, and
only those are stopped (``ray stop`` would stop every Ray on the machine).
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
import uuid
from pathlib import Path

import pytest
import yaml

from attnlab.results import ResultsStore
from conftest import multiple_instance_errors, s3_keys, without_api_server_env

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PROBE = {"synthetic": "copy_distractors", "vocab": 64, "copy_len": 16}
TINY_TRAIN = {"preset": "tiny", "data": PROBE, "steps": 8, "tokens_per_step": 256, "micro_batch": 4, "lr": 3.0e-3,
              "warmup_steps": 2, "log_every": 4, "val_every": 4, "val_tokens": 1024, "checkpoint_every": 4,
              "max_failures": 0, "cpus_per_worker": 0.5, "threads_per_worker": 1}


# ------------------------------------------------------------------------------------------ the cluster
def _free_ports(n: int) -> list[int]:
    """Free ports outside Ray's worker-port range (10002-19999, which ``ray start`` refuses for its own)."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not 10002 <= port <= 19999 and port not in ports:
            ports.append(port)
    return ports


def _processes_of(sids: set[int], temp_dirs: list[str]) -> list[int]:
    """Our cluster's processes: in one of ``sids``, or naming / working inside one of ``temp_dirs``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] == "Z":
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            try:
                cwd = os.readlink(entry / "cwd")
            except OSError:
                cwd = ""
        except (OSError, ValueError):
            continue
        if int(fields[3]) in sids or any(d in cmdline or cwd.startswith(d) for d in temp_dirs):
            pids.append(int(entry.name))
    return pids


def _stop_processes(sids: set[int], temp_dirs: list[str]) -> None:
    """SIGTERM, then SIGKILL, exactly the processes :func:`_processes_of` finds."""
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):  # a test cluster: nothing to flush
        for pid in _processes_of(sids, temp_dirs):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait
        while _processes_of(sids, temp_dirs) and time.time() < deadline:
            time.sleep(0.3)


class TwoNodeCluster:
    """A head and a worker node on loopback, each its own ``ray start --block`` process, ports and temp dir."""

    def __init__(self, storage: str):
        self.head_tmp = tempfile.mkdtemp(prefix="mnh", dir="/tmp")  # short: socket paths must stay < 108 chars
        self.worker_tmp = tempfile.mkdtemp(prefix="mnw", dir="/tmp")
        self.storage = storage
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
        # What cluster/*.yaml set on every node: the storage prefix (and, here, the moto endpoint and dummy keys
        # conftest set); PATH so job drivers find `attnlab`.
        env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", RAY_AUTH_MODE="disabled",
                   RAY_USAGE_STATS_ENABLED="0", ATTNLAB_STORAGE=storage)
        self.env = env
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        self.gcs = self.address = ""

    def _start(self, name: str, make_args, temp_dir: str, ready, attempts: int = 8) -> None:
        """``ray start --block ARGS`` until ``ready()``. On a loaded machine a raylet may abort at start-up
        (Ray 2.60's raylet waits 15 s for its dashboard agent's port file, and the agent's imports can take
        longer; seen here at a load average of 20-40 on 2 cores): the attempt's processes are stopped and it
        starts again."""
        for attempt in range(1, attempts + 1):
            args = make_args()  # fresh ports for each attempt
            log = open(Path(temp_dir) / f"{name}-{attempt}.log", "w")
            self.logs.append(log)
            proc = subprocess.Popen([str(BIN / "ray"), "start", "--block", *args], env=self.env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            self.procs.append(proc)
            deadline = time.time() + 180
            while proc.poll() is None and time.time() < deadline:
                try:
                    if ready():
                        return
                except Exception:  # noqa: BLE001 - not up yet
                    pass
                time.sleep(1)
            _stop_processes({proc.pid}, [])
            time.sleep(5)
            if attempt == attempts:
                log.flush()
                raise RuntimeError(f"ray start ({name}) did not come up {attempts} times; the last log:\n"
                                   + Path(log.name).read_text()[-3000:])

    def start(self) -> None:
        def head_args():
            gcs, dash, client, agent, metrics, agent_grpc, runtime_env, nm, om = _free_ports(9)
            self.gcs, self.address = f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}"
            return ["--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--dashboard-host=127.0.0.1",
                    f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
                    f"--dashboard-agent-listen-port={agent}", f"--metrics-export-port={metrics}",
                    f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={runtime_env}",
                    f"--node-manager-port={nm}", f"--object-manager-port={om}", "--include-dashboard=true",
                    "--num-cpus=2", "--object-store-memory=150000000", f"--temp-dir={self.head_tmp}",
                    "--resources=" + json.dumps({"head_node": 1, "slot": 1})]

        def worker_args():
            agent, metrics, agent_grpc, runtime_env, nm, om = _free_ports(6)
            return [f"--address={self.gcs}", "--node-ip-address=127.0.0.1", f"--dashboard-agent-listen-port={agent}",
                    f"--metrics-export-port={metrics}", f"--dashboard-agent-grpc-port={agent_grpc}",
                    f"--runtime-env-agent-port={runtime_env}", f"--node-manager-port={nm}",
                    f"--object-manager-port={om}", "--num-cpus=2", "--object-store-memory=150000000",
                    f"--temp-dir={self.worker_tmp}", "--resources=" + json.dumps({"worker_node": 1, "slot": 1})]

        self._start("head", head_args, self.head_tmp, ready=lambda: self._jobs_reachable() and "head" in self.nodes())
        self._start("worker", worker_args, self.worker_tmp, ready=lambda: len(self.nodes()) == 2)

    def _jobs_reachable(self) -> bool:
        from ray.job_submission import JobSubmissionClient

        JobSubmissionClient(self.address).list_jobs()
        return True

    def nodes(self) -> dict[str, str]:
        """``{"head" | "worker": node_id}`` of the alive nodes."""
        from ray.util.state import list_nodes

        out = {}
        for node in list_nodes(address=self.address, filters=[("state", "=", "ALIVE")], detail=True):
            resources = node.resources_total or {}
            out["worker" if "worker_node" in resources else "head"] = node.node_id
        return out

    def stop(self) -> None:
        _stop_processes({p.pid for p in self.procs}, [self.head_tmp, self.worker_tmp])
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for log in self.logs:
            log.close()
        shutil.rmtree(self.head_tmp, ignore_errors=True)
        shutil.rmtree(self.worker_tmp, ignore_errors=True)

    # ------------------------------------------------------------------------------------- jobs
    def submit(self, cwd: Path, *entrypoint: str, runtime_env: dict | None = None, wait: bool = True,
               submission_id: str | None = None, timeout: float = 420) -> subprocess.CompletedProcess:
        """``ray job submit --working-dir . [--runtime-env-json ...] -- ENTRYPOINT`` run in ``cwd``."""
        cmd = [str(BIN / "ray"), "job", "submit", "--address", self.address, "--working-dir", "."]
        if submission_id:
            cmd += ["--submission-id", submission_id]
        if runtime_env:
            cmd += ["--runtime-env-json", json.dumps(runtime_env)]
        if not wait:
            cmd.append("--no-wait")
        env = {k: v for k, v in self.env.items() if k != "ATTNLAB_STORAGE"}  # the cluster has it, not the laptop
        return subprocess.run([*cmd, "--", *entrypoint], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)

    def job(self, submission_id: str):
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.address).get_job_info(submission_id)

    def job_logs(self, submission_id: str) -> str:
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.address).get_job_logs(submission_id)

    def wait_job(self, submission_id: str, timeout: float = 420) -> str:
        deadline = time.time() + timeout
        while True:
            status = str(self.job(submission_id).status).split(".")[-1]
            if status in ("SUCCEEDED", "FAILED", "STOPPED"):
                return status
            assert time.time() < deadline, self.job_logs(submission_id)[-3000:]
            time.sleep(2)

    # ------------------------------------------------------------------------------------- where things ran
    def train_worker_nodes(self, job_ids: list[str]) -> list[str]:
        """The node of every Ray Train worker actor the given jobs (hex ids) started."""
        from ray.util.state import list_actors

        actors = list_actors(address=self.address, filters=[("class_name", "=", "RayTrainWorker")], detail=True,
                             limit=10_000)
        return [a.node_id for a in actors if a.job_id in job_ids]

    def task_nodes(self, name: str) -> list[str]:
        from ray.util.state import list_tasks

        return [t.node_id for t in list_tasks(address=self.address, filters=[("name", "=", name)], detail=True)]

    def logs_with_multiple_instance_errors(self) -> list[str]:
        """Ray log files of both nodes in which Ray could not tell which cluster to use."""
        hits = []
        for root in (self.head_tmp, self.worker_tmp):
            for path in Path(root).glob("session_2*/logs/*"):
                try:
                    if path.is_file() and multiple_instance_errors(path.read_text(errors="replace")):
                        hits.append(str(path))
                except OSError:
                    pass
        return hits


@pytest.fixture(scope="module")
def cluster(s3_server):
    import boto3

    bucket = f"attnlab-cluster-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    c = TwoNodeCluster(storage=f"s3://{bucket}/attnlab")
    with without_api_server_env():  # the job and State API clients here must reach this cluster
        try:
            c.start()
            yield c
        finally:
            c.stop()
    assert not _processes_of({p.pid for p in c.procs}, [c.head_tmp, c.worker_tmp])


def _local_s3_paths(*roots) -> list[str]:
    """Any file or folder named like ``s3:`` below ``roots``: what ``pathlib`` makes of an ``s3://`` URI."""
    found = []
    for root in roots:
        if not os.path.isdir(root):
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            found += [os.path.join(dirpath, n) for n in dirnames + filenames if n.startswith(("s3:", "gs:"))]
            dirnames[:] = [d for d in dirnames if d not in (".git", ".venv", "node_modules")]
    return found


def _write_study(folder: Path, study: dict) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{study['name']}.yaml"
    path.write_text(yaml.safe_dump(study))
    return path.name


def _job_id(cluster: TwoNodeCluster, submission_id: str) -> str:
    return cluster.job(submission_id).job_id


# ------------------------------------------------------------------------------------------ 1. the study
def test_a_study_on_two_nodes_trains_and_evaluates_on_the_worker_and_writes_only_to_the_bucket(
        cluster, s3_bucket, tmp_path):
    """A driver killed mid-study and run again is tests/test_study_run.py's (one node); a study resumed from the
    bucket's Tune state, training nothing, is the run book's step 5 below. One trial: where a trial trains and
    evaluates is the same for every trial (two took 40 s more and checked nothing new)."""
    # Ray Train workers and evaluation tasks, as a GPU study runs them (a one-worker CPU trial would train in its
    # own process: the submitted study below does)
    study = {"name": "mn-study", "train": {**TINY_TRAIN, "worker_resources": {"worker_node": 1}},
             "resources": {"trial_cpus": 0.5, "max_concurrent_trials": 1, "train_in_trial": False},
             "search": {"engine": "grid"},
             "space": {"seeds": [0]}, "objective": "val_loss@2x",
             "eval": {"multiples": [1, 2], "p_eval": ["none"], "max_tokens": 512}}
    work = tmp_path / "work"
    name = _write_study(work, study)
    storage, store = f"{s3_bucket}/ray", f"{s3_bucket}/results"
    run = ["attnlab", "study", "run", name, "--runs", storage, "--store", store]

    job_id = f"mn-study-{uuid.uuid4().hex[:6]}"
    proc = cluster.submit(work, *run, submission_id=job_id)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "study mn-study: 1 trial(s) 1 complete; 1 trained this run" in out, out[-3000:]
    rows = ResultsStore(store).read(study="mn-study")
    keys = sorted(set(rows.train_key))
    assert len(keys) == 1  # the trial's rows, in the bucket's store
    value_rows = rows[rows.metric == "val_loss"]
    assert value_rows.groupby("train_key").size().tolist() == [2]  # 1x and 2x, once each
    dup_cols = ["train_key", "eval_key", "metric", "eval_len", "p_eval", "window_mode", "bucket", "layer"]
    assert not rows[dup_cols].astype(str).duplicated().any()

    # The Train runs' files are in the bucket: metrics, provenance, checkpoints, replica checksums.
    bucket_keys = s3_keys(s3_bucket)
    for key in keys:
        prefix = f"ray/mn-study/runs/{key}/"
        mine = [k for k in bucket_keys if k.startswith(prefix)]
        assert f"{prefix}metrics.jsonl" in mine and f"{prefix}provenance.json" in mine, mine
        assert f"{prefix}replicas/rank0.sha256" in mine
        assert any(k.startswith(f"{prefix}checkpoint_") for k in mine), mine
    assert any(k.startswith("ray/mn-study/tune/") for k in bucket_keys)
    assert any(k.startswith("results/study=mn-study/") and k.endswith(".parquet") for k in bucket_keys)

    # Training and evaluation ran on the worker node, whichever node the trial's driver sat on.
    nodes = cluster.nodes()
    from ray.job_submission import JobSubmissionClient

    jobs = [j.job_id for j in JobSubmissionClient(cluster.address).list_jobs() if j.job_id]
    train_nodes = cluster.train_worker_nodes(jobs)
    assert train_nodes and set(train_nodes) == {nodes["worker"]}
    for key in keys:
        eval_nodes = cluster.task_nodes(f"evaluate-{key}")
        assert eval_nodes and set(eval_nodes) == {nodes["worker"]}, (key, eval_nodes)

    # Nothing was written to a local folder named s3: (job working-dir copies, both nodes' temp dirs, the cwd).
    assert _local_s3_paths(cluster.head_tmp, cluster.worker_tmp, work, os.getcwd()) == []
    # Train's placement-group cleaner found its own cluster among the several on this machine (attnlab.ray_runtime).
    assert multiple_instance_errors(cluster.job_logs(job_id)) == []
    assert cluster.logs_with_multiple_instance_errors() == []


# ------------------------------------------------------------------------------------------ 2. DDP across nodes
def test_one_training_run_with_a_ddp_rank_on_each_node_ends_with_identical_replicas_in_the_bucket(
        cluster, s3_bucket, tmp_path):
    from attnlab.evaluate import EvalConfig, evaluate_checkpoint
    from attnlab.location import Location
    from attnlab.runfolder import outcome, replica_checksums

    work = tmp_path / "work"
    work.mkdir()
    # slot: 1 on each node and per worker: one rank per node, whatever the scheduler would prefer.
    (work / "ddp.yaml").write_text(yaml.safe_dump({**TINY_TRAIN, "micro_batch": 2, "workers": 2,
                                                   "worker_resources": {"slot": 1}}))
    out = f"{s3_bucket}/runs/ddp"
    job = f"ddp-{uuid.uuid4().hex[:6]}"
    proc = cluster.submit(work, "attnlab", "train", "--config", "ddp.yaml", "--out", out, submission_id=job)
    logs = proc.stdout + proc.stderr
    assert proc.returncode == 0, logs[-4000:]
    assert "status: finished; step 8" in logs, logs[-3000:]

    nodes = cluster.nodes()
    assert sorted(cluster.train_worker_nodes([_job_id(cluster, job)])) == sorted(nodes.values())  # one per node
    run = Location.parse(out)
    replicas = replica_checksums(run)
    assert sorted(replicas) == [0, 1] and replicas[0] == replicas[1]  # byte-identical replicas
    assert run.read_json("provenance.json")["world_size"] == 2
    keys = s3_keys(s3_bucket)
    assert {"runs/ddp/metrics.jsonl", "runs/ddp/provenance.json", "runs/ddp/replicas/rank0.sha256",
            "runs/ddp/replicas/rank1.sha256"} <= set(keys)
    assert any(k.startswith("runs/ddp/checkpoint_") and k.endswith("/state.pt") for k in keys), keys
    assert _local_s3_paths(cluster.head_tmp, cluster.worker_tmp, work, os.getcwd()) == []
    assert multiple_instance_errors(logs) == []

    # Read back from the bucket alone, here (neither node's disk): the run's outcome, and an evaluation of its
    # last checkpoint.
    again = outcome(out, steps=8)
    assert again.status == "finished" and again.final["step"] == 8
    assert again.checkpoint.startswith(f"{out}/checkpoint_")
    rows = evaluate_checkpoint(out, EvalConfig(multiples=[1], max_tokens=256), device="cpu")
    assert rows and rows[0]["train_key"] == again.train_key and rows[0]["step"] == 8


# ------------------------------------------------------------------------------------------ 3. the run book
def _head_shell(cluster: TwoNodeCluster, command: str, cwd: Path = ROOT, timeout: float = 300):
    """A shell on "the head": the cluster's environment (``ATTNLAB_STORAGE`` set, as ``setup_commands`` does) and
    ``RAY_ADDRESS`` = its GCS (the run book's ``RAY_ADDRESS=auto`` there; on this shared machine ``auto`` could
    pick another user's cluster)."""
    return subprocess.run(["bash", "-c", command], cwd=cwd, env={**cluster.env, "RAY_ADDRESS": cluster.gcs},
                          capture_output=True, text=True, timeout=timeout)


def test_the_run_book_works_against_an_s3_compatible_server(cluster, tmp_path):
    """cluster/README.md, sections 0, 3, 4 and 5, with ``ATTNLAB_STORAGE=s3://bucket/attnlab`` on every node and
    only the cloud-specific parts (``ray up``, ``ray exec``, ``ray dashboard``) left out."""
    from attnlab.location import Location

    storage = cluster.storage
    laptop = {k: v for k, v in cluster.env.items() if k != "ATTNLAB_STORAGE"}

    # 0. Check the configs offline: the run book's two commands, through the command's own entry point in this
    #    process (two Python start-ups saved; `attnlab` on PATH is what every job below runs).
    from attnlab.cli import main

    for command in ("cluster validate cluster/aws.yaml cluster/gcp.yaml cluster/kuberay/raycluster.yaml "
                    "cluster/kuberay/rayjob.yaml",
                    # the run book's command; every shipped study against both clusters is test_memory_plan's
                    "study validate --cluster cluster/aws.yaml studies/paper_table4.yaml"):
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            assert main(command.split()) == 0, command
        finally:
            os.chdir(cwd)

    # 3. Prepare the data into the bucket (the demo corpus stands for FineWeb: no network here), then verify it.
    proc = _head_shell(cluster, "attnlab data prepare --source demo --out $ATTNLAB_STORAGE/data/demo "
                                "--shard-tokens 1000000 --val-tokens 200000 --quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = _head_shell(cluster, "attnlab data verify $ATTNLAB_STORAGE/data/demo")
    assert proc.returncode == 0 and proc.stdout.startswith("ok: "), proc.stdout + proc.stderr
    assert Location.parse(f"{storage}/data/demo").exists("manifest.json")

    # 4. Submit with no --runs / --store: the cluster's ATTNLAB_STORAGE decides, for the data too.
    work = tmp_path / "repo"
    (work / "studies").mkdir(parents=True)
    # train.data is relative, as in studies/paper_table4.yaml: inside the job it is read below ATTNLAB_STORAGE.
    study = {"name": "runbook", "train": {**TINY_TRAIN, "data": "data/demo", "steps": 4,
                                          "checkpoint_every": 4, "val_tokens": 512},
             "resources": {"trial_cpus": 0.5}, "search": {"engine": "grid"}, "space": {"attention": ["softmax"]},
             "objective": "val_loss@1x", "eval": {"multiples": [1], "p_eval": ["none"], "max_tokens": 256}}
    (work / "studies" / "runbook.yaml").write_text(yaml.safe_dump(study))
    command = ["attnlab", "study", "run", "studies/runbook.yaml"]
    first = f"runbook-{uuid.uuid4().hex[:6]}"
    proc = cluster.submit(work, *command, submission_id=first)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    logs = subprocess.run([str(BIN / "ray"), "job", "logs", "--address", cluster.address, first], env=laptop,
                          capture_output=True, text=True, timeout=120).stdout  # `ray job logs table4-1`
    assert "study runbook: 1 trial(s) 1 complete; 1 trained this run" in logs, logs[-3000:]
    rows = ResultsStore(f"{storage}/results").read(study="runbook", metric="val_loss")
    assert len(rows) == 1 and rows.data.tolist() == ["demo"]
    provenance = Location.parse(f"{storage}/runs/runbook/runs/{rows.train_key.iloc[0]}").read_json("provenance.json")
    assert provenance["data"]["spec"] == f"{storage}/data/demo"  # the bucket's copy, not the job's working dir
    assert Location.parse(f"{storage}/runs/runbook").exists("study.json")

    # 5. Resume, through the run book's other way to submit (`attnlab study submit`, which follows the job's log):
    #    the same study again trains nothing and adds no row.
    stored = len(ResultsStore(f"{storage}/results").read(study="runbook"))
    proc = subprocess.run([str(BIN / "attnlab"), "study", "submit", "studies/runbook.yaml", "--address",
                           cluster.address], cwd=work, env=laptop, capture_output=True, text=True, timeout=420)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    job_id = proc.stdout.split("job id: ")[1].split()[0]
    assert f"ray job logs --address {cluster.address} {job_id} -f" in proc.stdout
    assert f"job {job_id}: SUCCEEDED" in out
    assert "0 trained this run" in out and "resuming study 'runbook'" in out, out[-3000:]
    assert len(ResultsStore(f"{storage}/results").read(study="runbook")) == stored
    assert _local_s3_paths(cluster.head_tmp, cluster.worker_tmp, work, os.getcwd()) == []
    # A job with neither the flags nor ATTNLAB_STORAGE is refused in one line before it writes anything:
    # tests/test_location.py, in a job's working-dir copy.


# ------------------------------------------------------------------------------------------ 4. a plugin from the laptop
def test_a_submitted_study_runs_the_plugin_bytes_it_was_submitted_with(cluster, s3_bucket, tmp_path):
    """`attnlab study submit --plugin` of docs/plugins.md's example saved on "the laptop", outside the working
    directory: the job's driver loads it from the job's py_modules, the workers from each trial's training config.
    The file is broken right after submitting, and the job still trains, evaluates and stores rows with the bytes
    it was submitted with."""
    from attnlab.attention.plugin import read_source
    from attnlab.location import Location
    from test_study_plugins import worked_example

    plugin = tmp_path / "laptop" / "recency.py"
    plugin.parent.mkdir()
    plugin.write_text(worked_example())
    sha = read_source(str(plugin)).sha256
    study = {"name": "mn-plugin", "train": {**TINY_TRAIN, "steps": 4, "checkpoint_every": 4},
             "resources": {"trial_cpus": 0.5}, "search": {"engine": "grid"}, "space": {"attention": ["recency"]},
             "objective": "val_loss@2x", "eval": {"multiples": [1, 2], "p_eval": ["none"], "max_tokens": 512}}
    work = tmp_path / "work"
    name = _write_study(work, study)
    storage, store = f"{s3_bucket}/ray", f"{s3_bucket}/results"
    laptop = {k: v for k, v in cluster.env.items() if k != "ATTNLAB_STORAGE"}
    proc = subprocess.run([str(BIN / "attnlab"), "study", "submit", name, "--address", cluster.address, "--plugin",
                           "../laptop/recency.py", "--runs", storage, "--store", store, "--no-wait"], cwd=work,
                          env=laptop, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = proc.stdout.split("job id: ")[1].split()[0]
    plugin.write_text("VARIANTS = [  # broken after submitting: nothing on the cluster may read this file\n")

    assert cluster.wait_job(job_id) == "SUCCEEDED", cluster.job_logs(job_id)[-4000:]
    logs = cluster.job_logs(job_id)
    assert "study mn-plugin: 1 trial(s) 1 complete; 1 trained this run" in logs, logs[-3000:]
    rows = ResultsStore(store).read(study="mn-plugin", metric="val_loss")
    assert sorted(rows.eval_len) == [64, 128] and set(rows.attention) == {"recency"}
    assert set(rows.plugin_sha256) == {sha}
    provenance = Location.parse(f"{storage}/mn-plugin/runs/{rows.train_key.iloc[0]}").read_json("provenance.json")
    assert provenance["plugin"] == {"origin": "../laptop/recency.py", "sha256": sha, "attention": "recency"}
    # its one CPU worker trained in the Tune trial's own process (no Ray Train run): the plain process's checkpoints,
    # written straight to the bucket
    prefix = f"ray/mn-plugin/runs/{rows.train_key.iloc[0]}/"
    written = [k for k in s3_keys(s3_bucket) if k.startswith(prefix)]
    assert any(k.startswith(f"{prefix}checkpoints/step_0000004/") for k in written), written
    assert not any(k.startswith(f"{prefix}checkpoint_") for k in written), written
    assert "--plugin-bundle attnlab_job_plugins_" in cluster.job(job_id).entrypoint
