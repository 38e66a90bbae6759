"""Comparing configurations at one length: the difference of means, Welch's t test and an exact permutation test,
or, when the design pairs the runs (the same seeds; children of one parent), the paired t and the exact sign-flip
test (:mod:`attnlab.results.stats`); the smallest difference the design detects with 80% power; a family of
comparisons with Holm's correction; and a plain verdict (``attnlab results compare``).

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
    out and listed in ``notes``). ``test`` (Welch's t and the permutation test of independent samples) is None when
    either side has fewer than 2 runs. ``paired`` is the paired t and sign-flip test when the design pairs the runs
    (``pairing``: ``parent`` when the two runs of a seed share the run they started from, or one is the other's
    parent; ``seed`` when they share only the seed: its data order and initial draw). The deciding test is the paired
    one when there is one, else Welch's; its p is :attr:`p_value`, and ``significant`` is that p below ``alpha``
    (the exact permutation test decides when the t is undefined, having no spread). ``detectable`` is the smallest
    difference the design finds with 80% power at ``detectable_alpha`` (:func:`attnlab.results.stats.
    detectable_difference`, from the spread measured): a difference below it that is not significant is no evidence
    of equality. In a family (:func:`compare_family`) ``p_adjusted`` is its Holm-adjusted p and ``significant`` is
    decided on it.
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
    paired: _stats_mod.PairedResult | None = None
    pairing: str | None = None          # parent, seed, or None (independent samples)
    detectable: float = math.nan        # the smallest difference found with 80% power at detectable_alpha
    detectable_alpha: float = _stats_mod.ALPHA
    p_adjusted: float | None = None     # Holm-adjusted p in a family (None: a comparison on its own)
    family_size: int = 1
    at: str = ""                        # the --at text as given

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
        """The deciding test's interval of ``diff``: the paired t's, else Welch's (NaN, NaN without a test)."""
        if self.paired is not None:
            return self.paired.ci
        return self.test.ci if self.test else (math.nan, math.nan)

    @property
    def p_value(self) -> float:
        """The deciding test's two-sided p: the paired t's, else Welch's (NaN without a test or when the t is
        undefined)."""
        if self.paired is not None:
            return self.paired.p_t
        return self.test.p_welch if self.test else math.nan

    @property
    def p_decided(self) -> float:
        """The p the verdict rests on: :attr:`p_value`, or the exact permutation test's when the t is undefined."""
        if not math.isnan(self.p_value):
            return self.p_value
        if self.paired is not None:
            return self.paired.p_sign_flip
        return self.test.p_permutation if self.test else math.nan

    @property
    def test_name(self) -> str:
        if math.isnan(self.p_value):
            return "the sign-flip test" if self.paired is not None else "the permutation test"
        return "paired t" if self.paired is not None else "Welch"

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


def _pairing(side_a: pd.DataFrame, side_b: pd.DataFrame, seeds_a: list, seeds_b: list) -> str | None:
    """How the design ties the runs of the two sides, seed by seed: ``parent`` when each seed's two runs share the
    run they started from (or one started from the other), ``seed`` when they share only the seed, None when the
    seeds do not match one to one (or a side has a seed twice)."""
    if len(seeds_a) < 2 or None in seeds_a or len(set(seeds_a)) != len(seeds_a) or sorted(seeds_a) != sorted(seeds_b):
        return None

    def lineage(side: pd.DataFrame) -> dict:
        keys = side["train_key"].tolist() if "train_key" in side.columns else [None] * len(side)
        parents = side["parent_key"].tolist() if "parent_key" in side.columns else [None] * len(side)
        return {None if is_missing(s) else int(s): (_plain(k), _plain(p))
                for s, k, p in zip(side["seed"].tolist(), keys, parents)}

    la, lb = lineage(side_a), lineage(side_b)
    for seed in seeds_a:
        (key_a, parent_a), (key_b, parent_b) = la.get(seed, (None, None)), lb.get(seed, (None, None))
        shared = parent_a is not None and parent_a == parent_b
        if not (shared or (key_a is not None and key_a == parent_b) or (key_b is not None and key_b == parent_a)):
            return "seed"
    return "parent"


def compare(df: pd.DataFrame, a: str, b: str, at, metric: str = "val_loss", step="final",
            confidence: float = CONFIDENCE, alpha: float = _stats_mod.ALPHA, paired: bool | None = None) -> Comparison:
    """Compare configuration ``b`` with configuration ``a`` on ``metric`` at one eval length ``at``.

    ``a`` and ``b`` name an attention variant, optionally pinned further with configuration columns:
    ``"lssar"``, ``"softmax,p_eval=15"``, ``"lssa,rope_scaling=none"``. Each must pick exactly one
    configuration among the rows (narrow ``df`` first, e.g. ``--where rope_scaling=none``); otherwise a
    one-line :class:`UserError` lists the configurations and how to pick one. ``at`` is a length
    (``1024``, ``"1k"``) or a multiple of the training length (``"16x"``).

    The difference is **b - a** (mean over runs, i.e. seeds). With at least 2 runs on each side it carries
    Welch's interval and test and an exact permutation test (:func:`attnlab.results.stats.two_sample_test`). When
    the two sides have the same seeds, one run each, the runs are paired by seed (``paired=None``: as the design
    allows; False: never; True: required, a one-line error otherwise) and the paired t test and the exact sign-flip
    test decide (:func:`attnlab.results.stats.paired_test`). The verdict says plainly whether the difference is
    significant at ``alpha``, the smallest difference the design detects with 80% power, and when n is too small to
    test at all.
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

    test, pair_test, pairing, detectable = None, None, None, math.nan
    n_a, n_b = len(values["a"]), len(values["b"])
    if paired is not False:
        pairing = _pairing(side_a, side_b, [s for s, _ in values["a"]], [s for s, _ in values["b"]])
        if paired and pairing is None:
            raise UserError(f"--paired: a ({a}) and b ({b}) do not have the same seeds, one run each (a: "
                            f"{_seed_list(values['a'])}; b: {_seed_list(values['b'])}): leave out --paired")
    if n_a >= 2 and n_b >= 2:
        bounds = metric_bounds(metric)
        test = _stats_mod.two_sample_test([v for _, v in values["a"]], [v for _, v in values["b"]], confidence,
                                          bounds=bounds)
        if pairing is not None:
            order = sorted(s for s, _ in values["a"])
            by_a, by_b = dict(values["a"]), dict(values["b"])
            pair_test = _stats_mod.paired_test([by_a[s] for s in order], [by_b[s] for s in order], confidence, bounds)
            notes.extend(pair_test.notes)
            se, dof = pair_test.sd_diff / math.sqrt(pair_test.n_pairs), pair_test.df
        else:
            notes.extend(test.notes)
            se, dof = _stats_mod.welch_standard_error([v for _, v in values["a"]], [v for _, v in values["b"]])
        detectable = _stats_mod.detectable_difference(se, dof, alpha)
    result = Comparison(metric=metric, eval_len=eval_len, train_len=train_len, step=step, a=str(a), b=str(b),
                        a_config=a_config, b_config=b_config, constants=constants, a_values=values["a"],
                        b_values=values["b"], higher_is_better=higher, confidence=confidence, alpha=alpha,
                        test=test, significant=None, verdict="", notes=notes, paired=pair_test,
                        pairing=pairing if pair_test is not None else None, detectable=detectable,
                        detectable_alpha=alpha, at=str(at))
    _decide(result, result.p_decided)
    if pair_test is not None and pair_test.min_p_sign_flip >= alpha:
        notes.append(f"with {pair_test.n_pairs} pairs the exact sign-flip test cannot go below p = "
                     f"{pair_test.min_p_sign_flip:.3g}, so on its own it can never reach the {100 * alpha:g}% level; "
                     "more seeds are needed for a distribution-free test")
    elif pair_test is None and test is not None and test.min_p_permutation >= alpha:
        notes.append(f"with {n_a} vs {n_b} runs the exact permutation test cannot go below p = "
                     f"{test.min_p_permutation:.3g}, so on its own it can never reach the "
                     f"{100 * alpha:g}% level; more seeds are needed for a distribution-free test")
    return result


def _seed_list(pairs: list) -> str:
    return ", ".join("?" if s is None else str(s) for s, _ in pairs) or "none"


def _decide(result: Comparison, p: float, level: float | None = None) -> None:
    """Set ``result``'s ``significant`` and ``verdict`` from ``p`` (its deciding p, or Holm's adjusted p in a
    family) against ``alpha``."""
    alpha = result.alpha
    percent = f"{100 * alpha:g}%"
    test = result.test
    if test is None:
        few = [f"{name} has n={n}" for name, n in (("a", result.n_a), ("b", result.n_b)) if n < 2]
        result.significant = None
        result.verdict = (f"no test: {' and '.join(few)}; a test needs at least 2 runs (seeds) on each side, so "
                          f"this difference cannot be told from run-to-run noise")
        return
    family = "" if result.p_adjusted is None else f", Holm-adjusted over {result.family_size} comparisons"
    shown = (f"{result.test_name} p = {result.p_decided:.3g}" if result.p_adjusted is None else
             f"{result.test_name} p = {result.p_decided:.3g}, adjusted p = {result.p_adjusted:.3g}")
    if math.isnan(result.p_value) and result.diff == 0:
        result.significant = False
        result.verdict = "no difference: every run on both sides gave the same value"
        return
    result.significant = p < alpha
    if result.significant:
        better = (result.diff > 0) == result.higher_is_better
        result.verdict = (f"significant at the {percent} level{family} ({shown}): b is "
                          f"{'higher' if result.diff > 0 else 'lower'} than a ({'better' if better else 'worse'} for "
                          f"{result.metric}, {'higher' if result.higher_is_better else 'lower'} is better)")
        return
    interval = (f"; the {100 * result.confidence:g}% interval includes 0" if math.isclose(result.confidence, 1 - alpha)
                and result.ci[0] <= 0 <= result.ci[1] else "")
    undefined = "" if not math.isnan(result.p_value) else "; the t is undefined (no spread)"
    power = ""
    if math.isfinite(result.detectable):
        power = (f"; the design detects {result.detectable:.3g} with 80% power (alpha {result.detectable_alpha:.3g})"
                 + (", so this is no evidence of equality" if abs(result.diff) < result.detectable else ""))
    result.verdict = (f"not significant at the {percent} level{family} ({shown}{interval}{undefined}): these runs "
                      f"cannot tell a from b{power}")


def compare_family(df: pd.DataFrame, comparisons: list[tuple[str, str, object]], metric: str = "val_loss",
                   step="final", confidence: float = CONFIDENCE, alpha: float = _stats_mod.ALPHA,
                   paired: bool | None = None) -> list[Comparison]:
    """Several comparisons ``(a, b, at)`` as one family of verdicts: each tested as :func:`compare` does, then
    significant only when its Holm-adjusted p (:func:`attnlab.results.stats.holm`, over the comparisons that have a
    test) is below ``alpha``, so the chance of any false verdict in the family stays at ``alpha``. Each one's
    detectable difference is given at ``alpha / m``, the level Holm tests the family's smallest p at (the most
    demanding of its steps)."""
    if not comparisons:
        raise UserError("give at least one comparison (--a/--b/--at, or --pairs FILE)")
    results = [compare(df, a, b, at, metric=metric, step=step, confidence=confidence, alpha=alpha, paired=paired)
               for a, b, at in comparisons]
    adjusted = _stats_mod.holm([r.p_decided if r.test is not None else math.nan for r in results])
    tested = sum(1 for p in adjusted if not math.isnan(p))
    for result, p in zip(results, adjusted):
        if result.test is None:
            continue
        result.p_adjusted, result.family_size = p, tested
        result.detectable_alpha = alpha / tested
        se, dof = _design_error(result)
        result.detectable = _stats_mod.detectable_difference(se, dof, result.detectable_alpha)
        _decide(result, p)
    return results


def _design_error(result: Comparison) -> tuple[float, float]:
    """``(se, df)`` of the deciding test's difference."""
    if result.paired is not None:
        return result.paired.sd_diff / math.sqrt(result.paired.n_pairs), result.paired.df
    return _stats_mod.welch_standard_error([v for _, v in result.a_values], [v for _, v in result.b_values])


def read_pairs(path: str) -> list[tuple[str, str, str]]:
    """A file of comparisons, one a line: ``A B AT`` (each side as ``--a``/``--b`` write it, no spaces), blank
    lines and ``#`` comments skipped; a bad line is a one-line error naming it."""
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as exc:
        raise UserError(f"--pairs {path!r} cannot be read: {exc.strerror or exc}") from None
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 3:
            raise UserError(f"--pairs {path}:{number}: {line!r} is not 'A B AT' (e.g. lssar,stage=none "
                            "softmax,extension=yarn 16x)")
        out.append((parts[0], parts[1], parts[2]))
    if not out:
        raise UserError(f"--pairs {path!r} lists no comparison (one 'A B AT' a line)")
    return out


def _signed(value: float, digits: int) -> str:
    return "nan" if math.isnan(value) else f"{value:+.{digits}f}"


def _side_label(config: dict, spec: str) -> str:
    return ", ".join(f"{k}={format_value(v)}" for k, v in config.items()) or spec


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
        label = _side_label(config, spec)
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
    test, paired = result.test, result.paired
    if test is None:
        lines.append(f"b - a = {_signed(result.diff, digits)} (no interval, no test)")
    elif paired is not None:
        how = (f"paired by {result.pairing} ({paired.n_pairs} pairs: each seed's two runs share "
               f"{'a parent' if result.pairing == 'parent' else 'the seed'})")
        if math.isnan(paired.p_t):
            lines.append(f"b - a = {_signed(paired.diff, digits)}, {how}; the paired t is undefined")
        else:
            lines.append(f"b - a = {_signed(paired.diff, digits)}, {percent} CI [{_signed(paired.ci[0], digits)}, "
                         f"{_signed(paired.ci[1], digits)}], {how} (paired t = {paired.t:.3g}, df = {paired.df:.3g}, "
                         f"p = {paired.p_t:.3g})")
        how = "exact over" if paired.exact else "sampled,"
        lines.append(f"sign-flip permutation test ({how} {paired.assignments} sign assignments of the pairs): "
                     f"p = {paired.p_sign_flip:.3g}; unpaired: Welch p = {test.p_welch:.3g}, permutation p = "
                     f"{test.p_permutation:.3g}")
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
    if test is not None and math.isfinite(result.detectable):
        lines.append(f"detectable: {result.detectable:.{digits}f} (the smallest difference this design finds with "
                     f"80% power at alpha {result.detectable_alpha:.3g}, from the spread measured)")
    lines.append(f"verdict: {result.verdict}")
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)


def format_family(results: list[Comparison], digits: int = 4) -> str:
    """A family of comparisons: one line each (a, b, length, b - a with its interval, how paired, the raw and the
    Holm-adjusted p, the verdict in the family, the detectable difference), then the notes, each once."""
    tested = [r for r in results if r.test is not None]
    alpha = results[0].alpha
    lines = [f"family of {len(results)} comparison(s) of {results[0].metric} (b - a; "
             f"{'higher' if results[0].higher_is_better else 'lower'} is better), Holm's correction over the "
             f"{len(tested)} tested at {100 * alpha:g}%: an adjusted p below {alpha:g} is significant in the family"]
    for r in results:
        length = length_label(r.eval_len) + (f" ({r.eval_len / r.train_len:g}x)" if r.train_len else "")
        head = f"a {r.a} vs b {r.b} at {length}"
        if r.test is None:
            lines.append(f"{head}: b - a = {_signed(r.diff, digits)}; {r.verdict}")
            continue
        low, high = r.ci
        pairing = (f"paired by {r.pairing} ({r.paired.n_pairs} pairs)" if r.paired is not None
                   else f"unpaired ({r.n_a} vs {r.n_b})")
        permutation = (f"sign-flip p = {r.paired.p_sign_flip:.3g}" if r.paired is not None
                       else f"permutation p = {r.test.p_permutation:.3g}")
        word = "significant" if r.significant else "not significant"
        lines.append(f"{head}: b - a = {_signed(r.diff, digits)} [{_signed(low, digits)}, {_signed(high, digits)}], "
                     f"{pairing}; {r.test_name} p = {r.p_decided:.3g} ({permutation}), Holm p = {r.p_adjusted:.3g}: "
                     f"{word}; detectable {r.detectable:.{digits}f} (80% power, alpha {r.detectable_alpha:.3g})")
    seen = []
    for r in results:
        for note in r.notes:
            text = f"note ({r.a} vs {r.b} at {r.at}): {note}"
            if note not in [n for _, n in seen]:
                seen.append((r, note))
                lines.append(text)
    return "\n".join(lines)
