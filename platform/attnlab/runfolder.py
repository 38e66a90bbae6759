"""A training run's folder: the one owner of its files' format (``metrics.jsonl``, ``provenance.json``,
``failure.json``, the replica checksums) and of what is read back from them.

Training writes the files (rank 0, or every rank, straight to the run's location, local or a bucket); the trial,
the study's console and ``attnlab serve`` read them here, never through the trainer: a run's outcome
(:func:`outcome`: finished, diverged or incomplete), its metrics typed (:func:`decode_metrics`, the one place that
reads what older runs wrote), its progress (:class:`Progress`, :func:`watch`, :func:`latest_losses`) and its recorded
config as the stages that may not import training read it (:class:`TrainRecord`). It also holds
:class:`ValExtrapolation`, which the training and evaluation configs both hold and may not import from each other.

It must never import Ray or torch, nor leave anything on a worker's own disk: the reader may sit on another node.

Details: docs/cli.md#what-a-run-folder-holds (the layout), docs/architecture.md#one-owner-for-each-fact,
docs/protocol.md#validation-at-longer-lengths.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import time
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from attnlab.errors import UserError
from attnlab.location import Location
from attnlab.names import format_duration
from attnlab.states import RunStatus, StopReason

METRICS_FILE = "metrics.jsonl"
PROVENANCE_FILE = "provenance.json"
FAILURE_FILE = "failure.json"
REPLICAS_DIR = "replicas"
# On object storage the metrics file is rewritten at most this often (and always at a checkpoint, a
# validation, a divergence and the end); a local file is rewritten at every report.
REMOTE_FLUSH_SECONDS = 10.0
# The metrics key of the validation losses at longer lengths (ValExtrapolation): {"<length in tokens>": loss}.
VAL_LOSS_AT = "val_loss_at"


class ValExtrapolation(BaseModel):
    """Validation at longer lengths while a run trains: ``{multiples: [2, 4, 8], every: 100}`` measures the mean
    validation loss at ``round(m * train_len)`` tokens for each multiple ``m``, every ``every`` training steps and at
    the last step, with the model as trained (RoPE as trained, p as trained). The losses go to that step's
    ``metrics.jsonl`` line as ``val_loss_at: {"512": 2.9, ...}`` (:data:`VAL_LOSS_AT`). A run setting: it changes
    no weights, so no training key, study fingerprint or evaluation cell key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    multiples: list[float] = [2.0, 4.0, 8.0]  # of the training length, each > 1
    every: int  # training steps

    @model_validator(mode="before")
    @classmethod
    def _mapping(cls, data):
        if isinstance(data, (dict, ValExtrapolation)):
            return data
        raise ValueError("must be a mapping like {multiples: [2, 4, 8], every: 100}")

    @field_validator("multiples", mode="before")
    @classmethod
    def _multiples(cls, value):
        allowed = "a non-empty list of distinct numbers > 1 (multiples of the training length), e.g. [2, 4, 8]"
        items = value if isinstance(value, (list, tuple)) else [value]
        if not items or any(isinstance(m, bool) or not isinstance(m, numbers.Real) or not math.isfinite(m) or m <= 1
                            for m in items):
            raise ValueError(f"is not allowed: use {allowed}")
        out = [float(m) for m in items]
        if len(set(out)) != len(out):
            raise ValueError(f"repeats a value: use {allowed}")
        return out

    @field_validator("every", mode="before")
    @classmethod
    def _every(cls, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError("is not allowed: use a positive integer (training steps between measurements)")
        return int(value)

    def lengths(self, train_len: int) -> list[int]:
        """The lengths measured for a run trained at ``train_len``: ``round(m * train_len)``, distinct, sorted,
        each longer than ``train_len``."""
        lengths = {int(round(m * train_len)) for m in self.multiples}
        return sorted(length for length in lengths if length > train_len)

    def due(self, done: int, steps: int) -> bool:
        """Whether the measurement runs after training step ``done`` (1-based) of ``steps``."""
        return done % self.every == 0 or done == steps


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


def data_order_seed(data_seed, seed) -> int:
    """The seed a run's training batches are drawn with: its ``data_seed``, or its own ``seed`` when the config says
    ``data_seed: seed``."""
    return int(seed) if data_seed == "seed" else int(data_seed)


@dataclass(frozen=True)
class TrainRecord:
    """The fields of a recorded training config that the stages after training read (evaluation: its rows'
    identity columns, the precision, the validation batch and the data seed it must match). It states no default:
    ``TrainConfig`` wrote every field, and a record that lacks one is refused by name."""

    preset: str
    data: str | dict  # what the run trained on: a prepared folder (path or URI) or a generated source's mapping
    seed: int
    data_seed: int
    tokens_per_step: int
    precision: str
    val_batch: int
    record: dict  # the whole recorded config

    @property
    def plugin_sha256(self) -> str | None:
        """The sha256 of the attention plugin the run trained with (its recorded ``plugin``); None for a built-in
        variant, or a run recorded before configs carried their plugin."""
        plugin = self.record.get("plugin")
        return str(plugin["sha256"]) if isinstance(plugin, dict) and plugin.get("sha256") else None

    @classmethod
    def parse(cls, record, where: str = "checkpoint") -> TrainRecord:
        """``record``: the recorded dict, or a ``TrainConfig`` (recorded first, as a run records it)."""
        if hasattr(record, "model_dump"):
            record = record.model_dump(mode="json")
        if not isinstance(record, dict):
            raise UserError(f"{where}: its training config is a {type(record).__name__}, not a recorded TrainConfig")
        fields = [f.name for f in dataclasses.fields(cls) if f.name != "record"]
        missing = [name for name in fields if name not in record]
        if missing:
            raise UserError(f"{where}: its training config has no {missing[0]!r}; give the whole config as a run "
                            "records it (TrainConfig.model_dump(mode='json')) or the TrainConfig itself")
        return cls(preset=str(record["preset"]), data=record["data"], seed=int(record["seed"]),
                   data_seed=data_order_seed(record["data_seed"], record["seed"]),
                   tokens_per_step=int(record["tokens_per_step"]),
                   precision=str(record["precision"]), val_batch=int(record["val_batch"]), record=dict(record))


def recorded_train_key(run: Location) -> str | None:
    """The run's training key as its ``provenance.json`` records it (``config_hash`` in runs written before the key
    had its name); None without one."""
    provenance = run.read_json(PROVENANCE_FILE, default={}) or {}
    key = provenance.get("train_key") or provenance.get("config_hash")
    return str(key) if key else None


def decode_metrics(metrics: dict) -> dict:
    """A metrics mapping (a ``metrics.jsonl`` line, or what a checkpoint recorded) as this version writes it:
    ``stopped`` a :class:`StopReason` (from ``stop_reached`` in older files), ``mfu`` a float or None."""
    out = {k: v for k, v in metrics.items() if k != "stop_reached"}
    stop = StopReason.of(metrics)
    if stop is not None:
        out["stopped"] = stop
    if "mfu" in out and not isinstance(out["mfu"], (int, float)):
        out["mfu"] = None  # "unknown" in older lines: no peak-FLOPs figure for the device
    return out


def read_metrics(run: Location) -> list[dict]:
    if not run.exists(METRICS_FILE):
        return []
    return [decode_metrics(json.loads(line)) for line in run.read_text(METRICS_FILE).splitlines() if line.strip()]


def latest_losses(lines: list[dict]) -> dict:
    """The run's latest losses from its metrics lines: ``{"train_loss": the last report's, "val_loss": the last
    validation's}`` (None where there is none); for a finished run, its last train and validation loss."""
    train = next((m["train_loss"] for m in reversed(lines) if m.get("train_loss") is not None), None)
    val = next((m["val_loss"] for m in reversed(lines) if m.get("val_loss") is not None), None)
    return {"train_loss": train, "val_loss": val}


def write_failure(run: Location, reason: str, step: int, kind: str = RunStatus.DIVERGED) -> None:
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
    status: RunStatus
    final: dict  # the last metrics line
    checkpoint: str | None  # the latest checkpoint's location
    failure: str | None = None
    train_key: str | None = None
    # with a stopping rule (TrainConfig.stop_when): reached (met at steps_trained) or cap (steps ran out first);
    # None without a rule, or while the run is incomplete
    stopped: StopReason | None = None
    steps_trained: int | None = None  # the latest checkpoint's step


def outcome(run: str | Location, steps: int | None = None) -> TrainOutcome:
    """Read a run folder's result: last metrics, latest checkpoint, failure reason. ``steps``: the run's target;
    a run whose latest checkpoint is short of it (and that did not diverge) is ``incomplete``, unless that
    checkpoint met the run's stopping rule (``stopped: reached`` in its metrics): then it is ``finished``."""
    from attnlab.model.checkpoint import find_latest_checkpoint

    run = Location.parse(run, field="run")
    lines = read_metrics(run)
    final = lines[-1] if lines else {}
    failure = run.read_json(FAILURE_FILE)
    try:
        checkpoint = find_latest_checkpoint(run)
        meta = json.loads(checkpoint.read_bytes("meta.json"))
        step, stopped = meta.get("step"), StopReason.of(meta.get("metrics") or {})
    except UserError:
        checkpoint, step, stopped = None, None, None
    if failure:
        status = RunStatus.DIVERGED
    elif checkpoint is None or (steps is not None and (step or 0) < steps and stopped is not StopReason.REACHED):
        status = RunStatus.INCOMPLETE
    else:
        status = RunStatus.FINISHED
    return TrainOutcome(run.uri, status, final, checkpoint.uri if checkpoint else None,
                        failure["reason"] if failure else None, recorded_train_key(run),
                        stopped if status is RunStatus.FINISHED else None, None if step is None else int(step))


# ------------------------------------------------------------------------------------------ progress
class Progress:
    """A run's progress as its metrics show it: the latest step and losses, the pace since it was first seen,
    and an estimate of the time left."""

    def __init__(self, steps: int):
        self.steps = int(steps)
        self.first: tuple[float, int] | None = None
        self.last: dict = {}
        self.val_loss: float | None = None

    def update(self, lines: list[dict], now: float | None = None) -> bool:
        """Take the metrics lines read so far; True when the step moved."""
        now = time.monotonic() if now is None else now
        if not lines:
            return False
        moved = lines[-1].get("step") != self.last.get("step")
        self.last = lines[-1]
        self.val_loss = latest_losses(lines)["val_loss"]
        if self.first is None:
            self.first = (now, int(self.last.get("step", 0)))
        self._now = now
        return moved

    def eta_seconds(self) -> float | None:
        if self.first is None or not self.last:
            return None
        t0, s0 = self.first
        done = int(self.last.get("step", 0)) - s0
        if done <= 0 or self._now <= t0:
            return None
        return (self.steps - int(self.last.get("step", 0))) * (self._now - t0) / done

    def line(self) -> str:
        step = int(self.last.get("step", 0))
        parts = [f"step {step:,}/{self.steps:,}"]
        if "train_loss" in self.last:
            parts.append(f"loss {self.last['train_loss']:.4f}")
        if self.val_loss is not None:
            parts.append(f"val {self.val_loss:.4f}")
        eta = self.eta_seconds()
        if self.last.get("stopped") is StopReason.REACHED:
            parts.append("stopping rule met: done")
        elif step >= self.steps:
            parts.append("done")
        elif eta is not None:
            parts.append(f"ETA {format_duration(eta)}")
        return " · ".join(parts)


def watch(run: Location, steps: int, stop, emit, interval: float = 5.0) -> None:
    """Until ``stop`` (a threading.Event) is set, emit a progress line whenever the run's step moves."""
    progress = Progress(steps)
    while True:
        stopped = stop.wait(interval)
        try:
            if progress.update(read_metrics(run)):
                emit(progress.line())
        except (OSError, ValueError):  # a file being replaced, a bucket hiccup: try again next time
            pass
        if stopped:  # one last look after the run ended
            return
