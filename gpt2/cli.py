"""``gpt2`` command line: one subcommand per pipeline stage, plus helpers.

Each family's commands live beside its code (``gpt2/<family>/cli.py``); this group only gathers
them. The DVC stages in ``stages/`` call the same commands, so a pipeline run and a manual run do
exactly the same thing.
"""

from __future__ import annotations

import click

from gpt2.core import entry
from gpt2.core.cli import validate
from gpt2.data.cli import download, stats, tokenize
from gpt2.eval.cli import evaluate, export, sample
from gpt2.measure.cli import grid, ladder, peak, plan
from gpt2.train.cli import replay, train


@click.group()
@click.version_option(package_name="gpt2-pipeline")
def main() -> None:
    """Pre-train GPT-2 reproducibly: download → tokenize → stats → train → evaluate."""


for command in (validate, download, tokenize, stats, train, replay, evaluate, export, grid, ladder, plan, peak,
                sample):
    main.add_command(command)


def run() -> None:
    """The ``gpt2`` command's entry point: ``main``, ended as soon as its work is done (core/entry.py)."""
    entry.run(main)


if __name__ == "__main__":
    run()
