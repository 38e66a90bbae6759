"""The torch floor in pyproject.toml: the installed torch has every API the code uses, and the floor that
``bench/torch_floor.py --pypi`` found is the one pyproject.toml states (the script itself reads wheels on PyPI,
which tests do not)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("bench_torch_floor", ROOT / "bench" / "torch_floor.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_installed_torch_has_every_api_and_pyproject_states_the_floor():
    floor = _script()
    assert floor.missing(floor.installed_source) == []
    assert floor.pyproject_floor() == floor.FLOOR


def test_a_torch_without_an_api_is_reported():
    floor = _script()
    lacks = floor.missing(lambda file: "" if file.endswith("flex_attention.py") else floor.installed_source(file))
    assert {r.file for r in lacks} == {"torch/nn/attention/flex_attention.py"}
    assert floor.main([]) == 0
