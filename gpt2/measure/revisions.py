"""`gpt2 grid --rev A,B`: each git revision's own code, run in a checkout of its own, on the workspace's data and
params.

A code revision is not a params experiment: DVC bases its experiments on the workspace's commit,
so these runs are not DVC experiments. Each revision is checked out once (a detached git worktree
under ``.dvc/tmp/gpt2-revisions/``), the workspace's token folder linked into it, and its own
params.yaml given the workspace's value of every key both know (then the run's settings and seed),
so every revision trains on the same data and params and only the code differs; a key the
revision does not know is left out, and said. A run is that
revision's train stage (then its evaluate stage, for ``--target evaluate``) in its checkout, its
output appended to the comparison's log, its reports read back as soon as it ends (the next run
of that revision replaces them). It logs to the workspace's MLflow store, where its ``git_commit``
tag names the revision it ran.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpt2.core import paths
from gpt2.core.errors import UserError
from gpt2.measure.experiments import Experiment, code_changes, named, parse_val_curve, uncommitted_code, wait_or_stop

CHECKOUTS = Path(".dvc") / "tmp" / "gpt2-revisions"


@dataclass(frozen=True)
class Checkout:
    """A revision as given (``main``, ``HEAD~1``), the commit it names, the folder its code is checked out in,
    and its own params.yaml."""

    rev: str
    commit: str
    path: Path
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.rev if self.commit.startswith(self.rev) else f"{self.rev} ({self.commit[:7]})"


def parse_revs(text: str) -> list[str]:
    revs = [r.strip() for r in text.split(",") if r.strip()]
    if len(revs) < 2:
        raise UserError(f"--rev {text!r}: give two or more git revisions, the baseline first (--rev main,my-branch)")
    if len(set(revs)) < len(revs):
        raise UserError(f"--rev {text!r} names a revision twice; to compare a commit with itself, give it two names "
                        "(--rev main,HEAD)")
    return revs


@contextlib.contextmanager
def checked_out(root: Path, revs: str | None) -> Iterator[dict[str, Checkout]]:
    """Every revision of ``revs`` checked out, by label (none without ``revs``); removed on the way out, whatever
    the way (a bad revision, Ctrl-C)."""
    made: dict[str, Checkout] = {}
    try:
        for rev in parse_revs(revs) if revs else []:
            checkout = check_out(root, rev)
            made[checkout.label] = checkout
        yield made
    finally:
        remove(root, list(made.values()))


def commit_of(root: Path, rev: str) -> str:
    """The commit ``rev`` names, or one clear error."""
    out = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=root,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise UserError(f"--rev {rev!r} names no commit of this repository (git log --oneline --all lists them)")
    return out.stdout.strip()


def check_out(root: Path, rev: str) -> Checkout:
    """The revision's code in its own worktree (made once, reused), with the workspace's tokens linked in."""
    commit = commit_of(root, rev)
    tokens = root / "data" / "tokens"
    if not tokens.is_dir():
        raise UserError(f"{tokens} is missing: every revision trains on the workspace's tokens; run `dvc repro "
                        "tokenize` (or `dvc pull`) first")
    path = root / CHECKOUTS / commit[:12]
    if not (path / ".git").exists():
        shutil.rmtree(path, ignore_errors=True)
        subprocess.run(["git", "worktree", "prune"], cwd=root, capture_output=True)
        made = subprocess.run(["git", "worktree", "add", "--detach", "--force", str(path), commit], cwd=root,
                              capture_output=True, text=True)
        if made.returncode != 0:
            raise UserError(f"cannot check out {rev} in {path}: {made.stderr.strip()}")
    link = path / "data" / "tokens"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(tokens.resolve(), target_is_directory=True)
    shown = subprocess.run(["git", "show", f"{commit}:{paths.PARAMS}"], cwd=root, capture_output=True, text=True)
    own = yaml.safe_load(shown.stdout) if shown.returncode == 0 else None
    return Checkout(rev, commit, path, own if isinstance(own, dict) else {})


def remove(root: Path, checkouts: list[Checkout]) -> None:
    """Remove the worktrees (their runs' reports were read; their MLflow runs are in the workspace's store)."""
    for checkout in checkouts:
        subprocess.run(["git", "worktree", "remove", "--force", str(checkout.path)], cwd=root, capture_output=True)


def run(checkout: Checkout, name: str, params: dict[str, Any], target: str, log: Path, run_name: str) -> int:
    """One run of the revision: its train stage (and evaluate) on ``params``, from nothing (no checkpoint or report
    of the run before). Returns the exit status; Ctrl-C or SIGTERM stops it as ``experiments.run_now`` does."""
    from gpt2.run.names import COMPARISON_RUN_ENV, RUN_NAME_ENV
    from gpt2.run.mlflow_store import tracking_uri

    for old in ("checkpoints", "reports/train", "reports/eval"):
        shutil.rmtree(checkout.path / old, ignore_errors=True)
    (checkout.path / paths.PARAMS).write_text(yaml.safe_dump(params, sort_keys=False))
    env = {**os.environ, RUN_NAME_ENV: run_name, COMPARISON_RUN_ENV: name, "MLFLOW_TRACKING_URI": tracking_uri(),
           "PYTHONPATH": str(checkout.path)}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as sink:
        for stage in ("train", "evaluate") if target == "evaluate" else ("train",):
            sink.write(f"\n--- {name}: {checkout.label}, stage {stage}\n")
            sink.flush()
            process = subprocess.Popen([sys.executable, "-m", f"stages.{stage}"], cwd=checkout.path, stdout=sink,
                                       stderr=subprocess.STDOUT, env=env, start_new_session=True)
            if code := wait_or_stop(process):
                return code
    return 0


def collect(checkout: Checkout, name: str) -> tuple[Experiment, Any] | None:
    """The run just ended in ``checkout``, as a grid reads an experiment, with its val curve; None without metrics."""
    def read(path: str) -> Any:
        with contextlib.suppress(OSError, json.JSONDecodeError):
            return json.loads((checkout.path / path).read_text())
        return None

    train = read(paths.TRAIN_METRICS)
    if not train:
        return None
    metrics = {paths.TRAIN_METRICS: train, **({paths.EVAL_METRICS: e} if (e := read(paths.EVAL_METRICS)) else {})}
    params = yaml.safe_load((checkout.path / paths.PARAMS).read_text())
    curve_file = checkout.path / paths.VAL_CURVE
    curve = parse_val_curve(curve_file.read_text()) if curve_file.is_file() else None
    return (Experiment(name, checkout.commit, time.strftime("%Y-%m-%dT%H:%M:%S"), params, metrics,
                       {paths.TRAIN_SUMMARY: read(paths.TRAIN_SUMMARY)}), curve)


def params_for(checkout: Checkout, workspace: dict[str, Any], sets: dict[str, Any]) -> dict[str, Any]:
    """The revision's own params.yaml with the workspace's value of every key both know, then ``sets`` (dotted
    ``section.key``: the run's settings, seed and length)."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in checkout.params.items()}
    for section, values in workspace.items():
        if isinstance(values, dict) and isinstance(out.get(section), dict):
            out[section].update({k: v for k, v in values.items() if k in out[section]})
    for key, value in sets.items():
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name] = value
    return out


def same_code(root: Path, checkouts: list[Checkout]) -> list[str]:
    """What would make a comparison of ``checkouts`` compare less than it seems, said before its first run: a
    revision whose code is the baseline's (the same commit, or one that changes only params.yaml, which the runs
    take from the workspace), and code edited in the workspace and not committed, which no revision holds."""
    said = []
    base = checkouts[0]
    for other in checkouts[1:]:
        if other.commit == base.commit:
            said.append(f"--rev {base.rev} and {other.rev} are the same commit ({base.commit[:7]}): the grid compares "
                        "its code with itself (an A/A comparison, this machine's noise)")
        elif not code_changes(root, base.commit, other.commit):
            said.append(f"--rev {other.rev} changes none of {base.rev}'s code (params.yaml, docs or reports at most, "
                        "and every run takes its params from the workspace): their runs train alike; compare params "
                        "with -S key=a,b instead")
    if edited := uncommitted_code(root):
        said.append(f"the workspace's uncommitted changes to {named(edited)} are in no revision (each runs its "
                    "commit): to compare them, commit them on a branch of their own and add that branch to --rev")
    return said


def unknown_keys(checkout: Checkout, workspace: dict[str, Any]) -> list[str]:
    """The workspace's params the revision's params.yaml does not have (a key added since): left out of its runs."""
    return [f"{section}.{key}" for section, values in workspace.items() if isinstance(values, dict)
            for key in values if key not in (checkout.params.get(section) or {})]
