"""The full run's ``proxy`` and ``tests`` parts: ``pytest -m cuda_proxy`` / ``pytest -m gpu`` in a subprocess (these
need the test suite's dependencies; the quick check runs no pytest)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

from gpucheck.harness import ROOT


def run_cuda_tests(paths: list[str], timeout_s: float, marker: str = "gpu") -> dict:
    """``pytest -m MARKER`` on ``paths`` in a subprocess: its summary line, return code and seconds.

    ``gpu``: the tests that need a CUDA device; ``cuda_proxy``: the CPU tests of the CUDA-only paths (graph
    capture, inductor lowering, checkpoints on a non-CPU device, the memory plan), which run anywhere.
    """
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", marker, "-p", "no:cacheprovider", *paths]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "platform"), os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {"command": " ".join(cmd[2:]), "rc": None, "summary": f"timed out after {timeout_s:.0f} s",
                "seconds": time.monotonic() - start, "tail": tail[-3000:]}
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = next((ln.strip("= ") for ln in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error|"
                                                                          r"deselected)", ln)), "no summary")
    return {"command": " ".join(cmd[2:]), "rc": proc.returncode, "summary": summary,
            "seconds": time.monotonic() - start, "tail": "" if proc.returncode == 0 else proc.stdout[-3000:]}


