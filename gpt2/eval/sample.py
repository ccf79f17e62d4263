"""Text generation: temperature, top-k, top-p, EOT stop, with or without a KV cache.

With the cache, each new token runs the model on one position. Once the text
is longer than the model's context, the context is cropped from the left;
since GPT-2's position embeddings are absolute, every cropped window is a new
prefix, so past that point each token re-encodes the window (exactly what the
no-cache path does). Greedy decoding gives the same tokens either way (tested).

``stream_sample`` is ``gpt2 sample``: a checkpoint's continuations, printed token by token.
"""

from __future__ import annotations

import codecs
import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2.core.config import EvalConfig
from gpt2.core.errors import UserError
from gpt2.eval.loading import eval_runtime, load_model
from gpt2.model.gpt import GPT, KVCache

_EVAL = EvalConfig()  # the defaults live once, in params.yaml's eval section


@dataclass(frozen=True)
class SamplingConfig:
    """How one continuation is drawn; each field as the eval section's key of the same name (docs/params.md)."""

    max_new_tokens: int = _EVAL.max_new_tokens
    temperature: float = _EVAL.temperature
    top_k: int = _EVAL.top_k
    top_p: float = _EVAL.top_p
    stop_at_eot: bool = _EVAL.stop_at_eot
    kv_cache: bool = _EVAL.kv_cache

    @classmethod
    def of(cls, cfg: EvalConfig) -> SamplingConfig:
        return cls(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.stop_at_eot, cfg.kv_cache)


def filter_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, then keep the top-k, then the smallest set whose probability reaches top-p.

    Top-p ranks only the top-k survivors (``topk`` returns them sorted), not the whole vocabulary: a sort of
    50,304 logits took most of a sampled token's time outside the model."""
    logits = logits.float() / cfg.temperature
    ranked = None  # the surviving logits, largest first
    if cfg.top_k > 0:
        ranked = torch.topk(logits, min(cfg.top_k, logits.size(-1)), dim=-1).values
        logits = logits.masked_fill(logits < ranked[..., -1:], float("-inf"))
    if cfg.top_p < 1.0:
        if ranked is None:
            ranked = torch.sort(logits, descending=True, dim=-1).values
        probs = torch.softmax(ranked, dim=-1)
        above = probs.cumsum(dim=-1) - probs  # the probability of the tokens ranked above each one
        kept = (above < cfg.top_p).sum(dim=-1, keepdim=True)  # up to the token that crosses top_p
        logits = logits.masked_fill(logits < ranked.gather(-1, kept - 1), float("-inf"))
    return logits


def next_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
    logits = logits.float().cpu()  # the seeded generator lives on the CPU: same samples on any device
    if cfg.temperature == 0:
        return int(torch.argmax(logits, dim=-1))
    probs = torch.softmax(filter_logits(logits, cfg), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate_ids(model: GPT, prompt: list[int], cfg: SamplingConfig, generator: torch.Generator | None = None,
                 eot_id: int | None = None, autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                 cache_dtype: torch.dtype | None = None) -> Iterator[int]:
    """Yield new token ids one by one (so callers can stream them)."""
    device = next(model.parameters()).device
    autocast = autocast or contextlib.nullcontext
    block = model.cfg.block_size
    tokens = list(prompt)
    cache: KVCache | None = None
    pending = tokens[-block:]  # what the model has not seen yet
    model.eval()
    for _ in range(cfg.max_new_tokens):
        if cfg.kv_cache and len(tokens) <= block:
            if cache is None:
                cache = KVCache(model.cfg, 1, device, cache_dtype or next(model.parameters()).dtype)
            idx = torch.tensor([pending], device=device)
            with autocast():
                logits, _ = model(idx, cache=cache)
        else:  # no cache, or the window slid: encode the last block tokens afresh
            idx = torch.tensor([tokens[-block:]], device=device)
            with autocast():
                logits, _ = model(idx)
        token = next_token(logits[0, -1], cfg, generator)
        tokens.append(token)
        pending = [token]
        yield token
        if cfg.stop_at_eot and eot_id is not None and token == eot_id:
            return


class TextStream:
    """Turn token ids into text incrementally: a multi-byte character split over tokens prints once whole."""

    def __init__(self, encoding) -> None:
        self.encoding = encoding
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self.decoder.decode(self.encoding.decode_single_token_bytes(token))

    def flush(self) -> str:
        return self.decoder.decode(b"", final=True)


def encode_prompts(prompts: tuple[str, ...], block: int) -> list[list[int]]:
    """Token ids of each prompt, checked against the model's context (before any slow work)."""
    from gpt2.data.tokenizer import gpt2_encoding

    encoded = [gpt2_encoding().encode_ordinary(p) for p in prompts]
    for prompt, ids in zip(prompts, encoded):
        check_prompt(prompt, ids, block)
    return encoded


def check_prompt(prompt: str, ids: list[int], block: int) -> None:
    if len(ids) > block:
        raise UserError(f"prompt {prompt[:40]!r}... is {len(ids)} tokens, longer than the model's context of {block}; "
                        "shorten it")
    if not ids:
        raise UserError("a prompt is empty; give each prompt some text")


def stream_sample(ckpt_path: str | Path, prompt: str, sampling: SamplingConfig, num_samples: int, seed: int,
                  device: str, dtype: str, cpu_gemm: str = "auto") -> None:
    """``gpt2 sample``: print each continuation token by token as it is generated."""
    from gpt2.data.tokenizer import EOT_ID, gpt2_encoding

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    loaded = load_model(ckpt_path, eval_runtime(device, dtype), cpu_gemm)
    encoding = gpt2_encoding()
    ids = encoding.encode_ordinary(prompt)
    check_prompt(prompt, ids, loaded.model.cfg.block_size)
    for i in range(num_samples):
        if num_samples > 1:
            write(f"--- sample {i + 1} ---\n")
        write(prompt)
        stream = TextStream(encoding)
        generator = torch.Generator().manual_seed(seed + i)
        for token in generate_ids(loaded.model, ids, sampling, generator, EOT_ID, loaded.runtime.autocast,
                                  loaded.runtime.autocast_dtype):
            if token != EOT_ID:
                write(stream.push(token))
        write(stream.flush() + "\n")
