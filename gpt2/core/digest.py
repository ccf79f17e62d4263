"""A file's hash, read in 1 MB blocks (corpora and checkpoints are larger than memory): sha256 for what is
downloaded or checked against a pinned value, MD5 for DVC's hash of a file (``md5:`` of a file output in dvc.lock)."""

from __future__ import annotations

import hashlib
import os


def file_digest(path: str | os.PathLike, algorithm: str, block: int = 1 << 20) -> str:
    digest = hashlib.new(algorithm)
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    return file_digest(path, "sha256")


def file_md5(path: str | os.PathLike) -> str:
    return file_digest(path, "md5")
