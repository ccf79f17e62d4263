"""How far a recipe's result moves when the arithmetic changes in its last digit.

    python benchmarks/repeatability.py                              # the default recipe (params.yaml)
    python benchmarks/repeatability.py --set train.lr=1.0e-3 --jobs 2 --out /tmp/lr1e-3.json

Each perturbation trains the recipe once, in its own process, on ``data/tokens``:

- ``same``: as params.yaml says (PyTorch's default thread count);
- ``again``: the same once more, while the other jobs load the machine (``--jobs`` above 1):
  it must match ``same`` bit for bit;
- ``threads=1``: one intra-op thread, so every matmul and reduction adds in another order;
- ``nudge``: the initial weights plus 1e-6 times standard normal noise;
- ``mkl-compat``: MKL's conditional-reproducibility path (``MKL_CBWR=COMPATIBLE``), another GEMM
  code path, as another CPU model would take;
- ``aten-scalar``: PyTorch's own CPU kernels without SIMD (``ATEN_CPU_CAPABILITY=default``).

The table gives each one's final val loss, its difference from ``same``, and the first logged
step whose train loss differs from ``same`` by more than 0.01, where the runs part. A recipe is
repeatable when the spread of the final val losses stays within ``--tolerance``.
Needs only torch, numpy, click and pyyaml (no dvc, no mlflow).
"""

from __future__ import annotations

import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from train_switches import merge, parse_overrides  # noqa: E402  (the same --set syntax)

PERTURBATIONS = {  # name: (params overrides, environment, initial-weight nudge)
    "same": ({}, {}, 0.0),
    "again": ({}, {}, 0.0),
    "threads=1": ({"train": {"threads": 1}}, {}, 0.0),
    "nudge": ({}, {}, 1e-6),
    "mkl-compat": ({}, {"MKL_CBWR": "COMPATIBLE"}, 0.0),
    "aten-scalar": ({}, {"ATEN_CPU_CAPABILITY": "default"}, 0.0),
}
PARTED = 0.01  # train losses further apart than this: the runs have parted


def child(spec: str) -> None:
    """Train once as the spec says, the initial weights nudged, and print the summary."""
    import torch

    from gpt2.core.config import Params, build
    from gpt2.train import trainer

    job = json.loads(spec)
    built = trainer.build

    def nudged(*args, **kwargs):
        s = built(*args, **kwargs)
        if job["nudge"]:
            noise = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in s.model.parameters():
                    p.add_(torch.randn(p.shape, generator=noise).to(p) * job["nudge"])
        return s

    trainer.build = nudged
    summary = trainer.train(build(Params, job["params"], ""), job["tokens"], Path(job["out"]) / "ckpt.pt",
                            report_dir=Path(job["out"]) / "report")
    print("RESULT " + json.dumps(summary))


def run_one(name: str, params: dict, tokens: str, folder: Path) -> dict:
    overrides, env, nudge = PERTURBATIONS[name]
    spec = json.dumps({"params": merge(params, overrides), "tokens": tokens, "out": str(folder), "nudge": nudge})
    started = time.perf_counter()
    # Threads that wait sleep instead of spinning: jobs sharing the cores then cost their work, not
    # each other's spin (the waiting policy changes the speed only, never the arithmetic).
    result = subprocess.run([sys.executable, __file__, "--child-spec", spec], capture_output=True, text=True,
                            env={**os.environ, **env, "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE"})
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"{name}: the run failed\n{result.stderr[-3000:]}")
    summary = json.loads(lines[-1][len("RESULT "):])
    with open(folder / "report" / "plots" / "train.tsv") as f:
        losses = {int(row["step"]): float(row["loss"]) for row in csv.DictReader(f, delimiter="\t")}
    print(f"{name}: val loss {summary['val']['loss']:.4f} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return {"val_loss": summary["val"]["loss"], "val_loss_se": summary["val"].get("loss_se"),
            "train_losses": losses, "threads": summary["runtime"].get("threads")}


def parted_at(losses: dict[int, float], reference: dict[int, float]) -> int | None:
    return next((step for step in sorted(reference) if abs(losses.get(step, float("nan")) - reference[step]) > PARTED
                 or step not in losses), None)


@click.command()
@click.option("--params", "params_file", default=str(ROOT / "params.yaml"), show_default=True,
              help="the recipe: its train and model sections")
@click.option("--set", "sets", multiple=True, help="override, e.g. train.lr=1.0e-3 (repeatable)")
@click.option("--perturbations", default=",".join(PERTURBATIONS), show_default=True)
@click.option("--jobs", default=1, show_default=True, help="runs at once (each keeps its own thread count)")
@click.option("--tolerance", default=0.05, show_default=True, help="largest acceptable spread of the val losses")
@click.option("--tokens", default=str(ROOT / "data/tokens"), show_default=True)
@click.option("--out", default=None, help="write the results here as JSON")
@click.option("--child-spec", hidden=True)
def main(params_file: str, sets: tuple[str, ...], perturbations: str, jobs: int, tolerance: float, tokens: str,
         out: str | None, child_spec: str | None) -> None:
    if child_spec:
        child(child_spec)
        return
    names = [n.strip() for n in perturbations.split(",") if n.strip()]
    unknown = [n for n in names if n not in PERTURBATIONS]
    if unknown or "same" not in names:
        raise click.BadParameter(f"{unknown or 'same is missing'}: choose from {', '.join(PERTURBATIONS)} "
                                 "(same included)", param_hint="--perturbations")
    recipe = yaml.safe_load(Path(params_file).read_text())
    params = merge({"model": recipe.get("model", {}), "train": recipe.get("train", {})}, parse_overrides(list(sets)))
    params["train"].update(mlflow=False, resume="never", save_checkpoint=False)
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(jobs) as pool:
        futures = {n: pool.submit(run_one, n, params, tokens, Path(tmp) / n) for n in names}
        runs = {n: f.result() for n, f in futures.items()}
    reference = runs["same"]
    import torch

    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"recipe: {params_file} {' '.join(sets)}; {jobs} job(s) at once\n")
    print("| perturbation | threads | final val loss | vs same | train losses part at step |")
    print("|---|---|---|---|---|")
    for name, r in runs.items():
        parted = parted_at(r["train_losses"], reference["train_losses"])
        print(f"| {name} | {r['threads']} | {r['val_loss']:.4f} ± {r['val_loss_se'] or 0:.4f} "
              f"| {r['val_loss'] - reference['val_loss']:+.4f} | {parted if parted is not None else 'never'} |")
    losses = [r["val_loss"] for r in runs.values()]
    spread = max(losses) - min(losses)
    verdict = "repeatable" if spread <= tolerance else "not repeatable"
    print(f"\nspread of the final val loss: {spread:.4f} ({verdict} within {tolerance})")
    if "again" in runs and runs["again"]["train_losses"] != reference["train_losses"]:
        print("again differs from same: this machine does not repeat the recipe bit for bit")
    if out:
        Path(out).write_text(json.dumps({"params": params, "sets": sets, "runs": runs, "spread": spread}, indent=1))


if __name__ == "__main__":
    main()
