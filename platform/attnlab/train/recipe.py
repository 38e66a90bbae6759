"""The optimiser recipe of docs/protocol.md#training: AdamW with decay on 2-D weights only, warm-up + cosine decay,
MFU against a per-GPU peak table. Plain functions of the config; no Ray here.
"""

from __future__ import annotations

import math

import torch

from attnlab.train.config import TrainConfig

# Dense bf16 tensor-core peaks (FLOP/s), as llm.c's mfu.h and vendor sheets give them. Other hardware: unknown.
PEAK_BF16_FLOPS = {
    "A100": 312e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM / HBM3
    "H200": 989e12,
}


def peak_flops(device: torch.device) -> float | None:
    """The bf16 peak of this GPU, or None ("unknown") for CPUs and GPUs missing from the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if "H100" in name and "PCIe" in name:
        return PEAK_BF16_FLOPS["H100 PCIe"]
    for key in ("H200", "H100", "A100"):
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup_steps`` then cosine decay to ``min_lr_frac * lr`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    min_lr = cfg.min_lr_frac * cfg.lr
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW(beta1, beta2) with weight decay on parameters of 2 or more dimensions only."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=device.type == "cuda")
