"""Scalable-Softmax (SSMax) with its learned per-head s, as an attnlab plugin.

Nakanishi, "Scalable-Softmax Is Superior for Attention" (arXiv 2501.19399, 2025). The logits of query row i are
multiplied by ``s_h * ln(n)`` with n the number of keys the row sees (``N_i = i + 1`` under the causal mask):

    A_i = softmax_j( s_h * ln(N_i) * q_i . k_j / sqrt(d) )

with one learned s per head and layer. The built-in ``softmax_logn`` is this with s fixed at 1. Choices
(docs/plugins.md#scalable-softmax): every s starts at 0.43, the value the paper shows SSMax with (its Figure 1);
the fused form is a FlexAttention score_mod reading s as a captured buffer (so ALiBi and the two-pass sharpening
stay fused; on a GPU the gradient of s is then summed with atomic adds, not bitwise reproducible). Written against
the public plugin API only.
"""

import math

import torch
import torch.nn as nn

from attnlab.attention.plugin import Variant

S_INIT = 0.43


def params(shape):
    layer = nn.Module()
    layer.s = nn.Parameter(torch.full((shape.n_head,), S_INIT))  # state_dict: blocks.N.attn.plugin.s
    return layer


def prepare(x, layer, shape):
    return {"s": layer.s}  # (H,): read by both forms


def reference(q, k, rows, ctx):
    s = ctx.state["s"].view(-1, 1, 1)  # (H, 1, 1)
    logits = s * torch.log(rows.n) * (q @ k.transpose(-1, -2)) / math.sqrt(ctx.head_dim)
    logits = logits + ctx.alibi(rows.h, rows.i, rows.j)
    return torch.softmax(logits.masked_fill(~rows.visible, float("-inf")), dim=-1)


def log_score(score, b, h, q_idx, kv_idx, ctx):
    scale = ctx.state["s"][h] * torch.log(ctx.visible_keys(q_idx)) / math.sqrt(ctx.head_dim)
    return scale * score + ctx.alibi(h, q_idx, kv_idx)


VARIANTS = [Variant(name="ssmax", source="Scalable-Softmax with a learned s per head (Nakanishi 2025, "
                                         "arXiv 2501.19399)",
                    reference=reference, log_score=log_score, params=params, prepare=prepare, normalised=True)]
