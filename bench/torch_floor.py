"""Which torch release is the oldest with every torch API attnlab uses: the floor in ``pyproject.toml``.

Each entry of :data:`REQUIREMENTS` names an API the code uses, the torch source file that defines it, and the
text that file holds once the API exists. The script checks them against:

- the installed torch (default; offline): every entry must hold, or the installed torch is below the floor;
- ``--pypi 2.8.0 2.9.0 ...``: the source files inside those releases' wheels on PyPI, read with HTTP range
  requests (a few hundred KB per release, not the ~900 MB wheel), printing for each release which APIs it
  lacks. The oldest release that lacks none is the floor; ``pyproject.toml`` must say ``torch>=<that>``.

Run: ``python bench/torch_floor.py [--pypi VERSION ...]``. A test runs the offline check and compares the
floor recorded here with ``pyproject.toml``.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The oldest release found to have every API below (checked with --pypi; see docs/gpu.md#torch-version).
FLOOR = "2.9.0"


@dataclass(frozen=True)
class Requirement:
    api: str        # what the code uses
    where: str      # where attnlab uses it
    file: str       # the torch source file that defines it (inside the wheel)
    pattern: str    # a regular expression that matches in that file once the API exists


REQUIREMENTS = (
    Requirement("flex_attention(return_aux=AuxRequest(lse=True, max_scores=True))", "attention/flex.py",
                "torch/nn/attention/flex_attention.py", r"class AuxRequest\b(?s:.*)max_scores"),
    Requirement("flex_attention(..., return_aux=...)", "attention/flex.py",
                "torch/nn/attention/flex_attention.py", r"return_aux\s*:"),
    Requirement("flex_attention_hop and _apply_kernel_options(..., return_aux)", "attention/flex.py (CPU path)",
                "torch/nn/attention/flex_attention.py", r"def _apply_kernel_options\((?s:[^)]*)return_aux"),
    Requirement("create_block_mask(..., _compile=)", "attention/masks.py",
                "torch/nn/attention/flex_attention.py", r"def create_block_mask\((?s:[^)]*)_compile"),
    Requirement("torch._dynamo.config.recompile_limit", "model/compile.py, attention/flex.py",
                "torch/_dynamo/config.py", r"^recompile_limit\b"),
    Requirement("torch._dynamo.config.accumulated_recompile_limit", "model/compile.py, attention/flex.py",
                "torch/_dynamo/config.py", r"^accumulated_recompile_limit\b"),
    Requirement("torch.compiler.is_compiling", "attention/flex.py, attention/masks.py",
                "torch/compiler/__init__.py", r"def is_compiling\("),
    Requirement("nn.Module.compile", "model/compile.py", "torch/nn/modules/module.py", r"def compile\(self"),
    Requirement("scaled_dot_product_attention(..., enable_gqa=)", "attention/sdpa.py",
                "torch/nn/functional.py", r"enable_gqa"),
)


def missing(read_source) -> list[Requirement]:
    """The requirements whose pattern is not found; ``read_source(file)`` returns a file's text or None."""
    out = []
    for req in REQUIREMENTS:
        text = read_source(req.file)
        if text is None or re.search(req.pattern, text, flags=re.MULTILINE) is None:
            out.append(req)
    return out


def installed_source(file: str) -> str | None:
    import torch

    path = Path(torch.__file__).parent.parent / file
    return path.read_text() if path.exists() else None


class _RangeFile(io.RawIOBase):
    """A read-only, seekable view of a URL through HTTP range requests (enough for zipfile)."""

    def __init__(self, url: str):
        self.url, self.pos = url, 0
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as resp:
            self.size = int(resp.headers["Content-Length"])

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=0):
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def readinto(self, buffer):
        n = min(len(buffer), self.size - self.pos)
        if n <= 0:
            return 0
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{self.pos + n - 1}"})
        with urllib.request.urlopen(request, timeout=120) as resp:
            data = resp.read()
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def wheel_url(version: str) -> str:
    """The PyPI URL of torch ``version``'s CPython 3.11 manylinux x86_64 wheel."""
    request = urllib.request.Request("https://pypi.org/simple/torch/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        files = json.load(resp)["files"]
    wanted = re.compile(rf"torch-{re.escape(version)}-cp311-cp311-manylinux[^-]*x86_64\.whl$")
    for entry in files:
        if wanted.match(entry["filename"]):
            return entry["url"]
    raise SystemExit(f"torch {version}: no cp311 manylinux x86_64 wheel on PyPI")


def wheel_source(version: str):
    archive = zipfile.ZipFile(io.BufferedReader(_RangeFile(wheel_url(version)), buffer_size=1 << 16))
    names = set(archive.namelist())

    def read(file: str) -> str | None:
        return archive.read(file).decode() if file in names else None
    return read


def pyproject_floor() -> str | None:
    match = re.search(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    return match.group(1) if match else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pypi", nargs="+", metavar="VERSION", help="check these releases' wheels on PyPI")
    args = parser.parse_args(argv)
    if args.pypi:
        for version in args.pypi:
            lacks = missing(wheel_source(version))
            verdict = "has every API" if not lacks else "lacks " + "; ".join(r.api for r in lacks)
            print(f"torch {version}: {verdict}")
        return 0
    import torch

    lacks = missing(installed_source)
    print(f"installed torch {torch.__version__}: " + ("has every API" if not lacks else
                                                       "lacks " + "; ".join(r.api for r in lacks)))
    print(f"floor recorded here: {FLOOR}; pyproject.toml: torch>={pyproject_floor()}")
    return 1 if lacks else 0


if __name__ == "__main__":
    sys.exit(main())
