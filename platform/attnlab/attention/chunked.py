"""Dense attention in row chunks: the one loop, and the one compile guard, of every dense reference.

The built-in dense path (:func:`attnlab.attention.dense.attend_dense`) and a plugin's reference
(:func:`attnlab.attention.plugin.attend_reference`) both compute ``A @ v`` from the weights of blocks of query rows
(rows are independent: a block is exact, its absolute row indices given). :func:`attend_chunked` is that loop for
both; what differs is the function giving a block's weights and how many ``(rows x keys)`` temporaries it is counted
as (``temporaries``: the memory of one row). No Ray, no model code, no attention math here.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

# Query rows are processed in chunks once the weights and temporaries of one chunk would exceed this many bytes.
DEFAULT_CHUNK_BYTES = 256 * 1024**2


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Weights are computed in float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def autocast_off(device: torch.device):
    """Autocast switched off (weights are computed in float32 or float64); meta tensors (the memory plan) as CPU
    ones (``torch.autocast`` has no meta device)."""
    return torch.autocast(device_type="cpu" if device.type == "meta" else device.type, enabled=False)


def row_bytes(q: torch.Tensor, temporaries: int) -> int:
    """Bytes of one query row's weights and temporaries (``temporaries`` tensors of ``(rows x keys)``), all heads and
    batch entries, in the compute dtype."""
    return _row_bytes(math.prod(q.shape[:-2]), q.shape[-2], q.dtype, temporaries)


def chunk_rows(q: torch.Tensor, chunk_bytes: int, temporaries: int) -> int:
    """How many query rows one chunk holds within ``chunk_bytes`` (at least 1, at most T)."""
    return rows_per_chunk(math.prod(q.shape[:-2]), q.shape[-2], q.dtype, chunk_bytes, temporaries)


def rows_per_chunk(batch: int, seq_len: int, dtype: torch.dtype, chunk_bytes: int, temporaries: int) -> int:
    """:func:`chunk_rows` from sizes alone (``batch``: every leading axis, heads included): for a memory plan."""
    return max(1, min(seq_len, chunk_bytes // _row_bytes(batch, seq_len, dtype, temporaries)))


def _row_bytes(batch: int, seq_len: int, dtype: torch.dtype, temporaries: int) -> int:
    return max(1, batch * seq_len * torch.finfo(compute_dtype(dtype)).bits // 8 * temporaries)


def attend_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec, weights: Callable, *, temporaries: int,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES, **kwargs) -> torch.Tensor:
    """``A @ v`` (and ``spec``'s output LayerNorm, if it has one) with query rows in memory-bounded chunks, in v's
    dtype; computed in float32 (float64 for float64 inputs) whatever autocast is active.

    ``weights(q_rows, k_keys, spec, row_start=r0, seq_len=T, **kwargs)`` gives the causal weights of the query rows
    ``r0 ..`` over the keys ``0 .. K - 1`` (the last row + 1) in the compute dtype; ``q``, ``k`` and ``v`` are upcast
    once, before the loop.

    Under ``torch.compile`` the row-chunk loop is not traced chunk by chunk (one graph body per chunk: dozens per
    layer at B=64, T=1024): with gradients the whole sequence is one chunk, since autograd saves every chunk's weights
    for the backward anyway and chunking bounds nothing there; without gradients (long evaluation windows, where
    chunking is what bounds memory) a sequence that needs several chunks runs as one ``torch.compiler.disable``d
    region, eagerly and chunked, between two graphs.
    """
    if torch.compiler.is_compiling():
        if torch.is_grad_enabled():
            chunk_bytes = max(chunk_bytes, row_bytes(q, temporaries) * q.shape[-2])
        elif chunk_rows(q, chunk_bytes, temporaries) < q.shape[-2]:
            return _attend_chunked_eager(q, k, v, spec, weights, temporaries, chunk_bytes, kwargs)
    return _attend_chunked(q, k, v, spec, weights, temporaries, chunk_bytes, kwargs)


def _attend_chunked(q, k, v, spec, weights: Callable, temporaries: int, chunk_bytes: int,
                    kwargs: dict) -> torch.Tensor:
    T = q.shape[-2]
    dtype = compute_dtype(q.dtype)
    chunk = chunk_rows(q, chunk_bytes, temporaries)
    with autocast_off(q.device):
        q, k, vv = q.to(dtype), k.to(dtype), v.to(dtype)
        outs = []
        for r0 in range(0, T, chunk):
            r1 = min(T, r0 + chunk)
            a = weights(q[..., r0:r1, :], k[..., :r1, :], spec, row_start=r0, seq_len=T, **kwargs)
            outs.append(a @ vv[..., :r1, :])
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
        if spec.out_norm == "layernorm":
            out = F.layer_norm(out, out.shape[-1:])
    return out.to(v.dtype)


# Under torch.compile without gradients, a multi-chunk sequence: eager, chunked, outside the graph. torch's lazy form
# of ``torch.compiler.disable``: importing torch._dynamo costs every process about 2 s (a CLI call, a Ray worker) that
# never compiles.
_attend_chunked_eager = torch._disable_dynamo(_attend_chunked)
