"""The study spec: shipped studies validate, broken ones give their one-line error, spaces expand as designed.

No Ray here: the spec is plain pydantic.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.errors import UserError
from attnlab.study.spec import load_spec, parse_objective

ROOT = Path(__file__).resolve().parents[1]
BAD = sorted((ROOT / "tests" / "studies_bad").glob("*.yaml"))
SHIPPED = sorted((ROOT / "studies").glob("*.yaml"))


def _expected(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name} must start with '# expect: <message fragment>'"
    return first[len("# expect: "):]


def test_corpora_are_there():
    assert len(BAD) >= 20
    assert {p.name for p in SHIPPED} >= {"smoke.yaml", "paper_table4.yaml", "p_sweep.yaml", "scale_factor.yaml",
                                         "proxy_table4.yaml", "proxy_text.yaml", "demo_text.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_studies_validate(path):
    spec = load_spec(path)
    assert spec.search_space().size() >= 1
    comments = " ".join(line for line in path.read_text().splitlines() if line.lstrip().startswith("#")).lower()
    assert "cost" in comments or "min" in comments or " h " in comments, \
        f"{path.name} must carry a comment with its expected cost"


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.name)
def test_broken_study_gives_its_one_line_error(path):
    with pytest.raises(UserError) as info:
        load_spec(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path) + ": ")
    assert _expected(path) in message


@pytest.mark.parametrize("name", ["unknown_attention.yaml", "yaml_syntax.yaml", "bad_engine.yaml"])
def test_cli_validate_prints_one_line_and_exits_2(name):
    path = ROOT / "tests" / "studies_bad" / name
    proc = subprocess.run([sys.executable, "-m", "attnlab.cli", "study", "validate", str(path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("attnlab: error: ") and _expected(path) in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


def test_cli_validate_good_study_prints_trials_and_resources():
    proc = subprocess.run([sys.executable, "-m", "attnlab.cli", "study", "validate", "studies/smoke.yaml"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "study smoke: engine grid, 3 trial(s)" in proc.stdout
    assert "resources per trial: 1.5 CPU, 0 GPU (1 worker(s))" in proc.stdout


def _spec(train=None, **blocks):
    return load_spec({"name": "t", "train": {"preset": "tiny", "data": "demo", **(train or {})}, **blocks})


def test_grid_expands_conditional_axes_only_where_they_apply():
    spec = _spec(space={"attention": ["softmax", "lssa", "lssar"], "p_train": {"values": [3, 15],
                                                                              "when": ["softmax", "lssa"]},
                        "seeds": [0, 1]})
    space = spec.search_space()
    points = space.grid()
    # softmax x {3, 15} x 2 seeds + lssa x {3, 15} x 2 seeds + lssar x 2 seeds = 4 + 4 + 2
    assert len(points) == space.size() == 10
    assert {"attention": "lssar", "seed": 1} in points
    assert {"attention": "softmax", "p_train": 15, "seed": 0} in points
    assert not any(p["attention"] == "lssar" and "p_train" in p for p in points)
    cfg = space.config({"attention": "lssa", "p_train": 15, "seed": 1})
    assert (cfg.attention, cfg.p_train, cfg.seed, cfg.preset, cfg.data) == ("lssa", 15.0, 1, "tiny", "demo")


def test_random_points_are_seeded_and_respect_ranges():
    blocks = dict(search={"engine": "random", "num_samples": 6, "seed": 3},
                  space={"attention": ["softmax", "lssa"], "scale": {"low": 1.0, "high": 8.0, "when": ["softmax"]},
                         "p_train": {"low": 1, "high": 63, "when": ["lssa"]}})
    a, b = _spec(**blocks).search_space().sampled(), _spec(**blocks).search_space().sampled()
    assert a == b and len(a) == 6
    for p in a:
        if p["attention"] == "softmax":
            assert set(p) == {"attention", "scale"} and 1.0 <= p["scale"] <= 8.0 and isinstance(p["scale"], float)
        else:
            assert set(p) == {"attention", "p_train"} and 1 <= p["p_train"] <= 63 and isinstance(p["p_train"], int)


def test_the_study_embeds_the_training_config_and_its_resources():
    spec = _spec(train={"tokens": 10_000, "tokens_per_step": 1024, "micro_batch": 8, "workers": 2, "gpus_per_worker": 1,
                        "cpus_per_worker": 4},
                 resources={"max_concurrent_trials": 3})
    cfg = spec.search_space().config({})
    assert cfg.steps == 10  # ceil(10000 / 1024)
    assert (cfg.workers, cfg.gpu, cfg.gpus_per_worker, cfg.cpus_per_worker) == (2, True, 1.0, 4.0)
    assert spec.resource_request() == {"workers": 2, "gpus_per_worker": 1.0, "cpus_per_worker": 4.0,
                                       "max_concurrent_trials": 3, "trial_cpus": 0.5}
    assert spec.train == cfg.model_copy(update={"data": "demo"})  # the same type, no remapping


def test_p_train_says_what_it_means():
    """none/off is no sharpening for every variant (lssar included); default is the variant's own power."""
    spec = _spec(space={"attention": ["lssa", "lssar"], "p_train": [False, "default", 3, None]})
    space = spec.search_space()
    powers = {(p["attention"], str(p["p_train"])): space.config(p).gpt_config().attention_spec().p
              for p in space.grid()}
    assert powers[("lssar", "False")] is None and powers[("lssar", "None")] is None
    assert powers[("lssar", "default")] == 15.0 and powers[("lssa", "default")] is None
    assert powers[("lssar", "3")] == 3.0
    off = load_spec({"name": "t", "train": {"preset": "tiny", "data": "demo", "attention": "lssar", "p_train": "none"}})
    assert off.train.gpt_config().attention_spec().p is None


def test_objective_syntax():
    sixteen = parse_objective("val_loss@16x")
    assert sixteen.as_dict() == {"metric": "val_loss", "multiple": 16.0, "length": None, "p_eval": None, "rope": None,
                                 "key": "val_loss@16x"}
    assert sixteen.eval_len(64) == 1024  # the multiple resolved at the training length
    parsed = parse_objective("val_loss@16k,p_eval=15,rope=none")
    assert (parsed.length, parsed.p_eval, parsed.rope, parsed.eval_len(64)) == (16384, 15.0, "none", 16384)
    assert parsed.key == "val_loss@16k,p_eval=15,rope=none"
    spec = _spec(search={"engine": "optuna", "num_samples": 2},
                 objective=["val_loss@1x", {"metric": "passkey_acc@4x", "mode": "max"}],
                 eval={"multiples": [1, 4], "passkey": True})
    assert [(o.key, o.mode) for o in spec.objective] == [("val_loss@1x", "min"), ("passkey_acc@4x", "max")]


def test_the_search_fingerprint_ignores_the_evaluation():
    a = _spec(space={"attention": ["lssa"]}, eval={"p_eval": ["none"]})
    b = _spec(space={"attention": ["lssa"]}, eval={"p_eval": ["none", 3], "multiples": [1, 2, 4, 8, 16, 32]})
    c = _spec(space={"attention": ["lssa", "softmax"]})
    assert a.search_fingerprint() == b.search_fingerprint() != c.search_fingerprint()


def test_searched_knobs_label_rows_so_reports_never_average_them_as_seeds():
    import pandas as pd

    from attnlab.results import reports
    from attnlab.study.trial import knob_label

    spec = _spec(space={"attention": ["softmax"], "lr": [1e-3, 3e-3], "seeds": [0, 1]})
    labels = sorted({knob_label(spec, p) for p in spec.search_space().grid()})
    assert labels == ["lr=0.001", "lr=0.003"]
    assert knob_label(_spec(space={"attention": ["softmax", "lssa"]}), {"attention": "lssa"}) is None
    rows = [dict(study="t", attention="softmax", knobs=k, seed=s, eval_len=64, train_len=64, metric="val_loss", value=v,
                 step=10, trial=f"{k}-{s}", scale="inv_sqrt_d", p_train=None, p_eval=None, rope_scaling="ntk",
                 window_mode="nonoverlap", layer=None, bucket=None, preset="tiny", data="demo", train_key=f"{k}-{s}")
            for k, s, v in [("lr=0.001", 0, 5.0), ("lr=0.001", 1, 5.2), ("lr=0.003", 0, 4.0), ("lr=0.003", 1, 4.4)]]
    table = reports.table(pd.DataFrame(rows))
    assert list(table["knobs"]) == ["lr=0.001", "lr=0.003"]
    assert list(table["mean@64"]) == pytest.approx([5.1, 4.2])


def test_validate_refuses_a_local_data_folder_that_is_not_there(tmp_path, capsys):
    """Every trial would fail on it; `study validate` says so in one line (with --cluster the folder is the cluster's)."""
    from attnlab.cli import main

    study = tmp_path / "s.yaml"
    study.write_text(f"name: x\ntrain: {{preset: tiny, data: {tmp_path / 'nowhere'}, steps: 10}}\n")
    assert main(["study", "validate", str(study)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"attnlab: error: {study}: train.data='{tmp_path / 'nowhere'}': {tmp_path / 'nowhere'} does not exist; "
                   f"prepare it first (attnlab data prepare --out {tmp_path / 'nowhere'}), or check a cluster's study "
                   "with --cluster")
    (tmp_path / "nowhere").mkdir()
    assert main(["study", "validate", str(study)]) == 2
    assert "holds no manifest.json" in capsys.readouterr().err
    (tmp_path / "nowhere" / "manifest.json").write_text("{}")
    assert main(["study", "validate", str(study)]) == 0
