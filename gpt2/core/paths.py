"""The project's own paths, and its root: every ``gpt2`` command run in a subfolder reads and writes the
project's files, as ``dvc`` does, and opens the project's MLflow store, not a new one there."""

from __future__ import annotations

import os
from pathlib import Path

import click
from click.core import ParameterSource

PIPELINE = "dvc.yaml"
PARAMS = "params.yaml"
RAW = "data/raw"
TOKENS = "data/tokens"
STATS = "reports/stats"
CHECKPOINT = "checkpoints/ckpt.pt"
TRAIN_REPORTS = "reports/train"
TRAIN_METRICS = f"{TRAIN_REPORTS}/metrics.json"  # the compared figures (DVC metrics)
TRAIN_SUMMARY = f"{TRAIN_REPORTS}/summary.json"  # the rest of a run's summary: what really ran ("runtime")
VAL_CURVE = f"{TRAIN_REPORTS}/plots/val.tsv"
EVAL_REPORTS = "reports/eval"
EVAL_METRICS = f"{EVAL_REPORTS}/metrics.json"
VALID_MARK = "reports/validate/params.ok"
LADDER = "ladder.yaml"
LADDER_REPORTS = "reports/ladder"
GRID_REPORTS = "reports/grid"
MLFLOW_DB = "mlflow.db"


def root() -> Path:
    """The workspace this command works in: the nearest folder at or above the current one that holds
    dvc.yaml or .dvc/ (as DVC finds it), else the current folder. A stage run by DVC is in its workspace's
    root already (under ``dvc exp run --temp`` a temporary copy; ``tracking_root`` is the original)."""
    return _enclosing_project() or Path.cwd().resolve()


def _enclosing_project() -> Path | None:
    return enclosing(Path.cwd(), PIPELINE, ".dvc")


def enclosing(start: Path, *markers: str) -> Path | None:
    """The nearest folder at or above ``start`` that holds one of ``markers`` (file or folder names), or None."""
    here = start.resolve()
    return next((folder for folder in (here, *here.parents) if any((folder / m).exists() for m in markers)), None)


def not_found(thing: str, fix: str, option: str | None = None) -> str:
    """The message for a project file that is not there. Outside any project (no dvc.yaml or .dvc/ here or above)
    that is the cause, since a default path such as data/tokens then points at nothing: cd into the project, or
    pass ``option``. In a project, ``fix`` (the stage that writes it)."""
    if _enclosing_project():
        return f"{thing} not found; {fix}"
    return (f"{thing} not found: {Path.cwd().resolve()} is in no project (no {PIPELINE} here or above); cd into the "
            "project folder" + (f", or pass {option}" if option else ""))


def tracking_root() -> Path:
    """Where the project's MLflow store is: ``DVC_ROOT`` under DVC (a temporary workspace's runs go to the
    original project's store), else :func:`root`."""
    return Path(os.environ["DVC_ROOT"]).resolve() if os.environ.get("DVC_ROOT") else root()


def in_project(path: str) -> str:
    """A project path as seen from the current folder: unchanged in the root, ``../data/tokens`` from a subfolder."""
    project = root()
    here = Path.cwd().resolve()
    return path if project == here else os.path.relpath(project / path, here)


def default_in_project(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and ctx.get_parameter_source(param.name) is ParameterSource.DEFAULT:
        return in_project(value)
    return value


def option(*decls: str, default: str | None, **kwargs) -> click.Option:
    """A path option whose default is one of the project's paths: found from a subfolder too. A path the user
    types is theirs, relative to where they are."""
    return click.option(*decls, default=default, show_default=default is not None, callback=default_in_project,
                        **kwargs)
