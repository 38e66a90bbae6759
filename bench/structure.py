"""The package's shape in four figures: the largest module, the longest function, how many times one trial of a
study opens its data, and how many times the training config is dumped to a dict and validated back on the way.

Prints figures after the machine header (``bench/machine.py``); asserts nothing. Usage:

    python bench/structure.py [--source platform] [--skip-study]

- sizes: every ``.py`` file under ``SOURCE/attnlab`` read with ``ast``: its lines, and each function's lines
  (``def`` to its last line, nested functions counted inside their parent and on their own);
- a real one-trial study (a tiny GPT on the copy probe, one Ray Train worker, embedded Ray; then the same trained
  in its Tune trial's process, the default for one CPU worker: a source older than that option fails there) run as
  ``attnlab study run`` in a subprocess whose every Python process (the driver, the Tune trial, the Train worker,
  the evaluation task) loads a counting hook (a ``sitecustomize`` on its ``PYTHONPATH``). The hook wraps
  ``attnlab.data.source.open_data`` and ``TrainConfig.model_validate`` / ``model_dump`` as their modules load,
  and logs each call with its process and the attnlab functions on its stack (:data:`HOOK`).

A *dict round-trip* is a ``TrainConfig`` validated from a dict that holds every one of its fields: what
``model_dump`` gives, read back (a user's or a study's ``train:`` block never lists every field). ``--source``
names another source root (e.g. a copy of an older commit) so the before and after figures come from this same
script; the study runs from the current directory's ``studies/``-free temp folder, so any checkout works.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/machine.py, also when a test loads this file
import machine  # noqa: E402

ROOT = machine.ROOT

# The counting hook: installed as sitecustomize.py in a folder put first on PYTHONPATH, so every Python process of
# the study (Ray's workers inherit the environment of the embedded cluster) patches the two modules as they load.
HOOK = r'''
import importlib.abc, importlib.util, json, os, sys, traceback

_LOG = os.environ.get("ATTNLAB_COUNT_LOG")


def _log(kind, **fields):
    stack = [f.name for f in traceback.extract_stack()[:-2] if "attnlab" in f.filename]
    with open(_LOG, "a") as out:
        out.write(json.dumps({"pid": os.getpid(), "kind": kind, "stack": stack, **fields}) + "\n")


def _patch_source(module):
    inner = module.open_data

    def open_data(*args, **kwargs):
        _log("open_data")
        return inner(*args, **kwargs)

    module.open_data = open_data


def _patch_config(module):
    cls = module.TrainConfig
    validate, dump = cls.model_validate.__func__, cls.model_dump
    names = set(cls.model_fields)

    def model_validate(klass, obj, *args, **kwargs):
        full = isinstance(obj, dict) and names <= set(obj)
        _log("validate", full=full)
        return validate(klass, obj, *args, **kwargs)

    def model_dump(self, *args, **kwargs):
        _log("dump")
        return dump(self, *args, **kwargs)

    cls.model_validate = classmethod(model_validate)
    cls.model_dump = model_dump


_PATCHES = {"attnlab.data.source": _patch_source, "attnlab.train.config": _patch_config}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


if _LOG:
    sys.meta_path.insert(0, _Finder())
'''

# A one-trial study: tiny GPT on the copy probe, 4 steps, evaluated at 1x and 2x (about a minute on 2 cores).
STUDY = """\
name: structure
train:
  preset: tiny
  data: {synthetic: copy_distractors, vocab: 64, copy_len: 8}
  seq_len: 32
  steps: 4
  tokens_per_step: 256
  micro_batch: 8
  warmup_steps: 1
  log_every: 2
  val_every: 4
  val_tokens: 256
  checkpoint_every: 4
  threads_per_worker: 1
  workers: 1
  cpus_per_worker: 1
resources: {max_concurrent_trials: 1, trial_cpus: 0.5, train_in_trial: false}
search: {engine: grid}
space:
  attention: [softmax]
objective: val_loss@2x
eval: {multiples: [1, 2], rope_scaling: [none], max_tokens: 128}
"""

# The same study trained in its Tune trial's own process (the default for one CPU worker): one process opens the data
# for training and evaluation.
STUDY_IN_TRIAL = STUDY.replace("train_in_trial: false", "train_in_trial: true")

# Which process an event came from, by the attnlab functions on its stack (the first match wins).
ROLES = (("evaluation task", ("_evaluate_task", "evaluate_checkpoint")),
         ("Train worker", ("train_worker", "_worker")),
         ("Tune trial", ("study_trial",)),
         ("study driver", ("run_study", "load_spec", "main")))


def sizes(package: Path) -> dict:
    """The largest module (lines) and the longest functions (lines) of ``package``."""
    modules, functions = [], []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        name = str(path.relative_to(package.parent))
        modules.append((len(text.splitlines()), name))
        for node in ast.walk(ast.parse(text, name)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((node.end_lineno - node.lineno + 1, f"{name}:{node.lineno} {node.name}"))
    modules.sort(reverse=True)
    functions.sort(reverse=True)
    return {"largest_module": modules[0], "longest_functions": functions[:5],
            "functions_over_110": [f for f in functions if f[0] > 110]}


def role(stack: list[str]) -> str:
    for name, markers in ROLES:
        if any(m in stack for m in markers):
            return name
    return "other"


def count_study(source: Path, workdir: Path, study: str = STUDY, timeout: float = 900.0) -> list[dict]:
    """Run ``study`` (YAML text) with ``attnlab study run`` from the source root ``source`` under the counting hook;
    return the logged events (each with ``pid``, ``kind``, ``stack``, ``role``). Raises RuntimeError (with the
    command's output) when the study fails."""
    workdir.mkdir(parents=True, exist_ok=True)
    hook = workdir / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    (workdir / "study.yaml").write_text(study)
    log = workdir / "events.jsonl"
    log.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(source)]), "ATTNLAB_COUNT_LOG": str(log),
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_API_SERVER_ADDRESS", None)
    cmd = [sys.executable, "-c", "import sys; from attnlab.cli import main; sys.exit(main())", "study", "run",
           str(workdir / "study.yaml"), "--store", str(workdir / "results"), "--runs", str(workdir / "runs")]
    done = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the study failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    by_pid: dict[int, str] = {}
    for event in events:  # a process's role: that of its first event with a recognised stack
        if event["pid"] not in by_pid or by_pid[event["pid"]] == "other":
            by_pid[event["pid"]] = role(event["stack"])
    for event in events:
        event["role"] = by_pid[event["pid"]]
    return events


def summarise(events: list[dict]) -> dict:
    """Per role: data opens, TrainConfig validations (and how many of them read back a full dump), dumps; and the
    largest number of opens in any one process."""
    out = collections.OrderedDict()
    for name, _ in ROLES + (("other", ()),):
        mine = [e for e in events if e["role"] == name]
        if not mine:
            continue
        out[name] = {"processes": len({e["pid"] for e in mine}),
                     "data_opens": sum(e["kind"] == "open_data" for e in mine),
                     "validations": sum(e["kind"] == "validate" for e in mine),
                     "round_trips": sum(e["kind"] == "validate" and e.get("full", False) for e in mine),
                     "dumps": sum(e["kind"] == "dump" for e in mine)}
    opens = collections.Counter(e["pid"] for e in events if e["kind"] == "open_data")
    return {"roles": out, "max_opens_in_one_process": max(opens.values(), default=0),
            "data_opens": sum(opens.values()),
            "round_trips": sum(e["kind"] == "validate" and e.get("full", False) for e in events)}


def _git(source: Path) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=source, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "not a checkout"
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=str(ROOT / "platform"), help="the source root holding attnlab/")
    parser.add_argument("--skip-study", action="store_true", help="only the sizes (no study is run)")
    parser.add_argument("--workdir", help="where the study runs (default: a temporary folder)")
    args = parser.parse_args(argv)
    source = Path(args.source).resolve()
    machine.print_header(packages=("ray",))
    print(f"- source: {source} (git {_git(source)})")
    shape = sizes(source / "attnlab")
    print(f"largest module: {shape['largest_module'][1]} ({shape['largest_module'][0]} lines)")
    print("longest functions: " + "; ".join(f"{name} ({n} lines)" for n, name in shape["longest_functions"]))
    print("functions over 110 lines: " + ("; ".join(f"{name} ({n})" for n, name in shape["functions_over_110"])
                                         or "none"))
    if args.skip_study:
        return 0
    studies = {"with a Ray Train worker and an evaluation task (train_in_trial: false)": STUDY,
               "trained and evaluated in the Tune trial's process (the default)": STUDY_IN_TRIAL}
    for title, study in studies.items():
        with tempfile.TemporaryDirectory(prefix="attnlab-structure-") as tmp:
            events = count_study(source, Path(args.workdir or tmp) / str(len(title)), study=study)
        summary = summarise(events)
        print(f"one trial of a one-trial study (copy probe, 1 CPU worker), {title}:")
        print("| process | processes | data opens | TrainConfig validations | of them dict round-trips "
              "| model_dump calls |")
        print("|---|---|---|---|---|---|")
        for name, row in summary["roles"].items():
            print(f"| {name} | {row['processes']} | {row['data_opens']} | {row['validations']} | "
                  f"{row['round_trips']} | {row['dumps']} |")
        print(f"data opens: {summary['data_opens']} (at most {summary['max_opens_in_one_process']} in one process); "
              f"dict round-trips: {summary['round_trips']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
