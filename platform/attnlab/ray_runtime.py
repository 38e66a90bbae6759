"""Connecting to Ray: the one place that decides which cluster attnlab runs on.

Owns :func:`ensure_ray` (keep the cluster this process joined, else join the one ``RAY_ADDRESS`` names, else start
an embedded local Ray, started again when a start times out or loses its dashboard port), the environment every
process of that cluster gets (local defaults the user did not set; ``RAY_API_SERVER_ADDRESS``, the cluster's own
dashboard, so that Ray Train's placement-group cleaner never scans the machine and fails when it finds several
clusters), :func:`dashboard` (where the joined cluster's dashboard is, or why there is none: a study prints it and
records it for ``attnlab serve``) and the quiet console (:func:`quiet_ray`: Ray's own output to a log file).

No other module calls ``ray.init``; this one must never import attnlab's science, data or study code, and is one
of the thin Ray layer's modules (tests/test_architecture.py's ``RAY_MODULES``).

Details: docs/studies.md#which-ray-cluster-a-command-joins (why the variable), docs/watching.md#watching-a-running-study
(the dashboard), docs/watching.md#stopping-a-study-and-resuming-it (a local start made again).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import socket
import time
import warnings
from dataclasses import dataclass

from attnlab.errors import UserError

LOCAL_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0",
    "RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS": "0",
    # Ray's log monitor globs the session's log folder every 0.1 s until it holds 1,000 files, every 0.5 s after:
    # a study's worker logs grow to hundreds, and one test session's log monitor took 49 s of CPU in 20 minutes on
    # 2 cores. On 800 log files, 0.5 s halves its CPU; a new worker's first lines reach the driver up to 0.5 s later
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
}
API_SERVER_ENV = "RAY_API_SERVER_ADDRESS"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ask_dashboard(address: str) -> tuple[str | None, bool]:
    """``(url, answered)``: the dashboard URL the GCS at ``address`` records (None: the cluster has none), and
    whether the GCS could be asked at all."""
    from ray._private import ray_constants
    from ray._private.services import canonicalize_bootstrap_address_or_die
    from ray._raylet import GcsClient

    try:
        gcs = GcsClient(address=canonicalize_bootstrap_address_or_die(address))
        value = gcs.internal_kv_get(ray_constants.DASHBOARD_ADDRESS.encode(),
                                    namespace=ray_constants.KV_NAMESPACE_DASHBOARD, timeout=30)
    except Exception:  # noqa: BLE001 - private Ray API, best effort: Ray works without it, only less tidily
        return None, False
    if not value:
        return None, True
    value = value.decode()
    return (value if value.startswith(("http://", "https://")) else f"http://{value}"), True


def cluster_api_server(address: str) -> str | None:
    """The dashboard (State API) URL of the running cluster whose GCS is ``address`` (``host:port``), as the GCS
    records it; None when the cluster has no dashboard or cannot be asked."""
    return _ask_dashboard(address)[0]


@dataclass(frozen=True)
class Dashboard:
    """The Ray dashboard of the cluster this process runs on: ``url`` (None when there is none, or it is not
    known), ``note``, why not (empty when ``url`` is set), and ``embedded``: the cluster is the one
    :func:`ensure_ray` started in this process, so it stops when this process ends."""

    url: str | None
    note: str = ""
    embedded: bool = False

    def line(self) -> str:
        """``Ray dashboard: http://...`` or ``Ray dashboard: none (why)``, as the plan line ends."""
        return f"Ray dashboard: {self.url}" if self.url else f"Ray dashboard: none ({self.note})"

    def record(self) -> dict:
        """What a study writes to its state for ``attnlab serve`` (``StudyFolder.write_study``); an embedded
        cluster's also names this process (``host``, ``pid``: the cluster lives as long as it does)."""
        out = {"dashboard": self.url, "note": self.note, "recorded": time.time(), "embedded": self.embedded}
        if self.embedded:
            out.update(host=socket.gethostname(), pid=os.getpid())
        return out


_dashboards: dict[str, Dashboard] = {}  # by GCS address: an embedded cluster's own, or what its GCS answered


def dashboard() -> Dashboard:
    """The dashboard of the Ray cluster this process is connected to (call after :func:`ensure_ray`): the port
    ``ensure_ray`` chose for an embedded cluster, else the address the cluster's GCS records (a cluster named by
    ``RAY_ADDRESS``, a Ray job's driver, a cluster joined before), asked once per cluster."""
    import ray

    if not ray.is_initialized():
        return Dashboard(None, "not connected to a Ray cluster")
    try:
        gcs = ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - e.g. a Ray Client (ray://) connection, which has no GCS address here
        return Dashboard(None, "unknown: this connection does not tell the cluster's GCS address")
    if gcs not in _dashboards:
        url, answered = _ask_dashboard(gcs)
        _dashboards[gcs] = Dashboard(url, "" if url else ("the cluster runs without one" if answered
                                                          else f"unknown: the cluster's GCS at {gcs} did not answer"))
    return _dashboards[gcs]


def _api_server_runtime_env() -> dict | None:
    """``{"env_vars": {RAY_API_SERVER_ADDRESS: ...}}`` for the job runtime env of a driver joining the cluster
    ``RAY_ADDRESS`` names (why: docs/studies.md#which-ray-cluster-a-command-joins); None when it is already set or
    cannot be found."""
    address = os.environ.get("RAY_ADDRESS", "")
    if os.environ.get(API_SERVER_ENV) or "://" in address or address in ("", "local"):
        return None
    url = cluster_api_server(address)
    if not url:
        return None
    os.environ[API_SERVER_ENV] = url  # this driver's own State API calls too
    return {"env_vars": {API_SERVER_ENV: url}}


# Ray gives a starting node's raylet a fixed 30 s to register (ray/_private/node.py); on a loaded machine that can pass.
STARTUP_RETRY_PAUSE_S = 10.0
STARTUP_TIMEOUTS = 2  # a start that timed out is tried once more, after the pause
DASHBOARD_PORT_TRIES = 3
STOP_WAIT_S = 5.0  # how long a failed start's processes get to end after SIGTERM, before SIGKILL


def _startup_timed_out(exc: BaseException) -> bool:
    return "timed out during startup" in str(exc)


def _port_taken(exc: BaseException) -> bool:
    """Ray's ``ValueError`` for a dashboard port something else bound first."""
    return isinstance(exc, ValueError) and "already occupied" in str(exc)


class _StartAttempt:
    """One ``ray.init`` of a local cluster, and what it launched.

    ``ray.init`` builds its node (``ray._private.node.Node``) in the node's constructor, which starts the GCS, the
    raylet, the dashboard and the monitors, and only then hands the node to Ray. A start that fails in there (the
    raylet did not register in time, the dashboard port was taken) raises before Ray keeps the node: ``ray.shutdown()``
    knows none of its processes, and each failed attempt left its GCS, dashboard, raylet and agents running under
    the study for as long as it ran. So an attempt keeps the node it was building (``recording``): Ray's own record
    of the processes it launched and of its session folder, and :meth:`stop` ends them by process id (with their
    children: the raylet's agents and workers, the dashboard's modules), never by name."""

    def __init__(self) -> None:
        self.node = None

    @contextlib.contextmanager
    def recording(self):
        from ray._private import node as ray_node

        real = ray_node.Node
        attempt = self

        class RecordedNode(real):
            def __init__(self, *args, **kwargs):
                attempt.node = self  # before its processes start: what it starts lands in its all_processes
                super().__init__(*args, **kwargs)

        ray_node.Node = RecordedNode
        try:
            yield self
        finally:
            ray_node.Node = real

    @property
    def session(self) -> str | None:
        """The attempt's Ray session folder (``<temp>/ray/session_*``), once Ray chose it."""
        return getattr(self.node, "_session_dir", None) if self.node is not None else None

    def processes(self) -> list:
        """The processes the attempt launched that are still running, and theirs (``psutil.Process``)."""
        import psutil

        launched = [info.process for infos in getattr(self.node, "all_processes", {}).values() for info in infos]
        found: dict[int, psutil.Process] = {}
        for popen in launched:
            if popen.poll() is not None:  # ended (and reaped now)
                continue
            try:
                proc = psutil.Process(popen.pid)  # our child, not reaped: its id is not anyone else's
                found[proc.pid] = proc
                for child in proc.children(recursive=True):
                    found.setdefault(child.pid, child)
            except psutil.Error:
                continue
        return list(found.values())

    def stop(self, remove_session: bool) -> int:
        """End every process the attempt launched (SIGTERM, then SIGKILL after ``STOP_WAIT_S``), reap them, and
        remove its session folder when ``remove_session``. Returns how many processes were running."""
        import psutil

        procs = self.processes()
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
                proc.resume()  # one stopped (SIGSTOP) acts on its SIGTERM only once it runs
        _, alive = psutil.wait_procs(procs, timeout=STOP_WAIT_S)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=STOP_WAIT_S)
        for infos in getattr(self.node, "all_processes", {}).values():
            for info in infos:  # reap the attempt's own children (psutil reaped those it waited for)
                with contextlib.suppress(Exception):
                    info.process.wait(timeout=0.1)
        if remove_session and self.session:
            shutil.rmtree(self.session, ignore_errors=True)
        return len(procs)


def _start_local(ray, dashboard: bool, **init_kwargs) -> int | None:
    """``ray.init`` of a local cluster, attempted until it starts; returns its dashboard's port (None: none).

    A failed attempt's processes are stopped (:class:`_StartAttempt`), and its session folder removed, before the
    next attempt, which is made, with one console line saying why, when the attempt timed out (once more, after a pause: Ray's 30 s may pass on a loaded machine) or lost its dashboard
    port (another port, up to ``DASHBOARD_PORT_TRIES`` in all: a free port chosen here can be taken before Ray
    binds it, by another cluster starting on this machine at the same moment). A second time-out is a
    :class:`UserError` in one line naming that attempt's logs; any other failure is raised as it is."""
    import attnlab.faults as faults

    timeouts = ports = 0
    for number in itertools.count():
        port = None
        if dashboard:
            port = _free_port()
            init_kwargs.update(dashboard_host="127.0.0.1", dashboard_port=port)
            os.environ[API_SERVER_ENV] = f"http://127.0.0.1:{port}"  # inherited by this cluster's processes only
        faults.before_ray_start(number, port)
        attempt = _StartAttempt()
        try:
            with attempt.recording():
                ray.init(**init_kwargs)
            return port
        except BaseException as exc:
            timed_out, taken = _startup_timed_out(exc), dashboard and _port_taken(exc)
            timeouts, ports = timeouts + timed_out, ports + taken
            again = (timed_out and timeouts < STARTUP_TIMEOUTS) or (taken and ports < DASHBOARD_PORT_TRIES)
            ray.shutdown()  # the driver's side of the attempt
            stopped = attempt.stop(remove_session=again)  # the cluster's side: what Ray's shutdown never knew
            if again:
                why = (f"it did not start in time (its raylet did not register within Ray's 30 s; the machine may be "
                       f"busy); trying once more in {STARTUP_RETRY_PAUSE_S:g} s" if timed_out else
                       f"its dashboard port {port} was taken before Ray bound it; trying another port")
                print(f"attnlab: the local Ray cluster was started again: {why} (the failed start's {stopped} "
                      "process(es) were stopped and its session folder removed)", flush=True)
                if timed_out:
                    time.sleep(STARTUP_RETRY_PAUSE_S)
                continue
            if timed_out:
                logs = os.path.join(attempt.session, "logs") if attempt.session else os.path.join(
                    os.environ.get("RAY_TMPDIR", "/tmp"), "ray", "session_latest", "logs")
                raise UserError(f"the local Ray cluster did not start in time, twice (the machine may be overloaded): "
                                f"see {logs} (raylet.out, gcs_server.out), or join a running cluster with "
                                "RAY_ADDRESS") from None
            raise


def ensure_ray(num_cpus: int | None = None, object_store_mb: int = 512, dashboard: bool = True,
               log_to_driver: bool = True) -> bool:
    """Make sure this process is connected to Ray. Returns True if this call started a local cluster."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(configure_logging=False, log_to_driver=log_to_driver, runtime_env=_api_server_runtime_env())
        return False
    for key, value in LOCAL_ENV.items():
        os.environ.setdefault(key, value)
    port = _start_local(ray, dashboard, address="local", num_cpus=num_cpus or max(4, os.cpu_count() or 1),
                        include_dashboard=dashboard, object_store_memory=object_store_mb * 1024**2,
                        configure_logging=False, log_to_driver=log_to_driver)
    _dashboards[ray.get_runtime_context().gcs_address] = (
        Dashboard(f"http://127.0.0.1:{port}", embedded=True) if dashboard
        else Dashboard(None, "this embedded cluster was started without one", embedded=True))
    return True


def gcs_address() -> str | None:
    """The GCS address (``host:port``) of the cluster this process is connected to; None when not connected, or when
    the connection does not tell it (a Ray Client ``ray://`` one)."""
    import ray

    try:
        return ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - as in dashboard()
        return None


def log_file(folder: str, what: str) -> str:
    """A new log file path ``<folder>/<what>-<time>.log`` (the folder is created)."""
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{what}-{time.strftime('%Y%m%d-%H%M%S')}.log")


def quiet_ray(path: str) -> None:
    """Send Ray's, Tune's and Train's own logging, Python warnings and the raylets' messages to this driver
    (``(raylet) WARNING: N PYTHON worker processes have been started ...``) to the file ``path`` instead of the
    terminal (``ensure_ray(log_to_driver=False)`` keeps the workers' output in Ray's session logs). Errors attnlab
    reports itself still reach the terminal, one line each."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.attnlab_quiet = True  # a later call (the demo's second study) replaces it
    for name in ("ray", "ray.tune", "ray.train", "ray.data", "optuna"):
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            if getattr(old, "attnlab_quiet", False) or not isinstance(old, logging.FileHandler):
                logger.removeHandler(old)
        logger.addHandler(handler)
        logger.propagate = False
    stream = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    def to_file(message, category, filename, lineno, file=None, line=None):
        stream.write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = to_file
    _raylet_messages_to(stream)


def _raylet_messages_to(stream) -> None:
    """Send the messages raylets push to this driver to ``stream`` (the quiet log file) instead of the terminal.

    Ray's driver prints them from a thread of its own (``ray._private.worker.listen_error_messages``, started by
    every ``ray.init`` whatever ``log_to_driver`` says) through ``print_to_stdstream``, as ``(raylet) ...`` lines:
    e.g. ``WARNING: 16 PYTHON worker processes have been started on node ...``, which a study of many short
    trials triggers. Only those lines (``pid`` "raylet") are routed; anything else goes to Ray's own printer."""
    from ray._private import worker as ray_worker

    printer = getattr(ray_worker.print_to_stdstream, "attnlab_ray_printer", ray_worker.print_to_stdstream)

    def print_to_stdstream(data, ignore_prefix):
        if data.get("pid") != "raylet":
            return printer(data, ignore_prefix)
        for line in data.get("lines", []):
            stream.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} (raylet) {line}\n")
        return None

    print_to_stdstream.attnlab_ray_printer = printer  # a later call (the demo's second study) replaces this one
    ray_worker.print_to_stdstream = print_to_stdstream
