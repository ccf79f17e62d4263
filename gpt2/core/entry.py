"""A process's entry point (a DVC stage, the ``gpt2`` command) that ends the process once its work is done.

Python's own shutdown frees every module and object one by one. With torch and MLflow loaded that
takes seconds (docs/benchmarks.md measures it), paid by every stage of every run and by every run of a
grid. What a shutdown must do still happens here, in Python's order: thread pools are shut down and
the threads that are not daemons joined, the exit handlers run (MLflow's, multiprocessing's,
logging's), the standard streams are flushed. Only the freeing of memory the OS takes back anyway is
skipped.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

import click


def run(command: click.Command, args: list[str] | None = None, prog_name: str | None = None) -> NoReturn:
    """Run ``command`` with ``args`` (None: the process's own) as click does, then end the process with its
    exit status. An exception other than an exit (a bug's traceback) ends it the usual way."""
    try:
        command.main(args, prog_name=prog_name)
        code: int | str | None = 0
    except SystemExit as exc:
        code = exc.code
    end(code)


def end(code: int | str | None) -> NoReturn:
    """Exit with ``code`` as ``sys.exit`` would (a text is printed and exits 1), after what a shutdown must do."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    # Python's own first step: the thread pools are told to stop (a compiled model's leaves idle workers that
    # wait for work forever), then every thread that is not a daemon is joined
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to flush into
            pass
    os._exit(code or 0)
