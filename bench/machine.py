"""The machine header every benchmark prints: the date, the machine (CPU, cores, memory, load; the GPU and its
driver when one is measured), Python, torch and the packages the benchmark depends on, the platform, the git sha.

:func:`header` gathers it as a dict (the GPU check writes it into its JSON); :func:`lines` gives the Markdown lines
a section of ``bench/RESULTS.md`` starts with; :func:`print_header` prints them. ``python bench/machine.py
[PACKAGE ...]`` prints them for this machine (its GPU too, when torch sees one).
Standard library and ``attnlab.provenance`` only (its CPU model, core count and git sha), so that the GPU check on
a bare node (no Ray, no set-up) can use it.
"""

from __future__ import annotations

import datetime
import os
import platform as std_platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "platform") not in sys.path:
    sys.path.insert(0, str(ROOT / "platform"))  # attnlab.provenance, when bench/ runs from a bare checkout


def _version(package: str) -> str | None:
    module = sys.modules.get(package)
    if getattr(module, "__version__", None):  # the one imported (a site's torch on a GPU node)
        return str(module.__version__)
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            return next(int(ln.split()[1]) / 2**20 for ln in f if ln.startswith("MemTotal"))
    except (OSError, StopIteration):
        return None


def _gpu(device) -> tuple[str, str | None, str | None]:
    """``(name, GiB and SMs; driver; CUDA)`` of a CUDA device."""
    import torch

    props = torch.cuda.get_device_properties(device)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        driver = "unknown"
    return (f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs", driver,
            torch.version.cuda)


def header(device="cpu", packages: tuple[str, ...] = ()) -> dict:
    """This machine, now: ``device`` (``"cpu"``, ``"cuda"`` or a ``torch.device``) is what the benchmark measures
    on; ``packages`` the distributions whose versions it names besides Python and torch.

    Keys: ``date`` (UTC), ``device`` (the GPU, or ``CPU: model, cores, memory``), ``driver``, ``cuda``, ``cpu``,
    ``cores``, ``memory_gib``, ``load_average`` (1 min, at the call), ``python``, ``torch``, ``versions`` (of
    ``packages``; None when not installed), ``platform`` and ``git`` (``{"sha", "dirty"}`` of this checkout)."""
    from attnlab.provenance import git_info, hardware

    hw = hardware()
    memory = _memory_gib()
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": f"CPU: {hw['cpu']}, {hw['cpu_count']} cores" + (f", {memory:.0f} GiB" if memory else ""),
            "driver": None, "cuda": None, "cpu": hw["cpu"], "cores": hw["cpu_count"],
            "memory_gib": None if memory is None else round(memory, 1),
            "load_average": round(os.getloadavg()[0], 1), "python": std_platform.python_version(),
            "torch": _version("torch"), "versions": {p: _version(p) for p in packages},
            "platform": std_platform.platform(), "git": git_info()}
    if getattr(device, "type", device) == "cuda":
        info["device"], info["driver"], info["cuda"] = _gpu(device)
    return info


def lines(info: dict) -> list[str]:
    """The header as Markdown list items: date; machine; versions; git."""
    host = f"CPU: {info['cpu']}, {info['cores']} cores" + (f", {info['memory_gib']:.0f} GiB" if info["memory_gib"]
                                                            else "")
    machine = (host if info["driver"] is None else f"{info['device']}; driver {info['driver']}; host {host}")
    versions = [f"python {info['python']}", f"torch {info['torch'] or '-'}"
                + (f" (CUDA {info['cuda']})" if info["cuda"] else "")]
    versions += [f"{name} {version or 'not installed'}" for name, version in info["versions"].items()]
    git = info["git"]
    return [f"- date: {info['date']}",
            f"- machine: {machine}; load average {info['load_average']:.1f}",
            f"- {', '.join(versions)}; {info['platform']}",
            f"- git: {git['sha']}{' (dirty)' if git.get('dirty') else ''}"]


def print_header(device="cpu", packages: tuple[str, ...] = ()) -> dict:
    """Print the header's lines (flushed) and return it."""
    info = header(device, packages)
    print("\n".join(lines(info)), flush=True)
    return info


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("packages", nargs="*", help="distributions whose versions to name")
    args = ap.parse_args(argv)
    import torch

    print_header("cuda" if torch.cuda.is_available() else "cpu", tuple(args.packages))
    return 0


if __name__ == "__main__":
    sys.exit(main())
