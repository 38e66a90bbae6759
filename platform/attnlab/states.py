"""Control state as types: how a training run stopped, what a run folder's outcome is, and a trial's status.

Each is a ``str`` enum whose values are the strings the files have always held (``metrics.jsonl``, checkpoints'
``meta.json``, ``trials/<train_key>.json``, results rows, the web page's JSON), so files written before these types
existed read the same, and a member written to JSON is its value. Code compares members, never the strings:
this module is the one place that spells them. :meth:`read` turns what a file holds (a string, None, or a value
nothing knows) into a member. No imports from attnlab: train, evaluate, results, runfolder, study and serve all
read these.
"""

from __future__ import annotations

from enum import Enum


class _FileValue(str, Enum):
    """A ``str`` enum that prints and formats as its value on every Python (3.10's ``str(member)`` would otherwise
    say ``Class.MEMBER``), so f-strings, templates and JSON show the string the file holds."""

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def read(cls, value, default=None):
        """The member whose value ``value`` is; ``default`` for None or a value this enum does not know."""
        try:
            return cls(value)
        except ValueError:
            return default


class StopReason(_FileValue):
    """How a run with a stopping rule (``train.stop_when``) ended: the ``stopped`` field of its last metrics line,
    of the checkpoint that ended it, of its status file and of its results rows. A run without a rule has none."""

    REACHED = "reached"  # the rule was met (at ``steps_trained``)
    CAP = "cap"  # ``steps`` ran out first

    @classmethod
    def of(cls, metrics: dict) -> StopReason | None:
        """The stop a metrics mapping records: ``stopped``; a line written before ``stopped`` was the one field
        also said ``stop_reached`` (1 or 0), read here when ``stopped`` is missing."""
        stop = cls.read(metrics.get("stopped"))
        if stop is None and metrics.get("stop_reached") is not None:
            stop = cls.REACHED if metrics["stop_reached"] else cls.CAP
        return stop


class RunStatus(_FileValue):
    """A training run folder's outcome (:func:`attnlab.runfolder.outcome`)."""

    FINISHED = "finished"  # trained to ``steps``, or to where its stopping rule was met
    DIVERGED = "diverged"  # its loss left the finite numbers (``failure.json``)
    INCOMPLETE = "incomplete"  # no checkpoint yet, or the latest one is short of ``steps``


class TrialStatus(_FileValue):
    """A trial's status, the one word for where a trial stands: the ``status`` of its run's status file
    (``<runs>/<study>/trials/<train_key>.json``, read back whole as :class:`attnlab.study.folder.TrialRecord`),
    shown by the console and the web page."""

    RUNNING = "running"
    COMPLETE = "complete"  # trained and/or evaluated by this trial
    CACHED = "cached"  # found trained and evaluated: nothing to do
    DIVERGED = "diverged"
    PRUNED = "pruned"  # stopped by the scheduler (ASHA)
    INTERRUPTED = "interrupted"  # its study was stopped (SIGINT, SIGTERM) while it ran: the same command resumes it
    FAILED = "failed"
    SKIPPED = "skipped"  # a stage's run whose parent run failed, diverged or was pruned: never trained from scratch
    UNKNOWN = "unknown"  # a status file without a (known) status: never written

    @classmethod
    def read(cls, value, default=None) -> TrialStatus:
        return super().read(value, cls.UNKNOWN if default is None else default)

    @classmethod
    def recorded(cls) -> tuple[TrialStatus, ...]:
        """The statuses a trial writes, in the order pages count them."""
        return tuple(s for s in cls if s is not cls.UNKNOWN)

    @property
    def succeeded(self) -> bool:
        """The run trained (or was found trained) and its cells are evaluated."""
        return self in (TrialStatus.COMPLETE, TrialStatus.CACHED)

    @property
    def has_reason(self) -> bool:
        """The trial ended without objectives, and its status file says why (``reason``)."""
        return self in (TrialStatus.FAILED, TrialStatus.DIVERGED, TrialStatus.PRUNED, TrialStatus.INTERRUPTED,
                        TrialStatus.SKIPPED)


__all__ = ["RunStatus", "StopReason", "TrialStatus"]
