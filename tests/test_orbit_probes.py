"""The orbit study's probes: symbolic regression recovers Newton's law from true forces and reports a wrong law
as wrong; the force probes run on a tiny random model and return their documented fields; evaluating an orbit
model gives the extrapolation rows (coordinate error included) and the force-probe rows with the expression."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import sympy
import torch

from attnlab.data.generators.orbits import open_orbits
from attnlab.errors import UserError
from attnlab.model.orbit import OrbitGPT, OrbitGPTConfig
from attnlab.evaluate.extrapolation import evaluate_checkpoint
from attnlab.evaluate.force_probe import FORCE_METRICS, ForceProbeResult, finetune_force_probe, linear_force_probe
from attnlab.evaluate.plan import EvalCell, EvalConfig
from attnlab.evaluate.cell_rows import force_rows
from attnlab.evaluate.symbolic import G_NEWTON, ForceLaw, fit_force_law, fit_power_law
from attnlab.results.schema import validate_row
from attnlab.train import load_train_config

SMALL = {"synthetic": "orbits", "size": "cpu", "block_systems": 10, "n_train_systems": 40, "n_val_systems": 20}
BASE = dict(study="orbits", trial="t0", attention="lssar", scale="logd_logn", p_train=15.0, step=0, tokens=0,
            train_len=32, seed=0, train_key="0123456789abcdef", git_sha="unknown")
FAST_SR = dict(population=200, generations=4, restarts=1)


def points(n=2000, seed=0):
    rng = np.random.default_rng(seed)
    m = rng.uniform(0.1, 1.0, (2, n))
    return rng.uniform(0.4, 8.0, n), m.min(0), m.max(0), rng


def law_value(law: ForceLaw, r, m1, m2):
    sym = sympy.symbols("r m1 m2", positive=True)
    return sympy.lambdify(sym, sympy.sympify(law.expression, locals=dict(zip(("r", "m1", "m2"), sym))))(r, m1, m2)


# ---------------------------------------------------------------------------------------- symbolic regression
def test_symbolic_regression_recovers_newton_from_noisy_true_forces():
    r, m1, m2, rng = points()
    force = G_NEWTON * m1 * m2 / r**2 * np.exp(0.01 * rng.standard_normal(len(r)))  # 1% noise
    law = fit_force_law(r, m1, m2, force, n_points=500, population=500, restarts=2, stop_at=0.009)
    assert law.is_newton and law.newton_distance < 0.05
    assert law.sr_exp_r == pytest.approx(-2, abs=0.05)
    assert law.sr_exp_m1 == pytest.approx(1, abs=0.05) and law.sr_exp_m2 == pytest.approx(1, abs=0.05)
    assert law.sr_error < 0.012 and law.n_points == 500 and law.n_dropped == 0
    # the expression, in r, m1, m2 with its constant, is G m1 m2 / r^2 to ~1%
    np.testing.assert_allclose(law_value(law, r, m1, m2), G_NEWTON * m1 * m2 / r**2, rtol=0.03)
    pl = law.power_law
    assert (pl.exp_r, pl.exp_m1, pl.exp_m2) == pytest.approx((-2, 1, 1), abs=0.01)
    assert pl.coef == pytest.approx(G_NEWTON, rel=0.02) and pl.newton_distance < 0.01


@pytest.mark.parametrize("name, exponents", [("inverse r", (-1, 1, 1)), ("no star mass", (-2, 1, 0))])
def test_a_wrong_law_is_reported_as_wrong(name, exponents):
    c, a, b = exponents
    r, m1, m2, rng = points(seed=1)
    force = G_NEWTON * m1**a * m2**b * r**c * np.exp(0.01 * rng.standard_normal(len(r)))
    law = fit_force_law(r, m1, m2, force, n_points=500, population=500, restarts=2, stop_at=0.009)
    assert not law.is_newton
    assert law.newton_distance == pytest.approx(1.0, abs=0.1)
    assert (law.sr_exp_r, law.sr_exp_m1, law.sr_exp_m2) == pytest.approx((c, a, b), abs=0.1)
    assert law.power_law.newton_distance == pytest.approx(1.0, abs=0.05)


def test_power_law_fit_is_exact_on_exact_power_laws_and_drops_bad_forces():
    r, m1, m2, _ = points(200)
    force = 3.0 * m1**0.5 * m2**2 / r**3
    force[:5] = [0.0, -1.0, np.nan, np.inf, 0.0]
    pl = fit_power_law(r, m1, m2, force)
    assert (pl.exp_r, pl.exp_m1, pl.exp_m2, pl.coef) == pytest.approx((-3, 0.5, 2, 3.0), abs=1e-9)
    assert pl.rmse_log < 1e-12 and pl.newton_distance == pytest.approx(1.0)


def test_bad_symbolic_regression_input_is_a_user_error():
    r, m1, m2, _ = points(50)
    with pytest.raises(UserError, match="m1 has 49 values"):
        fit_force_law(r, m1[:-1], m2, r)
    with pytest.raises(UserError, match="finite and positive"):
        fit_force_law(-r, m1, m2, r)
    with pytest.raises(UserError, match="operators"):
        fit_force_law(r, m1, m2, r, operators=("add", "tanh"))
    with pytest.raises(UserError, match="at least 10"):
        fit_force_law(r, m1, m2, -r)
    with pytest.raises(UserError, match="restarts"):
        fit_force_law(r, m1, m2, r, restarts=0)


# ---------------------------------------------------------------------------------------- force probes
@pytest.fixture(scope="module")
def data():
    return open_orbits(SMALL)


@pytest.fixture(scope="module")
def model(data):
    torch.manual_seed(0)
    return OrbitGPT(OrbitGPTConfig(n_layer=2, n_head=2, n_embd=128, vocab_size=data.vocab_size, train_len=32,
                                   attention="lssar"))


def check_result(result: ForceProbeResult, kind: str):
    assert result.kind == kind and result.seq_len == 32
    assert isinstance(result.law, ForceLaw) and isinstance(result.law.expression, str) and result.law.expression
    assert np.isfinite(result.probe_error) and result.probe_error > 0
    assert result.n_test_points > 0 and result.n_train_points > 0 and result.seconds > 0
    assert set(result.points) == {"r", "m1", "m2", "f_true", "f_pred"}
    assert len(result.points["f_pred"]) == result.n_test_points
    np.testing.assert_allclose(result.points["f_true"],
                               G_NEWTON * result.points["m1"] * result.points["m2"] / result.points["r"] ** 2,
                               rtol=1e-9)
    cell = EvalCell("force", 32, None, "none", f"force_{kind}", 0)
    rows = force_rows(BASE, cell, "0" * 16, result)
    assert [r["metric"] for r in rows] == list(FORCE_METRICS)
    for i, row in enumerate(rows):
        stored = validate_row(row, i)
        assert stored["window_mode"] == f"force_{kind}" and stored["eval_len"] == 32
    assert [(r["metric"], r["expression"]) for r in rows if r.get("expression")] == [
        ("force_newton_dist", result.law.expression)]


def test_linear_probe_runs_on_a_tiny_random_model(data, model):
    result = linear_force_probe(model, data, n_train=12, n_test=6, sr_kwargs=FAST_SR, n_points=200)
    check_result(result, "linear")
    assert result.train_loss is None and result.oracle_law is None
    # 16 planet tokens per 32-token two-body sequence; the test sequences lend 2 each to training
    assert result.n_train_points == 12 * 16 + 6 * 2 and result.n_test_points == 6 * 14


def test_finetune_probe_trains_a_copy_and_checks_itself_against_the_true_forces(data, model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = finetune_force_probe(model, data, n_train=12, n_test=6, steps=10, batch_size=6, lr=1e-3,
                                  sr_kwargs=FAST_SR, n_points=200, oracle=True)
    check_result(result, "finetune")
    assert np.isfinite(result.train_loss)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model is untouched
    assert result.oracle_law.power_law.newton_distance < 1e-6  # the true forces are Newton's exactly


def test_probe_arguments_are_checked(data, model):
    with pytest.raises(UserError, match="test_shots"):
        linear_force_probe(model, data, n_train=2, n_test=2, test_shots=16, sr_kwargs=FAST_SR)
    with pytest.raises(UserError, match="steps"):
        finetune_force_probe(model, data, n_train=2, n_test=2, steps=0)
    with pytest.raises(UserError, match="n_train"):
        linear_force_probe(model, data, n_train=0, n_test=2)


# ---------------------------------------------------------------------------------------- evaluating an orbit model
def test_evaluating_an_orbit_model_scores_every_length_and_runs_the_force_probe(data, model):
    config = EvalConfig(multiples=[1, 2], rope_scaling="both", p_eval=[None, 3.0], max_tokens=64 * 4,
                        force_probe={"kind": "linear", "n_train": 12, "n_test": 6, "n_points": 200,
                                     "population": 200, "generations": 4, "restarts": 1})
    trained = load_train_config({"preset": "tiny", "data": SMALL, "seq_len": 32, "seed": 0, "tokens_per_step": 256})
    loaded = (model, trained, {"step": 0, "checkpoint": None})
    rows = evaluate_checkpoint(loaded, config, context={"study": "orbits"})
    for i, row in enumerate(rows):
        validate_row(row, i)
    windows = [r for r in rows if r["window_mode"] == "nonoverlap"]
    cells = {(r["eval_len"], r["rope_scaling"], r["p_eval"]) for r in windows}
    assert cells == {(L, rope, p) for L in (32, 64) for rope in ("ntk", "none") for p in (None, 3.0)}
    pick = {(r["eval_len"], r["rope_scaling"], r["p_eval"], r["metric"], r.get("bucket")): r for r in windows}
    for L, n in ((32, 8), (64, 4)):
        au = pick[(L, "ntk", None, "coord_err_au", None)]
        assert au["n_tokens"] == n * L
        assert au["value"] == pytest.approx(pick[(L, "ntk", None, "coord_err", None)]["value"] * data.bin_width)
        assert 0 <= pick[(L, "ntk", None, "acc", None)]["value"] <= 1
        assert {b for (l, rp, p, m, b) in pick if l == L and m == "loss_bucket"} == {"early", "middle", "late"}
    # NTK changes nothing at the training length, and something beyond it
    assert pick[(32, "ntk", None, "val_loss", None)]["value"] == pick[(32, "none", None, "val_loss", None)]["value"]
    assert pick[(64, "ntk", None, "val_loss", None)]["value"] != pick[(64, "none", None, "val_loss", None)]["value"]
    force = [r for r in rows if r["window_mode"] == "force_linear"]
    assert [r["metric"] for r in force] == list(FORCE_METRICS) and {r["eval_len"] for r in force} == {32}
    assert len({r["eval_key"] for r in force}) == 1 and force[0]["eval_key"] not in {r["eval_key"] for r in windows}
    assert [r["expression"] for r in force if r.get("expression")]
    assert dataclasses.is_dataclass(ForceLaw)


def test_the_force_probe_needs_orbit_data():
    from attnlab.data.generators.synthetic import open_task
    from attnlab.model import GPT, GPTConfig

    copy = {"synthetic": "copy_distractors", "vocab": 64, "copy_len": 4}
    gpt = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=32, vocab_size=open_task(copy).vocab_size, train_len=16))
    config = EvalConfig(multiples=[1], max_tokens=64, force_probe={"kind": "linear"})
    with pytest.raises(UserError, match="force_probe: needs a model trained on orbits"):
        evaluate_checkpoint((gpt, load_train_config({"preset": "tiny", "data": copy, "seq_len": 16}),
                             {"step": 0, "checkpoint": None}), config)
