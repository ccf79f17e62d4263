"""FP8 matmuls: the blocks' linear layers through torchao's float8 training or through ``RowwiseFp8Linear``
(``train.fp8``), and the LM head's three matmuls in the chunked loss through torch's own FP8 matmul
(``train.fp8_head``).

Each converted ``nn.Linear`` keeps its bf16 or fp32 weight (the optimizer, the checkpoint and every
reader of it see the same tensors as before) and casts weight, input and output gradient to FP8 with a
scale inside its forward and backward. torchao's recipes take e4m3 for the forward's operands, e5m2 for
the gradients: ``tensorwise`` one scale per tensor (the fastest of the two); ``rowwise`` one per row
(closer to bf16, a little slower). The matmuls accumulate in fp32 and return the autocast dtype.

torchao leaves the LM head out: its weight is the token embedding's (tied), and the training loss uses
it inside the chunked loss, not as a module. ``HeadFp8`` gives that loss FP8 operands instead. The
head is GPT-2's widest matmul (50,304 columns), where FP8's matmuls gain the most over their casts.
Layers whose sizes are not multiples of 16 (FP8's tensor cores need them) stay as they are. Every
FP8 layer evaluates (no gradient) as the plain layer it replaced: the training's val loss is the
model's, not FP8's rounding of it.

``rowwise_fwd_dgrad`` is this project's own recipe, without torchao, built so that its casts cost next
to nothing. Every operand is e4m3 with one scale per row (per-row scales keep the range that e5m2 is
for elsewhere). The casts are plain tensor code, so torch.compile fuses each row's scale and cast
into the kernel that produces the operand (the layer norm, GELU, the gradient's producer) instead
of passing over the tensor again; the weight's gradient, which would need every operand cast a
second time in the transposed layout, stays a bf16 matmul.

On a CPU torchao emulates the FP8 matmuls, and torch runs ``_scaled_mm`` with oneDNN: the numerics of
FP8, at a loss of speed. That is what the tests train with.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2.core.errors import UserError

FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first CUDA GPUs with FP8 tensor cores


OWN_RECIPE = "rowwise_fwd_dgrad"


def fp8_sized(module: nn.Module, name: str) -> bool:
    """A blocks' linear layer whose sizes FP8's tensor cores take (multiples of 16)."""
    return (isinstance(module, nn.Linear) and name.startswith("transformer.h.")
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert(model: nn.Module, scaling: str, device: torch.device, dtype: str = "bf16") -> list[str]:
    """Turn the blocks' linear layers into FP8 layers with ``scaling`` (``off``: nothing), on ``device``
    (emulated off CUDA) for a run that computes in ``dtype``; the names of the layers converted."""
    if scaling == "off":
        return []
    require_fp8_device(device, f"train.fp8 {scaling}", "train.fp8: off")
    if scaling == OWN_RECIPE:
        if dtype != "bf16":
            raise UserError(f"train.fp8 {scaling} writes its matmuls' results in bf16 and this run computes in "
                            f"{dtype}; set train.dtype: bf16 (or auto on a GPU), or set train.fp8: off")
        converted = [name for name, module in model.named_modules() if type(module) is nn.Linear
                     and fp8_sized(module, name)]
        for name in converted:
            to_own_recipe(model.get_submodule(name), device)
        return converted
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise UserError(f"train.fp8 {scaling} needs torchao, which is not installed here: pip install torchao "
                        "(or set train.fp8: off)") from None
    config = Float8LinearConfig.from_recipe_name(scaling)
    if device.type != "cuda":
        config = dataclasses.replace(config, emulate=True)
    converted: list[str] = []

    def wanted(module: nn.Module, name: str) -> bool:
        ok = fp8_sized(module, name)
        if ok:
            converted.append(name)
        return ok

    convert_to_float8_training(model, config=config, module_filter_fn=wanted)
    for name in converted:
        layer = model.get_submodule(name)
        layer.__class__ = type(f"{type(layer).__name__}TrainingOnly", (PlainEvaluation, type(layer)), {})
    return converted


class PlainEvaluation(nn.Module):
    """Put before an FP8 linear layer's class: evaluation (no gradient) runs the plain layer, so that the val
    loss measures the model the run trained, as the evaluate stage's does, not FP8's rounding of it."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            return super().forward(x)
        return F.linear(x, self.weight, self.bias)


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# softmax minus one-hot lies in [-1, 1]: this fixed scale puts it under e5m2's largest value (57,344) with no
# pass to find its maximum, and keeps probabilities down to about 5e-10 from rounding to zero
GRAD_SCALE = 2.0**15


def head_fp8_check(n_embd: int, vocab_rows: int, rows: int, chunk: int, fused_loss: bool) -> None:
    """Refuse ``train.fp8_head`` where its matmuls cannot run: FP8 tensor cores take sizes that are multiples
    of 16, and the head's FP8 path is part of the chunked loss."""
    if fused_loss or chunk == 0:
        raise UserError("train.fp8_head runs the LM head's matmuls inside the chunked loss; set train.loss_chunk "
                        "auto (or > 0) and train.loss_kernel: torch, or set train.fp8_head: false")
    sizes = {"model.n_embd": n_embd, "the vocabulary rows (model.pad_vocab: true pads 50,257 to 50,304)": vocab_rows,
             "the positions per micro-batch (micro_batch_size x block_size)": rows, "train.loss_chunk": chunk}
    odd = [f"{name} = {size}" for name, size in sizes.items() if size % 16]
    if odd:
        raise UserError(f"train.fp8_head needs sizes that are multiples of 16 (FP8 tensor cores): {'; '.join(odd)}; "
                        "change them or set train.fp8_head: false")


def require_fp8_device(device: torch.device, setting: str, off: str) -> None:
    """FP8 tensor cores, or a CPU (FP8's numerics, not its speed); else a UserError naming ``setting`` and how to
    turn it ``off``."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        name, capability = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
        raise UserError(f"{setting}: {name} (compute capability {capability[0]}.{capability[1]}) has no FP8 tensor "
                        f"cores (8.9 and newer: Ada, Hopper, Blackwell); set {off}")
    if device.type not in ("cuda", "cpu"):
        raise UserError(f"{setting} runs on CUDA (or a CPU), not on {device.type}; set {off}")


def to_fp8(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` scaled so that its largest magnitude is ``dtype``'s, rounded to ``dtype``; and the fp32 scale that
    undoes it (what ``torch._scaled_mm`` multiplies the product by)."""
    amax = t.detach().abs().amax().float().clamp(min=1e-12)
    largest = torch.finfo(dtype).max
    scale = largest / amax
    return (t.float() * scale).clamp(-largest, largest).to(dtype), scale.reciprocal()  # e4m3 has no inf: NaN past it


class HeadFp8:
    """The LM head's weight in FP8 (e4m3, one scale) for one forward, in both layouts its matmuls read.

    ``torch._scaled_mm`` takes its first operand row-major and its second column-major. The logits read the
    weight (V, C) as its transpose, which is column-major as it is stored; the hidden states' gradient reads
    it untransposed, from a transposed copy. Each chunk's hidden states take their own scale; the loss's
    gradient (softmax minus one-hot) takes ``GRAD_SCALE`` and e5m2, as FP8 training does for gradients."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.weight_scale = to_fp8(weight, E4M3)
        self.weight_t = self.weight.t().contiguous()
        self.grad_scale = torch.tensor(1.0 / GRAD_SCALE, device=weight.device)

    def logits(self, rows: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``rows @ weight.T`` in ``out_dtype`` from FP8 operands, and the rows in FP8 for ``grads``."""
        x, x_scale = to_fp8(rows, E4M3)
        logits = torch._scaled_mm(x, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale, out_dtype=out_dtype)
        return logits, (x, x_scale)

    def grads(self, g: torch.Tensor, rows_fp8: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``g @ weight`` (the hidden states' gradient) and ``g.T @ rows`` (the weight's), both fp32."""
        x, x_scale = rows_fp8
        g8 = (g * GRAD_SCALE).to(E5M2)
        grad_hidden = torch._scaled_mm(g8, self.weight_t.t(), scale_a=self.grad_scale, scale_b=self.weight_scale,
                                       out_dtype=torch.float32)
        grad_weight = torch._scaled_mm(g8.t().contiguous(), x.t().contiguous().t(), scale_a=self.grad_scale,
                                       scale_b=x_scale, out_dtype=torch.float32)
        return grad_hidden, grad_weight


def rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (2-D) in e4m3, each row scaled so that its largest magnitude is e4m3's largest, row-major; and the
    (rows, 1) fp32 scales that undo it. Under compile this fuses into the kernel that computes ``t``."""
    largest = torch.finfo(E4M3).max
    amax = t.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = largest / amax
    return (t.float() * scale).clamp(-largest, largest).to(E4M3).contiguous(), scale.reciprocal()


def to_own_recipe(layer: nn.Linear, device: torch.device) -> None:
    """Make ``layer`` (in place, parameters untouched) a ``RowwiseFp8Linear`` running on ``device``."""
    layer.__class__ = RowwiseFp8Linear
    layer.emulated = device.type == "cpu" and not cpu_has_rowwise_matmul()


@functools.cache
def cpu_has_rowwise_matmul() -> bool:
    """Whether this torch's ``_scaled_mm`` on a CPU takes one scale per row (2.13's does, through oneDNN; 2.11's
    takes one per tensor only)."""
    a = torch.ones(16, 16).to(E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def rowwise_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
               out_dtype: torch.dtype, emulated: bool, fast_accum: bool = False) -> torch.Tensor:
    """``(a · scale_a) @ (b · scale_b)`` for e4m3 ``a`` (M, K) row-major and ``b`` (K, N) column-major, ``scale_a``
    (M, 1), ``scale_b`` (1, N). ``emulated``: the same products of e4m3 values in fp32 (exact) and fp32 sums, where
    the CPU's ``_scaled_mm`` has no per-row scales."""
    if emulated:
        return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum)


class RowwiseFp8Matmul(torch.autograd.Function):
    """``x @ weight.T`` with the forward's and the input gradient's matmuls in FP8 (e4m3, one scale per row of
    each operand), the weight's gradient a matmul in ``x``'s dtype. ``torch._scaled_mm`` takes its first
    operand row-major and its second column-major, with the scales of the first's rows and the second's
    columns: the weight is cast once as it is stored for the forward, and once transposed (a copy of a few MB)
    for the input gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, emulated: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.emulated = emulated
        x8, x_scale = rowwise(x)
        w8, w_scale = rowwise(weight)
        return rowwise_mm(x8, w8.t(), x_scale, w_scale.t(), x.dtype, emulated, fast_accum=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        g8, g_scale = rowwise(grad)
        wt8, wt_scale = rowwise(weight.t())
        grad_x = rowwise_mm(g8, wt8.t(), g_scale, wt_scale.t(), grad.dtype, ctx.emulated)
        return grad_x, (grad.t() @ x).to(weight.dtype), None


class RowwiseFp8Training(nn.Linear):
    """An ``nn.Linear`` (the same parameters under the same names) whose matmuls run as ``RowwiseFp8Matmul`` in
    bf16, as ``train.fp8: rowwise_fwd_dgrad`` asks; the bias is added in bf16, where compile fuses it into the
    next kernel. ``emulated``: FP8's products in fp32 matmuls (a CPU whose ``_scaled_mm`` lacks per-row scales)."""

    emulated = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
            y = RowwiseFp8Matmul.apply(rows, self.weight, self.emulated).view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias.to(torch.bfloat16)


class RowwiseFp8Linear(PlainEvaluation, RowwiseFp8Training):
    """``RowwiseFp8Training`` for training, the plain layer for evaluation."""
