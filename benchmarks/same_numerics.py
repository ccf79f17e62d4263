"""Whether a change to the code changed what training computes: the same short run from two commits, compared.

    python benchmarks/same_numerics.py --base HEAD~3          # the work tree against three commits back
    python benchmarks/same_numerics.py --base main --steps 40 --set train.lr=3.0e-3

Each side trains ``--steps`` steps of params.yaml's recipe (log every step, eval every 5, MLflow off,
``--threads`` threads) on ``data/tokens`` in its own process, from its own code: the work tree, and a
``git worktree`` of ``--base``. Then it compares what the run computed: the SHA-256 of every weight and of
the optimizer state, and every logged train loss, learning rate, grad norm, val loss and standard error
(timings, memory, MFU and how busy the machine was are left out). A refactor must leave them identical;
the log lines are compared too, with their numbers masked. Needs only torch, numpy, click and pyyaml (no dvc,
no mlflow).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]

# Run in a child process from one code tree: train, then print the digest as JSON on the last line.
CHILD = r"""
import hashlib, json, sys
code, tokens, out, sets = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[6:]
steps, threads = int(sys.argv[4]), int(sys.argv[5])
sys.path.insert(0, code)
import torch
from gpt2.core.config import load_params
from gpt2.train.trainer import train
defaults = [f"train.max_steps={steps}", "train.log_interval=1", "train.eval_interval=5", "train.mlflow=false",
            f"train.threads={threads}", "train.resume=never"]
params = load_params(f"{code}/params.yaml", tuple(defaults + sets))
train(params, tokens, f"{out}/ckpt.pt", f"{out}/reports")
state = torch.load(f"{out}/ckpt.pt", map_location="cpu", weights_only=False)
weights = hashlib.sha256()
for name, tensor in sorted(state["model"].items()):
    weights.update(name.encode()); weights.update(tensor.detach().contiguous().numpy().tobytes())
def kept(key):
    timing = key.split("/")[0] in ("mem", "perf", "cost", "machine") or key.endswith("_s")
    return not timing and key not in ("tokens", "run_uid")
def numerics(value):
    if isinstance(value, dict):
        return {k: numerics(v) for k, v in value.items() if kept(k)}
    return [numerics(v) for v in value] if isinstance(value, list) else value
optimizer = hashlib.sha256(repr(state["optimizer"]).encode()).hexdigest()
print(json.dumps({"weights": weights.hexdigest(), "optimizer": optimizer,
                  "train": numerics(state["history"]["train"]), "val": numerics(state["history"]["val"])}))
"""


def run_side(code: Path, tokens: Path, out: Path, steps: int, threads: int, sets: tuple[str, ...]) -> tuple[dict, str]:
    out.mkdir(parents=True, exist_ok=True)
    result = subprocess.run([sys.executable, "-c", CHILD, str(code), str(tokens), str(out), str(steps), str(threads),
                             *sets], cwd=code, capture_output=True, text=True)
    if result.returncode != 0:
        raise click.ClickException(f"the run from {code} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def masked(log: str) -> list[str]:
    """The start, step and warning lines, with their numbers masked."""
    return [re.sub(r"\d+(\.\d+)?", "N", line) for line in log.splitlines()
            if line.startswith(("train:", "step ", "warning:"))]


def first_difference(a: object, b: object, where: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if (found := first_difference(a.get(key), b.get(key), f"{where}.{key}" if where else key)):
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return next(filter(None, (first_difference(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b)))),
                    None)
    return None if a == b else f"{where}: {a!r} against {b!r}"


@click.command()
@click.option("--base", default="HEAD", show_default=True, help="the commit to compare the work tree with")
@click.option("--steps", default=20, show_default=True, type=click.IntRange(min=1))
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1),
              help="intra-op threads on both sides (the count changes a CPU's last digits)")
@click.option("--tokens", default=str(ROOT / "data" / "tokens"), show_default=True, type=click.Path(exists=True),
              help="the token folder both sides train on (dvc repro tokenize makes the default)")
@click.option("--set", "sets", multiple=True, help="a params override for both sides, e.g. train.lr=3.0e-3")
def main(base: str, steps: int, threads: int, tokens: str, sets: tuple[str, ...]) -> None:
    rev = subprocess.run(["git", "rev-parse", "--short", base], cwd=ROOT, capture_output=True, text=True)
    if rev.returncode != 0:
        raise click.ClickException(f"--base {base}: not a commit here ({rev.stderr.strip()})")
    with tempfile.TemporaryDirectory(prefix="same-numerics-") as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), base], cwd=ROOT, check=True)
        try:
            print(f"training {steps} steps from {rev.stdout.strip()} and from the work tree ({threads} threads)",
                  file=sys.stderr)
            theirs, their_log = run_side(tree, Path(tokens).resolve(), Path(tmp) / "run-base", steps, threads, sets)
            ours, our_log = run_side(ROOT, Path(tokens).resolve(), Path(tmp) / "run-work", steps, threads, sets)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    # the logged figures first: the first step whose loss moved says more than a hash
    numbers = next(filter(None, (first_difference(theirs[k], ours[k], k)
                                 for k in ("train", "val", "weights", "optimizer"))), None)
    lines = next((f"{a!r} against {b!r}" for a, b in zip(masked(their_log), masked(our_log)) if a != b), None)
    if len(masked(their_log)) != len(masked(our_log)):
        lines = lines or f"{len(masked(their_log))} log lines against {len(masked(our_log))}"
    def same(key: str) -> str:
        return "the same" if ours[key] == theirs[key] else "DIFFERENT"

    print(f"weights sha256 {ours['weights'][:16]}… ({same('weights')}), optimizer state {same('optimizer')}, "
          f"{len(ours['train'])} train and {len(ours['val'])} val records")
    print(f"numerics: {'identical' if numbers is None else 'differ first at ' + numbers}")
    print(f"log lines (numbers masked): {'identical' if lines is None else 'differ: ' + lines}")
    if numbers is not None or lines is not None:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
