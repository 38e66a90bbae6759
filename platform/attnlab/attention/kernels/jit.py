"""The Triton kernels of the ``triton`` backend, in pure ``tl`` (Triton's interpreter runs them on CPU tensors).

Five kernels per layer for a sharpened first stage (docs/attention.md#the-triton-kernels has the derivation):

- ``stats_kernel`` (K1): one pass over the keys without V: each row's normaliser and the largest weight, hence
  the row's sharpening scale ``1 / m_i`` (0 for a row without mass).
- ``sharpened_fwd_kernel`` (K2): with the row statistics known, the sharpened weights ``(relu(N_i A_ij - O_i) /
  m_i)^p`` need no online rescale; the same loop sums ``U_i`` (weights ``P_ij / r_ij``) for the backward.
- ``plain_fwd_kernel``: the first stage alone (LSSA, softmax): one pass, online rescale only for ``exp``.
- ``preprocess_kernel`` (K3): ``delta_i = dO_i . O_i`` and the gradient of the normaliser, ``G_i``, from ``U_i``.
- ``dq_kernel`` (K4) and ``dkdv_kernel`` (K5): each owns its rows or its columns and sums over the other
  axis: no atomics, so the same step gives the same gradients bit for bit.

Every kernel reads q, k, v raw, through strides: QK-norm multiplies the scores by ``1/|q_i|`` and ``1/|k_j|`` in
float32 inside the kernel, and the gradients of q and k have their radial component removed there. Scores are kept
in base 2 (``t = s log2 e``), softplus as ``softplus(s) / ln 2`` (the factor cancels in the row's normalisation).
Only tiles on the diagonal are masked; the others are wholly visible. ``FAST`` (a GPU) takes ``log2`` from the
special-function unit (``lg2.approx``: one instruction where ``tl.log2`` is about thirty); the interpreter, which has
no libdevice, runs the ``tl.log2`` twin (``FAST=False``). Nothing here imports torch or attnlab; the launches, the
operators and the autograd are ``ops.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

LOG2E = tl.constexpr(1.4426950408889634)
# log2(1 + e) for e below this is the series e (1 - e / 2) log2(e) (relative error < e^2 / 3): log2 of 1 + e loses
# the digits of a small e (the interpreter's twin; lg2.approx's absolute error, 2^-22, is below a weight's rounding).
SMALL_E = tl.constexpr(1.0 / 1024)
# QK-norm divides by max(|x|, eps), as F.normalize does.
NORM_EPS = tl.constexpr(1e-12)
# attention.spec.SHARPEN_EXEMPT_ROWS: rows 0-2 have no offset O_i.
EXEMPT_ROWS = tl.constexpr(3)
# attention.dense.sharpen_tolerance(float32): a row whose largest N_i A_ij - O_i is no more has no mass.
MASS_TOL = tl.constexpr(256 * 1.1920928955078125e-07)

PHI_EXP = 0
PHI_SOFTPLUS = 1
PHI_SIGMOID = 2


@triton.jit
def _log2(x, FAST: tl.constexpr):
    if FAST:
        y = libdevice.fast_log2f(x)
    else:
        y = tl.log2(x)
    return y


@triton.jit
def _phi(t, PHI: tl.constexpr, FAST: tl.constexpr):
    """``(f, f')`` of a base-2 score ``t = s log2 e``, float32: ``exp`` (``t`` less the row maximum), softplus in
    base 2 (``softplus(s) / ln 2``; its derivative ``sigmoid(s)``, the caller multiplies by ``log2 e``), sigmoid."""
    if PHI == 0:
        f = tl.exp2(t)
        fp = f
    elif PHI == 1:
        e = tl.exp2(-tl.abs(t))
        if FAST:
            lp = _log2(1.0 + e, FAST)
        else:
            lp = tl.where(e < SMALL_E, e * (1.0 - 0.5 * e) * LOG2E, tl.log2(1.0 + e))
        f = tl.maximum(t, 0.0) + lp
        r = 1.0 / (1.0 + e)
        fp = tl.where(t >= 0.0, r, e * r)
    else:
        e = tl.exp2(-tl.abs(t))
        r = 1.0 / (1.0 + e)
        f = tl.where(t >= 0.0, r, e * r)
        fp = f * (1.0 - f)
    return f, fp


@triton.jit
def _power(t, e_float, e_int, use_int, FAST: tl.constexpr):
    """``t ** e`` for ``t >= 0``: by multiplication when ``use_int`` (``e_int`` < 32; the branches are on the
    exponent's bits, the same for every element, so ``t**15`` costs six multiplications), else ``exp2(e log2 t)``."""
    if use_int:
        result = tl.full(t.shape, 1.0, tl.float32)
        base = t
        for bit in tl.static_range(5):
            if ((e_int >> bit) & 1) != 0:
                result = result * base
            if (e_int >> (bit + 1)) != 0:
                base = base * base
    else:
        result = tl.exp2(e_float * _log2(tl.maximum(t, 1e-30), FAST))  # callers mask t = 0
    return result


@triton.jit
def _load_power(p_ptr):
    """The power ``p`` (a float32 scalar in memory, so a new ``p`` compiles nothing) and its integer form."""
    p = tl.load(p_ptr)
    p_int = p.to(tl.int32)
    use_int = (p_int.to(tl.float32) == p) & (p_int < 32)
    return p, p_int, use_int


@triton.jit
def _program(H):
    """``(tile, bh, b, h)``: this program's tile along axis 0 and its (batch, head) pair along axis 1."""
    bh = tl.program_id(1)
    return tl.program_id(0), bh, bh // H, bh % H


@triton.jit
def _rows_tile(base, rows, dims, st, sd, T, D, MASK_T: tl.constexpr = True):
    """A ``(rows, dims)`` tile of a ``(T, D)`` matrix at ``base`` with strides ``(st, sd)``, 0 outside it
    (``MASK_T=False``: every row is below T)."""
    if MASK_T:
        mask = (rows[:, None] < T) & (dims[None, :] < D)
    else:
        mask = dims[None, :] < D
    return tl.load(base + rows[:, None] * st + dims[None, :] * sd, mask=mask, other=0.0)


@triton.jit
def _cols_tile(base, cols, dims, st, sd, T, D, MASK_T: tl.constexpr = True):
    """The same matrix's ``(dims, cols)`` tile: rows ``cols`` of it, transposed."""
    if MASK_T:
        mask = (cols[None, :] < T) & (dims[:, None] < D)
    else:
        mask = dims[:, None] < D
    return tl.load(base + cols[None, :] * st + dims[:, None] * sd, mask=mask, other=0.0)


@triton.jit
def _row_factor(FACTORS, bh, rows, T):
    """``scale_i`` (times ``1/|q_i|`` with QK-norm) of a tile's rows: ``FACTORS[0, bh, i]``, computed once per call
    (``ops.factors``). The scores are ``z_ij * row_i * col_j`` with ``z = q . k``."""
    return tl.load(FACTORS + bh * T + rows, mask=rows < T, other=0.0)


@triton.jit
def _col_factor(FACTORS, bh, cols, T, BN: tl.constexpr, QK_NORM: tl.constexpr):
    """``1/|k_j|`` of a tile's keys (``FACTORS[1, bh, j]``), or 1 without QK-norm."""
    if QK_NORM:
        fac = tl.load(FACTORS + (tl.num_programs(1) + bh) * T + cols, mask=cols < T, other=0.0)
    else:
        fac = tl.full([BN], 1.0, tl.float32)
    return fac


@triton.jit
def _scores(q, k_t, row_t, col_fac, rows, cols, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """The base-2 scores of a tile, ``-inf`` above the diagonal (``MASKED``: a tile the diagonal crosses; keys past
    T are above it for every real row, and the rows past T are never stored)."""
    t = tl.dot(q, k_t, input_precision=PRECISION) * row_t[:, None] * col_fac[None, :]
    if MASKED:
        t = tl.where(cols[None, :] <= rows[:, None], t, float("-inf"))
    return t


@triton.jit
def _weights(t, ref, inv_den, n, offset, inv_m, W, p, p_int, use_int, PHI: tl.constexpr, SHARPEN: tl.constexpr,
             FAST: tl.constexpr):
    """``(P, P / r, A, f')`` of a tile: the output weights, the sharpened ``P_ij / r_ij`` (0 where ``r_ij = 0`` and
    on rows without mass), the first stage's ``A_ij`` and ``f'`` (per unit of ``s``, before the row's ``1/Z``).
    Entries above the diagonal (``t = -inf``) are 0 in all four."""
    if PHI == 0:
        f, fp = _phi(t - ref[:, None], PHI, FAST)
    else:
        f, fp = _phi(t, PHI, FAST)
    a = f * inv_den[:, None]
    if SHARPEN:
        mass = inv_m > 0.0
        r = tl.maximum(n[:, None] * a - offset[:, None], 0.0)
        x = r * inv_m[:, None]
        x_pm1 = _power(x, p - 1.0, p_int - 1, use_int, FAST)
        live = mass[:, None] & (r > 0.0)
        pr = tl.where(live, x_pm1 * (inv_m / W)[:, None], 0.0)
        prob = tl.where(mass[:, None], tl.where(live, x_pm1 * x, 0.0) / W[:, None], a)
    else:
        pr = a * 0.0
        prob = a
    return prob, pr, a, fp


@triton.jit
def _stats_tile(q, k_t, row_t, col_fac, rows, cols, m, z, MASKED: tl.constexpr, PHI: tl.constexpr,
                PRECISION: tl.constexpr, FAST: tl.constexpr):
    t = _scores(q, k_t, row_t, col_fac, rows, cols, MASKED, PRECISION)
    m_new = tl.maximum(m, tl.max(t, 1))
    if PHI == 0:
        z = z * tl.exp2(m - m_new) + tl.sum(tl.exp2(t - m_new[:, None]), 1)
    else:
        f, _ = _phi(t, PHI, FAST)
        z += tl.sum(f, 1)
    return m_new, z


@triton.jit
def stats_kernel(Q, K, STATS, sqb, sqh, sqt, sqd, skb, skh, skt, skd, H, T, D, FACTORS,
                 QK_NORM: tl.constexpr, PHI: tl.constexpr, PRECISION: tl.constexpr,
                 FAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    """K1: per row, the first stage's reference (the row maximum of ``t`` for ``exp``, else 0), ``1 / Z_i`` and the
    sharpening scale ``1 / m_i`` (0 without mass): ``STATS[0..2, bh, i]``."""
    pid_m, bh, b, h = _program(H)
    rows = pid_m * BM + tl.arange(0, BM)
    dims = tl.arange(0, BD)
    keep = rows < T
    q = _rows_tile(Q + b * sqb + h * sqh, rows, dims, sqt, sqd, T, D)
    row_t = _row_factor(FACTORS, bh, rows, T) * LOG2E
    m = tl.full([BM], float("-inf"), tl.float32)
    z = tl.zeros([BM], dtype=tl.float32)
    k_base = K + b * skb + h * skh
    diagonal = (pid_m * BM // BN) * BN
    for start in range(0, diagonal, BN):
        cols = start + tl.arange(0, BN)
        k_t = _cols_tile(k_base, cols, dims, skt, skd, T, D, False)
        col_fac = _col_factor(FACTORS, bh, cols, T, BN, QK_NORM)
        m, z = _stats_tile(q, k_t, row_t, col_fac, rows, cols, m, z, False, PHI, PRECISION, FAST)
    for start in range(diagonal, (pid_m + 1) * BM, BN):
        cols = start + tl.arange(0, BN)
        k_t = _cols_tile(k_base, cols, dims, skt, skd, T, D)
        col_fac = _col_factor(FACTORS, bh, cols, T, BN, QK_NORM)
        m, z = _stats_tile(q, k_t, row_t, col_fac, rows, cols, m, z, True, PHI, PRECISION, FAST)
    z = tl.where(keep, z, 1.0)
    n = (rows + 1).to(tl.float32)
    offset = tl.where(rows >= EXEMPT_ROWS, 1.0, 0.0)
    if PHI == 0:
        ref = m
        max_a = 1.0 / z
    else:
        ref = tl.zeros([BM], dtype=tl.float32)
        f_max, _ = _phi(m, PHI, FAST)
        max_a = f_max / z
    excess = n * max_a - offset
    inv_m = tl.where(excess > MASS_TOL, 1.0 / tl.maximum(excess, MASS_TOL), 0.0)
    base = STATS + bh * T + rows
    stride = tl.num_programs(1) * T
    tl.store(base, ref, mask=keep)
    tl.store(base + stride, 1.0 / z, mask=keep)
    tl.store(base + 2 * stride, inv_m, mask=keep)


@triton.jit
def _output_tile(q, k_t, v, row_t, col_fac, rows, cols, ref, inv_den, n, offset, inv_m, ones, p, p_int, use_int,
                 acc, acc_u, w_sum, s_sum, MASKED: tl.constexpr, PHI: tl.constexpr, PRECISION: tl.constexpr,
                 WITH_U: tl.constexpr, FAST: tl.constexpr):
    t = _scores(q, k_t, row_t, col_fac, rows, cols, MASKED, PRECISION)
    # W = 1 here: the weights before the row's division by their sum
    w, pr, _, _ = _weights(t, ref, inv_den, n, offset, inv_m, ones, p, p_int, use_int, PHI, True, FAST)
    acc += tl.dot(w.to(v.dtype), v, input_precision=PRECISION)
    w_sum += tl.sum(w, 1)
    if WITH_U:
        acc_u += tl.dot(pr.to(v.dtype), v, input_precision=PRECISION)
        s_sum += tl.sum(pr, 1)
    return acc, acc_u, w_sum, s_sum


@triton.jit
def sharpened_fwd_kernel(Q, K, V, O, U, STATS, P_PTR, sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd,
                         sob, soh, sot, sod, H, T, D, DV, FACTORS,
                         QK_NORM: tl.constexpr, PHI: tl.constexpr,
                         PRECISION: tl.constexpr, WITH_U: tl.constexpr, FAST: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
    """K2: ``O_i = sum_j P_ij v_j`` with the statistics of K1; ``U_i = sum_j (P_ij / r_ij) v_j`` (``WITH_U``, for
    the backward) and the row's ``W_i`` and ``S_i = sum_j P_ij / r_ij`` into ``STATS[3..4]``."""
    pid_m, bh, b, h = _program(H)
    rows = pid_m * BM + tl.arange(0, BM)
    dims = tl.arange(0, BD)
    vdims = tl.arange(0, BDV)
    keep = rows < T
    q = _rows_tile(Q + b * sqb + h * sqh, rows, dims, sqt, sqd, T, D)
    row_t = _row_factor(FACTORS, bh, rows, T) * LOG2E
    stride = tl.num_programs(1) * T
    base = STATS + bh * T + rows
    ref = tl.load(base, mask=keep, other=0.0)
    inv_den = tl.load(base + stride, mask=keep, other=0.0)
    inv_m = tl.load(base + 2 * stride, mask=keep, other=0.0)
    p, p_int, use_int = _load_power(P_PTR)
    n = (rows + 1).to(tl.float32)
    offset = tl.where(rows >= EXEMPT_ROWS, 1.0, 0.0)
    ones = tl.full([BM], 1.0, tl.float32)
    acc = tl.zeros([BM, BDV], dtype=tl.float32)
    acc_u = tl.zeros([BM, BDV], dtype=tl.float32)
    w_sum = tl.zeros([BM], dtype=tl.float32)
    s_sum = tl.zeros([BM], dtype=tl.float32)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    diagonal = (pid_m * BM // BN) * BN
    for start in range(0, diagonal, BN):
        cols = start + tl.arange(0, BN)
        k_t = _cols_tile(k_base, cols, dims, skt, skd, T, D, False)
        v = _rows_tile(v_base, cols, vdims, svt, svd, T, DV, False)
        col_fac = _col_factor(FACTORS, bh, cols, T, BN, QK_NORM)
        acc, acc_u, w_sum, s_sum = _output_tile(q, k_t, v, row_t, col_fac, rows, cols, ref, inv_den, n, offset, inv_m,
                                                ones, p, p_int, use_int, acc, acc_u, w_sum, s_sum, False, PHI,
                                                PRECISION, WITH_U, FAST)
    for start in range(diagonal, (pid_m + 1) * BM, BN):
        cols = start + tl.arange(0, BN)
        k_t = _cols_tile(k_base, cols, dims, skt, skd, T, D)
        v = _rows_tile(v_base, cols, vdims, svt, svd, T, DV)
        col_fac = _col_factor(FACTORS, bh, cols, T, BN, QK_NORM)
        acc, acc_u, w_sum, s_sum = _output_tile(q, k_t, v, row_t, col_fac, rows, cols, ref, inv_den, n, offset, inv_m,
                                                ones, p, p_int, use_int, acc, acc_u, w_sum, s_sum, True, PHI, PRECISION,
                                                WITH_U, FAST)
    mass = inv_m > 0.0
    W = tl.where(mass, w_sum, 1.0)
    out = acc / W[:, None]
    o_ptrs = O + b * sob + h * soh + rows[:, None] * sot + vdims[None, :] * sod
    o_mask = keep[:, None] & (vdims[None, :] < DV)
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=o_mask)
    tl.store(base + 3 * stride, W, mask=keep)
    if WITH_U:
        u_ptrs = U + b * sob + h * soh + rows[:, None] * sot + vdims[None, :] * sod
        tl.store(u_ptrs, (acc_u / W[:, None]).to(U.dtype.element_ty), mask=o_mask)
        tl.store(base + 4 * stride, s_sum / W, mask=keep)


@triton.jit
def _plain_tile(q, k_t, v, row_t, col_fac, rows, cols, m, z, acc, MASKED: tl.constexpr, PHI: tl.constexpr,
                PRECISION: tl.constexpr, FAST: tl.constexpr):
    t = _scores(q, k_t, row_t, col_fac, rows, cols, MASKED, PRECISION)
    if PHI == 0:
        m_new = tl.maximum(m, tl.max(t, 1))
        alpha = tl.exp2(m - m_new)
        f = tl.exp2(t - m_new[:, None])
        z = z * alpha
        acc = acc * alpha[:, None]
        m = m_new
    else:
        f, _ = _phi(t, PHI, FAST)
    z += tl.sum(f, 1)
    acc += tl.dot(f.to(v.dtype), v, input_precision=PRECISION)
    return m, z, acc


@triton.jit
def plain_fwd_kernel(Q, K, V, O, STATS, sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd,
                     sob, soh, sot, sod, H, T, D, DV, FACTORS,
                     QK_NORM: tl.constexpr, PHI: tl.constexpr, PRECISION: tl.constexpr,
                     FAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
    """The first stage alone, ``O_i = sum_j A_ij v_j``, in one pass (an online rescale for ``exp`` only:
    softplus and sigmoid of bounded scores need none); the reference and ``1 / Z_i`` into ``STATS[0..1]``."""
    pid_m, bh, b, h = _program(H)
    rows = pid_m * BM + tl.arange(0, BM)
    dims = tl.arange(0, BD)
    vdims = tl.arange(0, BDV)
    keep = rows < T
    q = _rows_tile(Q + b * sqb + h * sqh, rows, dims, sqt, sqd, T, D)
    row_t = _row_factor(FACTORS, bh, rows, T) * LOG2E
    m = tl.full([BM], float("-inf"), tl.float32)
    z = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BDV], dtype=tl.float32)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    diagonal = (pid_m * BM // BN) * BN
    for start in range(0, diagonal, BN):
        cols = start + tl.arange(0, BN)
        k_t = _cols_tile(k_base, cols, dims, skt, skd, T, D, False)
        v = _rows_tile(v_base, cols, vdims, svt, svd, T, DV, False)
        col_fac = _col_factor(FACTORS, bh, cols, T, BN, QK_NORM)
        m, z, acc = _plain_tile(q, k_t, v, row_t, col_fac, rows, cols, m, z, acc, False, PHI, PRECISION, FAST)
    for start in range(diagonal, (pid_m + 1) * BM, BN):
        cols = start + tl.arange(0, BN)
        k_t = _cols_tile(k_base, cols, dims, skt, skd, T, D)
        v = _rows_tile(v_base, cols, vdims, svt, svd, T, DV)
        col_fac = _col_factor(FACTORS, bh, cols, T, BN, QK_NORM)
        m, z, acc = _plain_tile(q, k_t, v, row_t, col_fac, rows, cols, m, z, acc, True, PHI, PRECISION, FAST)
    z = tl.where(keep, z, 1.0)
    out = acc / z[:, None]
    tl.store(O + b * sob + h * soh + rows[:, None] * sot + vdims[None, :] * sod, out.to(O.dtype.element_ty),
             mask=keep[:, None] & (vdims[None, :] < DV))
    base = STATS + bh * T + rows
    stride = tl.num_programs(1) * T
    if PHI == 0:
        tl.store(base, m, mask=keep)
    else:
        tl.store(base, tl.zeros([BM], dtype=tl.float32), mask=keep)
    tl.store(base + stride, 1.0 / z, mask=keep)


@triton.jit
def preprocess_kernel(O, U, DO, DELTA, G, STATS, P_PTR, sob, soh, sot, sod, sdb, sdh, sdt, sdd, H, T, DV,
                      SHARPEN: tl.constexpr, BM: tl.constexpr, BDV: tl.constexpr):
    """K3: ``delta_i = dO_i . O_i`` and, sharpened, ``G_i = p O_i (dO_i . U_i - delta_i S_i)``: the part of every
    ``dL/dA_ij`` that the row's normaliser ``Z_i`` shares (docs/attention.md#the-triton-kernels)."""
    pid_m, bh, b, h = _program(H)
    rows = pid_m * BM + tl.arange(0, BM)
    vdims = tl.arange(0, BDV)
    keep = rows < T
    o = _rows_tile(O + b * sob + h * soh, rows, vdims, sot, sod, T, DV)
    do = _rows_tile(DO + b * sdb + h * sdh, rows, vdims, sdt, sdd, T, DV)
    do = do.to(tl.float32)
    delta = tl.sum(do * o.to(tl.float32), 1)
    tl.store(DELTA + bh * T + rows, delta, mask=keep)
    if SHARPEN:
        u = _rows_tile(U + b * sob + h * soh, rows, vdims, sot, sod, T, DV)
        stride = tl.num_programs(1) * T
        s_row = tl.load(STATS + 4 * stride + bh * T + rows, mask=keep, other=0.0)
        p = tl.load(P_PTR)
        offset = tl.where(rows >= EXEMPT_ROWS, 1.0, 0.0)
        g = p * offset * (tl.sum(do * u.to(tl.float32), 1) - delta * s_row)
        tl.store(G + bh * T + rows, g, mask=keep)


@triton.jit
def _grad_scores(t, dp, delta, g, ref, inv_den, d_scale, n, offset, inv_m, W, p, p_int, use_int, PHI: tl.constexpr,
                 SHARPEN: tl.constexpr, FAST: tl.constexpr):
    """``(dL/ds, P)`` of a tile: ``f'/Z (N p (dP - delta) P / r - G)`` on rows with mass, ``f'/Z (dP - delta)``
    elsewhere (docs/attention.md#the-triton-kernels); ``d_scale`` is the row's ``1/Z`` in units of ``s``."""
    prob, pr, _, fp = _weights(t, ref, inv_den, n, offset, inv_m, W, p, p_int, use_int, PHI, SHARPEN, FAST)
    diff = dp - delta[:, None]
    if SHARPEN:
        mass = inv_m > 0.0
        term = tl.where(mass[:, None], (n * p)[:, None] * diff * pr - g[:, None], diff)
    else:
        term = diff
    return fp * d_scale[:, None] * term, prob


@triton.jit
def _row_state(STATS, DELTA, G, bh, rows, keep, T, stride, PHI: tl.constexpr, SHARPEN: tl.constexpr):
    """A row tile's statistics for the backward: ``(ref, 1/Z, 1/Z in units of s, delta, G, 1/m, W)``."""
    base = STATS + bh * T + rows
    ref = tl.load(base, mask=keep, other=0.0)
    inv_den = tl.load(base + stride, mask=keep, other=0.0)
    delta = tl.load(DELTA + bh * T + rows, mask=keep, other=0.0)
    if PHI == 1:
        d_scale = inv_den * LOG2E  # d softplus2(s)/ds = sigmoid(s) log2 e
    else:
        d_scale = inv_den
    if SHARPEN:
        inv_m = tl.load(base + 2 * stride, mask=keep, other=0.0)
        W = tl.load(base + 3 * stride, mask=keep, other=1.0)
        g = tl.load(G + bh * T + rows, mask=keep, other=0.0)
    else:
        inv_m = tl.zeros(rows.shape, tl.float32)
        W = tl.full(rows.shape, 1.0, tl.float32)
        g = tl.zeros(rows.shape, tl.float32)
    return ref, inv_den, d_scale, delta, g, inv_m, W


@triton.jit
def _dq_tile(q, do, k_t, v_t, row_t, col_fac, rows, cols, ref, inv_den, d_scale, delta, g, n, offset, inv_m, W, p,
             p_int, use_int, acc, MASKED: tl.constexpr, PHI: tl.constexpr, SHARPEN: tl.constexpr,
             PRECISION: tl.constexpr, FAST: tl.constexpr):
    t = _scores(q, k_t, row_t, col_fac, rows, cols, MASKED, PRECISION)
    dp = tl.dot(do, v_t, input_precision=PRECISION)
    ds, _ = _grad_scores(t, dp, delta, g, ref, inv_den, d_scale, n, offset, inv_m, W, p, p_int, use_int, PHI,
                         SHARPEN, FAST)
    ds = ds * col_fac[None, :]
    return acc + tl.dot(ds.to(k_t.dtype), tl.trans(k_t), input_precision=PRECISION)


@triton.jit
def dq_kernel(Q, K, V, DO, DQ, STATS, DELTA, G, P_PTR, sqb, sqh, sqt, sqd, skb, skh, skt, skd,
              svb, svh, svt, svd, sdb, sdh, sdt, sdd, sgb, sgh, sgt, sgd, H, T, D, DV, FACTORS,
              QK_NORM: tl.constexpr, PHI: tl.constexpr, SHARPEN: tl.constexpr,
              PRECISION: tl.constexpr, FAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
              BDV: tl.constexpr):
    """K4: ``dq_i = scale_i / |q_i| sum_j dL/ds_ij k_j / |k_j|`` over the keys row ``i`` sees, then (QK-norm) its
    component along ``q_i`` removed: the gradient through the normalisation."""
    pid_m, bh, b, h = _program(H)
    rows = pid_m * BM + tl.arange(0, BM)
    dims = tl.arange(0, BD)
    vdims = tl.arange(0, BDV)
    keep = rows < T
    q_mask = keep[:, None] & (dims[None, :] < D)
    q = _rows_tile(Q + b * sqb + h * sqh, rows, dims, sqt, sqd, T, D)
    do = _rows_tile(DO + b * sdb + h * sdh, rows, vdims, sdt, sdd, T, DV)
    row_s = _row_factor(FACTORS, bh, rows, T)
    row_t = row_s * LOG2E
    ref, inv_den, d_scale, delta, g, inv_m, W = _row_state(STATS, DELTA, G, bh, rows, keep, T,
                                                           tl.num_programs(1) * T, PHI, SHARPEN)
    p, p_int, use_int = _load_power(P_PTR)
    n = (rows + 1).to(tl.float32)
    offset = tl.where(rows >= EXEMPT_ROWS, 1.0, 0.0)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    diagonal = (pid_m * BM // BN) * BN
    for start in range(0, diagonal, BN):
        cols = start + tl.arange(0, BN)
        k_t = _cols_tile(k_base, cols, dims, skt, skd, T, D, False)
        v_t = _cols_tile(v_base, cols, vdims, svt, svd, T, DV, False)
        col_fac = _col_factor(FACTORS, bh, cols, T, BN, QK_NORM)
        acc = _dq_tile(q, do, k_t, v_t, row_t, col_fac, rows, cols, ref, inv_den, d_scale, delta, g, n, offset, inv_m,
                       W, p, p_int, use_int, acc, False, PHI, SHARPEN, PRECISION, FAST)
    for start in range(diagonal, (pid_m + 1) * BM, BN):
        cols = start + tl.arange(0, BN)
        k_t = _cols_tile(k_base, cols, dims, skt, skd, T, D)
        v_t = _cols_tile(v_base, cols, vdims, svt, svd, T, DV)
        col_fac = _col_factor(FACTORS, bh, cols, T, BN, QK_NORM)
        acc = _dq_tile(q, do, k_t, v_t, row_t, col_fac, rows, cols, ref, inv_den, d_scale, delta, g, n, offset, inv_m,
                       W, p, p_int, use_int, acc, True, PHI, SHARPEN, PRECISION, FAST)
    dq = acc * row_s[:, None]
    if QK_NORM:
        qf = q.to(tl.float32)
        radial = tl.sum(qf * dq, 1) / tl.maximum(tl.sum(qf * qf, 1), NORM_EPS * NORM_EPS)
        dq = dq - radial[:, None] * qf
    tl.store(DQ + b * sgb + h * sgh + rows[:, None] * sgt + dims[None, :] * sgd, dq.to(DQ.dtype.element_ty),
             mask=q_mask)


@triton.jit
def _dkdv_tile(STATS, DELTA, G, q_base, do_base, bh, rows, dims, vdims, k_t, v_t, col_fac, cols, T, D, DV,
               sqt, sqd, sdt, sdd, stride, FACTORS, p, p_int, use_int, acc_k, acc_v, MASKED: tl.constexpr,
               QK_NORM: tl.constexpr, PHI: tl.constexpr, SHARPEN: tl.constexpr,
               PRECISION: tl.constexpr, FAST: tl.constexpr):
    keep = rows < T
    q = _rows_tile(q_base, rows, dims, sqt, sqd, T, D)
    do = _rows_tile(do_base, rows, vdims, sdt, sdd, T, DV)
    row_s = _row_factor(FACTORS, bh, rows, T)
    ref, inv_den, d_scale, delta, g, inv_m, W = _row_state(STATS, DELTA, G, bh, rows, keep, T, stride, PHI, SHARPEN)
    n = (rows + 1).to(tl.float32)
    offset = tl.where(rows >= EXEMPT_ROWS, 1.0, 0.0)
    t = _scores(q, k_t, row_s * LOG2E, col_fac, rows, cols, MASKED, PRECISION)
    dp = tl.dot(do, v_t, input_precision=PRECISION)
    ds, prob = _grad_scores(t, dp, delta, g, ref, inv_den, d_scale, n, offset, inv_m, W, p, p_int, use_int, PHI,
                            SHARPEN, FAST)
    # (BDV, BM) @ (BM, BN) and (BD, BM) @ (BM, BN): the key axis stays last, as k and v are held
    acc_v += tl.dot(tl.trans(do), prob.to(do.dtype), input_precision=PRECISION)
    ds = ds * row_s[:, None]
    acc_k += tl.dot(tl.trans(q), ds.to(q.dtype), input_precision=PRECISION)
    return acc_k, acc_v


@triton.jit
def dkdv_kernel(Q, K, V, DO, DK, DV_, STATS, DELTA, G, P_PTR, sqb, sqh, sqt, sqd, skb, skh, skt, skd,
                svb, svh, svt, svd, sdb, sdh, sdt, sdd, s1b, s1h, s1t, s1d, s2b, s2h, s2t, s2d, H, T, D, DV, FACTORS,
                QK_NORM: tl.constexpr, PHI: tl.constexpr, SHARPEN: tl.constexpr,
                PRECISION: tl.constexpr, FAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                BDV: tl.constexpr):
    """K5: for the keys ``j`` of one block, ``dv_j = sum_i P_ij dO_i`` and ``dk_j = 1/|k_j| sum_i dL/ds_ij
    scale_i q_i / |q_i|`` over the rows that see them, then (QK-norm) its component along ``k_j`` removed."""
    pid_n, bh, b, h = _program(H)
    cols = pid_n * BN + tl.arange(0, BN)
    dims = tl.arange(0, BD)
    vdims = tl.arange(0, BDV)
    k_mask = (cols[None, :] < T) & (dims[:, None] < D)
    k_t = _cols_tile(K + b * skb + h * skh, cols, dims, skt, skd, T, D)
    v_t = _cols_tile(V + b * svb + h * svh, cols, vdims, svt, svd, T, DV)
    col_fac = _col_factor(FACTORS, bh, cols, T, BN, QK_NORM)
    p, p_int, use_int = _load_power(P_PTR)
    stride = tl.num_programs(1) * T
    acc_k = tl.zeros([BD, BN], dtype=tl.float32)
    acc_v = tl.zeros([BDV, BN], dtype=tl.float32)
    q_base = Q + b * sqb + h * sqh
    do_base = DO + b * sdb + h * sdh
    # row tiles the diagonal crosses, then those wholly below it
    first = (pid_n * BN // BM) * BM
    below = ((pid_n + 1) * BN + BM - 1) // BM * BM
    for start in range(first, below, BM):
        acc_k, acc_v = _dkdv_tile(STATS, DELTA, G, q_base, do_base, bh, start + tl.arange(0, BM), dims,
                                  vdims, k_t, v_t, col_fac, cols, T, D, DV, sqt, sqd, sdt, sdd, stride, FACTORS, p,
                                  p_int, use_int, acc_k, acc_v, True, QK_NORM, PHI, SHARPEN, PRECISION,
                                  FAST)
    for start in range(below, T, BM):
        acc_k, acc_v = _dkdv_tile(STATS, DELTA, G, q_base, do_base, bh, start + tl.arange(0, BM), dims,
                                  vdims, k_t, v_t, col_fac, cols, T, D, DV, sqt, sqd, sdt, sdd, stride, FACTORS, p,
                                  p_int, use_int, acc_k, acc_v, False, QK_NORM, PHI, SHARPEN, PRECISION,
                                  FAST)
    dk = acc_k * col_fac[None, :]
    if QK_NORM:
        kf = k_t.to(tl.float32)
        radial = tl.sum(kf * dk, 0) / tl.maximum(tl.sum(kf * kf, 0), NORM_EPS * NORM_EPS)
        dk = dk - radial[None, :] * kf
    tl.store(DK + b * s1b + h * s1h + cols[None, :] * s1t + dims[:, None] * s1d, dk.to(DK.dtype.element_ty),
             mask=k_mask)
    tl.store(DV_ + b * s2b + h * s2h + cols[None, :] * s2t + vdims[:, None] * s2d, acc_v.to(DV_.dtype.element_ty),
             mask=(cols[None, :] < T) & (vdims[:, None] < DV))
