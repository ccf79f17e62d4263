"""`gpt2 evaluate` (the evaluate stage's command), `gpt2 sample` and `gpt2 export`."""

from __future__ import annotations

import click

from gpt2.core import paths
from gpt2.core.cli import PARAMS, SETS, user_errors


@click.command()
@PARAMS
@SETS
@paths.option("--checkpoint", "ckpt", default=paths.CHECKPOINT, help="checkpoint file")
@paths.option("--tokens", default=paths.TOKENS, help="token files folder")
@paths.option("--out", default=paths.EVAL_REPORTS, help="report folder (metrics.json, samples.md)")
@click.option("--pretrained", default=None, help="score gpt2 ... gpt2-xl or a Hugging Face directory instead of "
              "the checkpoint (eval.pretrained)")
@user_errors
def evaluate(params_path: str, sets: tuple[str, ...], ckpt: str, tokens: str, out: str,
             pretrained: str | None) -> None:
    """Val loss, perplexity and a unigram baseline of a checkpoint (or a pretrained GPT-2), plus samples."""
    import dataclasses

    from gpt2.core.config import load_params
    from gpt2.eval.evaluate import evaluate as run

    cfg = load_params(params_path, sets).eval
    run(dataclasses.replace(cfg, pretrained=pretrained) if pretrained else cfg, ckpt, tokens, out)


def _flag(help: str, **kwargs) -> dict:
    return {"default": None, "help": f"{help} (default: the eval section's)", **kwargs}


@click.command()
@PARAMS
@SETS
@paths.option("--checkpoint", "ckpt", default=paths.CHECKPOINT, help="checkpoint file")
@click.argument("text", metavar="[PROMPT]", required=False)
@click.option("--prompt", help="text to continue (or give it as PROMPT)")
@click.option("--max-new-tokens", **_flag("tokens per sample", type=click.IntRange(min=0)))
@click.option("--temperature", **_flag("0 = greedy", type=float))
@click.option("--top-k", **_flag("0 = off", type=int))
@click.option("--top-p", **_flag("1.0 = off", type=float))
@click.option("--num-samples", **_flag("continuations", type=click.IntRange(min=1)))
@click.option("--seed", **_flag("the first sample's seed", type=int))
@click.option("--device", **_flag("where to run", type=click.Choice(["auto", "cpu", "cuda", "mps"])))
@click.option("--dtype", **_flag("precision", type=click.Choice(["auto", "fp32", "bf16", "fp16"])))
@click.option("--kv-cache/--no-kv-cache", **_flag("a KV cache"))
@click.option("--stop-at-eot/--no-stop-at-eot", **_flag("stop at <|endoftext|>"))
@user_errors
def sample(params_path: str, sets: tuple[str, ...], ckpt: str, text: str | None, prompt: str | None,
           **flags) -> None:
    """Continue PROMPT with a checkpoint, streaming tokens as they are generated.

    Sampling is set as the evaluate stage's samples are: params.yaml's eval section (when there is one), then
    -S, then these flags."""
    from pathlib import Path

    if text is None and prompt is None:
        raise click.UsageError("give the text to continue: gpt2 sample 'ROMEO:' (or --prompt 'ROMEO:')")
    if text is not None and prompt is not None:
        raise click.UsageError(f"give the text to continue once, as PROMPT or --prompt, not both ({text!r} and "
                               f"{prompt!r})")
    prompt = text if prompt is None else prompt

    from gpt2.core.config import EvalConfig, Params, load_params
    from gpt2.core.schema import ParamError, build, override, to_dict
    from gpt2.eval.sample import SamplingConfig, stream_sample

    ctx = click.get_current_context()
    given = ctx.get_parameter_source("params_path") is not click.core.ParameterSource.DEFAULT
    if given or Path(params_path).is_file():
        cfg = load_params(params_path, sets).eval
    else:  # a checkpoint outside a project: the eval section's defaults
        cfg = build(Params, override({}, sets), "").eval
    chosen = {name: value for name, value in flags.items() if value is not None}
    try:
        cfg = build(EvalConfig, {**to_dict(cfg), **chosen}, "eval")  # the flags checked as the params are
    except ParamError as error:  # name the flag the user typed, with the key it sets
        flag = next((name for name in chosen if str(error).startswith(f"params: eval.{name} = ")), None)
        if flag is None:
            raise
        raise ParamError(str(error).replace(f"params: eval.{flag} = ", f"--{flag.replace('_', '-')} (eval.{flag}) ",
                                            1)) from None
    stream_sample(ckpt, prompt, SamplingConfig.of(cfg), cfg.num_samples, cfg.seed, cfg.device, cfg.dtype, cfg.cpu_gemm)


@click.command()
@click.argument("checkpoint_path", metavar="CHECKPOINT", type=click.Path(dir_okay=False))
@click.argument("out_dir", metavar="OUT_DIR", type=click.Path(file_okay=False))
@user_errors
def export(checkpoint_path: str, out_dir: str) -> None:
    """Write CHECKPOINT as a Hugging Face model directory (safetensors, config, GPT-2 tokenizer files)."""
    from gpt2.eval.export import export as run

    run(checkpoint_path, out_dir)
