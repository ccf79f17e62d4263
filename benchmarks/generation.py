"""Generation speed (tokens/s) with and without the KV cache.

    python benchmarks/generation.py                                   # checkpoints/ckpt.pt, else a random tiny model
    python benchmarks/generation.py --size gpt2 --new-tokens 256 --prompt-tokens 512   # random GPT-2 124M

Greedy decoding from a fixed prompt, the device synchronized before each clock read,
the median of ``--repeats`` runs after one warm-up run. Also checks that both paths
produce the same tokens. Needs only torch, numpy, click, tiktoken and pyyaml.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from pathlib import Path

import click
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@click.command()
@click.option("--checkpoint", default=str(ROOT / "checkpoints/ckpt.pt"), show_default=True)
@click.option("--size", default=None, help="ignore the checkpoint: a randomly initialised model of this size")
@click.option("--prompt-tokens", default=16, show_default=True)
@click.option("--new-tokens", default=100, show_default=True)
@click.option("--repeats", default=5, show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
def main(checkpoint: str, size: str | None, prompt_tokens: int, new_tokens: int, repeats: int, device: str,
         dtype: str) -> None:
    from gpt2.eval.loading import eval_runtime, load_model
    from gpt2.eval.sample import SamplingConfig, generate_ids
    from gpt2.model.gpt import GPT, gpt_config

    runtime = eval_runtime(device, dtype)
    if size is None and Path(checkpoint).is_file():
        model, source = load_model(checkpoint, runtime).model, checkpoint
    else:
        size = size or "tiny"
        torch.manual_seed(0)
        model, source = GPT(gpt_config(size, {}, 50257, True, "flash")).to(runtime.device).eval(), f"random {size}"
    if prompt_tokens + new_tokens > model.cfg.block_size:
        raise SystemExit(f"prompt + new tokens must fit the context ({model.cfg.block_size}) to measure the cache")
    prompt = torch.randint(0, 50257, (prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    results, outputs = {}, {}
    for cache in (False, True):
        cfg = SamplingConfig(max_new_tokens=new_tokens, temperature=0.0, stop_at_eot=False, kv_cache=cache)
        times = []
        for run in range(repeats + 1):
            runtime.synchronize()
            start = time.perf_counter()
            outputs[cache] = list(generate_ids(model, prompt, cfg, autocast=runtime.autocast,
                                               cache_dtype=runtime.autocast_dtype))
            runtime.synchronize()
            if run:  # the first run warms up kernels and allocator
                times.append(time.perf_counter() - start)
        results[cache] = new_tokens / statistics.median(times)
    same = outputs[True] == outputs[False]
    device_name = torch.cuda.get_device_name() if runtime.device.type == "cuda" else platform.machine() + " CPU"
    print(f"Model: {source} ({model.num_params() / 1e6:.1f} M params, context {model.cfg.block_size}); "
          f"device {device_name}, dtype {runtime.dtype}; prompt {prompt_tokens} tokens, {new_tokens} new tokens, "
          f"greedy, median of {repeats}.\n")
    print("| KV cache | tokens/s | speed-up |")
    print("|---|---|---|")
    print(f"| off | {results[False]:.1f} | 1.00× |")
    print(f"| on | {results[True]:.1f} | {results[True] / results[False]:.2f}× |")
    print(f"\nSame tokens with and without the cache: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
