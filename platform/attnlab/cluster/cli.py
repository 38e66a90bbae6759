"""``attnlab cluster validate|fits|extract-crd``: offline checks of the cluster configs in ``cluster/``.

Thin argument handling over :mod:`attnlab.cluster.validate` (also reachable as
``python -m attnlab.cluster.validate``). Bad input raises ``UserError`` (one line, exit 2).
"""

from __future__ import annotations

import argparse


def register(sub) -> None:
    """Add the three sub-commands to an argparse sub-parser collection (shared with ``python -m``)."""
    from attnlab.cluster.validate import KUBERAY_SCHEMA_DIR

    p = sub.add_parser("validate", aliases=["config"], help="validate launcher YAMLs and KubeRay manifests",
                       description="Validate Ray cluster-launcher YAMLs against the schema shipped in the ray "
                       "wheel, and KubeRay manifests against the vendored v1.7.0 CRD schemas.")
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.set_defaults(func=_validate)
    p = sub.add_parser("fits", help="check that each study's resources fit a cluster config",
                       description="Refuse, before submission, a study that no node type of the config can host.")
    p.add_argument("--config", required=True, help="a cluster YAML (cluster/aws.yaml, gcp.yaml, kuberay/...)")
    p.add_argument("studies", nargs="+", metavar="STUDY.yaml")
    p.set_defaults(func=_fits)
    p = sub.add_parser("extract-crd", help="vendor a CRD's v1 schema into cluster/kuberay/schemas/")
    p.add_argument("crds", nargs="+", metavar="CRD.yaml")
    p.add_argument("--out", default=str(KUBERAY_SCHEMA_DIR))
    p.set_defaults(func=_extract)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("cluster", help="validate cluster configs offline; check that studies fit them",
                              description="Offline checks of the Ray cluster configs and KubeRay manifests.")
    sub = p.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND")
    sub.required = True
    register(sub)


def _validate(args: argparse.Namespace) -> int:
    from attnlab.cluster.validate import validate_config

    for path in args.paths:
        validate_config(path)
        print(f"ok: {path}")
    return 0


def _fits(args: argparse.Namespace) -> int:
    from attnlab.cluster.validate import plan_fit, study_resources

    for study in args.studies:
        fit = plan_fit(study_resources(study), args.config)
        print(f"ok: {study} on {args.config}: nodes per trial {fit.nodes_per_trial}, "
              f"{fit.concurrent_trials} trial(s) at once")
    return 0


def _extract(args: argparse.Namespace) -> int:
    from attnlab.cluster.validate import write_vendored_schema

    for crd in args.crds:
        print(f"wrote {write_vendored_schema(crd, args.out)}")
    return 0
