"""``attnlab cluster validate|fits|extract-crd``: offline checks of the cluster configs in ``cluster/``.

Thin argument handling over :mod:`attnlab.cluster.validate`; ``fits`` reads each study with the study spec and
also checks its GPU memory (as ``attnlab study validate --cluster``).
Bad input raises ``UserError`` (one line, exit 2).
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    from attnlab.cluster.validate import KUBERAY_SCHEMA_DIR

    p = subparsers.add_parser("cluster", help="validate cluster configs offline; check that studies fit them",
                              description="Offline checks of the Ray cluster configs and KubeRay manifests.")
    sub = p.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND")
    sub.required = True
    p = sub.add_parser("validate", aliases=["config"], help="validate launcher YAMLs and KubeRay manifests",
                       description="Validate Ray cluster-launcher YAMLs against the schema shipped in the ray "
                       "wheel, and KubeRay manifests against the vendored v1.7.0 CRD schemas.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="cluster launcher YAMLs (cluster/*.yaml) or KubeRay manifests")
    p.set_defaults(func=_validate)
    p = sub.add_parser("fits", help="check that each study's resources fit a cluster config",
                       description="Refuse, before submission, a study that no node type of the config can host, "
                       "or whose training step or evaluation does not fit that node's GPU memory.")
    p.add_argument("--config", required=True, help="a cluster YAML (cluster/aws.yaml, gcp.yaml, kuberay/...)")
    p.add_argument("studies", nargs="+", metavar="STUDY.yaml", help="study files whose trials must fit the cluster")
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
    from attnlab.cluster.validate import plan_fit
    from attnlab.study.spec import load_spec

    from attnlab.cluster.validate import check_study_memory

    for study in args.studies:
        spec = load_spec(study)
        fit = plan_fit(spec.resource_request(), args.config)
        note = check_study_memory(spec, args.config)
        print(f"ok: {study} on {args.config}: nodes per trial {fit.nodes_per_trial}, "
              f"{fit.concurrent_trials} trial(s) at once; {note}")
    return 0


def _extract(args: argparse.Namespace) -> int:
    from attnlab.cluster.validate import write_vendored_schema

    for crd in args.crds:
        print(f"wrote {write_vendored_schema(crd, args.out)}")
    return 0
