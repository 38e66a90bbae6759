"""The orbit simulator and data source: physics (conserved quantities, exact two-body orbits), tokens,
determinism, splits and parameter errors."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from attnlab.data.generators import orbit_sim as sim
from attnlab.data.generators.orbits import OrbitData, from_bins, open_orbits, simulate_params, to_bins
from attnlab.errors import UserError

SMALL = {"synthetic": "orbits", "size": "cpu", "block_systems": 10, "n_train_systems": 40, "n_val_systems": 20}


@pytest.fixture(scope="module")
def data() -> OrbitData:
    return open_orbits(SMALL)


# ---------------------------------------------------------------------------------------- physics
def test_two_body_orbits_are_exact_with_one_step_per_observation():
    """Two bodies: one integrator step per observation (even when it spans several orbits) and the relative
    orbit still matches the Kepler ellipse after 1000 observations."""
    rng = np.random.default_rng(3)
    S = 6
    a, e = rng.uniform(0.5, 5, (S, 1)), rng.uniform(0, 0.9, (S, 1))
    omega, m_anom = rng.uniform(0, 2 * math.pi, (S, 1)), rng.uniform(0, 2 * math.pi, (S, 1))
    m_star, m_planet = rng.uniform(0.1, 1, S), rng.uniform(0.01, 1, (S, 1))
    dt = np.full(S, 0.7)
    systems = sim.place_systems(m_star, m_planet, a, e, omega, m_anom, np.ones(S, int), rng.normal(size=(S, 2)),
                                dt, steps_per_orbit=50)
    assert systems.substeps.tolist() == [1] * S
    traj = sim.simulate(systems, 1000)
    mu = sim.G * (m_star + m_planet[:, 0])
    n = np.sqrt(mu / a[:, 0] ** 3)
    t = np.arange(1000) * 0.7
    expect, _ = sim.elements_to_state(a, e, omega, m_anom + n[:, None] * t[None, :], mu[:, None])
    got = traj.pos[:, :, 1] - traj.pos[:, :, 0]
    assert np.abs(got - expect).max() < 1e-7  # AU, after up to ~1000 revolutions
    # forces: Newton's law between the two bodies, equal and opposite
    r = np.linalg.norm(got, axis=-1)
    newton = sim.G * m_star[:, None] * m_planet[:, 0, None] / r**2
    np.testing.assert_allclose(np.linalg.norm(traj.force[:, :, 1], axis=-1), newton, rtol=1e-12)
    np.testing.assert_allclose(traj.force[:, :, 0], -traj.force[:, :, 1], rtol=1e-9, atol=1e-18)


def test_energy_and_angular_momentum_stay_within_bounds_over_long_trajectories(data):
    """20 planetary systems of the CPU size (2-4 bodies), 2000 observations each (up to ~500 inner orbits).

    Measured on this code: max relative energy error 2.5e-5 (median 2e-8), angular momentum 1e-13, over 100
    systems x 4000 observations. Bounds: 1e-4 and 1e-11; and no secular drift: the mean energy of the last
    tenth differs from the first tenth's by < 2e-5 (relative)."""
    params = [data.system_params("val", 0, i) for i in range(20)]
    assert sum(len(p.masses) > 1 for p in params) >= 10  # mostly real N-body systems
    block = simulate_params(data.task, params, 2000)
    m = block.masses[:, None, :]
    energy = sim.energy(block.pos, block.vel, m)
    ang = sim.angular_momentum(block.pos, block.vel, m)
    assert block.bound.all()
    assert np.abs(energy / energy[:, :1] - 1).max() < 1e-4
    assert np.abs(ang / ang[:, :1] - 1).max() < 1e-11
    tenth = 200
    drift = np.abs(energy[:, -tenth:].mean(1) - energy[:, :tenth].mean(1)) / np.abs(energy[:, 0])
    assert drift.max() < 2e-5


def test_energy_error_falls_like_the_step_squared(data):
    """Second-order map: 4x more steps per orbit cut the energy error by well over 4x (ideally 16x). A long
    observation interval (0.5 yr), so that the step is set by ``steps_per_orbit`` and not by ``dt``."""
    params = [p for p in (data.system_params("val", 0, i) for i in range(40)) if len(p.masses) >= 2][:6]
    errors = []
    for steps in (5, 20):
        task = open_orbits({**SMALL, "dts": [0.5], "steps_per_orbit": steps}).task
        params = [dataclasses.replace(p, dt_index=0) for p in params]
        block = simulate_params(task, params, 300)
        energy = sim.energy(block.pos, block.vel, block.masses[:, None, :])
        errors.append(np.median(np.abs(energy / energy[:, :1] - 1).max(1)))
    assert errors[1] < errors[0] / 6


def test_a_system_gives_the_same_bytes_alone_in_any_batch_and_at_any_horizon(data):
    params = [data.system_params("train", 0, i) for i in range(10)]
    full = simulate_params(data.task, params, 200)
    for i in (0, 9):
        alone = simulate_params(data.task, [params[i]], 200)
        assert np.array_equal(alone.pos[0], full.pos[i])
        assert np.array_equal(alone.force[0], full.force[i])
    short = simulate_params(data.task, params, 50)
    assert np.array_equal(short.pos[:, :50], full.pos[:, :50])


def test_kepler_solver_converges_for_every_eccentricity():
    e = np.linspace(0, 0.99, 100)[:, None]
    M = np.linspace(0, 2 * math.pi, 500)[None, :]
    E = sim.solve_kepler(M, e)
    assert np.abs(E - e * np.sin(E) - M).max() < 1e-12


# ---------------------------------------------------------------------------------------- tokens
def test_bins_round_trip_within_half_a_bin():
    rng = np.random.default_rng(0)
    xy = rng.uniform(-8, 8, (1000, 2))
    back = from_bins(to_bins(xy, 256, 8.0), 256, 8.0)
    assert np.abs(back - xy).max() <= 0.5 * 16 / 256 + 1e-12
    assert to_bins(np.array([-100.0, 100.0]), 256, 8.0).tolist() == [0, 255]  # clipped to the box


def test_windows_are_dt_token_then_bodies_interleaved(data):
    """Decoding a window gives the simulated positions (planets in drawn order, then the star) to half a bin."""
    L = 60
    windows = data.windows("val", 0, np.arange(5), L)
    assert windows.shape == (5, L + 1, 2) and windows.dtype == np.int64
    assert windows.max() < data.vocab_size and windows.min() >= 0
    half = 0.5 * data.bin_width + 1e-12
    for s in range(5):
        p = data.system_params("val", 0, s)
        assert windows[s, 0].tolist() == [data.task.n_bins + p.dt_index] * 2
        assert (windows[s, 1:] < data.task.n_bins).all()  # no other special token
        block = simulate_params(data.task, [p], 40)
        nb = len(p.masses) + 1
        truth = block.pos[0, :, :nb].reshape(-1, 2)[:L]
        assert np.abs(from_bins(windows[s, 1:], data.task.n_bins, data.task.coord_max) - truth).max() <= half
        # the star is the heaviest body and the last of each observation's group
        assert np.argmax(block.masses[0, :nb]) == nb - 1
        # planets keep the drawn order: body k has the k-th drawn mass
        np.testing.assert_array_equal(block.masses[0, :nb - 1], p.masses)


# ---------------------------------------------------------------------------------------- determinism, splits
def test_same_seed_same_bytes_and_seed_changes_data():
    a, b = open_orbits(SMALL), open_orbits(SMALL)
    xa, ya, ma = a.train_batch(3, 0, 1, 0, 8, seq_len=64, global_batch=8, seed=0)
    xb, yb, _ = b.train_batch(3, 0, 1, 0, 8, seq_len=64, global_batch=8, seed=0)
    assert ma is None and xa.shape == (8, 64, 2)
    assert xa.numpy().tobytes() == xb.numpy().tobytes() and ya.numpy().tobytes() == yb.numpy().tobytes()
    assert (xa[:, 1:] == ya[:, :-1]).all()
    xc, _, _ = b.train_batch(3, 0, 1, 0, 8, seq_len=64, global_batch=8, seed=1)
    assert not (xa == xc).all()
    assert a.fingerprint == b.fingerprint
    assert open_orbits({**SMALL, "n_bins": 128}).fingerprint != a.fingerprint


def test_rows_do_not_depend_on_the_number_of_workers(data):
    one, _, _ = data.train_batch(5, 0, 1, 0, 8, seq_len=32, global_batch=8, seed=0)
    parts = [data.train_batch(5, r, 2, m, 2, seq_len=32, global_batch=8, seed=0)[0]
             for m in range(2) for r in range(2)]
    import torch

    assert torch.equal(one, torch.cat(parts))


def test_each_epoch_visits_every_training_system_once(data):
    n = data.task.n_train_systems
    first = data.train_system_ids(np.arange(n), seed=0)
    second = data.train_system_ids(np.arange(n, 2 * n), seed=0)
    assert sorted(first.tolist()) == list(range(n)) == sorted(second.tolist())
    assert first.tolist() != second.tolist()  # a new order each epoch


def test_train_validation_and_probe_splits_share_no_system(data):
    def key(p):
        return (round(p.star_mass, 12), tuple(round(a, 12) for a in p.sma))

    train = {key(data.system_params("train", 0, i)) for i in range(data.task.n_train_systems)}
    val = {key(data.system_params("val", 0, i)) for i in range(data.task.n_val_systems)}
    probe_train = {key(data.system_params("probe_train", 0, i)) for i in range(50)}
    probe_test = {key(data.system_params("probe_test", 0, i)) for i in range(50)}
    assert len(train) == data.task.n_train_systems and len(val) == data.task.n_val_systems
    assert not train & val and not probe_train & probe_test and not (train | val) & (probe_train | probe_test)
    ev, mask = data.eval_set(32, max_tokens=32 * 20)
    tr = np.concatenate([data.train_batch(s, 0, 1, 0, 8, seq_len=32, global_batch=8, seed=0)[0].numpy()
                         for s in range(5)])
    assert mask is None
    assert not {w[:-1].tobytes() for w in ev} & {w.tobytes() for w in tr}


def test_longer_evaluation_windows_start_with_the_shorter_ones(data):
    short, _ = data.eval_set(32, max_tokens=None)
    long, _ = data.eval_set(128, max_tokens=128 * 5)
    assert len(short) == data.task.n_val_systems and len(long) == 5
    np.testing.assert_array_equal(long[:, :33], short[:5])


def test_probe_set_records_newtons_force_at_every_token(data):
    probe = data.probe_set("train", 12, 40)
    assert probe.tokens.shape == (12, 41, 2)
    assert probe.body[:, 0].tolist() == [-1] * 12 and np.isnan(probe.force[:, 0]).all()
    assert (probe.body[:, 1::2] == 0).all() and (probe.body[:, 2::2] == 1).all()
    assert (probe.m_planet <= probe.m_star).all()
    newton = sim.G * probe.m_planet[:, None] * probe.m_star[:, None] / probe.r[:, 1:] ** 2
    np.testing.assert_allclose(probe.force[:, 1:], newton, rtol=1e-9)
    lo, hi = data.task.probe_mass_min, data.task.probe_mass_max
    assert ((probe.m_planet >= lo) & (probe.m_star <= hi)).all()
    # the separation decoded from the tokens agrees with r to a bin diagonal
    xy = from_bins(probe.tokens[:, 1:], data.task.n_bins, data.task.coord_max)
    sep = np.linalg.norm(xy[:, 0::2] - xy[:, 1::2], axis=-1)
    assert np.abs(sep - probe.r[:, 1::2]).max() <= math.sqrt(2) * data.bin_width + 1e-9


# ---------------------------------------------------------------------------------------- sizes and errors
def test_paper_size_is_vafa_et_al():
    paper = open_orbits({"synthetic": "orbits", "size": "paper"})
    t = paper.task
    assert (t.n_bins, t.coord_max, t.min_planets, t.max_planets, t.sma_min, t.sma_max) == (7000, 50.0, 1, 10, 0.3, 32.0)
    assert paper.vocab_size == 7002 and t.n_train_systems == 10_000_000
    assert t.dts == pytest.approx([7 * 0.0027, 180 * 0.0027])
    assert open_orbits({"synthetic": "orbits"}).task.size == "cpu"
    assert open_orbits({"synthetic": "orbits", "size": "paper", "n_bins": 700}).task.n_bins == 700


@pytest.mark.parametrize("override, words", [
    ({"n_bins": 1}, ["data.n_bins", "greater than or equal to 2"]),
    ({"size": "huge"}, ["data.size", "cpu, paper"]),
    ({"dts": []}, ["data.dts", "at least 1"]),
    ({"dts": [0.1, 0.1]}, ["data.dts", "distinct"]),
    ({"min_planets": 3, "max_planets": 2}, ["min_planets=3", "max_planets=2"]),
    ({"ecc_max": 1.2}, ["data.ecc_max", "0.95"]),
    ({"n_train_systems": 4001}, ["n_train_systems=4001", "multiple of block_systems=250"]),
    ({"sma_min": 7.5, "sma_max": 9.0}, ["sma_min=7.5", "coord_max"]),
    ({"planets": 3}, ["data.planets", "not a known field"]),
    ({"n_bins": "many"}, ["data.n_bins", "integer"]),
])
def test_bad_parameters_give_one_line_errors_naming_the_field(override, words):
    with pytest.raises(UserError) as info:
        open_orbits({"synthetic": "orbits", **override})
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_bad_call_arguments_are_user_errors(data):
    with pytest.raises(UserError, match="seq_len"):
        data.eval_set(0, None)
    with pytest.raises(UserError, match="data_seed"):
        data.train_batch(0, 0, 1, 0, 2, seq_len=8, global_batch=2, seed=-1)
    with pytest.raises(UserError, match="global_batch"):
        data.train_batch(0, 0, 1, 1, 2, seq_len=8, global_batch=2, seed=0)
    with pytest.raises(UserError, match="probe split"):
        data.probe_set("val", 2, 8)
    with pytest.raises(UserError, match="not the orbit source"):
        open_orbits({"synthetic": "copy_distractors"})
