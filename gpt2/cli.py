"""``gpt2`` command line: one subcommand per pipeline stage, plus helpers.

The DVC stages in ``stages/`` call these same commands, so a pipeline run and
a manual run do exactly the same thing.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import click

from gpt2.errors import UserError

PARAMS = click.option("--params", "params_path", default="params.yaml", show_default=True,
                      type=click.Path(dir_okay=False), help="params file to read the stage's section from")


def user_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a :class:`UserError` into one ``error:`` line and a non-zero exit."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except UserError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted; no output was written", err=True)
            sys.exit(130)

    return wrapper


@click.group()
@click.version_option(package_name="gpt2-pipeline")
def main() -> None:
    """Pre-train GPT-2 reproducibly: download → tokenize → stats → train → evaluate."""


@main.command()
@PARAMS
@click.option("--out", default="data/raw", show_default=True, help="raw documents folder")
@user_errors
def download(params_path: str, out: str) -> None:
    """Fetch download.source into data/raw/ (documents + manifest.json)."""
    from gpt2.config import load_params
    from gpt2.sources import download as run

    run(load_params(params_path).download, out)


@main.command()
@PARAMS
@click.option("--raw", default="data/raw", show_default=True, help="raw documents folder")
@click.option("--out", default="data/tokens", show_default=True, help="token files folder")
@user_errors
def tokenize(params_path: str, raw: str, out: str) -> None:
    """Tokenize data/raw/ into data/tokens/{train,val}.bin + meta.json (GPT-2 BPE, uint16)."""
    from gpt2.config import load_params
    from gpt2.encode import tokenize_corpus

    tokenize_corpus(load_params(params_path).tokenize, raw, out)


@main.command()
@PARAMS
@click.option("--tokens", default="data/tokens", show_default=True, help="token files folder")
@click.option("--out", default="reports/stats", show_default=True, help="report folder")
@user_errors
def stats(params_path: str, tokens: str, out: str) -> None:
    """Dataset statistics and plots of data/tokens/ into reports/stats/."""
    from gpt2.config import load_params
    from gpt2.stats import dataset_stats

    dataset_stats(load_params(params_path).stats, tokens, out)


@main.command()
@PARAMS
@click.option("--tokens", default="data/tokens", show_default=True, help="token files folder")
@click.option("--checkpoint", "ckpt", default="checkpoints/ckpt.pt", show_default=True, help="checkpoint file")
@click.option("--out", default="reports/train", show_default=True, help="report folder (metrics.json, plots/)")
@user_errors
def train(params_path: str, tokens: str, ckpt: str, out: str) -> None:
    """Train GPT-2 on data/tokens/ as params.yaml says; resume an interrupted run."""
    from gpt2 import distributed
    from gpt2.config import load_params

    params = load_params(params_path)
    if distributed.must_launch(params.train):  # train.distributed: ddp on N processes: torchrun runs this again
        sys.exit(distributed.launch(params.train, ["train", "--params", params_path, "--tokens", tokens,
                                                   "--checkpoint", ckpt, "--out", out]))
    from gpt2.trainer import train as run

    run(params, tokens, ckpt, out)


@main.command()
@PARAMS
@click.option("--checkpoint", "ckpt", default="checkpoints/ckpt.pt", show_default=True, help="checkpoint file")
@click.option("--tokens", default="data/tokens", show_default=True, help="token files folder")
@click.option("--out", default="reports/eval", show_default=True, help="report folder (metrics.json, samples.md)")
@user_errors
def evaluate(params_path: str, ckpt: str, tokens: str, out: str) -> None:
    """Val loss, perplexity and a unigram baseline of a checkpoint, plus samples."""
    from gpt2.config import load_params
    from gpt2.evaluate import evaluate as run

    run(load_params(params_path).eval, ckpt, tokens, out)


@main.command()
@PARAMS
@click.option("--ladder", "ladder_path", default="ladder.yaml", show_default=True, type=click.Path(dir_okay=False),
              help="the rungs and per-device profiles")
@click.option("--out", default="reports/ladder", show_default=True, help="report folder (ladder.md, .png, .json)")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda", "mps"]),
              help="where to train; picks the ladder's profile (cuda: gpt2 124M, T=1024; else tiny)")
@click.option("--model", default=None, type=click.Choice(["tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]),
              help="model.size instead of the profile's")
@click.option("--steps", default=None, type=click.IntRange(min=2), help="steps per run instead of the profile's")
@click.option("--repeats", default=None, type=click.IntRange(min=1), help="runs per rung instead of the profile's")
@click.option("--fresh", is_flag=True, help="measure every rung again instead of reusing experiments with the same params")
@click.option("--mlflow/--no-mlflow", default=None, help="log to MLflow (default: params.yaml train.mlflow)")
@user_errors
def ladder(params_path: str, ladder_path: str, out: str, device: str, model: str | None, steps: int | None,
           repeats: int | None, fresh: bool, mlflow: bool | None) -> None:
    """Measure what each optimization buys: every rung of ladder.yaml as DVC experiments, then a table and plot."""
    from gpt2.ladder import run_ladder

    run_ladder(ladder_path, params_path, out, device, model, steps, repeats, fresh, mlflow)


@main.command()
@click.option("--model", default="gpt2", show_default=True,
              type=click.Choice(["tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]))
@click.option("--tokens", required=True, type=click.FloatRange(min=0, min_open=True),
              help="training tokens, e.g. 10e9")
@click.option("--device", default="h100", show_default=True,
              type=click.Choice(["h100", "h100-pcie", "h200", "a100", "a100-40gb", "l4", "v100", "cpu"]))
@click.option("--gpus", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--micro-batch", default=16, show_default=True, type=click.IntRange(min=1), help="sequences per GPU")
@click.option("--seq-len", default=None, type=click.IntRange(min=1), help="default: the model's context")
@click.option("--dtype", default="bf16", show_default=True, type=click.Choice(["fp32", "bf16", "fp16"]))
@click.option("--attention", default="flash", show_default=True, type=click.Choice(["flash", "manual"]))
@click.option("--mfu", default=None, type=click.FloatRange(0, 1, min_open=True),
              help="model FLOPs utilization (default: measured here on that device, else 40%)")
@click.option("--price-per-hour", default=None, type=click.FloatRange(min=0), help="USD per GPU-hour")
@click.option("--memory-gb", default=None, type=click.FloatRange(min=0, min_open=True), help="memory per device")
@click.option("--peak-tflops", default=None, type=click.FloatRange(min=0, min_open=True), help="peak per device")
@click.option("--root", default=".", show_default=True, type=click.Path(file_okay=False),
              help="project whose reports/ladder and mlflow.db hold measured MFU")
@click.option("--json", "as_json", is_flag=True, help="print the plan as JSON")
@user_errors
def plan(model: str, tokens: float, device: str, gpus: int, micro_batch: int, seq_len: int | None, dtype: str,
         attention: str, mfu: float | None, price_per_hour: float | None, memory_gb: float | None,
         peak_tflops: float | None, root: str, as_json: bool) -> None:
    """Compute budget: parameters, FLOPs, memory, largest micro-batch, time and cost for TOKENS."""
    import json
    from pathlib import Path

    from gpt2.plan import plan as make, render

    result = make(model, tokens, device, micro_batch, seq_len, gpus, dtype, attention, mfu, price_per_hour,
                  memory_gb, peak_tflops, Path(root))
    click.echo(json.dumps(result, indent=2) if as_json else render(result), nl=as_json)


@main.command()
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
    from gpt2.config import EvalConfig, build
    from gpt2.evaluate import stream_sample
    from gpt2.sample import SamplingConfig

    # the same validation as params.yaml's eval section: one message naming the bad value
    build(EvalConfig, {"temperature": temperature, "top_k": top_k, "top_p": top_p}, "sample")
    sampling = SamplingConfig(max_new_tokens, temperature, top_k, top_p, stop_at_eot, kv_cache)
    stream_sample(ckpt, prompt, sampling, num_samples, seed, device, dtype)


if __name__ == "__main__":
    main()
