"""Out of device memory as an answer: what did not fit, what the memory model expected, what to change.

A CUDA out-of-memory error is a traceback ending in allocator statistics; what a user needs is the
micro-batch to try next. The smaller micro-batch comes with the accumulation that keeps the batch,
and so the run's result, the same.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gpt2.core.errors import UserError
from gpt2.train.build import Setup


def is_cpu_out_of_memory(exc: BaseException) -> bool:
    """PyTorch's CPU allocator says it with a RuntimeError (a micro-batch too large for the RAM, ``ulimit -v``)."""
    return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)


def smaller_micro_batch(micro_batch: int, accum: int) -> tuple[int, int] | None:
    """The largest smaller micro-batch that divides this one, with the accumulation keeping the batch."""
    for size in range(micro_batch // 2, 0, -1):
        if micro_batch % size == 0:
            return size, accum * micro_batch // size
    return None


def out_of_memory_error(exc: BaseException, s: Setup, ckpt_path: Path) -> UserError:
    """The one-line error for an out-of-memory failure of this run (exit status 2)."""
    cfg, device = s.params.train, s.runtime.device
    capacity = ""
    if device.type == "cuda":
        capacity = f" of {torch.cuda.get_device_properties(device).total_memory / 1e9:.1f} GB"
    elif device.type == "cpu":
        import psutil

        capacity = f" ({psutil.virtual_memory().total / 1e9:.1f} GB of RAM)"
    micro, accum = s.batch.micro, s.batch.accum
    what = (f"out of memory on {device}{capacity} at micro-batch {micro} × {s.seq_len} tokens "
            f"({s.params.model.size}, {s.runtime.dtype}); the memory model expected "
            f"{s.recipe.bytes(micro) / 1e9:.1f} GB")
    smaller = smaller_micro_batch(micro, accum)
    if cfg.micro_batch_size == "auto" and smaller:
        fix = (f"auto chose {micro}: raise train.memory_margin (now {cfg.memory_margin:g}) so it leaves more free, "
               f"or set train.micro_batch_size {smaller[0]}")
    elif smaller and cfg.batch_tokens is not None:
        fix = f"set train.micro_batch_size {smaller[0]} (train.batch_tokens keeps the batch) or auto"
    elif smaller:
        fix = (f"set train.micro_batch_size {smaller[0]} and train.grad_accum_steps {smaller[1]} (the same batch "
               f"of {micro * accum} sequences), or smaller; or train.micro_batch_size auto with "
               f"train.batch_tokens {s.tokens_per_step} and train.grad_accum_steps 1")
    else:
        fix = "one sequence does not fit: a smaller model.size or train.block_size, or bf16 (train.dtype auto)"
    kept = (f"the last checkpoint ({ckpt_path}) is intact and train.resume auto continues from it"
            if ckpt_path.exists() else "no checkpoint was written")
    cause = "the CPU allocator failed" if is_cpu_out_of_memory(exc) else type(exc).__name__
    return UserError(f"{what}: {fix}; {kept} ({cause})")
