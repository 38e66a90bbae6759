"""``results compare`` and the small-sample statistics, on real Parquet rows written through ResultsStore.

The rows are built so the answers are known: lssar is far above softmax at 1K (a significant difference),
lssa overlaps softmax (no significant difference), sigmoid_l1 has a single seed (no test), softmax has two
p_eval configurations (ambiguous without a pin).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from attnlab.cli import main
from attnlab.errors import UserError
from attnlab.results import Comparison, ResultsStore, compare, reports
from attnlab.results.reports.figures import _plot_line
from attnlab.results.stats import t_interval, two_sample_test

SOFTMAX = [0.010, 0.020, 0.015, 0.012]   # acc at 1024, seeds 0..3
LSSAR = [0.900, 0.950, 0.920, 0.930]     # far above softmax: significant
LSSA = [0.012, 0.018, 0.011, 0.016]      # inside softmax's spread: not significant
SOFTMAX_P15 = [0.030, 0.020, 0.025, 0.040]


def row(attention, seed, eval_len, value, p_eval=None, p_train=None, metric="acc", study="probe") -> dict:
    return dict(study=study, trial=f"{attention}-{p_train}-s{seed}", attention=attention, scale="logd_logn",
                p_train=p_train, p_eval=p_eval, rope_scaling="none", step=800, tokens=800 * 2048,
                eval_len=eval_len, train_len=64, window_mode="copy_distractors", metric=metric, value=value,
                seed=seed, train_key=f"h-{attention}-{p_train}-{seed}", git_sha="abc1234")


@pytest.fixture()
def store(tmp_path):
    store = ResultsStore(str(tmp_path / "store"))
    for seed in range(4):
        rows = [row("softmax", seed, 1024, SOFTMAX[seed]), row("softmax", seed, 64, 1.0),
                row("softmax", seed, 1024, SOFTMAX_P15[seed], p_eval=15.0), row("softmax", seed, 64, 1.0, p_eval=15.0),
                row("lssar", seed, 1024, LSSAR[seed], p_train=15.0), row("lssar", seed, 64, 1.0, p_train=15.0),
                row("lssa", seed, 1024, LSSA[seed]), row("lssa", seed, 64, 1.0),
                row("relu_l1", seed, 64, 0.5)]  # no spread at 1x, and not softmax's 1.0
        store.write(rows, key=("probe", seed))
    store.write([row("sigmoid_l1", 0, 1024, 0.5), row("sigmoid_l1", 0, 64, 1.0),
                 row("nope_short", 0, 64, 1.0)], key=("probe", "single"))
    return store


def test_t_interval_and_welch_match_the_formulas():
    low, high = t_interval([3.0, 3.1, 3.5])
    half = sps.t.ppf(0.975, 2) * np.std([3.0, 3.1, 3.5], ddof=1) / math.sqrt(3)
    assert (low, high) == pytest.approx((3.2 - half, 3.2 + half)) and half == pytest.approx(0.657241, abs=1e-6)
    assert all(math.isnan(x) for x in t_interval([1.0]))  # n = 1: no interval

    a, b = np.array(SOFTMAX), np.array(LSSAR)
    result = two_sample_test(a, b)
    va, vb = a.var(ddof=1) / 4, b.var(ddof=1) / 4
    df = (va + vb) ** 2 / (va**2 / 3 + vb**2 / 3)  # Welch-Satterthwaite
    half = sps.t.ppf(0.975, df) * math.sqrt(va + vb)
    assert result.diff == pytest.approx(b.mean() - a.mean())
    assert result.df == pytest.approx(df) and result.t == pytest.approx((b.mean() - a.mean()) / math.sqrt(va + vb))
    assert result.ci == pytest.approx((result.diff - half, result.diff + half))
    assert result.p_welch < 1e-5
    # Exact permutation test, 4 vs 4: C(8, 4) = 70 splits; complete separation is the most extreme split
    # on each side, so p = 2 / 70.
    assert result.exact and result.permutation_splits == 70
    assert result.p_permutation == pytest.approx(2 / 70) and result.min_p_permutation == pytest.approx(2 / 70)


def test_compare_finds_a_known_difference(store):
    result = compare(store.read(study="probe"), a="softmax,p_eval=none", b="lssar", at="16x", metric="acc")
    assert isinstance(result, Comparison)
    assert result.eval_len == 1024 and result.n_a == 4 and result.n_b == 4
    assert result.a_values == list(enumerate(SOFTMAX)) and result.b_values == list(enumerate(LSSAR))
    assert result.diff == pytest.approx(np.mean(LSSAR) - np.mean(SOFTMAX))  # b - a
    assert result.ci[0] > 0.85 and result.ci[1] < 0.96
    assert result.significant is True and result.p_value < 1e-5
    assert result.verdict.startswith("significant at the 5% level") and "b is higher than a (better" in result.verdict
    assert result.a_config == {"attention": "softmax", "p_train": None}
    assert result.b_config == {"attention": "lssar", "p_train": 15.0}
    text = result.to_text(digits=3)
    assert "b - a = +0.911, 95% CI [+" in text
    assert "a: attention=softmax, p_train=none: 0.014 ± 0.004 (n=4) [95% CI" in text
    assert "per seed 0: 0.900, 1: 0.950, 2: 0.920, 3: 0.930" in text
    # softmax and lssar have the same seeds: paired by seed (the sign-flip test's floor with 4 pairs is 2/16)
    assert result.pairing == "seed" and result.paired.n_pairs == 4
    assert ("sign-flip permutation test (exact over 16 sign assignments of the pairs): p = 0.125; unpaired: Welch p = "
            in text and "permutation p = 0.0286" in text)
    unpaired = compare(store.read(study="probe"), a="softmax,p_eval=none", b="lssar", at="16x", metric="acc",
                       paired=False)
    assert unpaired.paired is None and "permutation test (exact over 70 splits of the pooled runs): p = 0.0286" in \
        unpaired.to_text()
    # Reversing the sides flips the sign, not the verdict.
    reverse = compare(store.read(), a="lssar", b="softmax,p_eval=none", at=1024, metric="acc")
    assert reverse.diff == pytest.approx(-result.diff) and reverse.significant is True
    assert "b is lower than a (worse for acc" in reverse.verdict


def test_compare_says_plainly_when_there_is_no_significant_difference(store):
    result = compare(store.read(), a="softmax,p_eval=none", b="lssa", at="1k", metric="acc")
    assert result.diff == pytest.approx(np.mean(LSSA) - np.mean(SOFTMAX))
    assert result.significant is False and result.p_value > 0.5
    assert result.ci[0] < 0 < result.ci[1]
    assert result.verdict.startswith("not significant at the 5% level") and "cannot tell a from b" in result.verdict
    # At 1x every run of both sides is 1.0: no spread, no difference.
    same = compare(store.read(), a="softmax,p_eval=none", b="lssa", at="1x", metric="acc")
    assert same.significant is False and same.verdict.startswith("no difference")


def test_compare_without_spread_falls_back_to_the_permutation_test(store):
    """1.0 on every softmax seed, 0.5 on every relu_l1 seed: Welch's t is undefined, the exact permutation test
    (4 vs 4: the most extreme of 70 splits, p = 2/70) decides."""
    result = compare(store.read(), a="softmax,p_eval=none", b="relu_l1", at=64, metric="acc", paired=False)
    assert result.diff == pytest.approx(-0.5) and math.isnan(result.p_value) and math.isnan(result.ci[0])
    assert result.test.p_permutation == pytest.approx(2 / 70) and result.significant is True
    assert result.verdict.startswith("significant at the 5% level (the permutation test p = 0.0286)")
    assert "Welch's t undefined" in result.to_text()
    # paired by seed (the default: the same seeds), the exact sign-flip test decides; 4 pairs cannot go below 2/16
    paired = compare(store.read(), a="softmax,p_eval=none", b="relu_l1", at=64, metric="acc")
    assert paired.paired.p_sign_flip == pytest.approx(2 / 16) and paired.significant is False
    assert paired.verdict.startswith("not significant at the 5% level (the sign-flip test p = 0.125")


def test_compare_refuses_to_test_a_single_run(store):
    result = compare(store.read(), a="softmax,p_eval=none", b="sigmoid_l1", at=1024, metric="acc")
    assert result.test is None and result.significant is None and result.n_b == 1
    assert result.verdict.startswith("no test: b has n=1; a test needs at least 2 runs (seeds) on each side")
    assert "b - a = +0.4858 (no interval, no test)" in result.to_text()
    assert "b: attention=sigmoid_l1: 0.5000 (1 seed); per seed 0: 0.5000" in result.to_text()


def test_compare_leaves_out_diverged_runs_and_says_so(store):
    frame = store.read()
    frame.loc[(frame["attention"] == "lssa") & (frame["seed"] == 3) & (frame["eval_len"] == 1024), "value"] = np.nan
    result = compare(frame, a="softmax,p_eval=none", b="lssa", at=1024, metric="acc")
    assert result.n_b == 3 and any("left out 1 run(s) with a non-finite value (diverged): seed(s) 3" in n
                                   for n in result.notes)


@pytest.mark.parametrize("kwargs, message", [
    (dict(a="softmax", b="lssar"),
     "--a 'softmax' matches 2 configurations at 1024 (p_eval=none; p_eval=15): pick one with "
     "--a softmax,p_eval=none (or --where p_eval=VALUE for both sides)"),
    (dict(a="softmax,p_eval=none", b="lsar"),
     "--b 'lsar': no 'acc' rows for that attention variant; variants present: lssa, lssar, nope_short, "
     "relu_l1, sigmoid_l1, softmax"),
    (dict(a="nope_short", b="lssar"),
     "--a 'nope_short': no 'acc' rows at 1024; it has rows at eval lengths 64"),
    (dict(a="softmax,p_eval=3", b="lssar"),
     "--a 'softmax,p_eval=3': no rows with p_eval=3 at 1024; p_eval values for softmax: 15, none"),
    (dict(a="softmax,depth=3", b="lssar"), "--a 'softmax,depth=3': 'depth' is not a configuration column"),
    (dict(a="lssar", b="lssar,p_train=15"), "pick the same configuration"),
    (dict(a="lssar", b="lssa", at="2k"), "--at '2k': no 'acc' rows at that length; eval lengths present: 64, 1024"),
    (dict(a="lssar", b="lssa", at="far"), "--at 'far': give an eval length"),
    (dict(a="lssar", b="lssa", metric="bpb"), "--metric 'bpb' has no rows; metrics present: acc"),
])
def test_compare_bad_input_is_a_one_line_error(store, kwargs, message):
    kwargs = {"at": 1024, "metric": "acc", **kwargs}
    with pytest.raises(UserError) as error:
        compare(store.read(), **kwargs)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_cli_compare(store, capsys):
    argv = ["results", "compare", "--store", store.uri, "--study", "probe", "--metric", "acc", "--at", "16x"]
    assert main([*argv, "--a", "softmax", "--b", "lssar", "--where", "p_eval=none"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("compare acc at 1K (16x) (final step of each run); difference = b - a (higher is better)")
    assert "verdict: significant at the 5% level" in out
    assert main([*argv, "--a", "softmax,p_eval=none", "--b", "lssa"]) == 0
    assert "verdict: not significant at the 5% level" in capsys.readouterr().out
    assert main([*argv, "--a", "softmax,p_eval=none", "--b", "softmax,p_eval=15"]) == 0
    out = capsys.readouterr().out
    assert "a: p_eval=none: " in out and "b: p_eval=15: " in out

    assert main([*argv, "--a", "softmax", "--b", "lssar"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnlab: error: --a 'softmax' matches 2 configurations at 16x (p_eval=none; p_eval=15)")
    assert err.count("\n") == 1
    assert main([*argv[:-1], "3x", "--a", "softmax", "--b", "lssar"]) == 2
    assert capsys.readouterr().err == ("attnlab: error: --at '3x': no 'acc' rows at that length; eval lengths "
                                       "present: 64, 1024\n")
    assert main([*argv, "--a", "gpt", "--b", "lssar"]) == 2
    assert "attnlab: error: --a 'gpt': no 'acc' rows for that attention variant" in capsys.readouterr().err


def test_single_runs_are_marked_in_tables_and_figures(store, tmp_path):
    import matplotlib.image

    frame = store.read()
    text = reports.to_markdown(reports.table(frame, metric="acc"), digits=3)
    assert "| sigmoid_l1 | none | none | 1.000 (1 seed) | 0.500 (1 seed) |" in text
    paths = reports.curves(frame, str(tmp_path / "c"), metric="acc")
    page = open(paths["html"], encoding="utf-8").read()
    assert "<td>0.5000 (1 seed)</td>" in page
    assert matplotlib.image.imread(paths["png"]).shape[1] == 900  # 9 inches at 100 dpi


def test_figure_legend_marks_single_runs(store):
    """The legend says which line is a single run and what the hollow marker means (read back from matplotlib)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    axes = Figure().add_subplot(1, 1, 1)
    xs, ys = np.array([64.0, 1024.0]), np.array([1.0, 0.5])
    assert _plot_line(axes, xs, ys, np.zeros(2), np.array([1, 1]), "sigmoid_l1") is True
    assert _plot_line(axes, xs, ys, np.array([0.0, 0.1]), np.array([4, 4]), "lssar") is False
    labels = axes.get_legend_handles_labels()[1]
    assert labels == ["sigmoid_l1 (1 seed)", "lssar"]
    hollow = [line for line in axes.lines if line.get_markerfacecolor() == "white"]
    assert len(hollow) == 1 and list(hollow[0].get_xdata()) == [64.0, 1024.0]


def test_bounded_metrics_keep_their_intervals_in_range():
    """One rule for tables, figures and compare: acc lies in [0, 1], val_loss has no bound; 2..3 runs show their
    values, more runs have the interval clipped; a difference of two accuracies stays inside [-1, 1]."""
    from attnlab.results.schema import metric_bounds
    from attnlab.results.stats import bounded_interval, clipped_bar, difference_bounds, shows_seed_values

    assert metric_bounds("acc") == (0.0, 1.0) and metric_bounds("passkey_acc") == (0.0, 1.0)
    assert metric_bounds("exact_match") == (0.0, 1.0)
    assert metric_bounds("val_loss") is None and metric_bounds("loss") is None and metric_bounds(None) is None
    low, high = t_interval([0.879, 0.123])
    assert low < -4 and high > 5  # the raw t interval of two accuracies
    assert bounded_interval([0.879, 0.123], bounds=(0.0, 1.0)) == (0.0, 1.0)
    assert bounded_interval([3.0, 3.1, 3.5]) == t_interval([3.0, 3.1, 3.5])  # unbounded: unchanged
    assert all(math.isnan(x) for x in bounded_interval([0.5], bounds=(0.0, 1.0)))
    assert [shows_seed_values(n, (0.0, 1.0)) for n in (1, 2, 3, 4)] == [False, True, True, False]
    assert not shows_seed_values(2, None)
    assert clipped_bar(0.9, 0.2, (0.0, 1.0)) == pytest.approx((0.2, 0.1)) and clipped_bar(0.9, 0.2, None) == (0.2, 0.2)
    assert difference_bounds((0.0, 1.0)) == (-1.0, 1.0) and difference_bounds(None) is None

    a, b = [0.0, 1.0], [1.0, 0.0, 1.0]
    raw = two_sample_test(a, b)
    assert raw.ci[0] < -1 and raw.ci[1] > 1  # Welch-Satterthwaite with ~2 df: wider than any difference can be
    bounded = two_sample_test(a, b, bounds=(0.0, 1.0))
    assert bounded.ci == (-1.0, 1.0) and bounded.p_welch == raw.p_welch and bounded.diff == raw.diff


def test_compare_of_a_bounded_metric_with_two_runs_lists_them(store):
    frame = store.read()
    few = (frame["attention"] == "lssar") & (frame["seed"] >= 2)
    result = compare(frame[~few], a="softmax,p_eval=none", b="lssar", at=1024, metric="acc")
    assert result.n_b == 2 and -1 <= result.ci[0] <= result.ci[1] <= 1
    text = result.to_text(digits=3)
    assert "b: attention=lssar, p_train=15: 0.925 (n=2; no interval, see per seed); per seed 0: 0.900, 1: 0.950" in text
    assert "a: attention=softmax, p_train=none: 0.014 ± 0.004 (n=4) [95% CI 0.007, 0.021]" in text


def test_figure_points_of_few_runs_show_each_run():
    """A bounded metric: a point of 2..3 runs draws its runs as small dots and no bar; other bars stop at the bound."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    axes = Figure().add_subplot(1, 1, 1)
    xs, ys = np.array([64.0, 1024.0]), np.array([0.9, 0.5])
    seeds = [tuple(enumerate([0.8, 0.9, 1.0, 0.9, 0.9])), ((0, 0.9), (1, 0.1))]
    assert _plot_line(axes, xs, ys, np.array([0.2, 0.57]), np.array([5, 2]), "lssar", bounds=(0.0, 1.0),
                              seeds=seeds) is False
    container = axes.containers[0]
    at_64, at_1024 = container.lines[2][0].get_segments()
    assert at_64[:, 0].tolist() == [64.0, 64.0] and at_64[:, 1].tolist() == pytest.approx([0.7, 1.0])  # not 1.1
    assert at_1024[:, 1].tolist() == [0.5, 0.5]  # no bar where the runs are shown
    dots = [line for line in axes.lines if line.get_marker() == "."]
    assert len(dots) == 1 and list(dots[0].get_xdata()) == [1024.0, 1024.0]
    assert list(dots[0].get_ydata()) == [0.9, 0.1]
