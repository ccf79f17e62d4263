"""The batch of a run: how many sequences each forward and backward takes, and how many it accumulates.

``train.batch_tokens`` fixes the optimizer's batch, the figure that shapes the result. How it is cut
into micro-batches only changes speed and memory: the sampler draws a step's windows in one seeded
stream, so a micro-batch of 4 accumulated 8 times trains on the same sequences as one of 32 (the
sum of their gradients differs in the last bits only).

``train.micro_batch_size: auto`` takes the largest micro-batch that divides the batch and that
the memory model (gpt2/core/memory_model.py, also ``gpt2 plan``'s) fits in the device's free memory, less
``train.memory_margin``. The estimate is of eager PyTorch. Compiled runs of GPT-2 124M peaked under it at
micro-batch 64 and 4% over it at 256: the margin covers that. Without device memory to size against
(CPU, MPS) auto keeps the default micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpt2.core.config import TrainConfig
from gpt2.core.errors import UserError
from gpt2.core.memory_model import Shape, memory
from gpt2.model.gpt import GPT

DEFAULT_MICRO_BATCH = TrainConfig.micro_batch_size


@dataclass(frozen=True)
class Batch:
    micro: int  # sequences per forward and backward, on each rank
    accum: int  # micro-batches per optimizer step
    why: str  # how the micro-batch was chosen, for the log


@dataclass(frozen=True)
class Recipe:
    """What the memory model needs to know of a run besides the micro-batch."""

    shape: Shape
    seq: int
    amp: bool
    flash: bool
    loss_chunk: int
    optimizer: str
    shards: int  # ranks the weights are split over (fsdp), else 1
    fp8_head: bool = False  # train.fp8_head: the loss's FP8 gradients add 2 bytes per token and vocabulary column

    def bytes(self, micro: int) -> float:
        return memory(self.shape, micro, self.seq, self.amp, self.flash, self.loss_chunk, self.optimizer,
                      self.shards, self.fp8_head).total


def model_shape(model: GPT) -> Shape:
    m = model.cfg
    return Shape(m.n_layer, m.n_head, m.n_embd, m.padded_vocab_size, model.num_params(),
                 model.num_params(exclude_position_embedding=True))


def free_bytes(device: torch.device) -> int | None:
    """Memory this process can still allocate on ``device``; None where there is no figure to trust."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


def resolve_batch(cfg: TrainConfig, recipe: Recipe, world: int, device: torch.device) -> Batch:
    """The micro-batch and accumulation of this run on this device."""
    if cfg.batch_tokens is None:
        return Batch(int(cfg.micro_batch_size), cfg.grad_accum_steps, "train.micro_batch_size")
    per_rank = sequences_per_rank(cfg.batch_tokens, recipe.seq, world)
    if cfg.micro_batch_size != "auto":
        micro = cfg.micro_batch_size
        if per_rank % micro:
            raise UserError(f"train.batch_tokens {cfg.batch_tokens:,} is {per_rank} sequences per rank, which "
                            f"train.micro_batch_size {micro} does not divide; set it to a divisor of {per_rank} "
                            f"({', '.join(map(str, divisors(per_rank)[:6]))}, ...) or to auto")
        return Batch(micro, per_rank // micro, "train.micro_batch_size, with train.batch_tokens")
    sizes = divisors(per_rank)  # largest first
    free = free_bytes(device)
    if free is None:
        micro = next(d for d in sizes if d <= DEFAULT_MICRO_BATCH)
        return Batch(micro, per_rank // micro, f"auto on {device.type}: no device memory to size against, so the "
                                              f"default {DEFAULT_MICRO_BATCH} (or its largest divisor of {per_rank})")
    budget = (1 - cfg.memory_margin) * free
    micro = next((d for d in sizes if recipe.bytes(d) <= budget), 0)
    if micro == 0:
        raise UserError(f"train.micro_batch_size auto: not even one sequence of {recipe.seq} tokens fits on {device}: "
                        f"the memory model expects {recipe.bytes(1) / 1e9:.1f} GB, {budget / 1e9:.1f} GB are usable "
                        f"({free / 1e9:.1f} GB free less train.memory_margin {cfg.memory_margin:g}); shard the model "
                        "over several GPUs (train.distributed fsdp), use bf16, or a shorter train.block_size")
    why = (f"auto: the memory model expects {recipe.bytes(micro) / 1e9:.2f} GB of the {budget / 1e9:.2f} GB usable "
           f"on {device} ({free / 1e9:.2f} GB free less train.memory_margin {cfg.memory_margin:g})")
    larger = [d for d in sizes if d > micro]
    if larger:
        why += f"; {larger[-1]} would need {recipe.bytes(larger[-1]) / 1e9:.2f} GB"
    return Batch(micro, per_rank // micro, why)


def sequences_per_rank(batch_tokens: int, seq: int, world: int) -> int:
    per_rank, rest = divmod(batch_tokens, seq * world)
    if rest or per_rank == 0:
        unit = seq * world
        nearest = sorted({max(unit, batch_tokens // unit * unit), (batch_tokens // unit + 1) * unit})
        raise UserError(f"train.batch_tokens {batch_tokens:,} is not a whole number of sequences on every rank: it "
                        f"must be a multiple of {seq} tokens × {world} rank(s) = {unit:,}; the nearest are "
                        f"{' and '.join(f'{n:,}' for n in nearest)}")
    return per_rank


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, largest first."""
    return [d for d in range(n, 0, -1) if n % d == 0]
