"""Reports on a store with known rows: Table-4 cells (hand-computed mean/std), curves PNG/HTML, best, export, CLI."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd
import pytest

from attnlab.errors import UserError
from attnlab.results import ResultsStore, reports
from attnlab.results import cli as results_cli


def row(attention, p_eval, seed, eval_len, value, step=500, metric="val_loss", **extra) -> dict:
    out = dict(
        study="t4", trial=f"{attention}-s{seed}", attention=attention, scale="logd_logn", p_train=None,
        p_eval=p_eval, rope_scaling="ntk", step=step, tokens=step * 4096, eval_len=eval_len, train_len=64,
        window_mode="nonoverlap", metric=metric, value=value, seed=seed, train_key=f"h-{attention}-{seed}",
        git_sha="abc1234",
    )
    out.update(extra)
    return out


# Hand-computed cells (train_len 64; lengths 64 = 1x and 128 = 2x):
# softmax, none: seeds 0,1 at 64 -> 3.0, 3.2: mean 3.1, sample std sqrt((0.01+0.01)/1) = 0.141421
#                at 128 -> 4.0, 4.4: mean 4.2, std 0.282843
# lssa, none:    seed 0: 3.1 at 64, 3.3 at 128 (n = 1: no std)
# lssa, 15:      seeds 0,1,2 at 64 -> 3.0, 3.1, 3.5: mean 3.2, std sqrt((0.04+0.01+0.09)/2) = 0.264575
#                seed 0 only at 128 -> 3.25
# 95% Student t intervals, mean ± t(0.975, n-1) std / sqrt(n) with t(0.975, 1) = 12.7062, t(0.975, 2) = 4.3027:
#   lssa 15 @64: 3.2 ± 4.3027 * 0.264575 / sqrt(3) = 3.2 ± 0.6572 -> [2.5428, 3.8572]
#   softmax @64: 3.1 ± 12.7062 * 0.141421 / sqrt(2) = 3.1 ± 1.2706 -> [1.8294, 4.3706]
#   softmax @128: 4.2 ± 12.7062 * 0.282843 / sqrt(2) = 4.2 ± 2.5412 -> [1.6588, 6.7412]
KNOWN_ROWS = [
    row("softmax", None, 0, 64, 3.0), row("softmax", None, 1, 64, 3.2),
    row("softmax", None, 0, 128, 4.0), row("softmax", None, 1, 128, 4.4),
    row("lssa", None, 0, 64, 3.1), row("lssa", None, 0, 128, 3.3),
    row("lssa", 15.0, 0, 64, 3.0), row("lssa", 15.0, 1, 64, 3.1), row("lssa", 15.0, 2, 64, 3.5),
    row("lssa", 15.0, 0, 128, 3.25),
]
NOISE_ROWS = [
    row("softmax", None, 0, 64, 9.9, step=100),  # an earlier step: not the final one
    row("softmax", None, 0, 128, 9.9, step=100),
    row("softmax", None, 0, 64, 1.23, metric="bpb"),  # another metric
]


@pytest.fixture()
def store(tmp_path):
    store = ResultsStore(str(tmp_path / "store"))
    by_trial: dict[tuple, list] = {}
    for r in KNOWN_ROWS + NOISE_ROWS:
        by_trial.setdefault((r["trial"], r["p_eval"], r["step"]), []).append(r)
    for key, rows in by_trial.items():
        store.write(rows, key=key)
    marker = {**KNOWN_ROWS[0], "metric": "complete", "value": 4.0}  # a schema-1 store's marker row: never reported
    store.write([marker], key=("__complete__", marker["trial"]))
    return store


def test_table_cells_are_hand_computed_mean_std_n(store):
    result = reports.table(store.read(study="t4"))
    assert result.attrs["label_columns"] == ["attention", "p_eval"]
    assert result.attrs["lengths"] == [64, 128]
    assert result.attrs["constants"]["scale"] == "logd_logn" and result.attrs["train_len"] == 64
    assert result["attention"].tolist() == ["lssa", "lssa", "softmax"]
    assert result["p_eval"].isna().tolist() == [True, False, True] and result["p_eval"][1] == 15.0
    assert result["mean@64"].tolist() == pytest.approx([3.1, 3.2, 3.1])
    assert result["std@64"][0] != result["std@64"][0]  # NaN: n = 1
    assert result["std@64"][1:].tolist() == pytest.approx([math.sqrt(0.07), math.sqrt(0.02)])
    assert result["n@64"].tolist() == [1, 3, 2]
    assert result["mean@128"].tolist() == pytest.approx([3.3, 3.25, 4.2])
    assert result["std@128"][2] == pytest.approx(math.sqrt(0.08))
    assert result["n@128"].tolist() == [1, 1, 2]
    assert result["ci_low@64"].tolist()[1:] == pytest.approx([2.542759, 1.829380], abs=1e-6)
    assert result["ci_high@64"].tolist()[1:] == pytest.approx([3.857241, 4.370620], abs=1e-6)
    assert math.isnan(result["ci_low@64"][0]) and math.isnan(result["ci_high@128"][1])  # n = 1: no interval
    assert result["ci_low@128"][2] == pytest.approx(4.2 - 12.706205 * math.sqrt(0.08) / math.sqrt(2), abs=1e-5)
    assert result.attrs["seed_values"][(1, 64)] == ((0, 3.0), (1, 3.1), (2, 3.5))

    markdown = reports.to_markdown(result)
    lines = markdown.splitlines()
    assert lines[0].startswith("val_loss (final step of each run;")
    assert "[95% Student t interval of the mean] when n > 1; '1 seed' = a single run" in lines[0]
    assert "constant: scale=logd_logn, p_train=none, rope_scaling=ntk, train_len=64, window_mode=nonoverlap" in lines[0]
    assert lines[2:] == [
        "| attention | p_eval | 64 (1x) | 128 (2x) |",
        "|---|---|---|---|",
        "| lssa | none | 3.1000 (1 seed) | 3.3000 (1 seed) |",
        "| lssa | 15 | 3.2000 ± 0.2646 (n=3) [2.5428, 3.8572] | 3.2500 (1 seed) |",
        "| softmax | none | 3.1000 ± 0.1414 (n=2) [1.8294, 4.3706] | 4.2000 ± 0.2828 (n=2) [1.6588, 6.7412] |",
    ]
    per_seed = reports.to_markdown(result, digits=2, with_caption=False, per_seed=True).splitlines()
    assert per_seed[3] == "| lssa | 15 | 3.20 ± 0.26 (n=3) [2.54, 3.86]; 0: 3.00, 1: 3.10, 2: 3.50 | 3.25 (1 seed) |"
    csv_lines = reports.to_csv(result).splitlines()
    assert csv_lines[0] == ("attention,p_eval,mean@64,std@64,n@64,ci_low@64,ci_high@64,note@64,"
                            "mean@128,std@128,n@128,ci_low@128,ci_high@128,note@128")
    assert csv_lines[1] == "lssa,,3.1,,1,,,1 seed,3.3,,1,,,1 seed"
    assert csv_lines[3].startswith("softmax,,3.1,0.1414213562")
    assert ",1.82937952" in csv_lines[3] and csv_lines[3].endswith(",")  # n = 2: no "1 seed" note


def test_table_other_metric_missing_cells_and_explicit_step(store):
    result = reports.table(store.read(), metric="bpb")
    assert result["mean@64"].tolist() == [1.23] and result.attrs["label_columns"] == ["attention"]
    early = reports.table(store.read(), step=100)
    assert early["mean@64"].tolist() == [9.9] and early["mean@128"].tolist() == [9.9]
    # A length measured for one configuration only shows "–" for the others.
    frame = pd.concat([store.read(), pd.DataFrame([row("lssa", None, 0, 256, 3.9)])], ignore_index=True)
    lines = reports.to_markdown(reports.table(frame), with_caption=False).splitlines()
    assert lines[2] == "| lssa | none | 3.1000 (1 seed) | 3.3000 (1 seed) | 3.9000 (1 seed) |"
    assert lines[4].endswith("| 4.2000 ± 0.2828 (n=2) [1.6588, 6.7412] | – |")
    with pytest.raises(UserError, match="--metric 'acc' has no rows; metrics present: bpb, val_loss"):
        reports.table(store.read(), metric="acc")
    with pytest.raises(UserError, match="marker"):
        reports.table(store.read(), metric="complete")


def test_best_ranks_at_a_length_or_multiple(store):
    ranking = reports.best(store.read(), at="2x")
    assert ranking["rank"].tolist() == [1, 2, 3]
    assert list(zip(ranking["attention"], ranking["p_eval"].fillna(0))) == [("lssa", 15.0), ("lssa", 0), ("softmax", 0)]
    assert ranking["mean"].tolist() == pytest.approx([3.25, 3.3, 4.2])
    assert reports.best(store.read(), at=128)["mean"].tolist() == pytest.approx([3.25, 3.3, 4.2])
    text = reports.best_to_markdown(ranking)
    assert "| 1 | lssa | 15 | 128 | 3.2500 (1 seed) |" in text and "lower is better" in text
    assert "| 3 | softmax | none | 128 | 4.2000 ± 0.2828 (n=2) [1.6588, 6.7412] |" in text
    assert ranking["ci_high"][2] == pytest.approx(6.741241, abs=1e-5)
    assert reports.best_to_csv(ranking).splitlines()[1].endswith(",1 seed")
    with pytest.raises(UserError, match="eval lengths present: 64, 128"):
        reports.best(store.read(), at="16x")
    with pytest.raises(UserError, match="--at 'far'"):
        reports.best(store.read(), at="far")
    # Accuracies rank higher-first.
    acc = pd.DataFrame([row("softmax", None, 0, 64, 0.2, metric="passkey_acc"),
                        row("lssa", None, 0, 64, 0.9, metric="passkey_acc")])
    assert reports.best(acc, at="1x", metric="passkey_acc")["attention"].tolist() == ["lssa", "softmax"]


def test_curves_write_a_png_that_opens_and_html_with_the_data(store, tmp_path):
    import matplotlib.image

    paths = reports.curves(store.read(), str(tmp_path / "plots"))
    with open(paths["png"], "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(paths["png"])
    assert image.shape[1] == 900 and image.shape[0] > 550  # 9 inches wide at 100 dpi; taller with the legend under it
    assert image.std() > 0  # something was drawn
    page = Path(paths["html"]).read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "data:image/png;base64,iVBORw0KGgo" in page
    assert "<td>3.2000 ± 0.2646 (n=3) [2.5428, 3.8572]</td>" in page
    assert "<td>4.2000 ± 0.2828 (n=2) [1.6588, 6.7412]</td>" in page and "<td>3.3000 (1 seed)</td>" in page
    assert "&#x27;1 seed&#x27; = a single run" in page
    assert "http://" not in page and "https://" not in page

    by_p = reports.curves(store.read(), str(tmp_path / "plots"), by="p")
    assert by_p["png"].endswith("val_loss_vs_p.png")
    assert matplotlib.image.imread(by_p["png"]).shape[1] == 900
    page = Path(by_p["html"]).read_text(encoding="utf-8")
    assert "<th>p_eval</th>" in page
    assert "<td>15</td><td>64</td><td>3.2000 ± 0.2646 (n=3) [2.5428, 3.8572]</td>" in page
    with pytest.raises(UserError, match="--by p needs rows with several"):
        reports.curves(store.read()[lambda d: d["attention"] == "softmax"], str(tmp_path / "x"), by="p")


def test_a_figure_says_what_it_shows_and_hides_no_line(store):
    """Title with the study, the shared settings under it, the training length marked, ticks in tokens and
    multiples, the unit on the y axis, and no two lines in one style (p_eval none and 15 of one model)."""
    figure, title, _, _, _ = reports.curve_figure(store.read())
    axes = figure.axes[0]
    assert title == "val_loss vs evaluation length — study t4"
    assert figure._suptitle.get_text() == title
    assert "fixed: " in axes.get_title() and "rope_scaling=ntk" in axes.get_title() and "train_len=64" in axes.get_title()
    assert axes.get_ylabel() == "val_loss (nats per token)"
    assert [t.get_text() for t in axes.get_xticklabels()] == ["64\n1x", "128\n2x"]
    marks = [line for line in axes.get_lines() if line.get_label().startswith("training length")]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == [64.0, 64.0]
    styles = [(c.lines[0].get_color(), c.lines[0].get_linestyle(), c.lines[0].get_marker()) for c in axes.containers]
    assert len(styles) == 3 and len(set(styles)) == 3  # softmax, lssa none, lssa 15: three distinct looks
    assert len({s[1] for s in styles}) == 3 and len({s[2] for s in styles}) == 3

    figure, title, _, _, _ = reports.curve_figure(store.read(), by="p")
    axes = figure.axes[0]
    assert title == "val_loss vs p_eval — study t4"
    assert [t.get_text() for t in axes.get_xticklabels()] == ["as trained", "15"]  # none = the model's own p
    assert "as trained" in axes.get_xlabel()
    assert any("L=128 (2x)" in c.get_label() for c in axes.containers)


def test_figures_and_exports_go_to_a_bucket_as_to_a_folder(store, s3_bucket, tmp_path, monkeypatch):
    from conftest import s3_keys

    monkeypatch.chdir(tmp_path)
    paths = reports.curves(store.read(), f"{s3_bucket}/figures")
    assert paths == {"png": f"{s3_bucket}/figures/val_loss_vs_length.png",
                     "html": f"{s3_bucket}/figures/val_loss_vs_length.html"}
    written = reports.export(store.read(metric="val_loss"), f"{s3_bucket}/rows/all.csv")
    assert written == f"{s3_bucket}/rows/all.csv"
    objects = [k for k in s3_keys(s3_bucket) if not k.endswith("/")]  # (pyarrow also puts folder markers)
    assert objects == ["figures/val_loss_vs_length.html", "figures/val_loss_vs_length.png", "rows/all.csv"]
    assert not any(p.name.startswith("s3") for p in tmp_path.iterdir())  # no local folder named after the URI


def test_every_command_and_option_says_what_it_does():
    import argparse

    from attnlab.cli import build_parser

    empty = []

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {choice.dest: choice.help for choice in action._choices_actions}
                for name, sub in action.choices.items():
                    if name in helps and not helps[name]:
                        empty.append(f"{path} {name}")
                    if name in helps:  # aliases share their command's parser
                        walk(sub, f"{path} {name}")
            elif action.dest != "help" and not action.help:
                empty.append(f"{path} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "attnlab")
    assert empty == []


def test_export_and_reference(store, tmp_path):
    frame = store.read(metric="val_loss")
    csv_path = reports.export(frame, str(tmp_path / "out" / "rows.csv"))
    assert len(pd.read_csv(csv_path)) == len(frame) == 12
    parquet_path = reports.export(frame, str(tmp_path / "rows.parquet"))
    assert pd.read_parquet(parquet_path)["value"].tolist() == frame["value"].tolist()
    reference = reports.format_reference_table()
    assert "| lssar | 15 | 3.1905 | 3.1930 | 3.2291 | 3.3171 |" in reference
    assert reports.reference_table().shape == (15, 6)


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="attnlab")
    results_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_reports(store, tmp_path, capsys):
    root = store.uri
    assert _run_cli(["results", "table", "--store", root, "--study", "t4"]) == 0
    out = capsys.readouterr().out
    assert "| softmax | none | 3.1000 ± 0.1414 (n=2) [1.8294, 4.3706] | 4.2000 ± 0.2828 (n=2) [1.6588, 6.7412] |" in out
    assert _run_cli(["results", "table", "--store", root, "--format", "csv", "--where", "attention=lssa",
                     "--where", "p_eval=none"]) == 0
    # Nothing varies: the label falls back to attention; std is empty when n = 1.
    assert capsys.readouterr().out.splitlines() == [
        "attention,mean@64,std@64,n@64,ci_low@64,ci_high@64,note@64,mean@128,std@128,n@128,ci_low@128,ci_high@128,note@128",
        "lssa,3.1,,1,,,1 seed,3.3,,1,,,1 seed"]
    assert _run_cli(["results", "table", "--store", root, "--per-seed", "--digits", "1", "--where", "attention=softmax"]) == 0
    assert "| 3.1 ± 0.1 (n=2) [1.8, 4.4]; 0: 3.0, 1: 3.2 | 4.2 ± 0.3 (n=2) [1.7, 6.7]; 0: 4.0, 1: 4.4 |" in capsys.readouterr().out
    assert _run_cli(["results", "table", "--store", root, "--reference"]) == 0
    assert "Paper (Gao & Spratling, Table 4)" in capsys.readouterr().out
    assert _run_cli(["results", "best", "--store", root, "--at", "2x", "--top", "1"]) == 0
    assert "| 1 | lssa | 15 | 128 | 3.2500 (1 seed) |" in capsys.readouterr().out
    assert _run_cli(["results", "curves", "--store", root, "--out", str(tmp_path / "c")]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "c" / "val_loss_vs_length.png"),
                                                 str(tmp_path / "c" / "val_loss_vs_length.html")]
    assert _run_cli(["results", "export", "--store", root, "--out", str(tmp_path / "e.parquet")]) == 0
    assert len(pd.read_parquet(tmp_path / "e.parquet")) == 14  # 13 rows + the complete marker
    assert _run_cli(["results", "studies", "--store", root]) == 0
    assert capsys.readouterr().out.split()[-1] == "t4"
    with pytest.raises(UserError, match="--study 'nope' not in store"):
        _run_cli(["results", "table", "--store", root, "--study", "nope"])
    with pytest.raises(UserError, match="no results store there"):
        _run_cli(["results", "table", "--store", str(tmp_path / "missing")])
    with pytest.raises(UserError, match="--where 'eval_len=big'"):
        _run_cli(["results", "table", "--store", root, "--where", "eval_len=big"])


def test_position_buckets_are_listed_in_window_order():
    import pandas as pd

    from attnlab.results import reports

    rows = [dict(study="s", trial="t", attention="lssa", scale="logd_logn", p_train=None, p_eval=None,
                 rope_scaling="ntk", step=1, tokens=1, eval_len=64, train_len=64, window_mode="nonoverlap",
                 metric="loss_bucket", value=v, seed=0, train_key="h", git_sha="x", bucket=b)
            for b, v in (("late", 3.0), ("early", 1.0), ("middle", 2.0))]
    table = reports.table(pd.DataFrame(rows), metric="loss_bucket")
    assert list(table["bucket"]) == ["early", "middle", "late"]
    assert list(table["mean@64"]) == [1.0, 2.0, 3.0]


# A real study's rows: many configuration columns constant over the selection, stated once under the title.
LONG_CONSTANTS = dict(scale="logd_logn", p_train=15.0, p_eval=None, rope_scaling="ntk_by_parts", train_len=64,
                      preset="tiny_cpu_probe", data="demo_corpus_synthetic_copy_v2", knobs="lr=0.003,warmup=50,wd=0.1",
                      window_mode="copy_distractors_with_long_padding")


def test_a_long_subtitle_is_wrapped_whole_inside_the_figure():
    """The line under the title names every constant column; with a real study's many columns it is wider than
    the figure, and the PNG used to cut it at both ends. It is now wrapped: every text of the figure lies inside
    the figure after drawing, and the wrapped lines joined give the whole subtitle back."""
    import matplotlib.text
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    frame = pd.DataFrame([{**row(attention, None, seed, length, 3.0 + 0.1 * seed + length / 1024, study="copy_probe"),
                           **LONG_CONSTANTS}
                          for attention in ("softmax", "lssar") for seed in (0, 1) for length in (64, 256, 1024)])
    expected = ("fixed: " + ", ".join(f"{k}={reports.format_value(v)}" for k, v in LONG_CONSTANTS.items())
                + "; error bars: sample std over seeds")
    assert len(expected) > 200  # wider than a 9-inch figure in one line
    figure, title, _, _, _ = reports.curve_figure(frame)
    subtitle = figure.axes[0].get_title()
    assert "\n" in subtitle and " ".join(subtitle.split("\n")) == expected  # wrapped, never cut short
    assert figure._suptitle.get_text() == title
    FigureCanvasAgg(figure)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    box = figure.bbox
    texts = [t for t in figure.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text().strip()]
    assert any(t.get_text() == subtitle for t in texts)
    for text in texts:
        extent = text.get_window_extent(renderer)
        assert (box.x0 - 0.5 <= extent.x0 and extent.x1 <= box.x1 + 0.5 and box.y0 - 0.5 <= extent.y0
                and extent.y1 <= box.y1 + 0.5), (text.get_text(), extent.bounds, box.bounds)
    assert figure.get_size_inches()[0] == 9  # grown in height only


def test_a_bounded_metric_never_reads_outside_its_range():
    """acc lies in [0, 1]: with n = 2 seeds its t interval would read [-4.3, 5.3]; the cell shows both seeds'
    values instead. With more seeds the interval is clipped to [0, 1]. val_loss is unbounded and unchanged."""
    import re

    from attnlab.results.stats import t_interval

    big = [1.0, 1.0, 1.0, 0.6, 1.0, 0.9]  # mean 0.9167, t interval [0.7485, 1.0848]
    acc = [row("softmax", None, 0, 64, 0.879, metric="acc"), row("softmax", None, 1, 64, 0.123, metric="acc"),
           *(row("lssa", None, seed, 64, v, metric="acc") for seed, v in enumerate(big))]
    loss = [row("softmax", None, 0, 64, 0.879), row("softmax", None, 1, 64, 0.123)]
    frame = pd.DataFrame(acc + loss)
    low, high = t_interval([0.879, 0.123])
    assert low < 0 and high > 1  # what the table used to print

    result = reports.table(frame, metric="acc")
    assert result["attention"].tolist() == ["lssa", "softmax"]
    assert ((result["ci_low@64"] >= 0) & (result["ci_high@64"] <= 1)).all()
    assert result["ci_high@64"][0] == 1.0 and result["ci_low@64"][0] == pytest.approx(t_interval(big)[0])
    lines = reports.to_markdown(result, digits=3, with_caption=False).splitlines()
    assert lines[2] == "| lssa | 0.917 ± 0.160 (n=6) [0.749, 1.000] |"
    assert lines[3] == "| softmax | 0.501 (n=2: 0.879, 0.123) |"
    numbers = [float(x) for line in lines[2:] for x in re.findall(r"-?\d+\.\d+", line)]
    assert numbers and all(0 <= x <= 1 for x in numbers)
    assert "acc lies in [0, 1]" in reports.caption(result)
    per_seed = reports.to_markdown(result, digits=3, with_caption=False, per_seed=True).splitlines()
    assert per_seed[3] == "| softmax | 0.501 (n=2: 0.879, 0.123); 0: 0.879, 1: 0.123 |"
    import io

    csv = pd.read_csv(io.StringIO(reports.to_csv(result)))
    assert csv["ci_low@64"].between(0, 1).all() and csv["ci_high@64"].between(0, 1).all()

    # The figure: the n = 2 point shows each seed as a small dot and no error bar; the n = 6 bar stops at 1.
    figure, _, _, _, body = reports.curve_figure(frame, metric="acc")
    axes = figure.axes[0]
    assert body == [["lssa", "0.9167 ± 0.1602 (n=6) [0.7485, 1.0000]"], ["softmax", "0.5010 (n=2: 0.8790, 0.1230)"]]
    bars = {c.get_label(): c for c in axes.containers}
    assert not bars["attention=softmax"].has_yerr
    dots = [line for line in axes.get_lines() if line.get_marker() == "."]
    assert len(dots) == 1 and sorted(dots[0].get_ydata()) == pytest.approx([0.123, 0.879])
    segments = bars["attention=lssa"].lines[2][0].get_segments()
    assert max(y for segment in segments for _, y in segment) == pytest.approx(1.0)
    assert min(y for segment in segments for _, y in segment) == pytest.approx(0.9167 - 0.1602, abs=1e-4)
    assert "small dots: each seed's value where n <= 3" in axes.get_title()

    # val_loss is not bounded: the same two values keep their t interval, as before.
    lines = reports.to_markdown(reports.table(frame, metric="val_loss"), digits=3, with_caption=False).splitlines()
    assert lines[2] == f"| softmax | 0.501 ± 0.535 (n=2) [{low:.3f}, {high:.3f}] |" == \
        "| softmax | 0.501 ± 0.535 (n=2) [-4.302, 5.304] |"
