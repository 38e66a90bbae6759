"""``bench/gpu.py``: the quick check (``--quick``) and the full run, each in its CPU smoke form end to end (so neither
GPU command rots), the quick check with Ray, the web page's packages, Optuna, lm-eval and pytest hidden from the
import system (a bare GPU node has none of them), results written as each part ends (a killed run keeps them), their
refusal without a GPU, the pieces they are built from, and the ``gpu`` marker on every CUDA test.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu.py"
# What a bare GPU node lacks and the quick check must not import.
HIDDEN = ("ray", "starlette", "uvicorn", "optuna", "lm_eval", "pytest", "jinja2", "plotly")
# Runs bench/gpu.py with HIDDEN unimportable, then writes the top-level modules it imported to argv[1].
HIDING_RUNNER = """
import importlib.abc, json, runpy, sys
HIDDEN = set(json.loads(sys.argv[1]))
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None
sys.meta_path.insert(0, Hide())
out = sys.argv[2]
sys.argv = [sys.argv[3]] + sys.argv[4:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    with open(out, "w") as f:
        json.dump(sorted({m.split(".")[0] for m in sys.modules}), f)
"""


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    yield _load_script()  # puts bench/ (gpucheck) and platform/ on sys.path
    sys.modules.pop("bench_gpu", None)


@pytest.fixture(scope="module")
def gc(bench):
    """The gpucheck package's modules."""
    from gpucheck import (agreement, evaluation, harness, kernels, pytests, quick, report, sizes, training,
                          variants)

    return type("GpuCheck", (), dict(agreement=agreement, evaluation=evaluation, harness=harness, kernels=kernels,
                                     pytests=pytests, quick=quick, report=report, sizes=sizes, training=training,
                                     variants=variants))


def _env(**extra):
    return dict(os.environ, PYTHONPATH=str(ROOT / "platform"), **extra)


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_without_a_gpu_it_exits_2_with_one_line(quick):
    proc = subprocess.run([sys.executable, str(SCRIPT)] + (["--quick"] if quick else []),
                          env=_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "needs a CUDA GPU" in proc.stderr and "--smoke" in proc.stderr
    assert proc.stdout == ""


def test_bad_parts_are_named(bench, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--smoke", "--parts", "attention,speed"])
    assert info.value.code == 2
    assert "--parts='speed' is not allowed" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the full run's parts are not the quick check's
        bench.main(["--quick", "--smoke", "--parts", "environment,attention"])
    err = capsys.readouterr().err
    assert "--parts='attention' is not allowed with --quick" in err and "environment,agreement,kernels" in err


# --- the quick check ---------------------------------------------------------------------------------------------

@pytest.mark.slow  # ~40 s of CPU: every part at tiny shapes, part b's 112 cases in a worker process
def test_quick_smoke_runs_with_ray_and_the_web_page_hidden(tmp_path):
    modules = tmp_path / "modules.json"
    out_json, out_md = tmp_path / "quick.json", tmp_path / "quick.md"
    proc = subprocess.run([sys.executable, "-c", HIDING_RUNNER, json.dumps(HIDDEN), str(modules), str(SCRIPT),
                           "--quick", "--smoke", "--json", str(out_json), "--lines", str(out_md)],
                          env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    imported = set(json.loads(modules.read_text()))
    assert not imported & set(HIDDEN), imported & set(HIDDEN)
    assert {"torch", "attnlab", "gpucheck"} <= imported  # it ran for real
    data = json.loads(out_json.read_text())
    parts = data["parts"]
    # run order: the short parts first, so that a cold GPU run's 6 minutes reach them
    assert list(parts) == ["environment", "checkpoint", "agreement", "evaluation", "kernels", "training"]
    assert all(p["status"] == "PASS" for p in parts.values()), {k: p["figures"] for k, p in parts.items()}
    assert data["verdict"] == "PASS"
    assert set(parts["environment"]["absent"]) >= {"ray", "starlette", "uvicorn", "optuna", "lm_eval"}
    # b: every registered variant (once per distinct spec, LSSAR with its p = 15) and each shipped plugin, both
    # dtypes, both lengths, in a worker process
    agreement = parts["agreement"]
    assert agreement["checked"] == len(agreement["cases"]) == agreement["variants"] * 2 * 2 and agreement["workers"]
    names = {(c["name"], c["p"]) for c in agreement["cases"]}
    assert {("lssar", 15.0), ("lssa", None), ("softmax", 15.0), ("fox", None), ("stickbreaking", None)} <= names
    assert all(c["error"] < c["tolerance"] for c in agreement["cases"] if c["judged"])
    # d: the production step twice from the same state gives the same losses; e: graphs counted; f: streams go on
    assert all(r["identical"] for r in parts["training"]["rows"])
    assert parts["evaluation"]["graphs"] <= parts["evaluation"]["graph_limit"]
    assert parts["checkpoint"]["loss"] == parts["checkpoint"]["expected_loss"]
    lines = out_md.read_text().splitlines()
    assert lines[0].startswith("## Quick GPU check") and "| part | verdict | figures | seconds |" in lines
    assert [ln.split(" | ")[0] for ln in lines if ln.startswith("| ") and " | PASS | " in ln] == [
        "| a. environment", "| f. checkpoint", "| b. fused vs reference", "| e. evaluation",
        "| c. kernel speed and memory", "| d. training"]
    assert "b. fused vs reference: PASS" in proc.stdout


def test_a_killed_quick_check_keeps_the_parts_that_ended(tmp_path):
    out_json, out_md = tmp_path / "quick.json", tmp_path / "quick.md"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--quick", "--smoke", "--parts", "environment,agreement",
                             "--json", str(out_json), "--lines", str(out_md)], env=_env(), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # part a ends within seconds; b takes tens of seconds
            if out_json.exists() and "environment" in json.loads(out_json.read_text())["parts"]:
                break
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its workers, as a time limit's kill would
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    data = json.loads(out_json.read_text())  # whole: it is replaced atomically after each part
    assert list(data["parts"]) == ["environment"] and data["parts"]["environment"]["status"] == "PASS"
    assert "verdict" not in data  # the run did not end
    assert [ln for ln in out_md.read_text().splitlines() if ln.startswith("| a. environment | PASS |")]


def test_a_part_that_raises_is_one_fail_line_and_the_next_part_runs(gc, tmp_path):
    h = gc.harness
    ctx = h.Context(gc.sizes.QUICK_SMOKE, torch.device("cpu"), h.Clock(1e9), None)
    recorder = h.Recorder(tmp_path / "q.json", tmp_path / "q.md", {})

    def broken(ctx):
        raise RuntimeError("the kernel said no\nsecond line")

    first = h.run_part(ctx, recorder, "one", "x. broken", 10, broken)
    second = h.run_part(ctx, recorder, "two", "y. fine", 10, lambda ctx: h.Outcome(h.PASS, "all good"))
    assert (first.status, first.figures) == ("FAIL", "RuntimeError: the kernel said no")
    assert second.status == "PASS"
    data = json.loads((tmp_path / "q.json").read_text())
    assert data["parts"]["one"]["status"] == "FAIL" and "Traceback" in data["parts"]["one"]["traceback"]
    assert (tmp_path / "q.md").read_text().splitlines()[0].startswith("| x. broken | FAIL | RuntimeError")
    late = h.Context(ctx.sizes, ctx.device, h.Clock(0), None)  # the run's total spent: the part is not started
    time.sleep(0.01)
    assert h.run_part(late, recorder, "three", "z. late", 10, broken).status == "SKIP"


def test_evaluation_scores_with_eager_blocks_when_the_compiled_graph_fails(gc, monkeypatch):
    """torch 2.11's inductor failed to lower the compiled LSSAR evaluation graph on an H200: the part says so, with
    the fix (eval.compile: false), and still measures the cells with the blocks eager. The failed model is gone by
    then: an H100 measured its weights, pinned by the exception's traceback, in every eager cell's peak."""
    import gc as garbage
    import weakref

    from attnlab.model import is_compiled

    ev = gc.evaluation
    calls, first = [], []
    real = ev._score_cells

    def score(ctx, model, rows, problems):
        calls.append(is_compiled(model.blocks[0]))
        if len(calls) == 1:
            first.append(weakref.ref(model))
            raise RuntimeError("LoweringException: AssertionError: " + ev.KNOWN_LOWERING_FAILURE)
        garbage.collect()
        assert first[0]() is None, "the model whose compile failed is still alive while the eager one scores"
        return real(ctx, model, rows, problems)

    monkeypatch.setattr(ev, "_score_cells", score)
    ctx = gc.harness.Context(gc.sizes.QUICK_SMOKE, torch.device("cpu"), gc.harness.Clock(1e9), "eager")
    outcome = ev.evaluation(ctx)
    assert calls == [True, False]  # compiled first, then eager blocks
    assert outcome.status == "FAIL" and "eval.compile: false" in outcome.figures
    assert "blocks eager after the compile failed" in outcome.figures
    rows = outcome.data["rows"]
    assert len(rows) == len(ctx.sizes.eval_multiples) * len(ctx.sizes.eval_p) and all("loss" in r for r in rows)


def test_a_gradient_over_the_tolerance_is_held_to_the_dense_form_in_its_dtype(gc):
    """The rule of part b for errors that are the dtype's (bench/gpucheck/agreement.py): on an H100, relu_shen's dk
    at 4,096 tokens in float32 was 1.7e-3 off, over the 1e-3 tolerance; the dense float32 form on the same inputs
    is 1.5e-3 off (ReLU's derivative jumps at 0 and float32 flips two scores). Within 4x the dense form's error a
    tensor is at the floor; beyond it, or with no dense figure, it fails."""
    off, at_floor = gc.agreement.judge({"dq": 5e-4, "dk": 1.7e-3, "dv": 9e-3}, 1e-3,
                                       {"dq": 4e-7, "dk": 1.5e-3, "dv": 1e-3})
    assert (off, at_floor) == (["dv"], ["dk"])  # dq within the tolerance; dv over 4x its floor
    assert gc.agreement.judge({"dk": 1.7e-3}, 1e-3, None) == (["dk"], [])
    assert gc.agreement.judge({"dk": 1.7e-3}, 1e-3, {"dk": 1e-6}) == (["dk"], [])


def test_a_case_over_its_tolerance_measures_the_dense_form_and_says_so(gc, monkeypatch):
    """The plumbing of that rule, on CPU at 64 tokens with the float32 tolerance set to 0 (every error is over it):
    the dense float32 form runs on the same inputs, each tensor is at the floor or named in the failure with the
    dense form's figure. (The H100's case itself, relu_shen at 4,096 tokens, hangs on where float32 rounds two of
    33.6M scores, which differs between CPUs: bench/results/2026-11-26-h100-quick.md gives the command that
    measures it.)"""
    import dataclasses

    monkeypatch.setitem(gc.agreement.TOLERANCE, torch.float32, 0.0)
    sizes = dataclasses.replace(gc.sizes.QUICK_SMOKE, agree_heads=2, head_dim=16)
    row = gc.agreement.check_case(sizes, torch.device("cpu"), 64, "float32", "relu_shen", None)
    assert row["form"] == "fused" and set(row["dense_errors"]) == set(row["errors"]) == {"out", "dq", "dk", "dv"}
    over = {n for n, e in row["errors"].items() if e > 0}
    at_floor = set(row["at_floor"])
    assert at_floor <= over and all(row["errors"][n] <= 4 * row["dense_errors"][n] for n in at_floor)
    if over - at_floor:
        assert "the dense float32 form:" in row["failure"], row
    else:
        assert "failure" not in row and row["error"] == 0.0
    assert all(f"{n} {row['errors'][n]:.1e} at float32's floor" in gc.agreement._line(row) for n in at_floor)


@pytest.mark.slow  # ~35 s of CPU, minutes of wall time on a loaded 2-core machine
def test_smoke_run_end_to_end(bench, gc, tmp_path, capsys):
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# Benchmark results\n")
    out_json = tmp_path / "gpu.json"
    rc = bench.main(["--smoke", "--parts", "plan,attention,train,eval,variants,determinism,recompiles", "--append",
                     "--results", str(results_md), "--json", str(out_json)])
    assert rc == 0
    printed = capsys.readouterr().out
    data = json.loads(out_json.read_text())
    # attention: each variant and backend at each length (the Triton kernels under Triton's interpreter here, as the
    # test session runs it), with a time and its ratio to SDPA
    assert [(r["T"], r["variant"], r["backend"]) for r in data["attention"]] == [
        (T, v, b) for T in gc.sizes.SMOKE.att_lengths for v, _, b in gc.kernels.KERNEL_METHODS]
    assert all(r["ms"] > 0 and r["x_time"] > 0 for r in data["attention"])
    # the memory plan: a training and an evaluation estimate per variant, growing with the evaluation length
    plan = data["plan"]
    assert [(r["step"], r["variant"]) for r in plan] == [
        (step, v) for v in ("softmax", "lssa", "lssar") for step in ["train"] + ["eval"] * len(gc.sizes.SMOKE.eval_multiples)]
    assert all(r["estimate_gib"] > r["tensor_gib"] > 0 and r["fits"] is None for r in plan)  # CPU: nothing to fit
    # training: the three variants, finite, with tokens/s at the largest micro-batch tried
    assert [r["variant"] for r in data["train"]] == ["softmax", "lssa", "lssar"]
    assert all(r["tokens_per_s"] > 0 and r["loss_finite"] and r["micro_batch"] == gc.sizes.SMOKE.max_micro_batch
               for r in data["train"])
    assert all(r["mfu"] is None for r in data["train"])  # CPU: no peak figure, never a made-up MFU
    assert all(r["estimate_gib"] > 0 and r["peak_gib"] is None and r["peak_vs_estimate"] is None
               for r in data["train"] + data["eval"])  # the estimate beside a peak only a GPU measures
    # evaluation: both multiples for each variant
    assert len(data["eval"]) == 3 * len(gc.sizes.SMOKE.eval_multiples)
    assert all(r["tokens_per_s"] > 0 and r["finite"] for r in data["eval"])
    # every distinct variant trained; none failed unexpectedly
    assert [(r["variant"], r["p"]) for r in data["variants"]] == gc.variants.check_cases()
    assert not [r for r in data["variants"] if r["verdict"] == "UNEXPECTED failure"], data["variants"]
    # the four targets, measured or not, never asserted
    assert len(data["targets"]) == 4
    met = [t["met"] for t in data["targets"]]
    assert met[0] is None and met[2] is None  # CPU: no peak memory, no llm.c figure
    assert isinstance(met[1], bool) and isinstance(met[3], bool)  # the ratios are measured, whatever they are
    text = results_md.read_text()
    assert text.startswith("# Benchmark results\n\n## The full GPU run (`bench/gpu.py --smoke`): CPU: ")
    assert "### Targets" in text
    # LSSAR run twice: bit-identical attention gradients and training steps; the p_eval sweep's graphs counted
    assert [(r["check"], r["identical"]) for r in data["determinism"]] == [("attention", True), ("training", True)]
    (sweep,) = data["recompiles"]
    assert sweep["graphs"] == sweep["limit"] == 2 * len(gc.sizes.SWEEP_MULTIPLES) and len(sweep["p_eval"]) == 11
    assert [r["part"] for r in data["summary"]] == ["plan", "attention", "train", "eval", "variants", "determinism",
                                                    "recompiles"]
    assert "lssar step" in next(r["detail"] for r in data["summary"] if r["part"] == "train")
    assert all(r["verdict"] == "PASSED" for r in data["summary"]), data["summary"]
    assert "### What passed and what did not" in text and "- train: **PASSED**" in text
    assert "| lssar p=15 | flex |" in text and text.strip().endswith("min.")
    assert "## The full GPU run" in printed


def test_a_run_appends_to_its_dated_log(gc):
    """bench/RESULTS.md holds the latest figures of each benchmark; a GPU run's whole section goes to a log named by
    its date, GPU and kind, a second run of the day below the first."""
    h100 = {"device": "NVIDIA H100 80GB HBM3, 79 GiB, 132 SMs", "driver": "580.159.04",
            "date": "2026-11-26T20:10:00+00:00"}
    assert gc.harness.run_log(h100, "quick") == ROOT / "bench" / "results" / "2026-11-26-h100-quick.md"
    h200 = dict(h100, device="NVIDIA H200, 140 GiB, 132 SMs")
    assert gc.harness.run_log(h200, "full").name == "2026-11-26-h200-full.md"
    cpu = {"device": "CPU: AMD EPYC, 2 cores, 24 GiB", "driver": None, "date": "2026-11-29T01:00:00+00:00"}
    assert gc.harness.run_log(cpu, "quick").name == "2026-11-29-cpu-quick.md"


def test_smoke_does_not_append_unless_asked(bench, tmp_path, capsys):
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("x\n")
    assert bench.main(["--smoke", "--parts", "attention", "--results", str(results_md)]) == 0
    assert results_md.read_text() == "x\n"
    printed = capsys.readouterr().out
    assert "appended" not in printed and "| 32 | lssar p=15 | flex |" in printed


def test_an_expired_clock_skips_every_item(gc):
    rows = gc.kernels.bench_attention(gc.sizes.SMOKE, torch.device("cpu"), gc.harness.Clock(total_s=0))
    assert len(rows) == len(gc.kernels.KERNEL_METHODS)
    assert all(r["skipped"] == "time budget" and r["ms"] is None for r in rows)
    assert gc.report.targets({"attention": rows}, torch.device("cpu"))[1]["met"] is None


def test_micro_batch_search_halves_on_out_of_memory(gc):
    tried = []

    def run(b):
        tried.append(b)
        if b > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return f"ran {b}"

    assert gc.training.largest_fitting(run, 64, torch.device("cpu")) == (8, "ran 8", [64, 32, 16])
    assert tried == [64, 32, 16, 8]
    wrapped = RuntimeError("compile failed")
    wrapped.__cause__ = torch.OutOfMemoryError("out of memory")
    assert gc.harness.is_oom(wrapped) and not gc.harness.is_oom(ValueError("shape"))

    def broken(b):
        raise ValueError("not an OOM")

    with pytest.raises(ValueError, match="not an OOM"):
        gc.training.largest_fitting(broken, 4, torch.device("cpu"))


def test_cuda_test_runner_reports_the_summary(gc, tmp_path):
    (tmp_path / "test_fake.py").write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_on_gpu():\n    pass\n\ndef test_on_cpu():\n    pass\n")
    result = gc.pytests.run_cuda_tests([str(tmp_path / "test_fake.py")], timeout_s=240)
    assert result["rc"] == 0 and "1 passed" in result["summary"] and "1 deselected" in result["summary"]


def test_summary_names_what_failed(gc):
    results = {
        "proxy": {"rc": 1, "summary": "1 failed, 20 passed"},
        "plan": [{"step": "train", "variant": "lssar", "T": 1024, "batch": 64, "estimate_gib": 52.9, "fits": False},
                 {"step": "eval", "variant": "lssar", "T": 16384, "batch": 1, "estimate_gib": 3.0, "fits": True}],
        "train": [{"variant": "softmax", "tokens_per_s": 1.0, "peak_vs_estimate": 1.1},
                  {"variant": "lssar", "error": "OOM at micro-batch 1"}],
        "eval": [{"variant": "softmax", "T": 1024, "skipped": "time budget"}],
        "variants": [{"variant": "relu_l1", "p": None, "backend": "flex", "verdict": "as expected", "failure": None},
                     {"variant": "softmax", "p": 15.0, "backend": "flex", "verdict": "UNEXPECTED failure",
                      "failure": "loss nan at step 2"}],
        "determinism": [{"check": "attention", "differences": ["dq (max |diff| 3.0e-03)"], "identical": False},
                        {"check": "training", "differences": [], "identical": True}],
        "recompiles": [{"lengths": [1, 2, 3, 4, 5], "p_eval": [None] * 11, "limit": 10, "graphs": 55}],
    }
    rows = {r["part"]: r for r in gc.report.summary(results)}
    assert rows["proxy"] == {"part": "proxy", "verdict": "FAILED", "detail": "1 failed, 20 passed"}
    assert rows["plan"]["verdict"] == "FAILED" and "train lssar T=1024 batch 64 needs 52.9 GiB" in rows["plan"]["detail"]
    assert rows["train"]["verdict"] == "FAILED" and rows["train"]["detail"] == "lssar: OOM at micro-batch 1"
    assert rows["eval"]["verdict"] == "INCOMPLETE"
    assert rows["variants"]["verdict"] == "FAILED" and rows["variants"]["detail"] == "softmax p=15: loss nan at step 2"
    assert rows["determinism"] == {"part": "determinism", "verdict": "FAILED",
                                   "detail": "attention differs (dq (max |diff| 3.0e-03))"}
    assert rows["recompiles"]["verdict"] == "FAILED" and "55 graphs for 11 p_eval x 5 lengths" in rows["recompiles"]["detail"]


def test_targets_are_judged_from_the_figures(gc):
    results = {
        "attention": [{"T": 16384, "variant": "softmax", "backend": "sdpa", "x_time": 1.0, "x_mem": 1.0},
                      {"T": 16384, "variant": "lssar", "backend": "triton", "x_time": 2.0, "x_mem": 1.5},
                      # the FlexAttention path, timed beside the kernels that replaced it, is not judged
                      {"T": 16384, "variant": "lssar", "backend": "flex", "x_time": 70.0, "x_mem": 2.0}],
        "train": [{"variant": "softmax", "tokens_per_s": 100.0}, {"variant": "lssar", "tokens_per_s": 80.0}],
    }
    rows = gc.report.targets(results, torch.device("cpu"))
    assert [r["met"] for r in rows] == [False, True, None, True]
    assert rows[0]["figure"] == 1.5 and rows[3]["figure"] == pytest.approx(1.25)


# --- the gpu marker ------------------------------------------------------------------------------------------

def test_every_cuda_test_carries_the_gpu_marker():
    """A test that skips without CUDA must be selected by ``pytest -m gpu`` (bench/gpu.py runs that)."""
    cuda_tests, unmarked = [], []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        if "CUDA" not in path.read_text():
            continue
        module = importlib.import_module(path.stem)
        for name, fn in vars(module).items():
            if not name.startswith("test_") or not callable(fn):
                continue
            marks = getattr(fn, "pytestmark", [])
            skips_without_cuda = any(m.name == "skipif" and "CUDA" in str(m.kwargs.get("reason", ""))
                                     for m in marks)
            if skips_without_cuda:
                cuda_tests.append(f"{path.name}::{name}")
                if not any(m.name == "gpu" for m in marks):
                    unmarked.append(f"{path.name}::{name}")
    assert len(cuda_tests) >= 5, cuda_tests
    assert not unmarked, f"CUDA tests without @pytest.mark.gpu: {unmarked}"
