"""Forgetting Transformer (FoX): softmax attention with a data-dependent forget gate, as an attnlab plugin.

Lin, Nikishin, He and Courville, "Forgetting Transformer: Softmax Attention with a Forget Gate", ICLR 2025
(arXiv 2503.02130). Each head h has a forget gate per token, ``f_t = sigmoid(w_h . x_t + b_h)`` on the attention
layer's input ``x``, and the score of query i and key j gets the log of the gates in between:

    S_ij = q_i . k_j / sqrt(d) + D_ij,    D_ij = sum_{l=j+1..i} log f_l = c_i - c_j,    c = cumsum(log f)

then a causal softmax. The paper runs it without RoPE (``position: nope``). Choices (docs/plugins.md#fox): the gate
is one ``Linear(n_embd, n_head)`` with bias per layer, initialised as the paper's model initialises every linear
layer (weights N(0, 0.02), bias 0: every gate starts near 1/2); ``log f`` is a log-sigmoid in float32 (or better).
Written against the public plugin API only.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlab.attention.plugin import Variant


def params(shape):
    gate = nn.Linear(shape.n_embd, shape.n_head)  # w_h, b_h of every head
    nn.init.normal_(gate.weight, mean=0.0, std=0.02)
    nn.init.zeros_(gate.bias)
    return gate


def prepare(x, gate, shape):
    logits = gate(x)  # (B, T, H)
    log_f = F.logsigmoid(logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits)
    c = torch.cumsum(log_f, dim=1).transpose(1, 2)  # (B, H, T): c_t = sum_{l <= t} log f_l
    # c_i enters every score of row i alike, so the softmax cancels it (its gradient is 0): the score_mod reads it
    # from a detached copy, since FlexAttention's lowering refuses two reads of one tensor that takes gradients.
    return {"c": c, "c_rows": c.detach()}


def reference(q, k, rows, ctx):
    c = ctx.state["c"]
    s = q @ k.transpose(-1, -2) / math.sqrt(ctx.head_dim) + ctx.alibi(rows.h, rows.i, rows.j)
    s = s + c[..., rows.i] - c[..., rows.j]  # D_ij = c_i - c_j
    return torch.softmax(s.masked_fill(~rows.visible, float("-inf")), dim=-1)


def log_score(score, b, h, q_idx, kv_idx, ctx):
    d_ij = ctx.state["c_rows"][b, h, q_idx] - ctx.state["c"][b, h, kv_idx]
    return score / math.sqrt(ctx.head_dim) + ctx.alibi(h, q_idx, kv_idx) + d_ij


VARIANTS = [Variant(name="fox", source="Forgetting Transformer (Lin et al., ICLR 2025, arXiv 2503.02130)",
                    reference=reference, log_score=log_score, params=params, prepare=prepare, normalised=True)]
