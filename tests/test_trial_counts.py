"""One real trial, counted: each process that uses the data opens it once, and the training config reaches the
Train worker as the object it is (no dict read back on the way). The counts come from bench/structure.py's hook
(a ``sitecustomize`` every process of the study's embedded Ray loads), so the bench's figures and this test are
one measurement."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_structure", ROOT / "bench" / "structure.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.ray
def test_one_trial_opens_its_data_once_per_process_and_reads_back_no_dumped_config(tmp_path):
    bench = _bench()
    events = bench.count_study(ROOT / "platform", tmp_path)
    summary = bench.summarise(events)
    roles = summary["roles"]
    opens = {name: row["data_opens"] for name, row in roles.items()}
    assert opens == {"study driver": 1, "Train worker": 1, "evaluation task": 1, **(
        {"Tune trial": 0} if "Tune trial" in roles else {})}, roles
    assert summary["max_opens_in_one_process"] == 1
    # the trial's processes never validate a dumped config again; the driver reads none back either for a fresh study
    trial_side = {name: row["round_trips"] for name, row in roles.items() if name != "study driver"}
    assert set(trial_side.values()) == {0}, roles
    assert roles["Train worker"]["validations"] == 0, roles  # the worker receives the TrainConfig itself


@pytest.mark.ray
def test_a_trial_that_trains_in_its_own_process_opens_the_data_there_once(tmp_path):
    """The default one-worker CPU trial: training and evaluation in the Tune trial's process, which opens the data
    once for both; no Train worker, no evaluation task."""
    bench = _bench()
    summary = bench.summarise(bench.count_study(ROOT / "platform", tmp_path, study=bench.STUDY_IN_TRIAL))
    roles = summary["roles"]
    assert {name: row["data_opens"] for name, row in roles.items()} == {"study driver": 1, "Tune trial": 1}, roles
    assert summary["max_opens_in_one_process"] == 1 and roles["Tune trial"]["round_trips"] == 0, roles
