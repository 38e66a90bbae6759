"""The causal mask and the per-row key counts N_i, for the dense reference and the fused path alike.

This is the single place where masks and positions are built: ``causal_mask_mod`` and ``visible_keys`` serve
FlexAttention directly and, through :func:`causal_rows`, the dense reference; ``attend`` builds them for every
call, so training and evaluation cannot disagree (a validation pass that forgot its mask was a real bug
elsewhere). A new mask (documents, sliding windows) changes ``causal_mask_mod``, and ``visible_keys`` must then
count the keys the mask leaves visible, not ``q_idx + 1``.

The ALiBi position bias (Press et al. 2022) lives here too, as positions do: :func:`alibi_slopes` is the one
definition of the slopes, and :func:`alibi_bias` the bias ``-m_h * (i - j)`` that the dense reference and the
FlexAttention ``score_mod`` both add.

No Ray, no model code, no attention math here.
"""

from __future__ import annotations

import functools
import math

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask


def causal_mask_mod(b, h, q_idx, kv_idx):
    """FlexAttention ``mask_mod``: query row ``i`` sees keys ``j <= i`` (as ``dense.causal_rows``)."""
    return kv_idx <= q_idx


def visible_keys(q_idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """N_i, the number of keys row ``i`` sees under :func:`causal_mask_mod`, as a ``dtype`` tensor."""
    return (q_idx + 1).to(dtype)


def causal_rows(row_start: int, n_rows: int, n_keys: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices ``i`` (shape ``(R, 1)``) of query rows ``row_start ..`` and their visibility mask over keys
    ``0 .. n_keys - 1`` (shape ``(R, K)``), as dense tensors for the reference implementation."""
    rows = torch.arange(row_start, row_start + n_rows, device=device).unsqueeze(-1)
    cols = torch.arange(n_keys, device=device).unsqueeze(0)
    return rows, causal_mask_mod(None, None, rows, cols)


def causal_block_mask(seq_len: int, device: torch.device | str) -> BlockMask:
    """The causal :class:`BlockMask` for ``seq_len`` queries and keys on ``device``, built once and cached
    (inside a compiled model: built by the compiled graph)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if torch.compiler.is_compiling():
        # Inside a compiled model the enclosing graph builds the mask (once per specialisation of the graph;
        # a cache lookup cannot be traced): the same mask, computed by the compiled code.
        return create_block_mask(causal_mask_mod, None, None, seq_len, seq_len, device=device)
    return _causal_block_mask(int(seq_len), device)


@functools.lru_cache(maxsize=32)
def _causal_block_mask(seq_len: int, device: torch.device) -> BlockMask:
    # On GPU the builder is compiled so that no (T, T) boolean mask is materialised at 16K tokens.
    return create_block_mask(causal_mask_mod, None, None, seq_len, seq_len, device=device,
                             _compile=device.type == "cuda")


# --- ALiBi (docs/attention.md#alibi) --------------------------------------------------------------------------

def alibi_slope(head: torch.Tensor, n_head: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ALiBi slope ``m_h`` of the 0-based head index ``head`` (a tensor, any shape) among ``n_head`` heads.

    Press et al. 2022: for ``H`` a power of two, ``m_h = 2^(-8 h / H)`` for ``h = 1..H`` (H = 8: 1/2, 1/4, ...,
    1/256). Otherwise, with ``c`` the largest power of two below ``H``: the ``c`` slopes of ``c`` heads, then
    every other slope of ``2c`` heads (``2^(-8 (2j + 1) / (2c))``, j = 0..H-c-1), as the paper's code does.
    Written with tensor ops so that a FlexAttention ``score_mod`` computes it from its head index.
    """
    if isinstance(n_head, bool) or not isinstance(n_head, int) or n_head < 1:
        raise ValueError(f"n_head={n_head!r} is not allowed: ALiBi needs a positive number of heads")
    c = 2 ** int(math.floor(math.log2(n_head)))
    h = head.to(dtype)
    exponent = torch.where(h < c, -8.0 * (h + 1.0) / c, -4.0 * (2.0 * (h - c) + 1.0) / c)
    return torch.exp2(exponent)


def alibi_slopes(n_head: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """The ``(n_head,)`` ALiBi slopes ``m_1 .. m_H`` (see :func:`alibi_slope`)."""
    return alibi_slope(torch.arange(n_head, device=device), n_head, dtype)


def alibi_bias(head: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, n_head: int,
               dtype: torch.dtype) -> torch.Tensor:
    """``-m_h * (i - j)``: the ALiBi bias of query ``i = q_idx`` and key ``j = kv_idx`` in head ``h`` (broadcast)."""
    return -alibi_slope(head, n_head, dtype) * (q_idx - kv_idx).to(dtype)
