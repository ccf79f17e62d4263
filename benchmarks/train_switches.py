"""Step time, tokens/s, MFU and memory for the baseline config and each switch flipped.

    python benchmarks/train_switches.py                          # tiny on this machine, every switch
    python benchmarks/train_switches.py --set model.size=gpt2 --set train.micro_batch_size=16 \\
        --set train.compile=true --steps 40 --variants "baseline;model.attention=manual"

Each variant runs in a fresh process (compile caches, allocator settings and peak-memory
counters do not leak between runs), with MLflow off, on ``data/tokens`` if present, else on a
synthetic token file. The numbers are the trainer's own: medians over the steps after
``timing_warmup_steps``, with the device synchronized before every clock read.
Needs only torch, numpy, click and pyyaml (no dvc, no mlflow).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import sys
import tempfile
from pathlib import Path

import click
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CPU_VARIANTS = [
    "baseline",
    "train.compile=true",
    "model.attention=manual",
    "model.pad_vocab=false",
    "train.fused_adamw=false",
    "train.keep_host_memory=false",
    "train.data_loading=memmap",
    "train.batching=loop",
    "train.dtype=bf16",
    "train.distributed=ddp",  # DDP's code path with one process: its overhead
]
GPU_VARIANTS = [
    "baseline",
    "train.compile=false",
    "model.attention=manual",
    "model.pad_vocab=false",
    "train.fused_adamw=false",
    "train.dtype=fp32",
    "train.dtype=fp32,train.tf32=false",
    "train.data_loading=memmap",
    "train.batching=loop",
    "train.distributed=ddp",  # DDP's code path with one process: its overhead (target: <= 3%)
]


def parse_overrides(items: list[str]) -> dict[str, dict]:
    tree: dict[str, dict] = {}
    for item in items:
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        tree.setdefault(section, {})[name] = yaml.safe_load(value)
    return tree


def merge(base: dict, extra: dict) -> dict:
    return {s: {**base.get(s, {}), **extra.get(s, {})} for s in {*base, *extra}}


def synthetic_tokens(folder: Path, n_tokens: int = 2_000_000) -> Path:
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    splits = {}
    for name, n in (("train", n_tokens), ("val", n_tokens // 10)):
        ids = rng.integers(0, 50257, size=n, dtype=np.uint16)
        ids[-1] = 50256
        ids.tofile(folder / f"{name}.bin")
        splits[name] = {"file": f"{name}.bin", "tokens": n, "documents": 1, "bytes": 3 * n}
    meta = {"format": "gpt2-tokens/1", "dtype": "uint16", "vocab_size": 50257, "eot_id": 50256,
            "manifest_sha256": "synthetic", "split": {"mode": "documents"}, "splits": splits}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def last_error(stderr: str) -> str:
    """The line that names what went wrong: the last exception line (``SomeError: …``), not the hints that
    libraries print after it (Dynamo's "Set TORCHDYNAMO_VERBOSE=1 …"); else the last line."""
    lines = stderr.strip().splitlines() or ["no output"]
    named = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b:?", line.strip())]
    return (named or lines)[-1].strip()[:300]


def run_child(params: dict, tokens: str, out: str, timeout_s: float | None = None) -> tuple[dict | None, str, str]:
    """(the run's summary or None, why it failed, its stderr) of one training in a fresh process.

    The process is forked from a server that imported torch once (``multiprocessing``'s forkserver, started at
    the first call): each run still starts with no CUDA context, no compile cache and fresh memory counters, but
    not with the 3-6 s of imports a new interpreter pays before it trains. The server never touches the GPU, so
    its children may. The run sees this process's environment as it is now, except what torch read at import."""
    spec = json.dumps({"params": params, "tokens": tokens, "out": out})
    with tempfile.TemporaryDirectory() as tmp:
        stdout, stderr = Path(tmp) / "stdout", Path(tmp) / "stderr"
        process = _server().Process(target=_child_in_files, args=(spec, dict(os.environ), str(stdout), str(stderr)))
        process.start()
        try:
            process.join(timeout_s)
            timed_out = process.is_alive()
        finally:  # past its time, or this process stopped (Ctrl-C): the run does not outlive its caller
            if process.is_alive():
                process.kill()
                process.join()
        result, errors = _text(stdout), _text(stderr)
    if timed_out:
        return None, f"timed out after {timeout_s:g} s", errors
    lines = [line for line in result.splitlines() if line.startswith("RESULT ")]
    if process.exitcode != 0 or not lines:
        return None, last_error(errors), errors
    return json.loads(lines[-1][len("RESULT "):]), "", errors


def _server() -> multiprocessing.context.ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch._dynamo"])  # _dynamo: every optimizer's first step imports it
    return context


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def _child_in_files(spec: str, environ: dict[str, str], stdout: str, stderr: str) -> None:
    """``child(spec)`` with the caller's environment, its output in two files (as a subprocess's, pipes aside)."""
    os.environ.clear()
    os.environ.update(environ)
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.stdout.reconfigure(line_buffering=True)  # what a kill at the time limit leaves is in the file
    child(spec)


def child(spec: str) -> None:
    from gpt2.core.config import Params, build
    from gpt2.train.trainer import train

    job = json.loads(spec)
    params = build(Params, job["params"], "")
    metrics = train(params, job["tokens"], Path(job["out"]) / "ckpt.pt", report_dir=None)  # the summary is the result
    print("RESULT " + json.dumps(metrics))


@click.command()
@click.option("--set", "sets", multiple=True, help="base override, e.g. train.micro_batch_size=16 (repeatable)")
@click.option("--variants", default=None, help="comma-free list separated by ';' of overrides per run "
              "(default: every switch for this device)")
@click.option("--steps", default=30, show_default=True, help="steps per run")
@click.option("--tokens", default=None, help="token folder (default: data/tokens, else synthetic)")
def main(sets: tuple[str, ...], variants: str | None, steps: int, tokens: str | None) -> None:
    import torch

    from gpt2.run.peak import cpu_label

    gpu = torch.cuda.is_available()
    names = variants.split(";") if variants else (GPU_VARIANTS if gpu else CPU_VARIANTS)
    base = merge({"train": {"max_steps": steps, "eval_interval": 10**9, "final_eval": False, "log_interval": 10,
                            "checkpoint_interval": 10**9, "mlflow": False, "resume": "never"}},
                 parse_overrides(list(sets)))
    with tempfile.TemporaryDirectory() as tmp:
        token_dir = tokens or (str(ROOT / "data/tokens") if (ROOT / "data/tokens/meta.json").exists()
                               else str(synthetic_tokens(Path(tmp) / "tokens")))
        rows = []
        for name in names:
            extra = {} if name == "baseline" else parse_overrides(name.split(","))
            metrics, _, stderr = run_child(merge(base, extra), token_dir, f"{tmp}/{len(rows)}")
            rows.append((name, metrics))
            if metrics is None:
                print(f"{name}: failed\n{stderr[-2000:]}", file=sys.stderr)
                continue
            print(f"{name}: {metrics['perf']['step_ms']:.1f} ms/step, {metrics['perf']['tokens_per_s']:.0f} tok/s",
                  file=sys.stderr)
    device = f"{torch.cuda.get_device_name()}, {os.cpu_count()} cores" if gpu else cpu_label()
    print(f"\nDevice: {device}, torch {torch.__version__}. "
          f"Base: {' '.join(sets) or 'params defaults'}; {steps} steps per run.\n")
    print("| variant | ms/step (median) | tokens/s | MFU | peak mem (GB) | vs baseline |")
    print("|---|---|---|---|---|---|")
    reference = rows[0][1]["perf"]["step_ms"] if rows and rows[0][1] else None
    for name, m in rows:
        if m is None:
            print(f"| {name} | failed | | | | |")
            continue
        perf = m["perf"]
        mfu = f"{100 * perf['mfu']:.1f}%" if perf["mfu"] is not None else "n/a"
        ratio = f"{reference / perf['step_ms']:.2f}× speed" if reference else ""
        print(f"| {name} | {perf['step_ms']:.1f} | {perf['tokens_per_s']:,.0f} | {mfu} | {m['mem']['peak_gb']:.2f} "
              f"| {ratio} |")


if __name__ == "__main__":
    from gpt2.core.entry import run

    run(main)  # a child ends once its result is out: no seconds of module teardown per row
