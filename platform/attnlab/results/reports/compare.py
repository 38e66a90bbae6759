"""Comparing two configurations at one length: the difference of means, Welch's t test and an exact
permutation test (:mod:`attnlab.results.stats`), and a plain verdict (``attnlab results compare``).

Pure: no Ray, no store access, no network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from attnlab.errors import UserError
from attnlab.names import is_missing
import attnlab.results.stats as _stats_mod
from attnlab.results.schema import CONFIG_COLUMNS, METRICS, metric_bounds
from attnlab.results.reports.rows import (
    CONFIDENCE, SINGLE_RUN, _config_columns, _seed_values, _sort_key, _train_len, format_value, length_label, select,
)
from attnlab.results.reports.table import _number
from attnlab.results.reports.best import _rows_at


# ---------------------------------------------------------------------------------------- compare
@dataclass
class Comparison:
    """The difference ``b - a`` of one metric at one eval length between two configurations, with its test.

    ``a_values``/``b_values`` are the per-run ``(seed, value)`` pairs used (NaN values, diverged runs, are left
    out and listed in ``notes``). ``test`` is None when either side has fewer than 2 runs. ``significant`` is
    Welch's two-sided p < ``alpha``; when Welch's t is undefined (no spread on either side) the permutation
    test decides; None when there is no test.
    """

    metric: str
    eval_len: int
    train_len: int | None
    step: object
    a: str                              # the --a text as given
    b: str
    a_config: dict                      # the configuration columns of each side that differ between them
    b_config: dict
    constants: dict                     # the configuration columns both sides share
    a_values: list
    b_values: list
    higher_is_better: bool
    confidence: float
    alpha: float
    test: _stats_mod.TestResult | None
    significant: bool | None
    verdict: str
    notes: list = field(default_factory=list)

    @property
    def n_a(self) -> int:
        return len(self.a_values)

    @property
    def n_b(self) -> int:
        return len(self.b_values)

    @property
    def mean_a(self) -> float:
        return float(np.mean([v for _, v in self.a_values])) if self.a_values else math.nan

    @property
    def mean_b(self) -> float:
        return float(np.mean([v for _, v in self.b_values])) if self.b_values else math.nan

    @property
    def diff(self) -> float:
        """mean(b) - mean(a)."""
        return self.mean_b - self.mean_a

    @property
    def ci(self) -> tuple[float, float]:
        """The Welch interval of ``diff`` (NaN, NaN without a test)."""
        return self.test.ci if self.test else (math.nan, math.nan)

    @property
    def p_value(self) -> float:
        """Welch's two-sided p (NaN without a test or when Welch's t is undefined)."""
        return self.test.p_welch if self.test else math.nan

    def to_text(self, digits: int = 4) -> str:
        return format_comparison(self, digits)


def _parse_side(text: str, flag: str) -> tuple[str, dict[str, str]]:
    """``ATTENTION[,COLUMN=VALUE...]`` -> (attention, {column: normalised value text})."""
    parts = [p.strip() for p in str(text).split(",")]
    if not parts[0] or "=" in parts[0]:
        raise UserError(f"{flag} {text!r}: start with the attention variant, e.g. {flag} lssar or "
                        f"{flag} lssar,p_eval=15")
    pins: dict[str, str] = {}
    for part in parts[1:]:
        name, sep, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise UserError(f"{flag} {text!r}: qualifiers are COLUMN=VALUE, e.g. {flag} {parts[0]},p_eval=15")
        if name not in CONFIG_COLUMNS and name != "study":
            raise UserError(f"{flag} {text!r}: {name!r} is not a configuration column; allowed: "
                            f"{', '.join(['study', *CONFIG_COLUMNS])}")
        pins[name] = _normalise(value)
    return parts[0], pins


def _normalise(text) -> str:
    """A value as the text reports show for it ("none", "15", "ntk"), so user text and stored values compare."""
    if isinstance(text, str):
        if text.strip().lower() == "none":
            return "none"
        try:
            return format_value(float(text))
        except ValueError:
            return text.strip()
    return format_value(text)


def _side_rows(picked: pd.DataFrame, all_rows: pd.DataFrame, spec: str, flag: str, metric: str,
               at, config_columns: list[str]) -> pd.DataFrame:
    attention, pins = _parse_side(spec, flag)
    where = f"at {at}"
    mine = picked[picked["attention"] == attention]
    if len(mine) == 0:
        elsewhere = all_rows[all_rows["attention"] == attention]
        if len(elsewhere):
            lengths = ", ".join(str(int(x)) for x in sorted(elsewhere["eval_len"].unique()))
            raise UserError(f"{flag} {attention!r}: no {metric!r} rows {where}; it has rows at eval lengths {lengths}")
        present = ", ".join(sorted(str(x) for x in all_rows["attention"].unique()))
        raise UserError(f"{flag} {attention!r}: no {metric!r} rows for that attention variant; variants present: "
                        f"{present}")
    for name, value in pins.items():
        if name not in mine.columns:
            raise UserError(f"{flag} {spec!r}: the rows have no {name!r} column")
        kept = mine[[_normalise(v) == value for v in mine[name].tolist()]]
        if len(kept) == 0:
            values = ", ".join(sorted({_normalise(v) for v in mine[name].tolist()}, key=str))
            raise UserError(f"{flag} {spec!r}: no rows with {name}={value} {where}; {name} values for "
                            f"{attention}: {values}")
        mine = kept
    varying = [c for c in config_columns if c in mine.columns and mine[c].nunique(dropna=False) > 1]
    if varying:
        configs = mine[varying].drop_duplicates()
        configs = configs.iloc[sorted(range(len(configs)),
                                      key=lambda i: tuple(_sort_key(configs.iloc[i][c]) for c in varying))]
        listed = "; ".join(", ".join(f"{c}={format_value(r[c])}" for c in varying) for _, r in configs.iterrows())
        first = configs.iloc[0]
        hint = ",".join(f"{c}={format_value(first[c])}" for c in varying)
        pins_flags = " ".join(f"--where {c}=VALUE" for c in varying)
        raise UserError(f"{flag} {spec!r} matches {len(configs)} configurations {where} ({listed}): pick one with "
                        f"{flag} {attention},{hint} (or {pins_flags} for both sides)")
    return mine


def _plain(value):
    """None for every spelling of missing; numpy scalars as Python numbers."""
    return None if is_missing(value) else (value.item() if isinstance(value, np.generic) else value)


def compare(df: pd.DataFrame, a: str, b: str, at, metric: str = "val_loss", step="final",
            confidence: float = CONFIDENCE, alpha: float = _stats_mod.ALPHA) -> Comparison:
    """Compare configuration ``b`` with configuration ``a`` on ``metric`` at one eval length ``at``.

    ``a`` and ``b`` name an attention variant, optionally pinned further with configuration columns:
    ``"lssar"``, ``"softmax,p_eval=15"``, ``"lssa,rope_scaling=none"``. Each must pick exactly one
    configuration among the rows (narrow ``df`` first, e.g. ``--where rope_scaling=none``); otherwise a
    one-line :class:`UserError` lists the configurations and how to pick one. ``at`` is a length
    (``1024``, ``"1k"``) or a multiple of the training length (``"16x"``).

    The difference is **b - a** (mean over runs, i.e. seeds). With at least 2 runs on each side it carries
    the Welch interval and Welch's two-sided t test, plus an exact permutation test
    (:func:`attnlab.results.stats.two_sample_test`); the verdict says plainly whether the difference is
    significant at ``alpha`` and when n is too small to test at all.
    """
    rows = select(df, metric, step)
    picked = _rows_at(rows, at, metric)
    config_columns, _ = _config_columns(rows)
    side_a = _side_rows(picked, rows, a, "--a", metric, at, config_columns)
    side_b = _side_rows(picked, rows, b, "--b", metric, at, config_columns)
    if set(side_a.index) == set(side_b.index):
        raise UserError(f"--a {a!r} and --b {b!r} pick the same configuration; compare two different ones")
    present = [c for c in config_columns if c in rows.columns]
    differing = [c for c in present if _normalise(side_a[c].iloc[0]) != _normalise(side_b[c].iloc[0])]
    a_config = {c: _plain(side_a[c].iloc[0]) for c in differing}
    b_config = {c: _plain(side_b[c].iloc[0]) for c in differing}
    constants = {c: _plain(side_a[c].iloc[0]) for c in present if c not in differing
                 and not (c in ("layer", "bucket", "preset", "data", "knobs") and is_missing(side_a[c].iloc[0]))}

    notes: list[str] = []
    values = {}
    for name, side in (("a", side_a), ("b", side_b)):
        pairs = list(_seed_values(side))
        bad = [s for s, v in pairs if not math.isfinite(v)]
        if bad:
            notes.append(f"{name}: left out {len(bad)} run(s) with a non-finite value (diverged): seed(s) "
                         f"{', '.join(str(s) for s in bad)}")
        values[name] = [(s, v) for s, v in pairs if math.isfinite(v)]
    higher = METRICS[metric].higher_is_better if metric in METRICS else False
    eval_len = int(side_a["eval_len"].iloc[0])
    train_len = _train_len(pd.concat([side_a, side_b]))

    test, significant = None, None
    n_a, n_b = len(values["a"]), len(values["b"])
    if n_a < 2 or n_b < 2:
        few = [f"{name} has n={n}" for name, n in (("a", n_a), ("b", n_b)) if n < 2]
        verdict = (f"no test: {' and '.join(few)}; a test needs at least 2 runs (seeds) on each side, so this "
                   f"difference cannot be told from run-to-run noise")
    else:
        test = _stats_mod.two_sample_test([v for _, v in values["a"]], [v for _, v in values["b"]], confidence,
                                          bounds=metric_bounds(metric))
        notes.extend(test.notes)
        if math.isnan(test.p_welch):
            if test.diff == 0:
                verdict = "no difference: every run on both sides gave the same value"
                significant = False
            else:
                significant = test.p_permutation < alpha
                verdict = (f"{'significant' if significant else 'not significant'} at the {100 * alpha:g}% level "
                           f"by the permutation test (p = {test.p_permutation:.3g}); Welch's t is undefined "
                           f"(no spread within either side)")
        else:
            significant = test.p_welch < alpha
            if significant:
                better = (test.diff > 0) == higher
                verdict = (f"significant at the {100 * alpha:g}% level (Welch p = {test.p_welch:.3g}): b is "
                           f"{'higher' if test.diff > 0 else 'lower'} than a ({'better' if better else 'worse'}"
                           f" for {metric}, {'higher' if higher else 'lower'} is better)")
            else:
                interval = (f"; the {100 * confidence:g}% interval includes 0"
                            if math.isclose(confidence, 1 - alpha) else "")
                verdict = (f"not significant at the {100 * alpha:g}% level (Welch p = {test.p_welch:.3g}{interval}): "
                           f"these runs cannot tell a from b")
        if test.min_p_permutation >= alpha:
            notes.append(f"with {n_a} vs {n_b} runs the exact permutation test cannot go below p = "
                         f"{test.min_p_permutation:.3g}, so on its own it can never reach the "
                         f"{100 * alpha:g}% level; more seeds are needed for a distribution-free test")
    return Comparison(metric=metric, eval_len=eval_len, train_len=train_len, step=step, a=str(a), b=str(b),
                      a_config=a_config, b_config=b_config, constants=constants, a_values=values["a"],
                      b_values=values["b"], higher_is_better=higher, confidence=confidence, alpha=alpha,
                      test=test, significant=significant, verdict=verdict, notes=notes)


def _signed(value: float, digits: int) -> str:
    return "nan" if math.isnan(value) else f"{value:+.{digits}f}"


def format_comparison(result: Comparison, digits: int = 4) -> str:
    """The comparison as a few lines of text: each side's runs, b - a with its interval, the tests, the verdict."""
    length = length_label(result.eval_len)
    if result.train_len:
        length += f" ({result.eval_len / result.train_len:g}x)"
    step = result.step
    step_text = "final step of each run" if step == "final" else ("all steps" if step in ("all", None) else f"step {step}")
    lines = [f"compare {result.metric} at {length} ({step_text}); difference = b - a "
             f"({'higher' if result.higher_is_better else 'lower'} is better)"]
    if result.constants:
        lines.append("constant: " + ", ".join(f"{k}={format_value(v)}" for k, v in result.constants.items()))
    percent = f"{100 * result.confidence:g}%"
    bounds = metric_bounds(result.metric)
    for name, spec, config, pairs in (("a", result.a, result.a_config, result.a_values),
                                      ("b", result.b, result.b_config, result.b_values)):
        label = ", ".join(f"{k}={format_value(v)}" for k, v in config.items()) or spec
        vals = np.array([v for _, v in pairs], dtype=float)
        if len(vals) == 0:
            summary = "no finite values"
        elif len(vals) == 1:
            summary = f"{_number(float(vals[0]), digits)} ({SINGLE_RUN})"
        elif _stats_mod.shows_seed_values(len(vals), bounds):  # too few runs for an interval inside the range
            summary = f"{_number(float(vals.mean()), digits)} (n={len(vals)}; no interval, see per seed)"
        else:
            low, high = _stats_mod.bounded_interval(vals, result.confidence, bounds)
            summary = (f"{_number(float(vals.mean()), digits)} ± {_number(float(vals.std(ddof=1)), digits)} "
                       f"(n={len(vals)}) [{percent} CI {_number(low, digits)}, {_number(high, digits)}]")
        seeds = ", ".join(f"{'?' if s is None else s}: {_number(v, digits)}" for s, v in pairs)
        lines.append(f"{name}: {label}: {summary}; per seed {seeds or '-'}")
    test = result.test
    if test is None:
        lines.append(f"b - a = {_signed(result.diff, digits)} (no interval, no test)")
    else:
        if math.isnan(test.p_welch):
            lines.append(f"b - a = {_signed(test.diff, digits)}; Welch's t undefined")
        else:
            lines.append(f"b - a = {_signed(test.diff, digits)}, {percent} CI [{_signed(test.ci[0], digits)}, "
                         f"{_signed(test.ci[1], digits)}] (Welch's t = {test.t:.3g}, df = {test.df:.3g}, "
                         f"p = {test.p_welch:.3g})")
        how = "exact over" if test.exact else "sampled,"
        lines.append(f"permutation test ({how} {test.permutation_splits} splits of the pooled runs): "
                     f"p = {test.p_permutation:.3g}")
    lines.append(f"verdict: {result.verdict}")
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)
