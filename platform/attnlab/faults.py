"""Seams for fault injection, all of them: the points where a test makes production code fail or slow down, each a
function that does nothing here. Production code calls them (``faults.<seam>(...)``, looked up at each call) and
never sets them; a test replaces one: ``monkeypatch.setattr`` in its own process; in Ray workers the test plugin
``tests/fault_injection.py``, which a test session's Ray cluster runs as every worker's setup hook; in a subprocess,
the script it runs. Nothing here reads the environment, and this module imports nothing, so a worker installs a
fault without importing torch.
"""

from __future__ import annotations


def after_data_item() -> None:
    """Called by data preparation (:mod:`attnlab.data.pipeline.prepare`) after each work item it finishes (a
    partition tokenised, a shard written). Sleeping here slows preparation down, so a test can kill it midway."""


def compaction_step(step: int, items: int | None = None) -> None:
    """Called by a results compaction (:meth:`attnlab.results.compaction.Compactor.compact`) just before its step
    ``step``, and with ``items`` after each item of a step done one file at a time. Ending the process here is a
    compaction crashing at that point."""


def before_train_step(step: int, rank: int) -> None:
    """Called by the training loop (:func:`attnlab.train.loop.train_loop`) on every rank before it runs optimizer
    step ``step`` (0-based: ``step`` steps are done). Raising here is that worker crashing at that step."""


# ------------------------------------------------------------------------------------------ a local Ray start
def before_ray_start(attempt: int, dashboard_port: int | None) -> None:
    """Called by :func:`attnlab.ray_runtime.ensure_ray` before each attempt (0-based) to start a local Ray cluster,
    with the dashboard port that attempt will bind (None: it starts none). Holding that port here is the start
    losing it; stalling the processes it launches (from a thread started here) is the start timing out."""


__all__ = ["after_data_item", "before_ray_start", "before_train_step", "compaction_step"]
