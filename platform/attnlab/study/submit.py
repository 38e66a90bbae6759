"""``attnlab study submit STUDY.yaml --address http://HEAD:8265``: run a study as a Ray Job on a running cluster.

Owns the submission: the study validated (and with ``--cluster`` checked against a cluster config) before
anything is sent; the working directory packaged (:data:`PACKAGE_EXCLUDES` left out); the study's plugins read
here, once, and shipped with the job (:func:`write_bundle`), so the cluster runs them as they were when submitted;
where the job writes, checked before anything is uploaded (:func:`job_location`); the job's entrypoint
(:func:`entrypoint`); then the job id, the log command and the dashboard URL, and the job's log followed unless
``--no-wait``.

It uses only Ray's Jobs SDK: it must never start Tune or train, and never read a plugin file on the cluster.

Details: docs/plugins.md#on-a-cluster-ray-job-submit (the plugin bundle, where the job writes, the entrypoint),
docs/studies.md#paths-uris-and-whole-file-writes.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from attnlab.errors import UserError

PACKAGE_EXCLUDES = [".venv", "venv", "runs", "results", "data", ".git", "*.egg-info", "__pycache__",
                    ".pytest_cache", "*.db", "outputs"]
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
BUNDLE_PREFIX = "attnlab_job_plugins_"  # the package a job's plugin sources travel in
BUNDLE_FILE = "sources.json"


def add_submit_parser(sub) -> None:
    p = sub.add_parser(
        "submit", help="submit a study as a Ray Job to a running cluster",
        description="Submit `attnlab study run STUDY.yaml` as a Ray Job: the working directory is uploaded "
                    "(without .venv, runs/, results/, data/, .git) and the job's driver runs on the head.")
    p.add_argument("study", metavar="STUDY.yaml", help="a study file inside the working directory")
    p.add_argument("--address", default=os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS"),
                   help="the head's dashboard, e.g. http://HEAD:8265 (default: $RAY_ADDRESS)")
    p.add_argument("--cluster", metavar="CLUSTER.yaml", help="check the study's resources fit this cluster config")
    p.add_argument("--store", help="results store for the job: a URI (s3://, gs://) or an absolute path the job's "
                   "nodes share; a relative path only for a cluster on this machine (default: "
                   "$ATTNLAB_STORAGE/results)")
    p.add_argument("--runs", "--storage", dest="runs",
                   help="the runs folder for the job: Tune state, training runs and trial status; a URI or a shared "
                   "absolute path, a relative one only for a cluster on this machine (default: $ATTNLAB_STORAGE/runs; "
                   "--storage is its earlier name)")
    p.add_argument("--working-dir", default=".", help="the folder to upload (default: the current folder)")
    p.add_argument("--submission-id", help="a job id to use (must be unique on the cluster)")
    p.add_argument("--no-wait", action="store_true", help="return after submitting instead of following the log")
    p.add_argument("--plugin", action="append", metavar="FILE_OR_MODULE",
                   help="an attention plugin added to the study's plugins:, repeatable; read here and shipped with "
                   "the job (it may live outside the working directory)")
    p.add_argument("--no-compact", dest="compact", action="store_false",
                   help="the job leaves the study's small results files as written when it ends (default: merge them, "
                   "as `attnlab results compact` does)")
    p.set_defaults(func=_submit)


def is_this_machine(address: str) -> bool:
    """True when the dashboard ``address`` (``http://HOST:8265``, ``HOST:PORT`` or ``auto``) names this machine: a
    loopback address, this host's name, or one of its addresses. A job submitted there runs here: it sees this machine's files
    and interpreter."""
    text = address.strip()
    if text == "auto":  # the Jobs SDK finds the cluster started on this machine
        return True
    host = text.split("://", 1)[1] if "://" in text else text
    host = host.split("/", 1)[0].rsplit("@", 1)[-1]
    host = host[1:].split("]", 1)[0] if host.startswith("[") else host.rsplit(":", 1)[0] if host.count(":") == 1 \
        else host
    host = host.lower()
    if host in ("localhost", "::1", "") or host.startswith("127."):
        return True
    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    if host in names:
        return True
    try:
        mine = set(socket.gethostbyname_ex(socket.gethostname())[2])
        return bool(mine & set(socket.gethostbyname_ex(host)[2]))
    except OSError:
        return False


def job_location(text: str | None, flag: str, local: bool) -> str | None:
    """``--store``/``--runs`` as the job must get it, checked before anything is uploaded: a URI (s3://, gs://) as
    given; an absolute path as given (it must be shared storage, e.g. NFS, on a multi-node cluster); a relative path
    made absolute on a cluster on this machine (``local``), else refused in one line naming the flag."""
    if text is None:
        return None  # the job's default: $ATTNLAB_STORAGE/<what> where the cluster (or this shell) sets it
    from attnlab.location import _scheme

    scheme = _scheme(text)
    if scheme is not None and scheme != "file":
        return text
    path = text[len("file://"):] if scheme == "file" else text
    if os.path.isabs(os.path.expanduser(path)):
        return text
    if local:
        return os.path.abspath(path)
    raise UserError(f"{flag} {text!r} is relative, and the job runs on another machine in a temporary copy of the "
                    f"working directory: give {flag} a shared location, a URI (s3://..., gs://...) or an absolute "
                    "path every node sees (NFS)")


def entrypoint(study: str, store: str | None = None, runs: str | None = None, plugins: list[str] | tuple = (),
               bundle: str | None = None, compact: bool = True, python: str | None = None) -> str:
    """The job's command line. ``python``: the interpreter to run ``python -m attnlab`` with (a cluster on this
    machine: this one); None runs ``attnlab`` from the head's PATH, after a check that names the fix when it is not
    there."""
    parts = [python, "-m", "attnlab", "study", "run", study] if python else ["attnlab", "study", "run", study]
    if not compact:
        parts.append("--no-compact")
    if store:
        parts += ["--store", store]
    if runs:
        parts += ["--runs", runs]
    for ref in plugins:
        parts += ["--plugin", ref]
    if bundle:
        parts += ["--plugin-bundle", bundle]
    command = " ".join(shlex.quote(p) for p in parts)
    if python:
        return command
    return f"{{ command -v attnlab >/dev/null || {{ echo {shlex.quote(PATH_ERROR)} >&2; exit 127; }}; }} && {command}"


# What a job says when the head's PATH has no attnlab (a head started from a venv that was not activated).
PATH_ERROR = ("attnlab: error: the job's driver found no attnlab on the head's PATH: start Ray on the head from the "
              "environment attnlab is installed in (source VENV/bin/activate, then ray start --head), or put VENV/bin "
              "on the PATH of ray start (docs/plugins.md#on-a-cluster-ray-job-submit)")


def write_bundle(sources: list, folder: str | Path) -> Path:
    """The package ``attnlab_job_plugins_<hash>/`` in ``folder`` holding ``sources`` (PluginSource) as JSON, keyed by
    their origin (the path or module name as written); returns its path (for ``runtime_env.py_modules``)."""
    records = {source.origin: source.to_dict() for source in sources}
    digest = hashlib.sha256(json.dumps(sorted((k, v["sha256"]) for k, v in records.items())).encode()).hexdigest()
    package = Path(folder) / f"{BUNDLE_PREFIX}{digest[:16]}"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('"""The attention plugins of an attnlab study job (attnlab.study.submit)."""\n')
    (package / BUNDLE_FILE).write_text(json.dumps(records))
    return package


def read_bundle(name: str) -> dict:
    """``{origin: PluginSource}`` from the package ``name`` on this process's path (:func:`write_bundle`'s)."""
    from attnlab.attention.plugin import PluginSource

    if not name.startswith(BUNDLE_PREFIX) or not name.isidentifier():
        raise UserError(f"--plugin-bundle {name!r} is not a plugin bundle (set by `attnlab study submit`)")
    found = importlib.util.find_spec(name)
    if found is None or not found.submodule_search_locations:
        raise UserError(f"--plugin-bundle {name!r} is not on this process's path (runtime_env py_modules of "
                        "`attnlab study submit`)")
    path = Path(list(found.submodule_search_locations)[0]) / BUNDLE_FILE
    return {origin: PluginSource.from_dict(record) for origin, record in json.loads(path.read_text()).items()}


def submit_study(study: str, address: str, *, working_dir: str = ".", store: str | None = None,
                 runs: str | None = None, cluster: str | None = None, submission_id: str | None = None,
                 plugins: list[str] | tuple = (), compact: bool = True) -> str:
    """Validate, package and submit; returns the job id. ``compact``: False runs the job with ``--no-compact``."""
    from attnlab.study.spec import load_spec

    if not address:
        raise UserError("--address is required (the head's dashboard, e.g. http://127.0.0.1:8265), or set RAY_ADDRESS")
    here = is_this_machine(address)
    store, runs = job_location(store, "--store", here), job_location(runs, "--runs", here)
    spec = load_spec(study, plugins=plugins)
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
    runtime_env = {"working_dir": str(wd), "excludes": PACKAGE_EXCLUDES, "env_vars": env_vars}
    folder = tempfile.mkdtemp(prefix="attnlab-submit-")
    try:
        bundle = None
        if spec.plugins:  # uploaded by submit_job: what the job runs is these bytes, whatever happens to the files
            bundle = write_bundle(spec.plugins, folder)
            runtime_env["py_modules"] = [str(bundle)]
        return client.submit_job(
            entrypoint=entrypoint(rel.as_posix(), store, runs, plugins, bundle.name if bundle else None, compact,
                                  python=sys.executable if here else None),
            runtime_env=runtime_env, submission_id=submission_id, metadata={"study": spec.name},
            entrypoint_num_cpus=0)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _submit(args: argparse.Namespace) -> int:
    job_id = submit_study(args.study, args.address, working_dir=args.working_dir, store=args.store,
                          runs=args.runs, cluster=args.cluster, submission_id=args.submission_id,
                          plugins=args.plugin or (), compact=args.compact)
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
