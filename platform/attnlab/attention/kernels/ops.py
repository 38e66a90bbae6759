"""The ``triton`` backend's operators: the kernels of ``jit.py`` launched, as ``torch.library`` operators with a
registered autograd, so that ``torch.compile`` keeps them in its graph (no graph break) and a compiled model runs the
same kernels as an eager one.

``attnlab::triton_attention`` (forward) returns ``(out, u, stats)``; ``attnlab::triton_attention_backward`` returns
``(dq, dk, dv)``. Both run on CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``
before Triton is imported). Imported only when the backend is used (``attention/kernels/__init__.py``): importing
it imports Triton.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

import attnlab.attention.kernels.jit as jit  # the module itself: the package's __init__ imports this one
from attnlab.attention.flex import inverse_norm

# Rows and keys per program: (BM, BN, warps, stages) of each kernel on a GPU, chosen from the kernels compiled for
# sm_90 on CPU (aot.py; bench/kernel_profile.py prints the figures): no spilled registers, the fewest instructions per
# score element. dkdv's BN is the keys a program owns, its BM the rows it takes per step. Not yet timed on a GPU.
GPU_BLOCKS = {
    "stats": (128, 64, 4, 2),
    "fwd": (128, 32, 8, 2),
    "plain": (128, 64, 4, 2),
    "pre": (128, 0, 4, 1),
    "dq": (128, 32, 8, 2),
    "dkdv": (128, 32, 8, 2),
    "dq_plain": (128, 64, 8, 2),
    "dkdv_plain": (128, 32, 8, 2),
}
INTERPRETER_BLOCKS = {name: (32, 32 if bn else 0, 1, 1) for name, (_, bn, _, _) in GPU_BLOCKS.items()}


@dataclass(frozen=True)
class Form:
    """What the kernels compute for a spec: the first stage (``phi``: 0 exp, 1 softplus, 2 sigmoid), QK-norm,
    the scale ``scale_mul * ln N_i`` (``scale_log``) or ``scale_mul``, and whether the rows are sharpened."""

    phi: int
    qk_norm: bool
    scale_mul: float
    scale_log: bool
    sharpen: bool


def interpreting() -> bool:
    """True when Triton's interpreter runs the kernels (``TRITON_INTERPRET=1`` when Triton was imported)."""
    return not isinstance(jit.stats_kernel, triton.runtime.JITFunction)


def _interpreter_index_fix() -> None:
    """Triton 3.6's interpreter turns a loop bound such as ``(program_id + 1) * BM`` into an int with ``int(array of
    shape (1,))``, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"). This is
    the upstream fix (triton-lang/triton#9172, in Triton 3.7), applied to the interpreter only: compiled kernels never
    run this code."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "squeezes_index", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.squeezes_index = True
    interpreter._patch_lang_tensor = patched


if interpreting():
    _interpreter_index_fix()


_block_override: dict[str, tuple[int, int, int, int]] = {}


def blocks(name: str) -> tuple[int, int, int, int]:
    """``(BM, BN, warps, stages)`` of kernel ``name`` in this process."""
    if name in _block_override:
        return _block_override[name]
    return (INTERPRETER_BLOCKS if interpreting() else GPU_BLOCKS)[name]


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _precision(dtype: torch.dtype) -> str:
    # float32 inputs get float32 products (torch's default matmul precision), not TF32
    return "ieee" if dtype == torch.float32 else "tf32"


def _strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(t.stride())


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the kernel, its block-size entry (``GPU_BLOCKS``), its grid (in tiles of that entry's
    rows, or keys for ``dkdv``), its arguments and its compile-time constants (the block sizes excepted)."""

    kernel: object
    name: str
    tiles: int
    bh: int
    args: tuple
    constexprs: dict

    def run(self) -> None:
        bm, bn, warps, stages = blocks(self.name)
        sizes = {"BM": bm} if not bn else {"BM": bm, "BN": bn}
        grid = (triton.cdiv(self.tiles, bn if self.name.startswith("dkdv") else bm), self.bh)
        self.kernel[grid](*self.args, **self.constexprs, **sizes, num_warps=warps, num_stages=stages)


def forward_launches(q, k, v, p, form: Form, factors, out, u, stats) -> list[Launch]:
    """The forward's launches into ``out``, ``u`` (empty: no U) and ``stats`` (any device: meta tensors plan a
    compile without a GPU, ``aot.py``)."""
    B, H, T, D = q.shape
    DV = v.shape[-1]
    common = dict(QK_NORM=form.qk_norm, PHI=form.phi, PRECISION=_precision(q.dtype), FAST=not interpreting(),
                  BD=_pow2(D))
    qs, ks, vs, os_ = _strides(q), _strides(k), _strides(v), _strides(out)
    if not form.sharpen:
        return [Launch(jit.plain_fwd_kernel, "plain", T, B * H, (q, k, v, out, stats, *qs, *ks, *vs, *os_, H, T, D, DV,
                                                                   factors), dict(common, BDV=_pow2(DV)))]
    keep_u = u.numel() > 0
    return [Launch(jit.stats_kernel, "stats", T, B * H, (q, k, stats, *qs, *ks, H, T, D, factors), common),
            Launch(jit.sharpened_fwd_kernel, "fwd", T, B * H,
                   (q, k, v, out, u if keep_u else out, stats, p, *qs, *ks, *vs, *os_, H, T, D, DV, factors),
                   dict(common, WITH_U=keep_u, BDV=_pow2(DV)))]


def backward_launches(dout, q, k, v, out, u, stats, p, form: Form, factors, delta, g, dq, dk, dv) -> list[Launch]:
    """The backward's launches into ``delta``, ``g`` (row statistics) and ``dq``, ``dk``, ``dv``."""
    B, H, T, D = q.shape
    DV = v.shape[-1]
    common = dict(QK_NORM=form.qk_norm, PHI=form.phi, SHARPEN=form.sharpen, PRECISION=_precision(q.dtype),
                  FAST=not interpreting(), BD=_pow2(D), BDV=_pow2(DV))
    args = (*_strides(q), *_strides(k), *_strides(v), *_strides(dout))
    return [Launch(jit.preprocess_kernel, "pre", T, B * H, (out, u if form.sharpen else out, dout, delta, g, stats, p,
                                                             *_strides(out), *_strides(dout), H, T, DV),
                   dict(SHARPEN=form.sharpen, BDV=_pow2(DV))),
            Launch(jit.dq_kernel, "dq" if form.sharpen else "dq_plain", T, B * H,
                   (q, k, v, dout, dq, stats, delta, g, p, *args, *_strides(dq), H, T, D, DV, factors), common),
            Launch(jit.dkdv_kernel, "dkdv" if form.sharpen else "dkdv_plain", T, B * H,
                   (q, k, v, dout, dk, dv, stats, delta, g, p, *args, *_strides(dk), *_strides(dv), H, T, D, DV,
                    factors), common)]


def factors(q: torch.Tensor, k: torch.Tensor, form: Form) -> torch.Tensor:
    """``(2, B*H, T)`` float32: each row's ``scale_i`` (times ``1/|q_i|`` with QK-norm) and each key's ``1/|k_j|``
    (1 without QK-norm): the scores are ``(q_i . k_j) * row_i * col_j``. Computed once a call, in float32 from the
    inputs' own values, so no kernel recomputes a norm per tile."""
    B, H, T, _ = q.shape
    n = torch.arange(1, T + 1, device=q.device, dtype=torch.float32)
    scale = form.scale_mul * torch.log(n) if form.scale_log else torch.full_like(n, form.scale_mul)
    row = scale.expand(B, H, T)
    col = torch.ones((B, H, T), device=q.device, dtype=torch.float32)
    if form.qk_norm:
        row = row * inverse_norm(q)
        col = inverse_norm(k)
    return torch.stack([row, col]).reshape(2, B * H, T).contiguous()


def forward(q, k, v, p, form: Form, with_grad: bool):
    """``(out, u, stats)``: the output in v's dtype; ``u`` (``(B, H, T, Dv)``, empty unless sharpened and
    ``with_grad``) and the float32 row statistics ``stats`` (``(5, B*H, T)``: reference, 1/Z, 1/m, W, S) for the
    backward."""
    B, H, T, D = q.shape
    DV = v.shape[-1]
    out = torch.empty((B, H, T, DV), dtype=v.dtype, device=q.device)
    stats = torch.zeros((5, B * H, T), dtype=torch.float32, device=q.device)
    u = torch.empty((B, H, T, DV) if form.sharpen and with_grad else (0,), dtype=v.dtype, device=q.device)
    for launch in forward_launches(q, k, v, p, form, factors(q, k, form), out, u, stats):
        launch.run()
    return out, u, stats


def backward(dout, q, k, v, out, u, stats, p, form: Form):
    """``(dq, dk, dv)`` for the output gradient ``dout``, in q's, k's and v's dtypes."""
    B, H, T, D = q.shape
    delta = torch.empty((B * H, T), dtype=torch.float32, device=q.device)
    g = torch.zeros((B * H, T), dtype=torch.float32, device=q.device)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=q.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=q.device)
    for launch in backward_launches(dout, q, k, v, out, u, stats, p, form, factors(q, k, form), delta, g, dq, dk,
                                    dv):
        launch.run()
    return dq, dk, dv


# --- the operators ---------------------------------------------------------------------------------------------

@torch.library.custom_op("attnlab::triton_attention", mutates_args=())
def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor, phi: int, qk_norm: bool,
                     scale_mul: float, scale_log: bool, sharpen: bool,
                     with_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return forward(q, k, v, p, Form(phi, qk_norm, scale_mul, scale_log, sharpen), with_grad)


@triton_attention.register_fake
def _(q, k, v, p, phi, qk_norm, scale_mul, scale_log, sharpen, with_grad):
    B, H, T, _ = q.shape
    DV = v.shape[-1]
    out = q.new_empty((B, H, T, DV), dtype=v.dtype)
    u = q.new_empty((B, H, T, DV) if sharpen and with_grad else (0,), dtype=v.dtype)
    return out, u, q.new_empty((5, B * H, T), dtype=torch.float32)


@torch.library.custom_op("attnlab::triton_attention_backward", mutates_args=())
def triton_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, u: torch.Tensor, stats: torch.Tensor, p: torch.Tensor, phi: int,
                              qk_norm: bool, scale_mul: float, scale_log: bool,
                              sharpen: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward(dout, q, k, v, out, u, stats, p, Form(phi, qk_norm, scale_mul, scale_log, sharpen))


@triton_attention_backward.register_fake
def _(dout, q, k, v, out, u, stats, p, phi, qk_norm, scale_mul, scale_log, sharpen):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


def _setup_context(ctx, inputs, output):
    q, k, v, p, phi, qk_norm, scale_mul, scale_log, sharpen, _ = inputs
    out, u, stats = output
    ctx.save_for_backward(q, k, v, p, out, u, stats)
    ctx.form = (phi, qk_norm, scale_mul, scale_log, sharpen)


def _backward(ctx, dout, _du, _dstats):
    q, k, v, p, out, u, stats = ctx.saved_tensors
    dq, dk, dv = triton_attention_backward(dout, q, k, v, out, u, stats, p, *ctx.form)
    return dq, dk, dv, None, None, None, None, None, None, None


triton_attention.register_autograd(_backward, setup_context=_setup_context)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor, form: Form) -> torch.Tensor:
    """The output ``(B, H, T, Dv)`` in v's dtype (q, k and v of one dtype: the caller casts)."""
    with_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    out, _, _ = triton_attention(q, k, v, p, form.phi, form.qk_norm, form.scale_mul, form.scale_log, form.sharpen,
                                 with_grad)
    return out


def scale_form(scale: str, coef: float | None, head_dim: int) -> tuple[float, bool]:
    """``(scale_mul, scale_log)`` for an AttentionSpec's scale: ``scale_i = scale_mul * ln N_i`` or ``scale_mul``."""
    if scale == "inv_sqrt_d":
        return 1.0 / math.sqrt(head_dim), False
    if scale == "log_n":
        return 1.0 / math.sqrt(head_dim), True
    if scale == "logd_logn":
        return math.log(head_dim), True
    return float(coef), True
