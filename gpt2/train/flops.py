"""FLOPs, model FLOPs utilization (MFU) and memory napkin math."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at run time: `gpt2 plan` reads the peak table without importing torch
    from gpt2.model.gpt import GPTConfig

# Dense peak TFLOP/s (no sparsity) by device-name substring and dtype. "fp32" is plain FP32;
# "tf32" is FP32 matmuls on tensor cores. Checked against the vendors' data sheets.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},  # SXM
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}


def flops_per_token(cfg: GPTConfig, n_params_without_wpe: int, seq_len: int) -> float:
    """nanoGPT's estimate for a forward + backward pass: 6·N + 12·n_layer·n_embd·T."""
    return 6.0 * n_params_without_wpe + 12.0 * cfg.n_layer * cfg.n_embd * seq_len


def peak_flops(device_name: str, dtype: str, tf32: bool, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s for this device and dtype, or None when unknown (then MFU is not reported)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    kind = "tf32" if dtype == "fp32" and tf32 else dtype
    for key, table in PEAK_TFLOPS.items():  # ordered: "H100 PCIe" before "H100"
        if key in device_name and kind in table:
            return table[kind] * 1e12
    return None


def training_memory_gb(n_params: int) -> float:
    """Weights, gradients and AdamW state in mixed precision: about 16 bytes per parameter."""
    return 16 * n_params / 1e9
