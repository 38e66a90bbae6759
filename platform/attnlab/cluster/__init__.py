"""Cluster configs: offline validation of the files in ``cluster/`` (``validate``) and whether a trial fits them
(``fit``).

``check_fits(request, config_path)`` refuses, before anything is submitted, a request whose trials no
node type (or allowed multi-node span) of a cluster config can ever schedule. ``validate_config(path)``
checks a Ray cluster-launcher YAML or a KubeRay manifest the way ``ray up`` / ``kubectl
--validate=strict`` would, without a cloud account, a Kubernetes cluster or a running Ray.

Nothing in this package starts Ray or contacts a cloud.
"""

__all__ = [
    "NodeType",
    "TrialFit",
    "check_fits",
    "load_node_types",
    "plan_fit",
    "validate_config",
    "validate_kuberay_manifest",
    "validate_launcher_config",
]


_FIT = {"TrialFit", "check_fits", "plan_fit"}


def __getattr__(name: str):
    # Lazy: importing the package does not load the schemas' helpers (yaml, jsonschema).
    if name in __all__:
        from attnlab.cluster import fit, validate

        return getattr(fit if name in _FIT else validate, name)
    raise AttributeError(f"module 'attnlab.cluster' has no attribute {name!r}")
