"""``attnlab cluster validate|extract-crd``: offline checks of the cluster configs in ``cluster/``.

Thin argument handling over :mod:`attnlab.cluster.validate`. Whether a study fits a config is one command,
``attnlab study validate --cluster CONFIG`` (``fits``, its earlier place here, says so in one line).
Bad input raises ``UserError`` (one line, exit 2).
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    from attnlab.cluster.validate import KUBERAY_SCHEMA_DIR

    p = subparsers.add_parser("cluster", help="validate cluster configs offline",
                              description="Offline checks of the Ray cluster configs and KubeRay manifests.")
    sub = p.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND")
    sub.required = True
    p = sub.add_parser("validate", aliases=["config"], help="validate launcher YAMLs and KubeRay manifests",
                       description="Validate Ray cluster-launcher YAMLs against the schema shipped in the ray "
                       "wheel, and KubeRay manifests against the vendored v1.7.0 CRD schemas.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="cluster launcher YAMLs (cluster/*.yaml) or KubeRay manifests")
    p.set_defaults(func=_validate)
    p = sub.add_parser("fits", help="moved: attnlab study validate --cluster CONFIG STUDY.yaml")
    p.add_argument("--config", help="the cluster YAML, now given to `attnlab study validate --cluster`")
    p.add_argument("studies", nargs="*", metavar="STUDY.yaml",
                   help="the studies, now given to `attnlab study validate`")
    p.set_defaults(func=_fits)
    p = sub.add_parser("extract-crd", help="vendor a CRD's v1 schema into platform/attnlab/cluster/kuberay_schemas/",
                       description="Extract the v1 openAPIV3Schema of KubeRay CRD files (e.g. ray.io_rayclusters.yaml "
                       "from a KubeRay release) into gzipped JSON schemas, the form `attnlab cluster validate` "
                       "checks manifests against offline.")
    p.add_argument("crds", nargs="+", metavar="CRD.yaml", help="KubeRay CRD YAML files (RayCluster, RayJob)")
    p.add_argument("--out", default=str(KUBERAY_SCHEMA_DIR),
                   help=f"folder for the extracted schemas (default {KUBERAY_SCHEMA_DIR})")
    p.set_defaults(func=_extract)


def _validate(args: argparse.Namespace) -> int:
    from attnlab.cluster.validate import validate_config

    for path in args.paths:
        validate_config(path)
        print(f"ok: {path}")
    return 0


def _fits(args: argparse.Namespace) -> int:
    from attnlab.errors import UserError

    shown = " ".join(args.studies) or "STUDY.yaml"
    raise UserError(f"cluster fits: a study's fit is checked by `attnlab study validate --cluster "
                    f"{args.config or 'CONFIG'} {shown}`")


def _extract(args: argparse.Namespace) -> int:
    from attnlab.cluster.validate import write_vendored_schema

    for crd in args.crds:
        print(f"wrote {write_vendored_schema(crd, args.out)}")
    return 0
