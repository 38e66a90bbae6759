"""Small-sample statistics for reports: a confidence interval per cell and a two-sample test per comparison.

What the reports use, and why (few seeds, typically 2-5 per configuration):

- **Cell interval**: the two-sided Student t interval of the mean over runs (seeds),
  ``mean ± t(1 - alpha/2, n - 1) · s / sqrt(n)`` with ``s`` the sample std (ddof=1). It assumes the runs are
  independent draws from a roughly normal distribution; with n = 2 it is very wide (t = 12.7), which is the
  honest answer. n < 2 gives no interval.
- **Comparison**: the difference of means ``b - a`` with the Welch-Satterthwaite t interval and Welch's
  two-sided t test (unequal variances; SciPy ``ttest_ind(equal_var=False)``), plus an exact two-sided
  permutation test of the difference of means over all splits of the pooled runs (SciPy
  ``permutation_test``), which needs no normality but cannot go below ``2 / C(n_a + n_b, n_a)`` (0.1 for
  3 vs 3 runs). Either side with fewer than 2 runs: no test (the result says so).
- **Bounded metrics** (accuracies in [0, 1], :data:`attnlab.results.schema.METRIC_BOUNDS`): a t interval knows
  nothing of the range, so with n = 2 an accuracy of 0.5 reads [-4.3, 5.3]. The rule, here and nowhere else:
  a cell with ``2 <= n <= SMALL_N`` runs shows its runs' own values instead of an interval
  (:func:`shows_seed_values`); otherwise the interval is clipped to the range (:func:`clip_interval`), and so
  are std error bars (:func:`clipped_bar`). A difference of two means may be negative: its interval is kept
  inside ``[-(high - low), high - low]`` (:func:`difference_bounds`). Unbounded metrics (losses) are untouched.

Pure numbers in, numbers out: this module never reads a results store, imports Ray, or plots. SciPy is
imported lazily so that importing the reports stays cheap.
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
