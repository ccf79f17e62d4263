"""The optimizers with GPT-2's parameter groups, and the learning-rate schedule."""

from __future__ import annotations

import math

import torch

from gpt2.core.config import TrainConfig
from gpt2.train.muon import build_muon, ns_dtype


def build_optimizers(model: torch.nn.Module, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """``adamw``: one AdamW for every parameter. ``muon``: Muon (train/muon.py) for the hidden matrices
    (attention and MLP weights), AdamW for the rest (embeddings, the tied LM head, gains, biases), the
    split of modded-nanogpt and nanochat: Muon orthogonalizes a matrix's update, which means nothing
    for an embedding's rows (each a separate lookup) or for a vector.

    Every param group remembers its peak learning rate as ``peak_lr``; ``set_lr`` scales it."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg.optimizer == "muon":
        hidden = [p for n, p in named if p.dim() == 2 and not _embedding(n)]
        device = hidden[0].device if hidden else torch.device("cpu")
        muon = build_muon([{"params": hidden, "peak_lr": cfg.muon_lr}], ns_dtype(cfg.muon_ns_dtype, device),
                          lr=cfg.muon_lr, momentum=cfg.muon_momentum, weight_decay=cfg.muon_weight_decay)
        taken = {id(p) for p in hidden}
        return [muon, adamw([(n, p) for n, p in named if id(p) not in taken], cfg)]
    return [adamw(named, cfg)]


def _embedding(name: str) -> bool:
    return name.endswith(("wte.weight", "wpe.weight", "lm_head.weight"))


def adamw(named: list[tuple[str, torch.nn.Parameter]], cfg: TrainConfig) -> torch.optim.AdamW:
    """Weight decay on matrices (2-D and up: linears, embeddings), none on biases and LayerNorm gains.

    ``fused_adamw`` selects PyTorch's fused kernel (one kernel for all parameters);
    off, PyTorch picks its default (multi-tensor ``foreach`` on CUDA).
    """
    params = [p for _, p in named]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay, "peak_lr": cfg.lr},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "peak_lr": cfg.lr},
    ]
    extra = {"fused": True} if cfg.fused_adamw else {}
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=cfg.betas, **extra)


def set_lr(optimizers: list[torch.optim.Optimizer], multiplier: float) -> None:
    """Every group's rate: its peak (``peak_lr``: AdamW's train.lr, Muon's train.muon_lr) times ``multiplier``."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = group["peak_lr"] * multiplier


def lr_at(step: int, cfg: TrainConfig, total_steps: int | None, progress: float | None = None) -> float:
    """The schedule's multiplier of every peak rate at ``step``: linear warmup from 1/warmup (never 0) to 1, then
    cosine decay to min_lr/lr at total_steps, or over ``progress`` (0 to 1) where the run's end is not a step (a
    time budget: train/length.py). Worked out on train.lr's rate, then divided by it, so that each step's rates
    are the ones earlier versions set, to the last bit (benchmarks/same_numerics.py)."""
    return _rate(step, cfg, total_steps, progress) / cfg.lr


def _rate(step: int, cfg: TrainConfig, total_steps: int | None, progress: float | None) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if progress is None:
        if step >= total_steps:
            return cfg.min_lr
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
