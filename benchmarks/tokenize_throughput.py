"""Tokenizer throughput (MB/s) and peak RSS on the embedded corpus and a synthetic big one.

    python benchmarks/tokenize_throughput.py                 # embedded + 1 GB, all worker counts
    python benchmarks/tokenize_throughput.py --synthetic-mb 0 --workers 1,2

Each measurement runs in a fresh child process, so its peak RSS is its own.
The synthetic corpus repeats the embedded texts into 256 documents with
their lines shuffled per document: Shakespeare's token mix at web-corpus size.
Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def child(raw: str, out: str, workers: int, chunk_kb: int) -> None:
    from gpt2.core.config import TokenizeConfig
    from gpt2.data.encode import tokenize_corpus
    from gpt2.data.tokenizer import gpt2_encoding

    gpt2_encoding()  # load the BPE outside the timed region
    start = time.perf_counter()
    meta = tokenize_corpus(TokenizeConfig(workers=workers, chunk_kb=chunk_kb), raw, out)
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tokens = sum(s["tokens"] for s in meta["splits"].values())
    nbytes = sum(s["bytes"] for s in meta["splits"].values())
    print(json.dumps({"seconds": seconds, "bytes": nbytes, "tokens": tokens, "peak_rss_mb": peak_mb}))


def synthesize(embedded_raw: Path, target: Path, megabytes: int, docs: int = 256) -> None:
    lines = []
    for path in sorted((embedded_raw / "docs").iterdir()):
        lines += path.read_text().splitlines(keepends=True)
    rng = random.Random(0)
    per_doc = megabytes * 1_000_000 // docs
    target.mkdir(parents=True)
    for i in range(docs):
        rng.shuffle(lines)
        with open(target / f"doc{i:04d}.txt", "w") as out:
            written = 0
            while written < per_doc:
                for line in lines:
                    out.write(line)
                    written += len(line)
                    if written >= per_doc:
                        break


@click.command()
@click.option("--synthetic-mb", default=1024, show_default=True, help="size of the synthetic corpus; 0 to skip")
@click.option("--workers", default=None, help="comma-separated worker counts (default: 1 and all cores)")
@click.option("--chunk-kb", default=1024, show_default=True)
@click.option("--child-run", nargs=2, hidden=True)
@click.option("--child-workers", type=int, hidden=True)
def main(synthetic_mb: int, workers: str | None, chunk_kb: int, child_run, child_workers) -> None:
    if child_run:
        child(*child_run, child_workers, chunk_kb)
        return
    from gpt2.core.config import DownloadConfig
    from gpt2.data.sources import download

    counts = [int(w) for w in workers.split(",")] if workers else sorted({1, os.cpu_count() or 1})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        download(DownloadConfig(), tmp / "embedded")
        corpora = [("embedded (5.1 MB)", tmp / "embedded")]
        if synthetic_mb:
            synthesize(tmp / "embedded", tmp / "synthetic_src", synthetic_mb)
            download(DownloadConfig(source=str(tmp / "synthetic_src")), tmp / "synthetic")
            shutil.rmtree(tmp / "synthetic_src")
            corpora.append((f"synthetic ({synthetic_mb} MB)", tmp / "synthetic"))
        for name, raw in corpora:
            for count in counts:
                cmd = [sys.executable, __file__, "--child-run", str(raw), str(tmp / "tokens"),
                       "--child-workers", str(count), "--chunk-kb", str(chunk_kb)]
                result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
                rows.append((name, count, result))
                print(f"{name}, {count} workers: {result['bytes'] / 1e6 / result['seconds']:.1f} MB/s, "
                      f"peak RSS {result['peak_rss_mb']:.0f} MB", file=sys.stderr)
    print(f"\nCPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; chunk_kb={chunk_kb}\n")
    print("| corpus | workers | MB/s | M tokens/s | tokens | seconds | peak RSS (MB) |")
    print("|---|---|---|---|---|---|---|")
    for name, count, r in rows:
        print(f"| {name} | {count} | {r['bytes'] / 1e6 / r['seconds']:.1f} | {r['tokens'] / 1e6 / r['seconds']:.2f} "
              f"| {r['tokens']:,} | {r['seconds']:.1f} | {r['peak_rss_mb']:.0f} |")


if __name__ == "__main__":
    main()
