"""Seams for fault injection: the points where a test makes production code fail, each a function that does
nothing here. Production code calls them and never sets them; a test replaces one (``monkeypatch.setattr`` in its
own process; in Ray workers and subprocesses the test plugin ``tests/fault_injection.py``, which a test session's
Ray cluster runs as every worker's setup hook). Nothing here reads the environment, and this module imports
nothing, so a worker installs a fault without importing torch.
"""

from __future__ import annotations


def before_train_step(step: int, rank: int) -> None:
    """Called by the training loop (:func:`attnlab.train.loop.train_loop`) on every rank before it runs optimizer
    step ``step`` (0-based: ``step`` steps are done). Raising here is that worker crashing at that step."""


# ------------------------------------------------------------------------------------------ a local Ray start
def before_ray_start(attempt: int, dashboard_port: int | None) -> None:
    """Called by :func:`attnlab.ray_runtime.ensure_ray` before each attempt (0-based) to start a local Ray cluster,
    with the dashboard port that attempt will bind (None: it starts none). Holding that port here is the start
    losing it; stalling the processes it launches (from a thread started here) is the start timing out."""


__all__ = ["before_ray_start", "before_train_step"]
