"""What a run is called and who ran it, from git and DVC: a DVC experiment's MLflow run is named after what
its params change from its baseline commit's (``lr=0.02 · max_steps=40``), not DVC's random name."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from gpt2.core import paths
from gpt2.core.errors import UserError


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1e-3}}`` → ``{"train.lr": 1e-3}``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=paths.tracking_root(), capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


RUN_NAME_ENV = "GPT2_RUN_NAME"  # set by gpt2 grid and gpt2 ladder for each experiment they run
# the run's name in its comparison (a grid's or a ladder's): its MLflow tag comparison_run, and what keeps it from
# resuming another run's kept interrupted checkpoint (train/interrupted.py)
COMPARISON_RUN_ENV = "GPT2_COMPARISON_RUN"


def experiment_run_name(params_path: str | Path = paths.PARAMS) -> str | None:
    """What a DVC experiment's MLflow run is called: what its params change from its baseline commit's
    (``lr=0.02 · max_steps=40``), where DVC alone would show a random name (``dusky-oast``, kept as the
    tag ``dvc_exp_name``). ``GPT2_RUN_NAME`` (a grid's or a ladder's name for the run) comes first.
    DVC's name where the params cannot be read; None outside ``dvc exp``."""
    if os.environ.get(RUN_NAME_ENV):
        return os.environ[RUN_NAME_ENV]
    rev, dvc_name = os.environ.get("DVC_EXP_BASELINE_REV"), os.environ.get("DVC_EXP_NAME")
    if not dvc_name or not rev:
        return dvc_name
    changed = changes_since(rev, paths.PARAMS, params_path, paths.tracking_root())
    return dvc_name if changed is None else changed or "params as committed"


def changes_since(rev: str, committed: str, params_path: str | Path, repo: Path, full: bool = False) -> str | None:
    """What ``params_path`` changes from the params file ``committed`` (its path in ``repo``) at ``rev``, as
    runs are named (``lr=0.02``; ``full``: ``train.lr=0.02``; "" for nothing); None where either cannot be read."""
    import yaml

    try:
        out = subprocess.run(["git", "show", f"{rev}:{committed}"], cwd=repo, capture_output=True, text=True,
                             timeout=10)
        before = yaml.safe_load(out.stdout) if out.returncode == 0 else None
        after = yaml.safe_load(Path(params_path).read_text())
    except (OSError, subprocess.TimeoutExpired, ValueError, yaml.YAMLError):
        return None
    if not isinstance(before, dict) or not isinstance(after, dict):
        return None
    return changes_name(flatten(_checked(before)), flatten(_checked(after)), full=full)


def _checked(raw: dict[str, Any]) -> dict[str, Any]:
    """Params as the stages read them (DVC rewrites ``"off"`` as a bare ``off``, which YAML reads as false)."""
    from gpt2.core.config import Params, build, to_dict

    try:
        return to_dict(build(Params, raw, ""))
    except UserError:
        return raw


def changes_name(before: dict[str, Any], after: dict[str, Any], most: int = 4, full: bool = False) -> str:
    """``lr=0.02 · model.attention=manual``: the dotted keys whose values differ, a key shown without its
    section where no other section has it (``full``: every key with it); past ``most`` keys, how many more."""
    changed = [k for k in after if k in before and before[k] != after[k]]
    leaves = [k.rsplit(".", 1)[-1] for k in after]

    def shown(key: str) -> str:
        leaf = key.rsplit(".", 1)[-1]
        value = after[key]
        text = f"{value:g}" if isinstance(value, float) else json_value(value)
        return f"{leaf if leaves.count(leaf) == 1 and not full else key}={text}"

    parts = [shown(k) for k in changed[:most]] + ([f"+{len(changed) - most} more"] if len(changed) > most else [])
    return " · ".join(parts)


def json_value(value: Any) -> str:
    """A param's value as people write it: text bare, the rest as JSON (``true``, ``0.002``, ``[0.9, 0.95]``)."""
    return value if isinstance(value, str) else json.dumps(value)


def who() -> dict[str, str]:
    """Who ran it and where: the git user (not the login, ``root`` on every container) and the host."""
    import re
    import socket

    tags = {"host": socket.gethostname()}
    try:  # git's own answer: GIT_AUTHOR_NAME/EMAIL, then the config
        out = subprocess.run(["git", "var", "GIT_AUTHOR_IDENT"], cwd=paths.tracking_root(), capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return tags
    found = re.match(r"(.*?) <(.*?)> \d+ [+-]\d+$", out.stdout.strip()) if out.returncode == 0 else None
    if found:
        name, email = found.groups()
        tags |= {"mlflow.user": name or email, "git_user": f"{name} <{email}>"}
    return tags
