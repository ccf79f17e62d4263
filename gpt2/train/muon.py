"""Muon with its Newton-Schulz orthogonalization in the precision this device computes fast.

``torch.optim.Muon`` orthogonalizes every update with five Newton-Schulz iterations in bf16. That
is right where bf16 matmuls are native (CUDA GPUs with bf16, CPUs with AVX512-BF16 or AMX). On a
CPU without them (AVX2 only) every bf16 matmul is emulated, and the ladder's Muon rung costs
several times AdamW's step time there (docs/benchmarks.md, "Muon's step where bf16 is
emulated"). ``FP32Muon`` runs the same iterations in fp32 and is otherwise
PyTorch's Muon: the same defaults, checks and ``momentum_buffer`` state, so a checkpoint resumes
with either. ``train.muon_ns_dtype: auto`` picks PyTorch's own where bf16 is
native and this one elsewhere.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gpt2.run.device import bf16_is_native


def ns_dtype(choice: str, device: torch.device) -> str:
    """``train.muon_ns_dtype`` resolved on ``device``: ``auto`` is bf16 where it is native, else fp32."""
    if choice != "auto":
        return choice
    return "bf16" if bf16_is_native(device) else "fp32"


def build_muon(params: list[dict[str, Any]], dtype: str, **options: Any) -> torch.optim.Optimizer:
    """PyTorch's Muon for ``bf16``, the fp32 variant for ``fp32``."""
    return (torch.optim.Muon if dtype == "bf16" else FP32Muon)(params, **options)


def orthogonalize(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of ``torch.optim.Muon``, in ``dtype``.

    It maps a matrix to roughly U S' V^T with S' near 1 (Keller Jordan's Muon); PyTorch's
    implementation is the reference it is tested against, in bf16."""
    a, b, c = coefficients
    x = update.to(dtype)
    wide = update.size(0) > update.size(1)
    if wide:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if wide else x


def adjusted_lr(lr: float, rule: str | None, shape: torch.Size) -> float:
    """Muon's per-matrix learning rate, as ``torch.optim.Muon`` scales it (``adjust_lr_fn``)."""
    rows, cols = shape[:2]
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1, rows / cols))


class FP32Muon(torch.optim.Muon):
    """``torch.optim.Muon`` with the orthogonalization in fp32 (``ns_dtype``), for devices that emulate bf16."""

    ns_dtype = torch.float32

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch.optim.Optimizer's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            buffers: list[torch.Tensor] = []
            self._init_group(group, params, grads, buffers)
            lr, momentum = float(group["lr"]), group["momentum"]
            for param, grad, buffer in zip(params, grads, buffers):
                buffer.lerp_(grad, 1 - momentum)
                update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                       self.ns_dtype)
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update.to(param.dtype), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss
