"""`gpt2 train`: the train stage's command (``python -m gpt2.train.cli`` is what torchrun runs on each rank)."""

from __future__ import annotations

import sys

import click

from gpt2.core.cli import PARAMS, user_errors


@click.command()
@PARAMS
@click.option("--tokens", default="data/tokens", show_default=True, help="token files folder")
@click.option("--checkpoint", "ckpt", default="checkpoints/ckpt.pt", show_default=True, help="checkpoint file")
@click.option("--out", default="reports/train", show_default=True, help="report folder (metrics.json, plots/)")
@user_errors
def train(params_path: str, tokens: str, ckpt: str, out: str) -> None:
    """Train GPT-2 on data/tokens/ as params.yaml says; resume an interrupted run."""
    from gpt2.core.config import load_params
    from gpt2.train import distributed

    params = load_params(params_path)
    if distributed.must_launch(params.train):  # train.distributed: ddp on N processes: torchrun runs this again
        sys.exit(distributed.launch(params.train, ["--params", params_path, "--tokens", tokens,
                                                   "--checkpoint", ckpt, "--out", out]))
    from gpt2.train.trainer import train as run

    run(params, tokens, ckpt, out)


if __name__ == "__main__":
    train()
