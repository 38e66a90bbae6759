"""Stopping a study: SIGINT (Ctrl-C) and SIGTERM (what ``timeout``, systemd, Slurm and Kubernetes send) end
``attnlab study run`` alike, as an outcome, not a crash.

Owns the study's signal handlers (:class:`StopSignals`, a context manager around one ``run_study``): the first
signal during the search stops Tune as its own Ctrl-C does, and anywhere else, or a second time, it raises
:class:`attnlab.errors.Interrupted` where the driver is; the watcher that ends the study itself when the signal has
also ended its embedded Ray cluster; and :func:`record_interrupted`, which marks the trials that were running as
interrupted (never pruned) with the step their runs reached.

It must never lose a trial's state or print Ray's stack dump: the same command resumes the study, and the last line
says so (the exit status is 128 + the signal). It never imports Ray: signals, files and a TCP connection.

Details: docs/watching.md#stopping-a-study-and-resuming-it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

from attnlab.errors import Interrupted
from attnlab.states import TrialStatus
from attnlab.study.folder import StudyFolder

GCS_CHECK_S = 0.5  # how often the watcher asks whether the cluster's GCS still answers


def gcs_answers(address: str, timeout: float = 1.0) -> bool:
    """Whether something accepts a TCP connection at ``address`` (``host:port``, a cluster's GCS). A busy GCS still
    answers (the kernel accepts for it); one whose process has ended is refused at once."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


class StopSignals:
    """SIGINT and SIGTERM during one ``run_study`` (a context manager).

    The first signal during the search (:meth:`search`) is Tune's own Ctrl-C: the handler Tune puts on SIGUSR1 while
    its loop runs is called (Tune's SIGINT handler is turned off, ``TUNE_DISABLE_SIGINT_HANDLER``: this class stands
    for it, for both signals). Tune's loop ends, its experiment state is saved with the unfinished trials marked to
    resume, its trials are stopped and ``tuner.fit`` returns; the runner then records the trials that were running
    (:func:`record_interrupted`), prints the counts and raises :meth:`interrupted`, whose line the CLI prints last,
    with the command that resumes the study. Outside the search, or a second time, the signal raises
    :class:`~attnlab.errors.Interrupted` where the driver is."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, study: str):
        self.study = study
        self.received: signal.Signals | None = None
        self.at = 0.0  # when it was received
        self.searching = False
        self.outside_search = False  # a signal came outside the search: it ended the study where it was
        self.reported = threading.Lock()  # held by whoever reports the interrupted study: the runner or the watcher
        self._previous: dict = {}
        self._cluster: tuple[str, Callable[[], None], bool] | None = None
        self._done = threading.Event()

    # ------------------------------------------------------------------------------------------ handlers
    def install(self) -> None:
        """(Re)install the handlers: as the study starts, and once Ray has started, over its own: ``ray.init`` puts
        its own SIGTERM handlers in place, a native one of which prints a stack dump (``*** SIGTERM received at
        time=...``) and aborts."""
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only
        for sig in self.SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def __enter__(self) -> StopSignals:
        os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)

    def interrupted(self) -> Interrupted:
        """The outcome, for the command's last line."""
        name = self.received.name if self.received is not None else "a signal"
        return Interrupted(f"study {self.study} was interrupted ({name})",
                           self.received if self.received is not None else signal.SIGINT)

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received, self.at = signal.Signals(signum), time.time()
            self._watch_cluster()
            tune_interrupt = signal.getsignal(signal.SIGUSR1) if self.searching else None
            if callable(tune_interrupt):
                tune_interrupt(signal.SIGUSR1, frame)  # Tune's Ctrl-C: it stops at its next step
                return
        self.outside_search = self.outside_search or not self.searching  # then the watcher has nothing to report
        raise self.interrupted()

    @contextlib.contextmanager
    def search(self):
        """Around ``tuner.fit()``: a signal then stops Tune. SIGUSR1 is reset first: a handler an earlier search of
        this process left there is not this one's (until Tune installs its own, a signal raises)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        self.searching = True
        try:
            yield
        finally:
            self.searching = False

    # ------------------------------------------------------------------------------------------ a cluster that went
    def watch_cluster(self, gcs_address: str | None, report: Callable[[], None], own_process: bool) -> None:
        """Once a signal comes, watch the cluster's GCS at ``gcs_address``. A signal sent to a whole process group
        (``timeout``; a terminal's Ctrl-C reaches Ray's processes too, but they ignore SIGINT) or to every process of
        a job (Slurm, systemd) also ends the study's embedded cluster, and Tune's clean-up then waits on a GCS that
        is gone until Ray aborts the process 60 s later ("Failed to connect to GCS"). If it stops answering while the
        search is still stopping, ``report`` (record the interrupted trials, print the counts) runs from the watcher;
        with ``own_process`` (the process is the study's: the CLI) the process then ends with the study's last line,
        and a process ending after an interrupted study skips Ray's shutdown when the cluster is gone (it would wait
        on it, then abort, after that last line)."""
        if gcs_address:
            self._cluster = (gcs_address, report, own_process)

    def _watch_cluster(self) -> None:
        if self._cluster is None:
            return
        if self._cluster[2]:
            atexit.register(self._exit_without_ray)  # after Ray's own: it runs first
        threading.Thread(target=self._watch, daemon=True, name="attnlab-stop-watch").start()

    def _watch(self) -> None:
        address, report, own_process = self._cluster
        while not self._done.wait(GCS_CHECK_S):
            if gcs_answers(address):
                continue
            if self.outside_search or not self.reported.acquire(blocking=False):
                return  # nothing to report, or the runner reports
            try:
                report()
                if own_process:  # the search would wait on the cluster until Ray aborts the process: it ends here
                    sys.stdout.flush()
                    print(self.interrupted().last_line(sys.argv[1:]), file=sys.stderr, flush=True)
                    os._exit(128 + int(self.received))
            finally:
                self.reported.release()  # the runner, which waits for it, raises the outcome
            return

    def _exit_without_ray(self) -> None:
        if self.received is not None and not gcs_answers(self._cluster[0]):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + int(self.received))


def record_interrupted(state: StudyFolder, stop: StopSignals) -> None:
    """After an interrupted search: each trial left running (its process was stopped with the search), or recorded
    failed by the stop itself (a Train run's controller stopped under it), is interrupted, with the step its run
    reached. The same command resumes it from its run's latest checkpoint."""
    from attnlab.runfolder import read_metrics

    how = stop.received.name if stop.received is not None else "a signal"
    for record in state.statuses():
        status = TrialStatus.read(record.get("status"))
        if not (status is TrialStatus.RUNNING
                or (status is TrialStatus.FAILED and (record.get("updated") or 0) >= stop.at)):
            continue
        key = record["train_key"]
        try:
            lines = read_metrics(state.run(key)) if record.get("run_dir") else []
        except (OSError, ValueError):
            lines = []
        step = int(lines[-1].get("step", 0)) if lines else 0
        state.write_status(key, status=TrialStatus.INTERRUPTED, step=step,
                           reason=f"interrupted ({how}) at step {step} of {record.get('steps', '?')}; the same "
                                  "command resumes it from its run's latest checkpoint")


__all__ = ["StopSignals", "gcs_answers", "record_interrupted"]
