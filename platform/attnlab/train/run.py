"""A training run's folder: its files, written by rank 0 (or every rank) straight to the run's location, and
how to read its outcome back. The folder may be local or on object storage; nothing is left on a worker's
own disk, so the process that reads the outcome may sit on another node than the one that trained.

Layout of a run folder (``RUN``)::

    RUN/metrics.jsonl          one JSON object per report (step, train_loss, lr, grad_norm, tokens_per_s, mfu,
                               val_loss when measured), rewritten whole (object storage has no append)
    RUN/provenance.json        config, train_key, git, versions, hardware, data fingerprint, FLOPs
    RUN/failure.json           only when the run diverged: {"reason", "step", "kind"}
    RUN/replicas/rankN.sha256  each DDP rank's final weights (replicas must end byte-identical)
    RUN/checkpoint_*/          Ray Train's checkpoints (RUN/checkpoints/step_*/ for a plain-process run)

No Ray, no torch here.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from attnlab.errors import UserError
from attnlab.location import Location

METRICS_FILE = "metrics.jsonl"
PROVENANCE_FILE = "provenance.json"
FAILURE_FILE = "failure.json"
REPLICAS_DIR = "replicas"
# On object storage the metrics file is rewritten at most this often (and always at a checkpoint, a
# validation, a divergence and the end); a local file is rewritten at every report.
REMOTE_FLUSH_SECONDS = 10.0


class MetricsLog:
    """``RUN/metrics.jsonl``, kept in memory and rewritten whole; on resume, lines past the checkpoint go."""

    def __init__(self, run: Location, keep_through_step: int | None = None):
        self.run = run
        self.lines: list[str] = []
        if run.exists(METRICS_FILE):
            self.lines = [line for line in run.read_text(METRICS_FILE).splitlines() if line.strip()]
        if keep_through_step is not None:
            kept = [line for line in self.lines if json.loads(line).get("step", -1) <= keep_through_step]
            changed = len(kept) != len(self.lines)
            self.lines = kept
            if changed:
                self.flush()
        self._flushed = time.monotonic()

    def append(self, metrics: dict, force: bool = False) -> None:
        self.lines.append(json.dumps(metrics))
        if force or self.run.is_local or time.monotonic() - self._flushed >= REMOTE_FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        self.run.write_text(METRICS_FILE, "".join(line + "\n" for line in self.lines))
        self._flushed = time.monotonic()


def read_metrics(run: Location) -> list[dict]:
    if not run.exists(METRICS_FILE):
        return []
    return [json.loads(line) for line in run.read_text(METRICS_FILE).splitlines() if line.strip()]


def write_failure(run: Location, reason: str, step: int, kind: str = "diverged") -> None:
    run.write_json(FAILURE_FILE, {"reason": reason, "step": int(step), "kind": kind})


def write_replica_checksum(run: Location, rank: int, digest: str) -> None:
    run.write_text(f"{REPLICAS_DIR}/rank{rank}.sha256", digest + "\n")


def replica_checksums(run: Location) -> dict[int, str]:
    out = {}
    for name in run.list_names(REPLICAS_DIR, hidden=False):
        if name.startswith("rank") and name.endswith(".sha256"):
            out[int(name[4:-7])] = run.read_text(f"{REPLICAS_DIR}/{name}").strip()
    return out


@dataclass
class TrainOutcome:
    run_dir: str  # the run's location (a path or a URI)
    status: str  # "finished" | "diverged" | "incomplete"
    final: dict  # the last metrics line
    checkpoint: str | None  # the latest checkpoint's location
    failure: str | None = None
    train_key: str | None = None


def outcome(run: str | Location, steps: int | None = None) -> TrainOutcome:
    """Read a run folder's result: last metrics, latest checkpoint, failure reason. ``steps``: the run's target;
    a run whose latest checkpoint is short of it (and that did not diverge) is ``incomplete``."""
    from attnlab.model.checkpoint import find_latest_checkpoint

    run = Location.parse(run, field="run")
    lines = read_metrics(run)
    final = lines[-1] if lines else {}
    failure = run.read_json(FAILURE_FILE)
    provenance = run.read_json(PROVENANCE_FILE, default={}) or {}
    try:
        checkpoint = find_latest_checkpoint(run)
        step = json.loads(checkpoint.read_bytes("meta.json")).get("step")
    except UserError:
        checkpoint, step = None, None
    if failure:
        status = "diverged"
    elif checkpoint is None or (steps is not None and (step or 0) < steps):
        status = "incomplete"
    else:
        status = "finished"
    return TrainOutcome(run.uri, status, final, checkpoint.uri if checkpoint else None,
                        failure["reason"] if failure else None, provenance.get("train_key"))
