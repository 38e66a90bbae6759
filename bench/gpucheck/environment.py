"""a. Environment: the GPU, its driver, torch, CUDA, Triton and Python, and whether the installed torch has every
torch API attnlab uses (``bench/torch_floor.py``, offline). Also which of the packages a study needs (Ray, the web
page's) are absent: the quick check needs none of them."""

from __future__ import annotations

import importlib.util

import torch

from gpucheck.harness import FAIL, PASS, Context, Outcome, say
from machine import header

# Present on a study's machines, absent on a bare GPU node: the quick check imports none of them.
NOT_NEEDED = ("ray", "starlette", "uvicorn", "optuna", "lm_eval")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module hidden from the import system counts as absent
        return False


def _version(module: str) -> str | None:
    if not _installed(module):
        return None
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as exc:  # noqa: BLE001 - a package that fails to import is reported as such
        return f"broken ({type(exc).__name__})"


def environment(ctx: Context) -> Outcome:
    import torch_floor  # bench/torch_floor.py: bench/ is on sys.path (the script's folder)

    info = header(ctx.device)
    triton = _version("triton")
    lacks = torch_floor.missing(torch_floor.installed_source)
    absent = [m for m in NOT_NEEDED if not _installed(m)]
    data = {**info, "triton": triton, "pydantic": _version("pydantic"), "torch_floor": torch_floor.FLOOR,
            "torch_lacks": [r.api for r in lacks], "absent": absent,
            "cuda_available": torch.cuda.is_available()}
    for key in ("device", "driver", "python", "torch", "cuda", "triton", "pydantic"):
        say(f"{key}: {data[key]}")
    say(f"torch floor {torch_floor.FLOOR}: " + ("every API present" if not lacks else
                                                "lacks " + "; ".join(r.api for r in lacks)))
    say(f"not installed (not needed here): {', '.join(absent) or 'none'}")
    problems = []
    if lacks:
        problems.append(f"torch {torch.__version__} lacks {len(lacks)} API(s) of the floor {torch_floor.FLOOR}: "
                        f"{lacks[0].api}")
    if ctx.device.type == "cuda" and triton is None:
        problems.append("Triton is not installed: compiled FlexAttention needs it")
    where = info["device"] if ctx.device.type == "cuda" else f"{info['device']} (smoke: no GPU)"
    figures = (f"{where}; driver {info['driver'] or '-'}; torch {info['torch']} (CUDA {info['cuda'] or '-'}); "
               f"Triton {triton or '-'}; Python {info['python']}; torch floor {torch_floor.FLOOR} "
               + ("met" if not lacks else "NOT met"))
    if problems:
        return Outcome(FAIL, "; ".join(problems) + f" ({figures})", data)
    return Outcome(PASS, figures, data)
