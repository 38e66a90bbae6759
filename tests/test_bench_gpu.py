"""``bench/gpu.py``: its CPU smoke run end to end (so the GPU command cannot rot), its refusal without a GPU,
the pieces it is built from, and the ``gpu`` marker on every CUDA test (``pytest -m gpu`` finds them all).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_gpu", None)


def _env(**extra):
    return dict(os.environ, PYTHONPATH=str(ROOT / "platform"), **extra)


def test_without_a_gpu_it_exits_2_with_one_line():
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=_env(CUDA_VISIBLE_DEVICES=""), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "needs a CUDA GPU" in proc.stderr and "--smoke" in proc.stderr
    assert proc.stdout == ""


def test_bad_parts_are_named(bench, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--smoke", "--parts", "attention,speed"])
    assert info.value.code == 2
    assert "--parts='speed' is not allowed" in capsys.readouterr().err


@pytest.mark.slow  # ~35 s of CPU, minutes of wall time on a loaded 2-core machine
def test_smoke_run_end_to_end(bench, tmp_path, capsys):
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# Benchmark results\n")
    out_json = tmp_path / "gpu.json"
    rc = bench.main(["--smoke", "--parts", "plan,attention,train,eval,variants,determinism,recompiles", "--append",
                     "--results", str(results_md), "--json", str(out_json)])
    assert rc == 0
    printed = capsys.readouterr().out
    data = json.loads(out_json.read_text())
    # attention: each variant at each length, with a time and its ratio to SDPA
    assert [(r["T"], r["variant"]) for r in data["attention"]] == [
        (T, v) for T in bench.SMOKE.att_lengths for v in ("softmax", "lssa", "lssar")]
    assert all(r["ms"] > 0 and r["x_time"] > 0 for r in data["attention"])
    # the memory plan: a training and an evaluation estimate per variant, growing with the evaluation length
    plan = data["plan"]
    assert [(r["step"], r["variant"]) for r in plan] == [
        (step, v) for v in ("softmax", "lssa", "lssar") for step in ["train"] + ["eval"] * len(bench.SMOKE.eval_multiples)]
    assert all(r["estimate_gib"] > r["tensor_gib"] > 0 and r["fits"] is None for r in plan)  # CPU: nothing to fit
    # training: the three variants, finite, with tokens/s at the largest micro-batch tried
    assert [r["variant"] for r in data["train"]] == ["softmax", "lssa", "lssar"]
    assert all(r["tokens_per_s"] > 0 and r["loss_finite"] and r["micro_batch"] == bench.SMOKE.max_micro_batch
               for r in data["train"])
    assert all(r["mfu"] is None for r in data["train"])  # CPU: no peak figure, never a made-up MFU
    assert all(r["estimate_gib"] > 0 and r["peak_gib"] is None and r["peak_vs_estimate"] is None
               for r in data["train"] + data["eval"])  # the estimate beside a peak only a GPU measures
    # evaluation: both multiples for each variant
    assert len(data["eval"]) == 3 * len(bench.SMOKE.eval_multiples)
    assert all(r["tokens_per_s"] > 0 and r["finite"] for r in data["eval"])
    # every distinct variant trained; none failed unexpectedly
    assert [(r["variant"], r["p"]) for r in data["variants"]] == bench.check_cases()
    assert not [r for r in data["variants"] if r["verdict"] == "UNEXPECTED failure"], data["variants"]
    # the four targets, measured or not, never asserted
    assert len(data["targets"]) == 4
    met = [t["met"] for t in data["targets"]]
    assert met[0] is None and met[2] is None  # CPU: no peak memory, no llm.c figure
    assert isinstance(met[1], bool) and isinstance(met[3], bool)  # the ratios are measured, whatever they are
    text = results_md.read_text()
    assert text.startswith("# Benchmark results\n") and "## GPU path" in text and "### Targets" in text
    # LSSAR run twice: bit-identical attention gradients and training steps; the p_eval sweep's graphs counted
    assert [(r["check"], r["identical"]) for r in data["determinism"]] == [("attention", True), ("training", True)]
    (sweep,) = data["recompiles"]
    assert sweep["graphs"] == sweep["limit"] == 2 * len(bench.SWEEP_MULTIPLES) and len(sweep["p_eval"]) == 11
    assert [r["part"] for r in data["summary"]] == ["plan", "attention", "train", "eval", "variants", "determinism",
                                                    "recompiles"]
    assert "lssar step" in next(r["detail"] for r in data["summary"] if r["part"] == "train")
    assert all(r["verdict"] == "PASSED" for r in data["summary"]), data["summary"]
    assert "### What passed and what did not" in text and "- train: **PASSED**" in text
    assert "| lssar p=15 | flex |" in text and text.strip().endswith("min.")
    assert "## GPU path" in printed


def test_smoke_does_not_append_unless_asked(bench, tmp_path, capsys):
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("x\n")
    assert bench.main(["--smoke", "--parts", "attention", "--results", str(results_md)]) == 0
    assert results_md.read_text() == "x\n"
    printed = capsys.readouterr().out
    assert "appended" not in printed and "| 32 | lssar p=15 | flex |" in printed


def test_an_expired_clock_skips_every_item(bench):
    rows = bench.bench_attention(bench.SMOKE, torch.device("cpu"), bench.Clock(total_s=0))
    assert len(rows) == 3 and all(r["skipped"] == "time budget" and r["ms"] is None for r in rows)
    assert bench.targets({"attention": rows}, torch.device("cpu"))[1]["met"] is None


def test_micro_batch_search_halves_on_out_of_memory(bench):
    tried = []

    def run(b):
        tried.append(b)
        if b > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return f"ran {b}"

    assert bench.largest_fitting(run, 64, torch.device("cpu")) == (8, "ran 8", [64, 32, 16])
    assert tried == [64, 32, 16, 8]
    wrapped = RuntimeError("compile failed")
    wrapped.__cause__ = torch.OutOfMemoryError("out of memory")
    assert bench.is_oom(wrapped) and not bench.is_oom(ValueError("shape"))

    def broken(b):
        raise ValueError("not an OOM")

    with pytest.raises(ValueError, match="not an OOM"):
        bench.largest_fitting(broken, 4, torch.device("cpu"))


def test_cuda_test_runner_reports_the_summary(bench, tmp_path):
    (tmp_path / "test_fake.py").write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_on_gpu():\n    pass\n\ndef test_on_cpu():\n    pass\n")
    result = bench.run_cuda_tests([str(tmp_path / "test_fake.py")], timeout_s=240)
    assert result["rc"] == 0 and "1 passed" in result["summary"] and "1 deselected" in result["summary"]


def test_summary_names_what_failed(bench):
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
    rows = {r["part"]: r for r in bench.summary(results)}
    assert rows["proxy"] == {"part": "proxy", "verdict": "FAILED", "detail": "1 failed, 20 passed"}
    assert rows["plan"]["verdict"] == "FAILED" and "train lssar T=1024 batch 64 needs 52.9 GiB" in rows["plan"]["detail"]
    assert rows["train"]["verdict"] == "FAILED" and rows["train"]["detail"] == "lssar: OOM at micro-batch 1"
    assert rows["eval"]["verdict"] == "INCOMPLETE"
    assert rows["variants"]["verdict"] == "FAILED" and rows["variants"]["detail"] == "softmax p=15: loss nan at step 2"
    assert rows["determinism"] == {"part": "determinism", "verdict": "FAILED",
                                   "detail": "attention differs (dq (max |diff| 3.0e-03))"}
    assert rows["recompiles"]["verdict"] == "FAILED" and "55 graphs for 11 p_eval x 5 lengths" in rows["recompiles"]["detail"]


def test_targets_are_judged_from_the_figures(bench):
    results = {
        "attention": [{"T": 16384, "variant": "softmax", "x_time": 1.0, "x_mem": 1.0},
                      {"T": 16384, "variant": "lssar", "x_time": 2.0, "x_mem": 1.5}],
        "train": [{"variant": "softmax", "tokens_per_s": 100.0}, {"variant": "lssar", "tokens_per_s": 80.0}],
    }
    rows = bench.targets(results, torch.device("cpu"))
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
