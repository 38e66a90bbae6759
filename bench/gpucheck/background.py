"""The quick check's background processes: what compiles, done beside what measures.

A cold GPU node spends most of a first run compiling (FlexAttention's forward and backward per variant, dtype and
length: about 15 s each on an H200, GPT-2 small's LSSAR training graph two minutes), one graph after another on one
CPU core. The quick check therefore starts, as it begins:

- ``agreement`` workers: part b's cases, dealt out round-robin, each case written to the worker's file as it ends;
- warmers: the compiles of parts c, d and e (the same functions on the same shapes), so that those parts find
  inductor's on-disk caches (FX graph and AOT autograd) warm and time their own calls, not the compiler.

Each runs ``python -m gpucheck.worker JOB`` with the parent's interpreter, writes one JSON line per result, and is
ended when the quick check ends. A part that needs a warmer waits for it within its own budget; a warmer that failed
or did not finish costs nothing but time (the part compiles for itself).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpucheck.harness import ROOT

BENCH = ROOT / "bench"


class Background:
    """The background processes of one quick check, each with its JSON-lines file."""

    def __init__(self, sizes_name: str, compile_backend: str | None, threads_each: int = 2):
        self.sizes_name, self.compile_backend, self.threads_each = sizes_name, compile_backend, threads_each
        self.dir = Path(tempfile.mkdtemp(prefix="attnlab-gpu-check-"))
        self.jobs: dict[str, tuple[subprocess.Popen, Path]] = {}

    def start(self, key: str, job: str, payload) -> None:
        out = self.dir / f"{key}.jsonl"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(BENCH), str(ROOT / "platform")] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
            # several compiling processes share the CPUs: a small compile pool each
            TORCHINDUCTOR_COMPILE_THREADS=str(self.threads_each), PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "gpucheck.worker", job, self.sizes_name, self.compile_backend or "none",
               json.dumps(payload), str(out)]
        log = open(self.dir / f"{key}.log", "w")
        self.jobs[key] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), out)

    def keys(self, prefix: str) -> list[str]:
        return [k for k in self.jobs if k.startswith(prefix)]

    def running(self, key: str) -> bool:
        return key in self.jobs and self.jobs[key][0].poll() is None

    def wait(self, keys: list[str], deadline: float, poll_s: float = 0.5) -> bool:
        """Wait until every job of ``keys`` ended or ``time.monotonic()`` passed ``deadline``; True when all ended."""
        while any(self.running(k) for k in keys):
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return True

    def results(self, key: str) -> list[dict]:
        """The JSON lines the job wrote so far (a line cut short by a kill is left out)."""
        if key not in self.jobs or not self.jobs[key][1].exists():
            return []
        rows = []
        for line in self.jobs[key][1].read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        return rows

    def log_tail(self, key: str, chars: int = 1500) -> str:
        path = self.dir / f"{key}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def summary(self) -> dict[str, dict]:
        """Each job's end: ``done`` (True, False for an error, None if still running or killed), its seconds and
        error, and the tail of its log when it did not finish."""
        out = {}
        for key in self.jobs:
            last = next((r for r in reversed(self.results(key)) if "done" in r), None)
            out[key] = {"done": None if last is None else last["done"],
                        "seconds": None if last is None else last.get("seconds"),
                        "error": None if last is None else last.get("error")}
            if not out[key]["done"]:
                out[key]["log_tail"] = self.log_tail(key, 800)
        return out

    def close(self) -> None:
        """End every job and remove the files."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def stop(self, keys: list[str] | None = None) -> None:
        """End the given jobs (all by default) that still run."""
        for key in keys if keys is not None else list(self.jobs):
            proc = self.jobs[key][0]
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def worker_count(n_cases: int) -> int:
    """Agreement workers: about half the CPUs (the warmers and the inductor pools need the rest), at most 8."""
    return max(1, min(8, (os.cpu_count() or 2) // 2, n_cases))
