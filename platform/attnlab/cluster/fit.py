"""Does a trial fit a cluster config: a resource request placed on the config's node types, and the GPU memory of
a trial's training step and evaluation on the GPU type it is placed on.

- ``plan_fit(request, config_path)`` / ``check_fits``: refuses, with a one-line ``UserError``, a request whose
  trials no node type (or allowed span of nodes) of the config can schedule, instead of letting Ray wait forever.
- ``trial_gpu(request, config_path)``: the GPU type (and its memory, :data:`attnlab.cluster.validate.GPU_MEMORY`)
  a trial's workers would be placed on; ``check_memory(...)`` refuses trials whose training step or evaluation
  does not fit it (docs/gpu-memory.md).

A request is the one shape below (:data:`REQUEST_DEFAULTS`); trials are ``TrainConfig``\ s. This module knows
no study: :mod:`attnlab.study.fit` asks it about a study. It never starts Ray or contacts a cloud.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from attnlab.cluster.validate import GPU_MEMORY, NodeType, load_node_types
from attnlab.errors import UserError

# The one shape of a resource request (``attnlab.study.spec.StudySpec.resource_request`` builds it): one trial = a
# Tune trial driver (``trial_cpus``) that runs a Ray Train job of ``workers`` workers, each ``gpus_per_worker``
# GPUs and ``cpus_per_worker`` CPUs; up to ``max_concurrent_trials`` trials at once.
REQUEST_DEFAULTS = {"workers": 1, "gpus_per_worker": 0.0, "cpus_per_worker": 1.0, "max_concurrent_trials": 1,
                    "trial_cpus": 1.0}
_EPS = 1e-9


@dataclass(frozen=True)
class TrialFit:
    """How one trial is placed on a config, and how many trials can run at once at full scale."""

    workers_per_node: dict[str, int]  # node type -> workers one node of it can hold
    nodes_per_trial: dict[str, int]  # node type -> nodes one trial uses (the plan picked)
    gpus_per_trial: float
    concurrent_trials: int  # trials that can run at once with every node type at its maximum

    @property
    def spans_nodes(self) -> bool:
        return sum(self.nodes_per_trial.values()) > 1


def normalise_request(request: dict) -> dict:
    """Fill defaults and check types of a ``resources:`` request; raise ``UserError`` on bad values."""
    if not isinstance(request, dict):
        raise UserError(f"resources: expected a mapping with keys {sorted(REQUEST_DEFAULTS)}, got {type(request).__name__}")
    unknown = sorted(set(request) - set(REQUEST_DEFAULTS))
    if unknown:
        raise UserError(f"resources: unknown key(s) {unknown}; allowed: {sorted(REQUEST_DEFAULTS)}")
    out = {**REQUEST_DEFAULTS, **request}
    for key in ("workers", "max_concurrent_trials"):
        value = out[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"resources.{key}: {value!r} is not allowed; use an integer >= 1")
    for key in ("gpus_per_worker", "cpus_per_worker", "trial_cpus"):
        value = out[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise UserError(f"resources.{key}: {value!r} is not allowed; use a number >= 0")
        out[key] = float(value)
    return out


def _workers_per_node(node: NodeType, gpus: float, cpus: float) -> int:
    limits = []
    if gpus > 0:
        limits.append(math.floor(node.gpus / gpus + _EPS))
    if cpus > 0:
        limits.append(math.floor(node.cpus / cpus + _EPS))
    return min(limits) if limits else 10**6


def _describe(nodes: list[NodeType]) -> str:
    return ", ".join(f"{n.name}: {n.gpus:g} GPU/{n.cpus:g} CPU x{n.max_nodes}" for n in nodes)


def plan_fit(request: dict, cluster_config_path: str | Path) -> TrialFit:
    """Place one trial of ``request`` on the config's node types; raise ``UserError`` if it never fits.

    A Ray Train worker must fit on one node. A trial's workers may span nodes (Ray Train's PACK
    placement spreads a placement group over nodes when one is not enough), within each node type's
    ``max_workers`` and the config's global cap on worker nodes. The trial driver needs ``trial_cpus`` on
    some node.
    """
    req = normalise_request(request)
    name = Path(cluster_config_path).name
    nodes, worker_cap = load_node_types(cluster_config_path)
    nodes = [n for n in nodes if n.max_nodes > 0]
    g, c, workers = req["gpus_per_worker"], req["cpus_per_worker"], req["workers"]
    per_node = {n.name: _workers_per_node(n, g, c) for n in nodes}
    usable = [n for n in nodes if per_node[n.name] >= 1]
    if not usable:
        raise UserError(
            f"resources: one worker needs {g:g} GPU + {c:g} CPU but no node type in {name} has that "
            f"({_describe(nodes)}); lower gpus_per_worker/cpus_per_worker or add a bigger node type"
        )

    def budget(candidates: list[NodeType]) -> dict[str, int]:
        """Nodes of each type usable together: head at most once, workers within the global cap."""
        left, out = worker_cap, {}
        for n in sorted(candidates, key=lambda n: (not n.is_head, -per_node[n.name])):
            take = n.max_nodes if n.is_head else min(n.max_nodes, left)
            left -= 0 if n.is_head else take
            out[n.name] = take
        return out

    # Prefer one node type (homogeneous hardware); else span node types.
    plans = []
    for n in usable:
        need = math.ceil(workers / per_node[n.name])
        if need <= budget([n])[n.name]:
            plans.append((need, n.gpus, n.cpus, n.name))
    if plans:  # fewest nodes, then the smallest machine (a CPU-only trial does not take a GPU node)
        need, _, _, chosen = min(plans)
        nodes_per_trial = {chosen: need}
    else:
        available = budget(usable)
        capacity = sum(per_node[k] * v for k, v in available.items())
        if capacity < workers:
            raise UserError(
                f"resources: {workers} workers x ({g:g} GPU + {c:g} CPU) need {workers * g:g} GPUs/{workers * c:g} CPUs "
                f"at once but {name} can place at most {capacity} such workers ({_describe(usable)}); "
                f"lower resources.workers or raise max_workers"
            )
        nodes_per_trial, remaining = {}, workers
        for n in sorted(usable, key=lambda n: -per_node[n.name]):
            if remaining <= 0:
                break
            take = min(available[n.name], math.ceil(remaining / per_node[n.name]))
            nodes_per_trial[n.name] = take
            remaining -= take * per_node[n.name]

    driver = req["trial_cpus"]
    if not any(n.cpus >= driver for n in nodes):
        raise UserError(f"resources: the trial driver needs {driver:g} CPU but no node type in {name} offers that "
                        "(lower resources.trial_cpus)")

    total = budget(usable)
    concurrent = sum(per_node[k] * v for k, v in total.items()) // workers
    return TrialFit(
        workers_per_node={n.name: per_node[n.name] for n in usable},
        nodes_per_trial=nodes_per_trial,
        gpus_per_trial=workers * g,
        concurrent_trials=concurrent,
    )


def check_fits(request: dict, cluster_config_path: str | Path) -> None:
    """Raise ``attnlab.errors.UserError`` (one line) if no node type or allowed span can host a trial.

    ``request``: ``{"workers": int, "gpus_per_worker": float, "cpus_per_worker": float,
    "max_concurrent_trials": int, "trial_cpus": float}`` (missing keys take :data:`REQUEST_DEFAULTS`), as
    ``StudySpec.resource_request()`` gives it. Running fewer trials
    at once than ``max_concurrent_trials`` is not an error (Tune queues the rest); see ``plan_fit``.
    """
    plan_fit(request, cluster_config_path)


@dataclass(frozen=True)
class TrialGpu:
    """The GPU a trial's workers get: its type and memory (None when the config does not say), and why."""

    gpu_type: str | None
    memory_bytes: int | None
    note: str  # e.g. "gpu.a100 (machine p4d.24xlarge)", or why the type is unknown


def trial_gpu(request: dict, cluster_config_path: str | Path) -> TrialGpu | None:
    """The GPU type a trial of ``request`` is placed on (:func:`plan_fit`); the smallest one when a trial spans
    node types. None for a CPU-only request; ``gpu_type`` None when a node type's GPU cannot be known."""
    req = normalise_request(request)
    if req["gpus_per_worker"] <= 0:
        return None
    fit = plan_fit(req, cluster_config_path)
    nodes = {n.name: n for n in load_node_types(cluster_config_path)[0]}
    placed = [nodes[name] for name in fit.nodes_per_trial]
    unknown = [n for n in placed if n.gpu_type not in GPU_MEMORY]
    if unknown:
        n = unknown[0]
        return TrialGpu(None, None, f"{Path(cluster_config_path).name}: node type {n.name!r}: GPU type unknown "
                                    f"({n.gpu_source}); GPU memory check skipped")
    n = min(placed, key=lambda n: GPU_MEMORY[n.gpu_type])
    return TrialGpu(n.gpu_type, GPU_MEMORY[n.gpu_type], f"{n.name} ({n.gpu_source})")


def _gib(n: float) -> str:
    return f"{n / 1024**3:.1f} GiB"


def check_memory(study: str, trials: list, eval_lengths, eval_batch: int | None, request: dict,
                 cluster_config_path: str | Path) -> str:
    """Refuse (one-line ``UserError``) a study whose training step or evaluation does not fit the GPU its
    trials are placed on; return a one-line note of what was checked (or why the check was skipped).

    ``trials``: the trials' ``attnlab.train.config.TrainConfig`` (one per distinct point); ``eval_lengths``: the
    lengths evaluated after training, or a function of the training length giving them (the training length
    is checked too, at ``val_batch``: training's own validation); ``eval_batch``:
    ``eval.batch_size`` (None: ``val_batch x seq_len // length``, at least 1, as evaluation does). Estimates come
    from :mod:`attnlab.model.memory`; ``micro_batch: auto`` is resolved for the GPU type.
    """
    from attnlab.model.memory import estimate_eval, largest_eval_batch

    gpu = trial_gpu(request, cluster_config_path)
    if gpu is None:
        return "GPU memory: CPU workers, not checked"
    if gpu.gpu_type is None:
        return gpu.note
    budget, where = gpu.memory_bytes, f"the {gpu.gpu_type}'s {_gib(gpu.memory_bytes)} ({gpu.note})"
    worst_train, worst_eval = None, None
    for cfg in trials:
        attention = cfg.gpt_config().attention_spec().name
        best = cfg.fitting_micro_batch(budget)
        batch = best if cfg.micro_batch == "auto" else cfg.micro_batch
        if batch < 1:
            est = cfg.step_memory(1)
            raise UserError(f"study {study!r}: a training step of attention {attention} needs {_gib(est.total)} per "
                            f"GPU at micro_batch=1 x {cfg.seq_length} tokens, more than {where}; no micro_batch "
                            f"fits: shorten seq_len or use a larger GPU")
        est = cfg.step_memory(batch)
        if est.total > budget:
            raise UserError(f"study {study!r}: a training step of attention {attention} at micro_batch={batch} x "
                            f"{cfg.seq_length} tokens needs ~{_gib(est.total)} per GPU, more than {where}; the "
                            f"largest micro_batch that fits (and divides the step's sequences) is {best}: set "
                            f"train.micro_batch: {best} or auto")
        if worst_train is None or est.total > worst_train[0]:
            worst_train = (est.total, batch)
        settings = cfg.memory_settings()
        gpt = cfg.gpt_config()
        T = cfg.seq_length
        lengths = eval_lengths(T) if callable(eval_lengths) else eval_lengths
        for length in sorted({T, *lengths}):
            b = cfg.val_batch if length == T and eval_batch is None else (
                eval_batch or max(1, cfg.val_batch * T // length))
            est = estimate_eval(gpt, length, b, settings["precision"], settings["backend"])
            if est.total > budget:
                fits = largest_eval_batch(gpt, length, budget, precision=settings["precision"],
                                          backend=settings["backend"])
                advice = (f"the largest eval batch that fits is {fits}: set eval.batch_size: {fits}" if fits else
                          "not even 1 window fits: evaluate shorter lengths or use a larger GPU")
                raise UserError(f"study {study!r}: evaluating attention {attention} at {length:,} tokens (eval batch "
                                f"{b}) needs ~{_gib(est.total)} per GPU, more than {where}; {advice}")
            if worst_eval is None or est.total > worst_eval[0]:
                worst_eval = (est.total, length, b)
    if worst_train is None:
        return f"GPU memory: no trials to check on {gpu.gpu_type}"
    out = f"GPU memory on {gpu.gpu_type} ({_gib(budget)}): training step <= {_gib(worst_train[0])}"
    if worst_eval is not None:
        out += f", evaluation <= {_gib(worst_eval[0])} (at {worst_eval[1]:,} tokens, batch {worst_eval[2]})"
    return out


__all__ = ["REQUEST_DEFAULTS", "TrialFit", "TrialGpu", "check_fits", "check_memory", "normalise_request", "plan_fit",
           "trial_gpu"]
