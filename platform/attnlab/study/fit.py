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


def trial_configs(spec: StudySpec) -> list:
    """One ``TrainConfig`` per distinct trial of a study (the grid's points; for a sampled search, each attention
    and each searched value or range end), for checks that need every trial's model and batch."""
    knobs = spec.space.knobs()
    if spec.search.engine == "grid":
        points = spec.grid_points()
    else:
        points = [{"attention": name} if spec.space.attention else {} for name in spec.attentions()]
        for key, axis in knobs.items():
            for name in (axis.when or spec.attentions()):
                base = {"attention": name} if spec.space.attention else {}
                values = axis.values if not axis.is_range else [axis.low, axis.high]
                if axis.is_int_range:
                    values = [int(v) for v in values]
                points += [{**base, key: v} for v in values]
    out, seen = [], set()
    for point in points:
        cfg = spec.train_config({k: v for k, v in point.items() if k != "seed"})
        key = cfg.model_dump_json()
        if key not in seen:
            seen.add(key)
            out.append(cfg)
    return out


def check_study_memory(spec: StudySpec, cluster: str | Path) -> str:
    """Refuse (one line) a study (a ``StudySpec``) whose trials' training step or evaluation does not fit the GPU
    type ``cluster`` places them on (:func:`check_memory`); return its one-line note."""
    return check_memory(spec.name, trial_configs(spec), spec.eval.eval_lengths, spec.eval.batch_size,
                        spec.resource_request(), cluster)


__all__ = ["check_study_fits", "check_study_memory", "trial_configs"]
