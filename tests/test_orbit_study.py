"""The orbit study through the platform's own path: a config naming {synthetic: orbits} trains an OrbitGPT with
the training loop, its checkpoint loads back as one, evaluation writes coordinate-error and force-probe rows
(with the recovered expression) to a results store, and `attnlab results laws` shows the law per variant and
seed. Real tokens from the simulator, a real Parquet store; the full study is `studies/orbits.yaml`."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from attnlab.cli import main
from attnlab.data.source import open_data
from attnlab.evaluate.extrapolation import evaluate_checkpoint
from attnlab.evaluate.force_probe import FORCE_METRICS
from attnlab.evaluate.plan import EvalConfig
from attnlab.model import OrbitGPT
from attnlab.model.checkpoint import load_model
from attnlab.results import ResultsStore
from attnlab.results import reports

SMALL = {"synthetic": "orbits", "size": "cpu", "block_systems": 10, "n_train_systems": 40, "n_val_systems": 20}
FAST_PROBE = {"kind": "finetune", "n_train": 12, "n_test": 6, "steps": 3, "batch_size": 6, "n_points": 200,
              "population": 200, "generations": 3, "restarts": 1}


@pytest.fixture(scope="module")
def orbit_run(tmp_path_factory):
    from attnlab.train import load_train_config
    from attnlab.train.loop import LocalSession, train_worker

    run_dir = tmp_path_factory.mktemp("orbit-run") / "run"
    cfg = load_train_config(dict(preset="tiny", data=SMALL, seq_len=32, steps=6, tokens_per_step=256,
                                 micro_batch=8, val_every=6, val_tokens=256, log_every=3, checkpoint_every=6,
                                 warmup_steps=1, lr=3e-3, attention="lssar"))
    last = train_worker(cfg, LocalSession(run_dir, device="cpu"), run_dir)
    return run_dir, cfg, last


def test_a_training_config_naming_orbits_trains_an_orbit_model(orbit_run):
    run_dir, cfg, last = orbit_run
    assert last["step"] == 6 and math.isfinite(last["train_loss"]) and math.isfinite(last["val_loss"])
    assert 0 <= last["val_acc"] <= 1
    model, train_config, meta = load_model(run_dir)
    assert isinstance(model, OrbitGPT) and model.cfg.channels == 2
    assert model.cfg.vocab_size == open_data(SMALL).vocab_size and model.cfg.attention == "lssar"
    assert train_config["data"] == SMALL and meta["step"] == 6


def test_evaluating_the_run_stores_errors_and_the_recovered_law(orbit_run, tmp_path, capsys):
    run_dir, cfg, _ = orbit_run
    store = ResultsStore(tmp_path / "results")
    config = EvalConfig(multiples=[1, 2], rope_scaling="none", max_tokens=256, force_probe=FAST_PROBE)
    rows = evaluate_checkpoint(run_dir, config, context={"study": "orbits_test"}, store=store)
    stored = store.read(study="orbits_test")
    assert len(stored) == len(rows)
    metrics = set(stored["metric"])
    assert {"val_loss", "acc", "coord_err", "coord_err_au", "loss_bucket", *FORCE_METRICS} <= metrics
    law_rows = stored[stored["metric"] == "force_newton_dist"]
    assert len(law_rows) == 1 and isinstance(law_rows["expression"].iloc[0], str)
    assert stored[stored["metric"] != "force_newton_dist"]["expression"].isna().all()

    # evaluating again measures nothing: every cell (the force probe's included) is keyed
    again = evaluate_checkpoint(run_dir, config, context={"study": "orbits_test"}, store=store,
                                skip=store.stored_eval_keys("orbits_test", rows[0]["train_key"]))
    assert again == []

    table = reports.laws(stored)
    assert list(table["attention"]) == ["lssar"] and list(table["probe"]) == ["finetune"]
    assert table["expression"].iloc[0] == law_rows["expression"].iloc[0]
    assert table["newton"].iloc[0] in (0.0, 1.0) and np.isfinite(table["exp_r"].iloc[0])

    assert main(["results", "laws", "--store", str(tmp_path / "results"), "--study", "orbits_test"]) == 0
    out = capsys.readouterr().out
    assert "| attention | seed | probe | expression |" in out and law_rows["expression"].iloc[0] in out
    assert "lssar: Newton's law (exponents -2, 1, 1 within tolerance) recovered in" in out


def test_laws_on_a_store_without_force_rows_is_a_one_line_error(orbit_run, tmp_path, capsys):
    run_dir, _, _ = orbit_run
    store = tmp_path / "results"
    evaluate_checkpoint(run_dir, EvalConfig(multiples=[1], max_tokens=64), context={"study": "plain"},
                        store=str(store))
    assert main(["results", "laws", "--store", str(store), "--study", "plain"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "force_newton_dist" in err[0]


def test_rows_written_before_the_expression_column_still_read(tmp_path):
    """A version-2 file (no expression column) reads with expression null next to version-3 rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from attnlab.results.schema import ARROW_SCHEMA, validate_row

    row = validate_row(dict(study="old", trial="t", attention="softmax", scale="inv_sqrt_d", rope_scaling="none",
                            step=1, tokens=1, eval_len=32, train_len=32, window_mode="nonoverlap", metric="val_loss",
                            value=1.0, seed=0, train_key="0" * 16, git_sha="unknown"))
    old_fields = [f for f in ARROW_SCHEMA if f.name != "expression"]
    table = pa.Table.from_pylist([{k: v for k, v in row.items() if k != "expression"} | {"schema_version": 2}],
                                 schema=pa.schema(old_fields))
    (tmp_path / "study=old").mkdir(parents=True)
    pq.write_table(table, tmp_path / "study=old" / "part-old.parquet")
    frame = ResultsStore(tmp_path).read(study="old")
    assert len(frame) == 1 and pd.isna(frame["expression"].iloc[0])


def test_attnlab_eval_takes_a_force_probe_flag(orbit_run, capsys):
    from attnlab.cli import build_parser
    from attnlab.evaluate.cli import eval_config_from_args

    run_dir, _, _ = orbit_run
    args = build_parser().parse_args(["eval", str(run_dir), "--force-probe", "linear", "--multiples", "1"])
    config = eval_config_from_args(args)
    assert config.force_probe is not None and config.force_probe.kind == "linear"
    assert [c.kind for c in config.cells(32)] == ["windows", "force"]
    # without the flag: no force cell; the orbit model's coordinate error is printed with the other tables
    assert main(["eval", str(run_dir), "--multiples", "1,2", "--max-tokens", "128", "--rope", "none", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "## coord_err_au" in out and "## val_loss" in out and "force law" not in out
