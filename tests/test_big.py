"""Splits of more than 2^31 tokens (FineWeb's 10 B): sparse files, so nothing writes 4 GB."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_tokens, micro_params

from gpt2.core.config import EvalConfig, StatsConfig
from gpt2.core.tokens import CHUNK, Shard, read_chunks, read_meta, windows
from gpt2.data import stats
from gpt2.eval import evaluate as evaluation
from gpt2.train.loader import BatchSampler, TokenSplit
from gpt2.train.trainer import train

BIG = 2**31 + 2**20  # tokens: indices past what an int32 holds
PATTERN_AT = 2**31 + 12_345
PATTERN = np.arange(1, 65, dtype=np.uint16)


def big_split(folder: Path, split: str) -> Path:
    """Replace ``split`` of a token folder with a sparse file of BIG tokens: zeros, a pattern past 2^31, EOT last."""
    path = folder / f"{split}.bin"
    with open(path, "wb") as handle:
        handle.truncate(2 * BIG)
        handle.seek(2 * PATTERN_AT)
        handle.write(PATTERN.tobytes())
        handle.seek(2 * (BIG - 1))
        handle.write(np.uint16(50256).tobytes())
    if path.stat().st_blocks * 512 > 64 << 20:
        pytest.skip("this filesystem does not keep files sparse")
    meta = json.loads((folder / "meta.json").read_text())
    meta["splits"][split].update(tokens=BIG, documents=1)
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


@pytest.fixture
def big_train(tmp_path):
    return big_split(make_tokens(tmp_path / "tokens"), "train")


def test_batches_index_past_2_31(big_train):
    data = TokenSplit(big_train, "train", "memmap")
    assert data.length == BIG
    assert np.array_equal(windows(data.array(), np.array([PATTERN_AT, PATTERN_AT + 10]), 8),
                          np.stack([PATTERN[:8], PATTERN[10:18]]))
    for batching in ("vectorized", "loop"):
        sampler = BatchSampler(data, 2, 8, 0, batching, torch.device("cpu"))

        class Late:  # the sampler's draws, steered past 2^31
            @staticmethod
            def integers(low, high, size):
                assert high == BIG - 8
                return np.full(size, PATTERN_AT, dtype=np.int64)

        sampler.rng = Late()
        x, y = sampler.next()
        assert x.tolist() == [PATTERN[:8].tolist()] * 2 and y.tolist() == [PATTERN[1:9].tolist()] * 2


def test_a_shard_is_read_past_2_31_into_one_buffer(big_train):
    """read_chunks seeks past 4 GB into the sparse file and refills one buffer: a whole split in constant memory."""
    start = PATTERN_AT - 100  # a piece of the split that starts past 2^31 tokens, the pattern inside it
    piece = [Shard("train.bin", 2 * start, 4096)]
    read = [(lo, chunk.copy(), chunk.__array_interface__["data"][0])
            for lo, chunk in read_chunks(big_train, piece, size=1024, whole_files=False)]
    assert [lo for lo, _, _ in read] == [0, 1024, 2048, 3072] and len({at for _, _, at in read}) == 1
    tokens = np.concatenate([chunk for _, chunk, _ in read])
    assert np.array_equal(tokens[100:164], PATTERN) and not tokens[:100].any() and not tokens[164:].any()


def test_stats_count_past_2_31_in_bounded_memory(big_train, monkeypatch):
    """The train split's chunks as read_chunks hands them over (one buffer, refilled), made in memory: reading
    4 GB of a sparse file fills the page cache with 4 GB of zeroed pages (13 s on a 2-core AMD EPYC, where the
    counting takes 3). The test above reads the file itself past 2^31."""
    import resource

    def chunks(tokens_dir, shards, size=CHUNK):
        if shards[0].tokens != BIG:
            yield from read_chunks(tokens_dir, shards, size)
            return
        buffer = np.empty(size, dtype=np.uint16)
        for lo in range(0, BIG, size):
            chunk = buffer[:min(size, BIG - lo)]
            chunk[:] = 0
            if lo <= PATTERN_AT < lo + len(chunk):
                chunk[PATTERN_AT - lo:PATTERN_AT - lo + len(PATTERN)] = PATTERN
            if lo + len(chunk) == BIG:
                chunk[-1] = 50256
            yield lo, chunk

    monkeypatch.setattr(stats, "read_chunks", chunks)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    metrics, lengths, counts = stats.compute(StatsConfig(), big_train)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert metrics["tokens"]["train"] == BIG and int(lengths.max()) == BIG - 1  # one document, then its EOT
    assert (counts[1:65] >= 1).all() and counts[0] > 2**31  # the pattern past 2^31 was counted
    assert grown_mb < 512  # 4.3 GB counted; nothing kept of a chunk once it is counted


@pytest.mark.slow
def test_evaluate_scores_a_val_split_past_2_31(tmp_path):
    tokens = big_split(make_tokens(tmp_path / "tokens"), "val")
    cfg = micro_params(max_steps=2, eval_interval=2, eval_windows=4, data_loading="memmap")
    train(cfg, tokens, tmp_path / "ckpt.pt", tmp_path / "reports")
    spans = evaluation.windows(BIG, 32, 65_536, 1337)  # 67 M windows: drawn from, never listed
    assert len(spans) == 2048 and max(start for start, _ in spans) > 0.99 * 2**31  # across the whole split
    summary = evaluation.evaluate(EvalConfig(max_tokens=4096, max_new_tokens=2, num_samples=1, prompts=("Hi",),
                                             mlflow=False), tmp_path / "ckpt.pt", tokens, tmp_path / "eval")
    assert summary["val"]["tokens"] == 4096 and np.isfinite(summary["val"]["loss"])


def test_the_unigram_baseline_reads_a_bounded_sample_of_a_big_train_split(tmp_path, monkeypatch):
    """Evenly spaced pieces: every region of the split is counted, and no more than the budget."""
    tokens = make_tokens(tmp_path / "tokens", n_train=10_000)
    regions = np.repeat(np.arange(10, dtype=np.uint16), 1000)  # token i in the i-th tenth
    regions.tofile(tokens / "train.bin")
    meta = read_meta(tokens)
    monkeypatch.setattr(evaluation, "CHUNK", 100)
    counts = evaluation.train_counts(tokens, meta, 1000)
    assert counts.sum() == 1000 and all(counts[i] > 0 for i in (0, 5, 9))
    assert evaluation.train_counts(tokens, meta, None).tolist()[:10] == [1000] * 10
