"""What the chunked training loss costs: the vocabulary-wide buffers its compiled code allocates, and its time.

    python benchmarks/loss_kernels.py                                  # CPU-sized
    python3 benchmarks/loss_kernels.py --rows 16384 --chunk 8192 --vocab 50304 --dim 768   # on a GPU

Every buffer the size of a chunk's logits is memory traffic per logit element: the compiled code's
list shows how many there are and in which dtype (one bf16 buffer for the logits, one for their
gradient, is the fused ideal; an fp32 one means the softmax was written out before the cast).
Times are medians of forward + backward (eager, compiled, and PyTorch's plain ``F.cross_entropy``
on the whole logits), with the device synchronized before each clock read.
"""

from __future__ import annotations

import math
import re
import statistics
import sys
import time
from pathlib import Path

import click
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpt2.model.loss import linear_cross_entropy  # noqa: E402


def vocab_wide_buffers(code: str, elements: int) -> list[str]:
    """The buffers of at least ``elements`` entries that generated code allocates, as 'shape dtype'."""
    found = re.findall(r"empty_strided_\w+\(\(([\d, ]+)\), \([^)]*\), (torch\.\w+)\)", code)
    sizes = [(tuple(int(d) for d in shape.split(",") if d.strip()), dtype) for shape, dtype in found]
    return [f"{shape} {dtype}" for shape, dtype in sizes if shape and math.prod(shape) >= elements]


def median_ms(fn, device: torch.device, repeats: int) -> tuple[float, float]:
    """Median and spread (max - min) in ms of ``fn`` over ``repeats`` calls, after two untimed ones."""
    times = []
    for i in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times), max(times) - min(times)


@click.command()
@click.option("--rows", default=1024, show_default=True, help="positions (micro-batch × T)")
@click.option("--chunk", default=1024, show_default=True, help="train.loss_chunk")
@click.option("--vocab", default=50304, show_default=True)
@click.option("--dim", default=128, show_default=True, help="n_embd")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default=None,
              help="autocast dtype (default: bf16 on a GPU, fp32 on a CPU, where bf16 is often emulated)")
@click.option("--repeats", default=10, show_default=True)
def main(rows: int, chunk: int, vocab: int, dim: int, dtype: str | None, repeats: int) -> None:
    from torch._inductor.utils import run_and_get_code

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bf16" if device.type == "cuda" else "fp32")
    torch.manual_seed(0)
    hidden = torch.randn(rows, dim, device=device, requires_grad=True)
    weight = (0.02 * torch.randn(vocab, dim, device=device)).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device=device)
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=dtype == "bf16")

    def chunked(loss_fn):
        def step():
            with autocast:
                loss = loss_fn(hidden, weight, targets, None, chunk)
            loss.backward()
            hidden.grad = weight.grad = None
        return step

    def plain():
        with autocast:
            loss = F.cross_entropy(F.linear(hidden, weight).float(), targets)
        loss.backward()
        hidden.grad = weight.grad = None

    compiled = torch.compile(linear_cross_entropy)
    started = time.perf_counter()
    _, codes = run_and_get_code(chunked(compiled))
    compile_s = time.perf_counter() - started
    buffers = vocab_wide_buffers("\n".join(codes), min(chunk, rows) * vocab)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{device_name}, torch {torch.__version__}: {rows} positions, chunk {chunk}, V={vocab}, C={dim}, {dtype}; "
          f"compiled in {compile_s:.1f} s")
    print(f"vocabulary-wide buffers of the compiled loss ({len(buffers)}): " + ", ".join(buffers))
    print("| path | ms (median) | spread |\n|---|---|---|")
    for name, fn in (("chunked, eager", chunked(linear_cross_entropy)), ("chunked, compiled", chunked(compiled)),
                     ("plain F.cross_entropy, eager", plain)):
        ms, spread = median_ms(fn, device, repeats)
        print(f"| {name} | {ms:.2f} | {spread:.2f} |")


if __name__ == "__main__":
    main()
