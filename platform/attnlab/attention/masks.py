"""The causal mask and the per-row key counts N_i for the fused (FlexAttention) path.

This is the single place where the fused path builds its mask and its positions; ``attend`` builds them for
every call, so training and evaluation cannot disagree (a validation pass that forgot its mask was a real bug
elsewhere). The dense reference builds the same two things as tensors in :func:`attnlab.attention.dense.
causal_rows` (``cols <= rows`` and ``rows + 1``); ``tests/test_attention_flex.py`` checks that the two agree
element by element. A new mask (documents, sliding windows) must change both functions together, and
``visible_keys`` must then count the keys the mask leaves visible, not ``q_idx + 1``.

No Ray, no model code, no attention math here.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask


def causal_mask_mod(b, h, q_idx, kv_idx):
    """FlexAttention ``mask_mod``: query row ``i`` sees keys ``j <= i`` (as ``dense.causal_rows``)."""
    return kv_idx <= q_idx


def visible_keys(q_idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """N_i, the number of keys row ``i`` sees under :func:`causal_mask_mod`, as a ``dtype`` tensor."""
    return (q_idx + 1).to(dtype)


def causal_block_mask(seq_len: int, device: torch.device | str) -> BlockMask:
    """The causal :class:`BlockMask` for ``seq_len`` queries and keys on ``device``, built once and cached."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _causal_block_mask(int(seq_len), device)


@functools.lru_cache(maxsize=32)
def _causal_block_mask(seq_len: int, device: torch.device) -> BlockMask:
    # On GPU the builder is compiled so that no (T, T) boolean mask is materialised at 16K tokens.
    return create_block_mask(causal_mask_mod, None, None, seq_len, seq_len, device=device,
                             _compile=device.type == "cuda")
