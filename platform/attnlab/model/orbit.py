"""The GPT for coordinate-pair tokens (simulated orbits): the same blocks, attention variants and RoPE/NTK as
:class:`attnlab.model.gpt.GPT`, with a pair embedding in and one next-bin head per coordinate out.

What it is for: training and evaluating on ``attnlab.data.generators.orbits`` windows, whose tokens are ``(x bin, y
bin)`` pairs (int64 ``(B, T, 2)``). As in Vafa et al. 2025, each coordinate has its own embedding table; the two
embeddings are concatenated and linearly projected to one ``n_embd`` input vector per token. The residual stream,
blocks, final LayerNorm, RoPE (no position table) and attention specs are exactly the GPT's, so every attention
variant, ``p_eval``, NTK scaling and the attention diagnostics work unchanged. The output is one linear head
producing ``channels x vocab_size`` logits (untied: there are two input tables).

Loss: the mean over target positions of the **mean of the per-coordinate cross-entropies** (nats per
coordinate, as Vafa et al.'s training loss). ``token_stats`` reports that per token, and "correct" = every
coordinate's argmax bin is right. :meth:`OrbitGPT.coord_stats` adds the distance between the argmax bins and
the target bins (in bins; times the data's ``bin_width`` for AU).

The same interface as ``GPT``: ``forward(idx, targets, *, loss_mask=None, **kw) -> (logits (B, T, C, V),
loss)``, ``token_stats``, ``hidden_states``, ``num_params``, ``flops_per_token``, ``cfg.attention_spec(p=...)``,
``cfg.train_len``, ``spec``. :class:`OrbitGPTConfig` is a :class:`GPTConfig` with ``model_kind = "orbit"``;
:func:`build_model` / :func:`config_from_dict` pick the model class from a config (the hook the training
loop and checkpoint loader need). No Ray here; it must never import the data or training packages.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlab.errors import UserError
from attnlab.model.config import GPTConfig
from attnlab.model.gpt import GPT, Block, make_norm


@dataclass(frozen=True)
class OrbitGPTConfig(GPTConfig):
    """A GPT config for tokens of ``channels`` coordinates; ``vocab_size`` is per coordinate (bins + dt tokens)."""

    model_kind: str = "orbit"
    channels: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model_kind != "orbit":
            raise UserError(f"model.model_kind={self.model_kind!r} is not allowed for OrbitGPTConfig: use 'orbit'")
        if isinstance(self.channels, bool) or not isinstance(self.channels, int) or self.channels < 1:
            raise UserError(f"model.channels={self.channels!r} is not allowed: use a positive integer")


class OrbitGPT(nn.Module):
    """GPT blocks over pair-embedded coordinate tokens, with a next-bin head per coordinate."""

    def __init__(self, cfg: OrbitGPTConfig):
        super().__init__()
        if not isinstance(cfg, OrbitGPTConfig):
            raise UserError(f"OrbitGPT needs an OrbitGPTConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.spec = cfg.attention_spec()
        C, V, D = cfg.channels, cfg.vocab_size, cfg.n_embd
        self.wte = nn.ModuleList(nn.Embedding(V, D) for _ in range(C))
        self.combine = nn.Linear(C * D, D, bias=cfg.bias)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = make_norm(cfg)
        self.head = nn.Linear(D, C * V, bias=False)
        self.apply(self._init_weights)

    # The GPT's own: initialisation (N(0, init_std), residual projections scaled by 1/sqrt(2 n_layer)), parameter
    # count and training FLOPs per token (6N + 12 * n_layer * n_head * head_dim * T).
    _init_weights = GPT._init_weights
    num_params = GPT.num_params
    flops_per_token = GPT.flops_per_token

    def _check_idx(self, idx: torch.Tensor) -> None:
        if idx.dim() != 3 or idx.shape[-1] != self.cfg.channels:
            raise UserError(f"orbit tokens must be (B, T, {self.cfg.channels}) coordinate bins, "
                            f"got shape {tuple(idx.shape)}")

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """``(B, T, C)`` bins -> ``(B, T, n_embd)``: the per-coordinate embeddings, concatenated and projected."""
        self._check_idx(idx)
        return self.combine(torch.cat([emb(idx[..., c]) for c, emb in enumerate(self.wte)], dim=-1))

    # The residual stream, RoPE/NTK, attention spec, p_eval and diagnostics observer are exactly the GPT's.
    hidden_states = GPT.hidden_states
    _observed_blocks = GPT._observed_blocks

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``(B, T, n_embd)`` -> ``(B, T, C, V)``."""
        return self.head(h).view(*h.shape[:-1], self.cfg.channels, self.cfg.vocab_size)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                loss_mask: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logits (B, T, C, V), loss)``: the mean over (masked) positions of the mean per-coordinate CE."""
        logits = self.logits(self.hidden_states(idx, **kwargs))
        if targets is None:
            return logits, None
        self._check_idx(targets)
        per_token = _coordinate_ce(logits, targets).mean(dim=-1)  # (B, T)
        if loss_mask is None:
            return logits, per_token.mean()
        mask = loss_mask.to(per_token.dtype)
        return logits, (per_token * mask).sum() / mask.sum().clamp_min(1.0)

    @torch.no_grad()
    def coord_stats(self, idx: torch.Tensor, targets: torch.Tensor, *, chunk: int = 1024,
                    **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per token ``(loss (B, T) float32, correct (B, T) bool, bin_distance (B, T) float32)``: the mean
        coordinate CE, whether every argmax bin is the target, and the Euclidean distance (in bins) between the
        argmax bins and the target bins. The head runs over chunks of positions."""
        self._check_idx(targets)
        h = self.hidden_states(idx, **kwargs)
        losses, correct, dist = [], [], []
        for t0 in range(0, h.shape[1], chunk):
            logits = self.logits(h[:, t0:t0 + chunk]).float()
            tgt = targets[:, t0:t0 + chunk]
            losses.append(_coordinate_ce(logits, tgt).mean(dim=-1))
            guess = logits.argmax(-1)
            correct.append((guess == tgt).all(dim=-1))
            dist.append((guess - tgt).float().pow(2).sum(-1).sqrt())
        return torch.cat(losses, dim=1), torch.cat(correct, dim=1), torch.cat(dist, dim=1)

    @torch.no_grad()
    def token_stats(self, idx: torch.Tensor, targets: torch.Tensor, *, chunk: int = 1024,
                    **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token loss ``(B, T)`` (mean coordinate CE, float32) and whether every argmax bin is right ``(B, T)``."""
        loss, correct, _ = self.coord_stats(idx, targets, chunk=chunk, **kwargs)
        return loss, correct


def _coordinate_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per coordinate ``(B, T, C)`` from logits ``(B, T, C, V)`` and targets ``(B, T, C)``."""
    V = logits.shape[-1]
    ce = F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1), reduction="none")
    return ce.view(targets.shape)


# ---------------------------------------------------------------------------------------- the hook
MODEL_KINDS = {"gpt": GPTConfig, "orbit": OrbitGPTConfig}


def with_kind(cfg: GPTConfig, kind: str) -> GPTConfig:
    """The same fields as config class ``kind`` (``gpt`` or ``orbit``; e.g. a preset made an orbit model)."""
    if kind not in MODEL_KINDS:
        raise UserError(f"model kind {kind!r} is not allowed: use one of {', '.join(MODEL_KINDS)}")
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(GPTConfig)}
    return MODEL_KINDS[kind](**fields)


def config_from_dict(fields: dict) -> GPTConfig:
    """A model config from ``dataclasses.asdict(cfg)`` (a checkpoint's ``gpt_config``): ``model_kind`` picks
    the class; a dict without it is a plain GPT (every checkpoint written before orbit models existed). A checkpoint
    written before ``rope_factor`` existed that says ``yarn`` was fine-tuned with the paper's ramp, ``yarn_paper``
    (:func:`attnlab.names.recorded_rope_method`)."""
    from attnlab.names import recorded_rope_method

    kind = fields.get("model_kind", "gpt")
    if kind not in MODEL_KINDS:
        raise UserError(f"model_kind={kind!r} in the checkpoint is not known: use one of {', '.join(MODEL_KINDS)}")
    if "rope_scaling" in fields:
        fields = {**fields, "rope_scaling": recorded_rope_method(fields)}
    return MODEL_KINDS[kind](**fields)


def build_model(cfg: GPTConfig) -> nn.Module:
    """``OrbitGPT`` for an ``OrbitGPTConfig``, ``GPT`` for any other ``GPTConfig``."""
    return OrbitGPT(cfg) if isinstance(cfg, OrbitGPTConfig) else GPT(cfg)


__all__ = ["MODEL_KINDS", "OrbitGPT", "OrbitGPTConfig", "build_model", "config_from_dict", "with_kind"]
