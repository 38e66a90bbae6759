"""The import graph of the package: dependencies point down, no file-level cycles, Ray only in its thin layer;
and every module docstring short (at most 20 lines).

Read from the source with ``ast`` (every ``import`` statement, lazy ones inside functions included), so a new
upward import fails here with the file and the line that made it.

Layers, bottom to top (a package may import its own layer's modules only inside itself):

    0  errors, faults (fault-injection seams: they import nothing, and the base's own code calls them too)
    1  names, validation, location, provenance, ray_runtime, cache, states (control state as enums)
       (the shared base)
    2  attention
    3  model
    4  data, results, runfolder (a training run's folder: its files' format, read by train, study and serve)
    5  train, evaluate, cluster, export (a run to a Hugging Face model folder)
    6  study
    7  the commands: attnlab/cli.py, attnlab/demo.py, every */cli.py, serve
    8  attnlab/__main__.py (``python -m attnlab``: the command line, as a Ray job's entrypoint runs it)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "platform"
PACKAGE = ROOT / "attnlab"
LAYERS = {
    "errors": 0, "names": 1, "validation": 1, "location": 1, "provenance": 1, "ray_runtime": 1, "cache": 1,
    "states": 1, "faults": 0,
    "attention": 2, "model": 3, "data": 4, "results": 4, "runfolder": 4,
    "train": 5, "evaluate": 5, "cluster": 5, "export": 5, "study": 6, "cli": 7, "demo": 7, "serve": 7,
    "__main__": 8,
}
# Modules that may import Ray (the thin layer); everything else must import and test without it.
RAY_MODULES = {"attnlab.ray_runtime", "attnlab.train.ray_train", "attnlab.data.pipeline.parallel",
               "attnlab.study.runner", "attnlab.study.trial", "attnlab.study.claims", "attnlab.study.trackers",
               "attnlab.study.submit", "attnlab.cluster.validate"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> list[tuple[str, int]]:
    """``(module, line)`` for every attnlab module (or Ray) the file imports, anywhere in it."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno))
            out += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names
                    if f"{node.module}.{alias.name}" in MODULES]
    return out


def _edges() -> list[tuple[str, str, int]]:
    edges = []
    for name, path in MODULES.items():
        for target, line in _imports(path):
            if target in MODULES and target != name:
                edges.append((name, target, line))
    return edges


def _layer(module: str) -> tuple[int, str]:
    parts = module.split(".")
    if len(parts) == 1:
        return -1, "attnlab"  # the package itself: imports nothing
    top = parts[1]
    if parts[-1] == "cli":
        return LAYERS["cli"], module
    assert top in LAYERS, f"{module}: a new top-level module or package; give it a layer in this test"
    return LAYERS[top], top


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def _upward(edges) -> list[str]:
    upward = []
    for source, target, line in edges:
        (ls, ps), (lt, pt) = _layer(source), _layer(target)
        if ps == pt or pt == "attnlab" or source.split(".")[:2] == target.split(".")[:2]:
            continue  # inside one package
        if lt >= ls:
            upward.append(f"{source}:{line} imports {target} (layer {ls} -> {lt})")
    return upward


def test_dependencies_point_down():
    upward = _upward(_edges())
    assert not upward, "imports that do not point down:\n" + "\n".join(upward)


def test_training_and_evaluation_never_import_each_other():
    bad = [f"{s} -> {t}" for s, t, _ in _edges()
           if {s.split(".")[1], t.split(".")[1]} == {"train", "evaluate"} and not s.endswith(".cli")]
    assert not bad, bad


def test_study_depends_on_cluster_never_the_other_way():
    """Whether a study fits a config is the study's question (study/fit.py asks cluster/fit.py); the cluster
    package, its command included, knows configs and resource requests, never a study."""
    bad = [f"{s}:{line} imports {t}" for s, t, line in _edges()
           if s.split(".")[1] == "cluster" and t.split(".")[1] == "study"]
    assert not bad, bad


def test_no_file_level_import_cycles():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for source, target, _ in _edges():
        graph[source].add(target)
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def strongconnect(v):  # Tarjan's algorithm
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            strongconnect(v)
    assert not cycles, f"import cycles: {cycles}"


def test_ray_stays_in_its_thin_layer():
    users = {name for name, path in MODULES.items() for target, _ in _imports(path)
             if target == "ray" or target.startswith("ray.")}
    assert users <= RAY_MODULES | {m for m in users if m.endswith(".cli")}, sorted(users - RAY_MODULES)


def test_the_checks_see_the_imports_and_flag_an_upward_one():
    """The reader finds real imports, and the layer rule flags a violation (the tests above cannot pass vacuously)."""
    edges = _edges()
    assert ("attnlab.train.parts", "attnlab.model.scoring") in {(s, t) for s, t, _ in edges}
    assert len(edges) > 100
    assert _upward([("attnlab.model.gpt", "attnlab.train.loop", 7)]) == [
        "attnlab.model.gpt:7 imports attnlab.train.loop (layer 3 -> 5)"]
    assert _upward([("attnlab.train.loop", "attnlab.evaluate.measure", 1)])  # same layer, other package
    assert not _upward([("attnlab.study.cli", "attnlab.study.runner", 1)])


# A module docstring says what the module owns and what it must never do, in about 15 lines and never more than 20,
# and links the doc (docs/*.md, with its anchor) that holds the details (issue 52). Lines are counted as
# ``len(ast.get_docstring(tree, clean=False).splitlines())``.
DOCSTRING_MAX_LINES = 20


def _docstring_lines(path: Path) -> int:
    doc = ast.get_docstring(ast.parse(path.read_text(), str(path)), clean=False)
    return len(doc.splitlines()) if doc else 0


def _long_docstrings(modules: dict[str, Path]) -> dict[str, int]:
    return {name: n for name, path in modules.items() if (n := _docstring_lines(path)) > DOCSTRING_MAX_LINES}


def test_module_docstrings_are_at_most_20_lines():
    long = sorted(f"{name}: {n} lines" for name, n in _long_docstrings(MODULES).items())
    assert not long, (f"module docstrings over {DOCSTRING_MAX_LINES} lines (say what the module owns and must never "
                      f"do, and link the docs/*.md section that holds the details):\n" + "\n".join(long))


def test_the_docstring_count_flags_a_long_module_docstring(tmp_path):
    """The count reads the module's docstring (not a function's) as its raw lines, and 21 lines are too many."""
    short, long = tmp_path / "short.py", tmp_path / "long.py"
    short.write_text('"""One.\n\nThree.\n"""\n\n\ndef f():\n    """' + "x\n" * 40 + '"""\n')
    long.write_text('"""' + "line\n" * 21 + '"""\n')
    assert _docstring_lines(short) == 3 and _docstring_lines(long) == 21
    assert _long_docstrings({"short": short, "long": long}) == {"long": 21}
    assert 1 < _docstring_lines(PACKAGE / "attention" / "flex.py") <= DOCSTRING_MAX_LINES


def _loaded_after(imports: str, watched: tuple[str, ...]) -> list[str]:
    """Which of ``watched`` a fresh interpreter has loaded after running ``imports`` (Python statements)."""
    import json
    import os
    import subprocess
    import sys

    code = f"import json, sys; {imports}; print(json.dumps(sorted(m for m in {watched!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_commands_and_a_trial_import_without_torch_dynamo():
    """Importing torch._dynamo costs a process about 2 s on a small machine: every ``attnlab`` call and every Ray
    worker paid it while a module-level ``torch.compiler.disable`` pulled it in. It loads when something compiles."""
    imports = ("import attnlab.cli, attnlab.study.trial, attnlab.train.ray_train, attnlab.evaluate.extrapolation; "
               "attnlab.cli.build_parser()")
    assert _loaded_after(imports, ("torch._dynamo", "torch._inductor")) == []


def test_the_claim_registry_actor_imports_neither_torch_nor_pandas():
    """A study driver starts a claim registry actor, whose process imports its class's module: through the
    package's eager ``load_spec`` it imported torch, pandas and pyarrow (4.4 s of CPU a study on 2 cores, for a
    dictionary)."""
    assert _loaded_after("import attnlab.study.claims", ("torch", "pandas", "pyarrow", "ray")) == []
