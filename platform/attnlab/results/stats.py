"""Small-sample statistics for reports (few seeds, typically 2-5 per configuration): a confidence interval per
cell, a two-sample or paired test per comparison, Holm's correction for a family, and what a design can detect.

Owns the numbers behind every interval and verdict: the Student t interval of a cell (:func:`t_interval`), Welch's t
with an exact permutation test (:func:`two_sample_test`), the paired t with an exact sign-flip test
(:func:`paired_test`), :func:`holm` and :func:`detectable_difference`. It is also the one home of the rule for
bounded metrics (accuracies in [0, 1]): a cell of ``2 <= n <= SMALL_N`` runs shows its runs' values
(:func:`shows_seed_values`); otherwise intervals and error bars are clipped to the range (:func:`clip_interval`,
:func:`clipped_bar`, :func:`difference_bounds`). Unbounded metrics (losses) are untouched.

Pure numbers in, numbers out: it must never read a results store, import Ray, or plot. SciPy is imported lazily so
that importing the reports stays cheap.

Details: docs/protocol.md#reports-and-statistics (the formulas, their assumptions and floors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

CONFIDENCE = 0.95
ALPHA = 0.05
# Exact permutation tests enumerate C(n_a + n_b, n_a) splits; above this many, SciPy samples this many.
MAX_EXACT_SPLITS = 100_000


def t_interval(values, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Student t interval of the mean of ``values`` (NaN, NaN when n < 2 or any value is NaN)."""
    values = np.asarray(values, dtype=float)
    n = len(values)
    if n < 2 or not np.all(np.isfinite(values)):
        return (math.nan, math.nan)
    from scipy.special import stdtrit  # the t quantile scipy.stats.t.ppf returns, without importing scipy.stats

    mean = float(np.mean(values))
    half = float(stdtrit(n - 1, 0.5 + confidence / 2)) * float(np.std(values, ddof=1)) / math.sqrt(n)
    return (mean - half, mean + half)


# At or below this many runs a bounded metric's cell lists its runs' values instead of a t interval.
SMALL_N = 3


def clip_interval(low: float, high: float, bounds: tuple[float, float] | None) -> tuple[float, float]:
    """``(low, high)`` clipped to ``bounds`` (``(lo, hi)`` or None = unbounded); NaN stays NaN."""
    if bounds is None:
        return (low, high)
    lo, hi = bounds

    def clip(x: float) -> float:
        return x if math.isnan(x) else min(max(x, lo), hi)

    return (clip(float(low)), clip(float(high)))


def bounded_interval(values, confidence: float = CONFIDENCE,
                     bounds: tuple[float, float] | None = None) -> tuple[float, float]:
    """:func:`t_interval` of ``values`` clipped to the metric's ``bounds`` (None: the plain t interval)."""
    return clip_interval(*t_interval(values, confidence), bounds)


def difference_bounds(bounds: tuple[float, float] | None) -> tuple[float, float] | None:
    """The range of a difference of two means of a metric bounded by ``bounds``: ``[-(hi - lo), hi - lo]``."""
    if bounds is None:
        return None
    width = bounds[1] - bounds[0]
    return (-width, width)


def shows_seed_values(n: int, bounds: tuple[float, float] | None) -> bool:
    """Whether a cell of ``n`` runs of a metric bounded by ``bounds`` shows its runs' values, not an interval."""
    return bounds is not None and 2 <= int(n) <= SMALL_N


def clipped_bar(mean: float, err: float, bounds: tuple[float, float] | None) -> tuple[float, float]:
    """``(below, above)`` lengths of a ``mean ± err`` error bar kept inside ``bounds`` (never negative)."""
    if bounds is None or math.isnan(mean):
        return (err, err)
    return (max(0.0, min(err, mean - bounds[0])), max(0.0, min(err, bounds[1] - mean)))


@dataclass
class TestResult:
    """Welch's t and the exact permutation test for the difference of means ``b - a``."""

    diff: float                       # mean(b) - mean(a)
    ci: tuple[float, float]           # Welch-Satterthwaite interval of diff (NaN, NaN when undefined; clipped to
                                      # difference_bounds(bounds) for a bounded metric)
    t: float                          # Welch t statistic (NaN when undefined)
    df: float                         # Welch-Satterthwaite degrees of freedom
    p_welch: float                    # two-sided p of Welch's t (NaN when undefined)
    p_permutation: float              # two-sided p of the exact permutation test
    permutation_splits: int           # number of splits enumerated (or resamples drawn)
    min_p_permutation: float          # the smallest p the permutation test can give with these n
    exact: bool = True                # all splits enumerated (else MAX_EXACT_SPLITS sampled)
    notes: list[str] = field(default_factory=list)


def two_sample_test(a, b, confidence: float = CONFIDENCE, bounds: tuple[float, float] | None = None) -> TestResult:
    """Welch's t test, its interval and the permutation test of ``mean(b) - mean(a)``.

    ``bounds``: the metric's range (None = unbounded); the interval of the difference is then kept inside
    :func:`difference_bounds` (it may still be negative).

    Both samples need at least 2 finite values (the caller checks and says so). When neither sample has any
    spread the t statistic is undefined: ``t``, ``p_welch`` and ``ci`` are NaN and a note says why; the
    permutation test still runs.
    """
    from scipy import stats

    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    if len(a) < 2 or len(b) < 2:
        raise ValueError("two_sample_test needs at least 2 values on each side")
    diff = float(np.mean(b) - np.mean(a))
    notes: list[str] = []
    var_a, var_b = float(np.var(a, ddof=1)), float(np.var(b, ddof=1))
    if var_a == 0.0 and var_b == 0.0:
        t = df = p_welch = math.nan
        ci = (math.nan, math.nan)
        notes.append("no spread within either side: Welch's t is undefined")
    else:
        result = stats.ttest_ind(b, a, equal_var=False)
        t, p_welch = float(result.statistic), float(result.pvalue)
        df = float(result.df)
        low, high = result.confidence_interval(confidence)
        ci = clip_interval(float(low), float(high), difference_bounds(bounds))

    splits = math.comb(len(a) + len(b), len(a))
    exact = splits <= MAX_EXACT_SPLITS
    permutation = stats.permutation_test(
        (b, a), lambda x, y, axis: np.mean(x, axis=axis) - np.mean(y, axis=axis),
        permutation_type="independent", alternative="two-sided", vectorized=True,
        n_resamples=math.inf if exact else MAX_EXACT_SPLITS, rng=np.random.default_rng(0),
    )
    if not exact:
        notes.append(f"permutation test sampled {MAX_EXACT_SPLITS} of {splits} splits")
    # SciPy's two-sided p doubles the smaller tail, so the smallest attainable value is 2 / splits.
    return TestResult(diff=diff, ci=ci, t=t, df=df, p_welch=p_welch,
                      p_permutation=float(permutation.pvalue),
                      permutation_splits=splits if exact else MAX_EXACT_SPLITS,
                      min_p_permutation=min(1.0, 2.0 / splits), exact=exact, notes=notes)


# ---------------------------------------------------------------------------------------- paired designs
POWER = 0.8  # the power at which a design's detectable difference is given


@dataclass
class PairedResult:
    """The paired t test and the exact sign-flip permutation test of ``b - a`` over matched runs (pairs).

    Two runs pair when their design ties them: the children of one parent (the same weights fine-tuned two ways), a
    parent and its own child, or two runs of one seed (the same data order and initial draw). The test is then on
    the pairs' differences, which the shared part no longer varies.
    """

    diff: float                       # mean of b_i - a_i (= mean(b) - mean(a))
    ci: tuple[float, float]           # the paired t interval of diff (NaN, NaN when undefined)
    t: float                          # paired t statistic (NaN when the differences have no spread)
    df: float                         # n_pairs - 1
    p_t: float                        # two-sided p of the paired t (NaN when undefined)
    p_sign_flip: float                # two-sided p of the exact sign-flip permutation test
    assignments: int                  # sign assignments enumerated (2^n) or sampled
    min_p_sign_flip: float            # the smallest p the sign-flip test can give with these n pairs
    n_pairs: int
    sd_diff: float                    # sample std of the differences
    exact: bool = True
    notes: list[str] = field(default_factory=list)


def sign_flip_test(differences) -> tuple[float, int, bool]:
    """``(p, assignments, exact)``: the two-sided exact sign-flip permutation test of a mean difference of zero,
    over every assignment of signs to the paired differences (2^n; above :data:`MAX_EXACT_SPLITS`, that many
    sampled with a fixed seed). ``p`` counts the assignments whose |mean| is at least the observed one, so its floor
    is ``2 / 2^n`` (0.0625 with 5 pairs, 0.125 with 4)."""
    d = np.asarray(differences, dtype=float)
    n = len(d)
    observed = abs(float(np.mean(d)))
    total = 2 ** n
    exact = total <= MAX_EXACT_SPLITS
    if exact:
        signs = 1 - 2 * ((np.arange(total)[:, None] >> np.arange(n)) & 1)
    else:
        signs = np.random.default_rng(0).choice([-1, 1], size=(MAX_EXACT_SPLITS, n))
    means = np.abs((signs * d).mean(axis=1))
    tolerance = 1e-12 * max(1.0, observed)  # ties in floating point count as at least as extreme
    return float(np.mean(means >= observed - tolerance)), (total if exact else MAX_EXACT_SPLITS), exact


def paired_test(a, b, confidence: float = CONFIDENCE, bounds: tuple[float, float] | None = None) -> PairedResult:
    """The paired t test and interval, and the exact sign-flip test, of ``b_i - a_i`` (``a`` and ``b`` in pair
    order, at least 2 pairs). ``bounds``: the metric's range; the interval is kept inside
    :func:`difference_bounds`."""
    from scipy import stats

    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    if len(a) != len(b) or len(a) < 2:
        raise ValueError("paired_test needs two samples of the same length, at least 2 pairs")
    d = b - a
    n = len(d)
    diff = float(np.mean(d))
    sd = float(np.std(d, ddof=1))
    notes: list[str] = []
    if sd == 0.0:
        t = p_t = math.nan
        ci = (math.nan, math.nan)
        notes.append("the paired differences have no spread: the paired t is undefined")
    else:
        result = stats.ttest_1samp(d, 0.0)
        t, p_t = float(result.statistic), float(result.pvalue)
        low, high = result.confidence_interval(confidence)
        ci = clip_interval(float(low), float(high), difference_bounds(bounds))
    p_flip, assignments, exact = sign_flip_test(d)
    if not exact:
        notes.append(f"sign-flip test sampled {MAX_EXACT_SPLITS} of {2 ** n} sign assignments")
    return PairedResult(diff=diff, ci=ci, t=t, df=float(n - 1), p_t=p_t, p_sign_flip=p_flip, assignments=assignments,
                        min_p_sign_flip=min(1.0, 2.0 / 2 ** n), n_pairs=n, sd_diff=sd, exact=exact, notes=notes)


def holm(p_values) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979), in the order given: the i-th smallest p times ``(m - i + 1)``,
    made non-decreasing in that order and capped at 1. A comparison is significant in the family at ``alpha`` when
    its adjusted p is below ``alpha``: that controls the chance of any false verdict among the m at ``alpha``. NaN
    (no test) stays NaN and does not count in m."""
    values = [float(p) for p in p_values]
    tested = sorted((p, i) for i, p in enumerate(values) if not math.isnan(p))
    m = len(tested)
    out = [math.nan] * len(values)
    running = 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


def detectable_difference(se: float, df: float, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest true difference a two-sided t test of standard error ``se`` and ``df`` degrees of freedom finds
    at level ``alpha`` with probability ``power`` (the noncentral t's power, solved for the difference): what a
    design with this spread could have told apart. NaN when ``se`` or ``df`` is undefined or zero."""
    if not (math.isfinite(se) and se > 0 and math.isfinite(df) and df > 0):
        return math.nan
    from scipy import optimize, stats

    critical = float(stats.t.ppf(1 - alpha / 2, df))

    def shortfall(delta: float) -> float:
        ncp = delta / se
        wrong_side = float(stats.nct.cdf(-critical, df, ncp))  # negligible, and NaN in SciPy far out in the tail
        return float(stats.nct.sf(critical, df, ncp)) + (0.0 if math.isnan(wrong_side) else wrong_side) - power

    high = se * critical
    while shortfall(high) < 0:  # the power grows with the difference: widen the bracket until it passes
        high *= 1.5
    return float(optimize.brentq(shortfall, 0.0, high, xtol=1e-9 * se))


def welch_standard_error(a, b) -> tuple[float, float]:
    """``(se, df)`` of the difference of two means with unequal variances (Welch-Satterthwaite)."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    va, vb = float(np.var(a, ddof=1)) / len(a), float(np.var(b, ddof=1)) / len(b)
    if va + vb == 0:
        return 0.0, math.nan
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return math.sqrt(va + vb), df
