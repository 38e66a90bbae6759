"""The force probe of Vafa et al. 2025: does a model trained on orbits carry the Newtonian force, and which law
does the force it carries follow?

Owns the probe of a trained :class:`attnlab.model.orbit.OrbitGPT`: two-body sequences from its orbit source
(``OrbitData.probe_set``), the force magnitude on the body of every **planet** token predicted from the model's
hidden state there (:func:`finetune_force_probe`, Vafa et al.'s transfer, or the cheaper
:func:`linear_force_probe`), the symbolic fit of the **predicted** forces (:mod:`attnlab.evaluate.symbolic`)
and :func:`force_values`, a result's reported numbers (``attnlab.evaluate.cell_rows`` makes the rows).

It must never modify the model passed in (the fine-tune trains a copy), import Ray, the training loop or the
study runner, or write files.

Details: docs/orbits.md#what-a-trial-does (steps 4 and 5) and, for the probe's target and points,
docs/orbits.md#where-it-differs-from-vafa-et-al
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn

from attnlab.errors import UserError
from attnlab.model.scoring import autocast_context
from attnlab.names import check_int
from attnlab.results.schema import LAW_METRIC
from attnlab.evaluate.symbolic import ForceLaw, fit_force_law

KINDS = ("finetune", "linear")


@dataclass
class ProbeData:
    """Inputs and planet-token targets for the probe: ``tokens (n, L, 2)`` model inputs (dt token first);
    ``train_mask``/``test_mask (n, L)`` the planet tokens to fit on / to hold out; per token ``force``, ``r``;
    per sequence ``m_planet``, ``m_star``."""

    tokens: np.ndarray
    force: np.ndarray
    r: np.ndarray
    m_planet: np.ndarray
    m_star: np.ndarray
    train_mask: np.ndarray
    test_mask: np.ndarray


@dataclass
class ForceProbeResult:
    """What a force probe found. ``law``: symbolic regression on the predicted forces; ``oracle_law`` (when
    asked): the same on the true forces at the same points (what a perfect probe would give)."""

    kind: str
    law: ForceLaw
    probe_error: float  # mean |log(F_pred / F_true)| over held-out planet tokens (nats)
    probe_r2: float  # R^2 of log F over the held-out tokens
    n_train_points: int
    n_test_points: int
    seq_len: int
    seconds: float
    train_loss: float | None = None  # last fine-tuning loss (standardised log F, MSE); None for the linear probe
    oracle_law: ForceLaw | None = None
    points: dict = field(default_factory=dict, repr=False)  # held-out r, m1, m2, f_true, f_pred arrays


def probe_data(source, *, seq_len: int, n_train: int, n_test: int, test_shots: int = 2, seed: int = 0) -> ProbeData:
    """Probe-train sequences (every planet token a target) and probe-test sequences (``test_shots`` planet
    tokens of each are targets too, the rest held out), of ``seq_len`` input tokens."""
    for name, value, low in (("n_train", n_train, 1), ("n_test", n_test, 1), ("test_shots", test_shots, 0),
                             ("seq_len", seq_len, 2)):
        check_int(value, name, low)
    train = source.probe_set("train", n_train, seq_len, seed=seed)
    test = source.probe_set("test", n_test, seq_len, seed=seed)
    planet_train = train.body[:, :seq_len] == 0
    planet_test = test.body[:, :seq_len] == 0
    if test_shots >= planet_test.sum(axis=1).min():
        raise UserError(f"test_shots={test_shots} leaves no held-out planet token in sequences of {seq_len} tokens: "
                        f"use test_shots < {int(planet_test.sum(axis=1).min())}")
    shots = np.zeros_like(planet_test)
    rng = np.random.default_rng(seed)
    for i in range(n_test):
        shots[i, rng.choice(np.nonzero(planet_test[i])[0], test_shots, replace=False)] = True
    cat = np.concatenate
    return ProbeData(
        tokens=cat([train.tokens[:, :seq_len], test.tokens[:, :seq_len]]),
        force=cat([train.force[:, :seq_len], test.force[:, :seq_len]]),
        r=cat([train.r[:, :seq_len], test.r[:, :seq_len]]),
        m_planet=cat([train.m_planet, test.m_planet]), m_star=cat([train.m_star, test.m_star]),
        train_mask=cat([planet_train, shots]),
        test_mask=cat([np.zeros_like(planet_train), planet_test & ~shots]))


class ForceHead(nn.Module):
    """A model's final hidden state -> one number per token (the standardised log force)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.head = nn.Linear(model.cfg.n_embd, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.model.hidden_states(idx)).squeeze(-1)


@torch.no_grad()
def _hidden(model, tokens: np.ndarray, device, batch_size: int) -> np.ndarray:
    out = []
    for i in range(0, len(tokens), batch_size):
        x = torch.as_tensor(tokens[i:i + batch_size], device=device)
        with autocast_context(device, "auto"):
            out.append(model.hidden_states(x).float().cpu().numpy())
    return np.concatenate(out)


def _finish(kind, data: ProbeData, log_pred: np.ndarray, *, seq_len, started, train_loss, n_points, seed,
            oracle, sr_kwargs) -> ForceProbeResult:
    """Held-out points, probe error and the symbolic regression of the predicted forces."""
    test = data.test_mask
    rows = np.nonzero(test)[0]
    f_true = data.force[test]
    f_pred = np.exp(log_pred[test])
    r = data.r[test]
    m1, m2 = data.m_planet[rows], data.m_star[rows]
    log_true = np.log(f_true)
    err = np.abs(log_pred[test] - log_true)
    total = float(np.sum((log_true - log_true.mean()) ** 2))
    r2 = float(1.0 - np.sum((log_pred[test] - log_true) ** 2) / total) if total > 0 else float("nan")
    kwargs = dict(n_points=n_points, seed=seed, **(sr_kwargs or {}))
    law = fit_force_law(r, m1, m2, f_pred, **kwargs)
    oracle_law = fit_force_law(r, m1, m2, f_true, **kwargs) if oracle else None
    return ForceProbeResult(
        kind=kind, law=law, probe_error=float(err.mean()), probe_r2=r2, n_train_points=int(data.train_mask.sum()),
        n_test_points=int(test.sum()), seq_len=seq_len, seconds=time.perf_counter() - started,
        train_loss=train_loss, oracle_law=oracle_law,
        points=dict(r=r, m1=m1, m2=m2, f_true=f_true, f_pred=f_pred))


def _standardise(data: ProbeData):
    logf = np.log(np.where(data.train_mask | data.test_mask, data.force, 1.0))
    mu, sigma = float(logf[data.train_mask].mean()), float(logf[data.train_mask].std() or 1.0)
    return logf, mu, sigma


def finetune_force_probe(model, source, *, seq_len: int | None = None, n_train: int = 256, n_test: int = 64,
                         test_shots: int = 2, steps: int = 200, batch_size: int = 16, lr: float = 3e-4,
                         seed: int = 0, n_points: int = 1000, oracle: bool = False, sr_kwargs: dict | None = None,
                         device=None) -> ForceProbeResult:
    """Fine-tune a copy of ``model`` + a linear force head on the probe targets (MSE on standardised log F,
    AdamW, ``steps`` steps of ``batch_size`` sequences), then symbolic regression of its held-out predictions.

    Vafa et al.: ``n_train = 9000``, ``n_test = 1000``, ``test_shots = 2``, 10k steps at batch 64.
    """
    started = time.perf_counter()
    seq_len = int(seq_len or model.cfg.train_len)
    check_int(steps, "steps", 1)
    check_int(batch_size, "batch_size", 1)
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise UserError(f"lr={lr!r} is not allowed: use a positive number")
    data = probe_data(source, seq_len=seq_len, n_train=n_train, n_test=n_test, test_shots=test_shots, seed=seed)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    logf, mu, sigma = _standardise(data)
    target = torch.as_tensor((logf - mu) / sigma, dtype=torch.float32)
    mask = torch.as_tensor(data.train_mask)
    tokens = torch.as_tensor(data.tokens)
    rows = np.nonzero(data.train_mask.any(axis=1))[0]

    torch.manual_seed(seed)
    probe = ForceHead(copy.deepcopy(model)).to(device)
    probe.train()
    opt = torch.optim.AdamW(probe.parameters(), lr=lr, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    loss_value = float("nan")
    for _ in range(steps):
        pick = torch.as_tensor(rng.choice(rows, size=min(batch_size, len(rows)), replace=False))
        x, y, m = tokens[pick].to(device), target[pick].to(device), mask[pick].to(device)
        with autocast_context(device, "auto"):
            pred = probe(x).float()
        loss = ((pred - y) ** 2 * m).sum() / m.sum().clamp_min(1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_value = float(loss.detach())
    probe.eval()
    with torch.no_grad():
        preds = []
        for i in range(0, len(tokens), batch_size):
            with autocast_context(device, "auto"):
                preds.append(probe(tokens[i:i + batch_size].to(device)).float().cpu().numpy())
    log_pred = np.concatenate(preds) * sigma + mu
    return _finish("finetune", data, log_pred, seq_len=seq_len, started=started, train_loss=loss_value,
                   n_points=n_points, seed=seed, oracle=oracle, sr_kwargs=sr_kwargs)


def linear_force_probe(model, source, *, seq_len: int | None = None, n_train: int = 256, n_test: int = 64,
                       test_shots: int = 2, alpha: float = 1.0, seed: int = 0, n_points: int = 1000,
                       oracle: bool = False, sr_kwargs: dict | None = None, batch_size: int = 16,
                       device=None) -> ForceProbeResult:
    """Ridge regression (penalty ``alpha`` on standardised features) from the frozen model's final hidden
    states to the standardised log force, then symbolic regression of its held-out predictions."""
    started = time.perf_counter()
    seq_len = int(seq_len or model.cfg.train_len)
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha >= 0):
        raise UserError(f"alpha={alpha!r} is not allowed: use a number >= 0")
    data = probe_data(source, seq_len=seq_len, n_train=n_train, n_test=n_test, test_shots=test_shots, seed=seed)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        hidden = _hidden(model, data.tokens, device, batch_size).astype(np.float64)
    finally:
        model.train(was_training)
    logf, mu, sigma = _standardise(data)
    H = hidden[data.train_mask]
    h_mu, h_sd = H.mean(axis=0), H.std(axis=0) + 1e-8
    Z = (H - h_mu) / h_sd
    y = (logf[data.train_mask] - mu) / sigma
    w = np.linalg.solve(Z.T @ Z + alpha * np.eye(Z.shape[1]), Z.T @ (y - y.mean()))
    log_pred = (((hidden - h_mu) / h_sd) @ w + y.mean()) * sigma + mu
    return _finish("linear", data, log_pred, seq_len=seq_len, started=started, train_loss=None,
                   n_points=n_points, seed=seed, oracle=oracle, sr_kwargs=sr_kwargs)


# ---------------------------------------------------------------------------------------- what is reported
FORCE_METRICS = ("force_probe_err", "force_probe_r2", "force_sr_err", "force_exp_r", "force_exp_m1", "force_exp_m2",
                 "force_exp_spread", LAW_METRIC, "force_is_newton", "force_pl_exp_r", "force_pl_exp_m1",
                 "force_pl_exp_m2", "force_pl_rmse", "force_pl_newton_dist")  # registered in attnlab.results.schema


def force_values(result: ForceProbeResult) -> dict[str, tuple[float, int]]:
    """``{metric: (value, n_points)}`` for every metric of :data:`FORCE_METRICS` (in that order)."""
    law, pl = result.law, result.law.power_law
    values = {
        "force_probe_err": (result.probe_error, result.n_test_points),
        "force_probe_r2": (result.probe_r2, result.n_test_points),
        "force_sr_err": (law.sr_error, law.n_points),
        "force_exp_r": (law.sr_exp_r, law.n_points),
        "force_exp_m1": (law.sr_exp_m1, law.n_points),
        "force_exp_m2": (law.sr_exp_m2, law.n_points),
        "force_exp_spread": (law.sr_exp_spread, law.n_points),
        LAW_METRIC: (law.newton_distance, law.n_points),
        "force_is_newton": (float(law.is_newton), law.n_points),
        "force_pl_exp_r": (pl.exp_r, law.n_points),
        "force_pl_exp_m1": (pl.exp_m1, law.n_points),
        "force_pl_exp_m2": (pl.exp_m2, law.n_points),
        "force_pl_rmse": (pl.rmse_log, law.n_points),
        "force_pl_newton_dist": (pl.newton_distance, law.n_points),
    }
    return {name: values[name] for name in FORCE_METRICS}


__all__ = ["FORCE_METRICS", "ForceHead", "ForceProbeResult", "KINDS", "ProbeData",
           "finetune_force_probe", "force_values", "linear_force_probe", "probe_data"]
