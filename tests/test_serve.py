"""``attnlab serve`` without a browser: the data layer on a known study, the real server's pages and JSON, bad input
(a store, runs folder or study that does not exist, a bad flag), an ``s3://`` store and runs folder, and no Ray import.

The study is written by the real layout writers (``StudyFolder``, ``ResultsStore``; see ``serve_util``); the pages
come from the application under uvicorn on a loopback port. The real-browser test is ``test_serve_browser.py``.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.cli import main
from attnlab.errors import UserError
from attnlab.results import ResultsStore, reports
from attnlab.serve import data
from attnlab.serve.app import ResultsCache, create_app, plotly_js
from attnlab.serve.data import NotFound, open_sources
from attnlab.study.folder import StudyFolder
from serve_util import TRIALS, add_val_loss_at, get, get_json, serving, write_study

ROOT = Path(__file__).resolve().parents[1]
URL = re.compile(r"""https?://[^\s"'<>)]+""")


@pytest.fixture()
def local(tmp_path):
    store, runs = str(tmp_path / "results"), str(tmp_path / "runs")
    state = write_study(store, runs)
    return open_sources(store, runs), state


# ------------------------------------------------------------------------------------------------ data layer
def test_trials_carry_status_reason_point_and_progress(local):
    sources, _ = local
    assert data.study_names(sources) == {"probe": {"has_state": True, "has_results": True}}
    out = data.trials(sources, "probe")
    by_key = {t["key"]: t for t in out["trials"]}
    assert out["trials"][0]["status"] == "running"  # running trials first
    assert out["counts"] == {"running": 1, "complete": 3, "cached": 1, "diverged": 1, "pruned": 1}
    assert len(by_key) == len(TRIALS)
    running = by_key["aaaa000000000005"]
    assert (running["step"], running["steps"], running["progress"]) == (24, 40, pytest.approx(0.6))
    assert running["train_loss"] == pytest.approx(4.2 - 0.05 * 24) and running["val_loss"] == pytest.approx(4.3 - 1.0)
    assert running["curve"]["step"][-1] == 24 and running["curve"]["val_step"] == [10, 20]
    assert running["label"] == "attention=lssa, seed=0"
    assert by_key["aaaa000000000006"]["reason"].startswith("loss became nan")
    assert by_key["aaaa000000000007"]["reason"].startswith("stopped by asha")
    assert by_key["aaaa000000000007"]["step"] == 20
    assert by_key["aaaa000000000001"]["progress"] == 1.0 and by_key["aaaa000000000001"]["curve"] is None
    # a run that stopped training shows its last losses, from its metrics.jsonl (train 4.2 - 0.05 x 40, val at 40)
    for key in ("aaaa000000000001", "aaaa000000000004"):  # complete, cached
        assert by_key[key]["train_loss"] == pytest.approx(2.2) and by_key[key]["val_loss"] == pytest.approx(2.3)
    pruned = by_key["aaaa000000000007"]  # stopped at step 20
    assert pruned["train_loss"] == pytest.approx(3.2) and pruned["val_loss"] == pytest.approx(3.3)
    assert (out["total"], out["page"], out["pages"], out["first"], out["last"]) == (len(TRIALS), 1, 1, 1, len(TRIALS))
    assert all(t["curve"] for t in data.trials(sources, "probe", curves="all")["trials"])
    assert out["signature"]  # the study has results files
    with pytest.raises(UserError, match="curves='some'"):
        data.trials(sources, "probe", curves="some")


def test_a_runs_validation_at_longer_lengths_is_a_curve_per_length(local):
    """A run trained with eval.during_training has val_loss_at in its metrics lines: its curve carries one series
    per length (shortest first) against the steps that measured it; a run without them has none."""
    sources, state = local
    add_val_loss_at(state, "aaaa000000000005", lengths=(256, 128), every=10)  # the running trial, to step 24
    by_key = {t["key"]: t for t in data.trials(sources, "probe", curves="all")["trials"]}
    val_at = by_key["aaaa000000000005"]["curve"]["val_at"]
    assert [s["length"] for s in val_at] == [128, 256]
    for series in val_at:
        assert series["step"] == [10, 20]
        assert series["val_loss"] == [pytest.approx(4.5 + series["length"] / 1000 - 0.05 * s) for s in (10, 20)]
    assert by_key["aaaa000000000001"]["curve"]["val_at"] == []
    with serving(create_app(sources, refresh_s=1.0)) as base:  # and through the page's JSON
        status, trials = get_json(base + "/api/study/probe/trials?curves=running")
    [running] = [t for t in trials["trials"] if t["curve"]]
    assert status == 200 and [s["length"] for s in running["curve"]["val_at"]] == [128, 256]


def test_a_study_of_many_trials_is_listed_a_page_at_a_time(tmp_path):
    """500 trials: the page lists 50 at a time (running first), with the counts of them all; the losses and curves
    are those of the page's trials."""
    runs = str(tmp_path / "runs")
    state = StudyFolder(runs, "many")
    state.write_study({"name": "many", "search": {"engine": "optuna"}}, "fp")
    for i in range(500):
        key = f"k{i:04d}"
        status = "running" if i in (7, 300) else ("failed" if i % 50 == 0 else "complete")
        if i < 120:  # only some runs have metrics
            state.run(key).write_text("metrics.jsonl", json.dumps({"step": 4, "train_loss": 3.0 + i / 1000,
                                                                   "val_loss": 3.5}) + "\n")
        state.write_status(key, status=status, point={"attention": "softmax", "seed": i}, steps=4,
                           started=1000.0 + i)
    sources = open_sources(str(tmp_path / "results"), runs)
    first = data.trials(sources, "many", curves="all")
    assert (first["total"], first["page"], first["pages"], first["per_page"]) == (500, 1, 10, 50)
    assert first["counts"] == {"running": 2, "complete": 489, "failed": 9}
    assert len(first["trials"]) == 50 and (first["first"], first["last"]) == (1, 50)
    assert [t["key"] for t in first["trials"][:3]] == ["k0007", "k0300", "k0000"]  # running first, then by start
    assert first["trials"][3]["train_loss"] == pytest.approx(3.001) and first["trials"][3]["val_loss"] == 3.5
    assert all(t["curve"] is not None for t in first["trials"])
    last = data.trials(sources, "many", page=10)
    assert (len(last["trials"]), last["first"], last["last"]) == (50, 451, 500)
    assert last["trials"][-1]["key"] == "k0499" and last["trials"][-1]["train_loss"] is None  # no metrics file
    assert data.trials(sources, "many", page=99)["page"] == 10  # past the end: the last page
    with pytest.raises(UserError, match="page=0: give a whole number >= 1"):
        data.trials(sources, "many", page=0)
    with pytest.raises(UserError, match="page='x': give a whole number >= 1"):
        data.page_number("x")

    with serving(create_app(sources)) as base:
        status, _, page = get(base + "/study/many?page=3")
        assert status == 200 and page.count(' data-key=') == 50
        assert "trials 101–150 of 500 (running first)" in page and "page 3 of 10" in page
        assert 'href="?page=2" data-page="2"' in page and 'href="?page=4" data-page="4"' in page
        status, body = get_json(base + "/api/study/many/trials?page=10&curves=none")
        assert status == 200 and body["page"] == 10 and body["html"].count(" data-key=") == 50
        assert 'href="?page=11"' not in body["html"]
        status, body = get_json(base + "/api/study/many/trials?page=-1")
        assert status == 400 and body["error"] == "page='-1': give a whole number >= 1"


def test_results_are_the_reports_of_attnlab_results(local):
    """The table and the ranking are reports.table / reports.best on the same rows: one code path."""
    sources, _ = local
    res = data.results(sources, "probe")
    assert res["metric"] == "acc"  # the study's objective metric (a probe), not val_loss
    assert res["metrics"] == ["acc", "val_loss"]
    df = ResultsStore(sources.store.uri).read(study="probe")
    expected = reports.table(df, metric="acc")
    header, body = reports.formatted_cells(expected)
    assert (res["table"]["header"], res["table"]["body"]) == (header, body)
    assert res["table"]["markdown"] == reports.to_markdown(expected)
    assert res["at"] == "4x" and res["at_length"] == 256  # the objective's length
    ranking = reports.best(df, at="4x", metric="acc")
    assert res["best"]["markdown"] == reports.best_to_markdown(ranking)
    assert res["best"]["top"]["attention"] == "lssar" and res["best"]["top"]["rank"] == "1"
    assert res["best"]["title"].startswith("ranking at 4x (higher is better;")

    curves = res["curves"]
    assert curves["selectors"] == {"p_eval": ["none", "15"], "rope_scaling": ["none", "ntk"]}
    assert curves["defaults"] == {"p_eval": "none", "rope_scaling": "none"}  # the objective's own cell
    assert curves["lengths"] == [64, 128, 256] and curves["train_len"] == 64
    assert curves["higher_is_better"] is True
    [softmax] = [s for s in curves["series"]
                 if s["labels"] == {"attention": "softmax", "p_train": "none", "p_eval": "none", "rope_scaling": "none"}]
    assert softmax["name"] == "attention=softmax, p_train=none"
    assert softmax["mean"][0] == pytest.approx(0.99) and softmax["n"] == [2, 2, 2]  # seeds 0 and 1: 1.0, 0.98
    assert softmax["std"][0] == pytest.approx(math.sqrt(2 * 0.01 ** 2))  # sample std (ddof = 1)

    other = data.results(sources, "probe", metric="val_loss", at="128")
    assert other["metric"] == "val_loss" and other["at_length"] == 128
    assert other["best"]["title"].startswith("ranking at 128 (lower is better;")
    # the diverged trial's NaN rows: "nan" cells in the table, no points on its curve, last in the ranking
    [diverged] = [s for s in other["curves"]["series"] if s["labels"]["attention"] == "sigmoid_l1"
                  and s["labels"]["p_eval"] == "none" and s["labels"]["rope_scaling"] == "none"]
    assert diverged["mean"] == [None, None, None] and diverged["n"] == [1, 1, 1]
    assert ["sigmoid_l1", "none", "none", "none", *["nan (1 seed)"] * 3] in other["table"]["body"]
    assert other["best"]["body"][-1][1] == "sigmoid_l1"
    with pytest.raises(UserError, match="metric='bpb'.*metrics present: acc, val_loss"):
        data.results(sources, "probe", metric="bpb")
    assert "error" in data.results(sources, "probe", at="32x")["best"]  # reports.best's own sentence


def test_results_are_cached_until_new_rows_land(local):
    sources, _ = local
    cache = ResultsCache(sources, size=2)
    first = cache.get("probe", None, None)
    assert cache.get("probe", None, None) is first
    assert cache.get("probe", "val_loss", None) is not first
    df = ResultsStore(sources.store.uri).read(study="probe", metric="acc", eval_len=64, p_eval=None,
                                               rope_scaling="none", seed=0, attention="lssar")
    extra = {**df.iloc[0].to_dict(), "trial": "aaaa000000000009", "train_key": "aaaa000000000009", "seed": 7,
             "value": 0.5}
    ResultsStore(sources.store.uri).write([{k: v for k, v in extra.items() if k not in ("created_at",)}],
                                          key=("eval", "aaaa000000000009"))
    second = cache.get("probe", None, None)
    assert second is not first and second["signature"] != first["signature"]
    assert second["table"]["body"][0][:4] == ["lssar", "15", "none", "none"]  # then 64 (1x): one more seed
    assert "(n=3: " in second["table"]["body"][0][4] and "(n=2: " in first["table"]["body"][0][4]  # acc: the seeds


def test_links_name_the_study_own_tensorboard_and_optuna(tmp_path):
    store, runs = str(tmp_path / "results"), str(tmp_path / "runs")
    write_study(store, runs, name="grid-study")
    state = write_study(store, runs, name="tpe-study", engine="optuna")
    sources = open_sources(store, runs, ray_dashboard="http://127.0.0.1:9999")
    grid = data.study_info(sources, "grid-study")
    assert grid["links"] == {"ray_dashboard": "http://127.0.0.1:9999", "optuna_dashboard": None,
                             "tensorboard": f"tensorboard --logdir {tmp_path / 'runs' / 'grid-study' / 'tune'}"}
    assert grid["ray"]["source"] == "flag"
    tpe = data.study_info(sources, "tpe-study")
    assert tpe["links"]["optuna_dashboard"] == f"optuna-dashboard {state.optuna_url(None)}"
    assert tpe["links"]["optuna_dashboard"].endswith("/tpe-study/optuna.db")
    overview = data.overview(sources)
    assert [s["name"] for s in overview["studies"]] == ["grid-study", "tpe-study"]
    assert overview["studies"][0]["counts"]["complete"] == 3 and overview["studies"][0]["trials"] == len(TRIALS)


def test_the_page_links_the_dashboard_the_study_recorded_unless_told_otherwise(tmp_path, capsys):
    from attnlab.ray_runtime import Dashboard

    store, runs = str(tmp_path / "results"), str(tmp_path / "runs")
    live = Dashboard("http://127.0.0.1:41234").record()
    write_study(store, runs, name="live", ray=live)
    write_study(store, runs, name="older", ray={**Dashboard("http://127.0.0.1:41000").record(), "recorded": 1.0})
    write_study(store, runs, name="bare", ray=Dashboard(None, "the cluster runs without one").record())
    write_study(store, runs, name="legacy")  # a study.json from before the dashboard was recorded
    write_study(store, runs, name="forged", ray={"dashboard": "javascript:alert(1)"})
    # an embedded cluster: linked while the study's process lives; "the cluster has stopped" once it ended (the
    # study recorded it as its process ended, or its process is gone); a cluster it joined keeps its link
    embedded = Dashboard("http://127.0.0.1:41500", embedded=True).record()
    assert embedded["embedded"] and embedded["pid"] == os.getpid()
    write_study(store, runs, name="embedded-live", ray=embedded)
    write_study(store, runs, name="embedded-ended", ray=embedded)
    StudyFolder(runs, "embedded-ended").record_cluster_stopped(pid=os.getpid() + 1)  # not its record: left alone
    assert "stopped" not in StudyFolder(runs, "embedded-ended").saved_study().ray
    StudyFolder(runs, "embedded-ended").record_cluster_stopped(pid=os.getpid())  # as the study's process ends
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_study(store, runs, name="embedded-killed", ray={**embedded, "pid": int(dead.stdout)})
    write_study(store, runs, name="joined-ended", ray={**live, "stopped": 1.0, "embedded": False})
    assert StudyFolder(runs, "live").saved_study().ray["dashboard"] == "http://127.0.0.1:41234"
    assert StudyFolder(runs, "legacy").saved_study().ray is None

    sources = open_sources(store, runs)  # no --ray-dashboard
    assert sources.ray_dashboard is None
    info = {name: data.study_info(sources, name) for name in ("live", "older", "bare", "legacy", "forged")}
    assert info["live"]["links"]["ray_dashboard"] == "http://127.0.0.1:41234"
    assert info["live"]["ray"]["source"] == "study"
    assert info["bare"]["links"]["ray_dashboard"] is None
    assert info["bare"]["ray"]["note"] == "the cluster runs without one"
    for name in ("legacy", "forged"):  # nothing (usable) recorded: Ray's default port
        assert info[name]["links"]["ray_dashboard"] == data.DEFAULT_RAY_DASHBOARD, name
        assert info[name]["ray"]["source"] == "default"
    assert data.study_info(sources, "embedded-live")["links"]["ray_dashboard"] == "http://127.0.0.1:41500"
    assert data.study_info(sources, "joined-ended")["links"]["ray_dashboard"] == "http://127.0.0.1:41234"
    for name in ("embedded-ended", "embedded-killed"):
        ended = data.study_info(sources, name)
        assert ended["links"]["ray_dashboard"] is None and ended["ray"]["stopped"] is True, name
    assert StudyFolder(runs, "embedded-ended").saved_study().ray["stopped"] > 0
    # the header outside a study page: the most recently started study's dashboard (a stopped one: never)
    assert data.header_dashboard(sources, [s for s in data.overview(sources)["studies"]
                                           if not s["name"].startswith(("embedded-live", "joined"))]) \
        == "http://127.0.0.1:41234"
    assert data.header_dashboard(sources) == data.DEFAULT_RAY_DASHBOARD

    # an explicit --ray-dashboard (an SSH tunnel) wins everywhere
    tunnel = open_sources(store, runs, ray_dashboard="http://127.0.0.1:8265")
    for name in ("live", "bare", "legacy"):
        assert data.study_info(tunnel, name)["links"]["ray_dashboard"] == "http://127.0.0.1:8265"
    assert data.header_dashboard(tunnel, data.overview(tunnel)["studies"]) == "http://127.0.0.1:8265"

    with serving(create_app(sources)) as base:
        _, _, page = get(base + "/study/live")
        assert page.count('href="http://127.0.0.1:41234"') == 2  # the header and the study's own link
        assert 'id="ray-dashboard"' in page and 'data-source="study"' in page
        _, _, page = get(base + "/study/bare")
        assert 'id="ray-dashboard-none"' in page and "the cluster runs without one" in page
        assert 'class="ray"' not in page and "8265" not in page
        _, _, page = get(base + "/study/embedded-ended")
        assert 'id="ray-dashboard-stopped"' in page and "the cluster has stopped" in page
        assert "41500" not in page and 'class="ray"' not in page  # no link to a dead port, not even in the header
        _, _, page = get(base + "/study/embedded-live")
        assert 'href="http://127.0.0.1:41500"' in page and "has stopped" not in page
        _, _, page = get(base + "/study/forged")
        assert "javascript:" not in page and 'href="http://127.0.0.1:8265"' in page
        _, _, index = get(base + "/")  # the latest study whose dashboard is up: embedded-live's
        assert 'class="ray" href="http://127.0.0.1:41500"' in index
    with serving(create_app(tunnel)) as base:
        _, _, page = get(base + "/study/live")
        assert "41234" not in page and page.count('href="http://127.0.0.1:8265"') == 2
    # the flag's help says where the default comes from
    from attnlab.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Default: each study's own, the dashboard of the cluster it runs on" in help_text


def test_bad_input_is_one_sentence(tmp_path, local):
    sources, _ = local
    with pytest.raises(NotFound, match=r"no study 'nope' under --runs .*; studies: probe"):
        data.study_info(sources, "nope")
    with pytest.raises(NotFound, match="not a study name"):
        data.trials(sources, "../etc")
    with pytest.raises(NotFound, match=r"--store .*/missing/results: neither it nor the folder"):
        open_sources(str(tmp_path / "missing" / "results"), str(tmp_path / "runs"))
    with pytest.raises(NotFound, match=r"--runs .*/missing/runs: neither it nor the folder"):
        open_sources(str(tmp_path / "results"), str(tmp_path / "missing" / "runs"))
    with pytest.raises(UserError, match="--store='ftp://x/y': the scheme ftp:// is not supported"):
        open_sources("ftp://x/y", str(tmp_path))
    with pytest.raises(UserError, match="--ray-dashboard"):
        open_sources(str(tmp_path), str(tmp_path), ray_dashboard="javascript:alert(1)")
    # a store a study has not written yet (its folder's parent exists): the page says so instead
    fresh = open_sources(str(tmp_path / "not-yet"), str(tmp_path / "runs"))
    assert "does not exist yet" in data.results(fresh, "probe")["message"]
    empty = open_sources(str(tmp_path / "results"), str(tmp_path / "no-runs-yet"))
    with pytest.raises(NotFound, match="no-runs-yet does not exist"):
        data.overview(open_sources(str(tmp_path / "none"), str(tmp_path / "no-runs-yet")))
    assert [s["name"] for s in data.overview(empty)["studies"]] == ["probe"]  # results only, no state
    assert data.trials(empty, "probe")["trials"] == []


# ------------------------------------------------------------------------------------------------ HTTP
def _no_external_resources(html: str, allowed: tuple[str, ...] = ("http://127.0.0.1:8265",)) -> None:
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html.replace('href="http://127.0.0.1:8265"', "")), \
        "a resource from another origin"
    found = {url.rstrip(":.,;") for url in URL.findall(html)}
    assert found <= set(allowed), found


def test_pages_and_json_over_a_real_server(local):
    sources, _ = local
    with serving(create_app(sources, refresh_s=1.0)) as base:
        status, kind, index = get(base + "/")
        assert status == 200 and kind.startswith("text/html")
        assert 'href="/study/probe"' in index and "1 running" in index and "1 diverged" in index
        _no_external_resources(index)

        status, _, page = get(base + "/study/probe")
        assert status == 200
        _no_external_resources(page)
        assert 'src="/static/plotly.min.js"' in page and 'src="/static/study.js"' in page
        assert 'data-status="running"' in page and "24 / 40" in page
        assert "loss became nan at step 12" in page and "stopped by asha at step 20" in page
        assert 'id="table4"' in page and "0.9900 (n=2: " in page  # softmax, 1x, acc: the values of seeds 0 and 1
        assert "tensorboard --logdir" in page and 'href="http://127.0.0.1:8265"' in page
        assert 'id="best-top"' in page

        status, kind, js = get(base + "/static/plotly.min.js")
        assert status == 200 and "javascript" in kind and js.encode() == plotly_js()
        for name in ("study.js", "page.css"):
            status, _, text = get(f"{base}/static/{name}")
            assert status == 200 and not URL.search(text), name  # the page's own code calls no other origin

        status, trials = get_json(base + "/api/study/probe/trials?curves=all")
        assert status == 200 and trials["running"] == 1 and 'id="trials-table"' in trials["html"]
        status, res = get_json(base + "/api/study/probe/results?metric=val_loss&at=2x")
        assert status == 200 and res["results"]["metric"] == "val_loss" and res["results"]["at_length"] == 128
        assert 'id="table4"' in res["html"]
        status, studies = get_json(base + "/api/studies")
        assert status == 200 and [s["name"] for s in studies["studies"]] == ["probe"]

        # bad input: one sentence, never a stack trace
        for path, code, sentence in [
            ("/study/nope", 404, "no study &#39;nope&#39; under --runs"),
            ("/study/probe?metric=bpb", 400, "has no rows of it; metrics present: acc, val_loss"),
            ("/nothing/here", 404, "nothing at /nothing/here"),
            ("/static/secret.py", 404, "no static file"),
        ]:
            status, _, body = get(base + path)
            assert status == code and sentence in body and "Traceback" not in body, (path, body)
        status, body = get_json(base + "/api/study/nope/trials")
        assert status == 404 and body["error"].startswith("no study 'nope'")


def test_a_missing_store_or_storage_gets_a_clear_page(tmp_path):
    store, runs = str(tmp_path / "results"), str(tmp_path / "runs")
    write_study(store, runs)
    with serving(create_app(open_sources(str(tmp_path / "typo"), runs))) as base:
        status, _, page = get(base + "/study/probe")  # the state is there, the store is not (yet)
        assert status == 200 and "The results store" in page and "does not exist yet" in page
    with serving(create_app(open_sources(str(tmp_path / "typo"), str(tmp_path / "typo-runs")))) as base:
        status, _, page = get(base + "/")
        assert status == 404 and "typo-runs does not exist (yet)" in page and "Traceback" not in page


def test_cli_refuses_bad_flags_in_one_line(tmp_path, capsys):
    missing = str(tmp_path / "no" / "such" / "runs")
    for argv, expected in [
        # --storage, the runs folder's earlier name, still names it
        (["serve", "--store", str(tmp_path), "--storage", missing], f"--runs {missing}: neither it nor"),
        (["serve", "--store", "ftp://bucket/x", "--runs", str(tmp_path)], "--store='ftp://bucket/x'"),
        (["serve", "--store", str(tmp_path), "--runs", str(tmp_path), "--port", "0"], "--port 0"),
        (["serve", "--store", str(tmp_path), "--runs", str(tmp_path), "--refresh", "0"], "--refresh 0"),
        (["serve", "--store", str(tmp_path), "--runs", str(tmp_path), "--host", "no.such.host.invalid"], "--host"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"attnlab: error: {expected}") and err.count("\n") == 1, err
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", "--store", str(tmp_path), "--runs", str(tmp_path), "--port", str(port)]) == 2
        assert f"--port {port}: cannot listen there" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- object storage
def test_the_page_reads_an_s3_store_and_storage(s3_bucket):
    store, runs = f"{s3_bucket}/results", f"{s3_bucket}/runs"
    state = write_study(store, runs, name="remote")
    sources = open_sources(store, runs)
    assert sources.runs.uri == runs and not sources.runs.is_local
    with serving(create_app(sources)) as base:
        status, _, page = get(base + "/study/remote")
        assert status == 200 and 'data-status="running"' in page and 'id="table4"' in page
        assert f"tensorboard --logdir {state.tune.uri}" in page and state.tune.uri.startswith("s3://")
        _no_external_resources(page)
        status, trials = get_json(base + "/api/study/remote/trials?curves=running")
        running = [t for t in trials["trials"] if t["status"] == "running"]
        assert status == 200 and running[0]["curve"]["step"][-1] == 24 and trials["signature"]
        status, res = get_json(base + "/api/study/remote/results")
        assert status == 200 and res["results"]["best"]["top"]["attention"] == "lssar"
        status, _, body = get(base + "/study/absent")
        assert status == 404 and "no study &#39;absent&#39;" in body
    with pytest.raises(NotFound, match="neither it nor the bucket exists"):
        open_sources("s3://attnlab-no-such-bucket-0", runs)


# ------------------------------------------------------------------------------------------------ house rules
def test_the_server_never_imports_ray(tmp_path):
    store, runs = str(tmp_path / "results"), str(tmp_path / "runs")
    write_study(store, runs)
    code = f"""
import sys
from attnlab.serve.app import create_app
from attnlab.serve import cli, data
sources = data.open_sources({store!r}, {runs!r})
create_app(sources)
data.overview(sources); data.trials(sources, "probe", curves="all"); data.results(sources, "probe")
bad = sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))
assert not bad, bad
print("no ray")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "platform")})
    assert out.returncode == 0 and "no ray" in out.stdout, out.stderr[-2000:]


def test_serve_is_registered_and_documented():
    from attnlab.cli import build_parser

    help_text = build_parser().format_help()
    assert "serve" in help_text
    page = (ROOT / "docs" / "watching.md").read_text()
    assert "## Watching a study in the browser" in page and "](serve.png)" in page
    readme = (ROOT / "README.md").read_text()
    assert "attnlab serve" in readme and "(docs/watching.md)" in readme
    assert (ROOT / "docs" / "serve.png").stat().st_size > 10_000
    cluster = (ROOT / "cluster" / "README.md").read_text()
    assert "attnlab serve" in cluster and "-L 8000:127.0.0.1:8000" in cluster
    for name in ("aws.yaml", "gcp.yaml", "local-fake.yaml"):  # never opened in the cluster files
        assert "8000" not in (ROOT / "cluster" / name).read_text(), name


def test_an_orbit_study_shows_the_recovered_laws(local):
    """Force-probe rows (as attnlab.evaluate.cell_rows.force_rows writes them) add the recovered-law table: the same
    reports.laws as `attnlab results laws`, on the page and in its markdown."""
    from attnlab.evaluate.force_probe import FORCE_METRICS
    from attnlab.results import LAW_METRIC
    from serve_util import _row

    sources, _ = local
    laws = {"aaaa000000000001": "39.48*m1*m2/r**2", "aaaa000000000002": "7.766/r**2"}
    rows = []
    for key, expression in laws.items():
        point = {"attention": "lssar" if key.endswith("1") else "softmax", "seed": 0}
        for metric in FORCE_METRICS:
            rows.append({**_row("probe", key, point, 40, None, "none", 64), "window_mode": "force_finetune",
                         "metric": metric, "value": 1.0 if metric == "force_is_newton" and "m1" in expression else 0.5,
                         **({"expression": expression} if metric == LAW_METRIC else {})})
    ResultsStore(sources.store.uri).write(rows, key=("eval", "force"))
    res = data.results(sources, "probe")
    expected = reports.laws_to_markdown(reports.laws(ResultsStore(sources.store.uri).read(study="probe")))
    assert res["laws"]["markdown"] == expected
    assert "expression" in res["laws"]["header"]
    assert {row[res["laws"]["header"].index("expression")] for row in res["laws"]["body"]} == set(laws.values())
    assert any(line.startswith("lssar: Newton's law") and "in 1 of 1" in line for line in res["laws"]["summary"])
    with serving(create_app(sources, refresh_s=1.0)) as base:
        status, _, page = get(base + "/study/probe")
        assert status == 200 and 'id="laws"' in page and "39.48*m1*m2/r**2" in page and 'id="laws-summary"' in page
