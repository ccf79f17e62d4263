"""The LM head's matmuls on this CPU by library and chunk size, and the step with each (cpu_gemm, loss_chunk).

    python benchmarks/cpu_gemm.py            # GFLOP/s of each shape: MKL (torch), oneDNN (torch), OpenBLAS (numpy)
    python benchmarks/cpu_gemm.py --steps 40 # and the tiny step with each variant, alternating in one process
    python benchmarks/cpu_gemm.py --steps 80 --variants blas:128,blas:512,blas:1024

The shapes are the tiny model's loss at chunks of 128 and 512 rows (128 wide, 50,304 vocabulary) and a square 2048³
for reference. MKL dispatches on the CPU's vendor: on AMD CPUs its fp32 kernels run the 128-row shapes well below the
chip's rate and need more rows, which is why ``train.loss_chunk: auto`` is 512 rows there (128 elsewhere). Each
figure is the best of a few repeats (a shared VM's neighbours only ever slow it down). The step's variants are
``library:chunk`` pairs, run in turn in blocks of 4 steps in one process, the order rotating every block, so the
machine's drift lands on all of them alike.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project, run as copied (no install)

SHAPES = [(2048, 2048, 2048), (128, 128, 50304), (128, 50304, 128), (50304, 128, 128), (512, 128, 50304),
          (512, 50304, 128), (50304, 512, 128)]
NAMES = {(128, 128, 50304): "the logits (one chunk)", (128, 50304, 128): "g @ w", (50304, 128, 128): "g.T @ rows",
         (512, 128, 50304): "the logits, 512 rows", (512, 50304, 128): "g @ w", (50304, 512, 128): "g.T @ rows"}


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

    from gpt2.model.loss import onednn_mm

    lines = ["| shape (M × K × N) | MKL (`a @ b`) | oneDNN (as the loss calls it) | OpenBLAS (numpy) |",
             "|---|---|---|---|"]
    for m, k, n in SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        if NAMES.get((m, k, n)) == "g @ w":  # b is the head's weight, (V, C): read through its transposed view
            call = lambda: onednn_mm(a, b.t())  # noqa: E731
        elif NAMES.get((m, k, n)) == "g.T @ rows":  # a is g's transposed view: the loss computes rows.T @ g
            g, rows_t = torch.randn(k, m), b.t().contiguous()
            call = lambda: onednn_mm(rows_t, g.t())  # noqa: E731
        else:  # the logits: the weight in a linear layer's (out, in) layout
            weight = b.t().contiguous()
            call = lambda: onednn_mm(a, weight)  # noqa: E731
        onednn = gflops(call, m, k, n)
        x, y = a.numpy(), b.numpy()
        name = f"{m:,} × {k:,} × {n:,}" + (f" ({NAMES[(m, k, n)]})" if (m, k, n) in NAMES else "")
        lines.append(f"| {name} | {gflops(lambda: a @ b, m, k, n):.0f} | {onednn:.0f} "
                     f"| {gflops(lambda: x @ y, m, k, n):.0f} |")
    return "\n".join(lines)


def step_ab(steps: int, variants: list[tuple[str, int]]) -> str:
    """The tiny model's training step (defaults: micro-batch 8 × 128, fp32) with each (library, chunk) variant,
    in blocks of 4 steps in one process, the order rotating every block: the machine's drift lands on all."""
    import torch

    from gpt2.model.gpt import GPT, gpt_config
    from gpt2.model.head import Head
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", {}, 50257, True, "flash"), Head(128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, 50257, (8, 128))

    def step() -> None:
        _, loss = model(idx, idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times: dict[tuple[str, int], list[float]] = {v: [] for v in variants}
    for block in range(max(len(variants), steps // 4)):
        shift = block % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            gemm, chunk = variant
            model.set_head(Head(chunk, gemm))
            step()  # the first step after a switch is not timed
            for _ in range(4):
                begun = time.perf_counter()
                step()
                times[variant].append(time.perf_counter() - begun)
    first = statistics.median(times[variants[0]])
    lines = [f"tiny step, median of {len(times[variants[0]])} each (IQR), speed against {variants[0][0]}:"
             f"{variants[0][1]}:"]
    for (gemm, chunk), measured in times.items():
        q = statistics.quantiles(measured, n=4)
        lines.append(f"  {gemm}:{chunk}  {statistics.median(measured) * 1e3:.0f} ms ({(q[2] - q[0]) * 1e3:.0f})  "
                     f"{first / statistics.median(measured):.2f}×")
    return "\n".join(lines)


def parse_variants(text: str) -> list[tuple[str, int]]:
    from gpt2.model.loss import chunk_rows

    variants = []
    for item in text.split(","):
        gemm, _, chunk = item.strip().partition(":")
        if gemm not in ("blas", "onednn") or not (chunk == "auto" or chunk.isdigit()):
            raise click.BadParameter(f"{item!r}: expected library:chunk, e.g. blas:128 or onednn:auto")
        variants.append((gemm, chunk_rows(chunk, "cpu", 50304)))
    return variants


@click.command()
@click.option("--steps", default=0, show_default=True, help="also time this many training steps with each variant")
@click.option("--variants", default="blas:128,blas:512,onednn:auto", show_default=True,
              help="the step's library:chunk pairs, the first the yardstick")
def main(steps: int, variants: str) -> None:
    import platform

    import torch

    from gpt2.model.loss import chunk_rows, cpu_gemm, cpu_vendor
    from gpt2.run.device import keep_freed_memory

    chosen = parse_variants(variants)
    # as a training run does (train.keep_host_memory): without it glibc maps every block above 32 MB afresh, and
    # the 512-row logits (103 MB) would be timed page-faulting their output in
    keep_freed_memory()
    print(f"{platform.machine()}, {cpu_vendor() or 'vendor unknown'}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}; auto here: train.cpu_gemm {cpu_gemm('auto', 'cpu')}, train.loss_chunk "
          f"{chunk_rows('auto', 'cpu', 50304)}\n")
    print(shapes_table())
    if steps:
        print("\n" + step_ab(steps, chosen))


if __name__ == "__main__":
    main()
