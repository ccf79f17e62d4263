"""Pre-tokenized GPT-2 shards as a corpus: checked, linked, never copied.

Two formats are read, both flat uint16 GPT-2 ids:

- llm.c / modded-nanogpt ``.bin``: a header of 256 little-endian int32 (magic
  20240520, version 1, token count), then the tokens; EOT comes *before* each
  document (``fineweb_train_000001.bin``, ``fineweb_val_000000.bin``);
- nanoGPT's headerless ``train.bin`` / ``val.bin`` (``prepare.py``): EOT comes
  *after* each document, as in this project's own files.

A ``.bin`` named exactly ``train.bin`` or ``val.bin`` without the llm.c magic is
nanoGPT's; any other ``.bin`` must carry the header. The split is read from the
name: a ``val`` word (``val``, ``valid``, ``validation``) or a ``train`` word.

Download hard-links the files into ``data/raw/docs/`` and tokenize links them
again into ``data/tokens/``: on one filesystem no byte is copied, and DVC's
content-addressed cache stores the shared content once (docs/data.md, "Token shards").
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpt2.core import log
from gpt2.core.errors import UserError
from gpt2.core.progress import Progress
from gpt2.core.tokens import Shard, read_chunks

logger = log.get("download")

LLMC_MAGIC = 20240520
LLMC_VERSION = 1  # uint16 GPT-2 tokens; llm.c's version 2 holds uint32 LLaMA-3 tokens
LLMC_HEADER_INTS = 256
LLMC_HEADER_BYTES = LLMC_HEADER_INTS * 4
NANOGPT_NAMES = ("train.bin", "val.bin")
VAL_WORDS = {"val", "valid", "validation"}
EOT_POSITION = {"llm.c": "before", "nanogpt": "after"}


@dataclass(frozen=True)
class ShardFile:
    format: str  # llm.c | nanogpt
    split: str
    offset: int
    tokens: int


def is_shard(path: Path | str) -> bool:
    return str(path).lower().endswith(".bin")


def inspect_shard(path: Path, name: str) -> ShardFile:
    """Check one file's header and length; every malformed file gets one message naming it."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(LLMC_HEADER_BYTES)
    magic = int(np.frombuffer(head[:4], dtype="<i4")[0]) if len(head) >= 4 else None
    split = shard_split(name)
    if magic != LLMC_MAGIC and Path(name).name in NANOGPT_NAMES:
        if size % 2:
            raise UserError(f"{name}: {size} bytes is an odd length, not a whole number of uint16 tokens; "
                            "the file is truncated or is not a nanoGPT token file")
        return ShardFile("nanogpt", split, 0, size // 2)
    if len(head) < LLMC_HEADER_BYTES:
        raise UserError(f"{name}: {size} bytes, shorter than llm.c's 1024-byte header; the file is truncated or "
                        "is not a token shard (nanoGPT's headerless files must be named train.bin / val.bin)")
    header = np.frombuffer(head, dtype="<i4")
    if magic != LLMC_MAGIC:
        raise UserError(f"{name}: bad magic number {magic} (llm.c shards start with {LLMC_MAGIC}); it is not an "
                        "llm.c token shard (nanoGPT's headerless files must be named train.bin / val.bin)")
    if header[1] != LLMC_VERSION:
        what = " (uint32 tokens of another tokenizer, e.g. LLaMA-3)" if header[1] == 2 else ""
        raise UserError(f"{name}: llm.c shard version {header[1]}{what}; only version {LLMC_VERSION} "
                        "(GPT-2 uint16 tokens) can be read: re-tokenize it for GPT-2")
    tokens = int(header[2])
    expected = LLMC_HEADER_BYTES + 2 * tokens
    if tokens < 0 or size != expected:
        raise UserError(f"{name}: the header says {tokens} tokens ({expected} bytes with the header) but the file "
                        f"has {size} bytes; it is truncated or corrupt: download it again")
    return ShardFile("llm.c", split, LLMC_HEADER_BYTES, tokens)


def shard_split(name: str) -> str:
    words = set(re.split(r"[^a-z0-9]+", Path(name).name.lower().removesuffix(".bin")))
    if words & VAL_WORDS:
        return "val"
    if "train" in words:
        return "train"
    raise UserError(f"{name}: cannot tell which split this token shard belongs to; name it with a train or val "
                    "word (fineweb_train_000001.bin, fineweb_val_000000.bin, train.bin, val.bin)")


def link_or_copy(src: Path, dst: Path) -> bool:
    """Hard-link ``src`` to ``dst``; copy where links are impossible (another filesystem). True if linked."""
    try:
        os.link(Path(src).resolve(), dst)  # resolved: linking a symlink itself would copy a dangling relative link
        return True
    except OSError:
        shutil.copyfile(src, dst)
        return False


def import_shards(raw_dir: Path, manifest: dict[str, Any], out: Path, vocab_size: int, eot_id: int,
                  token_bytes: np.ndarray) -> dict[str, dict[str, Any]]:
    """Link the downloaded shards into the token folder ``out`` and check every id; return meta's splits.

    One pass over the tokens (at disk speed, with progress): ids must be below the vocab, the EOTs
    counted give each split's documents, and ``token_bytes`` (each id's bytes of text) its bytes."""
    entries = [e for e in manifest["files"] if e["format"] in EOT_POSITION]
    if len({e["format"] for e in entries}) > 1:
        raise UserError("download.source mixes llm.c shards and nanoGPT's headerless files; use one format")
    splits: dict[str, dict[str, Any]] = {}
    copied = []
    with Progress("import", total=sum(e["tokens"] for e in entries) * 2, unit="B") as progress:
        for split in ("train", "val"):
            shards = []
            for entry in (e for e in entries if e["split"] == split):
                name = Path(entry["path"]).name
                if not link_or_copy(raw_dir / entry["path"], out / name):
                    copied.append(name)
                shards.append(Shard(name, entry["offset"], entry["tokens"]))
            if not shards:
                raise UserError(f"the token shards have no {split} file; add one whose name has a {split} word "
                                f"(e.g. fineweb_{split}_000000.bin or {split}.bin) to download.source")
            eots = text = 0
            for shard in shards:
                for _, chunk in read_chunks(out, [shard]):
                    if chunk.size and int(chunk.max()) >= vocab_size:
                        raise UserError(f"{shard.file} holds token id {int(chunk.max())}, outside GPT-2's vocab of "
                                        f"{vocab_size}: it was made with another tokenizer; use GPT-2 token shards")
                    eots += int(np.count_nonzero(chunk == eot_id))
                    text += int(token_bytes[chunk].sum(dtype=np.int64))
                    progress.update(chunk.nbytes)
            splits[split] = {"shards": [asdict(s) for s in shards], "tokens": sum(s.tokens for s in shards),
                             "documents": eots, "bytes": text}
    if copied:
        logger.warning(f"{len(copied)} shard(s) copied, not linked (another filesystem?): {', '.join(copied[:3])}")
    return splits
