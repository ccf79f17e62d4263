"""What every ``gpt2`` command shares: the ``--params`` option and one way to report user errors."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import click

from gpt2.core.errors import UserError

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
