"""Provenance of a run or an evaluation: git sha and dirty flag, package versions, hardware. No Ray here."""

from __future__ import annotations

import functools
import os
import platform as std_platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

_PACKAGES = ("attnlab", "torch", "ray", "numpy", "pyarrow", "tiktoken", "optuna", "datasets")


@functools.lru_cache(maxsize=1)
def git_info() -> dict:
    """``{"sha": ..., "dirty": bool}`` of the source tree attnlab runs from; ``unknown`` outside a checkout."""
    src = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=src, capture_output=True, text=True, timeout=10,
                             check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=src,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
        return {"sha": sha, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"sha": os.environ.get("ATTNLAB_GIT_SHA", "unknown"), "dirty": None}


def package_versions() -> dict:
    versions = {"python": sys.version.split()[0]}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def hardware() -> dict:
    cpu = std_platform.processor() or std_platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cpu_count": os.cpu_count(), "gpu": [], "gpu_count": 0, "host": std_platform.node()}
    try:
        import torch

        # the kernel path float32 rounding follows on this CPU (AVX2, AVX512): a run keyed alike on another rounds
        # otherwise (docs/stages.md#identity-and-reuse)
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        if torch.cuda.is_available():
            info["gpu"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            info["gpu_count"] = torch.cuda.device_count()
    except ImportError:
        pass
    return info
