"""Memory per rank of `distributed: fsdp` against `ddp` and one process: does sharding save what the plan says?

    python benchmarks/fsdp_memory.py                        # GPT-2 124M, 2 gloo ranks, a few steps
    python benchmarks/fsdp_memory.py --model gpt2-medium --ranks 4

Trains GPT-2 for a few steps at a tiny micro-batch (1 × 64 tokens: activations are negligible, the
weights, gradients and AdamW state are what is left) once in one process, once under DDP and once
under FSDP, and prints each rank's peak RSS above its RSS after importing torch, next to what
`gpt2 plan`'s memory model expects of the same (gpt2/core/memory_model.py, eager, fp32). glibc keeps
freed blocks of under 32 MB for reuse, which FSDP's gathers and reduce-scatters leave behind in
numbers: the children run with ``MALLOC_MMAP_THRESHOLD_=65536`` (every block above 64 KB mapped
and unmapped on its own), so RSS counts what is live. Needs psutil.
"""

from __future__ import annotations

import json
import os
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
import json, os, resource, sys
import psutil
sys.path.insert(0, {root!r})
import torch
from gpt2.core.config import load_params
from gpt2.train.trainer import train
before = psutil.Process().memory_info().rss
out = sys.argv[2] + "/" + os.environ.get("RANK", "0")
summary = train(load_params(sys.argv[1]), sys.argv[3], out + "/ckpt.pt", None)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("MEM " + json.dumps({{"rank": int(os.environ.get("RANK", 0)), "grown_gb": (peak - before) / 1e9,
                           "step_ms": summary["perf"]["step_ms"]}}))
"""


def run(params: dict, tmp: Path, tokens: Path, nproc: int, name: str) -> list[dict]:
    path = tmp / f"params-{name}.yaml"
    path.write_text(yaml.safe_dump(params))
    script = tmp / "child.py"
    script.write_text(CHILD.format(root=str(ROOT)))
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
                if nproc > 1 else [sys.executable])
    result = subprocess.run([*launcher, str(script), str(path), str(tmp / f"run-{name}"), str(tokens)],
                            capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"})
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])
    return [json.loads(line[4:]) for line in result.stdout.splitlines() if line.startswith("MEM ")]


def expected_gb(size: str, shards: int, seq: int) -> float:
    from gpt2.core import memory_model

    held = memory_model.memory(memory_model.shape(size), 1, seq, amp=False, flash=True, loss_chunk=8192, shards=shards)
    return held.total / 1e9


@click.command()
@click.option("--model", default="gpt2", show_default=True, type=click.Choice(["gpt2", "gpt2-medium", "gpt2-large"]))
@click.option("--ranks", default=2, show_default=True, type=click.IntRange(min=2))
@click.option("--steps", default=3, show_default=True, type=click.IntRange(min=2))
def main(model: str, ranks: int, steps: int) -> None:
    seq = 64
    train = {"dtype": "fp32", "block_size": seq, "micro_batch_size": 1, "max_steps": steps, "eval_interval": 10**6,
             "final_eval": False, "log_interval": 1, "timing_warmup_steps": 1, "mlflow": False,
             "save_checkpoint": False, "resume": "never", "threads": 1,
             "keep_host_memory": False}  # with MALLOC_MMAP_THRESHOLD_ (below): RSS is what is live, not what glibc kept
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tokens = synthetic_tokens(tmp / "tokens", 1_000_000)
        rows = [("1 process", 1, run({"model": {"size": model}, "train": train}, tmp, tokens, 1, "off"))]
        for mode in ("ddp", "fsdp"):
            rows.append((f"{mode} × {ranks}", ranks if mode == "fsdp" else 1,
                         run({"model": {"size": model}, "train": {**train, "distributed": mode}}, tmp, tokens, ranks,
                             mode)))
    print(f"{model}, micro-batch 1 × {seq} tokens, fp32, AdamW, {steps} steps, gloo on CPU, 1 thread per rank\n")
    print("| run | rank | peak RSS growth (GB) | memory model (GB) | ms/step |\n|---|---|---|---|---|")
    for name, shards, measured in rows:
        for r in sorted(measured, key=lambda r: r["rank"]):
            print(f"| {name} | {r['rank']} | {r['grown_gb']:.2f} | {expected_gb(model, shards, seq):.2f} "
                  f"| {r['step_ms']:,.0f} |")


if __name__ == "__main__":
    main()
