"""``attnlab study submit STUDY.yaml --address http://HEAD:8265``: run a study as a Ray Job on a running cluster.

Packages the working directory (``runtime_env.working_dir``, leaving out the virtualenv, runs, results, data and
git folders), submits ``attnlab study run STUDY.yaml ...`` with ``JobSubmissionClient``, prints the job id, the
log command and the dashboard URL, and (unless ``--no-wait``) follows the job's log until it ends. The study is
validated, and with ``--cluster`` its resources are checked against a cluster config, before anything is sent.

The job's driver resolves ``attnlab`` from the PATH the head was started with (activate the venv before
``ray start``). Only the Jobs SDK is used here: no Tune, no training.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from attnlab.errors import UserError

PACKAGE_EXCLUDES = [".venv", "venv", "runs", "results", "data", ".git", "*.egg-info", "__pycache__",
                    ".pytest_cache", "*.db", "outputs"]
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def add_submit_parser(sub) -> None:
    p = sub.add_parser(
        "submit", help="submit a study as a Ray Job to a running cluster",
        description="Submit `attnlab study run STUDY.yaml` as a Ray Job: the working directory is uploaded "
                    "(without .venv, runs/, results/, data/, .git) and the job's driver runs on the head.")
    p.add_argument("study", metavar="STUDY.yaml", help="a study file inside the working directory")
    p.add_argument("--address", default=os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS"),
                   help="the head's dashboard, e.g. http://HEAD:8265 (default: $RAY_ADDRESS)")
    p.add_argument("--cluster", metavar="CLUSTER.yaml", help="check the study's resources fit this cluster config")
    p.add_argument("--store", help="results store URI for the job (a shared one on a multi-node cluster: s3://...)")
    p.add_argument("--runs", "--storage", dest="runs",
                   help="the runs folder for the job: Tune state, training runs and trial status (shared storage on a "
                   "multi-node cluster; --storage is its earlier name)")
    p.add_argument("--working-dir", default=".", help="the folder to upload (default: the current folder)")
    p.add_argument("--submission-id", help="a job id to use (must be unique on the cluster)")
    p.add_argument("--no-wait", action="store_true", help="return after submitting instead of following the log")
    p.set_defaults(func=_submit)


def entrypoint(study: str, store: str | None = None, runs: str | None = None) -> str:
    """The job's command line."""
    parts = ["attnlab", "study", "run", study]
    if store:
        parts += ["--store", store]
    if runs:
        parts += ["--runs", runs]
    return " ".join(shlex.quote(p) for p in parts)


def submit_study(study: str, address: str, *, working_dir: str = ".", store: str | None = None,
                 runs: str | None = None, cluster: str | None = None, submission_id: str | None = None) -> str:
    """Validate, package and submit; returns the job id."""
    from attnlab.study.spec import load_spec

    if not address:
        raise UserError("--address is required (the head's dashboard, e.g. http://127.0.0.1:8265), or set RAY_ADDRESS")
    spec = load_spec(study)
    if cluster:
        from attnlab.study.fit import check_study_fits

        check_study_fits(spec, cluster)  # its trials' resources and GPU memory
    wd = Path(working_dir).resolve()
    if not wd.is_dir():
        raise UserError(f"--working-dir {working_dir!r} is not a folder")
    try:
        rel = Path(study).resolve().relative_to(wd)
    except ValueError:
        raise UserError(f"{study}: the study file must be inside the working directory {wd} (it is uploaded "
                        "with it)") from None
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError as exc:  # pragma: no cover - ray[default] is a dependency
        raise UserError(f"the Ray Jobs SDK is missing ({exc}); install ray[default]") from None
    try:
        client = JobSubmissionClient(address)
    except Exception as exc:  # noqa: BLE001 - connection errors come in many types
        raise UserError(f"--address {address!r}: cannot reach the Ray dashboard ({type(exc).__name__}: "
                        f"{(str(exc).splitlines() or [''])[0][:200]})") from None
    from attnlab.train.ray_train import forwarded_env

    env_vars = {k: os.environ[k] for k in ("RAY_AUTH_MODE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                                           "TIKTOKEN_CACHE_DIR") if k in os.environ}
    env_vars.update(forwarded_env())  # ATTNLAB_* (storage prefix, cache) and the object store's AWS_*/GOOGLE_*
    return client.submit_job(
        entrypoint=entrypoint(rel.as_posix(), store, runs),
        runtime_env={"working_dir": str(wd), "excludes": PACKAGE_EXCLUDES, "env_vars": env_vars},
        submission_id=submission_id, metadata={"study": spec.name}, entrypoint_num_cpus=0)


def _submit(args: argparse.Namespace) -> int:
    job_id = submit_study(args.study, args.address, working_dir=args.working_dir, store=args.store,
                          runs=args.runs, cluster=args.cluster, submission_id=args.submission_id)
    address = args.address.rstrip("/")
    print(f"job id: {job_id}")
    print(f"logs:   ray job logs --address {address} {job_id} -f")
    print(f"status: ray job status --address {address} {job_id}")
    print(f"dashboard: {address}/#/jobs/{job_id}")
    if args.no_wait:
        return 0
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(args.address)
    shown = 0
    while True:
        status = str(client.get_job_status(job_id)).split(".")[-1]
        logs = client.get_job_logs(job_id)
        sys.stdout.write(logs[shown:])
        sys.stdout.flush()
        shown = len(logs)
        if status in TERMINAL:
            print(f"job {job_id}: {status}")
            return 0 if status == "SUCCEEDED" else 1
        time.sleep(2)
