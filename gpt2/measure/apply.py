"""``--apply``: the settings a comparison found better outside noise, written into params.yaml.

Only a params.yaml that git holds as committed is changed, so nothing a user typed is lost: DVC's own
``dvc exp apply`` replaces the workspace's params.yaml whole, uncommitted edits and all. Each changed
line keeps its comment; the file is checked as the stages load it before it replaces the old one.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpt2.core import paths
from gpt2.core.atomic import write_files
from gpt2.core.config import RESOLVED_ON_DEVICE, load_params
from gpt2.core.errors import UserError
from gpt2.core.schema import bare_off


@dataclass(frozen=True)
class Change:
    """One params.yaml line to write, and why: the figure outside noise and the report that holds it."""

    key: str  # section.key
    value: Any
    why: str


def apply(changes: list[Change], params_path: str | Path = paths.PARAMS) -> str:
    """Write ``changes`` into params.yaml (only those that change a value); return what was done, diff included."""
    path = Path(params_path)
    text = path.read_text()
    data = yaml.safe_load(text) or {}
    todo = [c for c in changes if not runs_the_same(c.key, value_of(data, c.key), c.value)]
    if not changes:
        return "nothing to apply: no setting is better than the baseline outside noise; params.yaml is unchanged"
    if not todo:
        return "params.yaml already holds every winning setting: " + "; ".join(
            f"{c.key}={_scalar(c.value)}" + ("" if bare_off(value_of(data, c.key)) == bare_off(c.value) else
                                             f" ({c.key} {_scalar(value_of(data, c.key))} runs it here, and is kept)")
            for c in changes)
    refuse_uncommitted(path)
    new = text
    for change in todo:
        new = set_line(new, change.key, change.value)
    check(new, data, todo, path)
    write_files(path.parent, {path.name: new})
    diff = "".join(difflib.unified_diff(text.splitlines(True), new.splitlines(True), f"a/{path.name}",
                                        f"b/{path.name}", n=0))
    reasons = "\n".join(f"  {c.key}={_scalar(c.value)}: {c.why}" for c in todo)
    return f"applied to {path} (commit it, or `git checkout HEAD -- {path.name}` to undo):\n{diff}\nwhy:\n{reasons}"


def runs_the_same(key: str, held: Any, wanted: Any) -> bool:
    """Whether params.yaml's ``held`` already runs as ``wanted`` on this machine. An ``auto`` of a setting the
    device resolves (RESOLVED_ON_DEVICE: ``cpu_gemm: auto`` is oneDNN on an AMD CPU and BLAS on an Intel one) is
    kept where it resolves here to the winner: writing what it resolved to would make the file wrong for the next
    machine."""
    if bare_off(held) == bare_off(wanted):  # a bare off in the file is the choice off
        return True
    return held == "auto" and key in RESOLVED_ON_DEVICE and auto_here(key) == wanted


def auto_here(key: str) -> str | None:
    """What ``auto`` of ``key`` resolves to here (None: no auto to resolve): the CPU matmul library on this CPU,
    the dtype on the device train.device auto picks (a GPU where there is one)."""
    import torch

    from gpt2.model.loss import cpu_gemm
    from gpt2.run.device import dtype_for

    if key == "train.cpu_gemm":
        return cpu_gemm("auto", "cpu")
    if key == "train.dtype":
        return dtype_for("auto", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return None


def refuse_uncommitted(path: Path) -> None:
    """A params.yaml with edits git has not committed is never overwritten."""
    status = subprocess.run(["git", "status", "--porcelain", "--", path.name], cwd=path.parent or ".",
                            capture_output=True, text=True)
    if status.returncode != 0:
        raise UserError(f"--apply needs {path} in a git repository (to never overwrite an edit): "
                        f"{status.stderr.strip()}")
    if status.stdout.strip():
        raise UserError(f"{path} has uncommitted edits; --apply never overwrites them: commit them (git commit "
                        f"{path.name}) or set them aside (git stash), then apply again")


def set_line(text: str, key: str, value: Any) -> str:
    """``text`` with ``section.key`` set to ``value`` on its own line, keeping the line's comment; a key that is
    missing is added at the end of its section (and the section at the end of the file)."""
    section, _, name = key.partition(".")
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if re.match(rf"{re.escape(section)}:\s*(#.*)?$", line)), None)
    if start is None:
        return (text.rstrip("\n") + f"\n\n{section}:\n" + f"  {name}: {_in_file(value)}".rstrip() + "\n"
                + "".join(_block(value, "  ")))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip() and not lines[i][0].isspace()
                and not lines[i].startswith("#")), len(lines))
    pattern = re.compile(rf"([ \t]+){re.escape(name)}:([ \t]*)([^#\n]*?)([ \t]*#.*)?(\n?)$")
    for i in range(start + 1, end):
        match = pattern.match(lines[i])
        if match:
            indent, gap, old, comment, newline = match.groups()
            head = f"{indent}{name}:" + (f" {shown}" if (shown := _in_file(value, like=old)) else "")
            if comment:  # keep the comment's column where the new value leaves room
                column = len(indent) + len(name) + 1 + len(gap) + len(old) + len(comment) - len(comment.lstrip())
                comment = " " * max(1, column - len(head)) + comment.lstrip()
            lines[i] = f"{head}{comment or ''}".rstrip() + (newline or chr(10))
            following = i + 1  # a block value (a list on the lines below) goes with the old one
            while not old and following < end and _in_block(lines[following], len(indent)):
                del lines[following]
                end -= 1
            lines[i + 1:i + 1] = _block(value, indent)
            return "".join(lines)
    last = max(i for i in range(start, end) if lines[i].strip())
    lines[last + 1:last + 1] = [f"  {name}: {_in_file(value)}".rstrip() + "\n", *_block(value, "  ")]
    return "".join(lines)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip()) if line.strip() else 10**6


def _in_block(line: str, key_indent: int) -> bool:
    """Whether ``line`` belongs to the block value of a key indented ``key_indent``: deeper, or a list item at the
    key's own indent (as DVC writes lists: ``  betas:`` then ``  - 0.9``)."""
    return _indent(line) > key_indent or (_indent(line) == key_indent and line.lstrip().startswith("- "))


def _block(value: Any, indent: str) -> list[str]:
    """The lines below a key whose value is a list, one item each, as DVC writes them."""
    return [f"{indent}- {_in_file(item)}".rstrip() + "\n" for item in value] if isinstance(value, list) and value \
        else []


def _in_file(value: Any, like: str = "") -> str:
    """A value as params.yaml holds it, in the form `dvc exp run -S` writes the file back (ruamel's YAML 1.2): null
    as nothing, ``off`` bare (the config reads YAML 1.1's false back as off), a list as a block (its items on the
    lines below), so the two never rewrite each other's lines."""
    if value is None or (isinstance(value, list) and value):
        return ""
    return "off" if value == "off" else _scalar(value, like)


def _scalar(value: Any, like: str = "") -> str:
    """A value as params.yaml writes it: floats with a dot before the exponent (YAML reads 1e-05 as text), and in
    the exponent form where the value it replaces (``like``) was written so (``3.0e-3`` for ``1.0e-3``)."""
    if isinstance(value, float) and math.isfinite(value) and value and re.fullmatch(r"[-+]?\d+\.?\d*e[-+]?\d+", like):
        text = next(s for digits in range(1, 18) if float(s := f"{value:.{digits}e}") == value)
        mantissa, _, exponent = text.partition("e")
        return f"{mantissa.rstrip('0')}{'0' * mantissa.endswith('.0')}e{int(exponent):+d}"
    if isinstance(value, float):
        text = repr(value)
        mantissa, e, exponent = text.partition("e")
        return f"{mantissa}.0e{exponent}" if e and "." not in mantissa else text
    if isinstance(value, str) and yaml.safe_load(value) == value and ":" not in value and "#" not in value:
        return value
    return json.dumps(value)


def value_of(data: dict[str, Any], key: str) -> Any:
    """params.yaml's ``section.key`` in ``data``, or a marker no value equals where it is missing."""
    section, _, name = key.partition(".")
    return (data.get(section) or {}).get(name, _MISSING)


_MISSING = object()


def check(new: str, old: dict[str, Any], changes: list[Change], path: Path) -> None:
    """The new file reads as the old one with the changes, and the stages accept it."""
    expected = yaml.safe_load(yaml.safe_dump(old))
    for change in changes:
        section, _, name = change.key.partition(".")
        expected.setdefault(section, {})[name] = False if change.value == "off" else change.value  # YAML 1.1's
    if yaml.safe_load(new) != expected:
        raise UserError(f"--apply could not write {', '.join(c.key for c in changes)} into {path} line by line; "
                        "set them by hand")
    scratch = path.with_name(f".{path.name}.apply")
    try:
        scratch.write_text(new)
        load_params(scratch)
    except UserError as exc:
        raise UserError(f"--apply: {exc} (params.yaml left as it was)") from None
    finally:
        scratch.unlink(missing_ok=True)
