"""Newtonian N-body simulation of planetary systems in a plane: the physics under the orbit data source.

Owns the integration of batches of star + planet systems (a symplectic Wisdom-Holman map in Jacobi coordinates,
each system with its own step) and reports, at every observation time, the positions, velocities and the true
Newtonian force on every body, in AU, years and solar masses. A system's bytes never depend on the other systems
of its batch, nor on how many observations are asked for.

It must never: touch tokens, bins or torch (that is :mod:`attnlab.data.generators.orbits`), draw random numbers
(initial conditions come in as arrays), or import Ray.

Details: docs/orbits.md#the-simulator (the map, the step, the padding, what is conserved).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

G = 4.0 * math.pi**2  # AU^3 yr^-2 Msun^-1 (39.478...)
KEPLER_ITERATIONS = 6  # Halley steps: residual < 1e-15 for every e <= 0.99 from Danby's start (checked)
PAD_RADIUS = 1.0e5  # AU: where massless padding bodies sit (on circular orbits)


@dataclass(frozen=True)
class Systems:
    """Initial conditions of ``S`` systems padded to ``N`` bodies (body 0 = the star).

    ``masses (S, N)``, ``pos``/``vel (S, N, 2)`` barycentric-frame Cartesian (the centre of mass may sit anywhere
    and moves with ``vel``'s mean), ``n_bodies (S,)`` real bodies (the rest are padding with mass 0), ``dt (S,)``
    the observation interval in years, ``substeps (S,)`` integrator steps per observation interval.
    """

    masses: np.ndarray
    pos: np.ndarray
    vel: np.ndarray
    n_bodies: np.ndarray
    dt: np.ndarray
    substeps: np.ndarray


@dataclass(frozen=True)
class Trajectories:
    """Observations ``0..T-1`` (observation 0 = the initial conditions) of ``S`` systems of ``N`` bodies.

    ``pos``, ``vel``, ``force`` are ``(S, T, N, 2)`` float64; ``force[s, t, i]`` is the total Newtonian force on
    body ``i`` (Msun AU yr^-2). Padding bodies carry zeros in ``force``.
    """

    pos: np.ndarray
    vel: np.ndarray
    force: np.ndarray
    bound: np.ndarray  # (S,) bool: False if some orbit became unbound (see :func:`simulate`)


# ---------------------------------------------------------------------------------------- Kepler orbits
def solve_kepler(mean_anomaly: np.ndarray, ecc: np.ndarray) -> np.ndarray:
    """Eccentric anomaly ``E`` with ``E - e sin E = M`` (elliptic, ``e < 1``): Danby's start + fixed Halley steps."""
    M = np.asarray(mean_anomaly, dtype=np.float64)
    e = np.asarray(ecc, dtype=np.float64)
    E = M + 0.85 * e * np.sign(np.sin(M))
    for _ in range(KEPLER_ITERATIONS):
        sin_e, cos_e = np.sin(E), np.cos(E)
        f = E - e * sin_e - M
        f1 = 1.0 - e * cos_e
        newton = -f / f1
        E = E - f / (f1 + 0.5 * newton * e * sin_e)
    return E


def elements_to_state(a, e, omega, mean_anomaly, mu) -> tuple[np.ndarray, np.ndarray]:
    """Relative position and velocity ``(..., 2)`` on the prograde ellipse ``(a, e)`` with periapsis at angle
    ``omega`` and mean anomaly ``mean_anomaly``, around gravitational parameter ``mu``."""
    a, e, omega, mu = (np.asarray(t, dtype=np.float64) for t in (a, e, omega, mu))
    E = solve_kepler(np.asarray(mean_anomaly, dtype=np.float64), e)
    cos_e, sin_e = np.cos(E), np.sin(E)
    root = np.sqrt(1.0 - e * e)
    x_orb = np.stack([a * (cos_e - e), a * root * sin_e], axis=-1)
    speed = np.sqrt(mu / a) / (1.0 - e * cos_e)
    v_orb = np.stack([-speed * sin_e, speed * root * cos_e], axis=-1)
    rot = np.stack([np.stack([np.cos(omega), -np.sin(omega)], -1), np.stack([np.sin(omega), np.cos(omega)], -1)], -2)
    return np.einsum("...ij,...j->...i", rot, x_orb), np.einsum("...ij,...j->...i", rot, v_orb)


def kepler_drift(x: np.ndarray, v: np.ndarray, mu: np.ndarray, h: np.ndarray):
    """Advance bound Kepler orbits ``x, v (..., 2)`` around ``mu (...)`` by time ``h (...)`` exactly (f and g
    functions in eccentric-anomaly differences; any number of revolutions). Returns ``(x, v, bound (...))``;
    an unbound orbit (never expected here) moves on a straight line instead and reports ``bound=False``."""
    r0 = np.sqrt(x[..., 0] ** 2 + x[..., 1] ** 2)
    v2 = v[..., 0] ** 2 + v[..., 1] ** 2
    rv = x[..., 0] * v[..., 0] + x[..., 1] * v[..., 1]
    alpha = 2.0 / r0 - v2 / mu  # 1/a, > 0 for a bound orbit
    ok = alpha > 0
    alpha = np.where(ok, alpha, 1.0 / r0)  # unbound: computed on a stand-in orbit, replaced below
    a = 1.0 / alpha
    n = np.sqrt(mu * alpha**3)
    sqrt_mu_a = np.sqrt(mu * a)
    e_cos0 = 1.0 - r0 * alpha
    e_sin0 = rv / sqrt_mu_a
    ecc = np.sqrt(e_cos0**2 + e_sin0**2)
    E0 = np.arctan2(e_sin0, e_cos0)
    M1 = np.mod(E0 - e_sin0 + n * h, 2.0 * math.pi)
    E1 = solve_kepler(M1, ecc)
    dE = n * h + ecc * np.sin(E1) - e_sin0  # unwrapped: dM = dE - e (sin E1 - sin E0)
    s, one_minus_c = np.sin(dE), 2.0 * np.sin(0.5 * dE) ** 2
    e_cos1 = e_cos0 * np.cos(dE) - e_sin0 * s
    r1 = a * (1.0 - e_cos1)
    f = 1.0 - (a / r0) * one_minus_c
    g = h - (dE - s) / n
    fdot = -sqrt_mu_a * s / (r1 * r0)
    gdot = 1.0 - (a / r1) * one_minus_c
    x1 = f[..., None] * x + g[..., None] * v
    v1 = fdot[..., None] * x + gdot[..., None] * v
    if not ok.all():
        x1 = np.where(ok[..., None], x1, x + np.asarray(h)[..., None] * v)
        v1 = np.where(ok[..., None], v1, v)
    return x1, v1, ok


# ---------------------------------------------------------------------------------------- coordinates
def interior_masses(masses: np.ndarray) -> np.ndarray:
    """``M_i = m_0 + ... + m_i`` (S, N)."""
    return np.cumsum(masses, axis=-1)


def jacobi_matrices(masses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(J, J_inv)``, each ``(S, N, N)``: Jacobi coordinates are ``J @ x`` (``x'_i = x_i - COM(0..i-1)`` for
    i >= 1, ``x'_0`` = the centre of mass of all bodies) and ``x = J_inv @ x'``. Velocities and accelerations
    transform the same way."""
    S, N = masses.shape
    big = interior_masses(masses)
    J = np.zeros((S, N, N))
    J[:, 0, :] = masses / big[:, -1:]
    for i in range(1, N):
        J[:, i, :i] = -masses[:, :i] / big[:, i - 1:i]
        J[:, i, i] = 1.0
    J_inv = np.zeros((S, N, N))
    com = np.zeros((S, N))  # row of J_inv for "COM of bodies 0..i", walking i down from N-1
    com[:, 0] = 1.0
    for i in range(N - 1, 0, -1):
        unit = np.zeros((S, N))
        unit[:, i] = 1.0
        com = com - (masses[:, i] / big[:, i])[:, None] * unit
        J_inv[:, i, :] = unit + com
    J_inv[:, 0, :] = com
    return J, J_inv


def to_jacobi(x: np.ndarray, masses: np.ndarray) -> np.ndarray:
    """Cartesian ``(S, N, 2)`` -> Jacobi coordinates (see :func:`jacobi_matrices`)."""
    return jacobi_matrices(masses)[0] @ x


def accelerations(x: np.ndarray, masses: np.ndarray) -> np.ndarray:
    """Newtonian accelerations ``(S, N, 2)`` of every body from every other: ``G sum_j m_j d_ij / |d_ij|^3``."""
    d = x[:, None, :, :] - x[:, :, None, :]  # (S, i, j, 2): from body i to body j
    r2 = d[..., 0] ** 2 + d[..., 1] ** 2
    n = x.shape[1]
    r2[:, np.arange(n), np.arange(n)] = 1.0  # self terms have d = 0; any finite r2 gives 0
    weight = G * masses[:, None, :] / (r2 * np.sqrt(r2))
    return np.sum(weight[..., None] * d, axis=2)


def energy(pos: np.ndarray, vel: np.ndarray, masses: np.ndarray) -> np.ndarray:
    """Total energy ``(...,)`` of states ``(..., N, 2)`` with masses broadcastable to ``(..., N)``."""
    kinetic = 0.5 * np.sum(masses * np.sum(vel**2, axis=-1), axis=-1)
    potential = np.zeros(kinetic.shape)
    n = pos.shape[-2]
    for i in range(n):
        for j in range(i + 1, n):
            r = np.sqrt(np.sum((pos[..., i, :] - pos[..., j, :]) ** 2, axis=-1))
            potential = potential - G * masses[..., i] * masses[..., j] / r
    return kinetic + potential


def angular_momentum(pos: np.ndarray, vel: np.ndarray, masses: np.ndarray) -> np.ndarray:
    """Total angular momentum ``L_z (...,)`` of states ``(..., N, 2)``."""
    return np.sum(masses * (pos[..., 0] * vel[..., 1] - pos[..., 1] * vel[..., 0]), axis=-1)


# ---------------------------------------------------------------------------------------- set-up and the map
def substeps_for(masses: np.ndarray, pos: np.ndarray, vel: np.ndarray, n_bodies: np.ndarray, dt: np.ndarray,
                 steps_per_orbit: int) -> np.ndarray:
    """Integrator steps per observation interval: ``ceil(dt / (P_min / steps_per_orbit))`` per system, with
    ``P_min`` the shortest Jacobi orbital period among its real planets; 1 for a two-body system (exact)."""
    J, _ = jacobi_matrices(masses)
    xj, vj = J @ pos, J @ vel
    mu = G * interior_masses(masses)
    r = np.sqrt(np.sum(xj[:, 1:] ** 2, axis=-1))
    alpha = 2.0 / r - np.sum(vj[:, 1:] ** 2, axis=-1) / mu[:, 1:]
    with np.errstate(divide="ignore", invalid="ignore"):
        period = 2.0 * math.pi / np.sqrt(mu[:, 1:] * alpha**3)
    real = np.arange(1, masses.shape[1])[None, :] < n_bodies[:, None]
    p_min = np.min(np.where(real, period, np.inf), axis=1)
    steps = np.maximum(1, np.ceil(dt * steps_per_orbit / p_min)).astype(np.int64)
    return np.where(n_bodies <= 2, 1, steps)  # two bodies: no interaction term, every step length is exact


def place_systems(star_mass, planet_masses, sma, ecc, omega, mean_anomaly, n_planets, com, dt,
                  steps_per_orbit: int) -> Systems:
    """Systems from orbital elements: star mass ``(S,)``; per-planet arrays ``(S, P)`` ordered by semi-major
    axis (planets past ``n_planets[s]`` are ignored); ``com (S, 2)`` centre of mass at rest; ``dt (S,)``.

    Planet ``i``'s elements are those of its Jacobi orbit around the star and the planets inside it (so a lone
    planet's orbit is exactly the ellipse ``(a, e)`` of the two-body problem). Padding bodies go on circular
    orbits at ``PAD_RADIUS * (1 + k)`` AU.
    """
    S, P = np.shape(sma)
    N = P + 1
    real = np.arange(P)[None, :] < np.asarray(n_planets)[:, None]
    masses = np.zeros((S, N))
    masses[:, 0] = star_mass
    masses[:, 1:] = np.where(real, planet_masses, 0.0)
    a = np.where(real, sma, PAD_RADIUS * (1.0 + np.arange(P))[None, :])
    e = np.where(real, ecc, 0.0)
    mu = G * interior_masses(masses)[:, 1:]
    xj = np.zeros((S, N, 2))
    vj = np.zeros((S, N, 2))
    xj[:, 1:], vj[:, 1:] = elements_to_state(a, e, omega, mean_anomaly, mu)
    xj[:, 0] = com
    _, J_inv = jacobi_matrices(masses)
    pos, vel = J_inv @ xj, J_inv @ vj
    n_bodies = np.asarray(n_planets, dtype=np.int64) + 1
    dt = np.asarray(dt, dtype=np.float64)
    return Systems(masses=masses, pos=pos, vel=vel, n_bodies=n_bodies, dt=dt,
                   substeps=substeps_for(masses, pos, vel, n_bodies, dt, steps_per_orbit))


def _interaction_kick(xj, vj, masses, mu, J, J_inv, h_half):
    """Jacobi velocities after a kick of ``h_half`` by the interaction part (all forces minus the Kepler ones),
    and the Cartesian accelerations at ``xj``."""
    acc = accelerations(J_inv @ xj, masses)
    acc_j = J @ acc  # accelerations transform like positions; row 0 (the COM's) is 0
    r2 = xj[:, 1:, 0] ** 2 + xj[:, 1:, 1] ** 2
    kepler = -(mu / (r2 * np.sqrt(r2)))[..., None] * xj[:, 1:]
    vj = vj.copy()
    vj[:, 1:] += h_half[:, None, None] * (acc_j[:, 1:] - kepler)
    return vj, acc


def simulate(systems: Systems, n_obs) -> Trajectories:
    """Observe ``systems`` at times ``0, dt, ..., (n_obs - 1) dt``: positions, velocities and total forces.

    ``n_obs``: an int, or one per system ``(S,)`` (arrays are sized by the largest; a system's observations past
    its own count stay zero).

    A system in which some Jacobi orbit stops being bound (an ejection: never seen with the spacing
    :mod:`attnlab.data.generators.orbits` enforces) keeps going on straight lines for that body and is flagged in
    ``Trajectories.bound``.
    """
    masses = systems.masses
    S, N = masses.shape
    counts = np.broadcast_to(np.asarray(n_obs, dtype=np.int64), (S,))
    if S and counts.min() < 1:
        raise ValueError(f"n_obs={n_obs} must be >= 1")
    n_obs = int(counts.max()) if S else 1
    mu = G * interior_masses(masses)[:, 1:]
    J, J_inv = jacobi_matrices(masses)
    substeps = systems.substeps
    h = systems.dt / substeps
    xj, vj = J @ systems.pos, J @ systems.vel
    pos = np.zeros((S, n_obs, N, 2))
    vel = np.zeros((S, n_obs, N, 2))
    force = np.zeros((S, n_obs, N, 2))
    bound = np.ones(S, dtype=bool)
    pos[:, 0], vel[:, 0] = systems.pos, systems.vel
    force[:, 0] = masses[..., None] * accelerations(systems.pos, masses)
    done_at = substeps * (counts - 1)  # the step count of each system's last observation
    total = int(done_at.max()) if S else 0
    for k in range(1, total + 1):
        active = k <= done_at
        h_now = np.where(active, h, 0.0)
        vj, _ = _interaction_kick(xj, vj, masses, mu, J, J_inv, 0.5 * h_now)
        xj = xj.copy()
        xj[:, 1:], vj[:, 1:], ok = kepler_drift(xj[:, 1:], vj[:, 1:], mu, h_now[:, None])
        bound &= ok.all(axis=1) | ~active
        xj[:, 0] = xj[:, 0] + h_now[:, None] * vj[:, 0]
        vj, acc = _interaction_kick(xj, vj, masses, mu, J, J_inv, 0.5 * h_now)
        observe = active & (k % substeps == 0)
        if observe.any():
            rows = np.nonzero(observe)[0]
            t = k // substeps[rows]
            pos[rows, t] = J_inv[rows] @ xj[rows]
            vel[rows, t] = J_inv[rows] @ vj[rows]
            force[rows, t] = masses[rows, :, None] * acc[rows]
    return Trajectories(pos=pos, vel=vel, force=force, bound=bound)


__all__ = ["G", "Systems", "Trajectories", "accelerations", "angular_momentum", "elements_to_state", "energy",
           "jacobi_matrices", "kepler_drift", "place_systems", "simulate", "solve_kepler",
           "substeps_for", "to_jacobi"]
