"""The LM head's matmuls on this CPU by library, and the step with either (train.cpu_gemm).

    python benchmarks/cpu_gemm.py            # GFLOP/s of each shape: MKL (torch), oneDNN (torch), OpenBLAS (numpy)
    python benchmarks/cpu_gemm.py --steps 40 # and the tiny step, blas against onednn, alternating in one process

The shapes are the tiny model's loss at its default chunk (128 rows, 128 wide, 50,304 vocabulary) and a square
2048³ for reference. MKL dispatches on the CPU's vendor: on AMD CPUs its fp32 kernels run these shapes well below
the chip's rate, which is why ``train.cpu_gemm: auto`` sends the logits' matmul to oneDNN there. Each figure is
the best of a few repeats (a shared VM's neighbours only ever slow it down).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project, run as copied (no install)

SHAPES = [(2048, 2048, 2048), (128, 128, 50304), (128, 50304, 128), (50304, 128, 128)]
NAMES = {(128, 128, 50304): "the logits (one chunk)", (128, 50304, 128): "g @ w", (50304, 128, 128): "g.T @ rows"}


def gflops(work, m: int, k: int, n: int, reps: int = 10, rounds: int = 3) -> float:
    work()
    best = float("inf")
    for _ in range(rounds):
        begun = time.perf_counter()
        for _ in range(reps):
            work()
        best = min(best, (time.perf_counter() - begun) / reps)
    return 2 * m * k * n / best / 1e9


def shapes_table() -> str:
    import torch

    lines = ["| shape (M × K × N) | MKL (`a @ b`) | oneDNN | OpenBLAS (numpy) |", "|---|---|---|---|"]
    for m, k, n in SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        weight = b.t().contiguous()  # a linear layer's (out, in) layout
        onednn = gflops(lambda: torch.ops.mkldnn._linear_pointwise(a, weight, None, "none", [], ""), m, k, n)
        x, y = a.numpy(), b.numpy()
        name = f"{m:,} × {k:,} × {n:,}" + (f" ({NAMES[(m, k, n)]})" if (m, k, n) in NAMES else "")
        lines.append(f"| {name} | {gflops(lambda: a @ b, m, k, n):.0f} | {onednn:.0f} "
                     f"| {gflops(lambda: x @ y, m, k, n):.0f} |")
    return "\n".join(lines)


def step_ab(steps: int) -> str:
    """The tiny model's training step (defaults: micro-batch 8 × 128, fp32) with each library, in blocks of 4
    steps alternating in one process: the machine's drift lands on both."""
    import torch

    from gpt2.model.gpt import GPT, gpt_config

    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", {}, 50257, True, "flash"), loss_chunk=128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, 50257, (8, 128))

    def step() -> None:
        _, loss = model(idx, idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"blas": [], "onednn": []}
    for block in range(max(2, steps // 4)):
        for gemm in ("blas", "onednn") if block % 2 == 0 else ("onednn", "blas"):
            model.logits_gemm = gemm
            step()  # the first step after a switch is not timed
            for _ in range(4):
                begun = time.perf_counter()
                step()
                times[gemm].append(time.perf_counter() - begun)
    blas, onednn = (statistics.median(times[g]) * 1e3 for g in ("blas", "onednn"))
    return (f"tiny step, median of {len(times['blas'])} each: blas {blas:.0f} ms, onednn {onednn:.0f} ms: "
            f"{blas / onednn:.2f}× with oneDNN")


@click.command()
@click.option("--steps", default=0, show_default=True, help="also time this many training steps with each library")
def main(steps: int) -> None:
    import platform

    import torch

    from gpt2.model.loss import cpu_gemm, cpu_vendor

    print(f"{platform.machine()}, {cpu_vendor() or 'vendor unknown'}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}; train.cpu_gemm auto here: {cpu_gemm('auto', 'cpu')}\n")
    print(shapes_table())
    if steps:
        print("\n" + step_ab(steps))


if __name__ == "__main__":
    main()
