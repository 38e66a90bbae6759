"""Where a study keeps its state, under ``<runs>/<study>/`` (``<runs>`` is the runs folder, ``--runs``: a local
folder or object storage), and how the study's files are read and written.

Owns that layout, the one place that knows it (:class:`StudyFolder`; ``attnlab serve`` reads it too): the saved
study (``study.json``, read back typed as a :class:`SavedStudy`), each training run's status file
(``trials/<train_key>.json``, read back as a :class:`TrialRecord`), the events counted per training started, the
figures' folder, each run's folder and the Optuna storage URL; and the one place that reads the older
``config_hash`` of files written before the run's key was named ``train_key``.

Every file is written whole (:mod:`attnlab.location`): nothing may be appended, so the layout works on a bucket.
It must never import Ray or torch.

Details: docs/watching.md#the-runs-folder (the layout), docs/studies.md#paths-uris-and-whole-file-writes.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass

from attnlab.location import Location
from attnlab.states import TrialStatus

TUNE_DIR, RUNS_DIR, TRIALS_DIR, EVENTS_DIR, CURVES_DIR, STUDY_FILE = "tune", "runs", "trials", "events", "curves", \
    "study.json"
STATUSES = TrialStatus.recorded()  # what a status file's status may say (attnlab.states.TrialStatus)


@dataclass(frozen=True)
class SavedStudy:
    """A study's ``study.json``, typed: the spec as the user wrote it (``StudySpec.to_json``), its search
    fingerprint, the Ray cluster its latest run ran on, and what a reader shows of the spec (the search engine,
    the description, the Optuna storage, the objectives), each parsed here once."""

    spec: dict
    fingerprint: str | None
    ray: dict | None  # {"dashboard": URL or None, "note", "recorded", "embedded" (+ "host", "pid"), "stopped"}:
    # ray_runtime.Dashboard.record(), "stopped" once an embedded cluster ended (StudyFolder.record_cluster_stopped)
    objectives: tuple  # attnlab.study.spec.Objective, in the spec's order (those that no longer parse left out)

    @classmethod
    def parse(cls, record: dict) -> SavedStudy:
        from attnlab.study.spec import Objective

        spec = record.get("spec") if isinstance(record.get("spec"), dict) else {}
        raw = spec.get("objective")
        objectives = []
        for item in raw if isinstance(raw, list) else ([raw] if raw else []):
            try:
                objectives.append(Objective.model_validate(item))
            except ValueError:
                continue
        ray = record.get("ray")
        return cls(spec, record.get("fingerprint"), ray if isinstance(ray, dict) else None, tuple(objectives))

    @property
    def engine(self) -> str:
        return (self.spec.get("search") or {}).get("engine", "grid")

    @property
    def description(self) -> str | None:
        return self.spec.get("description")

    @property
    def optuna_storage(self) -> str | None:
        return self.spec.get("optuna_storage") or self.spec.get("storage")  # "storage": an older study.json


@dataclass(frozen=True)
class TrialRecord:
    """A training run's status file (``trials/<train_key>.json``) read back typed: what the console and the page
    show of it. The file is a mapping its trial updates (:meth:`StudyFolder.write_status`); fields a file written
    by an older attnlab lacks read as None."""

    train_key: str | None
    status: TrialStatus  # UNKNOWN for a file without a status the enum knows
    trial: str | None  # the Tune trial that holds the run
    point: dict
    attention: str | None  # the variant trained, as its TrainConfig resolved it
    reason: str | None
    steps: int | None  # the run's target (the cap, with a stopping rule)
    step: int | None  # the step reached, when the trial recorded it
    objectives: dict
    run_dir: str | None
    started: float | None
    updated: float | None
    parent: str | None = None  # a stage's run: the train_key of the run whose final weights it started from
    stage: str | None = None  # a study with stages: the stage's name (None for the study's own points)

    @classmethod
    def parse(cls, record: dict) -> TrialRecord:
        record = _with_train_key(record) or {}
        point = dict(record.get("point") or {})
        return cls(train_key=record.get("train_key"), status=TrialStatus.read(record.get("status")),
                   trial=record.get("trial"), point=point,
                   attention=record.get("attention") or point.get("attention"), reason=record.get("reason"),
                   steps=record.get("steps"), step=record.get("step"), objectives=dict(record.get("objectives") or {}),
                   run_dir=record.get("run_dir"), started=record.get("started"), updated=record.get("updated"),
                   parent=((record.get("config") or {}).get("init_from") or {}).get("train_key"),
                   stage=point.get("stage"))


def _with_train_key(record: dict | None) -> dict | None:
    """A status record with its run's key under ``train_key`` (older files say ``config_hash``)."""
    if record and "train_key" not in record and "config_hash" in record:
        record = {**record, "train_key": record["config_hash"]}
        record.pop("config_hash")
    return record


class StudyFolder:
    """The state of study ``name`` in the runs folder ``runs``."""

    def __init__(self, runs: str | Location, name: str):
        self.runs = Location.parse(runs, field="--runs")
        self.name = name
        self.loc = self.runs.child(name)

    def __repr__(self) -> str:
        return f"StudyFolder({self.loc.uri!r})"

    @property
    def tune(self) -> Location:
        return self.loc.child(TUNE_DIR)

    @property
    def curves(self) -> Location:
        return self.loc.child(CURVES_DIR)

    def run(self, train_key: str) -> Location:
        return self.loc.child(RUNS_DIR, train_key)

    # ------------------------------------------------------------------------------------- the saved study
    def saved_study(self) -> SavedStudy | None:
        """``study.json`` read back typed; None before the study first ran."""
        record = self.loc.read_json(STUDY_FILE)
        return SavedStudy.parse(record) if isinstance(record, dict) else None

    def write_study(self, spec_json: dict, search_fingerprint: str, ray: dict | None = None) -> None:
        """``ray``: the cluster the study runs on, ``{"dashboard": URL or None, "note": why none, "recorded":
        time}`` (:meth:`attnlab.ray_runtime.Dashboard.record`); ``attnlab serve`` links to that dashboard."""
        record = {"fingerprint": search_fingerprint, "spec": spec_json}
        if ray is not None:
            record["ray"] = ray
        self.loc.write_json(STUDY_FILE, record)

    def record_cluster_stopped(self, pid: int | None = None) -> None:
        """Say in ``study.json`` that the embedded Ray cluster its latest run ran on has stopped (``ray.stopped``:
        the time), so ``attnlab serve`` no longer links to its dashboard. Called as that process ends; ``pid``
        (that process): only when the record is still its own (a later run of the study may have replaced it)."""
        record = self.loc.read_json(STUDY_FILE)
        if isinstance(record, dict) and isinstance(record.get("ray"), dict) and (
                pid is None or record["ray"].get("pid") == pid):
            self.loc.write_json(STUDY_FILE, {**record, "ray": {**record["ray"], "stopped": time.time()}})

    # ------------------------------------------------------------------------------------- trials
    def status(self, train_key: str) -> dict | None:
        return _with_train_key(self.loc.read_json(f"{TRIALS_DIR}/{train_key}.json"))

    def write_status(self, train_key: str, **fields) -> dict:
        """Update a training run's status file with ``fields`` (the trial that holds it is its only writer)."""
        current = self.status(train_key) or {}
        record = {**current, **fields, "train_key": train_key, "updated": time.time()}
        self.loc.write_json(f"{TRIALS_DIR}/{train_key}.json", record)
        return record

    def trials(self) -> list[TrialRecord]:
        """Every training run's status, typed (:class:`TrialRecord`), ordered by train key."""
        return [TrialRecord.parse(record) for record in self.statuses()]

    def statuses(self) -> list[dict]:
        """Every training run's status record as written, ordered by train key."""
        out = []
        for name in self.loc.list_names(TRIALS_DIR, hidden=False):
            if name.endswith(".json"):
                record = _with_train_key(self.loc.read_json(f"{TRIALS_DIR}/{name}"))
                if record:
                    out.append(record)
        return out

    # ------------------------------------------------------------------------------------- events
    def record_training_started(self, train_key: str, point: dict) -> None:
        name = f"{time.strftime('%Y%m%dT%H%M%S')}-{train_key}-{uuid.uuid4().hex[:8]}.json"
        self.loc.write_json(f"{EVENTS_DIR}/{name}", {"event": "train", "train_key": train_key, "point": point,
                                                     "time": time.time()})

    def trainings_started(self) -> int:
        return sum(1 for name in self.loc.list_names(EVENTS_DIR, hidden=False) if name.endswith(".json"))

    # ------------------------------------------------------------------------------------- Optuna
    def optuna_url(self, configured: str | None) -> str:
        """The Optuna RDB URL: the study's ``optuna_storage:``, else SQLite next to the state when that is a local
        folder, else SQLite in this node's attnlab cache (a bucket cannot hold a live database)."""
        if configured:
            return configured
        if self.loc.is_local:
            self.loc.mkdir()
            return f"sqlite:///{self.loc.child('optuna.db').path}"
        from attnlab.cache import cache_dir

        folder = cache_dir() / "optuna"
        os.makedirs(folder, exist_ok=True)
        return f"sqlite:///{folder / f'{self.name}.db'}"
