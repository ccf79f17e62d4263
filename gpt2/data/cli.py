"""`gpt2 download`, `gpt2 tokenize`, `gpt2 stats`: the data stages' commands."""

from __future__ import annotations

import click

from gpt2.core.cli import PARAMS, user_errors


@click.command()
@PARAMS
@click.option("--out", default="data/raw", show_default=True, help="raw documents folder")
@user_errors
def download(params_path: str, out: str) -> None:
    """Fetch download.source into data/raw/ (documents + manifest.json)."""
    from gpt2.core.config import load_params
    from gpt2.data.sources import download as run

    run(load_params(params_path).download, out)


@click.command()
@PARAMS
@click.option("--raw", default="data/raw", show_default=True, help="raw documents folder")
@click.option("--out", default="data/tokens", show_default=True, help="token files folder")
@user_errors
def tokenize(params_path: str, raw: str, out: str) -> None:
    """Tokenize data/raw/ into data/tokens/{train,val}.bin + meta.json (GPT-2 BPE, uint16)."""
    from gpt2.core.config import load_params
    from gpt2.data.encode import tokenize_corpus

    tokenize_corpus(load_params(params_path).tokenize, raw, out)


@click.command()
@PARAMS
@click.option("--tokens", default="data/tokens", show_default=True, help="token files folder")
@click.option("--out", default="reports/stats", show_default=True, help="report folder")
@user_errors
def stats(params_path: str, tokens: str, out: str) -> None:
    """Dataset statistics and plots of data/tokens/ into reports/stats/."""
    from gpt2.core.config import load_params
    from gpt2.data.stats import dataset_stats

    dataset_stats(load_params(params_path).stats, tokens, out)
