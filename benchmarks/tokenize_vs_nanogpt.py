"""Tokenize throughput against nanoGPT's `data/openwebtext/prepare.py` approach, on the same text.

    pip install -c constraints.txt -e '.[hf]'          # the peer's approach needs `datasets`
    python benchmarks/tokenize_vs_nanogpt.py           # 512 MB of JSON Lines, 2 workers, 2 rounds

The peer's approach, as its prepare.py does it: the corpus as a Hugging Face dataset, `map` with
`num_proc` processes (each row: `encode_ordinary` + EOT, its ids and their count stored in Arrow),
then the summed length allocates a uint16 memmap that is filled shard by shard. Ours: the
`tokenize` stage (threads over blocks of text, tokens streamed to the file). Loading the JSON into
the dataset (the peer's equivalent of our `download`) is timed apart and left out of the ratio.
Both use the same tiktoken GPT-2 encoding, the same number of workers, a fresh process per run,
alternating ours / theirs; medians over the rounds. Both outputs are checked to hold the same tokens.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_corpus(embedded_raw: Path, path: Path, megabytes: int) -> None:
    """Web-sized documents (2-8 KB) cut from the embedded corpus's shuffled lines, one JSON row each."""
    lines = []
    for doc in sorted((embedded_raw / "docs").iterdir()):
        lines += doc.read_text().splitlines(keepends=True)
    rng = random.Random(0)
    written = 0
    with open(path, "w") as out:
        while written < megabytes * 1_000_000:
            start = rng.randrange(len(lines) - 200)
            text = "".join(lines[start:start + rng.randint(30, 120)])
            out.write(json.dumps({"text": text}) + "\n")
            written += len(text.encode())


def ours(jsonl: Path, work: Path, workers: int) -> dict:
    from gpt2.core.config import DownloadConfig, TokenizeConfig
    from gpt2.data.encode import tokenize_corpus
    from gpt2.data.sources import download
    from gpt2.data.tokenizer import gpt2_encoding

    download(DownloadConfig(source=str(jsonl)), work / "raw")
    gpt2_encoding()
    start = time.perf_counter()
    meta = tokenize_corpus(TokenizeConfig(workers=workers, val_fraction=0.0005), work / "raw", work / "tokens")
    seconds = time.perf_counter() - start
    ids = np.concatenate([np.fromfile(work / "tokens" / f"{s}.bin", dtype=np.uint16) for s in ("train", "val")])
    return {"seconds": seconds, "tokens": sum(s["tokens"] for s in meta["splits"].values()),
            "checksum": int(np.bincount(ids, minlength=50257).astype(np.int64) @ np.arange(50257))}


def theirs(jsonl: Path, work: Path, workers: int) -> dict:
    os.environ["HF_DATASETS_CACHE"] = str(work / "hf-cache")
    try:
        import datasets
    except ImportError:
        raise SystemExit("the peer's approach needs Hugging Face's datasets: "
                         "pip install -c constraints.txt -e '.[hf]'") from None

    from gpt2.data.tokenizer import EOT_ID, gpt2_encoding

    encoding = gpt2_encoding()
    start = time.perf_counter()
    dataset = datasets.load_dataset("json", data_files=str(jsonl), split="train")
    load_s = time.perf_counter() - start

    def process(example):
        ids = encoding.encode_ordinary(example["text"])
        ids.append(EOT_ID)
        return {"ids": ids, "len": len(ids)}

    start = time.perf_counter()
    tokenized = dataset.map(process, remove_columns=["text"], num_proc=workers)
    total = int(np.sum(tokenized["len"], dtype=np.uint64))
    out = np.memmap(work / "train.bin", dtype=np.uint16, mode="w+", shape=(total,))
    index = 0
    shards = 1024
    for i in range(shards):
        batch = tokenized.shard(num_shards=shards, index=i, contiguous=True).with_format("numpy")
        ids = np.concatenate(batch["ids"])
        out[index:index + len(ids)] = ids
        index += len(ids)
    out.flush()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "load_s": load_s, "tokens": total,
            "checksum": int(np.bincount(np.asarray(out), minlength=50257).astype(np.int64) @ np.arange(50257))}


@click.command()
@click.option("--mb", default=512, show_default=True, help="MB of text")
@click.option("--workers", default=2, show_default=True)
@click.option("--rounds", default=2, show_default=True)
@click.option("--embedded", default="data/raw", show_default=True, help="the embedded corpus's raw folder")
@click.option("--child", nargs=3, hidden=True)
def main(mb: int, workers: int, rounds: int, embedded: str, child: tuple[str, str, str] | None) -> None:
    if child:
        which, jsonl, work = child
        result = (ours if which == "ours" else theirs)(Path(jsonl), Path(work), workers)
        print("RESULT " + json.dumps(result))
        return
    results: dict[str, list[dict]] = {"ours": [], "theirs": []}
    with tempfile.TemporaryDirectory(dir=ROOT / "data") as tmp:
        jsonl = Path(tmp) / "corpus.jsonl"
        write_corpus(Path(embedded), jsonl, mb)
        text_mb = sum(len(json.loads(line)["text"].encode()) for line in open(jsonl)) / 1e6
        for r in range(rounds):
            for which in (("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")):
                work = Path(tmp) / f"{which}-{r}"
                work.mkdir()
                out = subprocess.run([sys.executable, __file__, "--workers", str(workers), "--child", which,
                                      str(jsonl), str(work)], capture_output=True, text=True, check=True)
                result = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))[7:])
                results[which].append(result)
                print(f"  {which} round {r}: {text_mb / result['seconds']:.1f} MB/s", file=sys.stderr)
    assert results["ours"][0]["checksum"] == results["theirs"][0]["checksum"], "the two produced other tokens"
    assert results["ours"][0]["tokens"] == results["theirs"][0]["tokens"]
    rate = {k: [text_mb / r["seconds"] for r in v] for k, v in results.items()}
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; {text_mb:,.0f} MB of text "
          f"({results['ours'][0]['tokens']:,} tokens, identical in both), {workers} workers, {rounds} rounds\n")
    print("| approach | MB/s median (min–max) | seconds |\n|---|---|---|")
    for name, key in (("this project's tokenize stage", "ours"),
                      ("nanoGPT prepare.py (datasets map + memmap)", "theirs")):
        print(f"| {name} | {statistics.median(rate[key]):.1f} ({min(rate[key]):.1f}–{max(rate[key]):.1f}) | "
              f"{statistics.median(r['seconds'] for r in results[key]):.1f} |")
    load = statistics.median(r["load_s"] for r in results["theirs"])
    print(f"\nratio: {statistics.median(rate['ours']) / statistics.median(rate['theirs']):.2f}× "
          f"(theirs also spent {load:.1f} s loading the JSON into Arrow, left out)")


if __name__ == "__main__":
    main()
