"""AdamW with GPT-2's parameter groups, and the learning-rate schedule."""

from __future__ import annotations

import math

import torch

from gpt2.core.config import TrainConfig


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """Weight decay on matrices (2-D and up: linears, embeddings), none on biases and LayerNorm gains.

    ``fused_adamw`` selects PyTorch's fused kernel (one kernel for all parameters);
    off, PyTorch picks its default (multi-tensor ``foreach`` on CUDA).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    extra = {"fused": True} if cfg.fused_adamw else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, **extra)


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Linear warmup from lr/warmup (never 0) to lr, then cosine decay to min_lr at total_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if step >= total_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
