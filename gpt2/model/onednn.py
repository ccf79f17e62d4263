"""The model's linear layers through oneDNN's fp32 kernels on a CPU (``train.cpu_gemm`` onednn).

PyTorch's ``nn.Linear`` on a CPU calls its BLAS, MKL on x86, which runs fp32 at half an AMD chip's
rate; oneDNN runs the same matmuls at all of it (docs/benchmarks.md). ``convert`` turns the blocks'
``nn.Linear`` layers and the LM head into ``OnednnLinear``: the same parameters under the same
names (checkpoints, optimizers and exports see no difference), with a forward and backward of
oneDNN's three matmuls where the input is fp32 on a CPU in eager code. Anywhere else (autocast, a
GPU, a compiled graph) it is ``nn.Linear``.
"""

from __future__ import annotations

import torch
from torch import nn

from gpt2.model.loss import onednn_mm


class OnednnLinearFunction(torch.autograd.Function):
    """``x @ weight.T + bias`` and its gradients, each matmul through oneDNN; the transposed operands are
    strided views that oneDNN reads in place."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        rows = x.reshape(-1, x.shape[-1])
        return onednn_mm(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        rows, grad_rows = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        grad_x = onednn_mm(grad_rows, weight.t()).view(x.shape)
        grad_weight = onednn_mm(grad_rows.t(), rows.t())
        return grad_x, grad_weight, grad_rows.sum(0) if ctx.has_bias else None


class OnednnLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type == "cpu" and x.dtype == self.weight.dtype == torch.float32
                and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()):
            return OnednnLinearFunction.apply(x, self.weight, self.bias)
        return super().forward(x)


def convert(model: nn.Module) -> list[str]:
    """Make the blocks' ``nn.Linear`` layers and the LM head ``OnednnLinear`` in place; the names of the layers
    converted. The head's own forward serves generation and the plain loss (training's chunked loss calls
    oneDNN itself): on an AMD CPU a sampled token's logits are several times faster through oneDNN than MKL."""
    converted = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear and (name.startswith("transformer.h.") or name == "lm_head"):
            module.__class__ = OnednnLinear
            converted.append(name)
    return converted


def what_ran(gemm: str, device_type: str, compiled: bool, dtype: str) -> str:
    """What ran a CPU's matmuls in training, where ``gemm`` is ``cpu_gemm``'s choice: oneDNN and BLAS are
    chosen only for eager fp32 code, so a compiled step runs Inductor's choice (``inductor``) and a step under
    autocast PyTorch's own kernels for its dtype (``aten``), whatever the setting."""
    if device_type != "cpu":
        return gemm
    return "inductor" if compiled else gemm if dtype == "fp32" else "aten"
