"""Raw documents → ``train.bin`` / ``val.bin`` + ``meta.json``, streamed and parallel.

Memory stays bounded whatever the corpus size: files are read in blocks of
``tokenize.chunk_kb``, at most ``2 × workers`` blocks are in flight, and tokens
go straight to disk. Threads are enough for parallelism because tiktoken
releases the GIL while it encodes.

A long document is cut into blocks only at a newline that sits between two
non-space characters: there the GPT-2 pre-tokenizer always splits, so the
tokens are exactly those of the uncut text (tests check this).
"""

from __future__ import annotations

import codecs
import collections
import gzip
import json
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from gpt2.core import log, paths
from gpt2.core.atomic import atomic_dir, write_json
from gpt2.core.config import TokenizeConfig
from gpt2.core.digest import sha256_file
from gpt2.core.errors import UserError
from gpt2.core.progress import Progress
from gpt2.core.tokens import DTYPE, FORMAT, META, TOKEN_BYTES
from gpt2.data.shards import EOT_POSITION, import_shards
from gpt2.data.sources import MANIFEST
from gpt2.data.tokenizer import EOT_ID, NAME, RANKS_SHA256, VOCAB_SIZE, gpt2_encoding, token_byte_lengths

TOKEN_FILES = ("*.bin", META, TOKEN_BYTES)  # what a token folder holds: the splits (or linked shards), meta.json
# and each id's bytes of text

logger = log.get("tokenize")

MAX_BLOCKS_WITHOUT_CUT = 64  # then cut anyway: a file with no newlines at all


@dataclass
class Piece:
    """A run of text from one document; ``last`` marks the document's end."""

    split: str
    text: str
    last: bool
    raw_bytes: int


@dataclass
class SplitWriter:
    path: Path
    handle: IO[bytes]
    tokens: int = 0
    documents: int = 0
    bytes: int = 0

    def write(self, ids: np.ndarray) -> None:
        self.handle.write(ids.tobytes())
        self.tokens += len(ids)


@dataclass
class DecodeStats:
    replaced: int = 0
    errors: list[str] = field(default_factory=list)


_EOT = np.array([EOT_ID], dtype=DTYPE)


def tokenize_corpus(cfg: TokenizeConfig, raw_dir: str | Path = paths.RAW,
                    out_dir: str | Path = paths.TOKENS) -> dict[str, Any]:
    """Tokenize the raw folder into ``out_dir`` atomically; return meta.json's content. Out of memory (the RAM,
    or an address-space limit such as ``ulimit -v``, where even a thread cannot start) is one error that says
    what to lower; the temporary output is removed."""
    try:
        return _tokenize_corpus(cfg, Path(raw_dir), out_dir)
    except (MemoryError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and "can't start new thread" not in str(exc):
            raise
        workers = cfg.workers or os.cpu_count() or 1
        raise UserError(f"tokenize ran out of memory ({type(exc).__name__}: {exc or 'no detail'}; the RAM, or a limit "
                        f"such as ulimit -v): lower tokenize.workers (now {workers}) or tokenize.chunk_kb (now "
                        f"{cfg.chunk_kb}), or raise the limit; nothing was written") from None


def _tokenize_corpus(cfg: TokenizeConfig, raw_dir: Path, out_dir: str | Path) -> dict[str, Any]:
    manifest = read_manifest(raw_dir)
    if manifest.get("tokens"):
        return import_token_shards(raw_dir, manifest, Path(out_dir))
    n_docs = manifest["documents"]
    encoding = gpt2_encoding()
    workers = cfg.workers or os.cpu_count() or 1
    within = n_docs == 1
    if within:
        logger.info("tokenize: the corpus is one document, so val is its last "
                    f"{cfg.val_fraction:.0%} of tokens (split inside the document)")
    is_val = np.zeros(n_docs, dtype=bool) if within else val_mask(n_docs, cfg.val_fraction, cfg.seed)
    decode = DecodeStats()
    with atomic_dir(out_dir, owns=TOKEN_FILES, command="tokenize") as tmp:
        splits = {name: SplitWriter(tmp / f"{name}.bin", open(tmp / f"{name}.bin", "wb")) for name in ("train", "val")}
        try:
            with ThreadPoolExecutor(workers) as pool, \
                    Progress("tokenize", total=text_bytes(manifest), unit="B") as progress:
                pending: collections.deque[tuple[Future, list[Piece]]] = collections.deque()
                for batch in batches(pieces(raw_dir, manifest, is_val, cfg, decode), cfg.chunk_kb * 1024):
                    pending.append((pool.submit(encode_batch, encoding, [p.text for p in batch]), batch))
                    while len(pending) >= 2 * workers:
                        drain(pending.popleft(), splits, progress, within)
                while pending:
                    drain(pending.popleft(), splits, progress, within)
        finally:
            for writer in splits.values():
                writer.handle.close()
        if within:
            split_within_document(splits, cfg.val_fraction, encoding)
        meta = token_meta(raw_dir, manifest, RANKS_SHA256,
                          split={"mode": "within-document" if within else "documents",
                                 "val_fraction": cfg.val_fraction, "seed": cfg.seed},
                          splits={name: {"file": w.path.name, "tokens": w.tokens, "documents": w.documents,
                                         "bytes": w.bytes} for name, w in splits.items()},
                          decode={"on_error": cfg.on_decode_error, "replaced_chars": decode.replaced})
        write_json(tmp / META, meta)
        np.save(tmp / TOKEN_BYTES, token_byte_lengths(), allow_pickle=False)
    total = sum(s["tokens"] for s in meta["splits"].values())
    logger.info(f"tokenize: {total:,} tokens (train {meta['splits']['train']['tokens']:,}, "
                f"val {meta['splits']['val']['tokens']:,}); {decode.replaced} characters replaced")
    return meta


def import_token_shards(raw_dir: Path, manifest: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Pre-tokenized shards: nothing to encode; link them into the token folder and describe them."""
    lengths = token_byte_lengths()
    with atomic_dir(out_dir, owns=TOKEN_FILES, command="tokenize") as tmp:
        splits = import_shards(raw_dir, manifest, tmp, VOCAB_SIZE, EOT_ID, lengths)
        fmt = next(e["format"] for e in manifest["files"])
        meta = token_meta(raw_dir, manifest, None,  # the shards' own ids: GPT-2's, checked in range
                          split={"mode": "shards", "shard_format": fmt, "eot": EOT_POSITION[fmt]}, splits=splits)
        write_json(tmp / META, meta)
        np.save(tmp / TOKEN_BYTES, lengths, allow_pickle=False)
    logger.info(f"tokenize: {len(manifest['files'])} {fmt} shards linked, not re-tokenized: train "
                f"{splits['train']['tokens']:,} tokens, val {splits['val']['tokens']:,}")
    return meta


def token_meta(raw_dir: Path, manifest: dict[str, Any], bpe_sha256: str | None, **splitting: Any) -> dict[str, Any]:
    """meta.json: the token format, the tokenizer, the raw text it came from, then how it was split
    (``split``, ``splits`` and, for text, ``decode``)."""
    return {"format": FORMAT, "dtype": DTYPE, "vocab_size": VOCAB_SIZE, "eot_id": EOT_ID,
            "tokenizer": {"name": NAME, "bpe_sha256": bpe_sha256}, "manifest_sha256": sha256_file(raw_dir / MANIFEST),
            "source": source_record(manifest), **splitting}


def source_record(manifest: dict[str, Any]) -> dict[str, Any]:
    """Where the raw text came from (download.source and what it resolved to), without the file list."""
    return {k: v for k, v in manifest.items() if k not in ("documents", "bytes", "tokens", "files")}


def read_manifest(raw_dir: Path) -> dict[str, Any]:
    path = raw_dir / MANIFEST
    if not path.is_file():
        raise UserError(paths.not_found(str(path), "run the download stage first (dvc repro download)", "--raw DIR"))
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc}); run the download stage again") from None
    for entry in manifest["files"]:
        file = raw_dir / entry["path"]
        if not file.is_file() or file.stat().st_size != entry["bytes"]:
            raise UserError(f"{file} is missing or changed since download; run the download stage again")
    if manifest["documents"] < 1 and not manifest.get("tokens"):
        raise UserError(f"{path} lists no documents; point download.source at a non-empty corpus")
    return manifest


def text_bytes(manifest: dict[str, Any]) -> int:
    """The corpus's text bytes (compressed JSON Lines count what they hold, not their size on disk)."""
    return sum(entry.get("text_bytes", entry["bytes"]) for entry in manifest["files"])


def val_mask(n_docs: int, fraction: float, seed: int) -> np.ndarray:
    """Which documents go to val: a seeded sample of round(n·fraction), at least one, never all."""
    n_val = min(n_docs - 1, max(1, round(n_docs * fraction)))
    mask = np.zeros(n_docs, dtype=bool)
    mask[np.random.default_rng(seed).choice(n_docs, size=n_val, replace=False)] = True
    return mask


def pieces(raw_dir: Path, manifest: dict[str, Any], is_val: np.ndarray, cfg: TokenizeConfig,
           decode: DecodeStats) -> Iterator[Piece]:
    """Every document of the manifest, in order, as pieces of at most about ``chunk_kb``."""
    doc = 0
    for entry in manifest["files"]:
        path = raw_dir / entry["path"]
        if entry["format"] == "jsonl":
            with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as handle:
                for line in handle:
                    if line.strip():
                        text = json.loads(line)["text"]
                        split = "val" if is_val[doc] else "train"
                        yield Piece(split, text, True, len(text.encode("utf-8", "surrogatepass")))
                        doc += 1
        else:
            split = "val" if is_val[doc] else "train"
            yield from text_pieces(path, split, cfg, decode, entry.get("origin", entry["path"]))
            doc += 1


def text_pieces(path: Path, split: str, cfg: TokenizeConfig, decode: DecodeStats,
                origin: str | None = None) -> Iterator[Piece]:
    """Read one text document in blocks and cut it only where tokenization is unaffected."""
    block = cfg.chunk_kb * 1024
    errors = "strict" if cfg.on_decode_error == "strict" else _counting_handler(decode)
    decoder = codecs.getincrementaldecoder("utf-8")(errors=errors)
    buffer, pending_bytes, offset, blocks = "", 0, 0, 0
    replaced_before, chars = decode.replaced, 0
    with open(path, "rb") as handle:
        while True:
            data = handle.read(block)
            final = not data
            try:
                buffer += decoder.decode(data, final=final)
            except UnicodeDecodeError as exc:
                raise UserError(f"{path}: invalid UTF-8 at byte {offset + exc.start}; set tokenize.on_decode_error: "
                                "replace to substitute U+FFFD, or fix the file") from None
            offset += len(data)
            pending_bytes += len(data)
            blocks += 1
            if final:
                chars += len(buffer)
                check_replaced(origin or str(path), decode.replaced - replaced_before, chars, cfg.max_replaced_fraction)
                yield Piece(split, buffer, True, pending_bytes)
                return
            cut = _last_safe_cut(buffer)
            if cut is None:  # one long line: cut before a word, so memory stays about chunk_kb whatever the line
                cut = _last_word_cut(buffer)
            if cut is None and blocks >= MAX_BLOCKS_WITHOUT_CUT:
                cut = len(buffer)  # no newline for 64 blocks: exactness gives way to bounded memory
            if cut:
                head, buffer = buffer[:cut], buffer[cut:]
                chars += len(head)
                head_bytes = pending_bytes - len(buffer.encode("utf-8", "surrogatepass"))
                yield Piece(split, head, False, head_bytes)
                pending_bytes -= head_bytes
                blocks = 0


def check_replaced(name: str, replaced: int, chars: int, limit: float) -> None:
    """``on_decode_error: replace`` is for a few bad bytes, not for a binary or a non-UTF-8 file."""
    if chars and replaced / chars > limit:
        raise UserError(f"{name}: {replaced:,} of {chars:,} characters ({replaced / chars:.1%}) are not valid UTF-8, "
                        f"more than tokenize.max_replaced_fraction ({limit:g}): it is not UTF-8 text; convert it "
                        "(e.g. iconv -f latin1 -t utf-8) or remove it from download.source")


def _last_safe_cut(text: str) -> int | None:
    """Index just after the last newline that has a non-space character on both sides."""
    pos = len(text)
    while (pos := text.rfind("\n", 0, pos)) > 0:
        if pos + 1 < len(text) and not text[pos - 1].isspace() and not text[pos + 1].isspace():
            return pos + 1
    return None


def _last_word_cut(text: str) -> int | None:
    """Index of the last single space that has a non-space character on both sides.

    GPT-2's pre-tokenizer never puts a space inside a token except as its first character, and a token
    starting at such a space is found the same with or without the text before it (the pattern looks
    ahead, never behind): cutting just before it changes no token."""
    pos = len(text) - 1
    while (pos := text.rfind(" ", 0, pos)) > 0:
        if not text[pos - 1].isspace() and not text[pos + 1].isspace():
            return pos
    return None


def _counting_handler(stats: DecodeStats) -> str:
    """Register a codecs error handler that substitutes U+FFFD and counts the substitutions."""
    name = f"gpt2-count-{id(stats)}"

    def handler(exc: UnicodeDecodeError) -> tuple[str, int]:
        stats.replaced += 1
        return "\ufffd", exc.end

    codecs.register_error(name, handler)
    return name


def batches(items: Iterator[Piece], max_chars: int) -> Iterator[list[Piece]]:
    """Group small pieces (short documents) so that each task carries about ``max_chars``."""
    batch: list[Piece] = []
    size = 0
    for piece in items:
        batch.append(piece)
        size += len(piece.text)
        if size >= max_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encode_batch(encoding: Any, texts: list[str]) -> list[np.ndarray]:
    out = []
    for text in texts:
        ids = np.asarray(encoding.encode_ordinary(text), dtype=np.uint32)
        if ids.size and int(ids.max()) >= 1 << 16:
            raise UserError(f"token id {int(ids.max())} does not fit in uint16; this tokenizer cannot be used")
        out.append(ids.astype(DTYPE))
    return out


def drain(item: tuple[Future, list[Piece]], splits: dict[str, SplitWriter], progress: Progress,
          within: bool) -> None:
    future, batch = item
    for piece, ids in zip(batch, future.result()):
        writer = splits[piece.split]
        writer.write(ids)
        writer.bytes += piece.raw_bytes
        if piece.last:
            writer.documents += 1
            if not within:
                writer.write(_EOT)
        progress.update(piece.raw_bytes)


def split_within_document(splits: dict[str, SplitWriter], fraction: float, encoding: Any) -> None:
    """Move the last ``fraction`` of the single document's tokens from train to val."""
    train, val = splits["train"], splits["val"]
    total = train.tokens
    if total < 2:
        raise UserError("the corpus is one document of fewer than 2 tokens: too small to split into train and val; "
                        "use a larger corpus")
    n_val = max(1, round(total * fraction))
    keep = total - n_val
    itemsize = np.dtype(DTYPE).itemsize
    moved_bytes = 0
    with open(train.path, "r+b") as src, open(val.path, "wb") as dst:
        src.seek(keep * itemsize)
        while data := src.read(1 << 22):
            dst.write(data)
            moved_bytes += len(encoding.decode_bytes(np.frombuffer(data, dtype=DTYPE).tolist()))
        dst.write(_EOT.tobytes())
        src.truncate(keep * itemsize)
        src.seek(0, os.SEEK_END)
        src.write(_EOT.tobytes())
    val.tokens, train.tokens = n_val + 1, keep + 1
    val.documents = 1
    val.bytes, train.bytes = moved_bytes, train.bytes - moved_bytes
