"""Does a study fit a cluster config: its trials' resources (some node type, or an allowed span of nodes, can host
one) and their GPU memory (training step and evaluation), checked offline by ``attnlab study validate --cluster``
and ``attnlab study submit --cluster`` with :mod:`attnlab.cluster.fit`, which knows configs and requests but no
study. Bad fits raise ``UserError`` (one line). No Ray here.
"""

from __future__ import annotations

from pathlib import Path

from attnlab.cluster.fit import check_memory, plan_fit
from attnlab.study.spec import StudySpec


def check_study_fits(spec: StudySpec, cluster: str | Path) -> list[str]:
    """Refuse (one line) a study that does not fit ``cluster``; return what was checked, in two lines: how a trial
    is placed (nodes per trial, trials at once) and its GPU memory."""
    fit = plan_fit(spec.resource_request(), cluster)
    nodes = ", ".join(f"{n} x{k}" for n, k in fit.nodes_per_trial.items())
    return [f"fits {Path(cluster).name}: nodes per trial {nodes}, {fit.concurrent_trials} trial(s) at once",
            check_study_memory(spec, cluster)]


def check_study_memory(spec: StudySpec, cluster: str | Path) -> str:
    """Refuse (one line) a study (a ``StudySpec``) whose trials' training step or evaluation does not fit the GPU
    type ``cluster`` places them on (:func:`check_memory`); return its one-line note. The trials are the distinct
    configs of the points the study's validation checked (:meth:`attnlab.study.space.SearchSpace.distinct`)."""
    trials = [searched.config for searched in spec.search_space().distinct()]
    return check_memory(spec.name, trials, spec.eval.eval_lengths, spec.eval.batch_size, spec.resource_request(),
                        cluster)


__all__ = ["check_study_fits", "check_study_memory"]
