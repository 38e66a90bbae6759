"""Which force law do a set of forces follow? Symbolic regression and a power-law fit against distance and masses.

Owns the last step of the orbit study (Vafa et al. 2025): given force magnitudes ``F`` at points ``(r, m1, m2)``
(a probe's predictions, or the true forces as a check), a :class:`ForceLaw` with a power-law fit
(:func:`fit_power_law`) and a gplearn expression ``F = f(r, m1, m2)``, its local exponents and how far it is
from Newton's ``G m1 m2 / r^2``.

It must never: train or run a model, touch tokens or torch, or import Ray.

Details: docs/orbits.md#the-force-law-fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from attnlab.errors import UserError
from attnlab.names import check_int

G_NEWTON = 4.0 * math.pi**2  # AU^3 yr^-2 Msun^-1
NEWTON_EXPONENTS = {"r": -2.0, "m1": 1.0, "m2": 1.0}
VARIABLES = ("r", "m1", "m2")
DEFAULT_OPERATORS = ("add", "mul", "inv", "sin", "cos", "exp")  # Vafa et al.'s PySR set: + * sin cos exp inv
ALLOWED_OPERATORS = ("add", "sub", "mul", "div", "inv", "sin", "cos", "exp", "log", "sqrt", "neg", "abs")
DEFAULT_TOLERANCE = 0.1


@dataclass(frozen=True)
class PowerLaw:
    """``F = exp(log_coef) * m1^exp_m1 * m2^exp_m2 * r^exp_r``, fitted in log space."""

    exp_r: float
    exp_m1: float
    exp_m2: float
    log_coef: float
    rmse_log: float  # residual RMS of log F (nats)
    r2: float  # of log F

    @property
    def coef(self) -> float:
        return math.exp(self.log_coef)

    @property
    def newton_distance(self) -> float:
        return exponent_distance(self.exp_r, self.exp_m1, self.exp_m2)


@dataclass(frozen=True)
class ForceLaw:
    """What a set of forces says about the force law (docs/orbits.md#the-force-law-fit)."""

    expression: str  # the symbolic-regression law in r, m1, m2, e.g. "39.48*m1*m2/r**2"
    program: str  # gplearn's form on the scaled inputs (X0 = r, X1 = m1, X2 = m2 over their geometric means)
    complexity: int  # nodes in the program
    sr_error: float  # mean |log(f / F)| of the expression on the points (nats; 0.01 ~ 1%)
    sr_exp_r: float
    sr_exp_m1: float
    sr_exp_m2: float
    sr_exp_spread: float  # the largest interquartile range of the three local exponents
    newton_distance: float  # from the SR exponents
    is_newton: bool
    power_law: PowerLaw
    n_points: int
    n_dropped: int  # points left out: non-positive or non-finite force


def exponent_distance(exp_r: float, exp_m1: float, exp_m2: float) -> float:
    """The largest deviation of the three exponents from Newton's ``(-2, 1, 1)``."""
    return max(abs(exp_r - NEWTON_EXPONENTS["r"]), abs(exp_m1 - NEWTON_EXPONENTS["m1"]),
               abs(exp_m2 - NEWTON_EXPONENTS["m2"]))


def _points(r, m1, m2, force) -> tuple[np.ndarray, np.ndarray, int]:
    arrays = [np.asarray(v, dtype=np.float64).reshape(-1) for v in (r, m1, m2, force)]
    n = len(arrays[0])
    for name, arr in zip(("r", "m1", "m2", "force"), arrays):
        if len(arr) != n:
            raise UserError(f"{name} has {len(arr)} values but r has {n}: give one value per point")
    X = np.stack(arrays[:3], axis=1)
    if not np.all(np.isfinite(X)) or np.any(X <= 0):
        raise UserError("r, m1 and m2 must be finite and positive at every point")
    F = arrays[3]
    keep = np.isfinite(F) & (F > 0)
    if keep.sum() < 10:
        raise UserError(f"force: only {int(keep.sum())} finite positive values; need at least 10 points")
    return X[keep], F[keep], int(n - keep.sum())


def fit_power_law(r, m1, m2, force) -> PowerLaw:
    """Least squares of ``log F`` on ``log m1, log m2, log r`` and a constant (non-positive forces dropped)."""
    X, F, _ = _points(r, m1, m2, force)
    design = np.column_stack([np.log(X[:, 1]), np.log(X[:, 2]), np.log(X[:, 0]), np.ones(len(F))])
    y = np.log(F)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    total = float(np.sum((y - y.mean()) ** 2))
    return PowerLaw(exp_r=float(coef[2]), exp_m1=float(coef[0]), exp_m2=float(coef[1]), log_coef=float(coef[3]),
                    rmse_log=float(np.sqrt(np.mean(resid**2))),
                    r2=float(1.0 - np.sum(resid**2) / total) if total > 0 else float("nan"))


# ---------------------------------------------------------------------------------------- gplearn pieces
def _protected_exp(x):
    return np.exp(np.clip(x, -50.0, 50.0))


def _log_ratio_error(y, y_pred, w):
    """Mean |log(c * y_pred / y)| with the best (median) constant c; 1e3 for non-positive or non-finite output."""
    with np.errstate(all="ignore"):
        if not np.all(np.isfinite(y_pred)) or np.any(y_pred <= 0):
            return 1e3
        d = np.log(y_pred) - np.log(y)
        return float(np.mean(np.abs(d - np.median(d))))


def _function_set(operators):
    from gplearn.functions import make_function

    bad = [op for op in operators if op not in ALLOWED_OPERATORS]
    if bad or not operators:
        raise UserError(f"operators={list(operators)!r} is not allowed: use names from {', '.join(ALLOWED_OPERATORS)}")
    exp = make_function(function=_protected_exp, name="exp", arity=1)
    return tuple(exp if op == "exp" else op for op in operators)


def _to_sympy(program, symbols):
    """A gplearn program (prefix list) as a sympy expression of ``symbols`` (X0, X1, X2)."""
    import sympy

    ops = {
        "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b, "div": lambda a, b: a / b,
        "inv": lambda a: 1 / a, "sin": sympy.sin, "cos": sympy.cos, "exp": sympy.exp,
        "log": lambda a: sympy.log(abs(a)),
        "sqrt": lambda a: sympy.sqrt(abs(a)), "neg": lambda a: -a, "abs": sympy.Abs,
    }
    stack: list = []
    for node in reversed(program.program):
        if isinstance(node, (int, np.integer)):
            stack.append(symbols[int(node)])
        elif isinstance(node, (float, np.floating)):
            stack.append(sympy.Float(float(node)))
        else:
            args = [stack.pop() for _ in range(node.arity)]
            stack.append(ops[node.name](*args))
    return stack[0]


def _local_exponents(program, Xs: np.ndarray, step: float = 1e-4) -> np.ndarray:
    """``d log f / d log x_k`` at every point ``(n, 3)`` by central differences in log space."""
    out = np.empty_like(Xs)
    for k in range(Xs.shape[1]):
        up, down = Xs.copy(), Xs.copy()
        up[:, k] *= math.exp(step)
        down[:, k] *= math.exp(-step)
        with np.errstate(all="ignore"):
            out[:, k] = (np.log(np.abs(program.execute(up))) - np.log(np.abs(program.execute(down)))) / (2 * step)
    return out


def fit_force_law(r, m1, m2, force, *, n_points: int = 1000, seed: int = 0, restarts: int = 3,
                  population: int = 1000, generations: int = 20, operators=DEFAULT_OPERATORS,
                  parsimony: float = 0.002, stop_at: float = 0.0, tolerance: float = DEFAULT_TOLERANCE) -> ForceLaw:
    """Symbolic regression and a power-law fit of ``force`` against ``(r, m1, m2)``.

    ``n_points``: a random subsample (seed ``seed``) of that many points (Vafa et al.: 1000); ``restarts``
    gplearn runs of ``population`` programs over ``generations`` generations, the best kept; ``stop_at``: stop
    a run once its error (mean |log ratio|) is at most this (0 = run every generation); ``tolerance``: how close
    to Newton's exponents counts as Newton. Non-positive or non-finite forces are left out (``n_dropped``).
    """
    import sympy
    from gplearn.fitness import make_fitness
    from gplearn.genetic import SymbolicRegressor

    for name, value, low in (("n_points", n_points, 10), ("restarts", restarts, 1), ("population", population, 10),
                             ("generations", generations, 1)):
        check_int(value, name, low)
    X, F, dropped = _points(r, m1, m2, force)
    rng = np.random.default_rng(seed)
    if len(F) > n_points:
        pick = np.sort(rng.choice(len(F), n_points, replace=False))
        X, F = X[pick], F[pick]
    x_scale = np.exp(np.log(X).mean(axis=0))
    f_scale = float(np.exp(np.log(F).mean()))
    Xs, ys = X / x_scale, F / f_scale

    metric = make_fitness(function=_log_ratio_error, greater_is_better=False, wrap=False)
    functions = _function_set(operators)
    best = None
    for restart in range(restarts):
        est = SymbolicRegressor(population_size=population, generations=generations, function_set=functions,
                                metric=metric, const_range=None, parsimony_coefficient=parsimony,
                                init_depth=(2, 5), stopping_criteria=stop_at, random_state=1000 * seed + restart,
                                n_jobs=1)
        est.fit(Xs, ys)
        program = est._program
        if best is None or (program.fitness_, program.length_) < (best.fitness_, best.length_):
            best = program

    pred = best.execute(Xs)
    with np.errstate(all="ignore"):
        ok = np.isfinite(pred) & (pred > 0)
        log_c = float(np.median(np.log(ys[ok]) - np.log(pred[ok]))) if ok.any() else float("nan")
        sr_error = float(np.mean(np.abs(np.log(pred[ok]) + log_c - np.log(ys[ok])))) if ok.all() else float("inf")
    local = _local_exponents(best, Xs)
    med = np.nanmedian(local, axis=0)
    q75, q25 = np.nanpercentile(local, [75, 25], axis=0)
    spread = float(np.max(q75 - q25))

    sym = sympy.symbols("X0 X1 X2")
    r_s, m1_s, m2_s = sympy.symbols("r m1 m2", positive=True)
    scaled = _to_sympy(best, sym)
    law = scaled.subs({sym[0]: r_s / float(x_scale[0]), sym[1]: m1_s / float(x_scale[1]),
                       sym[2]: m2_s / float(x_scale[2])})
    law = law * float(np.exp(log_c) * f_scale) if np.isfinite(log_c) else law
    try:
        law = sympy.simplify(law)
    except Exception:  # noqa: BLE001 - a display nicety; the unsimplified law is still right
        pass
    law = law.xreplace({f: sympy.Float(f, 4) for f in law.atoms(sympy.Float)})  # 4 significant digits
    distance = exponent_distance(*med)
    return ForceLaw(
        expression=str(law), program=str(best), complexity=int(best.length_), sr_error=sr_error,
        sr_exp_r=float(med[0]), sr_exp_m1=float(med[1]), sr_exp_m2=float(med[2]), sr_exp_spread=spread,
        newton_distance=float(distance), is_newton=bool(distance <= tolerance and spread <= tolerance),
        power_law=fit_power_law(X[:, 0], X[:, 1], X[:, 2], F), n_points=int(len(F)), n_dropped=dropped)


__all__ = ["DEFAULT_OPERATORS", "ForceLaw", "G_NEWTON", "NEWTON_EXPONENTS", "PowerLaw", "exponent_distance",
           "fit_force_law", "fit_power_law"]
