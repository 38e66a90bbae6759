"""bench/ as a whole: one machine header that every benchmark prints (``bench/machine.py``), ``bench/RESULTS.md`` as
a list of one section per benchmark, each naming its script, a command and a date, and the GPU probe of
evaluation's memory (``bench/eval_memory.py``) run on CPU so that it does not rot. The GPU check has its own file,
tests/test_bench_gpu.py."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def _machine():
    spec = importlib.util.spec_from_file_location("bench_machine", BENCH / "machine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_machine_header_names_the_date_the_machine_the_versions_and_the_commit():
    machine = _machine()
    info = machine.header("cpu", ("pyarrow", "no-such-distribution"))
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", info["date"])
    assert info["cores"] == os.cpu_count() and info["driver"] is None and info["device"].startswith("CPU: ")
    assert info["versions"] == {"pyarrow": __import__("pyarrow").__version__, "no-such-distribution": None}
    assert info["torch"] == __import__("torch").__version__ and len(info["git"]["sha"]) == 40
    lines = machine.lines(info)
    assert lines[0] == f"- date: {info['date']}"
    assert lines[1].startswith(f"- machine: CPU: {info['cpu']}, {info['cores']} cores") and "load average" in lines[1]
    assert f"torch {info['torch']}" in lines[2] and "no-such-distribution not installed" in lines[2]
    assert lines[3] == f"- git: {info['git']['sha']}" + (" (dirty)" if info["git"]["dirty"] else "")


def test_every_benchmark_takes_its_header_from_bench_machine():
    """A sixth copy of the header (a date, the CPU model, the versions written out again) fails here."""
    scripts = sorted(BENCH.glob("*.py")) + sorted(BENCH.glob("*/*.py"))
    own_header = {p.relative_to(ROOT).as_posix(): re.findall(r"/proc/cpuinfo|datetime|python_version\(\)|"
                                                            r"platform\.platform\(\)|nvidia-smi",
                                                            p.read_text())
                  for p in scripts if p.name != "machine.py"}
    assert not {k: v for k, v in own_header.items() if v}, own_header
    # every benchmark script prints it (torch_floor.py checks API names and prints no figures of a machine)
    printing = [p for p in BENCH.glob("*.py") if p.name not in ("machine.py", "torch_floor.py")]
    assert printing and all(re.search(r"^import machine\b", p.read_text(), re.M) for p in printing), printing


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## ", text, flags=re.M)[1:]
    return {part.splitlines()[0]: part for part in parts}


def test_results_is_one_section_per_benchmark_with_its_script_command_and_date():
    """bench/RESULTS.md holds the latest figures: each ``## <benchmark> (`bench/<script>`)`` section names a script
    that exists, the command that measured its figures and their date (or says it has not run); earlier runs' logs
    are dated files under bench/results/."""
    sections = _sections((BENCH / "RESULTS.md").read_text(encoding="utf-8"))
    assert len(sections) >= 10
    for title, body in sections.items():
        m = re.fullmatch(r".+ \(`bench/([\w/]+\.py)( [^`]*)?`\)", title)
        assert m, f"section {title!r}: its title must end with the script, (`bench/<script>`)"
        script = m.group(1)
        assert (BENCH / script).is_file(), f"section {title!r}: bench/{script} does not exist"
        assert re.search(rf"`(python3? |PYTHONPATH=\S+ python )?bench/{re.escape(script)}[^`]*`|`make [\w-]+`", body), \
            f"section {title!r} gives no command"
        assert re.search(r"20\d\d-\d\d-\d\d", body) or "has not run" in body, f"section {title!r} gives no date"
    logs = sorted((BENCH / "results").glob("*.md"))
    assert logs and all(re.fullmatch(r"20\d\d-\d\d-\d\d-[a-z0-9]+-[a-z0-9-]+\.md", p.name) for p in logs), logs


def test_the_evaluation_memory_probe_runs_on_cpu_without_ray(tmp_path):
    script = str(BENCH / "eval_memory.py")
    run = ("import runpy, sys\nsys.argv = [sys.argv[1], '--smoke', '--variants', 'lssar:15,softmax', '--cells', "
           "'2x32,1x64']\ntry:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit as exc:\n"
           "    assert not exc.code, exc.code\nassert 'ray' not in sys.modules, 'the probe imported Ray'\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "platform"))
    proc = subprocess.run([sys.executable, "-c", run, script], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("- date: ") and lines[1].startswith("- machine: CPU: ")
    rows = [ln for ln in lines if ln.startswith("| lssar p=15 |") or ln.startswith("| softmax |")]
    assert [r.split(" | ")[:2] for r in rows] == [["| lssar p=15", "2 x 32"], ["| lssar p=15", "1 x 64"],
                                                  ["| softmax", "2 x 32"], ["| softmax", "1 x 64"]]
    assert all(float(r.split(" | ")[7]) >= 0 for r in rows)  # the plan, beside peaks only a GPU measures ("-")
    no_gpu = subprocess.run([sys.executable, script], env=dict(env, CUDA_VISIBLE_DEVICES=""), capture_output=True,
                            text=True, timeout=300)
    assert no_gpu.returncode == 2 and "needs a CUDA GPU" in no_gpu.stderr and no_gpu.stdout == ""
