"""The ``triton`` backend: fused Triton kernels for LSSA, LSSAR and sharpened softmax, forward and backward.

Owns which specs the kernels compute (:func:`unsupported_reason`) and the entry point :func:`attend_triton`; the
kernels are ``jit.py`` (pure ``tl``: Triton's interpreter runs them on CPU tensors), their launches and the
``torch.library`` operators ``ops.py``. The derivation and the measured speed: docs/attention.md#the-triton-kernels,
docs/gpu.md. This module imports neither Triton nor the operators until a call needs them, so the dispatch
(``backends.py``) can ask :func:`unsupported_reason` on any machine. No Ray, no model code.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from attnlab.attention.spec import AttentionSpec, PluginSpec

PHIS = {"exp": 0, "softplus": 1, "sigmoid": 2}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unsupported_reason(spec) -> str | None:
    """Why the kernels do not compute ``spec`` (None when they do): an l1-normalised exp, softplus or sigmoid first
    stage, any scale, QK-norm or not, sharpened with any ``p >= 1`` or not; no bias, ALiBi, post-processing,
    output LayerNorm or learned QK-norm gain, and no plugin."""
    if isinstance(spec, PluginSpec):
        return "a plugin variant runs its own forms"
    if not isinstance(spec, AttentionSpec):
        return f"{type(spec).__name__} is not an AttentionSpec"
    if spec.phi not in PHIS or spec.norm != "l1":
        return f"the kernels compute l1-normalised exp, softplus or sigmoid rows (phi={spec.phi!r}, norm={spec.norm!r})"
    for field, value in (("bias", spec.bias), ("post", spec.post), ("out_norm", spec.out_norm),
                         ("position_bias", spec.position_bias), ("qk_norm_gain", spec.qk_norm_gain)):
        if value != "none":
            return f"the kernels have no {field} ({field}={value!r})"
    return None


def triton_installed() -> bool:
    """True when Triton can be imported (a CUDA build of torch brings it; ``make test`` installs it on CPU)."""
    return importlib.util.find_spec("triton") is not None


def device_refusal(device: torch.device | str) -> str | None:
    """Why the kernels cannot run on ``device`` in this process (one line), or None: CUDA, or CPU under Triton's
    interpreter (``TRITON_INTERPRET=1`` set before Triton is imported)."""
    if not triton_installed():
        return "Triton is not installed (a CUDA build of torch brings it; on CPU: pip install triton==3.6.0)"
    device = torch.device(device)
    if device.type == "cuda":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (f"the Triton kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter "
            f"(TRITON_INTERPRET=1 before Triton is imported); got {device.type} tensors")


def attend_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
                  p: float | torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention ``(B, H, T, Dv)`` in v's dtype with the Triton kernels (float32 inside; bf16, fp16 and
    float32 inputs). ``p``: the sharpening power of a sharpened spec instead of ``spec.p`` (a number or a 0-d
    tensor: the kernels read it from memory, so a new power compiles nothing)."""
    reason = unsupported_reason(spec) or device_refusal(q.device)
    if reason is not None:
        raise ValueError(f"impl='triton' cannot compute attention {spec.name!r}: {reason}; use impl='auto', 'flex' "
                         "or 'dense'")
    if q.dtype not in DTYPES:
        raise ValueError(f"impl='triton' computes in float32 from float32, bfloat16 or float16 inputs, got {q.dtype}: "
                         "use impl='dense' or 'flex' for float64")
    from attnlab.attention.kernels import ops

    work = q.dtype if q.dtype == k.dtype == v.dtype else torch.float32
    out_dtype = v.dtype
    q, k, v = q.to(work), k.to(work), v.to(work)
    scale_mul, scale_log = ops.scale_form(spec.scale, spec.coef, q.shape[-1])
    sharpen = spec.p is not None
    power = spec.p if p is None else p
    if isinstance(power, torch.Tensor):
        power = power.detach().to(device=q.device, dtype=torch.float32).reshape(1)
    else:
        power = torch.full((1,), float(power) if sharpen else 1.0, dtype=torch.float32, device=q.device)
    form = ops.Form(PHIS[spec.phi], spec.qk_norm, scale_mul, scale_log, sharpen)
    return ops.attend(q, k, v, power, form).to(out_dtype)
