"""``attnlab serve`` in a real browser: headless Chromium (Debian's package, driven by Playwright) watches a study run.

A small probe study (tiny preset, a copy task with a 64-token vocabulary, 2 variants x 2 seeds, two trials at a time)
runs as an ``attnlab study run`` subprocess on the session's Ray cluster; ``attnlab serve`` runs as another
subprocess on a free loopback port. The browser opens the study page while a trial trains and sees it running (its
status, its progress bar moving, its live training curve), follows the page's "Ray dashboard" link to the dashboard
of the cluster the study runs on (the address the study's plan line printed) and finds it answering, then, without
reloading, sees every trial complete and the extrapolation curves, the Table-4 layout and the best configuration
appear. Every request the study page makes goes to the server itself. Screenshots land in the test's folder
(``ATTNLAB_SERVE_SCREENSHOT=FILE`` also writes the final one there).

Chromium comes from Debian (``apt-get install -y chromium``; ``.ci/run`` installs it); Playwright's own browser
download (``playwright install``) is never used.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from attnlab.study.folder import StudyFolder

from serve_util import add_val_loss_at, free_port, get, serving, write_study


CHROMIUM = os.environ.get("ATTNLAB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
STUDY = {
    "name": "watched",
    "description": "copy probe watched by the browser test",
    "train": {"preset": "tiny", "data": {"synthetic": "copy_distractors", "vocab": 64, "copy_len": 16},
              "steps": 160, "tokens_per_step": 256, "micro_batch": 4, "lr": 3.0e-3, "warmup_steps": 5,
              "log_every": 4, "val_every": 80, "val_tokens": 1024, "checkpoint_every": 160, "keep_checkpoints": 1,
              "max_failures": 0, "cpus_per_worker": 0.5, "threads_per_worker": 1},
    "resources": {"trial_cpus": 0.5, "max_concurrent_trials": 2},
    "search": {"engine": "grid"},
    "space": {"attention": ["softmax", "lssar"], "seeds": [0, 1]},
    "objective": {"metric": "acc@4x,rope=none", "mode": "max"},
    "scheduler": "none",
    "eval": {"multiples": [1, 2, 4], "p_eval": ["none", 15], "rope_scaling": ["none", "ntk"], "max_tokens": 512},
}
TRIALS = 4


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None and not predicate():
            tail = log.read_text()[-3000:] if log and log.exists() else ""
            raise AssertionError(f"{what}: the process ended first (exit {proc.returncode})\n{tail}")
        if time.time() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


def _status(url: str) -> int | None:
    """The HTTP status of a GET, None while nothing listens."""
    try:
        return get(url)[0]
    except OSError:
        return None


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(1800)  # ~3 min on an idle 2-core machine; 17 min measured on a heavily shared one
def test_a_browser_watches_a_study_run_and_complete(ray_session, tmp_path):
    from playwright.sync_api import sync_playwright

    assert os.path.exists(CHROMIUM), f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does it)"
    study_file = tmp_path / "watched.yaml"
    study_file.write_text(yaml.safe_dump(STUDY))
    store, runs = tmp_path / "results", tmp_path / "runs"
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server_log, study_log = tmp_path / "serve.log", tmp_path / "study.log"

    # the server first: it starts before the study exists and picks it up
    server = subprocess.Popen([sys.executable, "-m", "attnlab.cli", "serve", "--store", str(store), "--runs",
                               str(runs), "--port", str(port), "--refresh", "1"], cwd=tmp_path, env=env,
                              stdout=server_log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    study = None
    try:
        _wait(lambda: _status(base + "/api/studies") in (200, 404), 180, "the server", server, server_log)
        status, _, page = get(base + "/")
        assert status == 404 and "does not exist (yet)" in page  # nothing ran there yet: a clear page

        study = subprocess.Popen([sys.executable, "-m", "attnlab.cli", "study", "run", str(study_file), "--store",
                                  str(store), "--runs", str(runs)], cwd=tmp_path, env=env,
                                 stdout=study_log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        _wait(lambda: _status(base + "/study/watched") == 200, 300, "the study's state", study, study_log)

        requests: list[str] = []
        errors: list[str] = []
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch_persistent_context(
                str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
                viewport={"width": 1280, "height": 900})
            try:
                page = browser.new_page()
                page.on("request", lambda r: requests.append(r.url))
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(base + "/study/watched")

                # while a trial trains: its status, its progress bar moving, its live training curve
                page.wait_for_selector('#trials tr[data-status="running"]', timeout=300_000)
                page.wait_for_function(
                    """() => { const p = document.querySelector('#trials tr[data-status="running"] progress');
                               return p !== null && p.value > 0 && p.value < p.max; }""", timeout=300_000)
                page.wait_for_function("() => +document.getElementById('live-curves').dataset.traces > 0",
                                       timeout=60_000)
                assert "running" in page.inner_text('#trials tr[data-status="running"] .badge')
                assert "● live" in page.inner_text("#trial-counts")
                running_steps = page.inner_text('#trials tr[data-status="running"] .steps')
                assert running_steps.endswith("/ 160"), running_steps
                page.screenshot(path=str(tmp_path / "running.png"), full_page=True)

                # the page's Ray dashboard is that of the cluster the study runs on (the session's, whose port is
                # not 8265), the address the study's plan line printed, and it answers while the trial runs
                dashboard = page.get_attribute("#ray-dashboard", "href")
                assert dashboard == os.environ["RAY_API_SERVER_ADDRESS"], dashboard
                assert page.get_attribute("header .ray", "href") == dashboard
                plan = next(line for line in study_log.read_text().splitlines() if line.startswith("plan: study"))
                assert plan.endswith(f"; Ray dashboard: {dashboard}"), plan
                board = browser.new_page()  # not `page`: its requests must all stay on the serve origin
                try:
                    response = board.goto(dashboard, wait_until="domcontentloaded", timeout=60_000)
                    assert response is not None and response.ok and "Ray" in board.title(), board.title()
                    version = board.request.get(dashboard.rstrip("/") + "/api/version", timeout=30_000)
                    assert version.ok and "ray_version" in version.json(), version.text()[:300]
                    assert page.locator('#trials tr[data-status="running"]').count() >= 1  # still running
                finally:
                    board.close()

                # after the study: every trial complete, and the results appear without a reload
                assert study.wait(timeout=900) == 0, study_log.read_text()[-3000:]
                page.wait_for_function(
                    f"""() => document.querySelectorAll('#trials tr[data-status="complete"]').length === {TRIALS}
                              && document.querySelectorAll('#trials tr[data-status="running"]').length === 0""",
                    timeout=60_000)
                page.wait_for_function("() => +(document.getElementById('extrapolation') || {dataset: {}}).dataset.traces > 0",
                                       timeout=60_000)
                # a finished trial shows its run's last train and validation loss (numbers, not "–")
                for cell in (4, 5):
                    text = page.inner_text(f'#trials tr[data-status="complete"] td:nth-child({cell})')
                    assert float(text) > 0, text
                header = page.inner_text("#table4 thead")
                assert "64 (1x)" in header and "256 (4x)" in header and "attention" in header
                assert page.locator("#table4 tbody tr").count() == 2 * 2 * 2  # attention x p_eval x rope_scaling
                assert "(n=2" in page.inner_text("#table4 tbody")  # mean ± std over the two seeds
                assert page.locator("#best tbody tr").count() >= 2
                assert page.inner_text("#best thead").split()[-1] == "acc"  # the probe's objective metric

                # p_eval and RoPE scaling are selectable: "all" draws every combination
                shown = int(page.get_attribute("#extrapolation", "data-traces"))
                page.select_option('select[data-selector="p_eval"]', "*")
                page.select_option('select[data-selector="rope_scaling"]', "*")
                page.wait_for_function(f"() => +document.getElementById('extrapolation').dataset.traces > {shown}")
                page.select_option('select[data-selector="p_eval"]', "none")
                page.select_option('select[data-selector="rope_scaling"]', "none")
                page.wait_for_timeout(500)
                page.screenshot(path=str(tmp_path / "complete.png"), full_page=True)
                if os.environ.get("ATTNLAB_SERVE_SCREENSHOT"):
                    shutil.copy(tmp_path / "complete.png", os.environ["ATTNLAB_SERVE_SCREENSHOT"])

                # the metric is selectable too (server side): val_loss instead of the probe's acc
                page.select_option('select[name="metric"]', "val_loss")
                page.wait_for_url("**metric=val_loss**")
                assert page.inner_text("#best thead").split()[-1] == "val_loss"

                # a study of 120 trials: 50 a page; "next" shows the next 50 without reloading the page
                many = StudyFolder(str(runs), "many")
                many.write_study({"name": "many"}, "fp")
                for i in range(120):
                    many.write_status(f"k{i:04d}", status="complete", point={"seed": i}, steps=4, started=1.0 + i)
                page.goto(base + "/study/many")
                assert page.locator("#trials tbody tr").count() == 50
                assert "trials 1–50 of 120" in page.inner_text("#trials-pager-top")
                page.evaluate("() => { window.notReloaded = true; }")
                page.click("#trials-pager-top a[data-page='2']")
                page.wait_for_function("() => document.querySelector('#trials tbody tr').dataset.key === 'k0050'")
                assert page.evaluate("() => window.notReloaded") is True and "page=2" in page.url
                assert "trials 51–100 of 120" in page.inner_text("#trials-pager-top")

                # an unknown study: a clear 404 page in the browser as well
                response = page.goto(base + "/study/no-such-study")
                assert response.status == 404
                assert "no study 'no-such-study'" in page.inner_text("#error-message")
            finally:
                browser.close()
        assert not errors, errors
        outside = sorted({url for url in requests if not url.startswith(base + "/")})
        assert not outside, f"the page loaded something from elsewhere: {outside}"
        assert any(url.endswith("/static/plotly.min.js") for url in requests)
    finally:
        if study is not None:
            _stop(study)
        _stop(server)
    assert "Traceback" not in server_log.read_text(), server_log.read_text()[-3000:]


def _browser(playwright, tmp_path):
    return playwright.chromium.launch_persistent_context(
        str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
        viewport={"width": 1280, "height": 900})


@pytest.mark.timeout(600)
def test_the_training_curves_draw_a_line_per_longer_length(tmp_path):
    """A run trained with eval.during_training: the study page's training curves draw its validation loss at each
    longer length as a line of its own, named "val @L" in the legend, next to its train and validation loss. No Ray:
    the study's files are written as a study leaves them (tests/serve_util.py) and served in this process."""
    from playwright.sync_api import sync_playwright

    from attnlab.serve.app import create_app
    from attnlab.serve.data import open_sources

    assert os.path.exists(CHROMIUM), f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does it)"
    store, runs = str(tmp_path / "results"), str(tmp_path / "runs")
    state = write_study(store, runs)
    add_val_loss_at(state, "aaaa000000000005", lengths=(128, 256), every=10)  # the running trial (lssa, seed 0)
    errors: list[str] = []
    with serving(create_app(open_sources(store, runs), refresh_s=1.0)) as base, sync_playwright() as playwright:
        browser = _browser(playwright, tmp_path)
        try:
            page = browser.new_page()
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(base + "/study/probe")
            page.wait_for_function("() => +document.getElementById('live-curves').dataset.traces > 0", timeout=60_000)
            names = page.evaluate("() => document.getElementById('live-curves').data.map((t) => t.name)")
            label = "attention=lssa, seed=0"
            assert f"{label} val @128" in names and f"{label} val @256" in names, names
            assert len([n for n in names if "val @" in n]) == 2  # only the run that measured them
            legend = page.evaluate("""() => [...document.querySelectorAll('#live-curves .legend .legendtext')]
                                                .map((e) => e.textContent)""")  # what the reader sees
            assert f"{label} val @128" in legend and f"{label} val @256" in legend, legend
            traces = page.evaluate("""() => document.getElementById('live-curves').data
                                           .filter((t) => / val @/.test(t.name)).map((t) => [t.x, t.line.dash])""")
            assert [x for x, _ in traces] == [[10, 20], [10, 20]] and traces[0][1] != traces[1][1]
            page.screenshot(path=str(tmp_path / "val-at.png"), full_page=True)
        finally:
            browser.close()
    assert not errors, errors
