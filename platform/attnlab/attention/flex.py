"""The fused path: every registered variant, and sharpening, with FlexAttention in O(T) memory.

Owns :func:`attend_flex` (``attend(impl="flex")``) and :func:`attend_log_scores`: the two-pass sharpening of any
first stage whose rows are a softmax of log-scores (the built-in variants pass :func:`first_stage_score_mod`),
with a backward that scatters into no captured buffer. A first stage is one call whose ``score_mod`` returns
``log f(S)`` (``l1norm(f(S) * M) == softmax(log f(S))``); unnormalised rows come from its LSE, a sign-changing
``f`` is split into two calls; QK-norm and ALiBi are done inside every ``score_mod``, in float32 or better.
What has no fused form (only overrides) runs the dense reference after one warning per variant name.

On CUDA the compiled kernels run, and an eager fallback past :data:`UNFUSED_MAX_TOKENS` is refused
(:func:`unfused_refusal`); on CPU FlexAttention's unfused implementation runs, for the equivalence tests only.

Never change the math here without the dense reference (``dense.py`` is the oracle; ``masks.py`` owns the causal
mask and N_i); no Ray, no model code.

Details: docs/attention.md#the-fused-path (the identity, the two passes and their backward, the row sums, the sign
split, precision and gradients).
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as _flex_module
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from attnlab.attention.dense import (EXP_CLAMP, attend_dense, check_power, check_qk_gain, compute_dtype, gain_factor,
                                    length_scale, sharpen_tolerance)
from attnlab.attention.masks import alibi_bias, causal_block_mask, visible_keys
from attnlab.attention.spec import SHARPEN_EXEMPT_ROWS, AttentionSpec, PluginSpec
from attnlab.errors import UserError

# f >= 0 everywhere, so l1norm(f) is the softmax of log f ("exp" with l1 is softmax itself).
NONNEGATIVE_PHIS = ("exp", "relu", "relu2", "relu6", "sigmoid", "softplus")
# Below this score, log softplus(s) == s to float64 precision (the error is exp(s) / 2 < 5e-14).
_LOG_SOFTPLUS_LINEAR_BELOW = -30.0
# QK-norm divides by max(|x|, eps), as F.normalize does.
_NORM_EPS = 1e-12

_warned_fallback: set[str] = set()


# --- which variants have a fused form ----------------------------------------------------------------------

def unfusable_reason(spec: AttentionSpec) -> str | None:
    """Why ``spec`` has no FlexAttention form (None when it has one).

    Fused: every ``phi`` (a sign-changing ``f`` as two calls, ``f+`` and ``f-``), every norm (``l1``, ``none``
    and ``count`` from FlexAttention's row sums), ``negate`` and ``recentre`` (a causal mean of v),
    ``recentre_l1`` of normalised non-negative rows (a second call for ``sum_j |A_ij - c_i|``), output
    LayerNorm, and sharpening of normalised non-negative rows. Not fused: ``recentre_l1`` of other rows and
    sharpening on top of anything else. A plugin's spec answers for itself (:meth:`PluginSpec.unfusable_reason`).
    """
    if isinstance(spec, PluginSpec):
        return spec.unfusable_reason()
    if spec.post == "recentre_l1" and (spec.norm != "l1" or spec.phi not in NONNEGATIVE_PHIS):
        return (f"post='recentre_l1' is fused on l1-normalised non-negative rows only "
                f"(phi={spec.phi!r}, norm={spec.norm!r})")
    if spec.p is not None and (spec.norm != "l1" or spec.phi not in NONNEGATIVE_PHIS or spec.post != "none"):
        return (f"sharpening is fused for l1-normalised non-negative rows without post-processing only "
                f"(phi={spec.phi!r}, norm={spec.norm!r}, post={spec.post!r})")
    return None


def is_fusable(spec: AttentionSpec) -> bool:
    """True when :func:`attend_flex` computes ``spec`` with FlexAttention rather than the dense reference."""
    return unfusable_reason(spec) is None


def warn_fallback(spec: AttentionSpec, reason: str, stacklevel: int = 3) -> None:
    """Warn, once per variant name and process, that ``spec`` is computed by the dense reference."""
    if spec.name in _warned_fallback:
        return
    _warned_fallback.add(spec.name)
    warnings.warn(f"attention {spec.name!r} has no fused form ({reason}): using the dense reference",
                  UserWarning, stacklevel=stacklevel)


# --- the score_mods, in log space --------------------------------------------------------------------------

def log_positive(x: torch.Tensor) -> torch.Tensor:
    """``log x`` where ``x > 0``, ``-inf`` elsewhere; its gradient is 0 (never NaN) where ``x <= 0``."""
    positive = x > 0
    return torch.where(positive, torch.log(torch.where(positive, x, torch.ones_like(x))), float("-inf"))


def log_softplus(s: torch.Tensor) -> torch.Tensor:
    """``log softplus(s)``, finite for every finite ``s`` (linear below -30, where softplus(s) ~ exp(s))."""
    linear = s < _LOG_SOFTPLUS_LINEAR_BELOW
    return torch.where(linear, s, torch.log(F.softplus(torch.where(linear, torch.zeros_like(s), s))))


def log_phi(phi: str, s: torch.Tensor, part: str = "whole", clamp_exp: bool = False) -> torch.Tensor:
    """``log f(s)`` for a non-negative ``f`` (``part="whole"``), or ``log f+(s)`` / ``log f-(s)`` (``part``
    ``plus`` / ``minus``) with ``f+ = relu(f)``, ``f- = relu(-f)`` for any ``f``; ``-inf`` where the part is 0.

    ``clamp_exp``: ``exp`` without softmax's normalisation is clamped at ``EXP_CLAMP``, as the dense path does.
    """
    if part != "whole":
        f = phi_values(phi, s, clamp_exp)
        return log_positive(f if part == "plus" else -f)
    if phi == "exp":
        return torch.clamp(s, max=EXP_CLAMP) if clamp_exp else s
    if phi == "softplus":
        return log_softplus(s)
    if phi == "sigmoid":
        return F.logsigmoid(s)
    if phi == "relu":
        return log_positive(s)
    if phi == "relu2":
        return 2.0 * log_positive(s)
    if phi == "relu6":
        return log_positive(torch.clamp(s, max=6.0))
    raise ValueError(f"phi={phi!r} has no log-space form: use one of {', '.join(NONNEGATIVE_PHIS)}")


def phi_values(phi: str, s: torch.Tensor, clamp_exp: bool = False) -> torch.Tensor:
    """``f(s)`` itself (for the sign split of a ``f`` that changes sign)."""
    if phi == "identity":
        return s
    if phi == "gelu":
        return F.gelu(s)
    if phi == "mish":
        return F.mish(s)
    return torch.exp(log_phi(phi, s, "whole", clamp_exp))


def parts_of(spec: AttentionSpec) -> tuple[str, ...]:
    """The FlexAttention calls of the first stage: ``("whole",)`` for ``f >= 0``, else ``("plus", "minus")``."""
    return ("whole",) if spec.phi in NONNEGATIVE_PHIS else ("plus", "minus")


@dataclass(frozen=True)
class Sizes:
    """The sizes a ``score_mod`` needs: the head dimension d (for the scale), T (for the ``-ln T`` bias) and the
    number of heads H (for the ALiBi slopes)."""

    head_dim: int
    seq_len: int
    n_head: int = 1


@dataclass(frozen=True, eq=False)
class ScoreMod:
    """A score_mod ``fn(score, b, h, q_idx, kv_idx, *buffers)`` and the tensors it reads.

    The tensors are passed as explicit buffers, not captured in a closure: FlexAttention's unfused (CPU)
    implementation only differentiates through tensors given that way; the compiled one gets the closure
    :meth:`bound` and lifts the captured tensors itself.
    """

    fn: Callable
    buffers: tuple[torch.Tensor, ...] = ()

    def bound(self) -> Callable:
        fn, buffers = self.fn, self.buffers
        return lambda score, b, h, q_idx, kv_idx: fn(score, b, h, q_idx, kv_idx, *buffers)


def first_stage_log_score(spec: AttentionSpec, sizes: Sizes, score: torch.Tensor, b, h, q_idx, kv_idx,
                          inv_q_norm: torch.Tensor | None = None,
                          inv_k_norm: torch.Tensor | None = None, part: str = "whole") -> torch.Tensor:
    """``log f(scale_i * s + bias_i)`` for one raw score ``s = q . k`` (upcast to float32 or float64).

    With QK-norm, ``inv_q_norm``/``inv_k_norm`` are the ``(B, H, T)`` tensors ``1/|q_i|`` and ``1/|k_j|``.
    ``part``: ``whole`` (``f >= 0``), ``plus`` or ``minus`` (see :func:`log_phi`).
    """
    s = score.to(compute_dtype(score.dtype))
    if inv_q_norm is not None:
        s = s * inv_q_norm[b, h, q_idx] * inv_k_norm[b, h, kv_idx]
    n = visible_keys(q_idx, s.dtype)
    s = length_scale(spec, n, sizes.head_dim) * s
    if spec.bias == "neg_log_t":
        s = s - math.log(sizes.seq_len)
    elif spec.bias == "neg_log_n":
        s = s - torch.log(n)
    if spec.position_bias == "alibi":
        s = s + alibi_bias(h, q_idx, kv_idx, sizes.n_head, s.dtype)
    return log_phi(spec.phi, s, part, clamp_exp=spec.norm != "l1")


def first_stage_score_mod(spec: AttentionSpec, sizes: Sizes, norms: tuple[torch.Tensor, ...] = (),
                          part: str = "whole") -> ScoreMod:
    """Pass 1: FlexAttention's softmax of this score_mod is the variant's weights ``A`` (for a normalised
    non-negative ``f``), or the row-normalised ``f+`` / ``f-`` (``part``).

    ``norms``: ``(1/|q|, 1/|k|)`` with QK-norm (see :func:`inverse_norm`), else empty.
    """
    return ScoreMod(_uncached_if_compiling(_first_stage_fn)(spec, sizes, part), tuple(norms))


def _uncached_if_compiling(cached: Callable) -> Callable:
    # Inside an enclosing torch.compile the graph is built once per specialisation: no cache lookup to trace.
    return cached.__wrapped__ if torch.compiler.is_compiling() else cached


# The functions are cached per (variant, sizes) so that the compiled kernel sees the same function each call.
@functools.lru_cache(maxsize=256)
def _first_stage_fn(spec: AttentionSpec, sizes: Sizes, part: str = "whole") -> Callable:
    def score_mod(score, b, h, q_idx, kv_idx, *norms):
        return first_stage_log_score(spec, sizes, score, b, h, q_idx, kv_idx, *norms, part=part)
    return score_mod


def sharpen_score_mod(first_stage: ScoreMod, log_z: torch.Tensor, has_mass: torch.Tensor,
                      p: torch.Tensor) -> ScoreMod:
    """Pass 2: ``p * log relu(N_i * A_ij - O_i)`` on rows with mass, the first stage's log-score on the others,
    with ``A_ij = exp(l_ij - log Z_i)`` and ``l_ij`` the first stage's log-score.

    ``log_z``: ``(B, H, T)`` pass 1's LSE (finite: 0 where a row had no visible weight), read as a constant:
    its gradient is handed to pass 1 by :func:`attend_log_scores`, never computed from a captured buffer.
    ``has_mass``: ``(B, H, T)`` booleans, True where ``relu(N_i * A_ij - O_i)`` is non-zero for some ``j``.
    ``p``: the power, a 0-d tensor in the compute dtype (a tensor does not specialise a compiled graph).
    """
    fn = _uncached_if_compiling(_sharpen_fn)(first_stage.fn)
    return ScoreMod(fn, (log_z, has_mass, p, *first_stage.buffers))


def _excess(log_a: torch.Tensor, log_z_i: torch.Tensor, q_idx) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N_i, x_ij = N_i * A_ij - O_i)`` for one first-stage log-score ``log_a`` and its row's ``log Z_i``."""
    n = visible_keys(q_idx, log_a.dtype)
    offset = (q_idx >= SHARPEN_EXEMPT_ROWS).to(log_a.dtype)
    return n, n * torch.exp(log_a - log_z_i) - offset


# Cached per first-stage function (itself cached per variant and sizes): the compiled kernel sees one function.
@functools.lru_cache(maxsize=256)
def _sharpen_fn(first_fn: Callable) -> Callable:
    def score_mod(score, b, h, q_idx, kv_idx, log_z, has_mass, p, *buffers):
        log_a = first_fn(score, b, h, q_idx, kv_idx, *buffers)
        _, x = _excess(log_a, log_z[b, h, q_idx], q_idx)
        return torch.where(has_mass[b, h, q_idx], p * log_positive(x), log_a)
    return score_mod


def sharpen_tilt_score_mod(first_stage: ScoreMod, log_z: torch.Tensor, has_mass: torch.Tensor,
                           p: torch.Tensor) -> ScoreMod:
    """The extra call of the sharpened backward: pass 2's score ``g_ij`` plus ``log h_ij``, ``h_ij = dg_ij / dl_ij
    = p N_i A_ij / x_ij`` (``x_ij = N_i A_ij - O_i``), i.e. ``(p - 1) log x_ij + log(p N_i) + l_ij - log Z_i``
    where ``x_ij > 0`` on rows with mass, ``-inf`` elsewhere (docs/attention.md#the-backward-of-the-two-passes)."""
    fn = _uncached_if_compiling(_sharpen_tilt_fn)(first_stage.fn)
    return ScoreMod(fn, (log_z, has_mass, p, *first_stage.buffers))


@functools.lru_cache(maxsize=256)
def _sharpen_tilt_fn(first_fn: Callable) -> Callable:
    def score_mod(score, b, h, q_idx, kv_idx, log_z, has_mass, p, *buffers):
        log_a = first_fn(score, b, h, q_idx, kv_idx, *buffers)
        log_z_i = log_z[b, h, q_idx]
        n, x = _excess(log_a, log_z_i, q_idx)
        live = has_mass[b, h, q_idx] & (x > 0)
        log_x = torch.log(torch.where(live, x, torch.ones_like(x)))
        return torch.where(live, (p - 1) * log_x + torch.log(p * n) + (log_a - log_z_i), float("-inf"))
    return score_mod


def sharpen_rows_with_mass(log_z: torch.Tensor, max_log_score: torch.Tensor) -> torch.Tensor:
    """``(B, H, T)`` booleans: does ``relu(N_i * A_ij - O_i)`` have an entry above rounding in row ``i``?

    From pass 1's LSE and row maximum: ``max_j A_ij = exp(max_j log f_ij - log Z_i)``. A row with no visible
    weight at all (LSE ``-inf``) has none; nor has a (nearly) uniform row, whose excess is within
    :func:`attnlab.attention.dense.sharpen_tolerance` (pass 2 would otherwise sharpen its rounding noise).
    """
    T = log_z.shape[-1]
    rows = torch.arange(T, device=log_z.device)
    n = visible_keys(rows, log_z.dtype)
    offset = (rows >= SHARPEN_EXEMPT_ROWS).to(log_z.dtype)
    finite = torch.isfinite(log_z) & torch.isfinite(max_log_score)
    max_a = torch.exp(torch.where(finite, max_log_score - log_z, torch.full_like(log_z, float("-inf"))))
    return finite & (n * max_a > offset + sharpen_tolerance(log_z.dtype))


class RadialGradientRemoved(torch.autograd.Function):
    """Identity on ``x`` (``(..., D)``) whose backward removes the gradient's component along ``x``.

    Used on q and k for QK-norm: the score_mod sees ``x`` and a captured, gradient-free ``1/|x|``, so
    FlexAttention's gradient is ``g/|x|`` with ``g`` the gradient with respect to ``u = x/|x|``; the true
    gradient through the normalisation is ``(g - (u.g) u)/|x|``, i.e. that with its radial part removed.
    """

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        dtype = compute_dtype(x.dtype)
        xf, gf = x.to(dtype), grad.to(dtype)
        radial = (xf * gf).sum(-1, keepdim=True) / (xf * xf).sum(-1, keepdim=True).clamp_min(_NORM_EPS**2)
        return (gf - radial * xf).to(grad.dtype)


def inverse_norm(x: torch.Tensor) -> torch.Tensor:
    """``1 / max(|x|, eps)`` over the last dimension, in float32 (float64 for float64), without gradient."""
    return 1.0 / torch.linalg.vector_norm(x.detach().to(compute_dtype(x.dtype)), dim=-1).clamp_min(_NORM_EPS)


# --- calling FlexAttention ---------------------------------------------------------------------------------

# FlexAttention's unfused implementation materialises (B, H, T, T) float32 scores. On CUDA it is refused past this
# many tokens (at 16K tokens and 12 heads that is 12 GiB per call): evaluation stops with the reason instead.
UNFUSED_MAX_TOKENS = 4096


def unfused_refusal(device: torch.device | str, batch_heads: int, seq_len: int) -> str | None:
    """Why FlexAttention must not run its unfused implementation for ``batch_heads`` (B * H) rows of ``seq_len``
    tokens on ``device`` (one line), or None where it may: on CUDA past :data:`UNFUSED_MAX_TOKENS`. (On CPU the
    unfused implementation is the intended path of the equivalence tests.)"""
    device = torch.device(device)
    if device.type != "cuda" or seq_len <= UNFUSED_MAX_TOKENS:
        return None
    import torch._dynamo as dynamo

    gib = batch_heads * seq_len * seq_len * 4 / 2**30
    return (f"FlexAttention would run unfused on {device.type} at T={seq_len}, materialising (B*H={batch_heads}, "
            f"T, T) float32 scores ({gib:.1f} GiB per call): torch.compile fell back to eager for this call (dynamo's "
            f"recompile_limit, {dynamo.config.recompile_limit}, was reached, or a compile failed: see the log "
            f"above); evaluate fewer lengths or p_eval values per process, or use impl='dense' (chunked rows)")


def _flex_attention_or_refuse(query, key, value, score_mod=None, block_mask=None, scale=None, return_aux=None):
    """``flex_attention``, as the process's compiled instance compiles it (:func:`_compiled_flex_attention`).

    Traced, this is FlexAttention's fused kernel. Run eagerly, dynamo gave up on the call (its recompile limit, or a
    compile it fell back from) and ``flex_attention`` would be the unfused implementation: refused where
    :func:`unfused_refusal` says so (a ``UserError``), before anything is allocated."""
    if not torch.compiler.is_compiling():
        reason = unfused_refusal(query.device, query.shape[0] * query.shape[1], query.shape[-2])
        if reason is not None:
            raise UserError(reason)
    return flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                          return_aux=return_aux)


@functools.cache
def _compiled_flex_attention():
    # One compiled instance for the process; each (variant, pass, length) is one specialisation of it.
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 512)
    return torch.compile(_flex_attention_or_refuse, dynamic=False)


# The CPU lowering proxy's switch (attention check, the cuda_proxy tests): see :func:`cuda_code_path`.
_cuda_code_path_on_cpu = False


@contextlib.contextmanager
def cuda_code_path():
    """Within this context, a ``torch.compile`` trace of :func:`_flex` on CPU tensors takes the CUDA branch.

    For checking lowering without a GPU (``attention check``'s lowering step through
    :mod:`attnlab.attention.inductor_proxy`, and ``tests/test_cuda_proxy_attention.py``): the traced FlexAttention
    call with its statistics (LSE and row maximum) and gradients, exactly the graph a compiled model builds on
    CUDA, so that inductor's lowering of it (forward and backward) can be checked on a machine without a GPU. The
    public
    ``flex_attention`` refuses CPU tensors that require grad and the row maximum on CPU before tracing, so
    the branch calls the operator underneath as ``flex_attention`` itself does when traced
    (:func:`_flex_traced`). Outside ``torch.compile`` the switch changes nothing (the CPU path stays the
    unfused one). Never use it for results.
    """
    global _cuda_code_path_on_cpu
    previous, _cuda_code_path_on_cpu = _cuda_code_path_on_cpu, True
    try:
        yield
    finally:
        _cuda_code_path_on_cpu = previous


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: ScoreMod, block_mask: BlockMask,
          with_stats: bool, with_max: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(out, lse, max_score)`` of one FlexAttention call with scale 1 (the score_mod scales).

    ``lse`` and ``max_score`` are natural-log ``(B, H, T)`` tensors when ``with_stats`` (``max_score`` only
    with ``with_max``; on CPU it is always there), else None.
    """
    compiling = torch.compiler.is_compiling()
    if compiling and _cuda_code_path_on_cpu and q.device.type == "cpu":
        return _flex_traced(q, k, v, score_mod, block_mask, with_stats, with_max)
    if q.device.type == "cuda" or (compiling and not with_stats and not torch.is_grad_enabled()):
        # Inside a compiled model the enclosing torch.compile compiles this call (and its block mask); outside
        # one, the process's one compiled instance does. On CPU FlexAttention compiles for inference without
        # statistics only; otherwise the CPU path is the unfused one, outside any graph.
        kernel = flex_attention if compiling else _compiled_flex_attention()
        aux = AuxRequest(lse=True, max_scores=with_max) if with_stats else None
        result = kernel(q, k, v, score_mod=score_mod.bound(), block_mask=block_mask, scale=1.0, return_aux=aux)
        if not with_stats:
            return result, None, None
        out, stats = result
        return out, stats.lse, stats.max_scores
    return _flex_unfused(q, k, v, score_mod, block_mask, with_stats)


def _flex_traced(q, k, v, score_mod: ScoreMod, block_mask: BlockMask, with_stats: bool, with_max: bool):
    """What ``flex_attention`` traces to (its higher-order op and kernel options), on any device: the
    :func:`cuda_code_path` branch. Statistics are natural-log as ``flex_attention`` returns them."""
    options = _flex_module._apply_kernel_options(q, k, v, False, None, AuxRequest(lse=True) if with_stats else None)
    options["OUTPUT_LOGSUMEXP"] = True  # as on CUDA under autograd
    options["OUTPUT_MAX"] = with_stats and with_max
    out, lse, max_score = _flex_module.flex_attention_hop(q, k, v, score_mod.bound(), block_mask.as_tuple(), 1.0,
                                                          options)
    if not with_stats:
        return out, None, None
    ln2 = math.log(2.0) if options.get("BACKEND") != "FLASH" else 1.0
    return out, lse * ln2, (max_score * ln2 if with_max else None)


@torch._disable_dynamo  # torch.compiler.disable, without importing torch._dynamo until it is called
def _flex_unfused(q, k, v, score_mod: ScoreMod, block_mask: BlockMask, with_stats: bool):
    """FlexAttention's own unfused implementation (CPU): its higher-order op called eagerly.

    The public ``flex_attention`` refuses tensors that require grad on CPU and cannot return the row
    maximum there; the op underneath does both (it materialises the scores). This is the CPU path of the
    equivalence tests, forward and backward. Never traced (``torch.compiler.disable``): in a compiled CPU
    model it runs eagerly between two graphs.
    """
    hop = getattr(_flex_module, "flex_attention_hop", None)
    apply_options = getattr(_flex_module, "_apply_kernel_options", None)
    if hop is None or apply_options is None:
        raise NotImplementedError(f"torch {torch.__version__} has no eager FlexAttention on {q.device.type}: "
                                  "use impl='dense'")
    options = apply_options(q, k, v, with_stats, None, AuxRequest(lse=True) if with_stats else None)
    out, lse, max_score = hop(q, k, v, score_mod.fn, block_mask.as_tuple(), 1.0, options, score_mod.buffers)
    if not with_stats:
        return out, None, None
    ln2 = math.log(2.0) if options.get("BACKEND") != "FLASH" else 1.0  # the op reports base-2 statistics
    return out, lse * ln2, max_score * ln2


# --- the public entry points -------------------------------------------------------------------------------

def attend_log_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_stage: ScoreMod, sizes: Sizes,
                      block_mask: BlockMask | None = None, p: float | torch.Tensor | None = None) -> torch.Tensor:
    """Rows that are a softmax of log-scores, times v: ``(B, H, T, Dv)`` in q's dtype, with FlexAttention.

    ``first_stage``: a :class:`ScoreMod` whose ``fn(score, b, h, q_idx, kv_idx, *buffers)`` returns the log-score
    ``l_ij`` of a raw score ``s = q_i . k_j`` in float32 (float64 for float64 inputs), ``-inf`` for a zero
    weight; the rows are ``A_ij = exp(l_ij) / Z_i`` over the causal keys. Keep ``fn`` the same object from call
    to call (cache it per configuration): the compiled kernels are keyed on it. ``sizes``: T for the causal
    mask (``block_mask``: that mask, built here when None).

    ``p`` (a float or a 0-d tensor, >= 1): the sharpened rows ``relu(N_i A_ij - O_i)^p / sum_k (...)^p``
    (docs/attention.md#sharpening) in two passes, with a deterministic backward that scatters into no captured
    buffer (docs/attention.md#the-backward-of-the-two-passes). A tensor ``p`` does not specialise a compiled
    graph: every power shares it.
    """
    if block_mask is None:
        block_mask = causal_block_mask(sizes.seq_len, q.device)
    if p is None:
        out, _, _ = _flex(q, k, v, first_stage, block_mask, with_stats=False)
        return out
    return _sharpened(q, k, v, first_stage, block_mask, p)


def attend_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
                qk_gain=None, p: float | torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention ``(B, H, T, Dv)`` in v's dtype, computed with FlexAttention in O(T) memory.

    One call for a non-negative ``f`` (two when sharpened), two for an ``f`` that changes sign
    (docs/attention.md#the-fused-path). Equal to :func:`attnlab.attention.dense.attend_dense` up to rounding; a
    variant without a fused form (see :func:`unfusable_reason`) is computed by ``attend_dense`` after a
    one-time warning. ``qk_gain``: the model's ``(gain_q, gain_k)`` for ``qk_norm_gain='learned'``. ``p``: the
    sharpening power of a sharpened spec instead of ``spec.p`` (a float or a 0-d tensor).
    """
    check_qk_gain(spec, qk_gain, q)
    check_power(spec, p)
    reason = unfusable_reason(spec)
    if reason is not None:
        warn_fallback(spec, reason)
        return attend_dense(q, k, v, spec, qk_gain=qk_gain, p=p)

    out_dtype = v.dtype
    work = q.dtype if q.dtype == k.dtype == v.dtype else compute_dtype(q.dtype)
    q, k, v = q.to(work), k.to(work), v.to(work)
    sizes = Sizes(head_dim=q.shape[-1], seq_len=q.shape[-2], n_head=q.shape[-3])
    norms: tuple[torch.Tensor, ...] = ()
    if spec.qk_norm:  # inside the score_mod, in float32 (docs/attention.md#precision-and-gradients)
        norms = (inverse_norm(q), inverse_norm(k))
        q, k = RadialGradientRemoved.apply(q), RadialGradientRemoved.apply(k)
        if spec.learned_qk_gain:  # RMSNorm's sqrt(d) * gain, on the raw q and k (their norms are taken above)
            d = sizes.head_dim
            q, k = q * gain_factor(qk_gain[0], d, work), k * gain_factor(qk_gain[1], d, work)
    block_mask = causal_block_mask(sizes.seq_len, q.device)

    if spec.p is not None:
        out = attend_log_scores(q, k, v, first_stage_score_mod(spec, sizes, norms), sizes, block_mask,
                                p=spec.p if p is None else p)
    elif spec.post == "recentre_l1":
        out = _recentred_l1(q, k, v, spec, sizes, norms, block_mask)
    elif spec.phi in NONNEGATIVE_PHIS and spec.norm == "l1":
        out = attend_log_scores(q, k, v, first_stage_score_mod(spec, sizes, norms), sizes, block_mask)
    else:
        out = _row_sums(q, k, v, spec, sizes, norms, block_mask)

    if spec.post in ("negate", "recentre"):
        out = out.to(compute_dtype(out.dtype))
        if spec.post == "negate":
            out = -out
        else:  # recentre: A_ij - [i >= 3] / N_i over the visible keys, i.e. minus [i >= 3] * the causal mean of v
            rows = torch.arange(sizes.seq_len, device=out.device)
            n = visible_keys(rows, out.dtype)[:, None]
            offset = (rows >= SHARPEN_EXEMPT_ROWS).to(out.dtype)[:, None]
            out = out - offset * torch.cumsum(v.to(out.dtype), dim=-2) / n
    if spec.out_norm == "layernorm":
        out = out.to(compute_dtype(out.dtype))
        out = F.layer_norm(out, out.shape[-1:])
    return out.to(out_dtype)


def _needs_gradient(log_z: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and log_z.requires_grad


def _sharpened(q, k, v, first_stage: ScoreMod, block_mask: BlockMask, p) -> torch.Tensor:
    """The two passes of docs/attention.md#the-two-pass-sharpening, and the gradient of pass 1's LSE handed to
    pass 1 without a captured-buffer gradient (docs/attention.md#the-backward-of-the-two-passes)."""
    dtype = compute_dtype(q.dtype)
    p = torch.as_tensor(p, dtype=dtype, device=q.device)
    # Pass 1 supplies log Z_i and the row maximum: a narrow zero value tensor keeps it cheap.
    v_stats = q.new_zeros(q.shape[:-1] + (16,))
    out_stats, log_z, max_log_score = _flex(q, k, v_stats, first_stage, block_mask, with_stats=True)
    has_mass = sharpen_rows_with_mass(log_z.detach(), max_log_score.detach())
    log_z = torch.where(torch.isfinite(log_z), log_z, torch.zeros_like(log_z))
    fixed_z = log_z.detach()  # pass 2 reads log Z as a constant: FlexAttention differentiates no captured buffer
    grad = _needs_gradient(log_z)
    second = sharpen_score_mod(first_stage, fixed_z, has_mass, p)
    out, lse, _ = _flex(q, k, v, second, block_mask, with_stats=grad, with_max=False)
    if grad:
        # dL/dlog Z_i = dO_i . w_i; adding (log Z - log Z.detach()) * w (zero) hands pass 1's LSE that gradient.
        with torch.no_grad():
            tilted = sharpen_tilt_score_mod(first_stage, fixed_z, has_mass, p)
            out_t, lse_t, _ = _flex(q, k, v, tilted, block_mask, with_stats=True, with_max=False)
            live = has_mass & torch.isfinite(lse_t) & torch.isfinite(lse)
            c = torch.exp(torch.where(live, lse_t - lse, torch.zeros_like(lse)))
            w = torch.where(live.unsqueeze(-1), -c.unsqueeze(-1) * (out_t.to(dtype) - out.to(dtype)), 0.0)
        out = (out.to(dtype) + (log_z - fixed_z).to(dtype).unsqueeze(-1) * w).to(out.dtype)
    # Pass 1's output (zeros: v_stats is 0) stays in the graph. Discarded, a compiled graph hands FlexAttention's
    # backward no output gradient at all and inductor cannot lower it (LoweringException in
    # flex_attention_backward); tied in, it gets a zero gradient, and its LSE the true one.
    return out + out_stats[..., :1].to(out.dtype) * 0


def recentre_score_mod(first_stage: ScoreMod, log_z: torch.Tensor) -> ScoreMod:
    """``log relu(A_ij - c_i)`` with ``A_ij = exp(l_ij - log Z_i)`` (pass 1's LSE, read as a constant) and
    ``c_i = [i >= 3] / N_i``: its LSE is ``log sum_j relu(A_ij - c_i)``."""
    return ScoreMod(_uncached_if_compiling(_recentre_fn)(first_stage.fn), (log_z, *first_stage.buffers))


def _centre(log_a: torch.Tensor, q_idx) -> torch.Tensor:
    return (q_idx >= SHARPEN_EXEMPT_ROWS).to(log_a.dtype) / visible_keys(q_idx, log_a.dtype)


@functools.lru_cache(maxsize=256)
def _recentre_fn(first_fn: Callable) -> Callable:
    def score_mod(score, b, h, q_idx, kv_idx, log_z, *buffers):
        log_a = first_fn(score, b, h, q_idx, kv_idx, *buffers)
        return log_positive(torch.exp(log_a - log_z[b, h, q_idx]) - _centre(log_a, q_idx))
    return score_mod


@functools.lru_cache(maxsize=256)
def _recentre_tilt_fn(first_fn: Callable) -> Callable:
    # The recentre score r_ij = log(A_ij - c_i) plus log h_ij, h_ij = dr_ij / dl_ij = A_ij / (A_ij - c_i): that is
    # log A_ij = l_ij - log Z_i where A_ij > c_i, -inf elsewhere.
    def score_mod(score, b, h, q_idx, kv_idx, log_z, *buffers):
        log_a = first_fn(score, b, h, q_idx, kv_idx, *buffers)
        rel = log_a - log_z[b, h, q_idx]
        return torch.where(torch.exp(rel) > _centre(log_a, q_idx), rel, float("-inf"))
    return score_mod


def _recentred_l1(q, k, v, spec: AttentionSpec, sizes: Sizes, norms, block_mask: BlockMask) -> torch.Tensor:
    """``l1norm(A - c)`` @ v for l1-normalised non-negative ``A`` and ``c_i = [i >= 3] / N_i`` (compute dtype).

    Numerator: ``A v - c_i sum_{j <= i} v_j`` (pass 1's output minus a cumulative sum). Normaliser:
    ``sum_j |A_ij - c_i| = 2 sum_j relu(A_ij - c_i) - (sum_j A_ij - N_i c_i)``, the relu sum from a second call
    that reads pass 1's LSE as a constant (``sum_j A_ij`` is 1, or 0 for a row with no visible weight); the
    gradient of that LSE reaches pass 1 as in :func:`_sharpened`, through the second call's LSE.
    """
    dtype = compute_dtype(q.dtype)
    first_stage = first_stage_score_mod(spec, sizes, norms)
    out, log_z, _ = _flex(q, k, v, first_stage, block_mask, with_stats=True, with_max=False)
    has_weight = torch.isfinite(log_z)
    log_z = torch.where(has_weight, log_z, torch.zeros_like(log_z))
    fixed_z = log_z.detach()
    v_stats = q.new_zeros(q.shape[:-1] + (16,))
    out_stats, log_pos, _ = _flex(q, k, v_stats, recentre_score_mod(first_stage, fixed_z), block_mask,
                                  with_stats=True, with_max=False)
    log_pos = log_pos.to(dtype)
    if _needs_gradient(log_z):
        # dL/dlog Z_i = -c_i dL/dlog_pos_i with c_i = sum_j P_ij h_ij = exp(LSE'_i - log_pos_i) (the tilted call).
        with torch.no_grad():
            tilted = ScoreMod(_uncached_if_compiling(_recentre_tilt_fn)(first_stage.fn), (fixed_z, *first_stage.buffers))
            _, lse_t, _ = _flex(q, k, v_stats, tilted, block_mask, with_stats=True, with_max=False)
            live = torch.isfinite(log_pos) & torch.isfinite(lse_t)
            c = torch.where(live, torch.exp(torch.where(live, lse_t.to(dtype) - log_pos, 0.0)), 0.0)
        log_pos = log_pos - (log_z - fixed_z).to(dtype) * c
    rows = torch.arange(sizes.seq_len, device=q.device)
    n = visible_keys(rows, dtype)
    exempt = rows < SHARPEN_EXEMPT_ROWS
    centred_sum = torch.where(exempt, torch.zeros_like(n), torch.ones_like(n))  # N_i c_i
    l1 = 2.0 * torch.exp(log_pos) - (has_weight.to(dtype) - centred_sum)
    numerator = out.to(dtype) - torch.where(exempt, 0.0, 1.0 / n)[:, None] * torch.cumsum(v.to(dtype), dim=-2)
    result = numerator / l1.clamp_min(torch.finfo(dtype).tiny).unsqueeze(-1)
    # The second call's (zero) output stays in the graph, as in _sharpened: a compiled backward needs it.
    return result + out_stats[..., :1].to(dtype) * 0


def _row_sums(q, k, v, spec: AttentionSpec, sizes: Sizes, norms, block_mask: BlockMask) -> torch.Tensor:
    """``sum_j f_ij v_j``, normalised per ``spec.norm``, from FlexAttention's output and LSE (compute dtype).

    With ``f+``/``f-`` (``Z+ = exp(lse+)``, ``out+``, and likewise for ``f-``): ``U_i = Z+ out+ - Z- out-``;
    ``l1``: ``U_i / (Z+ + Z-)``, ``none``: ``U_i``, ``count``: ``U_i / N_i``
    (docs/attention.md#unnormalised-rows). Computed relative to ``m_i = max(lse+, lse-)``: no overflow, and a row
    with no visible weight (both LSEs ``-inf``: FlexAttention's output is 0) gives exactly 0 and no NaN in either
    direction.
    """
    dtype = compute_dtype(q.dtype)
    outs, lses = [], []
    for part in parts_of(spec):
        out, lse, _ = _flex(q, k, v, first_stage_score_mod(spec, sizes, norms, part), block_mask,
                            with_stats=True, with_max=False)
        outs.append(out.to(dtype))
        lses.append(lse.to(dtype))
    m = lses[0] if len(lses) == 1 else torch.maximum(lses[0], lses[1])
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    weights = [torch.exp(lse - m).unsqueeze(-1) for lse in lses]
    u = weights[0] * outs[0] if len(outs) == 1 else weights[0] * outs[0] - weights[1] * outs[1]
    if spec.norm == "l1":  # only for a sign-changing f: the non-negative one is FlexAttention's output itself
        return u / (weights[0] + weights[1]).clamp_min(torch.finfo(dtype).tiny)
    u = u * torch.exp(m).unsqueeze(-1)
    if spec.norm == "count":
        u = u / visible_keys(torch.arange(sizes.seq_len, device=u.device), dtype)[:, None]
    return u
