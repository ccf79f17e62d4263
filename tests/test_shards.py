"""Pre-tokenized shards as a corpus: llm.c / modded-nanogpt `.bin` and nanoGPT's headerless files.

The fixtures write the files from the formats' specifications (llm.c's `write_datafile`: 256
little-endian int32, magic 20240520, version 1, token count, then uint16 ids with an EOT before each
document; nanoGPT's `prepare.py`: bare uint16 ids with an EOT after each document), never through
the project's own reader.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import MICRO_MODEL, document, dvc, new_project, run, set_params

from gpt2.core.config import DownloadConfig, StatsConfig, TokenizeConfig
from gpt2.core.errors import UserError
from gpt2.core.tokens import ShardedTokens, open_tokens, read_meta, windows
from gpt2.data.encode import tokenize_corpus
from gpt2.data.sources import download
from gpt2.data.stats import compute

EOT = 50256


def gpt2_docs(n_docs: int, seed: int = 0) -> list[list[int]]:
    from gpt2.data.tokenizer import gpt2_encoding  # tiktoken with GPT-2's ranks (tiktoken's own fetch needs a CDN)

    encoding = gpt2_encoding()
    rng = random.Random(seed)
    return [encoding.encode_ordinary(document(rng, rng.randint(3, 30))) for _ in range(n_docs)]


def write_llmc(path: Path, tokens: list[int] | np.ndarray, magic: int = 20240520, version: int = 1,
               count: int | None = None) -> Path:
    header = np.zeros(256, dtype="<i4")
    header[0], header[1], header[2] = magic, version, len(tokens) if count is None else count
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes())
    return path


def llmc_corpus(folder: Path, shard_tokens: int = 3000) -> tuple[dict[str, np.ndarray], int]:
    """fineweb-style shards: val first (shard 0), then train cut into fixed-size shards (documents span them)."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = gpt2_docs(40)
    stream = {split: np.array([t for doc in part for t in [EOT, *doc]], dtype=np.uint16)
              for split, part in (("val", docs[:6]), ("train", docs[6:]))}
    write_llmc(folder / "fineweb_val_000000.bin", stream["val"])
    for i, lo in enumerate(range(0, len(stream["train"]), shard_tokens)):
        write_llmc(folder / f"fineweb_train_{i + 1:06d}.bin", stream["train"][lo:lo + shard_tokens])
    return stream, len(docs)


def nanogpt_corpus(folder: Path) -> tuple[dict[str, np.ndarray], int]:
    folder.mkdir(parents=True, exist_ok=True)
    docs = gpt2_docs(20, seed=1)
    stream = {split: np.array([t for doc in part for t in [*doc, EOT]], dtype=np.uint16)
              for split, part in (("val", docs[:3]), ("train", docs[3:]))}
    for split, ids in stream.items():
        ids.tofile(folder / f"{split}.bin")
    return stream, len(docs)


def pipeline(tmp_path: Path, source: str | Path) -> Path:
    download(DownloadConfig(source=str(source)), tmp_path / "raw")
    tokenize_corpus(TokenizeConfig(), tmp_path / "raw", tmp_path / "tokens")
    return tmp_path / "tokens"


def test_sharded_tokens_slice_and_gather_windows_like_one_array():
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 50257, size=n).astype(np.uint16) for n in (7, 1, 0, 13, 5)]
    whole, sharded = np.concatenate(parts), ShardedTokens.of(parts)
    assert len(sharded) == len(whole) == 26
    for lo in range(27):
        for hi in range(lo, 27):
            assert np.array_equal(sharded[lo:hi], whole[lo:hi])
    for length in (1, 3, 9):
        starts = np.arange(0, 27 - length)  # every window, across every boundary
        assert np.array_equal(windows(sharded, starts, length), windows(whole, starts, length))


def test_llmc_shards_are_copied_once_then_linked_and_read_as_one_split(tmp_path):
    stream, n_docs = llmc_corpus(tmp_path / "fineweb")
    tokens_dir = pipeline(tmp_path, f"{tmp_path}/fineweb/fineweb_*.bin")
    meta = read_meta(tokens_dir)
    assert meta["split"] == {"mode": "shards", "shard_format": "llm.c", "eot": "before"}
    shards = meta["splits"]["train"]["shards"]
    assert len(shards) > 2 and all(s["offset"] == 1024 for s in shards)
    for split in ("train", "val"):
        assert np.array_equal(np.asarray(open_tokens(tokens_dir, split)[0:len(stream[split])]), stream[split])
        assert meta["splits"][split]["tokens"] == len(stream[split])
    for shard in meta["splits"]["train"]["shards"]:
        original = tmp_path / "fineweb" / shard["file"].split("-", 1)[1]
        raw = tmp_path / "raw" / "docs" / shard["file"]
        assert (tokens_dir / shard["file"]).stat().st_ino == raw.stat().st_ino  # the project's own: one file, linked
        assert raw.stat().st_ino != original.stat().st_ino  # the user's file: copied, never linked into DVC's cache
    stats, lengths, _ = compute(StatsConfig(), tokens_dir)
    assert stats["documents"]["total"] == n_docs
    from gpt2.data.tokenizer import gpt2_encoding

    text = {split: len(gpt2_encoding().decode_bytes([t for t in stream[split].tolist() if t != 50256]))
            for split in ("train", "val")}  # the end of a document stands for no text
    assert {split: meta["splits"][split]["bytes"] for split in text} == text  # counted once, as decoding would
    assert stats["bytes"]["total"] == sum(text.values()) and stats["bytes_per_token"] > 1
    assert sorted(lengths.tolist()) == sorted(len(d) for d in gpt2_docs(40))


def test_nanogpt_files_are_read_headerless(tmp_path):
    stream, n_docs = nanogpt_corpus(tmp_path / "shakespeare")
    tokens_dir = pipeline(tmp_path, tmp_path / "shakespeare")
    meta = read_meta(tokens_dir)
    assert meta["split"]["eot"] == "after" and meta["splits"]["val"]["shards"][0]["offset"] == 0
    for split in ("train", "val"):
        assert np.array_equal(open_tokens(tokens_dir, split), stream[split])
    assert compute(StatsConfig(), tokens_dir)[0]["documents"]["total"] == n_docs


def test_batches_are_the_same_in_ram_mapped_and_shared(tmp_path):
    import torch

    from gpt2.train.loader import BatchSampler, TokenSplit

    stream, _ = llmc_corpus(tmp_path / "fineweb", shard_tokens=500)
    tokens_dir = pipeline(tmp_path, tmp_path / "fineweb")
    batches = []
    for mode, shared in (("preload", False), ("memmap", False), ("preload", True)):
        for batching in ("vectorized", "loop"):
            sampler = BatchSampler(TokenSplit(tokens_dir, "train", mode, shared=shared), 8, 64, 0, batching,
                                   torch.device("cpu"))
            batches.append(torch.cat([torch.cat(sampler.next()) for _ in range(20)]))
    assert all(torch.equal(b, batches[0]) for b in batches)
    # windows read across shard boundaries are the stream's own tokens
    x, y = batches[0][:8], batches[0][8:16]
    assert torch.equal(x[:, 1:], y[:, :-1])


def bad(folder: Path, name: str, data: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
    return folder


def llmc_bytes(tokens: int = 10, **header) -> bytes:
    head = np.zeros(256, dtype="<i4")
    head[0], head[1], head[2] = header.get("magic", 20240520), header.get("version", 1), header.get("count", tokens)
    return head.tobytes() + np.ones(tokens, dtype="<u2").tobytes()


@pytest.mark.parametrize("name, data, match", [
    ("fineweb_train_000001.bin", llmc_bytes(magic=12345), r"fineweb_train_000001\.bin: bad magic number 12345"),
    ("fineweb_train_000001.bin", llmc_bytes(version=2), r"fineweb_train_000001\.bin: llm\.c shard version 2 .*LLaMA-3"),
    ("fineweb_train_000001.bin", llmc_bytes(count=11), r"fineweb_train_000001\.bin: the header says 11 tokens"),
    ("fineweb_train_000001.bin", llmc_bytes()[:-3], r"fineweb_train_000001\.bin: the header says 10 tokens"),
    ("fineweb_train_000001.bin", b"\x01\x02" * 100, r"fineweb_train_000001\.bin: 200 bytes, shorter than llm\.c's"),
    ("train.bin", b"\x01\x02\x03", r"train\.bin: 3 bytes is an odd length"),
    ("shard_000001.bin", llmc_bytes(), r"shard_000001\.bin: cannot tell which split"),
])
def test_malformed_shards_are_refused_by_name_and_nothing_is_written(tmp_path, name, data, match):
    source = bad(tmp_path / "src", name, data)
    write_llmc(source / "fineweb_val_000000.bin", [EOT, 1, 2, 3])
    with pytest.raises(UserError, match=match):
        download(DownloadConfig(source=str(source)), tmp_path / "raw")
    assert not (tmp_path / "raw").exists()


def test_mixed_or_incomplete_shard_sources_are_refused(tmp_path):
    source = tmp_path / "mixed"
    llmc_corpus(source)
    (source / "notes.txt").write_text("some text\n")
    with pytest.raises(UserError, match="mixes text files and token shards"):
        download(DownloadConfig(source=str(source)), tmp_path / "raw")

    only_train = tmp_path / "only_train"
    only_train.mkdir()
    write_llmc(only_train / "fineweb_train_000001.bin", [EOT, 5, 6, 7])
    download(DownloadConfig(source=str(only_train)), tmp_path / "raw")
    with pytest.raises(UserError, match="no val file; add one whose name has a val word"):
        tokenize_corpus(TokenizeConfig(), tmp_path / "raw", tmp_path / "tokens")
    assert not (tmp_path / "tokens").exists()

    formats = tmp_path / "formats"
    formats.mkdir()
    write_llmc(formats / "fineweb_train_000001.bin", [EOT, 5, 6, 7])
    np.array([5, 6, EOT], dtype=np.uint16).tofile(formats / "val.bin")
    download(DownloadConfig(source=str(formats)), tmp_path / "raw2")
    with pytest.raises(UserError, match="mixes llm.c shards and nanoGPT's headerless files"):
        tokenize_corpus(TokenizeConfig(), tmp_path / "raw2", tmp_path / "tokens")


def test_the_speedrun_s_yardstick_scores_the_first_val_tokens_and_times_the_target(tmp_path):
    """The speedrun's set (docs/gpu.md), scaled down, on llm.c's FineWeb-style shards: every eval scores the val
    split's first tokens end to end, and the run records when it reached the target loss."""
    from conftest import micro_params

    from gpt2.train import trainer
    from gpt2.train.evaluator import windows_of

    llmc_corpus(tmp_path / "fineweb")
    tokens = pipeline(tmp_path, f"{tmp_path}/fineweb/fineweb_*.bin")
    params = micro_params(eval_from="start", eval_windows=20, target_val_loss=10.95, stop_at_target=False)
    s = trainer.build(params, tokens)
    assert windows_of(s, s.val_data).tolist() == [16 * i for i in range(20)]  # block_size 16, from token 0
    summary = trainer.train(params, tokens, tmp_path / "ckpt.pt", tmp_path / "reports")
    assert summary["target"]["reached"] and summary["target"]["time_s"] > 0 and summary["val"]["bpb"] > 0
    with pytest.raises(UserError, match=r"train.eval_windows 1000 × 16 tokens from the start of the val split need "
                                        r"16,001 tokens, and .* has [\d,]+; lower train.eval_windows to \d+ or less"):
        trainer.build(micro_params(eval_from="start", eval_windows=1000), tokens)


def test_ids_of_another_tokenizer_are_refused(tmp_path):
    source = tmp_path / "llama"
    source.mkdir()
    write_llmc(source / "x_train_000001.bin", [EOT, 60000, 5])
    write_llmc(source / "x_val_000000.bin", [EOT, 5])
    download(DownloadConfig(source=str(source)), tmp_path / "raw")
    with pytest.raises(UserError, match=r"x_train_000001\.bin holds token id 60000, outside GPT-2's vocab of 50257"):
        tokenize_corpus(TokenizeConfig(), tmp_path / "raw", tmp_path / "tokens")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["llm.c", "nanogpt"])
def test_dvc_repro_trains_and_evaluates_on_shards_with_one_copy(tmp_path, fmt):
    source = tmp_path / "shards"
    stream, _ = llmc_corpus(source) if fmt == "llm.c" else nanogpt_corpus(source)
    root = new_project(tmp_path)
    set_params(root, download={"source": f"{source}/*.bin"}, model=MICRO_MODEL)
    stages = [] if fmt == "llm.c" else ["tokenize"]  # the formats part at tokenize; one goes on to train and evaluate
    dvc(root, "repro", *stages)
    meta = read_meta(root / "data" / "tokens")
    assert meta["split"]["shard_format"] == fmt
    assert np.array_equal(np.asarray(open_tokens(root / "data" / "tokens", "val")), stream["val"])
    assert (root / "reports" / "eval" / "metrics.json").is_file() == (not stages)
    cached = {p.stat().st_ino: p for p in (root / ".dvc" / "cache").rglob("*") if p.is_file()}
    for name in (s["file"] for split in ("train", "val") for s in meta["splits"][split]["shards"]):
        raw, tokens = root / "data" / "raw" / "docs" / name, root / "data" / "tokens" / name
        # one copy of the user's shard: DVC's cache object, data/raw and data/tokens; the user's file apart from it
        source_file = source / name.split("-", 1)[1]
        assert raw.stat().st_ino == tokens.stat().st_ino != source_file.stat().st_ino and raw.stat().st_ino in cached
    assert "Data and pipelines are up to date" in run(root, sys.executable, "-m", "dvc", "status", *stages).stdout
