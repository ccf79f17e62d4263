"""``gpt2`` command line: one subcommand per pipeline stage, plus helpers.

Each family's commands live beside its code (``gpt2/<family>/cli.py``); this group only gathers
them. The DVC stages in ``stages/`` call the same commands, so a pipeline run and a manual run do
exactly the same thing.
"""

from __future__ import annotations

from typing import Any

import click

from gpt2.core import entry
from gpt2.core.cli import validate
from gpt2.data.cli import download, stats, tokenize
from gpt2.eval.cli import evaluate, export, sample
from gpt2.measure.cli import grid, ladder, peak, plan
from gpt2.train.cli import replay, train


class Commands(click.Group):
    """The ``gpt2`` group: a usage error of a command that takes ``-S`` says how settings are written, for hands
    used to nanoGPT's ``--max_iters=10`` or to ``-S key value``; every usage error ends with one ``error:`` line,
    as the commands' own errors do."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as exc:  # the group's own options: gpt2 --bogus
            raise UsageLine(exc.format_message(), exc.ctx) from None

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            hint = settings_hint(exc)  # first: it may drop click's guesses from the message
            raise UsageLine(exc.format_message() + hint, exc.ctx) from None


class UsageLine(click.UsageError):
    """A usage error as click shows it (the usage and where help is), its last line ``error: …`` (click's own
    is ``Error: …``), so that every error of the CLI reads and greps alike."""

    def show(self, file: Any = None) -> None:
        ctx, color = self.ctx, self.ctx.color if self.ctx is not None else None
        if ctx is not None:
            hint = (f"Try '{ctx.command_path} {max(ctx.command.get_help_option_names(ctx), key=len)}' for help.\n"
                    if ctx.command.get_help_option(ctx) is not None else "")
            click.echo(f"{ctx.get_usage()}\n{hint}", file=file, err=True, color=color)
        click.echo(f"error: {self.format_message()}", file=file, err=True, color=color)


def settings_hint(exc: click.UsageError) -> str:
    """The hint for a usage error: '' unless its command takes ``-S``, or where click names an option of the command's
    own that the typed one starts or ends (``--repeat``: did you mean ``--repeats``?)."""
    command = exc.ctx.command if exc.ctx else None
    if command is None or not any("-S" in p.opts for p in command.params):
        return ""
    if isinstance(exc, click.NoSuchOption):
        typed = exc.option_name
        if any(near.startswith(typed) or typed.startswith(near) for near in exc.possibilities or ()):
            return ""
        exc.possibilities = None  # --set for --seed, --help for --lr: a params key is the better guess
        from gpt2.core.config import MOVED, sections_with

        key = exc.option_name.lstrip("-").replace("-", "_")
        if moved := MOVED.get(f"train.{key}"):
            return f"\nSettings are given as -S section.key=value; train.{key} {moved}."
        sections = sorted(sections_with(key), key=lambda section: section != "train")  # training's first
        example = f"-S {sections[0]}.{key}=VALUE" if sections else "-S train.max_steps=10"
        return f"\nSettings are given as -S section.key=value, e.g. {example} (docs/params.md lists them)."
    spaced = [item for p in command.params if "-S" in p.opts for item in (exc.ctx.params.get(p.name) or ())
              if "=" not in item]
    if "unexpected extra argument" in exc.message and spaced:  # -S train.lr 1e-3: the value came apart
        return "\n-S takes section.key=value as one word, e.g. -S train.lr=1.0e-3 (a grid's values: =1.0e-3,2.0e-3)."
    return ""


@click.group(cls=Commands)
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
