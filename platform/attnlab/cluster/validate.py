"""Offline checks of the cluster configs, and the resource-fit check run before a study is submitted.

Three things live here:

- ``validate_launcher_config(path)``: a Ray cluster-launcher YAML is checked against the JSON schema
  that ships in the installed ray wheel (``ray/autoscaler/ray-schema.json``), then with the same
  ``prepare_config`` + ``validate_config`` that ``ray up`` runs before it touches a cloud.
- ``validate_kuberay_manifest(path)``: RayCluster / RayJob manifests are checked against the v1
  ``openAPIV3Schema`` of the KubeRay v1.7.0 CRDs (vendored, trimmed, in ``platform/attnlab/cluster/kuberay_schemas/``),
  "strictified" so that unknown fields are errors, as with ``kubectl --validate=strict``.
- ``check_fits(request, config_path)``: refuses a study whose trials no node type (or allowed span of
  nodes) of a config can schedule, with a one-line ``UserError``, instead of letting Ray wait forever.
- ``trial_gpu(request, config_path)``: the GPU type (and its memory, :data:`GPU_MEMORY`) a trial's workers
  would be placed on; ``check_study_memory(spec, config_path)`` refuses a study whose training step or
  evaluation does not fit it (``attnlab study validate --cluster``, docs/gpu-memory.md).

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

# The repository's cluster/ folder (platform/attnlab/cluster/validate.py -> repo root).
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


# The one shape of a resource request (``attnlab.study.StudySpec.resource_request`` builds it): one trial = a
# Tune trial driver (``trial_cpus``) that runs a Ray Train job of ``workers`` workers, each ``gpus_per_worker``
# GPUs and ``cpus_per_worker`` CPUs; up to ``max_concurrent_trials`` trials at once.
REQUEST_DEFAULTS = {"workers": 1, "gpus_per_worker": 0.0, "cpus_per_worker": 1.0, "max_concurrent_trials": 1,
                    "trial_cpus": 1.0}
_EPS = 1e-9


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


# --------------------------------------------------------------------------------------------
# Does a study's request fit?
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrialFit:
    """How one trial is placed on a config, and how many trials can run at once at full scale."""

    workers_per_node: dict[str, int]  # node type -> workers one node of it can hold
    nodes_per_trial: dict[str, int]  # node type -> nodes one trial uses (the plan picked)
    gpus_per_trial: float
    concurrent_trials: int  # trials that can run at once with every node type at its maximum

    @property
    def spans_nodes(self) -> bool:
        return sum(self.nodes_per_trial.values()) > 1


def normalise_request(request: dict) -> dict:
    """Fill defaults and check types of a ``resources:`` request; raise ``UserError`` on bad values."""
    if not isinstance(request, dict):
        raise UserError(f"resources: expected a mapping with keys {sorted(REQUEST_DEFAULTS)}, got {type(request).__name__}")
    unknown = sorted(set(request) - set(REQUEST_DEFAULTS))
    if unknown:
        raise UserError(f"resources: unknown key(s) {unknown}; allowed: {sorted(REQUEST_DEFAULTS)}")
    out = {**REQUEST_DEFAULTS, **request}
    for key in ("workers", "max_concurrent_trials"):
        value = out[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"resources.{key}: {value!r} is not allowed; use an integer >= 1")
    for key in ("gpus_per_worker", "cpus_per_worker", "trial_cpus"):
        value = out[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise UserError(f"resources.{key}: {value!r} is not allowed; use a number >= 0")
        out[key] = float(value)
    return out


def _workers_per_node(node: NodeType, gpus: float, cpus: float) -> int:
    limits = []
    if gpus > 0:
        limits.append(math.floor(node.gpus / gpus + _EPS))
    if cpus > 0:
        limits.append(math.floor(node.cpus / cpus + _EPS))
    return min(limits) if limits else 10**6


def _describe(nodes: list[NodeType]) -> str:
    return ", ".join(f"{n.name}: {n.gpus:g} GPU/{n.cpus:g} CPU x{n.max_nodes}" for n in nodes)


def plan_fit(request: dict, cluster_config_path: str | Path) -> TrialFit:
    """Place one trial of ``request`` on the config's node types; raise ``UserError`` if it never fits.

    A Ray Train worker must fit on one node. A trial's workers may span nodes (Ray Train's PACK
    placement spreads a placement group over nodes when one is not enough), within each node type's
    ``max_workers`` and the config's global cap on worker nodes. The trial driver needs ``trial_cpus`` on
    some node.
    """
    req = normalise_request(request)
    name = Path(cluster_config_path).name
    nodes, worker_cap = load_node_types(cluster_config_path)
    nodes = [n for n in nodes if n.max_nodes > 0]
    g, c, workers = req["gpus_per_worker"], req["cpus_per_worker"], req["workers"]
    per_node = {n.name: _workers_per_node(n, g, c) for n in nodes}
    usable = [n for n in nodes if per_node[n.name] >= 1]
    if not usable:
        raise UserError(
            f"resources: one worker needs {g:g} GPU + {c:g} CPU but no node type in {name} has that "
            f"({_describe(nodes)}); lower gpus_per_worker/cpus_per_worker or add a bigger node type"
        )

    def budget(candidates: list[NodeType]) -> dict[str, int]:
        """Nodes of each type usable together: head at most once, workers within the global cap."""
        left, out = worker_cap, {}
        for n in sorted(candidates, key=lambda n: (not n.is_head, -per_node[n.name])):
            take = n.max_nodes if n.is_head else min(n.max_nodes, left)
            left -= 0 if n.is_head else take
            out[n.name] = take
        return out

    # Prefer one node type (homogeneous hardware); else span node types.
    plans = []
    for n in usable:
        need = math.ceil(workers / per_node[n.name])
        if need <= budget([n])[n.name]:
            plans.append((need, n.gpus, n.cpus, n.name))
    if plans:  # fewest nodes, then the smallest machine (a CPU-only trial does not take a GPU node)
        need, _, _, chosen = min(plans)
        nodes_per_trial = {chosen: need}
    else:
        available = budget(usable)
        capacity = sum(per_node[k] * v for k, v in available.items())
        if capacity < workers:
            raise UserError(
                f"resources: {workers} workers x ({g:g} GPU + {c:g} CPU) need {workers * g:g} GPUs/{workers * c:g} CPUs "
                f"at once but {name} can place at most {capacity} such workers ({_describe(usable)}); "
                f"lower resources.workers or raise max_workers"
            )
        nodes_per_trial, remaining = {}, workers
        for n in sorted(usable, key=lambda n: -per_node[n.name]):
            if remaining <= 0:
                break
            take = min(available[n.name], math.ceil(remaining / per_node[n.name]))
            nodes_per_trial[n.name] = take
            remaining -= take * per_node[n.name]

    driver = req["trial_cpus"]
    if not any(n.cpus >= driver for n in nodes):
        raise UserError(f"resources: the trial driver needs {driver:g} CPU but no node type in {name} offers that "
                        "(lower resources.trial_cpus)")

    total = budget(usable)
    concurrent = sum(per_node[k] * v for k, v in total.items()) // workers
    return TrialFit(
        workers_per_node={n.name: per_node[n.name] for n in usable},
        nodes_per_trial=nodes_per_trial,
        gpus_per_trial=workers * g,
        concurrent_trials=concurrent,
    )


def check_fits(request: dict, cluster_config_path: str | Path) -> None:
    """Raise ``attnlab.errors.UserError`` (one line) if no node type or allowed span can host a trial.

    ``request``: ``{"workers": int, "gpus_per_worker": float, "cpus_per_worker": float,
    "max_concurrent_trials": int, "trial_cpus": float}`` (missing keys take :data:`REQUEST_DEFAULTS`), as
    ``StudySpec.resource_request()`` gives it. Running fewer trials
    at once than ``max_concurrent_trials`` is not an error (Tune queues the rest); see ``plan_fit``.
    """
    plan_fit(request, cluster_config_path)


@dataclass(frozen=True)
class TrialGpu:
    """The GPU a trial's workers get: its type and memory (None when the config does not say), and why."""

    gpu_type: str | None
    memory_bytes: int | None
    note: str  # e.g. "gpu.a100 (machine p4d.24xlarge)", or why the type is unknown


def trial_gpu(request: dict, cluster_config_path: str | Path) -> TrialGpu | None:
    """The GPU type a trial of ``request`` is placed on (:func:`plan_fit`); the smallest one when a trial spans
    node types. None for a CPU-only request; ``gpu_type`` None when a node type's GPU cannot be known."""
    req = normalise_request(request)
    if req["gpus_per_worker"] <= 0:
        return None
    fit = plan_fit(req, cluster_config_path)
    nodes = {n.name: n for n in load_node_types(cluster_config_path)[0]}
    placed = [nodes[name] for name in fit.nodes_per_trial]
    unknown = [n for n in placed if n.gpu_type not in GPU_MEMORY]
    if unknown:
        n = unknown[0]
        return TrialGpu(None, None, f"{Path(cluster_config_path).name}: node type {n.name!r}: GPU type unknown "
                                    f"({n.gpu_source}); GPU memory check skipped")
    n = min(placed, key=lambda n: GPU_MEMORY[n.gpu_type])
    return TrialGpu(n.gpu_type, GPU_MEMORY[n.gpu_type], f"{n.name} ({n.gpu_source})")


def _gib(n: float) -> str:
    return f"{n / 1024**3:.1f} GiB"


def check_memory(study: str, trials: list, eval_lengths, eval_batch: int | None, request: dict,
                 cluster_config_path: str | Path) -> str:
    """Refuse (one-line ``UserError``) a study whose training step or evaluation does not fit the GPU its
    trials are placed on; return a one-line note of what was checked (or why the check was skipped).

    ``trials``: the trials' ``attnlab.train.config.TrainConfig`` (one per distinct point); ``eval_lengths``: the
    lengths evaluated after training, or a function of the training length giving them (the training length
    is checked too, at ``val_batch``: training's own validation); ``eval_batch``:
    ``eval.batch_size`` (None: ``val_batch x seq_len // length``, at least 1, as evaluation does). Estimates come
    from :mod:`attnlab.model.memory`; ``micro_batch: auto`` is resolved for the GPU type.
    """
    from attnlab.model.memory import estimate_eval, largest_eval_batch

    gpu = trial_gpu(request, cluster_config_path)
    if gpu is None:
        return "GPU memory: CPU workers, not checked"
    if gpu.gpu_type is None:
        return gpu.note
    budget, where = gpu.memory_bytes, f"the {gpu.gpu_type}'s {_gib(gpu.memory_bytes)} ({gpu.note})"
    worst_train, worst_eval = None, None
    for cfg in trials:
        attention = cfg.gpt_config().attention_spec().name
        best = cfg.fitting_micro_batch(budget)
        batch = best if cfg.micro_batch == "auto" else cfg.micro_batch
        if batch < 1:
            est = cfg.step_memory(1)
            raise UserError(f"study {study!r}: a training step of attention {attention} needs {_gib(est.total)} per "
                            f"GPU at micro_batch=1 x {cfg.seq_length} tokens, more than {where}; no micro_batch "
                            f"fits: shorten seq_len or use a larger GPU")
        est = cfg.step_memory(batch)
        if est.total > budget:
            raise UserError(f"study {study!r}: a training step of attention {attention} at micro_batch={batch} x "
                            f"{cfg.seq_length} tokens needs ~{_gib(est.total)} per GPU, more than {where}; the "
                            f"largest micro_batch that fits (and divides the step's sequences) is {best}: set "
                            f"train.micro_batch: {best} or auto")
        if worst_train is None or est.total > worst_train[0]:
            worst_train = (est.total, batch)
        settings = cfg.memory_settings()
        gpt = cfg.gpt_config()
        T = cfg.seq_length
        lengths = eval_lengths(T) if callable(eval_lengths) else eval_lengths
        for length in sorted({T, *lengths}):
            b = cfg.val_batch if length == T and eval_batch is None else (
                eval_batch or max(1, cfg.val_batch * T // length))
            est = estimate_eval(gpt, length, b, settings["precision"], settings["backend"])
            if est.total > budget:
                fits = largest_eval_batch(gpt, length, budget, precision=settings["precision"],
                                          backend=settings["backend"])
                advice = (f"the largest eval batch that fits is {fits}: set eval.batch_size: {fits}" if fits else
                          "not even 1 window fits: evaluate shorter lengths or use a larger GPU")
                raise UserError(f"study {study!r}: evaluating attention {attention} at {length:,} tokens (eval batch "
                                f"{b}) needs ~{_gib(est.total)} per GPU, more than {where}; {advice}")
            if worst_eval is None or est.total > worst_eval[0]:
                worst_eval = (est.total, length, b)
    if worst_train is None:
        return f"GPU memory: no trials to check on {gpu.gpu_type}"
    out = f"GPU memory on {gpu.gpu_type} ({_gib(budget)}): training step <= {_gib(worst_train[0])}"
    if worst_eval is not None:
        out += f", evaluation <= {_gib(worst_eval[0])} (at {worst_eval[1]:,} tokens, batch {worst_eval[2]})"
    return out


def trial_configs(spec) -> list:
    """One ``TrainConfig`` per distinct trial of a study (an ``attnlab.study.spec.StudySpec``, passed in: this
    module never imports the study layer) (the grid's points; for a sampled search, each attention
    and each searched value or range end), for checks that need every trial's model and batch."""
    knobs = spec.space.knobs()
    if spec.search.engine == "grid":
        points = spec.grid_points()
    else:
        points = [{"attention": name} if spec.space.attention else {} for name in spec.attentions()]
        for key, axis in knobs.items():
            for name in (axis.when or spec.attentions()):
                base = {"attention": name} if spec.space.attention else {}
                values = axis.values if not axis.is_range else [axis.low, axis.high]
                if axis.is_int_range:
                    values = [int(v) for v in values]
                points += [{**base, key: v} for v in values]
    out, seen = [], set()
    for point in points:
        cfg = spec.train_config({k: v for k, v in point.items() if k != "seed"})
        key = cfg.model_dump_json()
        if key not in seen:
            seen.add(key)
            out.append(cfg)
    return out


def check_study_memory(spec, cluster: str | Path) -> str:
    """Refuse (one line) a study (a ``StudySpec``) whose trials' training step or evaluation does not fit the GPU
    type ``cluster`` places them on (:func:`check_memory`); return its one-line note."""
    return check_memory(spec.name, trial_configs(spec), spec.eval.eval_lengths, spec.eval.batch_size,
                        spec.resource_request(), cluster)
