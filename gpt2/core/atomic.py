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
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpt2.core.errors import UserError


def _temp_sibling(final: Path) -> Path:
    """Where ``final`` is built; first removes the temporaries of ``final`` that a killed process left."""
    sweep_stale(final)
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


def sweep_stale(final: Path) -> None:
    """Delete ``.NAME.tmp-PID`` and ``.NAME.old-PID`` siblings whose process is dead: a SIGKILL during a write
    leaves them, and inside a DVC output folder (checkpoints/) DVC would cache them as part of it."""
    if not final.parent.is_dir():
        return
    leftovers = [p for kind in ("tmp", "old") for p in final.parent.glob(f".{glob_escape(final.name)}.{kind}-*")]
    for stale in leftovers:
        pid = stale.name.rsplit("-", 1)[1]
        if pid.isdigit() and not alive(int(pid)):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    stale.unlink()


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, owns: tuple[str, ...], command: str) -> Iterator[Path]:
    """Yield an empty temporary directory that replaces ``final`` on success.

    Replacing a folder deletes what was in it, which is right only for a folder this command wrote: so an
    existing ``final`` must hold nothing but what ``command`` writes (``owns``: names or glob patterns).
    Anything else makes it a user's folder, which is refused before any work, never emptied."""
    final = Path(os.path.abspath(final))  # "." has no name to build a sibling from
    check_owned(final, owns, command)
    tmp = _temp_sibling(final)
    try:
        with _explain_write_failure(final):
            final.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
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
    tmp = _temp_sibling(final)
    try:
        with _explain_write_failure(final):
            final.parent.mkdir(parents=True, exist_ok=True)
            yield tmp
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(OSError):  # absent, or a read-only folder where it never existed
            tmp.unlink()


def json_text(obj: Any) -> str:
    """``obj`` as the indented JSON the reports use. A NaN or infinite figure (the standard error of one
    window) is written as null: JSON has no NaN, and DVC and other readers refuse the bare token."""
    return json.dumps(finite(obj), indent=2, sort_keys=False, allow_nan=False) + "\n"


def finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    with atomic_file(path) as tmp:
        tmp.write_text(json_text(obj))


def write_files(folder: str | os.PathLike, contents: dict[str, bytes | str]) -> None:
    """Write a stage's files as one: every file goes to a temporary first (where a full disk fails), and
    only when all are written are they renamed into place. A failure leaves none of them new and no
    temporary behind. ``contents`` keys are paths relative to ``folder``."""
    folder = Path(folder)
    temps: list[tuple[Path, Path]] = []
    try:
        with _explain_write_failure(folder):
            for name, data in contents.items():
                final = folder / name
                final.parent.mkdir(parents=True, exist_ok=True)
                temps.append((_temp_sibling(final), final))
                with open(temps[-1][0], "wb") as handle:
                    handle.write(data.encode() if isinstance(data, str) else data)
                    handle.flush()
                    os.fsync(handle.fileno())
            for tmp, final in temps:
                os.replace(tmp, final)
    finally:
        for tmp, _ in temps:
            with contextlib.suppress(OSError):
                tmp.unlink()


# What a failed write's errno means, and what to do about it.
WRITE_FAILURES = {
    errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file larger than this system or the shell's file-size limit allows (ulimit -f)",
    errno.EROFS: "read-only file system", errno.EACCES: "no permission to write there",
    errno.EPERM: "no permission to write there",
}


def write_failure_cause(target: Path, exc: BaseException) -> str | None:
    """Why writing ``target`` failed, in words, or None when it is not a failure of the disk. torch.save's
    writer reports any failed write as a bare RuntimeError: the disk, the limit and the folder say why."""
    if isinstance(exc, OSError):
        return WRITE_FAILURES.get(exc.errno)
    torch_writer = ("PytorchStreamWriter", "inline_container", "iostream error")  # its ways of saying "write failed"
    if not (isinstance(exc, RuntimeError) and any(word in str(exc) for word in torch_writer)):
        return None
    import resource

    folder = target.parent if target.parent.exists() else Path(".")
    if shutil.disk_usage(folder).free < 64 * 2**20:
        return WRITE_FAILURES[errno.ENOSPC]
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        return WRITE_FAILURES[errno.EFBIG]
    if not os.access(folder, os.W_OK):
        return WRITE_FAILURES[errno.EACCES]
    return f"the write failed ({str(exc).splitlines()[0][:120]})"


@contextlib.contextmanager
def _explain_write_failure(target: Path) -> Iterator[None]:
    try:
        yield
    except (OSError, RuntimeError) as exc:
        cause = write_failure_cause(target, exc)
        if cause is None:
            raise
        raise UserError(f"writing {target} failed: {cause}; free some space, raise the limit or fix the "
                        "permissions, then run the stage again (what it wrote before is kept)") from None
