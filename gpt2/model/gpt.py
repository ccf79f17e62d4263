"""GPT-2 in one readable file (after nanoGPT): pre-LN blocks, GELU MLP, tied embeddings.

Two switches change what runs here, both for speed comparisons:
- ``attention``: ``flash`` calls ``F.scaled_dot_product_attention(is_causal=True)``
  (a fused kernel: flash / memory-efficient on CUDA); ``manual`` materializes the
  T×T score matrix, masks and softmaxes it in separate kernels.
- ``vocab_size`` may be padded (50257 → 50304, a multiple of 64) for friendlier
  matmul shapes; the padded logits are masked to -inf so they never win a
  sample and never take probability mass in the loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2.core.sizes import SIZES, pad_vocab
from gpt2.model.head import Head


@dataclass(frozen=True)
class GPTConfig:
    """The resolved architecture: what the checkpoint needs to rebuild the model."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int = 50257  # real tokens; ids >= this never occur
    padded_vocab_size: int = 50257  # rows of the embedding / columns of the logits
    dropout: float = 0.0
    bias: bool = True
    attention: Literal["flash", "manual"] = "flash"


class KVCache:
    """Keys and values of the positions seen so far, per layer, preallocated to ``block_size``.

    With it, generating a token costs one position's work instead of a re-run over the
    whole context. ``length`` is how many positions are filled.
    """

    def __init__(self, cfg: GPTConfig, batch: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (batch, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this call's keys/values after the cached ones; return all of them."""
        start, end = self.length, self.length + k.size(2)
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be divisible by n_head"
        self.layer = layer
        self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout
        self.attention = cfg.attention
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_scaled = True
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.update(self.layer, k, v)
        if self.attention == "flash" and past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        elif self.attention == "flash" and T == 1:  # one new query sees every cached position
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            # query i (absolute position past + i) may see keys 0 .. past + i
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
            scores = scores.masked_fill(~mask, float("-inf"))
            y = self.attn_dropout(F.softmax(scores, dim=-1)) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_scaled = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, layer)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, head: Head | None = None, residual_dtype: torch.dtype | None = None) -> None:
        """``head``: the losses a forward with targets computes (model/head.py), chosen here; the default holds
        every logit. ``residual_dtype``: under autocast, the residual stream between blocks in this dtype
        instead of the weights' (train.residual_stream)."""
        super().__init__()
        self.cfg = cfg
        self.residual_dtype = residual_dtype
        self.set_head(head or Head())
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.padded_vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList(Block(cfg, layer) for layer in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied: one matrix, counted once
        self.apply(self._init_weights)
        if cfg.padded_vocab_size > cfg.vocab_size:
            # -inf on padded logits: they never win a sample and never take mass in the loss
            bias = torch.zeros(cfg.padded_vocab_size)
            bias[cfg.vocab_size:] = float("-inf")
            self.register_buffer("logit_mask", bias, persistent=False)
        else:
            self.logit_mask = None

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "residual_scaled", False):
                std /= math.sqrt(2 * self.cfg.n_layer)  # GPT-2: residual projections scaled by 1/sqrt(2·n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, exclude_position_embedding: bool = False) -> int:
        """Parameters with tied weights counted once (``parameters()`` already deduplicates)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if exclude_position_embedding else n

    def set_head(self, head: Head) -> None:
        """Choose the losses a forward with targets computes, training's and scoring's: where the model is
        built, or to score the same weights another way (a benchmark's variants, a test's logits)."""
        self.head = head
        self.training_loss, self.scoring_loss = head.losses()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None,
                per_window: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Without ``targets`` (generation): the last position's logits. With them: the head's loss, training's
        with gradients, scoring's without, and all logits where that loss holds them (else None).
        ``per_window``: each sequence's mean loss, shape (B,), instead of the batch's (evaluation: the
        spread over windows gives the val loss its standard error).

        With ``cache``, ``idx`` holds only the new positions; their keys and values are
        appended to the cache, whose length then advances.
        """
        x = self.hidden_states(idx, cache)
        if targets is None:
            return self.logits(x[:, [-1], :]), None  # generation needs only the last position
        loss = self.training_loss if torch.is_grad_enabled() else self.scoring_loss
        return loss(self, x, targets, per_window)

    def hidden_states(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """The final layer norm's output, (B, T, n_embd): what the LM head reads."""
        B, T = idx.shape
        past = cache.length if cache is not None else 0
        if past + T > self.cfg.block_size:
            raise ValueError(f"sequence length {past + T} exceeds the model's block_size {self.cfg.block_size}")
        pos = torch.arange(past, past + T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        if self.residual_dtype is not None and torch.is_autocast_enabled(x.device.type):
            x = x.to(self.residual_dtype)  # each block adds its bf16 output to it: the sum stays bf16
        for block in self.transformer.h:
            x = block(x, cache)
        if cache is not None:
            cache.length += T
        return self.transformer.ln_f(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of ``hidden``, padded columns at -inf."""
        logits = self.lm_head(hidden)
        return logits + self.logit_mask.to(logits.dtype) if self.logit_mask is not None else logits


def gpt_config(size: str, overrides: dict[str, int | float | bool | None], vocab_size: int,
               pad_vocab_to_64: bool, attention: str) -> GPTConfig:
    """A named size with non-null ``overrides`` applied (params.yaml ``model`` section)."""
    from gpt2.core.errors import UserError

    dims = {**SIZES[size], **{k: v for k, v in overrides.items() if v is not None}}
    if dims["n_embd"] % dims["n_head"]:
        raise UserError(f"model.n_embd {dims['n_embd']} is not divisible by model.n_head {dims['n_head']}; "
                        "pick dimensions where it is")
    padded = pad_vocab(vocab_size) if pad_vocab_to_64 else vocab_size
    return GPTConfig(vocab_size=vocab_size, padded_vocab_size=padded, attention=attention, **dims)
