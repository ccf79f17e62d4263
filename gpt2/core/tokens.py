"""The token file format shared by tokenize, stats, train and evaluate.

``data/tokens/{train,val}.bin`` are flat little-endian uint16 arrays (GPT-2
ids reach 50256, so int16 would overflow) with the EOT id after every
document. ``meta.json`` says how many tokens each file holds, so a truncated
file or one written with another dtype is caught before anyone reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from gpt2.core.errors import UserError

FORMAT = "gpt2-tokens/1"
DTYPE = "uint16"
META = "meta.json"
SPLITS = ("train", "val")


def read_meta(tokens_dir: str | Path) -> dict[str, Any]:
    path = Path(tokens_dir) / META
    if not path.is_file():
        raise UserError(f"{path} not found; run the tokenize stage first (dvc repro tokenize)")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not valid JSON ({exc}); run the tokenize stage again") from None
    if meta.get("dtype") != DTYPE:
        raise UserError(f"{path} says dtype {meta.get('dtype')!r}, but token files must be {DTYPE} "
                        "(GPT-2 ids reach 50256); run the tokenize stage again")
    return meta


def open_tokens(tokens_dir: str | Path, split: str, meta: dict[str, Any] | None = None) -> np.memmap:
    """Memory-map one split after checking its length against meta.json."""
    meta = meta or read_meta(tokens_dir)
    info = meta["splits"][split]
    path = Path(tokens_dir) / info["file"]
    if not path.is_file():
        raise UserError(f"{path} not found; run the tokenize stage again")
    itemsize = np.dtype(DTYPE).itemsize
    expected = info["tokens"] * itemsize
    size = path.stat().st_size
    if size != expected:
        kind = "is truncated" if size < expected else "is longer than expected"
        raise UserError(f"{path} has {size} bytes but meta.json says {info['tokens']} {DTYPE} tokens "
                        f"({expected} bytes): the file {kind} or was written with another dtype; "
                        "run the tokenize stage again")
    if size == 0:
        return np.zeros(0, dtype=DTYPE)  # np.memmap refuses empty files
    return np.memmap(path, dtype=DTYPE, mode="r")
