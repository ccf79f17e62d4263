"""Pre-tokenized shards through download → tokenize → stats: time, rate, peak RSS and disk.

    python benchmarks/shard_import.py                   # 1 B tokens (2 GB) in 100 M-token shards
    python benchmarks/shard_import.py --tokens 2e8 --shard-tokens 5e7

Writes llm.c-format shards of random GPT-2 ids into a temp folder on the same filesystem, then runs
each stage in a fresh child process (its own peak RSS), and counts disk by inode: the source, data/raw
and data/tokens together should occupy the source's size once (hard links), not three times. The
page cache is warm after the shards are written, as it would be after a download: the rates are
what the CPU does, not the disk. Also times random training batches read from the shards (memmap,
ShardedTokens) against the same tokens in one file. Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def stage(name: str, work: Path) -> None:
    from gpt2.core.config import DownloadConfig, StatsConfig, TokenizeConfig
    from gpt2.data.encode import tokenize_corpus
    from gpt2.data.sources import download
    from gpt2.data.stats import dataset_stats

    start = time.perf_counter()
    if name == "download":
        download(DownloadConfig(source=str(work / "shards")), work / "raw")
    elif name == "tokenize":
        tokenize_corpus(TokenizeConfig(), work / "raw", work / "tokens")
    else:
        dataset_stats(StatsConfig(), work / "tokens", work / "stats")
    print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss_mb": peak_rss_mb()}))


def peak_rss_mb() -> float:
    """This process's own peak (VmHWM): getrusage's ru_maxrss keeps the parent's peak across fork and exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_shards(folder: Path, tokens: int, shard_tokens: int) -> None:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    header = np.zeros(256, dtype="<i4")
    header[0], header[1] = 20240520, 1
    val = min(shard_tokens, tokens // 10)
    plan = [("val", 0, val)] + [("train", i + 1, min(shard_tokens, tokens - val - lo))
                                for i, lo in enumerate(range(0, tokens - val, shard_tokens))]
    for split, index, n in plan:
        ids = rng.integers(0, 50256, size=n, dtype=np.uint16)
        ids[rng.random(n) < 1 / 1000] = 50256  # documents of about 1,000 tokens
        ids[0] = 50256
        header[2] = n
        with open(folder / f"fineweb_{split}_{index:06d}.bin", "wb") as out:
            out.write(header.tobytes())
            out.write(ids.tobytes())


def disk_bytes(*folders: Path) -> int:
    """Bytes on disk, each inode once (hard links are one file)."""
    seen: dict[tuple[int, int], int] = {}
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file():
                info = path.stat()
                seen[(info.st_dev, info.st_ino)] = info.st_blocks * 512
    return sum(seen.values())


def batch_rate(work: Path, steps: int = 200) -> tuple[float, float]:
    """Random 8 × 1024 windows per second: from the shards (mapped) and from one file of the same tokens."""
    import torch

    from gpt2.core.tokens import read_chunks, split_shards
    from gpt2.train.loader import BatchSampler, TokenSplit

    sharded = TokenSplit(work / "tokens", "train", "memmap")
    single = work / "single"
    single.mkdir()
    with open(single / "train.bin", "wb") as out:
        for _, chunk in read_chunks(work / "tokens", split_shards(sharded.meta, "train")):
            out.write(chunk.tobytes())
    meta = {"dtype": "uint16", "splits": {"train": {"file": "train.bin", "tokens": sharded.length}}}
    (single / "meta.json").write_text(json.dumps(meta))
    rates = []
    for data in (sharded, TokenSplit(single, "train", "memmap")):
        sampler = BatchSampler(data, 8, 1024, 0, "vectorized", torch.device("cpu"))
        sampler.next()
        start = time.perf_counter()
        for _ in range(steps):
            sampler.next()
        rates.append(steps / (time.perf_counter() - start))
    return rates[0], rates[1]


@click.command()
@click.option("--tokens", default=1e9, show_default=True, help="tokens in all shards")
@click.option("--shard-tokens", default=1e8, show_default=True, help="tokens per shard (llm.c's FineWeb: 1e8)")
@click.option("--stage-name", hidden=True)
@click.option("--work", hidden=True)
def main(tokens: float, shard_tokens: float, stage_name: str | None, work: str | None) -> None:
    if stage_name:
        return stage(stage_name, Path(work))
    with tempfile.TemporaryDirectory(dir=ROOT / "data") as tmp:
        work = Path(tmp)
        write_shards(work / "shards", int(tokens), int(shard_tokens))
        source = disk_bytes(work / "shards")
        n_files = len(list((work / "shards").iterdir()))
        print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; {int(tokens):,} tokens in "
              f"{n_files} llm.c shards, {source / 1e9:.2f} GB\n")
        print("| stage | seconds | GB/s | peak RSS (MB) |\n|---|---|---|---|")
        for name in ("download", "tokenize", "stats"):
            out = subprocess.run([sys.executable, __file__, "--stage-name", name, "--work", str(work)],
                                 capture_output=True, text=True, check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"| {name} | {result['seconds']:.1f} | {source / 1e9 / result['seconds']:.2f} "
                  f"| {result['peak_rss_mb']:.0f} |")
        together = disk_bytes(work / "shards", work / "raw", work / "tokens")
        print(f"\ndisk: source {source / 1e9:.2f} GB; source + data/raw + data/tokens {together / 1e9:.2f} GB "
              f"({together / source:.3f}x)")
        shards, single = batch_rate(work)
        print(f"random 8 x 1024 batches (memmap, vectorized): {shards:,.0f}/s from {n_files - 1} train shards, "
              f"{single:,.0f}/s from one file ({shards / single:.2f}x)")


if __name__ == "__main__":
    main()
