"""Time and tokens to a target val loss: AdamW against Muon, several seeds, alternating order.

    dvc repro tokenize                                   # the embedded corpus in data/tokens
    python benchmarks/time_to_target.py                  # tiny, and tiny with 12 layers; 3 seeds each
    python benchmarks/time_to_target.py --models tiny --seeds 1 --target 6.5

Every run is a fresh `gpt2 train` process with params.yaml's settings plus `train.optimizer`, the seed,
`train.target_val_loss` and a step cap; it stops at the target (`train.stop_at_target`). The default
target, 6.1, is the val loss the default run reaches in about half its 320 steps. Runs alternate
optimizers (adamw, muon, adamw, ...) so that a machine slowing down does not favour one. Before the
runs, the noise of the val figure itself: one model scored on the train loop's eval size (eval_windows ×
block_size tokens) at ten different window seeds. Prints Markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {"tiny": {"size": "tiny"}, "tiny-12-layers": {"size": "tiny", "n_layer": 12}}


def train_run(work: Path, name: str, model: dict, train: dict, tokens: Path) -> dict:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["model"].update(model)
    params["train"].update(train, mlflow=False, resume="never")
    folder = work / name
    folder.mkdir(parents=True)
    (folder / "params.yaml").write_text(yaml.safe_dump(params))
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gpt2.train.cli", "--params", str(folder / "params.yaml"), "--tokens",
                    str(tokens), "--checkpoint", str(folder / "ckpt.pt"), "--out", str(folder / "reports")],
                   check=True, cwd=ROOT, capture_output=True, text=True)
    summary = json.loads((folder / "reports" / "summary.json").read_text())
    return {**summary, "process_s": time.perf_counter() - started}


def val_noise(work: Path, tokens: Path, eval_tokens: int, seeds: int = 10) -> tuple[float, float, float]:
    """Mean, standard deviation and range of the val loss of one model over ``seeds`` window sets."""
    from gpt2.core.tokens import open_tokens
    from gpt2.eval.evaluate import val_loss, windows
    from gpt2.eval.loading import eval_runtime, load_model

    loaded = load_model(work / "noise" / "ckpt.pt", eval_runtime("cpu", "fp32"))
    val = open_tokens(tokens, "val")
    block = loaded.model.cfg.block_size
    losses = [val_loss(loaded, val, windows(len(val), block, eval_tokens, seed), 16)[0] for seed in range(seeds)]
    return statistics.mean(losses), statistics.stdev(losses), max(losses) - min(losses)


def spread(values: list[float], digits: int = 1) -> str:
    return f"{statistics.median(values):,.{digits}f} ({min(values):,.{digits}f}–{max(values):,.{digits}f})"


@click.command()
@click.option("--tokens", default="data/tokens", show_default=True, type=click.Path(exists=True, file_okay=False))
@click.option("--target", default=6.1, show_default=True, help="val loss to reach")
@click.option("--max-steps", default=480, show_default=True, help="step cap (a run that hits it never reached)")
@click.option("--eval-interval", default=10, show_default=True, help="steps between val measurements")
@click.option("--seeds", default=3, show_default=True)
@click.option("--models", default="tiny,tiny-12-layers", show_default=True,
              help=f"of {', '.join(MODELS)}; empty: the noise table only")
@click.option("--muon-lr", type=float, default=None, help="override train.muon_lr")
@click.option("--optimizers", default="adamw,muon", show_default=True, help="adamw alone: the default recipe's time")
@click.option("--noise/--no-noise", default=True, show_default=True, help="the val figure's noise table first")
def main(tokens: str, target: float, max_steps: int, eval_interval: int, seeds: int, models: str,
         muon_lr: float | None, optimizers: str, noise: bool) -> None:
    tokens_dir = Path(tokens).resolve()
    defaults = yaml.safe_load((ROOT / "params.yaml").read_text())["train"]
    eval_tokens = defaults["eval_windows"] * 128
    common = {"target_val_loss": target, "stop_at_target": True, "max_steps": max_steps, "eval_interval": eval_interval,
              "checkpoint_interval": max_steps, "save_checkpoint": False}
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; target val loss {target}, "
          f"cap {max_steps} steps, eval every {eval_interval} steps; {seeds} seed(s); params.yaml otherwise\n")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if noise:
            train_run(work, "noise", MODELS["tiny"], {"max_steps": 160, "save_checkpoint": True}, tokens_dir)
            print("Noise of the val figure: tiny after 160 steps scored on 10 different window sets of each size "
                  "(1× = the train loop's eval_windows × block_size)\n")
            print("| tokens scored | mean | sd | range |\n|---|---|---|---|")
            for factor in (1, 4):
                mean, std, width = val_noise(work, tokens_dir, factor * eval_tokens)
                print(f"| {factor * eval_tokens:,} ({factor}×) | {mean:.4f} | {std:.4f} | {width:.4f} |")
            print()
        print("| model | optimizer | time to target (s) | steps | tokens | reached | speedup (time) |")
        print("|---|---|---|---|---|---|---|")
        for model_name in filter(None, models.split(",")):
            chosen = optimizers.split(",")
            results: dict[str, list[dict]] = {name: [] for name in chosen}
            for seed in range(seeds):
                order = chosen if seed % 2 == 0 else chosen[::-1]
                for optimizer in order:
                    extra = {"muon_lr": muon_lr} if muon_lr and optimizer == "muon" else {}
                    summary = train_run(work, f"{model_name}-{optimizer}-{seed}", MODELS[model_name],
                                        {**common, "optimizer": optimizer, "seed": 1337 + seed, **extra}, tokens_dir)
                    results[optimizer].append(summary)
                    print(f"  {model_name} {optimizer} seed {seed}: {summary['target']}", file=sys.stderr)
            medians = {}
            for optimizer, runs in results.items():
                reached = [r["target"] for r in runs if r["target"]["reached"]]
                if not reached:
                    print(f"| {model_name} | {optimizer} | not reached in {max_steps} steps | | | 0/{len(runs)} | |")
                    continue
                medians[optimizer] = statistics.median(t["time_s"] for t in reached)
                speedup = f"{medians['adamw'] / medians[optimizer]:.2f}×" if "adamw" in medians else ""
                print(f"| {model_name} | {optimizer} | {spread([t['time_s'] for t in reached])} | "
                      f"{spread([t['steps'] for t in reached], 0)} | {spread([t['tokens'] for t in reached], 0)} | "
                      f"{len(reached)}/{len(runs)} | {speedup} |")


if __name__ == "__main__":
    main()
