"""GPT-2's named sizes and the vocabulary padding, without torch: `gpt2 plan` answers in a blink."""

from __future__ import annotations

import math

SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),  # 7.2M, most of it the embedding
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024),  # 1558M
}


def pad_vocab(vocab_size: int, multiple: int = 64) -> int:
    return math.ceil(vocab_size / multiple) * multiple


def sequence_length(size: str, model_block_size: int | None, train_block_size: int | None) -> int:
    """Tokens per training sequence: train.block_size, else the model's context (model.block_size, else the size's)."""
    return train_block_size or model_block_size or SIZES[size]["block_size"]
