"""Simulated planetary orbits as a data source: the token stream of Vafa et al. 2025 ("What has a foundation
model found?"), for training GPTs on trajectories and probing whether they learned Newton's law.

Owns the orbit data: ``data: {synthetic: orbits, size: cpu|paper, ...}`` and its sizes, the drawing of systems
(exoplanet-like, placed ``hill_spacing`` Hill radii apart), the (x bin, y bin) tokens and their windows, the splits
(system ``i`` of a split a pure function of ``(split, data_seed, i)``), the walk over training systems and the
force probe's two-body sets (:meth:`OrbitData.probe_set`). :func:`open_orbits` returns an :class:`OrbitData`
with the interface of :class:`attnlab.data.generators.synthetic.SyntheticData` and of text data. The physics is
:mod:`attnlab.data.generators.orbit_sim`'s.

It must never import Ray, the model or the training loop, nor build torch modules (torch only makes the
returned batch tensors).

Details: docs/orbits.md#the-data-in-detail (systems, tokens, splits and determinism), docs/orbits.md#sizes.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

import attnlab.data.generators.orbit_sim as orbit_sim
from attnlab.data.batching import micro_batch_rows
from attnlab.errors import UserError
from attnlab.validation import parse

SIM_VERSION = 1  # bump when the simulator or the tokenisation changes the bytes (part of the fingerprint)
TRAIN_STREAM = 0x747261696E  # "train"
VAL_STREAM = 0x76616C  # "val"
ORDER_STREAM = 0x6F72646572  # "order": the per-epoch walk over training systems
PROBE_STREAMS = {"train": 0x70747261, "test": 0x70746573}  # two-body force-probe systems

# Fits to the NASA Exoplanet Archive table shipped with Vafa et al.'s code (4956 planets): scipy.stats
# lognorm.fit of host masses and gamma.fit of planet masses below their 90th percentile, in Msun.
STAR_LOGNORM = (0.200450, -0.679361, 1.627151)  # (s, loc, scale)
STAR_MASS_RANGE = (0.1, 5.0)
PLANET_GAMMA = (0.320202, 6.009815e-08, 1.105595e-03)  # (a, loc, scale)
PLANET_MASS_RANGE = (1e-9, 1e-3)
ECC_BETA = (0.867, 3.03)  # Kipping 2013
PLACE_TRIES = 100  # draws per planet before it is dropped
COM_SIGMA_FRACTION = 0.02  # centre-of-mass offset, per axis, as a fraction of coord_max (1 AU at 50 AU)
WEEK, MONTH = 7 * 0.0027, 30 * 0.0027  # years, as Vafa et al. wrote them

SIZES: dict[str, dict[str, Any]] = {
    # A 2-core CPU study: 256 bins over +-8 AU (0.0625 AU per bin), 1-3 planets within 5 AU.
    "cpu": dict(n_bins=256, coord_max=8.0, dts=[0.025, 0.1], min_planets=1, max_planets=3, sma_min=0.4,
                sma_max=5.0, ecc_max=0.8, hill_spacing=5.0, steps_per_orbit=10, n_train_systems=4000,
                n_val_systems=250, block_systems=250, probe_mass_min=0.1, probe_mass_max=1.0),
    # Vafa et al. 2025: 7000 bins over +-50 AU, dt 1 week or 6 months, 1-10 planets, sma 0.3-32 AU, 10M systems.
    "paper": dict(n_bins=7000, coord_max=50.0, dts=[WEEK, 6 * MONTH], min_planets=1, max_planets=10, sma_min=0.3,
                  sma_max=32.0, ecc_max=0.95, hill_spacing=5.0, steps_per_orbit=20, n_train_systems=10_000_000,
                  n_val_systems=300, block_systems=250, probe_mass_min=1e-4, probe_mass_max=1.01e-2),
}

PositiveInt = Annotated[int, Field(strict=True, gt=0)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class OrbitTask(BaseModel):
    """The orbit source's parameters; ``size`` fills every field not given."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: ClassVar[str] = "orbits"

    size: Literal["cpu", "paper"] = "cpu"
    n_bins: Annotated[int, Field(strict=True, ge=2, le=65535)]
    coord_max: PositiveFloat  # AU: bins cover [-coord_max, coord_max] on both axes
    dts: list[PositiveFloat] = Field(min_length=1, max_length=16)  # observation intervals, years
    min_planets: Annotated[int, Field(strict=True, ge=1, le=20)]
    max_planets: Annotated[int, Field(strict=True, ge=1, le=20)]
    sma_min: PositiveFloat  # AU
    sma_max: PositiveFloat
    ecc_max: Annotated[float, Field(ge=0, le=0.95)]
    hill_spacing: Annotated[float, Field(ge=0, allow_inf_nan=False)]  # mutual Hill radii between orbits
    steps_per_orbit: Annotated[int, Field(strict=True, ge=1, le=10_000)]  # integrator steps per shortest period
    n_train_systems: PositiveInt
    n_val_systems: PositiveInt
    block_systems: Annotated[int, Field(strict=True, ge=1, le=100_000)]  # systems integrated together
    probe_mass_min: PositiveFloat  # Msun: two-body force-probe masses
    probe_mass_max: PositiveFloat

    @model_validator(mode="before")
    @classmethod
    def _fill_from_size(cls, data: Any) -> Any:
        if isinstance(data, dict):
            size = data.get("size", "cpu")
            if size in SIZES:
                data = {**SIZES[size], **data}
        return data

    @field_validator("dts")
    @classmethod
    def _distinct_dts(cls, value: list[float]) -> list[float]:
        if len(set(value)) != len(value):
            raise ValueError("dts must be distinct (each has its own dt token)")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "OrbitTask":
        if self.min_planets > self.max_planets:
            raise ValueError(f"min_planets={self.min_planets} must be <= max_planets={self.max_planets}")
        if self.sma_min >= self.sma_max:
            raise ValueError(f"sma_min={self.sma_min} must be < sma_max={self.sma_max}")
        if self.probe_mass_min > self.probe_mass_max:
            raise ValueError(f"probe_mass_min={self.probe_mass_min} must be <= probe_mass_max={self.probe_mass_max}")
        if self.sma_min >= self.apo_limit:
            raise ValueError(f"sma_min={self.sma_min} AU does not fit the box: use sma_min < {self.apo_limit:.3g} "
                             f"(coord_max minus a centre-of-mass margin) or a larger coord_max")
        if self.n_train_systems % self.block_systems:
            raise ValueError(f"n_train_systems={self.n_train_systems} must be a multiple of "
                             f"block_systems={self.block_systems}")
        return self

    @property
    def com_sigma(self) -> float:
        return COM_SIGMA_FRACTION * self.coord_max

    @property
    def apo_limit(self) -> float:
        """Largest apoapsis allowed (AU): inside the box with a 4-sigma margin for the centre-of-mass offset."""
        return self.coord_max - 4.0 * self.com_sigma

    @property
    def bin_width(self) -> float:
        return 2.0 * self.coord_max / self.n_bins

    def params_text(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.model_dump().items())


# ---------------------------------------------------------------------------------------- tokens
def to_bins(xy: np.ndarray, n_bins: int, coord_max: float) -> np.ndarray:
    """Coordinates (AU) -> bin indices ``0..n_bins-1`` (int64), clipped to the box."""
    width = 2.0 * coord_max / n_bins
    idx = np.floor((np.asarray(xy, dtype=np.float64) + coord_max) / width)
    return np.clip(idx, 0, n_bins - 1).astype(np.int64)


def from_bins(bins: np.ndarray, n_bins: int, coord_max: float) -> np.ndarray:
    """Bin indices -> bin centres (AU)."""
    width = 2.0 * coord_max / n_bins
    return -coord_max + (np.asarray(bins, dtype=np.float64) + 0.5) * width


# ---------------------------------------------------------------------------------------- drawing systems
def _rng(*words: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([int(w) for w in words]))


def _star_mass(rng: np.random.Generator) -> float:
    s, loc, scale = STAR_LOGNORM
    return float(np.clip(loc + scale * math.exp(s * rng.standard_normal()), *STAR_MASS_RANGE))


def _planet_mass(rng: np.random.Generator) -> float:
    a, loc, scale = PLANET_GAMMA
    return float(np.clip(loc + rng.gamma(a, scale), *PLANET_MASS_RANGE))


def _eccentricity(rng: np.random.Generator, ecc_max: float) -> float | None:
    e = float(rng.beta(*ECC_BETA))
    return e if e <= ecc_max else None


def _fits(task: OrbitTask, star: float, placed: list[tuple[float, float, float]], a: float, e: float,
          m: float) -> bool:
    """Inside the box and ``hill_spacing`` mutual Hill radii clear of every placed orbit."""
    if a * (1 + e) > task.apo_limit:
        return False
    for a2, e2, m2 in placed:
        (ai, ei, mi), (ao, eo, mo) = sorted([(a, e, m), (a2, e2, m2)])
        hill = ((mi + mo) / (3.0 * star)) ** (1.0 / 3.0) * 0.5 * (ai + ao)
        if ao * (1 - eo) - ai * (1 + ei) < task.hill_spacing * hill:
            return False
    return True


@dataclass
class SystemParams:
    """One system's draw: planets in drawn order (the token order)."""

    star_mass: float
    masses: list[float]
    sma: list[float]
    ecc: list[float]
    omega: list[float]
    mean_anomaly: list[float]
    com: tuple[float, float]
    dt_index: int


def draw_system(task: OrbitTask, rng: np.random.Generator) -> SystemParams:
    """A star with ``min_planets..max_planets`` planets (fewer if some cannot be placed)."""
    star = _star_mass(rng)
    wanted = int(rng.integers(task.min_planets, task.max_planets + 1))
    placed: list[tuple[float, float, float]] = []
    for _ in range(wanted):
        for _ in range(PLACE_TRIES):
            a = float(rng.uniform(task.sma_min, task.sma_max))
            e = _eccentricity(rng, task.ecc_max)
            m = _planet_mass(rng)
            if e is not None and _fits(task, star, placed, a, e, m):
                placed.append((a, e, m))
                break
    n = len(placed)
    if n == 0:  # the box is too small for the first planet: keep the innermost circular orbit
        placed.append((task.sma_min, 0.0, _planet_mass(rng)))
        n = 1
    omega = rng.uniform(0, 2 * math.pi, n)
    mean_anomaly = rng.uniform(0, 2 * math.pi, n)
    com = rng.normal(0.0, task.com_sigma, 2)
    dt_index = int(rng.integers(len(task.dts)))
    return SystemParams(star_mass=star, masses=[p[2] for p in placed], sma=[p[0] for p in placed],
                        ecc=[p[1] for p in placed], omega=omega.tolist(), mean_anomaly=mean_anomaly.tolist(),
                        com=(float(com[0]), float(com[1])), dt_index=dt_index)


def draw_two_body(task: OrbitTask, rng: np.random.Generator) -> SystemParams:
    """A force-probe system: two masses from ``[probe_mass_min, probe_mass_max]`` (the heavier is the star)."""
    m = rng.uniform(task.probe_mass_min, task.probe_mass_max, 2)
    star, planet = float(m.max()), float(m.min())
    for _ in range(PLACE_TRIES):
        a = float(rng.uniform(task.sma_min, task.sma_max))
        e = _eccentricity(rng, task.ecc_max)
        if e is not None and a * (1 + e) <= task.apo_limit:
            break
    else:
        a, e = task.sma_min, 0.0
    com = rng.normal(0.0, task.com_sigma, 2)
    return SystemParams(star_mass=star, masses=[planet], sma=[a], ecc=[e],
                        omega=[float(rng.uniform(0, 2 * math.pi))],
                        mean_anomaly=[float(rng.uniform(0, 2 * math.pi))],
                        com=(float(com[0]), float(com[1])), dt_index=int(rng.integers(len(task.dts))))


@dataclass
class SimulatedBlock:
    """A block of systems, integrated: bodies in token order per system (planets as drawn, then the star)."""

    params: list[SystemParams]
    n_bodies: np.ndarray  # (B,)
    n_obs: np.ndarray  # (B,) observations integrated per system
    pos: np.ndarray  # (B, T, N, 2) token order: body k of system s is pos[s, :, k] for k < n_bodies[s]
    vel: np.ndarray  # (B, T, N, 2)
    force: np.ndarray  # (B, T, N, 2)
    masses: np.ndarray  # (B, N) token order
    bound: np.ndarray  # (B,)


def simulate_params(task: OrbitTask, params: list[SystemParams], n_obs: np.ndarray | int) -> SimulatedBlock:
    """Integrate systems (padded to ``max_planets + 1`` bodies) for ``n_obs`` observations each."""
    S, P = len(params), task.max_planets
    sma = np.ones((S, P))
    ecc, omega, mean_anomaly, pmass = (np.zeros((S, P)) for _ in range(4))
    n_planets = np.array([len(p.masses) for p in params], dtype=np.int64)
    order = np.zeros((S, P), dtype=np.int64)  # simulation slot (by sma) of the k-th drawn planet
    for s, p in enumerate(params):
        n = len(p.masses)
        by_sma = np.argsort(np.asarray(p.sma), kind="stable")
        for field, arr in ((p.sma, sma), (p.ecc, ecc), (p.omega, omega), (p.mean_anomaly, mean_anomaly),
                           (p.masses, pmass)):
            arr[s, :n] = np.asarray(field)[by_sma]
        order[s, by_sma] = np.arange(n)
    systems = orbit_sim.place_systems(
        star_mass=np.array([p.star_mass for p in params]), planet_masses=pmass, sma=sma, ecc=ecc, omega=omega,
        mean_anomaly=mean_anomaly, n_planets=n_planets, com=np.array([p.com for p in params]),
        dt=np.array([task.dts[p.dt_index] for p in params]), steps_per_orbit=task.steps_per_orbit)
    traj = orbit_sim.simulate(systems, n_obs)
    # token order: drawn planets (simulation slot 1 + order), then the star (slot 0); padding after
    N = P + 1
    perm = np.tile(np.arange(N), (S, 1))
    for s in range(S):
        n = n_planets[s]
        perm[s, :n + 1] = np.concatenate([1 + order[s, :n], [0]])
    take = perm[:, None, :, None]
    return SimulatedBlock(
        params=params, n_bodies=n_planets + 1,
        n_obs=np.broadcast_to(np.asarray(n_obs, dtype=np.int64), (S,)).copy(),
        pos=np.take_along_axis(traj.pos, take, axis=2), vel=np.take_along_axis(traj.vel, take, axis=2),
        force=np.take_along_axis(traj.force, take, axis=2),
        masses=np.take_along_axis(systems.masses, perm, axis=1), bound=traj.bound)


def interleave(block: SimulatedBlock, s: int, n_tokens: int, values: np.ndarray) -> np.ndarray:
    """The first ``n_tokens`` body tokens of system ``s``: ``values (B, T, N, ...)`` interleaved by body."""
    nb = int(block.n_bodies[s])
    flat = values[s, :, :nb].reshape(-1, *values.shape[3:])
    if len(flat) < n_tokens:
        raise ValueError(f"system {s} has {len(flat)} body tokens integrated, {n_tokens} asked")
    return flat[:n_tokens]


def obs_needed(n_bodies: np.ndarray, n_tokens: int) -> np.ndarray:
    """Observations that give ``n_tokens`` body tokens for systems of ``n_bodies`` bodies."""
    return np.maximum(1, -(-n_tokens // np.asarray(n_bodies)))


@dataclass
class TokenBlock:
    """What the source keeps of a simulated block: per system its dt index and its first ``n_tokens`` body
    tokens ``(B, n_tokens, 2)`` (int32 bins); for force-probe blocks also the force magnitude on each token's
    body and the distance between the first two bodies at its observation ``(B, n_tokens)``, and the masses."""

    n_tokens: int
    dt_index: np.ndarray
    tokens: np.ndarray
    masses: np.ndarray
    force: np.ndarray | None = None
    separation: np.ndarray | None = None

    @classmethod
    def from_simulation(cls, task: "OrbitTask", sim_block: SimulatedBlock, n_tokens: int,
                        with_forces: bool) -> "TokenBlock":
        B = len(sim_block.params)
        tokens = np.empty((B, n_tokens, 2), dtype=np.int32)
        force = np.empty((B, n_tokens)) if with_forces else None
        separation = np.empty((B, n_tokens)) if with_forces else None
        for s in range(B):
            tokens[s] = to_bins(interleave(sim_block, s, n_tokens, sim_block.pos), task.n_bins, task.coord_max)
            if with_forces:
                force[s] = np.linalg.norm(interleave(sim_block, s, n_tokens, sim_block.force), axis=-1)
                nb = int(sim_block.n_bodies[s])
                sep = np.linalg.norm(sim_block.pos[s, :, 0] - sim_block.pos[s, :, 1], axis=-1)
                separation[s] = np.repeat(sep, nb)[:n_tokens]
        return cls(n_tokens=n_tokens, dt_index=np.array([p.dt_index for p in sim_block.params]), tokens=tokens,
                   masses=sim_block.masses.copy(), force=force, separation=separation)


# ---------------------------------------------------------------------------------------- the data source
@dataclass
class ProbeSet:
    """Two-body sequences for the force probe: windows and, per token, the truth about its body.

    ``tokens (n, L + 1, 2)`` int64 (position 0 = the dt token); ``force (n, L + 1)`` the magnitude of the total
    force on the token's body (Msun AU yr^-2; NaN at the dt token); ``body (n, L + 1)`` 0 = planet (the lighter
    body), 1 = star, -1 = the dt token; ``r (n, L + 1)`` the planet-star distance (AU) at the token's
    observation; ``m_planet``, ``m_star (n,)`` Msun.
    """

    tokens: np.ndarray
    force: np.ndarray
    body: np.ndarray
    r: np.ndarray
    m_planet: np.ndarray
    m_star: np.ndarray


class OrbitData:
    """Simulated orbits as a data source (the interface of ``attnlab.data.generators.synthetic.SyntheticData``)."""

    token_channels = 2  # each token is an (x bin, y bin) pair: windows are (n, L + 1, 2)
    model_kind = "orbit"  # the model that reads these tokens: attnlab.model.orbit.OrbitGPT

    def __init__(self, task: OrbitTask, cache_blocks: int = 64):
        self.task = task
        self.vocab_size = task.n_bins + len(task.dts)
        self.spec = {"synthetic": task.name, **task.model_dump()}
        blob = json.dumps({**self.spec, "sim_version": SIM_VERSION}, sort_keys=True)
        self.fingerprint = hashlib.sha256(blob.encode()).hexdigest()
        self.bin_width = task.bin_width
        self._cache: OrderedDict = OrderedDict()
        self._orders: OrderedDict = OrderedDict()
        self._cache_blocks = cache_blocks

    # -- interface
    def describe(self) -> str:
        return f"synthetic orbits({self.task.params_text()})"

    def min_tokens(self) -> int:
        return 2**62  # generated on demand: never runs out

    def dt_token(self, dt_index: int) -> int:
        return self.task.n_bins + int(dt_index)

    def train_batch(self, step, rank, world_size, micro, micro_batch, *, seq_len, global_batch, seed):
        """Rank ``rank``'s rows ``[(micro * world_size + rank) * micro_batch, ... + micro_batch)`` of step
        ``step``: ``(x (B, T, 2), y (B, T, 2), None)`` int64."""
        import torch

        rows = micro_batch_rows(rank, world_size, micro, micro_batch, global_batch)
        self._check(seq_len, seed)
        ids = self.train_system_ids(step * global_batch + np.arange(rows.start, rows.stop), seed)
        data = torch.from_numpy(self.windows("train", seed, ids, seq_len))
        return data[:, :-1].contiguous(), data[:, 1:].contiguous(), None

    def eval_size(self, seq_len: int, max_tokens: int | None) -> int:
        """Validation systems scored at length ``seq_len``: ``min(n_val_systems, max_tokens // seq_len)`` (>= 1)."""
        n = self.task.n_val_systems
        return n if max_tokens is None else max(1, min(n, max_tokens // seq_len))

    def eval_set(self, seq_len: int, max_tokens: int | None, long_docs: bool = False, seed: int = 0):
        """``(windows (n, L + 1, 2) int64, None)``: the first n validation systems, each observed from its start.

        ``long_docs`` means nothing here (every window is one whole trajectory); accepted for the interface.
        """
        self._check(seq_len, seed)
        n = self.eval_size(seq_len, max_tokens)
        return self.windows("val", seed, np.arange(n), seq_len), None

    # -- systems and windows
    def train_system_ids(self, positions: np.ndarray, seed: int) -> np.ndarray:
        """Training system id at each position of the endless walk (every epoch visits every system once)."""
        n, B = self.task.n_train_systems, self.task.block_systems
        positions = np.asarray(positions, dtype=np.int64)
        out = np.empty_like(positions)
        for k, p in enumerate(positions):
            epoch, j = divmod(int(p), n)
            block = self._permutation(seed, epoch, -1, n // B)[j // B]
            out[k] = block * B + self._permutation(seed, epoch, block, B)[j % B]
        return out

    def _permutation(self, seed: int, epoch: int, block: int, size: int) -> np.ndarray:
        """The walk's block order (``block=-1``) or a block's system order in ``epoch`` (last few cached)."""
        key = (seed, epoch, block)
        if key not in self._orders:
            self._orders[key] = _rng(ORDER_STREAM, seed, epoch, block + 1).permutation(size)
            while len(self._orders) > 4 * self._cache_blocks:
                self._orders.popitem(last=False)
        return self._orders[key]

    def system_params(self, split: str, seed: int, system_id: int) -> SystemParams:
        """The parameters of system ``system_id`` of ``split`` (``train``, ``val``, ``probe_train``, ``probe_test``)."""
        if split in ("train", "val"):
            return draw_system(self.task, _rng(TRAIN_STREAM if split == "train" else VAL_STREAM, seed, system_id))
        if split.startswith("probe_") and split[6:] in PROBE_STREAMS:
            return draw_two_body(self.task, _rng(PROBE_STREAMS[split[6:]], seed, system_id))
        raise UserError(f"split={split!r} is not allowed: use train, val, probe_train or probe_test")

    def block(self, split: str, seed: int, block: int, n_tokens: int) -> "TokenBlock":
        """Block ``block`` of ``split``: its systems' first ``n_tokens`` (or more) body tokens, cached."""
        key = (split, int(seed), int(block))
        hit = self._cache.get(key)
        if hit is not None and hit.n_tokens >= n_tokens:
            self._cache.move_to_end(key)
            return hit
        B = self.task.block_systems
        params = [self.system_params(split, seed, block * B + i) for i in range(B)]
        n_bodies = np.array([len(p.masses) + 1 for p in params])
        simulated = simulate_params(self.task, params, obs_needed(n_bodies, n_tokens))
        result = TokenBlock.from_simulation(self.task, simulated, n_tokens, with_forces=split.startswith("probe_"))
        self._cache[key] = result
        while len(self._cache) > self._cache_blocks:
            self._cache.popitem(last=False)
        return result

    def windows(self, split: str, seed: int, ids: np.ndarray, seq_len: int) -> np.ndarray:
        """``(len(ids), L + 1, 2)`` int64 windows of the given systems: the dt token, then L body tokens."""
        B = self.task.block_systems
        out = np.empty((len(ids), seq_len + 1, 2), dtype=np.int64)
        for k, sid in enumerate(np.asarray(ids, dtype=np.int64)):
            blk = self.block(split, seed, int(sid) // B, seq_len)
            s = int(sid) % B
            out[k, 0] = self.dt_token(blk.dt_index[s])
            out[k, 1:] = blk.tokens[s, :seq_len]
        return out

    def probe_set(self, split: str, n_sequences: int, seq_len: int, seed: int = 0) -> ProbeSet:
        """Force-probe sequences from two-body systems ``0..n_sequences-1`` of ``probe_train``/``probe_test``."""
        if split not in PROBE_STREAMS:
            raise UserError(f"probe split={split!r} is not allowed: use train or test")
        self._check(seq_len, seed)
        if isinstance(n_sequences, bool) or not isinstance(n_sequences, (int, np.integer)) or n_sequences < 1:
            raise UserError(f"n_sequences={n_sequences!r} is not allowed: use a positive integer")
        B = self.task.block_systems
        L1 = seq_len + 1
        tokens = np.empty((n_sequences, L1, 2), dtype=np.int64)
        force = np.full((n_sequences, L1), np.nan)
        body = np.full((n_sequences, L1), -1, dtype=np.int64)
        r = np.full((n_sequences, L1), np.nan)
        m_planet, m_star = np.empty(n_sequences), np.empty(n_sequences)
        for k in range(n_sequences):
            blk = self.block(f"probe_{split}", seed, k // B, seq_len)
            s = k % B
            tokens[k, 0] = self.dt_token(blk.dt_index[s])
            tokens[k, 1:] = blk.tokens[s, :seq_len]
            force[k, 1:] = blk.force[s, :seq_len]
            body[k, 1:] = np.arange(seq_len) % 2  # planet, star, planet, ...
            r[k, 1:] = blk.separation[s, :seq_len]
            m_planet[k], m_star[k] = blk.masses[s, 0], blk.masses[s, 1]
        return ProbeSet(tokens=tokens, force=force, body=body, r=r, m_planet=m_planet, m_star=m_star)

    def planet_counts(self, split: str = "train", seed: int = 0, n: int = 1000) -> dict[int, int]:
        """How many of the first ``n`` systems of ``split`` have each number of planets."""
        counts: dict[int, int] = {}
        for i in range(n):
            k = len(self.system_params(split, seed, i).masses)
            counts[k] = counts.get(k, 0) + 1
        return dict(sorted(counts.items()))

    def _check(self, seq_len: int, seed: int) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
            raise UserError(f"seq_len={seq_len!r} is not allowed for synthetic orbits: use a positive integer")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise UserError(f"data_seed={seed!r} is not allowed for synthetic orbits: use an integer >= 0")


def open_orbits(spec: dict[str, Any]) -> OrbitData:
    """``{synthetic: orbits, size: cpu|paper, <field>: <value>, ...}`` -> the source; UserError on bad input."""
    return OrbitData(orbit_task(spec))


def orbit_task(spec: dict[str, Any]) -> OrbitTask:
    """``{synthetic: orbits, size: cpu|paper, <field>: <value>, ...}`` -> the task's validated parameters (nothing
    is simulated); UserError on bad input."""
    if not isinstance(spec, dict) or spec.get("synthetic") != OrbitTask.name:
        raise UserError(f"data={spec!r} is not the orbit source: use a mapping like {{synthetic: orbits, size: cpu}}")
    params = {k: v for k, v in spec.items() if k != "synthetic"}
    if "size" in params and params["size"] not in SIZES:
        raise UserError(f"data.size={params['size']!r} is not allowed: use one of {', '.join(SIZES)}")
    return parse(OrbitTask, params, prefix="data")


__all__ = ["OrbitData", "OrbitTask", "ProbeSet", "SIZES", "SimulatedBlock", "SystemParams", "TokenBlock", "draw_system",
           "draw_two_body", "from_bins", "open_orbits", "orbit_task", "simulate_params", "to_bins"]
