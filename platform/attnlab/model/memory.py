"""Per-GPU peak memory of a training step and of evaluation, estimated without a GPU.

Owns the memory plan: an analytic count of what is alive at the peak of a training micro-step and of an
evaluation batch, tensor by tensor, from the code of :mod:`attnlab.model.gpt` and :mod:`attnlab.train.loop` (what
a variant's dense path or a plugin's attention saves is traced once, on tiny CPU or meta tensors, under
``saved_tensors_hooks``). :func:`estimate_train_step` and :func:`estimate_eval` return a :class:`MemoryEstimate`;
:func:`largest_micro_batch` and :func:`largest_eval_batch` the largest batch that fits a budget. ``micro_batch:
auto``, the cluster fit check and the GPU benches ask it.

A change to what gpt.py or loop.py keep alive must change the count here (tests/test_memory_plan.py holds it to
CPU measurements). It must never allocate on a GPU, nor import Ray or cluster code.

Details: docs/gpu-memory.md (the API at its top), docs/gpu-memory.md#method (what is counted), and for plugins
docs/plugins.md#the-gpu-memory-plan.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from attnlab.attention.spec import PluginSpec
from attnlab.model.config import GPTConfig

# The CUDA context, cuBLAS and Triton workspaces, NCCL buffers: outside torch's allocator, per process.
CUDA_CONTEXT_BYTES = 1536 * 1024**2
# Reserved-but-unused memory of the caching allocator (fragmentation), as a fraction of the tensor peak.
ALLOCATOR_OVERHEAD = 0.10
PRECISIONS = ("bf16", "fp32")
# Positions per chunk of the evaluation LM head (GPT.token_stats(chunk=...)).
EVAL_HEAD_CHUNK = 1024


@dataclass(frozen=True)
class MemoryEstimate:
    """A peak in bytes: ``tensor_bytes`` (live tensors, as max_memory_allocated) and ``total`` (with the
    allocator's overhead and the CUDA context); ``breakdown`` names each part of ``tensor_bytes``."""

    tensor_bytes: int
    total: int
    breakdown: dict[str, int] = field(default_factory=dict)

    def gib(self) -> float:
        return self.total / 1024**3

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / 1024**3:.2f}" for k, v in self.breakdown.items() if v)
        return f"{self.total / 1024**3:.1f} GiB ({parts} GiB; tensors {self.tensor_bytes / 1024**3:.2f} GiB)"


def _check(precision: str, backend: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not allowed: use one of {', '.join(PRECISIONS)}")
    from attnlab.attention.backends import Backend

    Backend.parse(backend, field="backend")


def _positive(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not allowed: use a positive integer")
    return value


def _llama(cfg: GPTConfig) -> bool:
    return getattr(cfg, "block", "gpt2") == "llama"


def num_params(cfg: GPTConfig) -> int:
    """Parameters of :class:`attnlab.model.GPT` (tied embedding counted once), without building it."""
    C, V, L = cfg.n_embd, cfg.vocab_size, cfg.n_layer
    # QK-norm with learned gains (softmax_qknorm): two (head_dim,) gains per layer; a plugin's parameters per layer
    gains = L * 2 * cfg.head_dim if getattr(cfg.attention_spec(), "learned_qk_gain", False) else 0
    gains += L * plugin_layer_params(cfg)
    if _llama(cfg):  # no biases; attention 4 C^2, SwiGLU 3 C H, two RMSNorm gains; the final RMSNorm's gain
        return V * C + L * (4 * C * C + 3 * C * cfg.mlp_hidden + 2 * C) + C + gains
    b = 1 if cfg.bias else 0
    per_layer = (3 * C * C + 3 * C * b) + (C * C + C * b) + (4 * C * C + 4 * C * b) + (4 * C * C + C * b) \
        + 2 * (C + C * b)
    return V * C + L * per_layer + (C + C * b) + gains


def _matrix_params(cfg: GPTConfig) -> int:
    """Weights autocast casts to bf16 (the linear layers' weights, the tied head included)."""
    C = cfg.n_embd
    mlp = 3 * C * cfg.mlp_hidden if _llama(cfg) else 8 * C * C
    return cfg.vocab_size * C + cfg.n_layer * (4 * C * C + mlp)


def resolve_backend_name(cfg: GPTConfig, backend: str = "auto") -> str:
    """The backend a CUDA worker would use (``attention.backends.choose_backend``, the one dispatch rule): ``auto``
    is the config's ``attn_impl``, and that on CUDA sdpa (softmax family), triton (LSSA, LSSAR, sharpened softmax),
    flex (other fusable variants) or dense."""
    from attnlab.attention.backends import choose_backend

    if backend == "auto":
        backend = cfg.attn_impl
    return choose_backend(cfg.attention_spec(), "cuda", backend)[0].value


def _plugin(cfg: GPTConfig) -> PluginSpec | None:
    spec = cfg.attention_spec()
    return spec if isinstance(spec, PluginSpec) else None


def plugin_layer_params(cfg: GPTConfig) -> int:
    """Parameters one attention layer holds for a plugin variant (0 for a built-in): its module built on meta."""
    spec = _plugin(cfg)
    if spec is None:
        return 0
    import torch

    from attnlab.attention.plugin import Shape, build_params

    with torch.device("meta"):
        module = build_params(spec, Shape(cfg.n_embd, cfg.n_head, cfg.head_dim))
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def plugin_attention_bytes(cfg: GPTConfig, batch: int, seq_len: int, precision: str, backend: str,
                           grad: bool) -> int:
    """One layer of a plugin variant on meta tensors of the planned size: with ``grad`` the bytes its ``prepare``
    and attention save for the backward (q, k, v included; the layer input ``x`` and the parameters excluded, the
    block counts them), without it the peak of their working set (q, k, v not included). A declared
    ``saved_bytes(shape, seq_len, batch)`` of a fused form replaces the traced figure with gradients."""
    return _plugin_attention_bytes(cfg, _plugin(cfg).sha256, batch, seq_len, precision, backend, grad)


@functools.lru_cache(maxsize=64)
def _plugin_attention_bytes(cfg: GPTConfig, sha256: str, batch: int, seq_len: int, precision: str, backend: str,
                            grad: bool) -> int:
    # Cached per plugin source too: a name may come back from edited code in the same process.
    import torch

    from attnlab.attention import attend
    from attnlab.attention.plugin import Shape, build_params, flex_calls_as_kernels, prepare_state

    spec = _plugin(cfg)
    shape = Shape(cfg.n_embd, cfg.n_head, cfg.head_dim)
    if grad and backend == "flex" and spec.variant.saved_bytes is not None:
        return int(spec.variant.saved_bytes(shape, seq_len, batch))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    with torch.device("meta"):
        params = build_params(spec, shape)
    x = torch.empty(batch, seq_len, cfg.n_embd, device="meta", requires_grad=grad)  # ln_1's float32 output
    q, k, v = (torch.empty(batch, cfg.n_head, seq_len, cfg.head_dim, device="meta", dtype=dtype, requires_grad=grad)
               for _ in range(3))
    excluded = {t.untyped_storage()._cdata for t in [x, *(params.parameters() if params is not None else ())]}

    def run():
        state = prepare_state(spec, x, params, shape)
        return attend(q, k, v, spec, impl=backend, state=state)

    if not grad:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        with torch.no_grad(), flex_calls_as_kernels(), tracker:
            run()
        return int(tracker.get_tracker_snapshot("peak")[torch.device("meta")]["Total"])
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in excluded:
            saved[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), flex_calls_as_kernels():
        run()
    return sum(saved.values())


@functools.lru_cache(maxsize=64)
def dense_saved_factor(cfg: GPTConfig) -> float:
    """Bytes autograd saves per element of the dense ``(rows x keys)`` weights for this variant, per head.

    Read, not assumed: one tiny :func:`attend_dense` call on CPU under ``saved_tensors_hooks`` at two lengths;
    the difference of the saved bytes over the difference of ``T^2`` is the quadratic coefficient.
    """
    import torch

    from attnlab.attention.dense import attend_dense

    spec = cfg.attention_spec()

    def saved(T: int) -> int:
        storages: dict[int, int] = {}

        def pack(t):
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
            return t

        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 1, T, 8, generator=g, requires_grad=True) for _ in range(3))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            attend_dense(q, k, v, spec, chunk_bytes=1 << 40)
        return sum(storages.values())

    return (saved(96) - saved(48)) / (96 * 96 - 48 * 48)


def _dense_rows_keys(B: int, H: int, T: int) -> int:
    """Elements of the dense weights over all chunks (attend_dense's chunking: causal keys ``:r1`` per chunk)."""
    import torch

    from attnlab.attention.chunked import DEFAULT_CHUNK_BYTES, rows_per_chunk
    from attnlab.attention.dense import DENSE_TEMPORARIES

    chunk = rows_per_chunk(B * H, T, torch.float32, DEFAULT_CHUNK_BYTES, DENSE_TEMPORARIES)
    total = 0
    for r0 in range(0, T, chunk):
        r1 = min(T, r0 + chunk)
        total += (r1 - r0) * r1
    return B * H * total


def _layer_bytes_per_token(cfg: GPTConfig, precision: str, compiled: bool, backend: str) -> int:
    """Bytes autograd saves per token per block, besides the dense attention weights.

    Read off :class:`attnlab.model.gpt.Block` under ``saved_tensors_hooks`` on CPU (fp32) and carried to bf16
    with autocast's dtypes: LayerNorm and the residual stream stay float32, linear inputs/outputs are bf16.
    The llama block (RMSNorm, SwiGLU) is counted the same way.
    """
    C = cfg.n_embd
    a = 2 if precision == "bf16" else 4
    r = 4
    if _llama(cfg):  # RMSNorm (composite: torch's CPU path) saves its input, 1/rms and the normalised input
        # before the gain; SwiGLU its input (cast once per projection under autocast), the gate, silu(gate), the
        # up projection and their product (c_proj's input)
        H = cfg.mlp_hidden
        saved = {"ln_1 input": 2 * r * C + 4, "c_attn input": a * C, "c_proj input": a * C,
                 "ln_2 input": 2 * r * C + 4,
                 "c_fc input": a * C, "c_up input": a * C if precision == "bf16" else 0, "c_fc output": a * H,
                 "silu output": a * H, "c_up output": a * H, "product": a * H}
    else:
        saved = {"ln_1 input": r * C + 8, "c_attn input": a * C, "c_proj input": a * C, "ln_2 input": r * C + 8,
                 "c_fc input": a * C, "c_fc output": 4 * a * C, "gelu output": 4 * a * C}
    if _plugin(cfg) is not None:  # traced per layer (plugin_attention_bytes), q and k beside the qkv projection's
        saved["q, k"] = 2 * a * C  # output (rotated, or copied from its transposed views: measured both ways)
    elif backend == "dense":  # q, k^T and v copied to float32 (and contiguous) for the two matmuls
        saved["q, k, v"] = 3 * 4 * C
    else:  # the fused kernels save q and k after RoPE, v as a view of the qkv projection, output + logsumexp
        saved["q, k, v"] = 5 * a * C + a * C + 4 * cfg.n_head
    if backend == "triton":  # attention/kernels/ops.py: five float32 row statistics, and U when sharpened
        saved["row statistics"] = 4 * 4 * cfg.n_head
        saved["U"] = a * C * int(cfg.attention_spec().p is not None)
    if backend == "flex":  # FlexAttention calls beyond the first (attention/flex.py): each saves its output + LSE;
        # a plugin's one call is in its trace, its sharpening's extra pass and LSE gradient direction are not
        from attnlab.attention.flex import parts_of

        spec = cfg.attention_spec()
        plugin = _plugin(cfg) is not None
        full = 0 if plugin else len(parts_of(spec)) - 1  # f = f+ - f-: a second full-width call, in float32
        recentre = 0 if plugin else int(spec.post == "recentre_l1")
        narrow = int(spec.p is not None) + recentre  # statistics passes (16-wide values)
        saved["more FlexAttention calls"] = full * (4 * C + 4 * cfg.n_head) + narrow * cfg.n_head * (16 * a + 4)
        # the direction of pass 1's LSE gradient (docs/attention.md#the-backward-of-the-two-passes): float32 w_i
        # (B, H, T, d) for sharpening, a float32 c_i per row for recentre_l1
        saved["LSE gradient direction"] = 4 * C * int(spec.p is not None) + 4 * cfg.n_head * recentre
    if compiled:  # inductor recomputes the cheap pointwise GELU / SiLU in the backward instead of saving it
        saved.pop("silu output" if _llama(cfg) else "gelu output")
    return sum(saved.values())


def _loss_path_bytes_per_token(cfg: GPTConfig, precision: str, compiled: bool) -> int:
    """The logits the loop holds (``_, loss = model(x, y)`` keeps them through the backward) and the float32
    cross-entropy: its saved log-softmax output and, at the backward's start, NLL's dense gradient and
    log-softmax's gradient."""
    V = cfg.vocab_size
    a = 2 if precision == "bf16" else 4
    if compiled:  # fused log-softmax + NLL: the logits it saves, two fp32 (tokens x vocab) tensors at the start of
        # the backward and the gradient's bf16 cast. Calibrated on a GPU (bench/results/2026-11-26-h200-quick.md):
        # GPT-2 small at 16 x 1,024 peaked 2.4-2.7 GiB above the model of one fp32 gradient, ~3.2 x vocab bytes a
        # token; with the second fp32 tensor the plan is 2-4 % above the measured peaks.
        return a * V + 8 * V + (2 * V if precision == "bf16" else 0)
    return a * V + 12 * V


def _finish(parts: dict[str, int]) -> MemoryEstimate:
    tensors = int(sum(parts.values()))
    total = int(tensors * (1 + ALLOCATOR_OVERHEAD)) + CUDA_CONTEXT_BYTES
    return MemoryEstimate(tensor_bytes=tensors, total=total, breakdown={k: int(v) for k, v in parts.items()})


def estimate_train_step(cfg: GPTConfig, seq_len: int, micro_batch: int, precision: str = "bf16",
                        compiled: bool = True, backend: str = "auto", *, ddp: bool = False) -> MemoryEstimate:
    """Peak memory of one worker's training micro-step (forward + backward, AdamW state present)."""
    _check(precision, backend)
    T, B = _positive(seq_len, "seq_len"), _positive(micro_batch, "micro_batch")
    backend = resolve_backend_name(cfg, backend)
    P = num_params(cfg)
    N = B * T
    parts = {"params": 4 * P, "grads": 4 * P, "optimizer": 8 * P, "ddp_buckets": 4 * P if ddp else 0,
             "autocast_weights": 2 * _matrix_params(cfg) if precision == "bf16" else 0}
    layer = _layer_bytes_per_token(cfg, precision, compiled, backend) * N
    if _plugin(cfg) is not None:
        layer += plugin_attention_bytes(cfg, B, T, precision, backend, grad=True)
    elif backend == "dense":
        layer += dense_saved_factor(cfg) * _dense_rows_keys(B, cfg.n_head, T)
    C = cfg.n_embd
    head_in = ((8 * C + 4) if _llama(cfg) else (4 * C + 8)) + (2 if precision == "bf16" else 4) * C  # ln_f, lm_head inputs
    parts["activations"] = cfg.n_layer * layer + head_in * N
    parts["loss_path"] = _loss_path_bytes_per_token(cfg, precision, compiled) * N
    parts["transient"] = 0
    return _finish(parts)


def estimate_eval(cfg: GPTConfig, length: int, batch: int, precision: str = "bf16",
                  backend: str = "auto") -> MemoryEstimate:
    """Peak memory of scoring ``batch`` windows of ``length`` tokens (no grad; the LM head in chunks of
    ``EVAL_HEAD_CHUNK`` positions, as :meth:`attnlab.model.GPT.token_stats`).

    Without autograd nothing is kept between phases, so the peak is the largest of three: a block's attention
    (residual, qkv, q/k after RoPE, output; the dense path's chunk of weights), its MLP (residual, LayerNorm
    output, the 4x hidden before and after GELU) and the LM head (the final hidden states, one chunk's float32
    logits and log-softmax, the per-token outputs)."""
    _check(precision, backend)
    T, B = _positive(length, "length"), _positive(batch, "batch")
    backend = resolve_backend_name(cfg, backend)
    C, V, H = cfg.n_embd, cfg.vocab_size, cfg.n_head
    a, r = (2 if precision == "bf16" else 4), 4
    N = B * T
    parts = {"params": 4 * num_params(cfg), "autocast_weights": 2 * _matrix_params(cfg) if precision == "bf16" else 0}
    attention = (r * C + 3 * a * C + 2 * a * C + a * C) * N
    if _plugin(cfg) is not None:  # residual, qkv, rotated q and k, then the traced prepare + attention
        attention = (r * C + 3 * a * C + 2 * a * C) * N + plugin_attention_bytes(cfg, B, T, precision, backend,
                                                                                  grad=False)
    elif backend == "dense":  # attend_dense: fp32 scores, masked copy and weights of one chunk of query rows
        chunk = max(1, min(T, 256 * 1024**2 // max(1, B * H * T * 16)))
        per_element = max(12.0, dense_saved_factor(cfg))  # sharpening's temporaries: what training saves
        attention += int(per_element * B * H * chunk * T) + 3 * 4 * C * N  # and q, k, v in float32
    if _llama(cfg):  # residual, RMSNorm output, gate, silu(gate) / up, their product
        mlp = (r * C + a * C + 3 * a * cfg.mlp_hidden) * N
    else:
        mlp = (r * C + a * C + 8 * a * C) * N
    head = r * C * N + 8 * V * B * min(T, EVAL_HEAD_CHUNK) + 5 * N
    phase = max(("attention", attention), ("mlp", mlp), ("lm_head", head), key=lambda kv: kv[1])
    parts[f"working_set ({phase[0]})"] = phase[1]
    return _finish(parts)


def largest_micro_batch(cfg: GPTConfig, seq_len: int, budget_bytes: int, *, precision: str = "bf16",
                        compiled: bool = True, backend: str = "auto", ddp: bool = False,
                        divisor_of: int | None = None, limit: int = 1024) -> int:
    """The largest micro_batch whose estimated ``total`` fits ``budget_bytes`` (0: not even 1). With
    ``divisor_of`` only divisors of it are candidates (sequences per worker per step, for accumulation)."""
    best = 0
    top = min(limit, divisor_of) if divisor_of else limit
    for b in range(1, top + 1):
        if divisor_of and divisor_of % b:
            continue
        if estimate_train_step(cfg, seq_len, b, precision, compiled, backend, ddp=ddp).total > budget_bytes:
            break
        best = b
    return best


def largest_eval_batch(cfg: GPTConfig, length: int, budget_bytes: int, *, precision: str = "bf16",
                       backend: str = "auto", limit: int = 1024) -> int:
    """The largest evaluation batch at ``length`` whose estimated ``total`` fits ``budget_bytes`` (0: none)."""
    best = 0
    for b in range(1, limit + 1):
        if estimate_eval(cfg, length, b, precision, backend).total > budget_bytes:
            break
        best = b
    return best


__all__ = ["ALLOCATOR_OVERHEAD", "CUDA_CONTEXT_BYTES", "MemoryEstimate", "PRECISIONS",
           "dense_saved_factor", "estimate_eval", "plugin_attention_bytes", "plugin_layer_params", "estimate_train_step", "largest_eval_batch",
           "largest_micro_batch", "num_params", "resolve_backend_name"]
