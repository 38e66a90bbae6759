"""GPT-2 with RoPE + NTK scaling and any attention variant (docs/protocol.md#blocks), read top to bottom.

Blocks as in llm.c's GPT-2: pre-LayerNorm with biases, tanh-GELU MLP (4x), tied input/output embeddings,
init N(0, 0.02) with residual projections at 0.02/sqrt(2 * n_layer). The learned position table is replaced
by RoPE. ``cfg.block = "llama"`` swaps in Llama's block (pre-RMSNorm with a learnable gain, SwiGLU MLP, no
biases, final RMSNorm; the same embeddings, init and attention). ``cfg.position``: ``rope`` (rotate q and k),
``nope`` (no position signal: the causal mask only) or ``alibi`` (no rotation; the attention spec carries
ALiBi's bias, added by the attention backends). A variant from a plugin (docs/plugins.md) gets its learned
parameters as the attention layer's ``plugin`` module (``blocks.N.attn.plugin.*``, initialised by the plugin, not
by the model) and its prepared tensors from the layer's input on every call. Per forward call one can choose the
RoPE scaling (``none``/``ntk``/``pi``/``yarn``) and, for evaluation, another attention spec (e.g. a different
sharpening power ``p_eval``) without touching the weights; the power reaches the attention as a tensor
(:func:`power_as_tensor`), so a compiled block has one graph per length for every ``p_eval``. No Ray imports here.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlab.attention import PluginSpec, attend
from attnlab.attention.plugin import Shape, build_params, prepare_state
from attnlab.attention.spec import AttentionSpec
from attnlab.model.config import GPTConfig, alibi_override
from attnlab.model.rope import apply_rope, scaled_rope_tables
from attnlab.names import check_scaling

# Llama's RMSNorm epsilon (Touvron et al. 2023, Llama 2's configuration; Llama 1 used 1e-6).
RMS_EPS = 1e-5

# Called as on_attention(layer_index, q, k, qk_gain) with q, k after RoPE, (B, H, T, D), and the layer's learned
# QK-norm gains (g_q, g_k) or None: for attention diagnostics, which recompute the weights the layer used. A layer
# of a plugin variant adds a fifth argument, its PluginState (parameters and prepared tensors, detached).
AttentionObserver = Callable[..., None]
# What a block sees: the observer with its layer index bound, called as observe(q, k, qk_gain[, state]). Blocks
# take no layer index, so one compiled block serves every layer (see compile.py).
LayerObserver = Callable[[torch.Tensor, torch.Tensor, "tuple | None"], None]


# The token embedding as an operator of its own: compiled, inductor lowers nn.Embedding's backward to an accumulating
# index_put whose atomic adds make two identical training steps differ in the last bits
# (bench/results/2026-11-26-h200-quick.md).
# As an operator its backward is aten's embedding_dense_backward (sorted indices, summed in order: deterministic on
# CUDA and CPU), in the compiled model as in the eager one, without use_deterministic_algorithms for the whole model.
@torch.library.custom_op("attnlab::embedding", mutates_args=())
def embedding(weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``weight[idx]``: token ids ``(B, T)`` -> vectors ``(B, T, C)``, with a deterministic weight gradient."""
    return F.embedding(idx, weight)


@embedding.register_fake
def _(weight, idx):
    return weight.new_empty((*idx.shape, weight.shape[1]))


@torch.library.custom_op("attnlab::embedding_backward", mutates_args=())
def embedding_backward(grad: torch.Tensor, idx: torch.Tensor, num_weights: int) -> torch.Tensor:
    return torch.ops.aten.embedding_dense_backward(grad, idx, num_weights, -1, False)


@embedding_backward.register_fake
def _(grad, idx, num_weights):
    return grad.new_empty((num_weights, grad.shape[-1]))


def _embedding_setup(ctx, inputs, output):
    weight, idx = inputs
    ctx.save_for_backward(idx)
    ctx.num_weights = weight.shape[0]


def _embedding_grad(ctx, grad):
    (idx,) = ctx.saved_tensors
    return embedding_backward(grad, idx, ctx.num_weights), None


embedding.register_autograd(_embedding_grad, setup_context=_embedding_setup)


# The power every sharpened spec carries into the blocks: the power itself goes as a 0-d tensor beside it
# (:func:`power_as_tensor`), so the graph a compiled block builds for one p_eval serves every other.
GRAPH_POWER = 1.0


def power_as_tensor(spec: AttentionSpec, device) -> tuple[AttentionSpec, torch.Tensor | None]:
    """``(spec the blocks see, p)``: a sharpened spec as the same spec with ``p = GRAPH_POWER`` and its power as a
    0-d float64 tensor on ``device`` (a tensor's value does not specialise a compiled graph; a float would, one
    graph per ``p_eval``); an unsharpened spec as itself and None (a second graph: one pass, not two)."""
    if spec.p is None:
        return spec, None
    return spec.replace(p=GRAPH_POWER), torch.tensor(spec.p, dtype=torch.float64, device=device)


def make_norm(cfg: GPTConfig) -> nn.Module:
    """The block's normalisation: LayerNorm (gpt2; with bias when ``cfg.bias``) or RMSNorm with a gain (llama)."""
    if cfg.block == "llama":
        return nn.RMSNorm(cfg.n_embd, eps=RMS_EPS)
    return nn.LayerNorm(cfg.n_embd, bias=cfg.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_scaled = True
        if getattr(cfg.attention_spec(), "learned_qk_gain", False):
            # QK-norm as an RMSNorm with a learned per-channel gain shared by the heads, initialised to 1
            # (docs/attention.md#softmax_qknorm): parameters of the model, passed to every attention call
            self.q_gain = nn.Parameter(torch.ones(cfg.head_dim))
            self.k_gain = nn.Parameter(torch.ones(cfg.head_dim))
        self.layer_shape = Shape(cfg.n_embd, cfg.n_head, cfg.head_dim)
        spec = cfg.attention_spec()
        plugin = build_params(spec, self.layer_shape) if isinstance(spec, PluginSpec) else None
        if plugin is not None:  # a plugin variant's learned parameters, as the plugin initialised them
            for module in plugin.modules():
                module.plugin_init = True
            self.plugin = plugin

    def forward(self, x, cos, sin, spec: AttentionSpec, impl: str, p: torch.Tensor | None = None,
                observe: LayerObserver | None = None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if cos is not None:  # position rope; nope and alibi leave q and k as they are
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gain = (self.q_gain, self.k_gain) if getattr(spec, "learned_qk_gain", False) else None
        # a plugin variant: its per-token tensors from the layer's input x (e.g. FoX's forget gates)
        state = None
        if isinstance(spec, PluginSpec):
            state = prepare_state(spec, x, getattr(self, "plugin", None), self.layer_shape)
        if observe is not None:
            seen = (q.detach(), k.detach(), None if gain is None else tuple(g.detach() for g in gain))
            if state is None:
                observe(*seen)
            else:
                observe(*seen, state.detach())
        y = attend(q, k, v, spec, impl=impl, qk_gain=gain, state=state, p=p)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_scaled = True

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class SwiGLU(nn.Module):
    """Llama's MLP (Shazeer 2020; Touvron et al. 2023): ``c_proj(silu(c_fc(x)) * c_up(x))``, hidden width
    ``cfg.mlp_hidden`` (8/3 x n_embd rounded up to 64), three projections without bias."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        hidden = cfg.mlp_hidden
        self.c_fc = nn.Linear(cfg.n_embd, hidden, bias=False)  # the gate (Llama's w1)
        self.c_up = nn.Linear(cfg.n_embd, hidden, bias=False)  # Llama's w3
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=False)  # Llama's w2
        self.c_proj.residual_scaled = True

    def forward(self, x):
        return self.c_proj(F.silu(self.c_fc(x)) * self.c_up(x))


class Block(nn.Module):
    """A pre-norm block: GPT-2's (LayerNorm, GELU MLP) or Llama's (RMSNorm, SwiGLU), by ``cfg.block``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = make_norm(cfg)
        self.mlp = SwiGLU(cfg) if cfg.block == "llama" else MLP(cfg)

    def forward(self, x, cos, sin, spec, impl, p: torch.Tensor | None = None, observe: LayerObserver | None = None):
        x = x + self.attn(self.ln_1(x), cos, sin, spec, impl, p, observe)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.spec = cfg.attention_spec()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied input/output embeddings
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if getattr(module, "plugin_init", False):  # a plugin's parameters keep the plugin's own initialisation
            return
        std = self.cfg.init_std
        if isinstance(module, nn.Linear):
            if getattr(module, "residual_scaled", False):
                std = std / math.sqrt(2 * self.cfg.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)

    def num_params(self) -> int:
        """Parameters, the tied embedding counted once (there is no position table)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 6N + 12 * n_layer * n_head * head_dim * T (PaLM appendix B / nanoGPT)."""
        T = seq_len or self.cfg.train_len
        c = self.cfg
        return 6.0 * self.num_params() + 12.0 * c.n_layer * c.n_head * c.head_dim * T

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B, T)`` -> input vectors ``(B, T, C)`` (:func:`embedding`: a deterministic backward)."""
        return embedding(self.wte.weight, idx)

    def hidden_states(self, idx: torch.Tensor, *, rope_scaling: str = "none", attention: AttentionSpec | None = None,
                      impl: str | None = None, on_attention: AttentionObserver | None = None) -> torch.Tensor:
        """The final-norm output ``(B, T, C)``.

        ``rope_scaling``: ``none``, ``ntk``, ``pi``, ``yarn``, ``yarn_paper`` or ``dynamic:F`` beyond train_len
        (:mod:`attnlab.model.rope`; YaRN's logit multiplier is folded into the cos/sin tables, so into q and k; a model with position
        ``nope`` or ``alibi`` checks the name and ignores it); ``attention``: a spec to use
        instead of the trained one (evaluation-time sharpening); ``on_attention``: diagnostics observer. With an
        observer the blocks run eagerly even in a compiled model (:func:`attnlab.model.compile_model`).
        """
        x = self.embed(idx)
        T = x.shape[1]
        c = self.cfg
        position = getattr(c, "position", "rope")
        if position == "rope":
            cos, sin = scaled_rope_tables(rope_scaling, T, c.head_dim, c.train_len, c.rope_base, device=idx.device,
                                          trained=c.trained_scaling)
        else:  # no rotation: the scaling is checked, and has nothing to scale
            check_scaling(rope_scaling)
            cos = sin = None
        spec = attention or self.spec
        if position == "alibi":  # an evaluation spec from elsewhere keeps the model's bias
            override = alibi_override()
            if any(getattr(spec, k) != v for k, v in override.items()):
                spec = spec.replace(**override)
        impl = impl or c.attn_impl
        spec, p = power_as_tensor(spec, x.device)
        if on_attention is not None:
            return self._observed_blocks(x, cos, sin, spec, impl, p, on_attention)
        for block in self.blocks:
            x = block(x, cos, sin, spec, impl, p)
        return self.ln_f(x)

    @torch._disable_dynamo  # torch.compiler.disable, without importing torch._dynamo until it is called
    def _observed_blocks(self, x, cos, sin, spec, impl, p, on_attention: AttentionObserver) -> torch.Tensor:
        # block.forward, not block(...): a compiled block's __call__ would trace the observer (a new closure
        # per call, so a recompile per call); diagnostics run eagerly.
        for i, block in enumerate(self.blocks):
            x = block.forward(x, cos, sin, spec, impl, p, functools.partial(on_attention, i))
        return self.ln_f(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, loss_mask: torch.Tensor | None = None,
                **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logits, loss)``; the loss is the mean cross-entropy over all (or the masked) target positions."""
        h = self.hidden_states(idx, **kwargs)
        logits = self.lm_head(h)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
        if loss_mask is None:
            return logits, loss.mean()
        mask = loss_mask.reshape(-1).to(loss.dtype)
        return logits, (loss * mask).sum() / mask.sum().clamp_min(1.0)

    @torch.no_grad()
    def token_stats(self, idx: torch.Tensor, targets: torch.Tensor, *, chunk: int = 1024,
                    **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token cross-entropy ``(B, T)`` (float32) and whether the argmax is the target ``(B, T)`` (bool).

        The LM head runs over chunks of positions, so long windows never materialise ``(B, T, vocab)`` logits. The
        cross-entropy reads the logits as ``(positions, vocab)`` rows: given them transposed, CUDA's log-softmax
        first copies them contiguous, 4 more bytes per logit (an H100 measured 0.77 GiB at 4 x 1,024 tokens).
        """
        h = self.hidden_states(idx, **kwargs)
        losses, correct = [], []
        for t0 in range(0, h.shape[1], chunk):
            logits = self.lm_head(h[:, t0:t0 + chunk]).float()
            tgt = targets[:, t0:t0 + chunk]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
            losses.append(loss.view(tgt.shape))
            correct.append(logits.argmax(-1) == tgt)
        return torch.cat(losses, dim=1), torch.cat(correct, dim=1)
