"""Run a study as a Ray Tune search: the only Tune and Optuna code of attnlab.

``run_study(spec)`` turns a :class:`~attnlab.study.spec.StudySpec` into a ``tune.Tuner`` over the function
trainable :func:`attnlab.study.trial.study_trial` (plan, claim the point in the run's claim registry, train unless
done, evaluate the missing cells in a task with a training worker's resources, report), then evaluates any cell
that a grown ``eval`` added to trials that had finished (:func:`~attnlab.study.trial.evaluate_missing`), records the
trials the scheduler stopped, compacts the study's results (unless told not to; a failure is a warning) and
prints the table and the curves.

Locations: ``--store`` (the results store) and ``--runs`` (the runs folder) are local paths or object-storage
URIs; the defaults are ``$ATTNLAB_STORAGE/results`` and ``$ATTNLAB_STORAGE/runs`` when a cluster sets that prefix,
else ``./results`` and ``./runs``; inside a Ray job's temporary working directory a relative location is refused
(:func:`attnlab.location.store_location`, :func:`~attnlab.location.runs_location`).
The state layout under ``<runs>/<study>/`` is :mod:`attnlab.study.folder`'s. Running the study again
restores the Tune experiment when its search is unchanged (a changed evaluation is fine: only new cells run).

Never imports torch at module level; never deletes results or Tune state (``fresh`` moves the old Tune
experiment aside).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from attnlab.errors import Interrupted, UserError
from attnlab.location import runs_location, store_location
from attnlab.states import TrialStatus
from attnlab.study.space import SearchPoint
from attnlab.study.claims import end_run, start_registry
from attnlab.study.spec import StudySpec
from attnlab.study.stages import stage_of
from attnlab.study.folder import StudyFolder
from attnlab.study.stopping import StopSignals, record_interrupted
from attnlab.study.trackers import tracker_callbacks
from attnlab.study.trial import StudyContext, StudyData, evaluate_missing, plan_trial, point_of, study_trial

if TYPE_CHECKING:
    from attnlab.results import ResultsStore


def study_state(spec: StudySpec, runs: str | None = None) -> StudyFolder:
    """Where ``spec`` keeps its state: the runs folder (``--runs`` or the default, see the module docstring)."""
    return StudyFolder(runs_location(runs), spec.name)


def study_context(spec: StudySpec, state: StudyFolder, store: ResultsStore,
                  checked: list[SearchPoint] | None = None) -> StudyContext:
    """Resolve the study's data (``demo`` is built on first use, a relative path made absolute) and open it, once
    for the whole study: every point the study's validation checked (``checked``, when the caller has them) must
    fit it (its sequence length, its vocabulary), and what the trials need of it travels in the context, so no
    trial opens it."""
    from attnlab.data.source import data_label, open_data, resolve_data
    from attnlab.train.ray_train import forwarded_env

    def opened(spec_data) -> StudyData:
        resolved = resolve_data(spec_data)
        source = open_data(resolved)
        return StudyData(resolved=resolved, fingerprint=str(source.fingerprint), vocab_size=int(source.vocab_size),
                         label=data_label(resolved), min_tokens=int(source.min_tokens()), described=source.describe())

    data = opened(spec.train.data)
    # a stage that trains on other data (stages[].train.data), and the stages after it, read that data
    stage_data: dict[str, StudyData] = {}
    for stage in spec.stages and spec.search_space().stages:
        if "data" in stage.train:
            stage_data[stage.name] = opened(stage.train["data"])
        elif stage.parent in stage_data:
            stage_data[stage.name] = stage_data[stage.parent]
    for searched in spec.search_space().checked() if checked is None else checked:
        fits = stage_data.get(stage_of(searched.point), data)
        searched.config.check_fits_data(fits.vocab_size, fits.min_tokens, fits.described)
    return StudyContext(spec=spec, state=state, store=store, data=data, env=forwarded_env(), stage_data=stage_data)


def stage_plan(ctx: StudyContext) -> str:
    """A study with stages in one line: per stage, how many runs it has, how many are found trained (reused, in
    this study's runs folder or another study's) and how many will train. Refuses (UserError, one line, before
    anything is written) a child whose parent finished without its final checkpoint."""
    from attnlab.model.checkpoint import checkpoint_steps
    from attnlab.runfolder import outcome, read_metrics
    from attnlab.states import RunStatus
    from attnlab.study.stages import ROOT
    from attnlab.study.trial import parent_final_step

    counts: dict[str, list[int]] = {}
    checked: set[str] = set()
    for point in ctx.spec.search_space().points():
        plan = plan_trial(ctx, point, "plan")
        done = outcome(plan.run, steps=plan.cfg.steps).status in (RunStatus.FINISHED, RunStatus.DIVERGED)
        counts.setdefault(plan.stage, [0, 0])[0 if done else 1] += 1
        parent = plan.parent
        if parent is None or parent.train_key in checked:
            continue
        checked.add(parent.train_key)
        step = parent_final_step(parent)
        for run in [parent.run, *(StudyFolder(ctx.state.runs, name).run(parent.train_key)
                                  for name in ctx.state.runs.list_names(hidden=False) if name != ctx.state.name)]:
            lines = read_metrics(run) if run.exists() else []
            reached = bool(lines) and int(lines[-1].get("step", 0)) >= step
            if reached and step not in checkpoint_steps(run):
                kept = ", ".join(str(s) for s in sorted(checkpoint_steps(run))) or "none"
                raise UserError(f"stages.{plan.stage}: parent run {parent.train_key} at {run.uri} finished without "
                                f"its final checkpoint (step {step}; kept: {kept}): its children cannot start from it; "
                                "restore that checkpoint, or move the run aside to train it again")
    parts = []
    for stage, (reused, train) in counts.items():
        role = "parent" if stage == ROOT else "child"
        parts.append(f"{stage}: {reused + train} {role} run(s), {train} to train, {reused} reused")
    return "plan: stages: " + "; ".join(parts)


# ------------------------------------------------------------------------------------------------ search
class DefineByRunSpace:
    """Optuna's define-by-run space for a study: its search space's suggestions (picklable: Tune saves the searcher
    with it)."""

    def __init__(self, spec: StudySpec):
        self.spec = spec

    def __call__(self, trial):
        self.spec.search_space().suggest(trial)
        return None


def _optuna_search(spec: StudySpec, url: str):
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    progress_metric = spec.scheduler.metric  # what training reports along the way (val_loss by default)

    class StudyOptunaSearch(OptunaSearch):
        """OptunaSearch whose intermediate values are the training's own validation metric at each training
        step (optuna-dashboard's learning curves line up across trials), and whose trials carry their run's
        location and training key as user attributes."""

        def on_trial_result(self, trial_id, result):
            ot_trial = self._ot_trials.get(trial_id)
            if ot_trial is None:
                return
            for attr, key in (("train_key", "train_key"), ("run", "run_dir")):
                if result.get(key):
                    ot_trial.set_user_attr(attr, str(result[key]))
            if isinstance(self.metric, list) or progress_metric not in result or "step" not in result:
                return  # multi-objective studies have no intermediate values in Optuna
            ot_trial.report(float(result[progress_metric]), int(result["step"]))

        def on_trial_complete(self, trial_id, result=None, error=False):
            # A trial the scheduler stopped ends without its objective(s): record it as PRUNED, not RUNNING.
            metrics = self.metric if isinstance(self.metric, list) else [self.metric]
            if result and any(m not in result for m in metrics):
                result = None
            super().on_trial_complete(trial_id, result=result, error=error)

    seed = spec.search.seed
    samplers = {"tpe": lambda: optuna.samplers.TPESampler(seed=seed),
                "random": lambda: optuna.samplers.RandomSampler(seed=seed),
                "nsgaii": lambda: optuna.samplers.NSGAIISampler(seed=seed)}
    sampler = samplers[spec.search.sampler or "tpe"]()
    keys = [o.key for o in spec.objective]
    modes = [o.mode for o in spec.objective]
    try:
        rdb = optuna.storages.RDBStorage(url)
    except Exception as exc:  # noqa: BLE001 - any driver/URL problem is the user's to fix
        raise UserError(f"optuna_storage: {url!r} is not a usable Optuna RDB storage ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:200]})") from None
    return StudyOptunaSearch(DefineByRunSpace(spec), metric=keys if len(keys) > 1 else keys[0],
                             mode=modes if len(modes) > 1 else modes[0], sampler=sampler,
                             study_name=spec.name, storage=rdb)


def _scheduler(spec: StudySpec):
    if spec.scheduler.type == "none":
        return None
    from ray.tune.schedulers import ASHAScheduler

    return ASHAScheduler(time_attr="step", metric=spec.scheduler.metric,
                         mode="max" if spec.scheduler.metric == "val_acc" else "min",
                         max_t=spec.search_space().max_steps(), grace_period=spec.scheduler.grace_period,
                         reduction_factor=spec.scheduler.reduction_factor, stop_last_trials=False)


# ------------------------------------------------------------------------------------------------ study
@dataclass
class StudySummary:
    name: str
    state_dir: str
    store: str
    optuna_url: str | None
    trials: list[dict] = field(default_factory=list)  # status file of each training run of this study
    searched: int = 0  # Tune trials; more than ``trials`` when the search proposed a point twice (one training)
    trained: int = 0  # trainings started by this call
    evaluated: int = 0  # cells evaluated for trials that had finished before (the evaluation grew)
    compacted: str | None = None  # what the compaction at the end did (Compaction.describe), None when not run/failed
    table: str = ""
    curves: dict = field(default_factory=dict)
    tensorboard_dir: str | None = None
    restored: bool = False

    def count(self, status: TrialStatus) -> int:
        return sum(1 for t in self.trials if TrialStatus.read(t.get("status")) == status)  # a member or its string


def _check_state(spec: StudySpec, state: StudyFolder, resume: bool | None) -> bool:
    """Whether to restore the Tune experiment; refuse to resume a study whose search changed."""
    from ray import tune

    exp = state.tune
    # Ray takes a filesystem with a path inside it (bucket/key), never with a URI: ray_storage() gives that pair.
    exists = exp.exists() and tune.Tuner.can_restore(*exp.ray_storage())
    if resume is True and not exists:
        raise UserError(f"--resume: no Tune state for study {spec.name!r} at {exp.uri}; run without --resume to start")
    if resume is False and exp.exists():
        aside = f"tune.{time.strftime('%Y%m%d-%H%M%S')}"
        state.loc.move("tune", aside)
        print(f"attnlab: previous Tune state moved to {state.loc.child(aside).uri}", flush=True)
        return False
    saved = state.saved_study()
    if exists and saved and saved.fingerprint != spec.search_fingerprint():
        _refuse_changed_plugins(spec, saved, exp.uri)
        raise UserError(f"study {spec.name!r}: its search (train, space, search, objective, scheduler or resources) "
                        f"changed since its Tune state at {exp.uri} was written; run with --fresh to start a new "
                        "search (finished training runs and stored cells are reused) or rename the study")
    return exists


def _refuse_changed_plugins(spec: StudySpec, saved, where: str) -> None:
    """A resumed search whose plugins' bytes changed: say which, in one line (docs/plugins.md#plugins-in-studies)."""
    before = {p.get("origin"): p.get("sha256") for p in saved.spec.get("plugins") or [] if isinstance(p, dict)}
    changed = [(origin, before[origin], sha) for origin, sha in spec.plugin_hashes().items()
               if origin in before and before[origin] != sha]
    if changed:
        origin, old, new = changed[0]
        raise UserError(f"study {spec.name!r}: plugin {origin} changed since its Tune state at {where} was written "
                        f"(sha256 {str(old)[:12]} -> {new[:12]}); run with --fresh: its variants train again with the "
                        "new code, every other finished run and stored cell is reused")


def study_plan(spec: StudySpec, dashboard=None) -> str:
    """The study in one line: trials, each trial's training, the evaluation cells, how many at once, and (given
    ``dashboard``, an :class:`attnlab.ray_runtime.Dashboard`) the Ray dashboard of the cluster it runs on."""
    cfg = spec.train
    cells = len(spec.eval.cells(cfg.seq_length))
    workers = "1 worker in the trial's own process" if spec.trains_in_trial() else f"{cfg.workers} worker(s)"
    return (f"plan: study {spec.name}: {spec.search_space().size()} trial(s) ({spec.search.engine}), each "
            f"{cfg.steps:,} steps x {cfg.tokens_per_step:,} tokens on {workers}, then {cells} "
            f"evaluation cell(s) (lengths {spec.eval.eval_lengths(cfg.seq_length)}, {spec.eval.max_tokens:,} tokens "
            f"each); at most {spec.resources.max_concurrent_trials} trial(s) at once"
            + (f"; {dashboard.line()}" if dashboard is not None else ""))


def run_study(spec: StudySpec, store: str | None = None, runs: str | None = None, resume: bool | None = None,
              curves_dir: str | None = None, verbose: int = 0, quiet: bool = False,
              compact: bool = True, own_process: bool = False) -> StudySummary:
    """Run ``spec`` on the current Ray cluster (``ensure_ray``: ``RAY_ADDRESS`` or an embedded one).

    ``store``: results store (default ``spec.store``, else see the module docstring); ``runs``: the runs folder,
    where the study's state goes. ``resume``: None = restore the Tune experiment when it exists, True = it must exist,
    False = start a fresh search (the old state is moved aside). ``curves_dir``: a local folder for the figures
    (default ``<runs>/<study>/curves``). ``quiet``: Ray's and Tune's own output goes to a log file (its path is
    printed) and the terminal shows a line per trial change (:class:`attnlab.study.console.LiveView`);
    ``verbose``: Tune's own status tables (0 = none). The plan line, printed once Ray is up, ends with the
    address of the cluster's Ray dashboard (also written to the log file, and recorded in ``study.json`` for
    ``attnlab serve``; a cluster started here, embedded, is recorded as stopped when this process ends).
    ``compact``: once every trial has ended (complete, failed or stopped) and the catch-up evaluation is written,
    merge the study's small files in the store (:func:`compact_results`); False leaves them (``attnlab results
    compact`` merges them later).

    SIGINT and SIGTERM stop it alike (:mod:`attnlab.study.stopping`): the trials that were running are recorded as
    interrupted (``TrialStatus.INTERRUPTED``), the counts are printed, and it raises :class:`attnlab.errors.Interrupted`;
    running it again resumes them. ``own_process``: this process is the study's (the CLI's): when the signal took the
    Ray cluster too, the process ends itself with the study's last line instead of waiting on the cluster.
    """
    with StopSignals(spec.name) as stop:
        return _run_study(spec, store, runs, resume, curves_dir, verbose, quiet, compact, stop, own_process)


def _run_study(spec: StudySpec, store: str | None, runs: str | None, resume: bool | None, curves_dir: str | None,
               verbose: int, quiet: bool, compact: bool, stop: StopSignals, own_process: bool) -> StudySummary:
    from ray import tune

    from attnlab.ray_runtime import dashboard, ensure_ray, gcs_address as ray_gcs_address, log_file, quiet_ray
    from attnlab.results import ResultsStore
    from attnlab.study.console import LiveView, say

    store_loc = store_location(store or spec.store)
    state = study_state(spec, runs)
    space = spec.search_space()
    checked = space.checked()  # the points validation checked, with their configs: fitted to the data, warned about
    ctx = study_context(spec, state, ResultsStore(store_loc), checked=checked)
    if spec.eval.downstream is not None:  # a missing task folder or task: one line before any trial starts
        from attnlab.evaluate.downstream import check_tasks

        check_tasks(spec.eval.downstream.tasks, spec.eval.downstream.data)
    stages = stage_plan(ctx) if spec.stages else None  # refuses a parent without its final checkpoint
    state.loc.mkdir()
    log = None
    if quiet:
        from attnlab.cache import cache_dir

        log = log_file(state.loc.child("logs").path if state.loc.is_local else str(cache_dir() / "logs"), "ray")
        quiet_ray(log)
        # Tune's newer console output prints its experiment box and result paths even at verbose=0; the classic
        # one is silent there (the live view and the final table are the console).
        os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    ensure_ray(log_to_driver=not quiet)
    stop.install()  # over the handlers ray.init put in place
    board = dashboard()  # the cluster this study runs on: embedded, RAY_ADDRESS's or the Ray job's
    say(study_plan(spec, board), log)  # the terminal and the log file both name the dashboard
    if stages:
        say(stages, log)
    for warning in dict.fromkeys(w for searched in checked[:50] for w in searched.config.warnings()):
        print(f"attnlab: warning: {warning}", flush=True)
    if log:
        print(f"Ray's and Tune's own output: {log} (--verbose shows it here)", flush=True)
    restore = _check_state(spec, state, resume)
    state.write_study(spec.to_json(), spec.search_fingerprint(), ray=board.record())  # `attnlab serve` links it
    if board.embedded:  # the cluster ends with this process: then `attnlab serve` says so instead of linking it
        atexit.register(_record_cluster_stopped, state)
    trained_before = state.trainings_started()
    # one trial per point: this run's claims in the driver's claim registry (attnlab.study.claims)
    ctx.claims = start_registry(spec.name)

    os.environ.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")  # training reports lack the objective
    trainable = tune.with_resources(tune.with_parameters(study_trial, context=ctx),
                                    tune.PlacementGroupFactory([spec.trial_bundle()]))
    url = state.optuna_url(spec.optuna_storage) if spec.search.engine == "optuna" else None
    exp = state.tune
    storage_path, storage_fs = state.loc.ray_storage()
    if restore:
        print(f"attnlab: resuming study {spec.name!r} from {exp.uri}", flush=True)
        exp_path, exp_fs = exp.ray_storage()
        tuner = tune.Tuner.restore(exp_path, trainable=trainable, resume_unfinished=True, resume_errored=True,
                                   restart_errored=False, storage_filesystem=exp_fs)
    else:
        if spec.search.engine == "optuna":
            search_alg, param_space, num_samples = _optuna_search(spec, url), None, spec.search.num_samples
        else:
            search_alg, param_space, num_samples = None, {"point": tune.grid_search(space.points())}, 1
        tuner = tune.Tuner(
            trainable, param_space=param_space,
            # reuse_actors: a trial's process (its start and its imports, torch's among them, are seconds: see
            # bench/trials.py) runs the next trial too. Not with a scheduler: a trial ASHA stopped in a reused
            # process was left RUNNING in Optuna (tests/test_study_run.py's ASHA study)
            tune_config=tune.TuneConfig(search_alg=search_alg, scheduler=_scheduler(spec), num_samples=num_samples,
                                        max_concurrent_trials=spec.resources.max_concurrent_trials,
                                        reuse_actors=spec.scheduler.type == "none"),
            run_config=tune.RunConfig(name="tune", storage_path=storage_path, storage_filesystem=storage_fs,
                                      verbose=verbose, failure_config=tune.FailureConfig(max_failures=0),
                                      callbacks=tracker_callbacks(spec, state) if spec.trackers else []))
    if url:
        print(f"attnlab: Optuna study {spec.name!r} in {url}\n  watch it: optuna-dashboard {url}", flush=True)
    print(f"attnlab: TensorBoard: tensorboard --logdir {exp.uri}", flush=True)

    def interrupted_counts() -> None:
        trials = state.statuses()
        _print_counts(spec, StudySummary(spec.name, state.loc.uri, store_loc.uri, url, trials=trials,
                                         searched=len(trials), trained=state.trainings_started() - trained_before),
                      interrupted=stop.received.name)

    def report_interrupted() -> None:  # from the watcher, when a signal took the cluster too
        record_interrupted(state, stop)
        interrupted_counts()

    stop.watch_cluster(ray_gcs_address(), report_interrupted, own_process)
    reporting = False
    try:
        with stop.search(), LiveView(state) if quiet else contextlib.nullcontext():
            grid = tuner.fit()
            # Tune stopped, and its trials: recorded interrupted (the live view's last lines show them)
            if stop.received is not None and (reporting := stop.reported.acquire(blocking=False)):
                record_interrupted(state, stop)
    except Interrupted:  # a second signal, or one before Tune's loop began: the search ended where it was
        if (reporting := stop.reported.acquire(blocking=False)):
            record_interrupted(state, stop)
        grid = None
    if stop.received is not None:
        if reporting:
            end_run(ctx.claims)
            interrupted_counts()
        else:
            stop.reported.acquire()  # the watcher reports (the cluster went with the signal): wait for it
        raise stop.interrupted()
    end_run(ctx.claims)  # every trial has ended: the run's claims go
    _record_pruned(spec, state, grid)
    _record_died(ctx, grid)
    summary = StudySummary(spec.name, state.loc.uri, store_loc.uri, url, restored=restore, tensorboard_dir=exp.uri)
    summary.evaluated = evaluate_missing(ctx)
    if compact:
        summary.compacted = compact_results(ctx.store, spec.name)
    summary.trained = state.trainings_started() - trained_before
    summary.trials = state.statuses()
    summary.searched = len(grid)
    _report(spec, summary, state, ctx.store, curves_dir)
    return summary


def _record_cluster_stopped(state: StudyFolder) -> None:
    try:
        state.record_cluster_stopped(pid=os.getpid())
    except Exception:  # noqa: BLE001 - the process is ending; a study.json that cannot be written keeps its link
        pass


def compact_results(store: ResultsStore, study: str) -> str | None:
    """Merge ``study``'s small files in ``store`` (``ResultsStore.compact``: a crash or an error at any step loses
    and doubles no row) and say so in one line. A failure is a warning, never the study's failure: the store reads
    whole as it is, and ``attnlab results compact`` finishes the job later. Returns what was done, or None."""
    try:
        if not store.has_study(study):
            return None  # no row written yet (every trial failed early): nothing to merge, no folder to make
        done = store.compact(study).describe()
    except Exception as exc:  # noqa: BLE001 - the study's results are written; merging them is an optimisation
        reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        print(f"attnlab: warning: could not compact the results of study {study} ({type(exc).__name__}: {reason}); "
              f"they read whole as they are; retry with: attnlab results compact --store {store.uri} --study {study}",
              file=sys.stderr, flush=True)
        return None
    print(f"attnlab: results compacted: {done}", flush=True)
    return done


def _record_pruned(spec: StudySpec, state: StudyFolder, grid) -> None:
    """Trials the scheduler stopped never wrote their own final status: say so, with the step they reached."""
    objective = spec.objective[0].key
    for result in grid:
        metrics = result.metrics or {}
        key = metrics.get("train_key")
        if not key or result.error is not None or objective in metrics:
            continue
        current = state.status(key) or {}
        # failed too: stopping a trial kills its Train controller, which the trial sees as an error.
        if TrialStatus.read(current.get("status")) in (TrialStatus.UNKNOWN, TrialStatus.RUNNING, TrialStatus.FAILED):
            state.write_status(key, status=TrialStatus.PRUNED,
                               reason=f"stopped by {spec.scheduler.type} at step {metrics.get('step')} "
                                      f"({spec.scheduler.metric}={metrics.get(spec.scheduler.metric)})")


def _record_died(ctx: StudyContext, grid) -> None:
    """Tune trials that ended with an error their own code never recorded: the trial's process, or its node, died
    (killed, out of memory, a node the autoscaler removed), or its worker could not import what it runs. A run left
    ``running`` is marked failed with the reason (:func:`died_reason`); a trial that died before it recorded its run
    gets a status file all the same, failed with the reason, under the key the driver plans for its point (the trial
    never got that far), so the page, ``study status``, the summary and the exit code all count it."""
    import json

    state = ctx.state
    errored = [result for result in grid if result.error is not None]
    statuses = state.statuses() if errored else []  # read once: a large study's status files are many
    for result in errored:
        point = json.loads(json.dumps(point_of(result.config or {}), default=str))  # as its status file holds it
        reason = died_reason(result.error)
        mine = [t for t in statuses if t.get("point") == point]
        for t in mine:
            if TrialStatus.read(t.get("status")) in (TrialStatus.RUNNING, TrialStatus.UNKNOWN):
                state.write_status(t["train_key"], status=TrialStatus.FAILED, reason=reason)
        if mine:
            continue
        trial = (result.metrics or {}).get("trial_id")
        try:
            plan = plan_trial(ctx, point, trial or "unrecorded")
            key, planned = plan.train_key, {"config": plan.cfg.model_dump(mode="json"), "steps": plan.cfg.steps,
                                            "attention": plan.cfg.gpt_config().attention}
        except Exception:  # noqa: BLE001 - a point the driver cannot plan either: keyed by the point itself
            import hashlib

            key = "unplanned-" + hashlib.sha256(json.dumps(point, sort_keys=True).encode()).hexdigest()[:16]
            planned = {}
        state.write_status(key, point=point, trial=trial, run_dir=None, status=TrialStatus.FAILED, reason=reason,
                           recorded_by="driver", **planned)


def died_reason(error: BaseException) -> str:
    """Why a Tune trial ended with ``error``, one line: an import error in its worker, its process out of memory
    (Ray's memory monitor killed it, or an allocation failed: ``MemoryError``, ``OutOfMemoryError``), or its process
    killed (Ray cannot tell a SIGKILL, the kernel's OOM killer's included, from a crash: it names both); anything else
    as the error says (the trial's own code records the errors it raises once its run is recorded)."""
    import ray.exceptions

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))  # Ray colours the traceback it carries back
    chain, seen = [], error
    while isinstance(seen, BaseException) and seen not in chain and len(chain) < 10:
        chain.append(seen)  # the error, its cause (a RayTaskError's), what it was raised from
        seen = getattr(seen, "cause", None) or seen.__cause__ or seen.__context__
    raised = [m.group(1) + ": " + m.group(3) for m in re.finditer(
        r"^\s*(?:[\w.]+\.)?(\w+(Error|Exception))(?:\(\w+\))?: (.*)$", text, re.M)]
    raised = [" ".join(line.split())[:300] for line in raised]
    # the root cause: the last error raised, else the error itself
    said = raised[-1] if raised else " ".join(f"{type(error).__name__}: {text}".split())[:300]
    if any(isinstance(e, ImportError) for e in chain) or re.search(r"\b(ModuleNotFoundError|ImportError): ", text):
        return f"an import error in the trial's worker: {said}"
    if any(isinstance(e, MemoryError) for e in chain) or re.search(
            r"running low on memory|OutOfMemoryError|MemoryError|out of memory", text):
        return f"the trial's process ran out of memory: {said}"
    died = (ray.exceptions.ActorDiedError, ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError)
    if any(isinstance(e, died) for e in chain) or re.search(r"died unexpectedly|its node has died", text):
        pid = re.search(r"\bpid: (\d+)", text)
        detail = re.search(r"Worker exit detail: (.*?\.)(?: |$)", text)
        return (f"the trial's process died{f' (pid {pid.group(1)})' if pid else ''}: killed, or crashed"
                + (f" (Ray: {detail.group(1)[:200]})" if detail else f" ({said})"))
    return f"the trial ended with an error it did not record: {said}"


def _print_counts(spec: StudySpec, summary: StudySummary, interrupted: str | None = None) -> None:
    """The summary line (how many trials, by status; how many trained) and a line per trial that ended with a
    reason; ``interrupted``: the signal that stopped the study, said first."""
    statuses = {}
    for t in summary.trials:
        statuses[t.get("status")] = statuses.get(t.get("status"), 0) + 1
    runs = len(summary.trials)
    counted = (f"{summary.searched} trial(s) on {runs} distinct training run(s) (the search proposed a point more "
               "than once):" if summary.searched > runs else f"{runs} trial(s)")
    print(f"\nstudy {spec.name}: {f'interrupted ({interrupted}): ' if interrupted else ''}{counted} "
          + ", ".join(f"{n} {s}" for s, n in sorted(statuses.items())) + f"; {summary.trained} trained this run"
          + (f", {summary.evaluated} new evaluation cell(s) of earlier trials" if summary.evaluated else ""),
          flush=True)
    for t in summary.trials:
        if TrialStatus.read(t.get("status")).has_reason:
            print(f"  {t['status']}: {t.get('train_key')} {t.get('point')}: {t.get('reason')}", flush=True)


def _report(spec: StudySpec, summary: StudySummary, state: StudyFolder, store: ResultsStore,
            curves_dir: str | None) -> None:
    """Print the results table, the trials that did not complete, and write the curves."""
    from attnlab.results import reports

    df = store.read(study=spec.name)
    _print_counts(spec, summary)
    metric = spec.objective[0].parts.metric  # the study's own measure: val_loss, or acc for a probe
    if len(df) == 0 or not (df["metric"] == metric).any():
        print("no results in the store yet")
        return
    try:
        summary.table = reports.to_markdown(reports.table(df, metric=metric))
        print("\n" + summary.table + "\n")
        target = curves_dir or state.curves.uri  # next to the study's state, on a bucket too
        summary.curves = reports.curves(df, target, metric=metric, by="length")
        if len({str(p) for p in df["p_eval"]}) > 1:
            summary.curves["by_p"] = reports.curves(df, target, metric=metric, by="p")["png"]
        print(f"curves: {summary.curves['png']} (and {summary.curves['html']})")
    except UserError as exc:
        print(f"attnlab: could not report: {exc}", file=sys.stderr)
    print(f"results store: {summary.store}  (attnlab results table --store {summary.store} --study {spec.name})")


__all__ = ["StudySummary", "compact_results", "run_study", "study_context", "study_state"]
