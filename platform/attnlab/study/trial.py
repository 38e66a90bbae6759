"""A trial is a small composition of steps, each with its own identity (docs/protocol.md#steps-and-identities):

1. **plan**: the point's ``TrainConfig``, its training key (what changes the weights, the data by content), its
   run location ``<runs>/<study>/runs/<train_key>`` and its evaluation cells, each with its own key; then the
   trial claims the key in the study run's claim registry (:mod:`attnlab.study.claims`), waiting while a live twin
   proposed at the same point holds it, and releases it once its status is written;
2. **train**: skipped when the run already finished (or diverged); otherwise from the run's latest checkpoint when
   there is one: in the trial's own process for one CPU worker (``resources.train_in_trial``), else with Ray Train;
   with a stopping rule (``train.stop_when``) a run is finished when its latest checkpoint met the rule, or reached
   ``steps`` (the cap) without meeting it;
3. **evaluate**: only the cells whose key has no rows in the results store: in the trial's process when it trained
   there, else in a Ray task with the resources of one training worker (a GPU when the workers have GPUs: then the
   task's worker process ends with it); the rows go to the store (with a stopping rule every row carries
   ``stopped``: reached or cap, and ``stop_rule``);
4. **report**: the objectives, read back from the store's rows of exactly the objective's cell.

Each step is a plain function testable without Tune; :func:`study_trial` is the Tune function trainable that
composes them, and :func:`evaluate_missing` runs step 3 for finished trials when a study's evaluation grew
(a new p_eval, length or RoPE setting evaluates the existing checkpoints and trains nothing).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from attnlab.errors import UserError
from attnlab.evaluate.plan import EvalCell, EvalConfig
from attnlab.location import Location
from attnlab.names import is_missing, same_optional_number
from attnlab.states import RunStatus, StopReason, TrialStatus
from attnlab.study.claims import claim_point, release_point
from attnlab.study.spec import StudySpec
from attnlab.study.stages import ROOT, StagedSpace, stage_of
from attnlab.study.folder import StudyFolder
from attnlab.train.config import TrainConfig

if TYPE_CHECKING:
    from attnlab.results import ResultsStore


@dataclass(frozen=True)
class StudyData:
    """The study's data as the driver found it when it opened it, once (:func:`attnlab.study.runner.study_context`):
    what every process that reads it opens, and what a trial needs to know of it without opening it."""

    resolved: str | dict  # an absolute path or URI, or a generated source's mapping
    fingerprint: str  # the content hash a training run's key uses
    vocab_size: int
    label: str  # the results' data column
    min_tokens: int  # the shortest split, in tokens
    described: str


@dataclass
class StudyContext:
    """What every trial of a study shares, built and validated once by the study driver. Its values travel as
    the objects they are (they pickle: Tune hands the context to every trial), never as strings re-parsed."""

    spec: StudySpec
    state: StudyFolder  # <runs>/<study>
    store: ResultsStore
    data: StudyData
    env: dict = field(default_factory=dict)  # attnlab's and the object store's settings, for every process
    claims: str | None = None  # this `study run`'s name in the claim registry (attnlab.study.claims); None: none
    stage_data: dict = field(default_factory=dict)  # {stage: StudyData} of the stages that train on other data

    def data_for(self, stage: str) -> StudyData:
        """The data a stage's runs train on: the study's, or the stage's own (``stages[].train.data``)."""
        return self.stage_data.get(stage, self.data)


@dataclass
class TrialPlan:
    point: dict
    cfg: TrainConfig
    train_key: str
    run: Location
    cells: list[tuple[EvalCell, str]]  # (cell, eval_key)
    row_context: dict  # the study's columns of every row (study, the Tune trial, seed, the run's train_key, data,
    # knobs, and a stage's run's stage: the root's rows say none, so rows measured before stages existed match them)
    stage: str = ROOT  # the study stage the run belongs to (attnlab.study.stages)
    parent: TrialPlan | None = None  # the plan of the run whose final weights this run starts from
    data: StudyData | None = None  # what the run trains on (the study's data, or its stage's own)

    @property
    def lineage_tokens(self) -> int:
        """Training tokens of the run's lineage at its last step (its parents' and its own)."""
        before = self.cfg.init_from.lineage_tokens if self.cfg.init_from is not None else 0
        return before + self.cfg.steps * self.cfg.tokens_per_step


def knob_label(spec: StudySpec, point: dict) -> str | None:
    """The trial's searched settings other than attention, scale, p_train and seed, as one sortable string:
    reports group by it, so trials differing only in e.g. ``lr`` are never averaged as seeds. A stage's axes count
    as ``<stage>.<axis>`` (but its rope_scaling, which the rows' ``extension`` column says)."""
    extra = [k for k in (spec.space.model_extra or {}) if k in point]
    extra += [stage.axis_key(k) for stage in spec.stages for k in stage.space.knobs()
              if stage.axis_key(k) in point and k != "rope_scaling"]
    return ",".join(f"{k}={point[k]:g}" if isinstance(point[k], float) else f"{k}={point[k]}"
                    for k in sorted(extra)) or None


def plan_trial(ctx: StudyContext, point: dict, trial: str, cfg: TrainConfig | None = None) -> TrialPlan:
    """Step 1: everything a trial will do, and the keys that say what is already done. ``trial``: the Tune trial
    (the rows' ``trial`` column); ``cfg``: the point's training config when already known (a status file's), else
    the study's search space makes it."""
    from attnlab.provenance import git_info

    spec = ctx.spec
    space = spec.search_space()
    stage = stage_of(point)
    data = ctx.data_for(stage)
    parent = None
    if stage != ROOT:  # a stage's run: its parent's plan first (its key is part of this run's)
        parent = plan_trial(ctx, space.parent_point(point), trial)
        if cfg is None:
            cfg = space.config(point, data=ctx.data.resolved)
            if data is not ctx.data:
                cfg = cfg.model_copy(update={"data": data.resolved})
            cfg = StagedSpace.with_parent(cfg, parent.train_key, parent.run.uri, parent_final_step(parent),
                                          parent.lineage_tokens)
    cfg = cfg or space.config(point, data=data.resolved)
    # eval.during_training: a run setting (no key changes), also on a config read back from a status file
    cfg = cfg.model_copy(update={"val_extrapolation": spec.eval.during_training})
    key = cfg.train_key(data.fingerprint, data.vocab_size)
    cells = [(cell, cell.key(key, cfg.steps, data.fingerprint)) for cell in spec.eval.cells(cfg.base_length)]
    row_context = {"study": spec.name, "trial": trial, "seed": cfg.seed, "train_key": key,
                   "git_sha": git_info()["sha"], "data": data.label, "knobs": knob_label(spec, point),
                   **({"stage": stage} if stage != ROOT else {})}
    return TrialPlan(point, cfg, key, find_run(ctx.state, key, cfg.steps), cells, row_context, stage, parent, data)


def find_run(state: StudyFolder, train_key: str, steps: int) -> Location:
    """Where the run of ``train_key`` is: this study's own run folder when it has one (finished, or to resume), else
    a finished run of that key in another study of the same runs folder (reused, never copied: a run's key says
    what it trained, so ``proxy_text``'s finished runs serve another study's points and stages), else this study's
    folder, where it will train."""
    from attnlab.runfolder import outcome

    own = state.run(train_key)
    if own.exists():
        return own
    for name in state.runs.list_names(hidden=False):
        if name == state.name:
            continue
        other = StudyFolder(state.runs, name).run(train_key)
        if other.exists() and outcome(other, steps=steps).status is RunStatus.FINISHED:
            return other
    return own


def parent_final_step(parent: TrialPlan) -> int:
    """The step whose weights a parent's children start from: its last (with a stopping rule, the step it stopped
    at, once it has)."""
    if parent.cfg.stop_when is None:
        return parent.cfg.steps
    from attnlab.runfolder import outcome

    done = outcome(parent.run, steps=parent.cfg.steps)
    return done.steps_trained if done.status is RunStatus.FINISHED and done.steps_trained else parent.cfg.steps


def wait_for_parent(ctx: StudyContext, parent: TrialPlan, poll: float = 2.0) -> str | None:
    """Wait until the parent's run has finished (None) or cannot (the reason: it diverged, or its trial failed or
    was stopped or skipped). The grid runs every parent before its children, so its trial has started."""
    from attnlab.runfolder import outcome

    while True:
        done = outcome(parent.run, steps=parent.cfg.steps)
        if done.status is RunStatus.FINISHED:
            return None
        if done.status is RunStatus.DIVERGED:
            return f"parent run {parent.train_key} diverged ({done.failure})"
        record = ctx.state.status(parent.train_key) or {}
        status = TrialStatus.read(record.get("status"))
        if status in (TrialStatus.FAILED, TrialStatus.PRUNED, TrialStatus.SKIPPED):
            return f"parent run {parent.train_key} {status.value}: {record.get('reason')}"
        time.sleep(poll)


# ------------------------------------------------------------------------------------------ step 2: train
def train_step(plan: TrialPlan, state: StudyFolder, callbacks=list, here=None, on_report=None):
    """Train unless the run already finished or diverged. Returns ``(outcome, trained: bool)``. ``here``: train in
    this process (a one-worker CPU trial: :meth:`StudySpec.trains_in_trial`), a function returning the data opened
    in it, each step's metrics going to ``on_report``; None: Ray Train, its reports going to the callbacks that
    ``callbacks()`` returns, called only then (a ``TuneReportCallback`` starts an actor, its queue, as it is made)."""
    from attnlab.runfolder import outcome

    done = outcome(plan.run, steps=plan.cfg.steps)
    if done.status in (RunStatus.FINISHED, RunStatus.DIVERGED):
        return done, False
    state.record_training_started(plan.train_key, plan.point)
    if here is not None:
        from attnlab.train.loop import train_here

        train_here(plan.cfg, plan.run, source=here(), on_report=on_report, device="cpu")
        return outcome(plan.run, steps=plan.cfg.steps), True
    from attnlab.train.ray_train import run_training

    return run_training(plan.cfg, plan.run, callbacks=callbacks()), True


# ------------------------------------------------------------------------------------------ step 3: evaluate
def _evaluate_task(run: Location, eval_config: EvalConfig, data: str | dict, row_context: dict, store: ResultsStore,
                   skip: list[str], threads: int | None, env: dict, source=None) -> list[dict]:
    """Runs inside a Ray task with one training worker's resources (a GPU when the workers had one), or in the trial
    that trained the run in its own process (``source``: the data it opened)."""
    import torch

    from attnlab.evaluate.extrapolation import evaluate_checkpoint

    os.environ.update(env)
    if threads:
        torch.set_num_threads(threads)
    return evaluate_checkpoint(run, eval_config, data=data, context=row_context, store=store, skip=set(skip),
                               source=source)


def evaluation_task(cfg: TrainConfig, train_key: str):
    """The Ray remote function that evaluates a run of ``cfg``: one training worker's resources, outside the Tune
    trial's placement group (it holds only the trial driver; like Train's workers, the evaluation asks the cluster
    for a training worker's resources, on whichever node has them).

    With GPUs the task's worker process ends after the task (``max_calls=1``): a CUDA worker that lived on would
    keep its context and the caching allocator's memory on that GPU while the next trial trains there, and stay bound
    to the device it first saw whatever ``CUDA_VISIBLE_DEVICES`` Ray gives it next. ``max_calls`` can only be set
    in ``ray.remote(...)``, never in ``.options()`` (ray-project/ray#47767), hence the decorator form. A CPU
    evaluation keeps Ray's pooled workers: it holds nothing across tasks, and a fresh process (with torch's imports)
    would add seconds to every trial."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from attnlab.train.ray_train import worker_resources

    resources = worker_resources(cfg)
    gpus = resources.pop("GPU", 0)
    return ray.remote(num_cpus=resources.pop("CPU"), num_gpus=gpus, resources=resources or None,
                      max_calls=1 if gpus else 0, max_retries=1, name=f"evaluate-{train_key}",
                      scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=None))(_evaluate_task)


def evaluate_step(plan: TrialPlan, ctx: StudyContext, outcome, here=None) -> int:
    """Measure the plan's cells that have no rows in the study's store yet; a diverged run's cells get NaN rows (so
    tables show it and nothing retries a deterministic failure). ``here``: measure in this process, with the data
    the function returns (opened here); None: in a Ray task. Returns the number of cells evaluated."""
    from attnlab.evaluate.cell_rows import nan_rows

    store = ctx.store
    stored = store.stored_eval_keys(ctx.spec.name, plan.train_key)
    missing = [(cell, key) for cell, key in cell_keys(plan, ctx, outcome) if key not in stored]
    if not missing:
        return 0
    if outcome.status is RunStatus.DIVERGED:
        rows = []
        step = int(outcome.final.get("step", 0))
        base = diverged_base_row(plan, step)
        for cell, key in missing:
            if cell.kind in ("windows", "force", "downstream"):
                rows += nan_rows(base, cell, key)
        if rows:
            store.write(rows, key=("eval", plan.train_key, RunStatus.DIVERGED.value))
        return len(missing)
    if outcome.status is not RunStatus.FINISHED:
        raise UserError(f"training run {plan.train_key} at {plan.run.uri} has not finished ({outcome.status}); "
                        "nothing to evaluate")
    args = (plan.run, ctx.spec.eval, plan.data.resolved, {**plan.row_context, **stop_columns(plan, outcome)}, store,
            sorted(stored), plan.cfg.threads_per_worker, ctx.env)
    if here is not None:
        _evaluate_task(*args, source=here())
        return len(missing)
    import ray

    task = evaluation_task(plan.cfg, plan.train_key)
    ray.get(task.remote(*args))
    return len(missing)


def cell_keys(plan: TrialPlan, ctx: StudyContext, outcome) -> list[tuple[EvalCell, str]]:
    """The plan's cells keyed by the step of the checkpoint evaluation reads (as the evaluation keys its rows):
    ``steps``, or for a finished run with a stopping rule the step it stopped at, known only after training."""
    step = outcome.steps_trained if plan.cfg.stop_when is not None and outcome.status is RunStatus.FINISHED else None
    if not step or step == plan.cfg.steps:
        return plan.cells
    return [(cell, cell.key(plan.train_key, step, plan.data.fingerprint)) for cell, _ in plan.cells]


def stop_columns(plan: TrialPlan, outcome) -> dict:
    """The rows' ``stopped`` (reached / cap) and ``stop_rule`` of a finished run with a stopping rule; none without."""
    rule = plan.cfg.stop_when
    if rule is None:
        return {}
    return {"stop_rule": rule.describe(), **({"stopped": outcome.stopped.value} if outcome.stopped else {})}


def diverged_base_row(plan: TrialPlan, step: int) -> dict:
    from attnlab.evaluate.extrapolation import lineage_columns

    gpt = plan.cfg.gpt_config()
    attention = gpt.attention_spec()
    return {**plan.row_context, "attention": gpt.attention, "scale": attention.scale_label, "p_train": attention.p,
            "step": int(step), "tokens": int(step) * plan.cfg.tokens_per_step, "train_len": plan.cfg.base_length,
            "preset": plan.cfg.preset, "plugin_sha256": plan.cfg.plugin.sha256 if plan.cfg.plugin else None,
            **lineage_columns(plan.cfg.model_dump(mode="json"), step)}


# ------------------------------------------------------------------------------------------ step 4: report
def objective_values(spec: StudySpec, rows: list[dict], train_len: int) -> dict[str, float]:
    """Each objective's value from a trial's rows: exactly its cell (length, p_eval, rope, whole windows, no
    bucket or layer); NaN when the rows lack it."""
    out = {}
    for obj in spec.objective:
        parts = obj.parts
        out[obj.key] = cell_value(rows, parts.metric, parts.eval_len(train_len), parts.p_eval,
                                  parts.rope or spec.eval.rope_scaling[0])
    return out


def cell_value(rows: list[dict], metric: str, length: int, p_eval, rope: str) -> float:
    values = [r["value"] for r in rows
              if r.get("metric") == metric and int(r.get("eval_len", -1)) == length
              and r.get("rope_scaling") == rope and same_optional_number(r.get("p_eval"), p_eval)
              and r.get("window_mode", "nonoverlap") in ("nonoverlap", "passkey")
              and is_missing(r.get("bucket")) and is_missing(r.get("layer"))]
    return float(values[0]) if values else float("nan")


def run_rows(ctx: StudyContext, train_key: str) -> list[dict]:
    """The rows of one training run."""
    return ctx.store.read(study=ctx.spec.name, train_key=train_key).to_dict("records")


# ------------------------------------------------------------------------------------------ the Tune trial
def failure_reason(exc: BaseException) -> str:
    """One line: the exception's first line plus, for wrapped worker errors (whose first line is only
    "Training failed due to worker errors:"), the root cause, the last ``SomeError: message`` line."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    reason = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    causes = [line for line in lines[1:] if line.split(":", 1)[0].endswith(("Error", "Exception"))]
    if causes:
        reason += f" ... {causes[-1]}"
    return reason[:500]


def progress_report(metrics: dict, final_step: int, train_key: str) -> dict | None:
    """What Tune hears of a training report: tagged with the train key, and None for the last one (the final step,
    or the one that met the stopping rule; the trial reports its objective after the evaluation instead, so ASHA
    never stops a trial at its final step)."""
    if int(metrics.get("step", 0)) >= final_step or StopReason.of(metrics) is StopReason.REACHED:
        return None
    # timesteps_total: TensorBoard's and MLflow's x axis is then the training step, not Tune's report count
    return {**metrics, "train_key": train_key, "timesteps_total": int(metrics.get("step", 0))}


def report_callback(final_step: int, train_key: str):
    """A ``TuneReportCallback`` passing Ray Train's reports on as :func:`progress_report` says."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class StudyReportCallback(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            report = progress_report(metrics[0], final_step, train_key) if metrics else None
            if report is not None:
                super().after_report(run_context, [report, *metrics[1:]], checkpoint)

    return StudyReportCallback()


def tune_reporter(final_step: int, train_key: str):
    """The same for a trial that trains in its own process: each training report straight to ``tune.report``."""
    from ray import tune

    def report(metrics: dict) -> None:
        passed = progress_report(metrics, final_step, train_key)
        if passed is not None:
            tune.report(passed)

    return report


def point_of(config: dict) -> dict:
    if "point" in config:
        return dict(config["point"])
    return {k: v for k, v in config.items() if not k.startswith("__")}


_DATA_HERE: dict = {}  # the study's data as opened in this process (fingerprint -> source)


def data_here(data: StudyData):
    """The study's data, opened in this process once: a trial that trains here opens it for training and evaluation
    alike, and the next trial of a process Tune reuses finds it open."""
    if data.fingerprint not in _DATA_HERE:
        from attnlab.data.source import open_data

        _DATA_HERE.clear()
        _DATA_HERE[data.fingerprint] = open_data(data.resolved)
    return _DATA_HERE[data.fingerprint]


_TRIALS_IN_PROCESS = [0]  # trials this process ran (Tune reuses a trial's process for the next trial)


def process_started() -> float | None:
    """When this process started (epoch seconds, from ``/proc``; None elsewhere): the first trial of a process counts
    the process's start in its timing."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as boot:
            btime = next(int(line.split()[1]) for line in boot if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def study_trial(config: dict, context: StudyContext) -> None:
    """One Tune trial: plan, train (unless done), evaluate the missing cells, report the objectives. Its status
    records ``timing``: when its process started, how many trials that process has run, when each step ended (epoch
    seconds; ``bench/trials.py`` reads it)."""
    from ray import tune

    _TRIALS_IN_PROCESS[0] += 1
    timing = {"process": process_started(), "trial_in_process": _TRIALS_IN_PROCESS[0], "entered": time.time()}
    os.environ.update(context.env)
    spec, state = context.spec, context.state
    spec.load_plugins()  # from the bytes the spec carries: this process reads no plugin file
    point = point_of(config)
    trial = tune.get_context().get_trial_name()
    if stage_of(point) != ROOT:  # a stage's run starts from its parent's final weights: wait for them
        parent = plan_trial(context, spec.search_space().parent_point(point), trial)
        why = wait_for_parent(context, parent)
        if why is not None:
            skip_child(context, point, trial, parent, why)
            return
        timing["parent_done"] = time.time()
    plan = plan_trial(context, point, trial)
    status = {"point": point, "trial": trial, "run_dir": plan.run.uri,
              "config": plan.cfg.model_dump(mode="json"), "attention": plan.cfg.gpt_config().attention,
              "steps": plan.cfg.steps}
    # one trial per point: wait while a live twin of this study run holds the key (attnlab.study.claims)
    before = claim_point(context.claims, plan.train_key, trial)
    timing["claimed"] = time.time()
    state.write_status(plan.train_key, **status, status=TrialStatus.RUNNING, started=time.time(), reason=None)
    try:
        if spec.eval.downstream is not None:  # a missing task folder or task: one line before any training
            from attnlab.evaluate.downstream import check_tasks

            check_tasks(spec.eval.downstream.tasks, spec.eval.downstream.data)
        # a one-worker CPU trial holds the worker's resources too: it trains and evaluates here, the data opened once
        here = functools.partial(data_here, plan.data) if spec.trains_in_trial() else None
        outcome, trained = train_step(plan, state, here=here, on_report=tune_reporter(plan.cfg.steps, plan.train_key),
                                      callbacks=lambda: [report_callback(plan.cfg.steps, plan.train_key)])
        timing["trained"] = time.time()
        evaluated = evaluate_step(plan, context, outcome, here=here)
        timing["evaluated"] = time.time()
        rows = run_rows(context, plan.train_key)
        objectives = objective_values(spec, rows, plan.cfg.base_length)
        final = cell_value(rows, "val_loss", plan.cfg.base_length, None, spec.eval.rope_scaling[0])
        # Tune's time is the cap (the trial is over); steps trained: the cap, or where the stopping rule was met
        reached = outcome.stopped is StopReason.REACHED
        steps = outcome.steps_trained if reached and outcome.steps_trained else plan.cfg.steps
        base = {"train_key": plan.train_key, "run_dir": plan.run.uri, "step": plan.cfg.steps,
                "timesteps_total": plan.cfg.steps, "steps_trained": steps, "cached": int(not trained and not evaluated)}
        if outcome.status is RunStatus.DIVERGED:
            state.write_status(plan.train_key, status=TrialStatus.DIVERGED, reason=outcome.failure,
                               step=int(outcome.final.get("step", 0)), objectives=objectives,
                               timing={**timing, "reported": time.time()})
            release_point(context.claims, plan.train_key, trial, TrialStatus.DIVERGED)
            tune.report({**base, **{k: float("nan") for k in objectives}, "diverged": 1})
            return
        done = TrialStatus.CACHED if not trained and not evaluated else TrialStatus.COMPLETE
        if done is TrialStatus.CACHED and TrialStatus.read(before.get("status")) is TrialStatus.COMPLETE:
            done = TrialStatus.COMPLETE  # another trial of this `study run` trained it: a point proposed twice
        stop = {"stopped": outcome.stopped} if plan.cfg.stop_when is not None else {}
        state.write_status(plan.train_key, status=done, objectives=objectives, trained=trained,
                           evaluated_cells=evaluated, step=steps, finished=time.time(),
                           timing={**timing, "reported": time.time()}, **stop)
        release_point(context.claims, plan.train_key, trial, done)
        tune.report({**base, **objectives, "diverged": 0, "val_loss": final,
                     **({"stopped": outcome.stopped.value} if stop and outcome.stopped else {})})
    except BaseException as exc:  # an error, or Tune stopping the trial: its twins stop waiting either way
        if isinstance(exc, Exception):
            state.write_status(plan.train_key, status=TrialStatus.FAILED, reason=failure_reason(exc))
        release_point(context.claims, plan.train_key, trial, TrialStatus.FAILED if isinstance(exc, Exception) else None)
        raise


def skip_child(ctx: StudyContext, point: dict, trial: str, parent: TrialPlan, why: str) -> None:
    """A stage's run whose parent cannot give it weights: recorded as skipped, with why, and never trained from
    scratch. Its status file is keyed by what its key would be with the parent's planned final step."""
    from ray import tune

    space = ctx.spec.search_space()
    cfg = StagedSpace.with_parent(space.config(point, data=ctx.data.resolved), parent.train_key, parent.run.uri,
                                  parent.cfg.steps, parent.lineage_tokens)
    data = ctx.data_for(stage_of(point))
    key = cfg.train_key(data.fingerprint, data.vocab_size)
    reason = f"skipped: {why}"
    print(f"attnlab: stage {stage_of(point)} run {key} ({point}) {reason}", flush=True)
    ctx.state.write_status(key, point=point, trial=trial, run_dir=None, config=cfg.model_dump(mode="json"),
                           attention=cfg.gpt_config().attention, steps=cfg.steps, status=TrialStatus.SKIPPED,
                           reason=reason, started=time.time())
    tune.report({"train_key": key, "step": cfg.steps, "timesteps_total": cfg.steps, "skipped": 1,
                 **{o.key: float("nan") for o in ctx.spec.objective}})


# ------------------------------------------------------------------------------------------ catching up
def evaluate_missing(ctx: StudyContext, log=print) -> int:
    """For every trial that finished training, evaluate the cells of the current ``eval`` with no rows yet
    (after a p_eval value, a length or a RoPE setting was added). Returns the number of cells evaluated."""
    from attnlab.runfolder import outcome

    pending = []
    current = set(ctx.spec.plugin_hashes().values())
    for record in ctx.state.statuses():
        status = TrialStatus.read(record.get("status"))
        if not (status.succeeded or status is TrialStatus.DIVERGED) or not record.get("config"):
            continue
        plugin = record["config"].get("plugin") or {}
        if plugin and plugin.get("sha256") not in current:
            continue  # a run of a plugin's earlier code: the study's variant is now other bytes (another key)
        cfg = TrainConfig.model_validate(record["config"])  # the config as the trial recorded it
        # the rows name the Tune trial that trained the run (this evaluation runs in the study's driver)
        plan = plan_trial(ctx, record.get("point") or {}, record.get("trial") or "catch-up", cfg=cfg)
        stored = ctx.store.stored_eval_keys(ctx.spec.name, plan.train_key)
        if all(key in stored for _, key in plan.cells):
            continue
        done = outcome(plan.run, steps=plan.cfg.steps)  # a stopping rule keys the cells by the step it stopped at
        if all(key in stored for _, key in cell_keys(plan, ctx, done)):
            continue
        pending.append((plan, done))
    total = 0
    for plan, done in pending:
        log(f"attnlab: evaluating new cells of run {plan.train_key} (training reused)")
        total += evaluate_step(plan, ctx, done)
    return total


__all__ = ["StudyContext", "StudyData", "TrialPlan", "evaluate_missing", "evaluate_step", "failure_reason",
           "knob_label", "objective_values", "plan_trial", "cell_keys", "evaluation_task", "stop_columns", "study_trial",
           "train_step"]
