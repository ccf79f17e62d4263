"""`gpt2 evaluate` (the evaluate stage's command), `gpt2 sample` and `gpt2 export`."""

from __future__ import annotations

import click

from gpt2.core.cli import PARAMS, user_errors


@click.command()
@PARAMS
@click.option("--checkpoint", "ckpt", default="checkpoints/ckpt.pt", show_default=True, help="checkpoint file")
@click.option("--tokens", default="data/tokens", show_default=True, help="token files folder")
@click.option("--out", default="reports/eval", show_default=True, help="report folder (metrics.json, samples.md)")
@click.option("--pretrained", default=None, help="score gpt2 ... gpt2-xl or a Hugging Face directory instead of "
              "the checkpoint (eval.pretrained)")
@user_errors
def evaluate(params_path: str, ckpt: str, tokens: str, out: str, pretrained: str | None) -> None:
    """Val loss, perplexity and a unigram baseline of a checkpoint (or a pretrained GPT-2), plus samples."""
    import dataclasses

    from gpt2.core.config import load_params
    from gpt2.eval.evaluate import evaluate as run

    cfg = load_params(params_path).eval
    run(dataclasses.replace(cfg, pretrained=pretrained) if pretrained else cfg, ckpt, tokens, out)


@click.command()
@click.option("--checkpoint", "ckpt", default="checkpoints/ckpt.pt", show_default=True, help="checkpoint file")
@click.option("--prompt", required=True, help="text to continue")
@click.option("--max-new-tokens", default=200, show_default=True, type=click.IntRange(min=0))
@click.option("--temperature", default=0.8, show_default=True, type=float, help="0 = greedy")
@click.option("--top-k", default=200, show_default=True, type=int, help="0 = off")
@click.option("--top-p", default=0.95, show_default=True, type=float, help="1.0 = off")
@click.option("--num-samples", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=1337, show_default=True, type=int)
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda", "mps"]))
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", "fp32", "bf16", "fp16"]))
@click.option("--kv-cache/--no-kv-cache", default=True, show_default=True)
@click.option("--stop-at-eot/--no-stop-at-eot", default=True, show_default=True)
@user_errors
def sample(ckpt: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
           num_samples: int, seed: int, device: str, dtype: str, kv_cache: bool, stop_at_eot: bool) -> None:
    """Continue PROMPT with a checkpoint, streaming tokens as they are generated."""
    from gpt2.core.config import EvalConfig, build
    from gpt2.eval.evaluate import stream_sample
    from gpt2.eval.sample import SamplingConfig

    # the same validation as params.yaml's eval section: one message naming the bad value
    build(EvalConfig, {"temperature": temperature, "top_k": top_k, "top_p": top_p}, "sample")
    sampling = SamplingConfig(max_new_tokens, temperature, top_k, top_p, stop_at_eot, kv_cache)
    stream_sample(ckpt, prompt, sampling, num_samples, seed, device, dtype)


@click.command()
@click.argument("checkpoint_path", metavar="CHECKPOINT", type=click.Path(dir_okay=False))
@click.argument("out_dir", metavar="OUT_DIR", type=click.Path(file_okay=False))
@user_errors
def export(checkpoint_path: str, out_dir: str) -> None:
    """Write CHECKPOINT as a Hugging Face model directory (safetensors, config, GPT-2 tokenizer files)."""
    from gpt2.eval.export import export as run

    run(checkpoint_path, out_dir)
