"""The study's live view on the terminal: one compact line per trial whenever it changes (status, step, latest
loss, time), read from the study's state (``attnlab.study.folder``) and each running trial's metrics. It replaces
Ray's and Tune's own output, which goes to a log file (``attnlab.ray_runtime.quiet_ray``: Ray's logging, Python
warnings and the raylets' ``(raylet)`` messages to the driver).

Lines, not a redrawn screen: they read the same in a terminal, a ``ray job logs`` stream and a CI log. A trial
that fails or diverges prints its reason on its line. No Ray here: only files are read (and :func:`say`
appends a line the terminal shows to the log file).
"""

from __future__ import annotations

import threading
import time

from attnlab.names import format_duration
from attnlab.states import TrialStatus
from attnlab.study.folder import StudyFolder, TrialRecord
from attnlab.runfolder import Progress, read_metrics


def say(line: str, log: str | None = None) -> None:
    """Print ``line`` on the terminal and, when the study's output goes to a log file (``--verbose`` off), append
    it there too, so the log names what the terminal showed (the plan, the Ray dashboard)."""
    print(line, flush=True)
    if log:
        with open(log, "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} attnlab: {line}\n")


def trial_label(trial: TrialRecord) -> str:
    """What tells trials apart: the attention variant and the other searched settings of its point."""
    rest = ",".join(f"{k}={'off' if v is False else v}" for k, v in sorted(trial.point.items()) if k != "attention")
    return f"{trial.attention or '?'}" + (f" {rest}" if rest else "")


def trial_detail(state: StudyFolder, trial: TrialRecord, progress: Progress) -> str:
    """What a trial's line says after its status: a running trial's progress (``progress``, updated here from its
    metrics: step, losses, time left), a finished one's objectives, or why it ended without them."""
    if trial.status is TrialStatus.RUNNING and trial.run_dir and trial.train_key:
        try:
            progress.update(read_metrics(state.run(trial.train_key)))
        except (OSError, ValueError):
            pass
        return progress.line() if progress.last else ""
    if trial.status.succeeded:
        return " ".join(f"{k} {v:.4f}" for k, v in trial.objectives.items() if isinstance(v, float))
    if trial.status.has_reason:
        return str(trial.reason or "")[:200]
    return ""


def status_lines(state: StudyFolder) -> list[str]:
    """``attnlab study status``: the study's trials counted by status, then a line per trial (its status, point,
    run key and what :func:`trial_detail` says), running ones first."""
    trials = sorted(state.trials(), key=lambda t: (t.status is not TrialStatus.RUNNING, t.started or 0,
                                                   t.train_key or ""))
    counts: dict[str, int] = {}
    for trial in trials:
        counts[trial.status.value] = counts.get(trial.status.value, 0) + 1
    lines = [f"study {state.name}: {len(trials)} trial(s)"
             + (": " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) if counts else "")
             + f" ({state.loc.uri})"]
    for trial in trials:
        detail = trial_detail(state, trial, Progress(int(trial.steps or 0)))
        lines.append(f"  {trial.status:<11} {trial_label(trial):<28} {trial.train_key or '?':<16}  {detail}".rstrip())
    return lines


class LiveView:
    """Polls a study's trials every ``interval`` seconds and emits a line per change."""

    def __init__(self, state: StudyFolder, emit=print, interval: float = 5.0):
        self.state = state
        self.emit = emit
        self.interval = interval
        self.started = time.monotonic()
        self._progress: dict[str, Progress] = {}
        self._shown: dict[str, tuple] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def lines(self) -> list[str]:
        """The lines that changed since the last call."""
        out = []
        for trial in self.state.trials():
            key, status = trial.train_key, trial.status
            if not key:
                continue
            progress = self._progress.setdefault(key, Progress(int(trial.steps or 0)))
            shown = (status, trial_detail(self.state, trial, progress))
            if self._shown.get(key) == shown:
                continue
            self._shown[key] = shown
            elapsed = format_duration(time.monotonic() - self.started)
            out.append(f"  {elapsed:>7}  {status:<11} {trial_label(trial):<28} {shown[1]}".rstrip())
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                for line in self.lines():
                    self.emit(line)
            except (OSError, ValueError):
                continue

    def __enter__(self) -> LiveView:
        self._thread = threading.Thread(target=self._run, daemon=True, name="attnlab-live-view")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            for line in self.lines():  # the last changes
                self.emit(line)
        except (OSError, ValueError):
            pass
