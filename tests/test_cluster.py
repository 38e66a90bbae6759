"""Cluster configs: launcher YAMLs and KubeRay manifests validate offline, studies fit them, and the
fake multi-node autoscaler really adds and removes a worker node on this machine.

The autoscaling test starts its OWN Ray cluster (own temp dir, own ports, own process session) and
stops only the processes of that session; it never touches the session's ``ray_session`` cluster.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from attnlab.cluster import fit as cf
from attnlab.cluster import validate as cv
from attnlab.errors import UserError
from conftest import without_api_server_env

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
LAUNCHER_CONFIGS = [CLUSTER / "aws.yaml", CLUSTER / "gcp.yaml", CLUSTER / "local-fake.yaml"]
CLOUD_CONFIGS = [CLUSTER / "aws.yaml", CLUSTER / "gcp.yaml", CLUSTER / "kuberay" / "raycluster.yaml"]
KUBERAY_MANIFESTS = [CLUSTER / "kuberay" / "raycluster.yaml", CLUSTER / "kuberay" / "rayjob.yaml"]
STUDIES = sorted((ROOT / "studies").glob("*.yaml"))


def _write_variant(tmp_path: Path, source: Path, old: str, new: str) -> Path:
    text = source.read_text()
    assert old in text, f"{old!r} not in {source}"
    out = tmp_path / source.name
    out.write_text(text.replace(old, new, 1))
    return out


# ---------------------------------------------------------------------------------------------
# Launcher YAMLs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", LAUNCHER_CONFIGS, ids=lambda p: p.name)
def test_launcher_config_validates(path):
    config = cv.validate_launcher_config(path)
    assert config["idle_timeout_minutes"] > 0
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0  # the head never trains


# The CUDA build the GPU nodes install (cluster/README.md#torch-and-the-nvidia-driver: NVIDIA driver >= 525).
TORCH_CUDA_INDEX = "https://download.pytorch.org/whl/cu126"


def test_gpu_nodes_install_the_torch_the_tests_run():
    # An unpinned torch>=2.9 took PyPI's newest CUDA wheel on the nodes: a version the tests never ran, possibly
    # built for a CUDA newer than the nodes' driver. Every place that installs torch on a GPU pins this one.
    import torch

    pin = f"torch=={torch.__version__.split('+')[0]}"

    def pinned(line: str) -> bool:
        return "pip install" in line and pin in line.split() and f"--index-url {TORCH_CUDA_INDEX}" in line

    for path in (CLUSTER / "aws.yaml", CLUSTER / "gcp.yaml"):
        commands = yaml.safe_load(path.read_text())["setup_commands"]
        first = next(i for i, c in enumerate(commands) if "pip install" in c and "torch" in c.split("#")[0])
        attnlab = next(i for i, c in enumerate(commands) if "-e ~/attnlab" in c)
        assert pinned(commands[first]) and first < attnlab, (path.name, commands[first])
    runs = [line for line in (CLUSTER / "kuberay" / "Dockerfile").read_text().splitlines() if line.startswith("RUN")]
    assert pinned(runs[0]) and "-e ." in runs[-1], runs
    tag = f"ray2.60.0-{pin.replace('==', '')}-cu126"
    for manifest in ("raycluster.yaml", "rayjob.yaml"):
        images = [ln.split("image:")[1].strip() for ln in (CLUSTER / "kuberay" / manifest).read_text().splitlines()
                  if "image:" in ln]
        assert images and all(image.endswith(tag) for image in images), (manifest, images)
    makefile = (CLUSTER.parent / "Makefile").read_text()
    assert any(pinned(line) for line in makefile.splitlines())  # `make` on a GPU machine (bench-gpu)
    readme = (CLUSTER / "README.md").read_text()
    assert "### Torch and the NVIDIA driver" in readme and ">= 525" in readme and pin.replace("==", " ") in readme


@pytest.mark.parametrize("path", [CLUSTER / "aws.yaml", CLUSTER / "gcp.yaml"], ids=lambda p: p.name)
def test_cloud_launcher_config_content(path):
    config = yaml.safe_load(path.read_text())
    a100 = config["available_node_types"]["gpu.a100"]
    assert a100["min_workers"] == 0 and a100["max_workers"] >= 1
    machine = a100["node_config"].get("InstanceType") or a100["node_config"].get("machineType")
    assert machine in {"p4d.24xlarge", "p4de.24xlarge", "a2-ultragpu-8g"}
    assert cv.INSTANCE_TYPES[config["provider"]["type"]][machine]["GPU"] == 8
    # attnlab installed from the working dir on every node
    assert config["file_mounts"]["~/attnlab"] == "."
    assert any("pip install" in c and "-e ~/attnlab" in c for c in config["setup_commands"])
    # storage location set once, in the env, on a bucket
    scheme = "s3://" if config["provider"]["type"] == "aws" else "gs://"
    assert any(f"ATTNLAB_STORAGE={scheme}" in c for c in config["setup_commands"])
    # dashboard/job server bound to the head's loopback, token auth on, token file shipped
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start and "RAY_AUTH_MODE=token" in head_start
    assert "RAY_AUTH_MODE=token" in " ".join(config["worker_start_ray_commands"])
    assert "~/.ray/auth_token" in config["file_mounts"]


def test_aws_h100_type_is_optional_and_spot_documented():
    config = yaml.safe_load((CLUSTER / "aws.yaml").read_text())
    h100 = config["available_node_types"]["gpu.h100"]
    assert h100["node_config"]["InstanceType"] == "p5.48xlarge"
    assert h100["max_workers"] == 0  # off until the user raises it
    assert "MarketType: spot" in (CLUSTER / "aws.yaml").read_text()


def test_schema_catches_typo_key(tmp_path):
    bad = _write_variant(tmp_path, CLUSTER / "aws.yaml", "idle_timeout_minutes:", "idle_timeout_minute:")
    with pytest.raises(UserError, match=r"'idle_timeout_minute' was unexpected"):
        cv.validate_launcher_config(bad)


def test_schema_catches_fractional_resource(tmp_path):
    bad = _write_variant(tmp_path, CLUSTER / "gcp.yaml", '{"CPU": 96, "GPU": 8}', '{"CPU": 96, "GPU": 0.5}')
    with pytest.raises(UserError, match=r"available_node_types\.gpu\.a100\.resources\.GPU: 0\.5 is not of type 'integer'"):
        cv.validate_launcher_config(bad)


def test_ray_validate_config_catches_min_over_global_max(tmp_path):
    bad = _write_variant(tmp_path, CLUSTER / "aws.yaml", "    min_workers: 0\n    max_workers: 4\n", "    min_workers: 9\n    max_workers: 9\n")
    with pytest.raises(UserError, match="max_workers"):
        cv.validate_launcher_config(bad)


def test_gcp_declared_gpus_cannot_exceed_machine(tmp_path):
    bad = _write_variant(tmp_path, CLUSTER / "gcp.yaml", '{"CPU": 96, "GPU": 8}', '{"CPU": 96, "GPU": 16}')
    with pytest.raises(UserError, match=r"'gpu\.a100' declares GPU: 16 but a2-ultragpu-8g has 8"):
        cv.load_node_types(bad)


def test_aws_resources_come_from_instance_table():
    nodes, cap = cv.load_node_types(CLUSTER / "aws.yaml")
    by_name = {n.name: n for n in nodes}
    assert (by_name["gpu.a100"].cpus, by_name["gpu.a100"].gpus, by_name["gpu.a100"].max_nodes) == (96, 8, 4)
    assert (by_name["gpu.h100"].cpus, by_name["gpu.h100"].gpus, by_name["gpu.h100"].max_nodes) == (192, 8, 0)
    assert (by_name["head.cpu"].cpus, by_name["head.cpu"].is_head) == (4, True)  # explicit wins over 8 vCPU
    assert cap == 8


def test_missing_config_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        cf.check_fits({"workers": 1}, tmp_path / "nope.yaml")


# ---------------------------------------------------------------------------------------------
# KubeRay manifests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", KUBERAY_MANIFESTS, ids=lambda p: p.name)
def test_kuberay_manifest_validates(path):
    (doc,) = cv.validate_kuberay_manifest(path)
    assert doc["apiVersion"] == "ray.io/v1"


def test_raycluster_gpu_autoscaling_and_auth():
    (doc,) = yaml.safe_load_all((CLUSTER / "kuberay" / "raycluster.yaml").read_text())
    spec = doc["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    assert spec["autoscalerOptions"]["upscalingMode"] in {"Default", "Conservative", "Aggressive"}
    assert spec["authOptions"]["mode"] == "token"
    assert spec["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP"
    head_limits = spec["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "nvidia.com/gpu" not in head_limits
    (gpu_group,) = [g for g in spec["workerGroupSpecs"] if g["groupName"] == "a100"]
    assert gpu_group["minReplicas"] == 0 and gpu_group["maxReplicas"] >= 1
    container = gpu_group["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "8"
    nodes, cap = cv.load_node_types(CLUSTER / "kuberay" / "raycluster.yaml")
    assert [(n.name, n.cpus, n.gpus, n.max_nodes) for n in nodes] == [("head", 4, 0, 1), ("a100", 88, 8, 4)]
    assert cap == 4


def test_rayjob_runs_an_existing_study_on_the_cluster():
    (job,) = yaml.safe_load_all((CLUSTER / "kuberay" / "rayjob.yaml").read_text())
    (cluster,) = yaml.safe_load_all((CLUSTER / "kuberay" / "raycluster.yaml").read_text())
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    entrypoint = job["spec"]["entrypoint"].split()
    assert entrypoint[:3] == ["attnlab", "study", "run"]
    study = entrypoint[3]
    assert study == "studies/paper_table4.yaml"
    assert "--runs" in entrypoint and "--store" in entrypoint
    assert (ROOT / study).is_file(), f"the RayJob runs {study}, which does not exist"


@pytest.mark.parametrize(
    "old,new,message",
    [
        ("maxReplicas: 4", "maxReplica: 4", r"workerGroupSpecs\[0\]: .*'maxReplica' was unexpected"),
        ("upscalingMode: Default", "upscalingMode: Fast", r"'Fast' is not one of \['Default', 'Aggressive', 'Conservative'\]"),
        ('num-cpus: "4"', "num-cpus: 4", r"rayStartParams\.num-cpus: 4 is not of type 'string'"),
        ("- groupName: a100", "- groupNam: a100", r"'groupNam' was unexpected"),
        ("authOptions:\n    mode: token", "authOptions:\n    mode: tokens", r"authOptions\.mode: 'tokens' is not one of"),
    ],
)
def test_kuberay_strict_schema_catches(tmp_path, old, new, message):
    bad = _write_variant(tmp_path, CLUSTER / "kuberay" / "raycluster.yaml", old, new)
    with pytest.raises(UserError, match=message):
        cv.validate_kuberay_manifest(bad)


def test_rayjob_strict_schema_catches_typo(tmp_path):
    bad = _write_variant(tmp_path, CLUSTER / "kuberay" / "rayjob.yaml", "submissionMode:", "submisionMode:")
    with pytest.raises(UserError, match="'submisionMode' was unexpected"):
        cv.validate_kuberay_manifest(bad)


def test_strictify_keeps_preserve_unknown_fields_open():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"x": {"type": "string"}}},
            "b": {"type": "object", "properties": {"y": {}}, "x-kubernetes-preserve-unknown-fields": True},
            "c": {"type": "array", "items": {"type": "object", "properties": {"z": {}}}},
        },
    }
    strict = cv.strictify(schema)
    assert strict["additionalProperties"] is False
    assert strict["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in strict["properties"]["b"]
    assert strict["properties"]["c"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is not modified


def test_vendored_schemas_are_v1_kuberay_schemas_and_extraction_round_trips(tmp_path):
    """The vendored files are KubeRay v1 schemas of both kinds, and `extract-crd` on a CRD made from one gives
    back exactly that file (the regeneration path of platform/attnlab/cluster/kuberay_schemas/README.md)."""
    for kind in cv.KUBERAY_KINDS:
        vendored = json.loads(gzip.decompress(cv.vendored_schema_path(kind).read_bytes()))
        assert (vendored["group"], vendored["kind"], vendored["version"]) == ("ray.io", kind, "v1")
        assert "v1.7.0" in vendored["source"]
        assert vendored["openAPIV3Schema"]["properties"]["spec"]["type"] == "object"
        crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
               "spec": {"group": "ray.io", "names": {"kind": kind},
                        "versions": [{"name": "v1alpha1", "schema": {"openAPIV3Schema": {"type": "object"}}},
                                     {"name": "v1", "schema": {"openAPIV3Schema": vendored["openAPIV3Schema"]}}]}}
        source = tmp_path / f"{kind}.yaml"
        source.write_text(yaml.safe_dump(crd))
        extracted = cv.extract_crd_schema(source)
        assert extracted["openAPIV3Schema"] == vendored["openAPIV3Schema"]
        assert (extracted["kind"], extracted["version"]) == (kind, "v1")
        assert vendored["kind"] == kind and vendored["version"] == "v1"


def test_kuberay_licence_notice_is_kept():
    notice = (cv.KUBERAY_SCHEMA_DIR / "README.md").read_text()
    assert "Apache" in notice and "KubeRay" in notice and "v1.7.0" in notice


# ---------------------------------------------------------------------------------------------
# Resource fit
# ---------------------------------------------------------------------------------------------

PAPER_TRIAL = {"workers": 8, "gpus_per_worker": 1, "cpus_per_worker": 8, "max_concurrent_trials": 4}


@pytest.mark.parametrize("config", CLOUD_CONFIGS, ids=lambda p: p.name)
def test_eight_gpu_trial_fits_one_node(config):
    cf.check_fits(PAPER_TRIAL, config)
    fit = cf.plan_fit(PAPER_TRIAL, config)
    assert list(fit.nodes_per_trial.values()) == [1] and not fit.spans_nodes
    assert fit.gpus_per_trial == 8
    assert fit.concurrent_trials == 4  # 4 A100 nodes x 8 GPUs / 8 GPUs per trial


def test_trial_spans_nodes_when_allowed():
    fit = cf.plan_fit({"workers": 16, "gpus_per_worker": 1, "cpus_per_worker": 8}, CLUSTER / "aws.yaml")
    assert fit.nodes_per_trial == {"gpu.a100": 2} and fit.spans_nodes
    assert fit.concurrent_trials == 2  # 32 GPUs / 16
    fit = cf.plan_fit({"workers": 32, "gpus_per_worker": 0.5, "cpus_per_worker": 2}, CLUSTER / "gcp.yaml")
    assert fit.workers_per_node["gpu.a100"] == 16 and fit.nodes_per_trial == {"gpu.a100": 2}


def test_cpu_only_trial_prefers_a_cpu_node():
    fit = cf.plan_fit({"workers": 2, "gpus_per_worker": 0, "cpus_per_worker": 1}, CLUSTER / "aws.yaml")
    assert fit.nodes_per_trial == {"head.cpu": 1}


def test_worker_too_big_for_any_node_is_refused():
    with pytest.raises(UserError) as err:
        cf.check_fits({"workers": 1, "gpus_per_worker": 16, "cpus_per_worker": 8}, CLUSTER / "aws.yaml")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("resources: one worker needs 16 GPU + 8 CPU but no node type in aws.yaml has that")
    assert "gpu.a100: 8 GPU/96 CPU x4" in message


def test_too_many_workers_is_refused():
    with pytest.raises(UserError, match=r"64 workers .* need 64 GPUs/512 CPUs at once but raycluster\.yaml can place at most 32"):
        cf.check_fits({"workers": 64, "gpus_per_worker": 1, "cpus_per_worker": 8}, CLUSTER / "kuberay" / "raycluster.yaml")
    # CPUs per worker can be the limit too: 88 CPUs per pod / 12 = 7 workers per node.
    with pytest.raises(UserError, match="at most 28 such workers"):
        cf.check_fits({"workers": 32, "gpus_per_worker": 1, "cpus_per_worker": 12}, CLUSTER / "kuberay" / "raycluster.yaml")


def test_global_max_workers_caps_the_span(tmp_path):
    capped = _write_variant(tmp_path, CLUSTER / "aws.yaml", "max_workers: 8                 #", "max_workers: 1                 #")
    cf.check_fits(PAPER_TRIAL, capped)
    with pytest.raises(UserError, match="at most 8 such workers"):
        cf.check_fits({"workers": 16, "gpus_per_worker": 1, "cpus_per_worker": 8}, capped)


@pytest.mark.parametrize(
    "request_,message",
    [
        ({"workers": 0}, r"resources\.workers: 0 is not allowed"),
        ({"workers": 2.5}, r"resources\.workers: 2\.5 is not allowed"),
        ({"gpus_per_worker": -1}, r"resources\.gpus_per_worker: -1 is not allowed"),
        ({"gpu_per_worker": 1}, r"unknown key\(s\) \['gpu_per_worker'\]"),
    ],
)
def test_malformed_request_is_a_user_error(request_, message):
    with pytest.raises(UserError, match=message):
        cf.check_fits(request_, CLUSTER / "aws.yaml")


def test_the_shipped_studies_are_there():
    names = {p.name for p in STUDIES}
    assert {"smoke.yaml", "demo_probe.yaml", "probe_copy.yaml", "paper_table4.yaml"} <= names, names


@pytest.mark.parametrize("config", CLOUD_CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("study", STUDIES, ids=lambda p: p.name)
def test_every_study_fits_each_cloud_config(study, config):
    from attnlab.study.spec import load_spec

    cf.check_fits(load_spec(study).resource_request(), config)


def test_a_study_resource_request_is_the_one_request_shape(tmp_path):
    from attnlab.study.spec import load_spec

    study = tmp_path / "s.yaml"
    study.write_text("name: x\ntrain: {preset: tiny, data: demo, tokens_per_step: 8192, workers: 8, gpus_per_worker: 1}\nresources: {trial_cpus: 0.5}\n")
    request = load_spec(study).resource_request()
    assert request == cf.normalise_request(request)
    assert request == {"workers": 8, "gpus_per_worker": 1.0, "cpus_per_worker": 1.0, "max_concurrent_trials": 1,
                       "trial_cpus": 0.5}


def test_a_trial_that_trains_in_its_own_process_is_placed_as_one_bundle(tmp_path):
    """One CPU worker trains in the Tune trial's process: the trial asks for its driver's and the worker's CPUs (and
    the worker's resources) as one bundle, and the fit check places that bundle on one node."""
    from attnlab.study.spec import load_spec

    text = ("name: x\ntrain: {preset: tiny, data: demo, cpus_per_worker: 2, worker_resources: {fast: 1}}\n"
            "resources: {trial_cpus: 0.5%s}\n")
    (tmp_path / "a.yaml").write_text(text % "")
    (tmp_path / "b.yaml").write_text(text % ", train_in_trial: false")
    here, ray_train = load_spec(tmp_path / "a.yaml"), load_spec(tmp_path / "b.yaml")
    assert here.trains_in_trial() and not ray_train.trains_in_trial()
    assert here.trial_bundle() == {"CPU": 2.5, "fast": 1} and ray_train.trial_bundle() == {"CPU": 0.5}
    assert here.resource_request()["cpus_per_worker"] == 2.5 and ray_train.resource_request()["cpus_per_worker"] == 2
    assert here.trial_resources() == ray_train.trial_resources() == {"CPU": 2.5, "GPU": 0}


def test_a_trial_driver_bigger_than_every_node_is_refused():
    with pytest.raises(UserError, match=r"trial driver needs 500 CPU"):
        cf.check_fits({"workers": 1, "trial_cpus": 500}, CLUSTER / "aws.yaml")


def test_cli_exit_codes(tmp_path, capsys):
    from attnlab.cli import main

    assert main(["cluster", "validate", str(CLUSTER / "kuberay" / "rayjob.yaml")]) == 0
    bad = _write_variant(tmp_path, CLUSTER / "kuberay" / "rayjob.yaml", "submissionMode:", "submisionMode:")
    assert main(["cluster", "validate", str(bad)]) == 2
    assert capsys.readouterr().err.startswith("attnlab: error: ")
    capsys.readouterr()
    smoke = str(ROOT / "studies" / "smoke.yaml")
    assert main(["study", "validate", "--cluster", str(CLUSTER / "aws.yaml"), smoke]) == 0
    out = capsys.readouterr().out
    assert "fits aws.yaml: nodes per trial" in out and "GPU memory" in out, out
    # a study's fit is one command: its earlier place says where it went, in one line
    assert main(["cluster", "fits", "--config", str(CLUSTER / "aws.yaml"), "studies/smoke.yaml"]) == 2
    assert capsys.readouterr().err.strip() == ("attnlab: error: cluster fits: a study's fit is checked by `attnlab "
                                               f"study validate --cluster {CLUSTER / 'aws.yaml'} studies/smoke.yaml`")


def test_no_credentials_in_cluster_files():
    patterns = [r"AKIA[0-9A-Z]{16}", r"aws_secret_access_key", r"BEGIN [A-Z ]*PRIVATE KEY", r'"private_key"', r"ghp_[A-Za-z0-9]{20,}"]
    for path in CLUSTER.rglob("*"):
        if path.is_file() and path.suffix in {".yaml", ".md", ""}:
            text = path.read_text(errors="replace")
            for pattern in patterns:
                assert not re.search(pattern, text), f"{path} matches {pattern}"


# ---------------------------------------------------------------------------------------------
# Autoscaling for real: Ray's fake multi-node provider on this machine
# ---------------------------------------------------------------------------------------------

# The workload: a tiny attnlab study whose two trials train (and are evaluated) with
# train.worker_resources = {fake_gpu_node: 1}, a resource only the fake.gpu worker nodes have, as real studies'
# trials need GPUs the head lacks. The Tune trial drivers need only resources.trial_cpus, which the head gives.
# `attnlab study run` joins the cluster through RAY_ADDRESS; this watcher, a second driver on the same cluster,
# starts it and counts the live nodes while it runs and after it ends.
_STUDY = {
    "name": "autoscale",
    "train": {"preset": "tiny", "data": {"synthetic": "copy_distractors", "vocab": 64, "copy_len": 16}, "steps": 4,
              "tokens_per_step": 256, "micro_batch": 4, "lr": 3.0e-3, "warmup_steps": 1, "log_every": 2,
              "val_every": 4, "val_tokens": 512, "checkpoint_every": 4, "max_failures": 0, "cpus_per_worker": 0.5,
              "threads_per_worker": 1, "worker_resources": {"fake_gpu_node": 1}},
    # one trial: a node added for it and removed when idle is the behaviour (a second trial added a second node, 10 s
    # more on 2 cores, and checked nothing new)
    "resources": {"trial_cpus": 0.25, "max_concurrent_trials": 1}, "search": {"engine": "grid"},
    "space": {"seeds": [0]}, "objective": "val_loss@1x",
    "eval": {"multiples": [1], "p_eval": ["none"], "max_tokens": 256},
}
_WATCHER = r"""
import json, os, subprocess, sys, time
import ray

address, log_path, command = sys.argv[1], sys.argv[2], sys.argv[3:]
ray.init(address=address, log_to_driver=False, configure_logging=False)

def alive():
    return sum(1 for n in ray.nodes() if n["Alive"])

t0 = time.time()
print(json.dumps({"event": "start", "nodes": alive()}), flush=True)
with open(log_path, "w") as log:
    study = subprocess.Popen(command, env={**os.environ, "RAY_ADDRESS": address}, stdout=log, stderr=subprocess.STDOUT)
    peak = 1
    while study.poll() is None:
        peak = max(peak, alive())
        time.sleep(0.5)
print(json.dumps({"event": "done", "nodes": peak, "rc": study.returncode, "seconds": round(time.time() - t0, 1)}),
      flush=True)
deadline = time.time() + 120
while alive() > 1 and time.time() < deadline:
    time.sleep(1)
print(json.dumps({"event": "idle", "nodes": alive(), "seconds": round(time.time() - t0, 1)}), flush=True)
"""


def _free_port() -> int:
    """A free port outside Ray's default worker-port range (10002-19999), which ray start refuses."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not 10002 <= port <= 19999:
            return port


def _session_pids(sid: int) -> list[int]:
    """Processes whose session id is ``sid``: exactly what our ``ray start`` (a new session) spawned."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state ppid pgrp session ...
            pids.append(int(entry.name))
    return pids


class OwnFakeCluster:
    """A fake multi-node autoscaling cluster in its own temp dir, ports and process session."""

    def __init__(self, config_path: Path):
        self.temp_dir = Path(tempfile.mkdtemp(prefix="attnlab-fake-", dir="/tmp"))
        self.port = _free_port()
        self.dashboard_port = _free_port()
        config = yaml.safe_load(config_path.read_text())
        config["provider"]["gcs_address"] = f"127.0.0.1:{self.port}"
        # 30 s, not the shipped 6 s: on a loaded machine (CI's two test workers on 2 cores) the autoscaler removed a
        # node it had added for the second trial before that trial's process started there, as idle; the trial died
        # with it ("Terminated by autoscaler"). The test still waits for the idle nodes to go.
        config["idle_timeout_minutes"] = 0.5
        self.config_path = self.temp_dir / "autoscaler.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        # Not the session cluster's addresses (conftest's ray_session sets RAY_API_SERVER_ADDRESS for its own).
        self.env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
        self.env.update(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_AUTH_MODE="disabled",
                        RAY_USAGE_STATS_ENABLED="0")
        self.sid: int | None = None

    def start(self) -> None:
        ray_cli = Path(sys.executable).with_name("ray")
        cmd = [
            str(ray_cli), "start", "--head", f"--port={self.port}", f"--temp-dir={self.temp_dir}",
            "--num-cpus=1", "--object-store-memory=100000000", f"--autoscaling-config={self.config_path}",
            # The dashboard is on, as on a real cluster: Train's placement-group cleaner and the test's look at
            # where the trials ran both use its State API.
            "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
            "--dashboard-agent-listen-port=0",
            f"--dashboard-agent-grpc-port={_free_port()}", f"--ray-client-server-port={_free_port()}",
            f"--metrics-export-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}",
        ]
        proc = subprocess.Popen(cmd, env=self.env, start_new_session=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        self.sid = proc.pid
        out, _ = proc.communicate(timeout=90)
        if proc.returncode != 0:
            raise RuntimeError(f"ray start failed:\n{out[-3000:]}")

    def stop(self) -> None:
        if self.sid is not None:
            for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
                for pid in _session_pids(self.sid):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                deadline = time.time() + wait
                while _session_pids(self.sid) and time.time() < deadline:
                    time.sleep(0.2)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(900)
def test_fake_cluster_adds_worker_nodes_for_a_study_and_removes_them_when_idle(tmp_path):
    from ray.util.state import list_actors, list_tasks

    from attnlab.results import ResultsStore

    study = tmp_path / "autoscale.yaml"
    study.write_text(yaml.safe_dump(_STUDY))
    store, storage = tmp_path / "results", tmp_path / "runs"
    command = [str(Path(sys.executable).with_name("attnlab")), "study", "run", str(study), "--store", str(store),
               "--runs", str(storage)]
    cluster = OwnFakeCluster(CLUSTER / "local-fake.yaml")
    try:
        cluster.start()
        watcher = subprocess.run(
            [sys.executable, "-c", _WATCHER, f"127.0.0.1:{cluster.port}", str(tmp_path / "study.log"), *command],
            env=cluster.env, capture_output=True, text=True, timeout=840,
        )
        events = {e["event"]: e for e in (json.loads(line) for line in watcher.stdout.splitlines() if line.startswith("{"))}
        print("fake cluster:", {k: (v["nodes"], v.get("seconds")) for k, v in events.items()})  # (nodes, s); -s shows it
        out = (tmp_path / "study.log").read_text() if (tmp_path / "study.log").exists() else ""
        assert watcher.returncode == 0, watcher.stderr[-3000:] + out[-3000:]
        assert events["start"]["nodes"] == 1  # the head alone
        assert events["done"]["rc"] == 0, out[-4000:]
        assert "study autoscale: 1 trial(s) 1 complete; 1 trained this run" in out, out[-3000:]
        rows = ResultsStore(str(store)).read(study="autoscale", metric="val_loss")
        assert len(set(rows.train_key)) == 1  # the trial trained, was evaluated and wrote its rows
        assert events["done"]["nodes"] >= 2  # the autoscaler added a fake.gpu node for it
        # Training and evaluation ran on added nodes (the head has no fake_gpu_node).
        head_id = "f" * 51 + "00000"  # the fake provider's head node id
        dashboard = f"http://127.0.0.1:{cluster.dashboard_port}"
        with without_api_server_env():
            trials = list_actors(address=dashboard, filters=[("class_name", "=", "ImplicitFunc")], detail=True)
            workers = list_actors(address=dashboard, filters=[("class_name", "=", "RayTrainWorker")], detail=True)
            evals = [t for t in list_tasks(address=dashboard, detail=True, limit=10_000)
                     if (t.name or "").startswith("evaluate-")]
        # one CPU worker: the trial trained and evaluated in its own process, which held the worker's resources
        # (fake_gpu_node) and so ran on an added node; no Train worker group, no evaluation task
        assert len(trials) == 1 and workers == [] and evals == []
        assert all(a.node_id != head_id for a in trials)
        assert events["idle"]["nodes"] == 1  # and removed them after idle_timeout_minutes
        monitor_log = next(cluster.temp_dir.glob("session_*/logs/monitor.log")).read_text()
        assert re.search(r"Adding \d+ node\(s\) of type fake\.gpu", monitor_log)
        assert re.search(r"Removing \d+ nodes of type fake\.gpu \(idle\)", monitor_log)
        assert "Found multiple active Ray instances: " not in out.replace("Connecting to latest cluster", "")
    finally:
        cluster.stop()
    assert not _session_pids(cluster.sid)


def test_attnlab_cluster_cli_validates_and_refuses_unschedulable_studies():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "attnlab.cli", "cluster", *args], cwd=root, capture_output=True,
                              text=True, timeout=120)

    ok = cli("validate", "cluster/aws.yaml", "cluster/kuberay/rayjob.yaml")
    assert ok.returncode == 0 and "ok: cluster/aws.yaml" in ok.stdout, ok.stderr
    refused = subprocess.run([sys.executable, "-m", "attnlab.cli", "study", "validate", "--cluster",
                              "cluster/local-fake.yaml", "studies/paper_table4.yaml"], cwd=root, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2
    errors = [line for line in refused.stderr.splitlines() if line.startswith("attnlab: error:")]
    assert len(errors) == 1 and "no node type in local-fake.yaml" in errors[0] and "Traceback" not in refused.stderr
