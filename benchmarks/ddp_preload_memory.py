"""Memory of `data_loading: preload` with several DDP ranks: is the corpus held once or once per rank?

    python benchmarks/ddp_preload_memory.py --tokens-m 200     # a 400 MB token file, 2 gloo ranks

Trains a small model for a few steps on a synthetic token file, once in one process (preload reads
the file into a private array) and once under torchrun with 2 ranks (preload maps the file and the
ranks share the page cache's copy), and prints each process's unique memory (USS: pages no other
process shares) and RSS after training. With a private copy per rank, every rank's USS would grow
by the file's size. Needs psutil.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import click
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from train_switches import synthetic_tokens  # noqa: E402

CHILD = """
import json, os, sys
import psutil
sys.path.insert(0, {root!r})
from gpt2.core.config import load_params
from gpt2.train.trainer import train
out = sys.argv[2] + "/" + os.environ.get("RANK", "0")
train(load_params(sys.argv[1]), sys.argv[3], out + "/ckpt.pt", out + "/reports")
info = psutil.Process().memory_full_info()
print("MEM " + json.dumps({{"rank": int(os.environ.get("RANK", 0)), "uss_mb": info.uss / 1e6,
                           "rss_mb": info.rss / 1e6}}))
"""


def run(params: dict, tmp: Path, tokens: Path, nproc: int) -> list[dict]:
    path = tmp / f"params-{nproc}.yaml"
    path.write_text(yaml.safe_dump(params))
    script = tmp / "child.py"
    script.write_text(CHILD.format(root=str(ROOT)))
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
                if nproc > 1 else [sys.executable])
    result = subprocess.run([*launcher, str(script), str(path), str(tmp / f"run-{nproc}"), str(tokens)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])
    return [json.loads(line[4:]) for line in result.stdout.splitlines() if line.startswith("MEM ")]


@click.command()
@click.option("--tokens-m", default=200, show_default=True, help="millions of tokens in the synthetic train split")
def main(tokens_m: int) -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tokens = synthetic_tokens(tmp / "tokens", tokens_m * 1_000_000)
        size_mb = (tokens / "train.bin").stat().st_size / 1e6
        model = {"size": "tiny", "n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 64}
        train = {"data_loading": "preload", "max_steps": 5, "micro_batch_size": 4, "eval_interval": 1000,
                 "eval_windows": 4, "mlflow": False, "save_checkpoint": False, "resume": "never"}
        single = run({"model": model, "train": train}, tmp, tokens, 1)
        ddp = run({"model": model, "train": {**train, "distributed": "ddp"}}, tmp, tokens, 2)
    print(f"train.bin: {size_mb:,.0f} MB\n")
    print("| run | process | USS (MB) | RSS (MB) |\n|---|---|---|---|")
    for name, rows in (("1 process, private array", single), ("2 DDP ranks, shared map", ddp)):
        for r in sorted(rows, key=lambda r: r["rank"]):
            print(f"| {name} | rank {r['rank']} | {r['uss_mb']:,.0f} | {r['rss_mb']:,.0f} |")


if __name__ == "__main__":
    main()
