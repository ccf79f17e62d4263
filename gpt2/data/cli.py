"""`gpt2 download`, `gpt2 tokenize`, `gpt2 stats`: the data stages' commands."""

from __future__ import annotations

import click

from gpt2.core import paths
from gpt2.core.cli import PARAMS, SETS, user_errors


@click.command()
@PARAMS
@SETS
@paths.option("--out", default=paths.RAW, help="raw documents folder")
@user_errors
def download(params_path: str, sets: tuple[str, ...], out: str) -> None:
    """Fetch download.source into data/raw/ (documents + manifest.json)."""
    from gpt2.core.config import load_params
    from gpt2.data.sources import download as run

    run(load_params(params_path, sets).download, out)


@click.command()
@PARAMS
@SETS
@paths.option("--raw", default=paths.RAW, help="raw documents folder")
@paths.option("--out", default=paths.TOKENS, help="token files folder")
@user_errors
def tokenize(params_path: str, sets: tuple[str, ...], raw: str, out: str) -> None:
    """Tokenize data/raw/ into data/tokens/{train,val}.bin + meta.json (GPT-2 BPE, uint16)."""
    from gpt2.core.config import load_params
    from gpt2.data.encode import tokenize_corpus

    tokenize_corpus(load_params(params_path, sets).tokenize, raw, out)


@click.command()
@PARAMS
@SETS
@paths.option("--tokens", default=paths.TOKENS, help="token files folder")
@paths.option("--out", default=paths.STATS, help="report folder")
@user_errors
def stats(params_path: str, sets: tuple[str, ...], tokens: str, out: str) -> None:
    """Dataset statistics and plots of data/tokens/ into reports/stats/."""
    from gpt2.core.config import load_params
    from gpt2.core.sizes import sequence_length
    from gpt2.data.stats import dataset_stats

    params = load_params(params_path, sets)
    context = sequence_length(params.model.size, params.model.block_size, params.train.block_size)
    dataset_stats(params.stats, tokens, out, context)
