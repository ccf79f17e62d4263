"""What MFU divides by, and what a run faster than that peak does to it.

The peak is ``train.peak_tflops`` if set, a GPU's data sheet, or a CPU's measured matmul peak
(gpt2/run/peak.py). The yardstick is the bf16 peak where bf16 is native, whatever the run's dtype, so
fp32 and bf16 runs compare on one scale; the run's own dtype's peak is kept beside it where it differs.
Model FLOP/s above the peak mean the peak is wrong, so ``raised`` returns the figures a run goes on with:
MFU never reads above 100%.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from gpt2.core import log
from gpt2.run.device import Runtime
from gpt2.run.flops import Throughput, dtype_peak_flops, yardstick_flops
from gpt2.run.peak import cache_path, cpu_peaks, raise_to_run

logger = log.get("train")

CPU_PEAK = "this CPU's measured matmul peak "


def mfu_peaks(runtime: Runtime, peak_tflops: float | None, main: bool = True) -> dict[str, Any]:
    """The peaks of this device (``peak_flops``, ``dtype_peak_flops``) and where they come from (``mfu_against``);
    a CPU's is measured by the ``main`` rank only, the others read it if it is kept."""
    if peak_tflops is not None or runtime.device.type != "cpu":
        return {"peak_flops": yardstick_flops(runtime.device_name, peak_tflops),
                "dtype_peak_flops": dtype_peak_flops(runtime.device_name, runtime.dtype, runtime.tf32, peak_tflops),
                "mfu_against": "train.peak_tflops" if peak_tflops is not None else "the data sheet's dense peak"}
    started = time.perf_counter()
    peaks, fresh = cpu_peaks(may_measure=main)
    if peaks is None:
        return {"peak_flops": None, "dtype_peak_flops": None, "mfu_against": "rank 0's measured CPU peak"}
    figures = cpu_peak_figures(peaks, runtime.dtype)
    if fresh:
        logger.info(f"train: measured this CPU's matmul peak in {time.perf_counter() - started:.1f} s: "
                    f"{figures['mfu_against'].removeprefix(CPU_PEAK).strip('()')} (kept in {cache_path()}; `gpt2 peak` "
                    "measures it again)")
    if peaks.get("under_load"):
        logger.warning(f"the CPU's matmul peak was measured under load ({100 * peaks.get('load', 0):.0f}% of the "
                       "cores busy with other work): it may read low and MFU high; the next run on a quiet machine "
                       "measures it again, and a run faster than it raises it")
    return figures


def cpu_peak_figures(peaks: dict[str, Any], dtype: str) -> dict[str, Any]:
    """MFU's yardstick (bf16's peak where native, else fp32's) and the run's own dtype's where it differs."""
    shown = ", ".join(f"{kind} {peaks[kind] / 1e12:.2f} TFLOP/s" for kind in ("bf16", "fp32") if peaks.get(kind))
    yardstick = max(peaks.get("bf16") or 0.0, peaks["fp32"])
    own = peaks.get(dtype)
    return {"peak_flops": yardstick, "dtype_peak_flops": own if own and own != yardstick else None,
            "mfu_against": f"{CPU_PEAK}({shown})"}


def raised(t: Throughput, tokens_per_s: float, dtype: str) -> tuple[Throughput, str] | None:
    """Where a run goes faster than the peak MFU divides by: the figures with the peak raised to this rate, and
    the warning that says so; None when the rate is within the peak.

    A CPU's kept peak (measured beside other work, most likely) is raised for later runs too; a
    ``train.peak_tflops`` set too low is raised for this run only."""
    achieved = t.flops_per_token * tokens_per_s / t.world
    own = t.dtype_peak_flops or t.peak_flops
    if own is None or achieved <= own:
        return None
    if t.mfu_against.startswith(CPU_PEAK):
        kind = dtype if dtype in ("fp32", "bf16") else "fp32"
        figures = cpu_peak_figures(raise_to_run(kind, achieved), dtype)
        return (dataclasses.replace(t, **figures),
                f"this run reached {achieved / 1e12:.3f} TFLOP/s in {kind}, above the kept CPU matmul peak of "
                f"{own / 1e12:.3f} (measured beside other work, most likely): the peak is raised to this run's rate "
                f"for this and later runs (kept in {cache_path()}; `gpt2 peak` on a quiet machine measures it again)")
    which = "dtype_peak_flops" if t.dtype_peak_flops else "peak_flops"
    higher = {which: achieved}
    if which == "dtype_peak_flops" and t.peak_flops:
        higher["peak_flops"] = max(t.peak_flops, achieved)
    return (dataclasses.replace(t, **higher),
            f"this run reached {achieved / 1e12:.1f} TFLOP/s, above the peak MFU divides by ({own / 1e12:.1f}, "
            f"{t.mfu_against}): MFU divides by this run's rate from here; set train.peak_tflops to the device's "
            "dense bf16 peak")
