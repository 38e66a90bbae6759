"""Downstream zero-shot (or few-shot) tasks through lm-evaluation-harness: HellaSwag, ARC, PIQA, LAMBADA, or any
task written in the harness's YAML format, scored by :class:`attnlab.evaluate.harness_lm.AttnlabLM`.

- :func:`open_tasks` finds the tasks (``eval.downstream.data``: a local folder or a bucket prefix, copied to a
  local temporary folder; tasks not found there are the harness's own) and refuses, in one line, a missing
  folder, an unknown task or a missing ``lm_eval``;
- :func:`run_tasks` runs the harness on one model at one context length, RoPE scaling and p_eval, and returns
  ``{task: [(metric, value, stderr, n_docs), ...]}`` for the metrics the results store knows
  (:data:`HARNESS_METRICS`; ``bits_per_byte`` is stored as ``bpb``).

Offline: the tasks read their data from the folder (paths in a task YAML are relative to it: the harness runs
with that folder as its working directory) or from the ``datasets`` cache; with ``HF_DATASETS_OFFLINE=1`` nothing
is fetched from the hub. docs/downstream.md says how to prepare the paper's tasks.

No Ray, no store here (``attnlab.evaluate.cell_rows`` makes the rows).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from attnlab.errors import UserError
from attnlab.location import Location

# harness metric name -> results-store metric name
HARNESS_METRICS = {"acc": "acc", "acc_norm": "acc_norm", "perplexity": "perplexity",
                   "word_perplexity": "word_perplexity", "byte_perplexity": "byte_perplexity",
                   "bits_per_byte": "bpb", "mcc": "mcc", "f1": "f1", "exact_match": "exact_match"}
BOOTSTRAP_ITERS = 1000  # the harness's bootstrap for perplexity stderr (its default 100000 takes minutes)
INSTALL_HINT = "pip install 'attnlab[downstream]'"


def require_harness():
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(f"eval.downstream needs lm-evaluation-harness, which is not installed: {INSTALL_HINT}") from None


@dataclass
class TaskSet:
    """The located tasks: the local folder of task configs (or None: the harness's own tasks only) and the
    harness's task manager over it."""

    folder: str | None
    manager: object
    tasks: list[str]


def _local_folder(data: str, stack: contextlib.ExitStack) -> str:
    loc = Location.parse(data, field="eval.downstream.data")
    if not loc.is_dir():
        raise UserError(f"eval.downstream.data: {data} is not a folder (or does not exist); prepare the tasks' "
                        "configs and data there first (docs/downstream.md)")
    if loc.is_local:
        return os.path.abspath(loc.local_path)
    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="attnlab-tasks-"))
    return loc.download("", os.path.join(tmp, "tasks"))


def _yaml_task_names(folder: str) -> set[str]:
    """Names declared by the task YAMLs under ``folder`` (``task:`` entries), read without the harness."""
    import yaml

    class _Loose(yaml.SafeLoader):
        pass

    _Loose.add_multi_constructor("!", lambda loader, suffix, node: None)  # !function and friends
    names = set()
    for root, _, files in os.walk(folder):
        for name in files:
            if name.endswith((".yaml", ".yml")):
                try:
                    with open(os.path.join(root, name), encoding="utf-8") as f:
                        doc = yaml.load(f, Loader=_Loose)
                except yaml.YAMLError:
                    continue
                task = doc.get("task") if isinstance(doc, dict) else None
                for item in task if isinstance(task, list) else [task]:
                    if isinstance(item, str):
                        names.add(item)
    return names


@contextlib.contextmanager
def open_tasks(tasks: list[str], data: str | None) -> Iterator[TaskSet]:
    """The harness's task manager for ``tasks``: the folder's own configs, plus the harness's built-in index only
    when a task is not in the folder. UserError (one line) naming the missing folder or the unknown task."""
    require_harness()
    with contextlib.ExitStack() as stack:
        folder = _local_folder(data, stack) if data else None
        local = _yaml_task_names(folder) if folder else set()
        builtin = any(task not in local for task in tasks)
        manager = _manager(folder, builtin) if builtin else _build_manager(folder, False)
        known = set(manager.all_tasks)
        for task in tasks:
            if task not in known:
                where = f"in {data} (tasks there: {', '.join(sorted(local)) or 'none'})" if data else \
                    "among lm-evaluation-harness's tasks (set eval.downstream.data to a folder of task configs)"
                raise UserError(f"eval.downstream: task {task!r} is not {where}")
        yield TaskSet(folder, manager, list(tasks))


def _build_manager(folder: str | None, builtin: bool):
    from lm_eval.tasks import TaskManager

    with _quiet():
        return TaskManager(include_path=folder, include_defaults=builtin)


@functools.lru_cache(maxsize=4)
def _manager(folder: str | None, builtin: bool):
    """Indexing the harness's built-in tasks takes seconds: once per folder and process."""
    return _build_manager(folder, builtin)


def check_tasks(tasks: list[str], data: str | None) -> None:
    """Refuse a missing folder or an unknown task now (before any training)."""
    with open_tasks(tasks, data):
        pass


@contextlib.contextmanager
def _quiet():
    """The harness logs every task it builds at INFO/WARNING; keep the progress lines attnlab's own."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _one_process():
    """The harness bootstraps a perplexity's stderr in a ``multiprocessing`` pool it forks per metric unless
    ``DISABLE_MULTIPROC`` is set. A fork of a process holding Ray's threads (an evaluation task, a trial) can hang in
    the child on a lock another thread held (seen once under load in the tests); BOOTSTRAP_ITERS draws take
    milliseconds in one process."""
    before = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("DISABLE_MULTIPROC", None)
        else:
            os.environ["DISABLE_MULTIPROC"] = before


@contextlib.contextmanager
def _working_dir(folder: str | None):
    if folder is None:
        yield
        return
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def run_tasks(model, task_set: TaskSet, tasks: list[str], *, length: int, rope_scaling: str, attention,
              num_fewshot: int, limit: int | None, device, precision: str, batch_size: int,
              say=lambda message: None) -> dict[str, list[tuple[str, float, float | None, int | None]]]:
    """Score ``tasks`` with the harness; ``{task: [(metric, value, stderr or None, documents), ...]}``. The
    process's random generators are left alone (scoring draws nothing; few-shot examples use the harness's own
    fixed seed)."""
    import lm_eval

    from attnlab.evaluate.harness_lm import AttnlabLM

    lm = AttnlabLM(model, max_length=length, rope_scaling=rope_scaling, attention=attention, device=device,
                   precision=precision, batch_size=batch_size)
    try:
        with _quiet(), _one_process(), _working_dir(task_set.folder):
            results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                              task_manager=task_set.manager, log_samples=False,
                                              bootstrap_iters=BOOTSTRAP_ITERS, random_seed=None,
                                              numpy_random_seed=None, torch_random_seed=None)
    except UserError:
        raise
    except (FileNotFoundError, ConnectionError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"eval.downstream: tasks {', '.join(tasks)}: their data could not be read ({first}); "
                        "prepare it ahead (docs/downstream.md)") from None
    out: dict[str, list] = {}
    samples = results.get("n-samples", {})
    for task in tasks:
        metrics = results["results"].get(task, {})
        n_docs = samples.get(task, {}).get("effective")
        rows = []
        for key, value in metrics.items():
            name, _, filt = key.partition(",")
            if name.endswith("_stderr") or name == "alias" or name not in HARNESS_METRICS:
                continue
            stderr = metrics.get(f"{name}_stderr,{filt}")
            stderr = float(stderr) if isinstance(stderr, (int, float)) else None
            rows.append((HARNESS_METRICS[name], float(value), stderr, None if n_docs is None else int(n_docs)))
        skipped = sorted({k.partition(",")[0] for k in metrics} - set(HARNESS_METRICS) - {"alias"}
                         - {f"{m}_stderr" for m in HARNESS_METRICS})
        if skipped:
            say(f"eval: {task}: metrics {', '.join(skipped)} are not stored (not results metrics)")
        out[task] = rows
    return out


__all__ = ["BOOTSTRAP_ITERS", "HARNESS_METRICS", "TaskSet", "check_tasks", "open_tasks", "require_harness",
           "run_tasks"]
