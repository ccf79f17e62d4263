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
    from gpt2.config import load_params
    from gpt2.trainer import train as run

    run(load_params(params_path), tokens, ckpt, out)


if __name__ == "__main__":
    main()
