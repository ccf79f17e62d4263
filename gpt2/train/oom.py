"""Out of device memory as an answer: what did not fit, what the memory model expected, what to change.

A CUDA out-of-memory error is a traceback ending in allocator statistics; what a user needs is the
micro-batch to try next. The smaller micro-batch comes with the accumulation that keeps the batch,
and so the run's result, the same.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gpt2.core.errors import UserError
from gpt2.train.setup import Setup


def expected_gb(s: Setup) -> float:
    """What ``gpt2 plan``'s memory model expects this run to need on one device, in GB."""
    from gpt2.measure.plan import Shape, memory

    cfg, m = s.params.train, s.model_cfg
    shape = Shape(m.n_layer, m.n_head, m.n_embd, m.padded_vocab_size, s.model.num_params(),
                  s.model.num_params(exclude_position_embedding=True))
    return memory(shape, cfg.micro_batch_size, s.seq_len, amp=s.runtime.dtype in ("bf16", "fp16"),
                  flash=m.attention == "flash", loss_chunk=cfg.loss_chunk).total / 1e9


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
    what = (f"out of memory on {device}{capacity} at micro-batch {cfg.micro_batch_size} × {s.seq_len} tokens "
            f"({s.params.model.size}, {s.runtime.dtype}); the memory model expected {expected_gb(s):.1f} GB")
    smaller = smaller_micro_batch(cfg.micro_batch_size, cfg.grad_accum_steps)
    if smaller:
        fix = (f"set train.micro_batch_size {smaller[0]} and train.grad_accum_steps {smaller[1]} (the same batch "
               f"of {cfg.micro_batch_size * cfg.grad_accum_steps} sequences), or smaller")
    else:
        fix = "one sequence does not fit: a smaller model.size or train.block_size, or bf16 (train.dtype auto)"
    kept = (f"the last checkpoint ({ckpt_path}) is intact and train.resume auto continues from it"
            if ckpt_path.exists() else "no checkpoint was written")
    return UserError(f"{what}: {fix}; {kept} ({type(exc).__name__})")
