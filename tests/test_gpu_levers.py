"""benchmarks/gpu_levers.py's tables, run on a CPU at small shapes: a GPU session spends no device time finding out
that the script breaks."""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_levers  # noqa: E402

from gpt2.model.fp8 import cpu_has_rowwise_matmul  # noqa: E402


def test_the_attention_table_checks_every_kernel_against_math_and_names_what_is_missing(capsys):
    kernels = gpu_levers.attention("cpu", batch=1, heads=2, seq=64, head_dim=16)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in capsys.readouterr().out.splitlines()[2:]}
    assert [k["kernel"] for k in kernels] == list(rows)  # the rows gpu_next.py's go/no-go reads (--json)
    flash = next(k for k in kernels if k["kernel"] == "flash (SDPA)")
    assert flash["forward_ms"] > 0 and flash["backward_ms"] > 0 and 0 < flash["output_diff"] < 0.05
    assert next(k for k in kernels if k["kernel"] == "cuDNN (SDPA)")["unavailable"]
    assert list(rows) == ["math (reference)", "flash (SDPA)", "cuDNN (SDPA)", "memory-efficient (SDPA)",
                          "FA3 (SDPA's flash backend)", "FA4 (SDPA's flash backend)", "FlexAttention (compiled)"]
    output_diff, gradient_diff = (float(x) for x in rows["flash (SDPA)"].split(" | ")[-1].rstrip(" |").split(", "))
    assert 0 < output_diff < 0.05 and 0 < gradient_diff < 0.1  # another kernel than math's, and a right one
    assert "unavailable: " in rows["cuDNN (SDPA)"]  # a CPU has no cuDNN: the row says so and the table goes on
    assert "unavailable: FlexAttention does not support backward on CPU" in rows["FlexAttention (compiled)"]


def test_the_fp8_matmul_table_times_bf16_and_both_fp8_scalings(capsys):
    [shape_row] = gpu_levers.fp8_gemms("cpu", {"a small one": (64, 32, 48)})
    assert shape_row["bf16_ms"] > 0 and (shape_row["rowwise_ms"] is not None) == cpu_has_rowwise_matmul()
    row = capsys.readouterr().out.splitlines()[2]
    shape, *cells = row.strip("| ").split(" | ")
    timed = [re.fullmatch(r"\d+\.\d{3} \(\d+\)", cell) is not None for cell in cells]  # ms (TFLOP/s)
    # torch 2.13's CPU runs both FP8 scalings (oneDNN); 2.11's has one scale per tensor only, which the row says
    assert shape == "a small one: 64 × 32 × 48" and timed == [True, True, cpu_has_rowwise_matmul()]
    assert all(ok or cell.startswith("failed: ") for ok, cell in zip(timed, cells))
