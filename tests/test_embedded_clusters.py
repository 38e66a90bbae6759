"""Several embedded Ray clusters side by side: two ``attnlab study run`` processes started at once on this machine
(no ``RAY_ADDRESS``: each starts its own local Ray) both finish, and nothing in them meets Ray's
``Found multiple active Ray instances`` (see :mod:`attnlab.ray_runtime`).

Each process gets its own ``RAY_TMPDIR``, so its Ray session logs (where a detached actor such as Train's
``PlacementGroupCleaner`` writes its errors) can be searched too. Both clusters end with their drivers.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from attnlab.results import ResultsStore
from attnlab.study.folder import StudyFolder
from conftest import multiple_instance_errors

pytestmark = [pytest.mark.ray, pytest.mark.slow]

BIN = Path(sys.executable).parent
def _processes_naming(path: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if path.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _study(name: str) -> dict:
    return {"name": name,
            "train": {"preset": "tiny", "data": {"synthetic": "copy_distractors", "vocab": 64, "copy_len": 16},
                      "steps": 4, "tokens_per_step": 256, "micro_batch": 4, "lr": 3.0e-3, "warmup_steps": 1,
                      "log_every": 2, "val_every": 4, "val_tokens": 512, "checkpoint_every": 4, "max_failures": 0,
                      "cpus_per_worker": 0.5, "threads_per_worker": 1},
            "resources": {"trial_cpus": 0.5}, "search": {"engine": "grid"}, "space": {"attention": ["softmax"]},
            "objective": "val_loss@1x", "eval": {"multiples": [1], "p_eval": ["none"], "max_tokens": 256}}


@pytest.mark.timeout(900)
def test_two_studies_with_their_own_embedded_ray_run_side_by_side(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    runs = {}
    for name in ("side-a", "side-b"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "study.yaml").write_text(yaml.safe_dump(_study(name)))
        ray_tmp = tempfile.mkdtemp(prefix="sbs", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
        log = open(folder / "out.log", "w")
        proc = subprocess.Popen(
            [str(BIN / "attnlab"), "study", "run", "study.yaml", "--store", "results", "--runs", "runs"],
            cwd=folder, env={**env, "RAY_TMPDIR": ray_tmp}, stdout=log, stderr=subprocess.STDOUT)
        runs[name] = (proc, folder, ray_tmp, log)
    try:
        deadline = time.time() + 840
        for name, (proc, folder, _, _) in runs.items():
            proc.wait(timeout=max(1, deadline - time.time()))
        for name, (proc, folder, ray_tmp, log) in runs.items():
            log.close()
            out = (folder / "out.log").read_text()
            assert proc.returncode == 0, out[-4000:]
            assert f"study {name}: 1 trial(s) 1 complete; 1 trained this run" in out, out[-3000:]
            assert len(ResultsStore(str(folder / "results")).read(study=name, metric="val_loss")) == 1
            # its own cluster ended with it, and study.json says so: `attnlab serve` no longer links its dashboard
            recorded = StudyFolder(str(folder / "runs"), name).saved_study().ray
            assert recorded["embedded"] is True and recorded["stopped"] >= recorded["recorded"], recorded
            assert multiple_instance_errors(out) == []  # the drivers' output: every worker's log reaches it
            sessions = list(Path(ray_tmp).glob("ray/session_2*/logs"))
            assert len(sessions) == 1  # this study's own cluster, and only it, under its RAY_TMPDIR
            hits = [p for p in sessions[0].rglob("*") if p.is_file()
                    and multiple_instance_errors(p.read_text(errors="replace"))]
            assert hits == []
    finally:
        for proc, _, ray_tmp, log in runs.values():
            if proc.poll() is None:
                proc.kill()  # only the drivers this test started
                proc.wait(timeout=30)
            for pid in _processes_naming(ray_tmp):  # and what is left of their clusters
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if not log.closed:
                log.close()
            shutil.rmtree(ray_tmp, ignore_errors=True)
