"""The sha256 of a file, read in 1 MB blocks (corpora and checkpoints are larger than memory)."""

from __future__ import annotations

import hashlib
import os


def sha256_file(path: str | os.PathLike, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()
