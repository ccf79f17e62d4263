"""FP8 matmuls for the blocks' linear layers, through torchao's float8 training (``train.fp8``).

Each converted ``nn.Linear`` keeps its bf16 or fp32 weight (the optimizer, the checkpoint and every
reader of it see the same tensors as before) and casts weight, input and output gradient to FP8 with a
scale inside its forward and backward: e4m3 for the forward's operands, e5m2 for the gradients.
``tensorwise`` takes one scale per tensor (the fastest); ``rowwise`` one per row (closer to bf16, a
little slower). The matmuls accumulate in fp32 and return the autocast dtype.

The LM head is left out: its weight is the token embedding's (tied), and the training loss uses it
inside the chunked or fused loss, not as a module. Layers whose sizes are not multiples of 16 (FP8's
tensor cores need them) stay as they are.

On a CPU torchao emulates the FP8 matmuls: the numerics of FP8, at a loss of speed. That is what the
tests train with.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from gpt2.core.errors import UserError

FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first CUDA GPUs with FP8 tensor cores


def convert(model: nn.Module, scaling: str, device: torch.device) -> list[str]:
    """Turn the blocks' linear layers into torchao's Float8Linear with ``scaling`` (``off``: nothing), on
    ``device`` (emulated off CUDA); the names of the layers converted."""
    if scaling == "off":
        return []
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        name, capability = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
        raise UserError(f"train.fp8 {scaling}: {name} (compute capability {capability[0]}.{capability[1]}) has no FP8 "
                        "tensor cores (8.9 and newer: Ada, Hopper, Blackwell); set train.fp8: off")
    if device.type not in ("cuda", "cpu"):
        raise UserError(f"train.fp8 {scaling} runs on CUDA (or emulated on a CPU), not on {device.type}; "
                        "set train.fp8: off")
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
        ok = (isinstance(module, nn.Linear) and name.startswith("transformer.h.")
              and module.in_features % 16 == 0 and module.out_features % 16 == 0)
        if ok:
            converted.append(name)
        return ok

    convert_to_float8_training(model, config=config, module_filter_fn=wanted)
    return converted
