"""What every ``gpt2`` command shares: the ``--params`` option and one way to report user errors."""

from __future__ import annotations

import functools
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from gpt2.core import log, paths
from gpt2.core.errors import Terminated, UserError

logger = log.get("cli")

def params_option(help: str) -> Any:
    return paths.option("--params", "params_path", default=paths.PARAMS, type=click.Path(dir_okay=False), help=help)


PARAMS = params_option("params file to read the stage's section from")
STARTING_PARAMS = params_option("the project's params file: every run starts from it, and --apply writes the winner "
                                "to it")
SETS = click.option("-S", "--set", "sets", multiple=True, metavar="SECTION.KEY=VALUE",
                    help="this run only: one params.yaml key set to VALUE (YAML, as dvc exp run -S reads it), "
                         "checked as the file is; repeatable, e.g. -S train.lr=1.0e-3 -S train.max_steps=50")


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated


_interrupted = False  # a Ctrl-C reached the command before it set up its own handling (training's stop_on_signals)


def _interrupt(signum: int, frame: Any) -> None:
    """Python's own Ctrl-C (a KeyboardInterrupt), remembered: one that lands in an import can surface as another
    error (a half-imported numpy recursing), and one raised in a finalizer is printed as "Exception ignored" and
    lost while the command goes on."""
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def interrupt_pending() -> bool:
    """A Ctrl-C came and the command is still running: its KeyboardInterrupt was lost. Called where a command
    starts to write, so that the Ctrl-C still stops it."""
    return _interrupted


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()  # signal handlers can only be set there


def user_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a :class:`UserError` into one ``error:`` line and a non-zero exit; SIGTERM cleans up as Ctrl-C does
    (temporaries removed, children stopped) and exits 143."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        global _interrupted
        _interrupted = False
        previous = signal.signal(signal.SIGTERM, _terminate) if _main_thread() else None
        # Python's Ctrl-C, remembered; not where it is ignored (a job started in the background keeps ignoring it)
        previous_int = (signal.signal(signal.SIGINT, _interrupt) if _main_thread()
                        and signal.getsignal(signal.SIGINT) is signal.default_int_handler else None)
        try:
            return func(*args, **kwargs)
        except UserError as exc:
            logger.error(str(exc), extra=log.EVERY_RANK if exc.every_rank else {})
            sys.exit(exc.exit_code)
        except Terminated:
            logger.info("terminated (SIGTERM); no output was written", extra=log.EVERY_RANK)
            sys.exit(143)
        except KeyboardInterrupt as exc:  # its own words where it has some (training's second Ctrl-C)
            logger.info(str(exc) or "interrupted; no output was written", extra=log.EVERY_RANK)
            sys.exit(130)
        except Exception as exc:
            if not _interrupted:
                raise
            logger.info(f"interrupted (Ctrl-C; it surfaced as {type(exc).__name__})", extra=log.EVERY_RANK)
            sys.exit(130)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if previous_int is not None:
                signal.signal(signal.SIGINT, previous_int)

    return wrapper


VALID_MARK = "params.yaml: every section valid\n"


def check_devices(params: Any) -> None:
    """A CUDA device asked for where there is none is refused before any stage runs (torch only then)."""
    asked = [f"{section}.device" for section in ("train", "eval") if getattr(params, section).device == "cuda"]
    if not asked:
        return
    import torch

    if not torch.cuda.is_available():
        raise UserError(f"{' and '.join(asked)} cuda, but CUDA is not available here (torch {torch.__version__}); "
                        "set it to auto or cpu, or run on a machine with an NVIDIA GPU and a CUDA build of torch")


def check_source(source: str, lock: Path) -> None:
    """A local ``download.source`` that is not there stops the pipeline here, before DVC deletes data/raw to run
    the download stage again. Only where that stage will run for it: where ``lock`` (dvc.lock) records another
    source. A download DVC kept needs no source, and a ``dvc exp run --temp`` copy lacks the untracked folders."""
    import glob

    import yaml

    from gpt2.core.config import local_source, refuse_other_scheme

    source = source.strip()
    refuse_other_scheme(source)
    if not local_source(source):
        return
    try:
        recorded = yaml.safe_load(lock.read_text())["stages"]["download"]["params"]["params.yaml"]["download"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        recorded = {}
    if recorded.get("source") == source:
        return
    path, pattern = Path(source).expanduser(), any(ch in source for ch in "*?[")
    if glob.glob(str(path), recursive=True) if pattern else path.exists():
        return
    missing = f"the pattern {source!r} matched no files" if pattern else f"no such file or directory {source!r}"
    raise UserError(f"download.source: {missing} (checked before DVC deletes data/raw to download again); use "
                    "embedded, a path, a glob, an http(s):// URL or hf:<dataset>. Under `dvc exp run --temp` or a "
                    "queue, a path that git and DVC do not track is not in the run's copy: `dvc add` it and commit "
                    "its .dvc file, or give its absolute path")


@click.command()
@PARAMS
@SETS
@paths.option("--out", default=paths.VALID_MARK,
              help="marker written when every section is valid (the first DVC stage's output)")
@user_errors
def validate(params_path: str, sets: tuple[str, ...], out: str) -> None:
    """Check every section of params.yaml: unknown keys, types, ranges, shapes, the device, a local source.

    As the first DVC stage, it runs whenever params.yaml changes, before any other stage can
    delete its outputs: a typo costs a message, not a retrain. Its marker never changes, so
    passing it re-runs nothing downstream."""
    from gpt2.core.atomic import atomic_file
    from gpt2.core.config import load_params

    from gpt2.core.sizes import check_shapes

    params = load_params(params_path, sets)
    check_shapes(params.model, params.train)
    check_devices(params)
    check_source(params.download.source, paths.root() / "dvc.lock")
    with atomic_file(Path(out)) as tmp:
        tmp.write_text(VALID_MARK)
    logger.info(f"validate: {params_path} is valid" + (f" with {' '.join(f'-S {item}' for item in sets)}"
                                                        if sets else ""))
