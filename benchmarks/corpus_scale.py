"""A corpus of several GB through download → tokenize → stats under `dvc repro`: time, peak RSS, disk.

    python benchmarks/corpus_scale.py                  # 5 GB of synthetic text (about 15 minutes on 2 cores)
    python benchmarks/corpus_scale.py --gb 0.5         # a quick look

The text is the embedded corpus's lines, shuffled into 512 documents (Shakespeare's token mix at
web-corpus size), written to a local folder that is `download.source`. A fresh DVC project (this
checkout's dvc.yaml, params.yaml and .dvc/config) runs each stage with `dvc repro <stage>`, timed
around the whole command (DVC's hashing and caching included); peak RSS is the largest process of
that command. Disk is counted by inode (hard links once) for the project's data/ and .dvc/cache,
first as this project stores them (`cache.type: reflink,hardlink,copy`), then after
`dvc config cache.type copy && dvc checkout --relink`, DVC's default: the "before".
"""

from __future__ import annotations

import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]


def synthesize(lines_from: Path, target: Path, total_bytes: int, docs: int = 512) -> None:
    lines = []
    for path in sorted((lines_from / "docs").iterdir()):
        lines += path.read_bytes().splitlines(keepends=True)
    rng = random.Random(0)
    target.mkdir(parents=True)
    per_doc = total_bytes // docs
    for i in range(docs):
        rng.shuffle(lines)
        block = b"".join(lines)
        with open(target / f"doc{i:04d}.txt", "wb") as out:
            written = 0
            while written < per_doc:
                piece = block[:per_doc - written]
                out.write(piece)
                written += len(piece)


def disk(*folders: Path) -> int:
    seen: dict[tuple[int, int], int] = {}
    for folder in folders:
        for path in folder.rglob("*") if folder.exists() else ():
            if path.is_file() and not path.is_symlink():
                info = path.stat()
                seen[(info.st_dev, info.st_ino)] = info.st_blocks * 512
    return sum(seen.values())


def timed(project: Path, *args: str) -> tuple[float, float]:
    """Seconds and the peak RSS (MB) of the largest process, for one DVC command run in a child."""
    probe = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
             "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
             "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)")
    out = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "dvc", *args], cwd=project,
                         check=True, capture_output=True, text=True, env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    seconds, rss = out.stdout.split()
    return float(seconds), float(rss)


@click.command()
@click.option("--gb", default=5.0, show_default=True, help="GB of text")
@click.option("--embedded", default="data/raw", show_default=True,
              help="the embedded corpus's raw folder (dvc repro download)")
def main(gb: float, embedded: str) -> None:
    import yaml

    with tempfile.TemporaryDirectory(dir=ROOT / "data") as tmp:
        work = Path(tmp)
        synthesize(Path(embedded), work / "corpus", int(gb * 1e9))
        text = disk(work / "corpus")
        project = work / "project"
        project.mkdir()
        for name in ("dvc.yaml", "params.yaml", ".dvcignore"):
            shutil.copy(ROOT / name, project / name)
        for name in ("stages", "gpt2"):
            shutil.copytree(ROOT / name, project / name, ignore=shutil.ignore_patterns("__pycache__"))
        subprocess.run(["git", "init", "-q"], cwd=project, check=True)
        subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=project, check=True)
        shutil.copy(ROOT / ".dvc" / "config", project / ".dvc" / "config")
        params = yaml.safe_load((project / "params.yaml").read_text())
        params["download"]["source"] = str(work / "corpus")
        (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; {text / 1e9:.2f} GB of text in "
              f"512 files\n")
        print("| stage | seconds | MB/s of text | peak RSS (MB) | project disk after (GB) |\n|---|---|---|---|---|")
        timed(project, "repro", "validate")
        for stage in ("download", "tokenize", "stats"):
            seconds, rss = timed(project, "repro", stage)
            used = disk(project / "data", project / ".dvc" / "cache")
            print(f"| {stage} | {seconds:.0f} | {text / 1e6 / seconds:.1f} | {rss:.0f} | {used / 1e9:.2f} |",
                  flush=True)
        meta = json.loads((project / "data" / "tokens" / "meta.json").read_text())
        tokens = sum(s["tokens"] for s in meta["splits"].values())
        data_bytes = {name: disk(project / "data" / name) for name in ("raw", "tokens")}
        linked = disk(project / "data", project / ".dvc" / "cache")
        with_source = disk(work / "corpus", project / "data", project / ".dvc" / "cache")
        subprocess.run([sys.executable, "-m", "dvc", "config", "cache.type", "copy"], cwd=project, check=True)
        subprocess.run([sys.executable, "-m", "dvc", "checkout", "--relink", "-q", "download", "tokenize"], cwd=project,
                       check=True)
        copied = disk(project / "data", project / ".dvc" / "cache")
        content = data_bytes["raw"] + data_bytes["tokens"]
        print(f"\n{tokens:,} tokens ({data_bytes['tokens'] / 1e9:.2f} GB). data/ holds {content / 1e9:.2f} GB "
              f"(raw {data_bytes['raw'] / 1e9:.2f} + tokens {data_bytes['tokens'] / 1e9:.2f}).")
        print(f"data/ + .dvc/cache: {linked / 1e9:.2f} GB with links ({linked / content:.2f}× the data), "
              f"{copied / 1e9:.2f} GB with DVC's default copies ({copied / content:.2f}×); with the source "
              f"folder too: {with_source / 1e9:.2f} GB.")


if __name__ == "__main__":
    main()
