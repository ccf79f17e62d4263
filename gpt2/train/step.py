"""One training step: forward and backward over the micro-batches, then the optimizer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext

import torch

from gpt2.run.device import Runtime


def backward_micro_batches(model: torch.nn.Module, batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
                           steps: int, runtime: Runtime, scaler: torch.amp.GradScaler) -> torch.Tensor:
    """Forward and backward ``steps`` micro-batches; each loss is divided by ``steps``, so the
    accumulated gradient equals the gradient of one batch ``steps`` times larger. Returns the mean
    loss, still on the device.

    Under DDP the gradients are all-reduced once per step: every micro-batch but the last runs
    in ``no_sync``. FSDP reduce-scatters after every micro-batch: deferring it would hold full-size
    gradients, the memory that sharding saves."""
    total = torch.zeros((), device=runtime.device)
    for i in range(steps):
        x, y = next(batches)
        last = i == steps - 1
        with nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
            with runtime.autocast(), runtime.attention():
                _, loss = model(x, y)
            loss = loss / steps
            total += loss.detach()
            scaler.scale(loss).backward()
    return total


def optimizer_step(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], scaler: torch.amp.GradScaler,
                   grad_clip: float) -> tuple[torch.Tensor, bool]:
    """Unscale, measure (and clip) the gradient norm, step, zero the gradients.

    Returns the gradient norm, still on the device, and whether GradScaler skipped the step
    (fp16 only: it reads the device to know)."""
    for optimizer in optimizers:
        scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # FSDP: a DTensor, the same on every rank
        norm = norm.full_tensor()
    scale = scaler.get_scale() if scaler.is_enabled() else None
    for optimizer in optimizers:
        scaler.step(optimizer)
    scaler.update()
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    return norm, scale is not None and scaler.get_scale() < scale
