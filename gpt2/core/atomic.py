"""Write outputs so that a failed run leaves nothing half-written behind.

Every stage builds its outputs in a hidden temporary sibling and renames it
into place only when everything succeeded. A crash, a Ctrl-C or a full disk
removes the temporary and leaves the old output (or no output) in place.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpt2.core.errors import UserError


def _temp_sibling(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, owns: tuple[str, ...], command: str) -> Iterator[Path]:
    """Yield an empty temporary directory that replaces ``final`` on success.

    Replacing a folder deletes what was in it, which is right only for a folder this command wrote: so an
    existing ``final`` must hold nothing but what ``command`` writes (``owns``: names or glob patterns).
    Anything else makes it a user's folder, which is refused before any work, never emptied."""
    final = Path(os.path.abspath(final))  # "." has no name to build a sibling from
    check_owned(final, owns, command)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with _explain_disk_full(final):
            yield tmp
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_owned(folder: Path, owns: tuple[str, ...], command: str) -> None:
    """Refuse ``folder`` unless it is absent, empty, or holds only what ``command`` writes."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise UserError(f"{folder} is a file; {command} writes a folder there: give it a folder's path")
    foreign = sorted(p.name for p in folder.iterdir() if not any(fnmatch.fnmatch(p.name, pattern) for pattern in owns))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UserError(f"{folder} holds {shown}, which {command} does not write; it replaces its output folder "
                        "whole, so it will not write into this one: give it a new or empty folder (or move those "
                        "files away)")


@contextlib.contextmanager
def atomic_file(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path; on success it is fsynced and renamed to ``final``."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(final)
    try:
        with _explain_disk_full(final):
            yield tmp
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


@contextlib.contextmanager
def _explain_disk_full(target: Path) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(
                f"disk full while writing {target}; free some space on that disk (or move the project) "
                "and run the stage again"
            ) from None
        raise
