"""Stick-breaking attention, as an attnlab plugin (reference form only).

Tan, Shen, Ren, Courville and Panda, "Scaling Stick-Breaking Attention: An Efficient Implementation and In-depth
Study", ICLR 2025 (arXiv 2410.17980). No softmax and no positional encoding: each query breaks a stick, nearest
key first,

    beta_ij = sigmoid(q_i . k_j / sqrt(d)),     A_ij = beta_ij * prod_{j<k<i} (1 - beta_ik)     (j < i)

so a key's weight depends on every key between it and the query (not a score_mod). Choices
(docs/plugins.md#stick-breaking): a token does not break the stick over itself (the authors' default,
``attend_current=False``), and the stick left over, ``1 - sum_{j<i} A_ij = prod_{j<i} (1 - beta_ij)``, goes to the
token itself (their ``o + rem * v_i``): ``A_ii`` is that remainder, so every row sums to 1 (row 0 is all on
itself). Computed in log space: ``log beta = logsigmoid(s)``, ``log(1 - beta) = logsigmoid(-s)``, and the product
over the keys between as an exclusive reverse cumulative sum along the row. The platform runs it over blocks of
query rows, so 16x windows fit in memory. Written against the public plugin API only.
"""

import math

import torch
import torch.nn.functional as F

from attnlab.attention.plugin import Variant


def reference(q, k, rows, ctx):
    s = q @ k.transpose(-1, -2) / math.sqrt(ctx.head_dim) + ctx.alibi(rows.h, rows.i, rows.j)
    earlier = rows.j < rows.i  # (R, K): the keys the stick is broken over
    log_keep = F.logsigmoid(-s).masked_fill(~earlier, 0.0)  # log(1 - beta_ij), 0 elsewhere
    # sum_{k >= j} log(1 - beta_ik), then shifted by one key: sum_{k > j} (no subtraction, no cancellation)
    suffix = torch.flip(torch.cumsum(torch.flip(log_keep, [-1]), dim=-1), [-1])
    after = torch.cat([suffix[..., 1:], torch.zeros_like(suffix[..., :1])], dim=-1)
    log_a = torch.where(earlier, F.logsigmoid(s) + after, float("-inf"))
    log_a = torch.where(rows.j == rows.i, suffix[..., :1], log_a)  # the remainder prod_{j<i} (1 - beta_ij)
    return torch.exp(log_a)


VARIANTS = [Variant(name="stickbreaking",
                    source="Stick-breaking attention (Tan et al., ICLR 2025, arXiv 2410.17980)",
                    reference=reference, normalised=True)]
