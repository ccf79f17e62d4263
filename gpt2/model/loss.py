"""The training loss without the logits: LM head and cross-entropy, a few thousand rows at a time.

GPT-2 124M at micro-batch 64 × 1024 has 65,536 positions × 50,304 vocabulary entries: the plain
path (``lm_head`` then ``F.cross_entropy``) keeps those logits, their fp32 copy and their gradient
alive through backward, about 16 bytes × V per token (52 GB). Training needs only the loss and the
gradients, so here each chunk of rows gets its logits, its softmax, and at once its share of the
gradients for the hidden states and the head's weight; the chunk's logits are then freed. Peak
memory for the head drops to one chunk's logits plus the N × C gradient of the hidden states; the
work is the same three matmuls (forward, and the two of backward, done in forward).

Precision follows autocast as the plain path does: matmuls in the autocast dtype, the softmax in
fp32. The gradient's 1/N is applied in fp32 after the matmuls, so fp16 does not underflow it.

Written so that Inductor fuses each chunk's softmax into one pass. Bytes moved per logit element,
bf16 on a GPU: the logits matmul writes 2, logsumexp reads 2 (4 in two passes), one kernel reads
the logits and writes the bf16 gradient (2 + 2), the two gradient matmuls read it (2 + 2): 12 to 14.
Scattering the label column's -1 into fp32 probabilities and casting after (the obvious eager code)
makes Inductor write and read those probabilities in fp32 first: about 20. The in-place ``sub_`` and
``exp_`` act on a fresh buffer, which Inductor turns into one fused expression; without compile they
keep one fp32 chunk alive instead of three. ``benchmarks/loss_kernels.py`` shows the buffers the
compiled chunk allocates and times it.
"""

from __future__ import annotations

import torch


AUTOCAST_DEVICES = ("cuda", "cpu", "mps", "xpu")  # torch.is_autocast_enabled raises for others (meta)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on this device type, or None where it is off."""
    if device_type not in AUTOCAST_DEVICES or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                mask: torch.Tensor | None, chunk: int) -> torch.Tensor:
        compute = autocast_dtype(hidden.device.type) or hidden.dtype
        acc = torch.promote_types(compute, torch.float32)  # softmax and sums: fp32 at least
        x, w = hidden.to(compute), weight.to(compute)
        n = x.shape[0]
        total = torch.zeros((), device=hidden.device, dtype=acc)
        grad_hidden = torch.empty(x.shape, device=hidden.device, dtype=acc)
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=acc)
        for lo in range(0, n, chunk):
            rows, labels = x[lo:lo + chunk], targets[lo:lo + chunk]
            logits = (rows @ w.t()).to(acc)
            if mask is not None:
                logits += mask  # -inf on padded vocabulary rows: no probability mass there
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, labels[:, None]).squeeze(1)
            total += (lse - picked).sum()
            # d(loss sum)/d(logits) = softmax - one-hot: the softmax cast once to the matmul dtype, then the
            # label column from the picked logits (fp32, so 1 - p near 0 keeps its precision)
            g = logits.sub_(lse[:, None]).exp_().to(compute)
            g[torch.arange(len(labels), device=g.device), labels] = ((picked - lse).exp() - 1.0).to(compute)
            del logits
            grad_hidden[lo:lo + chunk] = g @ w
            grad_weight += g.t() @ rows
        ctx.save_for_backward(grad_hidden.div_(n), grad_weight.div_(n))
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total / n

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        return ((grad_hidden * grad_loss).to(hidden_dtype), (grad_weight * grad_loss).to(weight_dtype),
                None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         mask: torch.Tensor | None = None, chunk: int = 8192, per_row: bool = False) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``, never holding all the logits.

    ``hidden``: (N, C), ``weight``: (V, C), ``targets``: (N,) ids, ``mask``: (V,) added to the logits.
    Without gradients (evaluation) only the loss is computed, chunk by chunk; ``per_row`` returns
    each row's loss, shape (N,), instead of their mean (evaluation only).
    """
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        if per_row:
            raise ValueError("per_row losses are for evaluation: call under torch.no_grad()")
        return LinearCrossEntropy.apply(hidden, weight, targets, mask, chunk)
    acc = torch.promote_types(hidden.dtype, torch.float32)
    rows = []
    for lo in range(0, hidden.shape[0], chunk):
        logits = (hidden[lo:lo + chunk] @ weight.t()).to(acc)
        if mask is not None:
            logits += mask
        labels = targets[lo:lo + chunk]
        rows.append(torch.logsumexp(logits, dim=-1) - logits.gather(1, labels[:, None]).squeeze(1))
    losses = torch.cat(rows)
    return losses if per_row else losses.mean()
