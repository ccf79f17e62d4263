"""FLOPs per token and the peak FLOP/s that model FLOPs utilization (MFU) divides by."""

from __future__ import annotations

from dataclasses import dataclass

# torch-free: `gpt2 plan` reads the peak table and the FLOPs formula without importing torch
# Dense peak TFLOP/s (no sparsity) by GPU model and dtype, from the vendors' data sheets. "fp32" is
# plain FP32; "tf32" is FP32 matmuls on tensor cores; GeForce figures are FP16/BF16 with FP32
# accumulation (what autocast uses). Keys are matched as whole words in torch's device name, the
# longest first, so "NVIDIA L40S" is not an L4 and "NVIDIA H100 NVL" not an H100 SXM.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},  # SXM ("NVIDIA H100 80GB HBM3")
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},  # SXM
    "H200 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0},
    "H800": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},  # SXM
    "H800 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "GH200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "L40": {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
    "RTX 3090": {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}


def device_key(device_name: str) -> str | None:
    """The PEAK_TFLOPS key naming this GPU: the longest key found as whole words in the name."""
    import re

    found = [key for key in PEAK_TFLOPS if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name)]
    return max(found, key=len) if found else None


def flops_per_token(n_params_without_wpe: int, n_layer: int, n_embd: int, seq_len: int) -> tuple[float, float]:
    """nanoGPT's estimate for a forward + backward pass, in its two parts: (6·N, attention 12·n_layer·n_embd·T)."""
    return 6.0 * n_params_without_wpe, 12.0 * n_layer * n_embd * seq_len


def llmc_share(n_params_without_wpe: int, n_layer: int, n_embd: int, seq_len: int,
               block_size: int | None = None) -> float:
    """llm.c's count of a token's FLOPs over nanoGPT's (this project's and nanochat's): llm.c counts every
    parameter, the position embedding's too, and only the causal half of attention (6·n_layer·n_embd·T where
    nanoGPT counts the whole square). An MFU here times this is the same run's MFU in llm.c's count, which a
    comparison with llm.c's figures needs: 0.939 for GPT-2 124M at T = 1024. ``block_size``: the position
    embedding's rows (``seq_len`` where not given)."""
    dense, attention = flops_per_token(n_params_without_wpe, n_layer, n_embd, seq_len)
    position = (block_size or seq_len) * n_embd
    return (6.0 * (n_params_without_wpe + position) + attention / 2) / (dense + attention)


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float | None, world: int) -> float | None:
    """Model FLOPs utilization: the FLOP/s the model's arithmetic needs at this speed over the peak."""
    return flops_per_token * tokens_per_s / (peak_flops * world) if peak_flops else None


@dataclass(frozen=True)
class Throughput:
    """A run's speed figures, computed one way for the log line and the summary alike."""

    tokens_per_step: int  # the whole job's: micro-batch × sequence × accumulation × ranks
    flops_per_token: float
    world: int
    peak_flops: float | None  # per device: MFU's yardstick, the bf16 peak where bf16 is native
    dtype_peak_flops: float | None  # per device: the run's own dtype's peak where it differs (fp32, tf32)
    mfu_against: str = ""  # where the peaks come from (gpt2/run/mfu.py)

    def tokens_per_s(self, step_s: float) -> float:
        return self.tokens_per_step / step_s

    def mfu(self, tokens_per_s: float) -> float | None:
        return mfu(self.flops_per_token, tokens_per_s, self.peak_flops, self.world)

    def mfu_dtype(self, tokens_per_s: float) -> float | None:
        return mfu(self.flops_per_token, tokens_per_s, self.dtype_peak_flops, self.world)


def peak_flops(device_name: str, dtype: str, tf32: bool) -> float | None:
    """Peak FLOP/s for this device and dtype, or None when unknown."""
    kind = "tf32" if dtype == "fp32" and tf32 else dtype
    key = device_key(device_name)
    peak = PEAK_TFLOPS[key].get(kind) if key else None
    return peak * 1e12 if peak else None


def yardstick_flops(device_name: str, override_tflops: float | None = None) -> float | None:
    """The peak MFU divides by, whatever the run's dtype: the card's dense bf16 peak (fp16 on cards
    without bf16), so an fp32 run and a bf16 run are measured against the same number, as the peers
    measure theirs. None when unknown (then MFU is not reported)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    return peak_flops(device_name, "bf16", False) or peak_flops(device_name, "fp16", False)


def dtype_peak_flops(device_name: str, dtype: str, tf32: bool, override_tflops: float | None = None) -> float | None:
    """The run's own dtype's peak where it differs from the yardstick (fp32 and tf32 runs), else None."""
    own = peak_flops(device_name, dtype, tf32)
    return own if own is not None and own != yardstick_flops(device_name, override_tflops) else None
