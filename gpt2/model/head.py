"""The loss after the LM head, chosen once where the model is built (after torchtitan's components/loss.py).

A model holds two losses: training's, run with gradients, and scoring's, run without (the val loss,
each window's mean). Training may take a faster head than scoring: FP8 operands (``train.fp8_head``)
or liger's fused kernel (``train.loss_kernel``); a val loss is always scored in full precision.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from gpt2.model.loss import linear_cross_entropy


class Vocab(Protocol):
    vocab_size: int  # the true vocabulary: the LM head's rows past it are padding


class Model(Protocol):
    """What a loss reads of the model (model/gpt.py's GPT), named here so that this module needs nothing of it."""

    cfg: Vocab
    lm_head: torch.nn.Linear

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class Loss(Protocol):
    def __call__(self, model: Model, hidden: torch.Tensor, targets: torch.Tensor,
                 per_window: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(all positions' logits, or None where they are never held; the mean loss, or each window's)."""


@dataclass(frozen=True)
class Head:
    """What a model's two losses are made of: ``train.loss_chunk``, ``train.cpu_gemm`` (or ``eval.cpu_gemm``),
    ``train.fp8_head`` and ``train.loss_kernel`` as resolved for the device."""

    chunk: int = 0  # > 0: the loss in chunks of this many positions, no logits held; 0: every logit, then the loss
    gemm: str = "blas"  # the chunked loss's matmul: model/loss.py's cpu_gemm choice (blas off a CPU)
    fp8: bool = False  # training's chunked loss from FP8 operands (model/fp8.py's HeadFp8)
    fused: Callable | None = None  # liger's kernel (model/loss.py's liger_loss): training's loss

    def losses(self) -> tuple[Loss, Loss]:
        """(training's loss, scoring's)."""
        scoring = Chunked(self.chunk, self.gemm) if self.chunk else AllLogits()
        if self.fused is not None:
            # the kernel runs outside a compiled graph (liger_loss), and so does this whole call: one graph break, in
            # forward, instead of a second graph for the slicing around the kernel
            return torch.compiler.disable(Fused(self.fused)), scoring
        return (Chunked(self.chunk, "fp8") if self.fp8 and self.chunk else scoring), scoring  # FP8: chunks only


@dataclass(frozen=True)
class AllLogits:
    """Every position's logits, then the cross-entropy: the logits are returned with the loss."""

    def __call__(self, model: Model, hidden: torch.Tensor, targets: torch.Tensor,
                 per_window: bool) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model.logits(hidden)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                               reduction="none" if per_window else "mean")
        return logits, loss.view(targets.shape).mean(1) if per_window else loss


@dataclass(frozen=True)
class Chunked:
    """The loss without the logits (model/loss.py), ``chunk`` positions at a time, its matmuls by ``gemm``."""

    chunk: int
    gemm: str

    def __call__(self, model: Model, hidden: torch.Tensor, targets: torch.Tensor,
                 per_window: bool) -> tuple[None, torch.Tensor]:
        loss = linear_cross_entropy(hidden.reshape(-1, hidden.size(-1)), model.lm_head.weight, targets.reshape(-1),
                                    model.cfg.vocab_size, self.chunk, per_row=per_window, gemm=self.gemm)
        return None, loss.view(targets.shape).mean(1) if per_window else loss


@dataclass(frozen=True)
class Fused:
    """A fused linear cross-entropy kernel, called as ``kernel(weight, hidden, targets)``."""

    kernel: Callable

    def __call__(self, model: Model, hidden: torch.Tensor, targets: torch.Tensor,
                 per_window: bool) -> tuple[None, torch.Tensor]:
        if per_window:
            raise ValueError("per-window losses are scoring's: call under torch.no_grad()")
        # the real vocabulary's rows only: the padding rows then take no probability, as the mask does
        weight = model.lm_head.weight[:model.cfg.vocab_size]
        return None, self.kernel(weight, hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1))
