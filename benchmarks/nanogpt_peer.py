"""nanoGPT's own ``train.py``, run as shipped on our token files: the peer row of benchmarks/gpu_check.py.

The checkout is the user's (``--nanogpt DIR``, e.g. ``git clone https://github.com/karpathy/nanoGPT``
into a git-ignored folder brought along with the job); nothing of it is copied here. It runs through
its own command line (``--key=value`` overrides), in its own folder (its ``configurator.py`` is read
from the working directory), with ``dataset`` set to the absolute path of our token folder: nanoGPT
reads ``<dataset>/train.bin`` as uint16 tokens, our format, and with no ``meta.pkl`` there it pads
the vocabulary to 50304, as our padded-vocab rung does. ``bias=True`` makes its model GPT-2's, ours.

Run as a script it compares the two on this CPU (the tiny model, fp32, compile off, the same tokens,
alternating runs, every other pair starting with ours, as a ratio of medians and each pair's ratio)::

    python benchmarks/nanogpt_peer.py --nanogpt peers/nanoGPT --pairs 5

Its step time is the one it prints, ``iter N: loss …, time …ms`` (wall clock between iterations; with
``log_interval=1``, its default, each one ends in a ``loss.item()`` sync). A wrapper around its script
adds what it does not print: the process's peak CUDA memory and wall time.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project, run as copied (no install)

from gpt2.run.peak import cpu_label  # noqa: E402
from gpt2.train.reports import iqr  # noqa: E402

ITER_LINE = re.compile(r"^iter (\d+): loss [-+\d.naif]+, time ([\d.]+)ms")

# Runs train.py as `python train.py …` would, from its folder, then reports the peak memory and wall time.
RUNNER = """
import json, os, runpy, sys, time
folder, argv = sys.argv[1], sys.argv[2:]
os.chdir(folder)
sys.path.insert(0, folder)
sys.argv = ["train.py", *argv]
started = time.perf_counter()
try:
    runpy.run_path("train.py", run_name="__main__")
finally:
    import resource
    torch = sys.modules.get("torch")  # train.py imported it
    cuda = torch is not None and torch.cuda.is_available()
    peak_bytes = (torch.cuda.max_memory_allocated() if cuda
                  else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    peak = peak_bytes / 1e9
    print("RESULT " + json.dumps({"peak_gb": peak, "wall_s": time.perf_counter() - started}), flush=True)
"""


def check_checkout(folder: Path) -> None:
    """Refuse a folder that is not a nanoGPT checkout, naming what is missing."""
    missing = [name for name in ("train.py", "model.py", "configurator.py") if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"--nanogpt {folder}: no {', '.join(missing)} there; give a checkout of karpathy/nanoGPT "
                         "(git clone https://github.com/karpathy/nanoGPT)")


def overrides(prof: dict[str, Any], tokens: str, out_dir: str, micro_batch: int, steps: int, gpu: bool
              ) -> list[str]:
    """nanoGPT's command-line settings for the same model, tokens, micro-batch, T and dtype as ours."""
    model = prof["model"]
    shape = ({"n_layer": 12, "n_head": 12, "n_embd": 768} if model["size"] == "gpt2"
             else {k: model[k] for k in ("n_layer", "n_head", "n_embd")})
    settings = {
        "dataset": str(Path(tokens).resolve()), "out_dir": out_dir, "batch_size": micro_batch,
        "block_size": prof["seq"], "gradient_accumulation_steps": 1, "max_iters": steps - 1,  # iterations 0..max_iters
        "eval_interval": steps + 1000, "eval_iters": 1,  # one short eval at iteration 0 only
        "log_interval": 1, "always_save_checkpoint": False, "wandb_log": False, "bias": True, "dropout": 0.0,
        "compile": prof["compile"], "dtype": "bfloat16" if gpu else "float32", "device": "cuda" if gpu else "cpu",
        **shape,
    }
    return [f"--{key}={value}" for key, value in settings.items()]


def run(folder: Path, args: list[str], timeout_s: float | None) -> tuple[list[float], dict[str, Any], str, str]:
    """(each iteration's ms, the wrapper's figures, why it failed or '', stderr) of one nanoGPT run."""
    command = [sys.executable, "-c", RUNNER, str(folder.resolve()), *args]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return [], {}, f"timed out after {timeout_s:g} s", stderr
    times = [float(m.group(2)) for m in map(ITER_LINE.match, result.stdout.splitlines()) if m]
    figures = [json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not times:
        why = (result.stderr.strip().splitlines() or ["no iteration lines in its output"])[-1][:300]
        return times, figures[-1] if figures else {}, why, result.stderr + result.stdout[-4000:]
    return times, figures[-1], "", result.stderr


def figures(times_ms: list[float], wrapper: dict[str, Any], tokens_per_step: int, warmup: int) -> dict[str, Any]:
    """Our row's figures from nanoGPT's iteration times: the median after ``warmup`` iterations, the steady
    state over those iterations' summed time, and the whole process's tokens over its wall time."""
    timed = times_ms[warmup:] or times_ms
    step_ms = statistics.median(timed)
    return {"step_ms": step_ms, "step_ms_iqr": iqr(timed), "tokens_per_s": tokens_per_step / (step_ms / 1000),
            "tokens_per_s_steady": tokens_per_step * len(timed) / (sum(timed) / 1000),
            "tokens_per_s_wall": tokens_per_step * len(times_ms) / wrapper["wall_s"] if wrapper.get("wall_s") else None,
            "peak_gb": wrapper.get("peak_gb"), "warmup_s": sum(times_ms[:warmup]) / 1000}



TINY = {"model": {"size": "tiny", "n_layer": 4, "n_head": 4, "n_embd": 128}, "seq": 128, "compile": False}


def ours(tokens: str, out: str, micro_batch: int, steps: int, warmup: int, train: dict[str, Any]
         ) -> tuple[dict[str, Any] | None, str]:
    """(our trainer's summary or None, why it failed) for the tiny model in a fresh process, MLflow off."""
    from train_switches import run_child

    params = {"model": {"size": "tiny"},
              "train": {"max_steps": steps, "micro_batch_size": micro_batch, "block_size": TINY["seq"],
                        "eval_interval": 10**9, "final_eval": False, "log_interval": 1, "checkpoint_interval": 10**9,
                        "save_checkpoint": False, "mlflow": False, "resume": "never", "timing_warmup_steps": warmup,
                        "compile": False, "dtype": "fp32", **train}}
    summary, error, _ = run_child(params, tokens, out)
    return summary, error


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} tok/s (median; {min(values):,.0f}–{max(values):,.0f})"


@click.command()
@click.option("--nanogpt", "folder", type=click.Path(path_type=Path), required=True,
              help="a checkout of karpathy/nanoGPT (e.g. the git-ignored peers/nanoGPT)")
@click.option("--pairs", default=5, show_default=True, help="alternating runs of each")
@click.option("--steps", default=40, show_default=True, help="iterations per run")
@click.option("--warmup", default=5, show_default=True, help="first iterations left out of the medians")
@click.option("--micro-batch", default=8, show_default=True)
@click.option("--tokens", default=None, help="token folder (default: data/tokens)")
@click.option("--set", "sets", multiple=True, help="our train.* override, e.g. loss_chunk=8192 (repeatable)")
def main(folder: Path, pairs: int, steps: int, warmup: int, micro_batch: int, tokens: str | None,
         sets: tuple[str, ...]) -> None:
    """The tiny model on this CPU, fp32, compile off: nanoGPT's own train.py and ours, alternating, as a ratio."""
    import tempfile

    import torch
    import yaml

    check_checkout(folder)
    token_dir = tokens or str(Path(__file__).resolve().parents[1] / "data/tokens")
    train = {k: yaml.safe_load(v) for k, _, v in (s.partition("=") for s in sets)}
    peer_rates: list[float] = []
    our_rates: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(pairs):
            def peer_run() -> dict[str, Any]:
                args = overrides(TINY, token_dir, f"{tmp}/nanogpt", micro_batch, steps, gpu=False)
                times, wrapper, error, _ = run(folder, args, None)
                if error:
                    raise SystemExit(f"nanoGPT failed: {error}")
                return figures(times, wrapper, micro_batch * TINY["seq"], warmup)

            def our_run() -> dict[str, Any]:
                summary, error = ours(token_dir, f"{tmp}/ours{k}", micro_batch, steps, warmup, train)
                if summary is None:
                    raise SystemExit(f"our trainer failed: {error}")
                return summary

            # every other pair starts with ours: a VM that drifts faster or slower favours neither side
            if k % 2:
                summary, peer = our_run(), peer_run()
            else:
                peer, summary = peer_run(), our_run()
            peer_rates.append(peer["tokens_per_s"])
            our_rates.append(summary["perf"]["tokens_per_s"])
            print(f"pair {k + 1}: nanoGPT {peer['step_ms']:.1f} ms, ours {summary['perf']['step_ms']:.1f} ms: "
                  f"{our_rates[-1] / peer_rates[-1]:.2f}×", file=sys.stderr, flush=True)
    each = [o / p for o, p in zip(our_rates, peer_rates)]
    print(f"{cpu_label()}, torch {torch.__version__}; tiny, "
          f"micro-batch {micro_batch} × {TINY['seq']}, fp32, compile off, {steps} iterations ({warmup} warm-up) per "
          f"run, {pairs} alternating pairs; ours: {' '.join(sets) or 'params defaults'}")
    print(f"nanoGPT train.py: {spread(peer_rates)}")
    print(f"ours:             {spread(our_rates)}")
    print(f"ours ÷ nanoGPT:   {statistics.median(our_rates) / statistics.median(peer_rates):.2f}× "
          f"(pairs {min(each):.2f}–{max(each):.2f}×, their median {statistics.median(each):.2f}×)")


if __name__ == "__main__":
    main()
