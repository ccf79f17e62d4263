"""The stats stage: figures equal to a direct count, its plot files, and a token file that does not match its
meta.json refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpt2.core.config import DownloadConfig, StatsConfig, TokenizeConfig
from gpt2.core.errors import UserError
from gpt2.data.encode import tokenize_corpus
from gpt2.data.sources import download
from gpt2.data.stats import dataset_stats
from gpt2.data.tokenizer import EOT_ID, gpt2_encoding


@pytest.fixture
def tokens_dir(tmp_path, corpus) -> Path:
    download(DownloadConfig(source=str(corpus)), tmp_path / "raw")
    tokenize_corpus(TokenizeConfig(), tmp_path / "raw", tmp_path / "tokens")
    return tmp_path / "tokens"


def test_metrics_match_a_direct_count(tmp_path, tokens_dir, corpus):
    metrics = dataset_stats(StatsConfig(top_tokens=5), tokens_dir, tmp_path / "report")
    enc = gpt2_encoding()
    docs = [enc.encode_ordinary(p.read_text()) for p in sorted(corpus.iterdir())]
    all_ids = np.concatenate([np.array(d) for d in docs])
    lengths = np.array([len(d) for d in docs])
    assert metrics["documents"]["total"] == 12
    assert metrics["tokens"]["total"] == len(all_ids) + 12
    assert metrics["bytes"]["total"] == sum(p.stat().st_size for p in corpus.iterdir())
    assert metrics["unique_tokens"] == len(np.unique(all_ids))
    assert metrics["vocab_coverage"] == round(len(np.unique(all_ids)) / 50257, 4)
    assert metrics["doc_tokens"]["max"] == lengths.max()
    assert metrics["doc_tokens"]["p50"] == float(np.percentile(lengths, 50))
    ids, counts = np.unique(all_ids, return_counts=True)
    top = ids[np.argsort(-counts, kind="stable")][:5]
    assert [t["id"] for t in metrics["top_tokens"]] == top.tolist()
    assert metrics["top_tokens"][0]["token"] == enc.decode([int(top[0])])
    assert metrics["top_tokens"][0]["share"] == round(counts.max() / len(all_ids), 4)  # of the text's tokens
    assert json.loads((tmp_path / "report" / "summary.json").read_text()) == metrics
    assert sorted(json.loads((tmp_path / "report" / "metrics.json").read_text())) == [
        "bytes_per_token", "documents", "tokens", "unique_tokens", "vocab_coverage"]


def test_plot_files(tmp_path, tokens_dir):
    metrics = dataset_stats(StatsConfig(length_bins=4), tokens_dir, tmp_path / "report", context=100)
    longer = metrics["doc_tokens"]["p50"] > 100  # the training context on the plot, and the documents past it
    assert metrics["context"]["tokens"] == 100 and (metrics["context"]["documents_longer"] >= 0.5) == longer
    assert "context" not in dataset_stats(StatsConfig(length_bins=4), tokens_dir, tmp_path / "r2")
    report = tmp_path / "report"
    hist = (report / "doc_lengths.tsv").read_text().splitlines()
    assert hist[0] == "doc_tokens\tdocuments"
    assert sum(int(line.split("\t")[1]) for line in hist[1:]) == 12
    ranks = (report / "rank_frequency.tsv").read_text().splitlines()
    assert ranks[0].startswith("rank\tcount")
    counts = [int(line.split("\t")[1]) for line in ranks[1:]]
    assert counts == sorted(counts, reverse=True)
    for png in ("doc_lengths.png", "rank_frequency.png"):
        assert (report / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def rewrite_meta(tokens_dir: Path, **changes) -> None:
    meta = json.loads((tokens_dir / "meta.json").read_text())
    meta.update(changes)
    (tokens_dir / "meta.json").write_text(json.dumps(meta))


def assert_fails_without_report(tmp_path, tokens_dir, match):
    with pytest.raises(UserError, match=match):
        dataset_stats(StatsConfig(), tokens_dir, tmp_path / "report")
    assert not (tmp_path / "report").exists()


def test_wrong_dtype_in_meta(tmp_path, tokens_dir):
    rewrite_meta(tokens_dir, dtype="int32")
    assert_fails_without_report(tmp_path, tokens_dir, "dtype 'int32'.*must be uint16")


def test_file_written_with_another_dtype(tmp_path, tokens_dir):
    ids = np.fromfile(tokens_dir / "train.bin", dtype=np.uint16)
    ids.astype(np.int32).tofile(tokens_dir / "train.bin")
    assert_fails_without_report(tmp_path, tokens_dir, "train.bin has .* bytes .* written with another dtype")


def test_truncated_file(tmp_path, tokens_dir):
    data = (tokens_dir / "val.bin").read_bytes()
    (tokens_dir / "val.bin").write_bytes(data[:-7])
    assert_fails_without_report(tmp_path, tokens_dir, "val.bin has .* truncated")


def test_truncated_file_with_consistent_meta(tmp_path, tokens_dir):
    ids = np.fromfile(tokens_dir / "val.bin", dtype=np.uint16)[:-3]
    ids.tofile(tokens_dir / "val.bin")
    meta = json.loads((tokens_dir / "meta.json").read_text())
    meta["splits"]["val"]["tokens"] = len(ids)
    (tokens_dir / "meta.json").write_text(json.dumps(meta))
    assert_fails_without_report(tmp_path, tokens_dir, "does not end with the EOT token")


def test_ids_outside_the_vocab(tmp_path, tokens_dir):
    ids = np.fromfile(tokens_dir / "train.bin", dtype=np.uint16)
    ids[0] = 60000
    ids.tofile(tokens_dir / "train.bin")
    assert_fails_without_report(tmp_path, tokens_dir, "token id 60000 >= vocab size")


def test_missing_tokens(tmp_path):
    assert_fails_without_report(tmp_path, tmp_path / "nothing", "run the tokenize stage first")


def test_eot_is_not_a_top_token(tmp_path, tokens_dir):
    metrics = dataset_stats(StatsConfig(top_tokens=50), tokens_dir, tmp_path / "report")
    assert EOT_ID not in [t["id"] for t in metrics["top_tokens"]]
