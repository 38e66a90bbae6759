"""Helpers of the ``attnlab serve`` tests: a study written with the real layout writers, and the real server.

:func:`write_study` writes a study's state with :class:`attnlab.study.folder.StudyFolder` (spec, one status record per
trial, each run's ``metrics.jsonl``) and its rows with :class:`attnlab.results.ResultsStore`, on a local folder or a
bucket alike: the files a study run leaves, with known numbers. :func:`serving` runs the application under uvicorn
on a free loopback port (a thread), and :func:`get` fetches a page with the standard library.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request

from attnlab.results import ResultsStore
from attnlab.study.folder import StudyFolder

TRAIN_LEN = 64
LENGTHS = (64, 128, 256)
# (key, status, point, steps, step reached, reason); complete trials get rows, the others none.
TRIALS = (
    ("aaaa000000000001", "complete", {"attention": "softmax", "seed": 0}, 40, 40, None),
    ("aaaa000000000002", "complete", {"attention": "softmax", "seed": 1}, 40, 40, None),
    ("aaaa000000000003", "complete", {"attention": "lssar", "seed": 0}, 40, 40, None),
    ("aaaa000000000004", "cached", {"attention": "lssar", "seed": 1}, 40, 40, None),
    ("aaaa000000000005", "running", {"attention": "lssa", "seed": 0}, 40, 24, None),
    ("aaaa000000000006", "diverged", {"attention": "sigmoid_l1", "seed": 0}, 40, 12,
     "loss became nan at step 12 (lr too high?)"),
    ("aaaa000000000007", "pruned", {"attention": "softmax", "seed": 2}, 40, 20,
     "stopped by asha at step 20 (val_loss=4.3)"),
)
# acc at (attention, seed, p_eval, rope, eval_len): lssar stays near 1, softmax falls with length.
ACC = {"softmax": (1.0, 0.6, 0.2), "lssar": (1.0, 0.98, 0.95)}


def acc_value(attention: str, seed: int, p_eval, rope: str, index: int) -> float:
    base = ACC[attention][index]
    return round(base - 0.02 * seed - (0.05 if p_eval else 0.0) - (0.1 if rope == "ntk" else 0.0) * index, 6)


def spec_json(name: str, engine: str = "grid") -> dict:
    search = {"engine": engine, **({"num_samples": 4} if engine != "grid" else {})}
    return {"name": name, "description": "a probe written by the serve tests",
            "train": {"preset": "tiny", "data": {"synthetic": "copy_distractors", "vocab": 64}, "steps": 40},
            "search": search, "space": {"attention": ["softmax", "lssar", "lssa", "sigmoid_l1"], "seeds": [0, 1, 2]},
            "objective": [{"metric": "acc@4x,rope=none", "mode": "max"}],
            "eval": {"multiples": [1, 2, 4], "p_eval": ["none", 15], "rope_scaling": ["none", "ntk"]}}


def write_study(store_uri: str, runs_uri: str, name: str = "probe", engine: str = "grid",
                ray: dict | None = None) -> StudyFolder:
    """A study with every trial status, metrics for each run and acc + val_loss rows for the finished ones;
    ``ray``: the cluster record ``attnlab study run`` writes (``Dashboard.record()``), none by default."""
    state = StudyFolder(runs_uri, name)
    state.write_study(spec_json(name, engine), "fingerprint0", ray=ray)
    store = ResultsStore(store_uri)
    now = time.time()
    for i, (key, status, point, steps, reached, reason) in enumerate(TRIALS):
        lines = [{"step": s, "train_loss": 4.2 - 0.05 * s, **({"val_loss": 4.3 - 0.05 * s} if s % 10 == 0 else {})}
                 for s in range(2, reached + 1, 2)]
        state.run(key).write_text("metrics.jsonl", "".join(json.dumps(line) + "\n" for line in lines))
        record = {"point": point, "trial": f"study_trial_0000{i}", "run_dir": state.run(key).uri,
                  "config": {"steps": steps}, "steps": steps, "status": status, "reason": reason,
                  "started": now - 100 + i}
        if status in ("complete", "cached"):
            record.update(step=steps, objectives={"acc@4x,rope=none": acc_value(point["attention"], point["seed"],
                                                                                None, "none", 2)})
        elif status != "running":
            record.update(step=reached)
        state.write_status(key, **record)
        if status == "diverged":  # a diverged run's cells are NaN rows (as attnlab.evaluate.cell_rows.nan_rows writes)
            store.write([{**_row(name, key, point, reached, p_eval, rope, length), "metric": "val_loss",
                          "value": float("nan")} for p_eval in (None, 15.0) for rope in ("none", "ntk")
                         for length in LENGTHS], key=("eval", key, "diverged"))
        if status not in ("complete", "cached"):
            continue
        rows = []
        for p_eval in (None, 15.0):
            for rope in ("none", "ntk"):
                for j, length in enumerate(LENGTHS):
                    base = _row(name, key, point, steps, p_eval, rope, length)
                    acc = acc_value(point["attention"], point["seed"], p_eval, rope, j)
                    rows.append({**base, "metric": "acc", "value": acc})
                    rows.append({**base, "metric": "val_loss", "value": round(2.0 + 3.0 * (1.0 - acc), 6)})
        store.write(rows, key=("eval", key))
    return state


def add_val_loss_at(state: StudyFolder, key: str, lengths=(128, 256), every: int = 10) -> None:
    """Give run ``key``'s metrics the validation losses at longer lengths a run with ``eval.during_training``
    writes (``val_loss_at`` every ``every`` steps), with known numbers: ``4.5 + L / 1000 - 0.05 * step``."""
    run = state.run(key)
    lines = [json.loads(line) for line in run.read_text("metrics.jsonl").splitlines() if line.strip()]
    for line in lines:
        if line["step"] % every == 0:
            line["val_loss_at"] = {str(L): round(4.5 + L / 1000 - 0.05 * line["step"], 6) for L in lengths}
    run.write_text("metrics.jsonl", "".join(json.dumps(line) + "\n" for line in lines))


def _row(study: str, key: str, point: dict, step: int, p_eval, rope: str, length: int) -> dict:
    return {"study": study, "trial": key, "attention": point["attention"], "scale": "logd_logn",
            "p_train": 15.0 if point["attention"] == "lssar" else None, "p_eval": p_eval, "rope_scaling": rope,
            "step": step, "tokens": step * 256, "eval_len": length, "train_len": TRAIN_LEN, "window_mode": "nonoverlap",
            "seed": point["seed"], "train_key": key, "git_sha": "abc1234", "preset": "tiny",
            "data": "copy_distractors"}


# ------------------------------------------------------------------------------------------------ the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app):
    """Run ``app`` under uvicorn on a free loopback port in a thread; yields its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name="attnlab-serve-test", daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        if not thread.is_alive() or time.time() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def get(url: str) -> tuple[int, str, str]:
    """``(status, content type, body)`` of a GET, error statuses included."""
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read().decode("utf-8")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read().decode("utf-8")


def get_json(url: str) -> tuple[int, dict]:
    status, _, body = get(url)
    return status, json.loads(body)
