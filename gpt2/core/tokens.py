"""The token file format shared by tokenize, stats, train and evaluate.

A split is a flat little-endian uint16 array (GPT-2 ids reach 50256, so int16
would overflow). ``meta.json`` says which files hold it and how many tokens
each holds, so a truncated file or one written with another dtype is caught
before anyone reads it:

- text tokenized here: one file per split, ``{train,val}.bin``, with the EOT id
  after every document;
- imported token shards (llm.c / modded-nanogpt ``.bin`` with a 1024-byte
  header, nanoGPT's headerless files): a list of ``shards``, each a file, the
  byte offset of its first token and its token count. The files are hard links
  to the downloaded ones, read in place: no second copy.

``open_tokens`` hides the difference: one file is a memmap, several are a
``ShardedTokens`` that slices and gathers across file boundaries.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np

from gpt2.core.errors import UserError

FORMAT = "gpt2-tokens/1"
DTYPE = "uint16"
META = "meta.json"
TOKEN_BYTES = "token_bytes.npy"  # each id's bytes of text (tokenize writes it): bits per byte divide by them
SPLITS = ("train", "val")
CHUNK = 1 << 24  # tokens per pass when a whole split is scanned: 32 MB of uint16


@dataclass(frozen=True)
class Shard:
    file: str  # relative to the token folder
    offset: int  # bytes before the first token (an llm.c header: 1024)
    tokens: int


def read_meta(tokens_dir: str | Path) -> dict[str, Any]:
    path = Path(tokens_dir) / META
    if not path.is_file():
        from gpt2.core.paths import not_found

        raise UserError(not_found(str(path), "run the tokenize stage first (dvc repro tokenize)", "--tokens DIR"))
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not valid JSON ({exc}); run the tokenize stage again") from None
    if not isinstance(meta, dict):
        raise UserError(f"{path} holds a JSON {type(meta).__name__}, not the token folder's description; run the "
                        "tokenize stage again")
    if meta.get("dtype") != DTYPE:
        raise UserError(f"{path} says dtype {meta.get('dtype')!r}, but token files must be {DTYPE} "
                        "(GPT-2 ids reach 50256); run the tokenize stage again")
    missing = [key for key in ("vocab_size", "eot_id", "splits") if key not in meta]
    splits = meta.get("splits")
    if not missing and isinstance(splits, dict):
        missing = [f"splits.{name}.{key}" for name in ("train", "val") for key in ("tokens",)
                   if not isinstance(splits.get(name), dict) or not isinstance(splits[name].get(key), int)]
        missing += [f"splits.{name}.file" for name in ("train", "val") if isinstance(splits.get(name), dict)
                    and "file" not in splits[name] and "shards" not in splits[name]]
    elif not missing:
        missing = ["splits (a mapping)"]
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}: it is not a token folder's meta.json this code wrote; run "
                        "the tokenize stage again")
    return meta


def token_bytes(tokens_dir: str | Path) -> np.ndarray | None:
    """Each id's bytes of text, from the token folder; None for a folder an older version wrote (no bits per byte
    until tokenize runs again)."""
    path = Path(tokens_dir) / TOKEN_BYTES
    if not path.is_file():
        return None
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} cannot be read ({exc}); run the tokenize stage again (dvc repro -f tokenize)"
                        ) from None


def bits_per_byte(mean_loss: float, tokens: int, text_bytes: int) -> float | None:
    """The loss in bits per byte of text: ``tokens`` scored at ``mean_loss`` nats each, over the ``text_bytes`` they
    stand for. None without bytes to divide by."""
    return mean_loss * tokens / (math.log(2) * text_bytes) if text_bytes > 0 else None


def split_shards(meta: dict[str, Any], split: str) -> list[Shard]:
    info = meta["splits"][split]
    if "shards" in info:
        return [Shard(s["file"], s["offset"], s["tokens"]) for s in info["shards"]]
    return [Shard(info["file"], 0, info["tokens"])]


def checked_path(tokens_dir: str | Path, shard: Shard) -> Path:
    """The shard's file, after checking its length against meta.json."""
    path = Path(tokens_dir) / shard.file
    if not path.is_file():
        raise UserError(f"{path} not found; run the tokenize stage again")
    itemsize = np.dtype(DTYPE).itemsize
    expected = shard.offset + shard.tokens * itemsize
    size = path.stat().st_size
    if size != expected:
        kind = "is truncated" if size < expected else "is longer than expected"
        raise UserError(f"{path} has {size} bytes but meta.json says {shard.tokens} {DTYPE} tokens "
                        f"({expected} bytes): the file {kind} or was written with another dtype; "
                        "run the tokenize stage again")
    return path


def open_shard(tokens_dir: str | Path, shard: Shard) -> np.ndarray:
    """Memory-map one file's tokens after checking its length against meta.json."""
    path = checked_path(tokens_dir, shard)
    if shard.tokens == 0:
        return np.zeros(0, dtype=DTYPE)  # np.memmap refuses empty files
    return np.memmap(path, dtype=DTYPE, mode="r", offset=shard.offset, shape=(shard.tokens,))


class ShardedTokens:
    """Several token files read as one array, without concatenating them (20 GB of FineWeb shards
    stay on disk, mapped): ``len``, slices, and ``windows`` for training batches. A file is opened
    the first time it is read, so a batch that touches two of a hundred shards maps two."""

    def __init__(self, lengths: Sequence[int], open_part: Callable[[int], np.ndarray]) -> None:
        self.bounds = np.cumsum([0, *lengths])
        self.part = functools.lru_cache(maxsize=None)(open_part)

    @classmethod
    def of(cls, parts: Sequence[np.ndarray]) -> ShardedTokens:
        return cls([len(p) for p in parts], parts.__getitem__)

    def __len__(self) -> int:
        return int(self.bounds[-1])

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise IndexError("ShardedTokens slices take no step")
        pieces = []
        shard = int(np.searchsorted(self.bounds, start, side="right")) - 1
        while start < stop:
            lo, hi = self.bounds[shard], self.bounds[shard + 1]
            pieces.append(self.part(shard)[start - lo:min(stop, hi) - lo])
            start, shard = hi, shard + 1
        return np.concatenate(pieces) if len(pieces) > 1 else np.asarray(pieces[0] if pieces else [], dtype=DTYPE)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """``length`` tokens from each start: one gather per shard; a window across a boundary is joined."""
        out = np.empty((len(starts), length), dtype=DTYPE)
        shard = np.searchsorted(self.bounds, starts, side="right") - 1
        inside = starts + length <= self.bounds[shard + 1]
        offsets = np.arange(length)
        for s in np.unique(shard[inside]):
            rows = np.flatnonzero(inside & (shard == s))
            out[rows] = self.part(int(s))[(starts[rows] - self.bounds[s])[:, None] + offsets]
        for row in np.flatnonzero(~inside):
            out[row] = self[int(starts[row]):int(starts[row]) + length]
        return out


Tokens = Union[np.ndarray, ShardedTokens]


def windows(tokens: Tokens, starts: np.ndarray, length: int) -> np.ndarray:
    """The ``(len(starts), length)`` batch of windows: one fancy-index gather."""
    if isinstance(tokens, ShardedTokens):
        return tokens.windows(starts, length)
    return tokens[starts[:, None] + np.arange(length)]


def open_tokens(tokens_dir: str | Path, split: str, meta: dict[str, Any] | None = None, lazy: bool = False
                ) -> Tokens:
    """One split's tokens, mapped: an array for one file, a ``ShardedTokens`` for several. Every file's
    length is checked against meta.json now, unless ``lazy`` (then each file is mapped when first read)."""
    meta = meta or read_meta(tokens_dir)
    shards = split_shards(meta, split)
    if len(shards) == 1:
        return open_shard(tokens_dir, shards[0])
    if lazy:
        return ShardedTokens([s.tokens for s in shards], lambda i: open_shard(tokens_dir, shards[i]))
    return ShardedTokens.of([open_shard(tokens_dir, s) for s in shards])


def read_chunks(tokens_dir: str | Path, shards: Sequence[Shard], size: int = CHUNK, whole_files: bool = True
                ) -> Iterator[tuple[int, np.ndarray]]:
    """(offset in the split, tokens) of every shard in turn, read with plain file reads into one reused
    buffer: a whole split (10 B tokens, say) scanned in constant memory. A mapped scan would leave every
    page it touched resident in the process (20 GB of RSS, reclaimable but alarming). The buffer is
    overwritten by the next chunk: use each before asking for the next. ``whole_files: false`` reads
    pieces of files (a shard's offset and tokens then a range inside it), skipping the length check."""
    buffer = np.empty(size, dtype=DTYPE)
    done = 0
    for shard in shards:
        with open(checked_path(tokens_dir, shard) if whole_files else Path(tokens_dir) / shard.file, "rb") as handle:
            handle.seek(shard.offset)
            for lo in range(0, shard.tokens, size):
                view = buffer[:min(size, shard.tokens - lo)]
                raw, filled = memoryview(view).cast("B"), 0
                while filled < raw.nbytes:
                    got = handle.readinto(raw[filled:])
                    if not got:
                        raise UserError(f"{handle.name} ended early; run the tokenize stage again")
                    filled += got
                yield done + lo, view
        done += shard.tokens


def split_label(meta: dict[str, Any], split: str) -> str:
    """How messages name a split: its file, or its shard files."""
    files = [s.file for s in split_shards(meta, split)]
    return files[0] if len(files) == 1 else f"{split} shards ({files[0]}, … {len(files)} files)"
