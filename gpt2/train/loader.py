"""Batches of (input, target) token windows, with the loading and batching switches.

- ``data_loading``: ``preload`` reads the split into RAM once; ``memmap`` opens
  the file afresh for every batch (RAM does not grow with the corpus, and a
  fresh map sidesteps the page-cache growth nanoGPT works around the same way).
- ``batching``: ``vectorized`` gathers the whole batch with one fancy index and
  copies it to the device once (pinned memory, non_blocking on CUDA);
  ``loop`` is the per-sample Python baseline: a slice, a tensor and a copy per row.

Both modes draw the same random offsets from the same seeded generator, so
they yield identical batches and differ only in speed. The generator state is
part of the checkpoint, which is what makes a resumed run continue exactly.

Under DDP every rank holds the same generator, draws the offsets of the whole
global batch (``batch_size × world``) and keeps its own slice: no two ranks read
the same window in a step, and N ranks see exactly the batches of one process
with an N times larger micro-batch.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from gpt2.core import tokens as token_files
from gpt2.core.errors import UserError
from gpt2.core.tokens import DTYPE, Shard, ShardedTokens, Tokens, open_shard, open_tokens, read_meta


class TokenSplit:
    """One split's tokens, held in RAM (``preload``) or mapped per use (``memmap``).

    With several processes on a machine (DDP), ``preload`` maps the files once and reads them into the
    page cache instead: every rank then uses the same physical copy, where private arrays would
    hold one copy per rank (8 GPUs: 8 × 20 GB for FineWeb's 10 B tokens)."""

    def __init__(self, tokens_dir: str | Path, split: str, mode: Literal["preload", "memmap"],
                 meta: dict[str, Any] | None = None, shared: bool = False) -> None:
        self.meta = meta or read_meta(tokens_dir)
        self.dir, self.name, self.mode = Path(tokens_dir), split, mode
        self.length = len(open_tokens(tokens_dir, split, self.meta))  # validates dtype and lengths
        self.label = token_files.split_label(self.meta, split)
        shards = token_files.split_shards(self.meta, split)
        self._ram: Tokens | None = None
        self.vocab_size = int(self.meta["vocab_size"])
        self.token_bytes = token_files.token_bytes(tokens_dir)  # each id's bytes of text: bits per byte (or None)
        if mode == "preload" and shared:
            parts = [shared_pages(self.dir, s) for s in shards]
            for part in parts:
                self.check_ids(part)
            self._ram = parts[0] if len(parts) == 1 else ShardedTokens.of(parts)
        elif mode == "preload":  # one allocation, filled shard by shard (no transient second copy)
            self._ram = np.empty(self.length, dtype=DTYPE)
            for lo, chunk in token_files.read_chunks(self.dir, shards):
                self._ram[lo:lo + len(chunk)] = chunk
            self.check_ids(self._ram)  # in RAM: one pass; mapped per use (memmap): each batch is checked

    def check_ids(self, tokens: np.ndarray) -> None:
        """Refuse ids outside the vocabulary: past the embedding they fail deep in PyTorch, and in its padded
        rows (50,257-50,303) they make the loss infinite, which would be blamed on the learning rate."""
        tokens = tokens.reshape(-1)
        if len(tokens) and int(tokens.max()) >= self.vocab_size:
            at = int(np.argmax(tokens >= self.vocab_size))
            raise UserError(f"{self.label} holds token id {int(tokens[at])}, outside the vocab of {self.vocab_size} "
                            "(GPT-2's ids end at 50256): these are not this tokenizer's tokens, or the file is "
                            "damaged; run the tokenize stage again")

    def array(self) -> Tokens:
        if self._ram is not None:
            return self._ram
        return open_tokens(self.dir, self.name, self.meta, lazy=True)


def shared_pages(tokens_dir: Path, shard: Shard) -> np.ndarray:
    """A read-only map of the file, read ahead into the page cache: one copy for every process."""
    mapped = open_shard(tokens_dir, shard)
    advise = getattr(getattr(mapped, "_mmap", None), "madvise", None)
    if advise is not None and hasattr(mmap, "MADV_WILLNEED"):
        advise(mmap.MADV_WILLNEED)  # the kernel reads it in now, not on the first batches
    return mapped


class BatchSampler:
    """Random windows of ``block_size + 1`` tokens; ``x`` is the window, ``y`` the window shifted by one."""

    def __init__(self, data: TokenSplit, batch_size: int, block_size: int, seed: int,
                 batching: Literal["vectorized", "loop"], device: torch.device, rank: int = 0, world: int = 1) -> None:
        if data.length < block_size + 1:
            raise UserError(f"{data.label} has {data.length} tokens, fewer than block_size + 1 = {block_size + 1}; "
                            "lower train.block_size or use a larger corpus")
        self.data, self.batch_size, self.block_size = data, batch_size, block_size
        self.batching, self.device = batching, device
        self.rank, self.world = rank, world
        self.rng = np.random.default_rng(seed)

    def state(self) -> dict[str, Any]:
        return self.rng.bit_generator.state

    def load_state(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.rng.integers(0, self.data.length - self.block_size, size=self.batch_size * self.world)
        return self.at(starts[self.rank * self.batch_size:(self.rank + 1) * self.batch_size])

    def at(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows that begin at ``starts``, on the device."""
        tokens = self.data.array()
        if self.batching == "vectorized":
            return self._vectorized(tokens, starts)
        return self._loop(tokens, starts)

    def _read(self, tokens: np.ndarray) -> np.ndarray:
        """Tokens read from a map (memmap) are checked as they are read; preloaded ones were checked at load."""
        if self.data.mode == "memmap":
            self.data.check_ids(tokens)
        return tokens

    def _vectorized(self, tokens: Tokens, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        batch = torch.from_numpy(self._read(token_files.windows(tokens, starts, self.block_size + 1)).astype(np.int64))
        if self.device.type == "cuda":
            batch = batch.pin_memory().to(self.device, non_blocking=True)
        else:
            batch = batch.to(self.device)
        return batch[:, :-1], batch[:, 1:]

    def _loop(self, tokens: Tokens, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.block_size
        x = torch.stack([torch.from_numpy(self._read(tokens[i:i + T]).astype(np.int64)) for i in starts])
        y = torch.stack([torch.from_numpy(self._read(tokens[i + 1:i + 1 + T]).astype(np.int64)) for i in starts])
        return x.to(self.device), y.to(self.device)
