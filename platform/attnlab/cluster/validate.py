"""Offline checks of the cluster configs, and what each config can supply.

- ``validate_launcher_config(path)``: a Ray cluster-launcher YAML is checked against the JSON schema
  that ships in the installed ray wheel (``ray/autoscaler/ray-schema.json``), then with the same
  ``prepare_config`` + ``validate_config`` that ``ray up`` runs before it touches a cloud.
- ``validate_kuberay_manifest(path)``: RayCluster / RayJob manifests are checked against the v1
  ``openAPIV3Schema`` of the KubeRay v1.7.0 CRDs (vendored, trimmed, in ``attnlab/cluster/kuberay_schemas/``),
  "strictified" so that unknown fields are errors, as with ``kubectl --validate=strict``.
- ``load_node_types(path)``: the node types a config can bring up (CPUs, GPUs, GPU type, how many), from the
  machine tables here (:data:`INSTANCE_TYPES`, :data:`GPU_MEMORY`, :data:`GPU_OF_MACHINE`). Whether a trial fits
  them is :mod:`attnlab.cluster.fit`'s question.

This module never starts Ray, never contacts a cloud or a Kubernetes API, and holds no credentials;
the only Ray it touches is the autoscaler's config helpers and schema file.
"""

from __future__ import annotations

import copy
import gzip
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import yaml

from attnlab.errors import UserError

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when available: the CRDs are 2 MB

KUBERAY_SCHEMA_DIR = Path(__file__).resolve().parent / "kuberay_schemas"  # package data, installed with attnlab
KUBERAY_KINDS = {"RayCluster": "rayclusters", "RayJob": "rayjobs"}

# The CPUs and GPUs of the cloud machine types the configs use. AWS node types may leave
# ``resources`` empty (Ray's AWS provider detects them at ``ray up`` time, which needs credentials),
# so the fit check looks them up here. GCP does not detect them: its configs must declare them, and
# this table only checks that a declaration does not exceed the machine.
INSTANCE_TYPES: dict[str, dict[str, dict[str, int]]] = {
    "aws": {
        "m5.large": {"CPU": 2, "GPU": 0},
        "m6i.xlarge": {"CPU": 4, "GPU": 0},
        "m6i.2xlarge": {"CPU": 8, "GPU": 0},
        "m6i.4xlarge": {"CPU": 16, "GPU": 0},
        "m6i.8xlarge": {"CPU": 32, "GPU": 0},
        "m6i.16xlarge": {"CPU": 64, "GPU": 0},
        "g5.xlarge": {"CPU": 4, "GPU": 1},  # 1x A10G 24 GB
        "p4d.24xlarge": {"CPU": 96, "GPU": 8},  # 8x A100 40 GB
        "p4de.24xlarge": {"CPU": 96, "GPU": 8},  # 8x A100 80 GB
        "p5.48xlarge": {"CPU": 192, "GPU": 8},  # 8x H100 80 GB
    },
    "gcp": {
        "n2-standard-8": {"CPU": 8, "GPU": 0},
        "n2-standard-16": {"CPU": 16, "GPU": 0},
        "n2-standard-32": {"CPU": 32, "GPU": 0},
        "a2-highgpu-8g": {"CPU": 96, "GPU": 8},  # 8x A100 40 GB
        "a2-ultragpu-8g": {"CPU": 96, "GPU": 8},  # 8x A100 80 GB
        "a3-highgpu-8g": {"CPU": 208, "GPU": 8},  # 8x H100 80 GB
    },
}

# GPU memory per GPU type, in bytes (nvidia-smi's total; torch's total_memory is a few hundred MiB less,
# which the estimate's CUDA-context reserve covers), and the GPU type of each machine type or Kubernetes node
# label value that names one. The one place the memory check reads GPU types from (docs/gpu-memory.md).
MIB = 1024**2
GPU_MEMORY: dict[str, int] = {
    "A10G-24GB": 23028 * MIB,
    "A100-40GB": 40960 * MIB,
    "A100-80GB": 81920 * MIB,
    "H100-80GB": 81559 * MIB,
}
GPU_OF_MACHINE: dict[str, str] = {  # fnmatch patterns: instance types, GCE machine types, GKE accelerator labels
    "g5.*": "A10G-24GB",
    "p4d.24xlarge": "A100-40GB",
    "p4de.24xlarge": "A100-80GB",
    "p5.48xlarge": "H100-80GB",
    "a2-highgpu-*": "A100-40GB",
    "a2-megagpu-*": "A100-40GB",
    "a2-ultragpu-*": "A100-80GB",
    "a3-highgpu-*": "H100-80GB",
    "nvidia-tesla-a100": "A100-40GB",
    "nvidia-a100-80gb": "A100-80GB",
    "nvidia-h100-80gb": "H100-80GB",
    "nvidia-a10g": "A10G-24GB",
}
# Kubernetes node labels a nodeSelector may pin a GPU pool with (EKS / any: instance type; GKE: accelerator).
GPU_NODE_LABELS = ("node.kubernetes.io/instance-type", "beta.kubernetes.io/instance-type",
                   "cloud.google.com/gke-accelerator", "cloud.google.com/machine-family")


def gpu_of_machine(machine: str | None) -> str | None:
    """The GPU type of a machine type / accelerator label (``GPU_OF_MACHINE``), None when unknown."""
    import fnmatch

    if not machine:
        return None
    for pattern, gpu in GPU_OF_MACHINE.items():
        if fnmatch.fnmatchcase(str(machine), pattern):
            return gpu
    return None


# --------------------------------------------------------------------------------------------
# Launcher YAML (ray up)
# --------------------------------------------------------------------------------------------


def _read_yaml(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"cluster config {str(path)!r} does not exist (give a path to a YAML file)")
    try:
        return yaml.load(path.read_text(), Loader=_LOADER)
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"cluster config {str(path)!r} is not valid YAML: {first}") from None


def _read_yaml_documents(path: str | Path) -> list[Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"manifest {str(path)!r} does not exist (give a path to a YAML file)")
    try:
        return [doc for doc in yaml.load_all(path.read_text(), Loader=_LOADER) if doc is not None]
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"manifest {str(path)!r} is not valid YAML: {first}") from None


def _json_path(parts: Iterable[Any]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _schema_error(path: str | Path, validator, document: Any) -> None:
    import jsonschema

    errors = sorted(validator.iter_errors(document), key=lambda e: (len(e.absolute_path), str(e.absolute_path)))
    if errors:
        # A typo'd key shows up as an unknown field plus a missing one: name the typo first.
        typos = [e for e in errors if e.validator == "additionalProperties"]
        error = typos[0] if typos else jsonschema.exceptions.best_match(errors)
        message = error.message.replace("\n", " ")
        if len(message) > 300:
            message = message[:300] + "..."
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise UserError(f"{path}: {_json_path(error.absolute_path)}: {message}{more}")


def ray_launcher_schema() -> dict:
    """The cluster-launcher JSON schema of the installed ray wheel (draft-07)."""
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def validate_launcher_config(path: str | Path) -> dict:
    """Check a cluster-launcher YAML as ``ray up`` would before touching the cloud; return the raw config.

    Pure schema first (typos, types: ``resources`` values must be integers), then Ray's own
    ``prepare_config`` (merges the provider's defaults) and ``validate_config`` (head type exists,
    ``min_workers`` sum within ``max_workers``, ...). The fake multi-node provider ships no defaults
    file in the wheel, so a config for it must be complete and is checked without ``prepare_config``.
    """
    import jsonschema

    raw = _read_yaml(path)
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a cluster-launcher config must be a YAML mapping, got {type(raw).__name__}")
    _schema_error(path, jsonschema.Draft7Validator(ray_launcher_schema()), raw)

    from ray.autoscaler._private.util import prepare_config, validate_config as ray_validate_config

    try:
        config = copy.deepcopy(raw)
        if raw["provider"].get("type") != "fake_multinode":
            config = prepare_config(config)
        ray_validate_config(config)
    except (ValueError, KeyError, jsonschema.ValidationError) as exc:
        message = getattr(exc, "message", None) or str(exc)
        raise UserError(f"{path}: {message.splitlines()[0] if message else type(exc).__name__}") from None
    return raw


# --------------------------------------------------------------------------------------------
# KubeRay manifests
# --------------------------------------------------------------------------------------------


def strictify(schema: Any) -> Any:
    """Copy of an OpenAPI v3 schema where objects with ``properties`` refuse unknown fields.

    The API server silently prunes unknown fields; ``kubectl --validate=strict`` rejects them. Objects
    marked ``x-kubernetes-preserve-unknown-fields`` or with their own ``additionalProperties`` stay open.
    """
    if isinstance(schema, list):
        return [strictify(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "properties" and isinstance(value, dict):
            out[key] = {name: strictify(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = strictify(value)
        elif key in ("allOf", "anyOf", "oneOf") and isinstance(value, list):
            out[key] = [strictify(sub) for sub in value]
        else:
            out[key] = value
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def extract_crd_schema(crd_path: str | Path, version: str = "v1") -> dict:
    """The trimmed record vendored in ``platform/attnlab/cluster/kuberay_schemas/``: one version's ``openAPIV3Schema``."""
    crd = _read_yaml(crd_path)
    try:
        spec = crd["spec"]
        (served,) = [v for v in spec["versions"] if v["name"] == version]
        schema = served["schema"]["openAPIV3Schema"]
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{crd_path}: not a CustomResourceDefinition with a {version!r} openAPIV3Schema") from None
    return {
        "group": spec["group"],
        "kind": spec["names"]["kind"],
        "version": version,
        "source": f"KubeRay v1.7.0 ray-operator/config/crd/bases/{Path(crd_path).name} (Apache-2.0)",
        "openAPIV3Schema": schema,
    }


def vendored_schema_path(kind: str, schema_dir: str | Path | None = None) -> Path:
    if kind not in KUBERAY_KINDS:
        raise UserError(f"kind {kind!r} is not a KubeRay kind this project validates; allowed: {sorted(KUBERAY_KINDS)}")
    return Path(schema_dir or KUBERAY_SCHEMA_DIR) / f"{KUBERAY_KINDS[kind]}.ray.io-v1.schema.json.gz"


def write_vendored_schema(crd_path: str | Path, schema_dir: str | Path | None = None) -> Path:
    """Extract a CRD's v1 schema into ``platform/attnlab/cluster/kuberay_schemas/`` (gzip, deterministic bytes)."""
    record = extract_crd_schema(crd_path)
    out = vendored_schema_path(record["kind"], schema_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    out.write_bytes(gzip.compress(data, mtime=0))
    return out


def load_kuberay_schema(kind: str, schema_dir: str | Path | None = None) -> dict:
    """The strictified v1 ``openAPIV3Schema`` of a KubeRay kind, from the vendored extraction."""
    path = vendored_schema_path(kind, schema_dir)
    if not path.is_file():
        raise UserError(f"KubeRay schema {str(path)!r} is missing (regenerate it with 'extract-crd', see cluster/README.md)")
    record = json.loads(gzip.decompress(path.read_bytes()))
    return strictify(record["openAPIV3Schema"])


def validate_kuberay_manifest(path: str | Path, schema_dir: str | Path | None = None) -> list[dict]:
    """Validate every RayCluster/RayJob document of a manifest; return the documents.

    Not covered: the CRDs' CEL ``x-kubernetes-validations`` rules (mostly immutability on update)
    and the operator's own runtime checks.
    """
    import jsonschema

    documents = _read_yaml_documents(path)
    if not documents:
        raise UserError(f"{path}: no YAML documents found")
    for index, doc in enumerate(documents):
        kind = doc.get("kind") if isinstance(doc, dict) else None
        if kind not in KUBERAY_KINDS:
            raise UserError(f"{path}: document {index} has kind {kind!r}; allowed: {sorted(KUBERAY_KINDS)}")
        if doc.get("apiVersion") != "ray.io/v1":
            raise UserError(f"{path}: document {index} has apiVersion {doc.get('apiVersion')!r}; allowed: 'ray.io/v1'")
        if not (doc.get("metadata") or {}).get("name"):
            raise UserError(f"{path}: document {index} ({kind}) needs metadata.name")
        _schema_error(path, jsonschema.Draft7Validator(load_kuberay_schema(kind, schema_dir)), doc)
    return documents


def is_kuberay_manifest(path: str | Path) -> bool:
    documents = _read_yaml_documents(path)
    return bool(documents) and all(isinstance(d, dict) and d.get("kind") in KUBERAY_KINDS for d in documents)


def validate_config(path: str | Path) -> None:
    """Validate a launcher YAML or a KubeRay manifest, whichever ``path`` is."""
    if is_kuberay_manifest(path):
        validate_kuberay_manifest(path)
    else:
        validate_launcher_config(path)


# --------------------------------------------------------------------------------------------
# What each config can supply
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeType:
    """One kind of node a config can bring up: its CPUs and GPUs, and how many of it at most."""

    name: str
    cpus: float
    gpus: float
    max_nodes: int
    is_head: bool = False
    gpu_type: str | None = None  # a GPU_MEMORY key; None: no GPU, or not known from the config
    gpu_source: str = ""  # what named the GPU type (or why it is unknown)


def _launcher_node_types(config: dict, path: str | Path) -> tuple[list[NodeType], int]:
    provider = config["provider"].get("type", "")
    table = INSTANCE_TYPES.get(provider, {})
    global_max = int(config.get("max_workers", 2))
    head = config["head_node_type"]
    nodes = []
    for name, node_type in config["available_node_types"].items():
        node_config = node_type.get("node_config") or {}
        machine = node_config.get("InstanceType") or node_config.get("machineType")
        known = table.get(machine, {})
        declared = node_type.get("resources") or {}
        if provider == "aws":  # Ray's AWS provider fills in CPU/GPU it detects; explicit values win.
            resources = {**known, **declared}
        else:
            resources = dict(declared)
            for key in ("CPU", "GPU"):
                if known and resources.get(key, 0) > known[key]:
                    raise UserError(
                        f"{path}: node type {name!r} declares {key}: {resources[key]} but {machine} has {known[key]}"
                    )
        if "CPU" not in resources:
            raise UserError(
                f"{path}: node type {name!r}: CPU count unknown (machine {machine!r} is not in "
                f"attnlab.cluster.validate.INSTANCE_TYPES[{provider!r}]); declare resources: {{CPU: n, GPU: m}}"
            )
        max_nodes = 1 if name == head else min(int(node_type.get("max_workers", global_max)), global_max)
        gpu = gpu_of_machine(machine)
        source = f"machine {machine}" if gpu else f"machine {machine!r} is not in GPU_OF_MACHINE"
        nodes.append(NodeType(name, float(resources["CPU"]), float(resources.get("GPU", 0)), max_nodes, name == head,
                              gpu, source))
    return nodes, global_max


_QUANTITY = re.compile(r"^([0-9.]+)(m?)$")


def _cpu_quantity(value: Any, where: str) -> float:
    match = _QUANTITY.match(str(value).strip())
    if not match:
        raise UserError(f"{where}: CPU quantity {value!r} not understood (use e.g. '8' or '500m')")
    return float(match.group(1)) / (1000.0 if match.group(2) else 1.0)


def _kuberay_group(group: dict, name: str, path: str | Path) -> tuple[float, float]:
    """CPUs and GPUs Ray sees on a pod: rayStartParams win, else the ray-head/worker container's limits."""
    params = group.get("rayStartParams") or {}
    containers = ((group.get("template") or {}).get("spec") or {}).get("containers") or [{}]
    limits = (containers[0].get("resources") or {}).get("limits") or {}
    requests = (containers[0].get("resources") or {}).get("requests") or {}
    where = f"{path}: group {name!r}"
    if "num-cpus" in params:
        cpus = _cpu_quantity(params["num-cpus"], where)
    elif "cpu" in limits or "cpu" in requests:
        cpus = math.floor(_cpu_quantity(limits.get("cpu", requests.get("cpu")), where))
    else:
        raise UserError(f"{where}: CPU count unknown; set resources.limits.cpu or rayStartParams num-cpus")
    gpus = float(params.get("num-gpus", limits.get("nvidia.com/gpu", 0)))
    return float(cpus), gpus


def _kuberay_gpu(group: dict) -> tuple[str | None, str]:
    """A group's GPU type from its pod template's nodeSelector (instance type or GKE accelerator label)."""
    selector = ((group.get("template") or {}).get("spec") or {}).get("nodeSelector") or {}
    for label in GPU_NODE_LABELS:
        if label in selector:
            gpu = gpu_of_machine(selector[label])
            if gpu:
                return gpu, f"nodeSelector {label}={selector[label]}"
            return None, f"nodeSelector {label}={selector[label]!r} is not in GPU_OF_MACHINE"
    return None, "no nodeSelector names an instance type or GPU accelerator"


def _kuberay_node_types(documents: list[dict], path: str | Path) -> tuple[list[NodeType], int]:
    specs = []
    for doc in documents:
        spec = doc.get("spec") or {}
        if doc["kind"] == "RayCluster":
            specs.append(spec)
        elif "rayClusterSpec" in spec:
            specs.append(spec["rayClusterSpec"])
    if len(specs) != 1:
        raise UserError(f"{path}: the fit check needs exactly one RayCluster spec (a RayCluster, or a RayJob with rayClusterSpec); found {len(specs)}")
    spec = specs[0]
    cpus, gpus = _kuberay_group(spec["headGroupSpec"], "head", path)
    nodes = [NodeType("head", cpus, gpus, 1, True)]
    for group in spec.get("workerGroupSpecs") or []:
        cpus, gpus = _kuberay_group(group, group["groupName"], path)
        max_pods = int(group.get("maxReplicas", 0)) * int(group.get("numOfHosts", 1))
        gpu, source = _kuberay_gpu(group)
        nodes.append(NodeType(group["groupName"], cpus, gpus, max_pods, False, gpu, source))
    return nodes, sum(n.max_nodes for n in nodes if not n.is_head)


def load_node_types(config_path: str | Path) -> tuple[list[NodeType], int]:
    """The node types of a launcher YAML or KubeRay manifest, and the cap on worker nodes in total."""
    if is_kuberay_manifest(config_path):
        return _kuberay_node_types(validate_kuberay_manifest(config_path), config_path)
    return _launcher_node_types(validate_launcher_config(config_path), config_path)
