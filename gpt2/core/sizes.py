"""GPT-2's named sizes and the vocabulary padding, without torch: `gpt2 plan` answers in a blink."""

from __future__ import annotations

import math
from pathlib import Path

from gpt2.core.config import ModelParams, TrainConfig
from gpt2.core.schema import require

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


def check_shapes(model: ModelParams, train: TrainConfig) -> None:
    """What the train stage would refuse about the model's and the batch's shapes, found from params alone: the
    validate stage runs this before DVC deletes any stage's outputs, so a bad shape costs a message only."""
    dims = {**SIZES[model.size], **{k: getattr(model, k) for k in SIZES[model.size] if getattr(model, k) is not None}}
    require(dims["n_embd"] % dims["n_head"] == 0, "model.n_head", dims["n_head"],
            f"a divisor of the width, model.n_embd {dims['n_embd']}")
    seq = sequence_length(model.size, model.block_size, train.block_size)
    require(seq <= dims["block_size"], "train.block_size", seq,
            f"at most the model's context, model.block_size {dims['block_size']} (or raise that)")
    if train.batch_tokens is not None:
        ranks = train.nproc_per_node if train.distributed != "off" else 1
        unit = seq * ranks
        require(train.batch_tokens % unit == 0, "train.batch_tokens", train.batch_tokens,
                f"a multiple of the sequence, {seq} tokens × {ranks} rank(s) = {unit:,}")
        per_rank = train.batch_tokens // unit
        require(train.micro_batch_size == "auto" or per_rank % int(train.micro_batch_size) == 0,
                "train.micro_batch_size", train.micro_batch_size,
                f"auto or a divisor of the {per_rank} sequences per rank of train.batch_tokens")
    source = train.init_from
    require(source == "scratch" or (source in SIZES and source != "tiny") or Path(source).expanduser().exists(),
            "train.init_from", source, f"scratch, {', '.join(n for n in SIZES if n != 'tiny')}, or an existing "
                                       "Hugging Face directory or weights file")
