"""``results compare`` for a family of verdicts (issue 51, part 4): seed-paired tests where the two sides share
parents or seeds (the paired t and the exact sign-flip test), Holm's correction over the comparisons of one call
(several ``--b``/``--at``, or ``--pairs FILE``), and the smallest difference the design detects with 80% power.

The rows are an extension study's, written through ResultsStore: five parents a variant (seeds 0-4) whose losses
differ a lot from seed to seed, and their children fine-tuned two ways, which differ from each other by a small,
steady amount within each parent. Welch's test drowns that in the parents' spread; the pairs see it.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats as sps

from attnlab.cli import main
from attnlab.errors import UserError
from attnlab.results import ResultsStore, reports
from attnlab.results.stats import detectable_difference, holm, paired_test, sign_flip_test, welch_standard_error

SEEDS = range(5)
PARENT = [2.40, 2.46, 2.37, 2.52, 2.43]          # softmax zero-shot at 16x: a wide spread over seeds
SHIFT = [-0.30, -0.28, -0.31, -0.29, -0.30]      # plain RoPE fine-tune: the child of each parent
YARN_MINUS_NONE = [0.011, 0.013, 0.009, 0.012, 0.010]  # yarn's child, against the plain child of the same parent
LSSAR = [2.05, 2.02, 2.06, 2.03, 2.04]


def _row(attention, seed, value, eval_len=2048, **lineage) -> dict:
    key = lineage.pop("key", f"{attention}-{lineage.get('extension') or 'zero'}-{seed}")
    return dict(study="ext", trial=key, attention=attention, scale="inv_sqrt_d", p_train=None, p_eval=None,
                rope_scaling="none", step=400, tokens=400 * 4096, eval_len=eval_len, train_len=128,
                window_mode="nonoverlap", metric="val_loss", value=value, seed=seed, train_key=key, git_sha="abc",
                **lineage)


@pytest.fixture()
def store(tmp_path):
    store = ResultsStore(str(tmp_path / "store"))
    rows = []
    for seed in SEEDS:
        parent = f"softmax-zero-{seed}"
        child = dict(stage="extend", parent_key=parent, ext_len=512, ext_tokens=163_840, lineage_tokens=1_802_240)
        none_value = PARENT[seed] + SHIFT[seed]
        for length, scale in ((512, 0.9), (2048, 1.0)):
            rows += [_row("softmax", seed, scale * PARENT[seed], length),
                     _row("lssar", seed, scale * LSSAR[seed], length),
                     _row("softmax", seed, scale * none_value, length, extension="none", **child),
                     _row("softmax", seed, scale * (none_value + YARN_MINUS_NONE[seed]), length, extension="yarn",
                          ext_factor=4.0, **child)]
    for row in rows:
        if row["attention"] == "lssar":
            row["p_train"] = 15.0
    store.write(rows, key=("ext", 0))
    return store


# ------------------------------------------------------------------------------------------ the statistics
def test_the_paired_t_is_scipys_and_the_sign_flip_test_enumerates_every_sign():
    a, b = np.array(PARENT), np.array(PARENT) + np.array(YARN_MINUS_NONE)
    result = paired_test(a, b)
    reference = sps.ttest_rel(b, a)
    assert result.t == pytest.approx(reference.statistic) and result.p_t == pytest.approx(reference.pvalue)
    assert result.df == 4 and result.n_pairs == 5 and result.diff == pytest.approx(np.mean(YARN_MINUS_NONE))
    half = sps.t.ppf(0.975, 4) * np.std(YARN_MINUS_NONE, ddof=1) / math.sqrt(5)
    assert result.ci == pytest.approx((result.diff - half, result.diff + half))
    # every difference positive: only the two all-one-sign assignments are as extreme, 2 of 2^5
    assert result.p_sign_flip == pytest.approx(2 / 32) and result.min_p_sign_flip == pytest.approx(2 / 32)
    d = [0.3, -0.1, 0.2, 0.25, -0.05, 0.15]
    brute = np.mean([abs(np.mean(np.array(s) * d)) >= abs(np.mean(d)) - 1e-12
                     for s in itertools.product((1, -1), repeat=len(d))])
    assert sign_flip_test(d) == (pytest.approx(brute), 64, True)


def test_holm_is_the_step_down_rule():
    # sorted: 0.005 x 4, 0.01 x 3, 0.03 x 2, 0.04 x 1, each at least the one before it
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    out = holm([0.02, math.nan, 0.01])  # no test: left out of m
    assert out[0] == pytest.approx(0.02) and math.isnan(out[1]) and out[2] == pytest.approx(0.02)


def test_the_detectable_difference_is_found_with_80_percent_power():
    se, df = 0.01, 4
    delta = detectable_difference(se, df)
    critical = sps.t.ppf(0.975, df)
    assert sps.nct.sf(critical, df, delta / se) + sps.nct.cdf(-critical, df, delta / se) == pytest.approx(0.8)
    assert detectable_difference(se, df, alpha=0.005) > delta > detectable_difference(se, 40)  # stricter, more seeds
    assert math.isnan(detectable_difference(0.0, 4))
    se3, df3 = welch_standard_error([2.40, 2.41, 2.42], [2.50, 2.51, 2.52])
    assert se3 == pytest.approx(0.01 * math.sqrt(2 / 3)) and df3 == pytest.approx(4.0)


# ------------------------------------------------------------------------------------------ compare
def test_children_of_one_parent_are_paired_and_the_pairs_see_what_welch_cannot(store):
    frame = store.read()
    paired = reports.compare(frame, a="softmax,stage=extend,extension=none", b="softmax,extension=yarn", at="16x")
    assert paired.pairing == "parent" and paired.paired.n_pairs == 5
    assert paired.diff == pytest.approx(np.mean(YARN_MINUS_NONE)) and paired.significant is True
    assert paired.p_value == pytest.approx(sps.ttest_rel(
        [PARENT[s] + SHIFT[s] + YARN_MINUS_NONE[s] for s in SEEDS], [PARENT[s] + SHIFT[s] for s in SEEDS]).pvalue)
    assert "paired by parent (5 pairs: each seed's two runs share a parent)" in paired.to_text()
    welch = reports.compare(frame, a="softmax,stage=extend,extension=none", b="softmax,extension=yarn", at="16x", paired=False)
    assert welch.paired is None and welch.significant is False and welch.p_value > 0.5
    assert welch.detectable > 0.05 > paired.detectable  # the parents' spread hides 0.011 from Welch, not from pairs


def test_a_zero_shot_parent_and_its_own_child_pair_by_parent_and_other_variants_by_seed(store):
    frame = store.read()
    child = reports.compare(frame, a="softmax,stage=none", b="softmax,stage=extend,extension=none", at="16x")
    assert child.pairing == "parent" and child.significant is True
    other = reports.compare(frame, a="lssar,stage=none", b="softmax,stage=extend,extension=none", at="16x")
    assert other.pairing == "seed"
    with pytest.raises(UserError, match="do not have the same seeds"):
        reports.compare(frame[~((frame["attention"] == "lssar") & (frame["seed"] == 4))], a="lssar,stage=none",
                        b="softmax,stage=extend,extension=none", at="16x", paired=True)


def test_a_not_significant_line_says_what_the_design_could_detect(store):
    result = reports.compare(store.read(), a="softmax,stage=extend,extension=none", b="softmax,extension=yarn", at="16x",
                             paired=False)
    text = result.to_text()
    assert f"detectable: {result.detectable:.4f} (the smallest difference this design finds with 80% power" in text
    assert "so this is no evidence of equality" in result.verdict


def test_a_family_is_holm_corrected_and_each_line_has_its_raw_and_adjusted_p(store, capsys):
    frame = store.read()
    pairs = [("lssar,stage=none", b, at) for b in ("softmax,stage=extend,extension=none", "softmax,extension=yarn")
             for at in ("4x", "16x")]
    results = reports.compare_family(frame, pairs)
    alone = [reports.compare(frame, a, b, at) for a, b, at in pairs]
    assert [r.p_decided for r in results] == [r.p_decided for r in alone]
    assert [r.p_adjusted for r in results] == pytest.approx(holm([r.p_decided for r in alone]))
    assert all(r.family_size == 4 and r.detectable_alpha == pytest.approx(0.05 / 4) for r in results)
    assert all(r.significant == (r.p_adjusted < 0.05) for r in results)
    argv = ["results", "compare", "--store", store.uri, "--study", "ext", "--a", "lssar,stage=none",
            "--b", "softmax,stage=extend,extension=none", "--b", "softmax,extension=yarn", "--at", "4x", "--at", "16x"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("family of 4 comparison(s) of val_loss (b - a; lower is better), Holm's correction")
    for line, result in zip(out[1:5], results):
        assert f"paired t p = {result.p_decided:.3g}" in line and f"Holm p = {result.p_adjusted:.3g}" in line
        assert f"detectable {result.detectable:.4f} (80% power, alpha 0.0125)" in line


def test_a_family_from_a_file_of_pairs(store, tmp_path, capsys):
    path = tmp_path / "verdicts.txt"
    path.write_text("# LSSAR against softmax fine-tuned\nlssar,stage=none softmax,extension=yarn 16x\n\n"
                    "lssar,stage=none softmax,stage=extend,extension=none 16x  # the control\n")
    assert main(["results", "compare", "--store", store.uri, "--pairs", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("family of 2 comparison(s)") and len([l for l in out if "Holm p = " in l]) == 2
    path.write_text("lssar softmax\n")
    assert main(["results", "compare", "--store", store.uri, "--pairs", str(path)]) == 2
    assert f"--pairs {path}:1: 'lssar softmax' is not 'A B AT'" in capsys.readouterr().err
    assert main(["results", "compare", "--store", store.uri, "--pairs", str(path), "--a", "lssar"]) == 2
    assert "leave out --a, --b and --at" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ yarn before schema 9
def test_yarn_rows_of_schema_1_to_8_read_as_yarn_paper_and_never_mix_with_new_ones(tmp_path, capsys):
    """A store holding YaRN rows written before yarn became the reference code's ramp (schema 8, a layout-1 file as
    older attnlab wrote it) and rows of the new yarn: reports show them as two configurations, yarn_paper and yarn, and
    --where finds each by its current name."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from attnlab.results.schema import ARROW_SCHEMA

    store = ResultsStore(str(tmp_path))
    store.write([{**_row("softmax", seed, 2.5 + 0.01 * seed, key=f"new-{seed}"), "rope_scaling": "yarn"}
                 for seed in SEEDS], key=("ext", "new"))
    old = [{**_row("softmax", seed, 2.8 + 0.01 * seed, key=f"old-{seed}"), "rope_scaling": "yarn", "schema_version": 8,
            "extension": None} for seed in SEEDS]
    columns = [name for name in old[0] if name in ARROW_SCHEMA.names]
    table = pa.Table.from_pylist([{k: r[k] for k in columns} for r in old],
                                 schema=pa.schema([ARROW_SCHEMA.field(n) for n in columns]))
    pq.write_table(table, str(tmp_path / "study=ext" / "old.parquet"))
    result = reports.table(store.read(study="ext"))
    assert sorted(result["rope_scaling"]) == ["yarn", "yarn_paper"]
    assert main(["results", "table", "--store", store.uri, "--where", "rope_scaling=yarn_paper", "--digits", "2"]) == 0
    out = capsys.readouterr().out
    assert "2.82" in out and "2.52" not in out  # the old rows alone (mean 2.82 over seeds 0-4)
    assert main(["results", "table", "--store", store.uri, "--where", "rope_scaling=yarn", "--digits", "2"]) == 0
    out = capsys.readouterr().out
    assert "2.52" in out and "2.82" not in out
    compared = reports.compare(store.read(study="ext"), a="softmax,rope_scaling=yarn_paper",
                               b="softmax,rope_scaling=yarn", at="16x")
    assert compared.diff == pytest.approx(-0.3)
