"""Where a study keeps its state, under ``<runs>/<study>/`` (``<runs>`` is the runs folder, ``--runs``: a local
folder or object storage), and how the study's files are read and written. The one place that knows this layout
(``attnlab serve`` reads it too)::

    <runs>/<study>/study.json               the spec and its search fingerprint (a resumed search must match),
                                            and the Ray dashboard of the cluster its latest run runs on
    <runs>/<study>/tune/                    the Tune experiment (trial logs, TensorBoard files, searcher state)
    <runs>/<study>/runs/<train_key>/        each training run (metrics.jsonl, provenance.json, checkpoints)
    <runs>/<study>/trials/<train_key>.json  each trial's status: running, complete, cached, diverged, pruned,
                                            failed; its point, reason, config, objectives, progress
    <runs>/<study>/events/*.json            one file per training started (a counter for people and tests)
    <runs>/<study>/curves/                  the study's figures
    <runs>/<study>/optuna.db                the Optuna SQLite file when the runs folder is local

Every file is written whole (``attnlab.location``); nothing is appended, so the layout works on a bucket.
No Ray, no torch here.
"""

from __future__ import annotations

import os
import time
import uuid

from attnlab.location import Location

TUNE_DIR, RUNS_DIR, TRIALS_DIR, EVENTS_DIR, CURVES_DIR, SPEC_FILE = "tune", "runs", "trials", "events", "curves", \
    "study.json"
STATUSES = ("running", "complete", "cached", "diverged", "pruned", "failed")


class StudyState:
    """The state of study ``name`` in the runs folder ``runs``."""

    def __init__(self, runs: str | Location, name: str):
        self.runs = Location.parse(runs, field="--runs")
        self.name = name
        self.loc = self.runs.child(name)

    def __repr__(self) -> str:
        return f"StudyState({self.loc.uri!r})"

    @property
    def tune(self) -> Location:
        return self.loc.child(TUNE_DIR)

    @property
    def curves(self) -> Location:
        return self.loc.child(CURVES_DIR)

    def run(self, train_key: str) -> Location:
        return self.loc.child(RUNS_DIR, train_key)

    # ------------------------------------------------------------------------------------- the spec
    def saved_spec(self) -> dict | None:
        return self.loc.read_json(SPEC_FILE)

    def write_spec(self, spec_json: dict, search_fingerprint: str, ray: dict | None = None) -> None:
        """``ray``: the cluster the study runs on, ``{"dashboard": URL or None, "note": why none, "recorded":
        time}`` (:meth:`attnlab.ray_runtime.Dashboard.record`); ``attnlab serve`` links to that dashboard."""
        record = {"fingerprint": search_fingerprint, "spec": spec_json}
        if ray is not None:
            record["ray"] = ray
        self.loc.write_json(SPEC_FILE, record)

    def ray_cluster(self, saved: dict | None = None) -> dict | None:
        """The ``ray`` record of the study's latest run (see :meth:`write_spec`), None when none was recorded (a
        study written before it was, or not started yet). ``saved``: the already read ``study.json``."""
        saved = self.saved_spec() if saved is None else saved
        ray = (saved or {}).get("ray")
        return ray if isinstance(ray, dict) else None

    # ------------------------------------------------------------------------------------- trials
    def status(self, train_key: str) -> dict | None:
        return self.loc.read_json(f"{TRIALS_DIR}/{train_key}.json")

    def write_status(self, train_key: str, **fields) -> dict:
        """Update a trial's status file with ``fields`` (the trial is its only writer)."""
        current = self.status(train_key) or {}
        record = {**current, **fields, "config_hash": train_key, "updated": time.time()}
        self.loc.write_json(f"{TRIALS_DIR}/{train_key}.json", record)
        return record

    def statuses(self) -> list[dict]:
        """Every trial's status record, ordered by train key."""
        out = []
        for name in self.loc.list_names(TRIALS_DIR, hidden=False):
            if name.endswith(".json"):
                record = self.loc.read_json(f"{TRIALS_DIR}/{name}")
                if record:
                    out.append(record)
        return out

    # ------------------------------------------------------------------------------------- events
    def record_training_started(self, train_key: str, point: dict) -> None:
        name = f"{time.strftime('%Y%m%dT%H%M%S')}-{train_key}-{uuid.uuid4().hex[:8]}.json"
        self.loc.write_json(f"{EVENTS_DIR}/{name}", {"event": "train", "config_hash": train_key, "point": point,
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
