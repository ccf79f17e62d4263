"""Queued experiments run in parallel on a fresh project: every one ends, every one is in MLflow.

    python benchmarks/parallel_queue.py                  # 3 experiments, dvc queue start -j 3
    python benchmarks/parallel_queue.py --jobs 2 --threads 1

What a new user does first with a queue: a fresh clone (no ``mlflow.db`` yet), three
``dvc exp run --queue -S train.lr=…``, then ``dvc queue start -j N``. The trainers start together
and each opens the MLflow store, which the first one creates. The script copies the project into a
temporary git repo with a small corpus and a small model (a few seconds of training per
experiment), queues the three, starts the workers, waits for them, and prints each experiment's
outcome, its val loss and the thread count it trained with, the MLflow runs the store holds, and
the wall time against running the same three one after another (``--serial``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import yaml

ROOT = Path(__file__).resolve().parents[1]
LRS = ("1.0e-3", "2.0e-3", "3.0e-3")
SMALL = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
         "train": {"max_steps": 60, "micro_batch_size": 8, "eval_interval": 20, "log_interval": 10,
                   "checkpoint_interval": 60, "warmup_steps": 10},
         "eval": {"max_new_tokens": 10, "num_samples": 1}}


def sh(cwd: Path, *cmd: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
           "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@example.org",
           "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@example.org"}
    env.pop("MLFLOW_TRACKING_URI", None)
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def small_project(base: Path, name: str, settings: dict[str, dict], documents: int = 20, lines: int = 400) -> Path:
    """A copy of this project in ``base/name`` (code, dvc.yaml, params.yaml with ``settings`` on top) reading a
    small local corpus of made-up verse in ``base/corpus``; not yet a git or DVC repository."""
    root = base / name
    root.mkdir()
    for file in ("dvc.yaml", "params.yaml", ".dvcignore", ".gitignore"):
        shutil.copy(ROOT / file, root / file)
    for folder in ("stages", "gpt2"):
        shutil.copytree(ROOT / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    corpus = base / "corpus"
    corpus.mkdir()
    words = "the king queen lord thou art my good sweet love night day fair death life heaven speak".split()
    for i in range(documents):
        (corpus / f"doc{i:02d}.txt").write_text("\n".join(" ".join(words[(i + j + k) % len(words)] for k in range(9))
                                                          for j in range(lines)) + "\n")
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["download"]["source"] = str(corpus)
    for section, values in settings.items():
        params[section].update(values)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return root


def project(base: Path, threads: int) -> Path:
    """The small project with its data stages run and committed."""
    root = small_project(base, "project", {**SMALL, "train": {**SMALL["train"], "threads": threads}})
    sh(root, "git", "init", "-q")
    sh(root, sys.executable, "-m", "dvc", "init", "-q")
    sh(root, sys.executable, "-m", "dvc", "repro", "-q", "tokenize")  # the data, once, before any timing
    sh(root, "git", "add", "-A")
    sh(root, "git", "commit", "-qm", "baseline")
    return root


def run_queue(root: Path, jobs: int) -> float:
    for lr in LRS:
        sh(root, sys.executable, "-m", "dvc", "exp", "run", "--queue", "-S", f"train.lr={lr}")
    started = time.perf_counter()
    sh(root, sys.executable, "-m", "dvc", "queue", "start", "-j", str(jobs))
    while True:  # `dvc queue start` returns at once; the workers run on
        time.sleep(2)
        status = sh(root, sys.executable, "-m", "dvc", "queue", "status").stdout
        if not any(word in status for word in ("Queued", "Running")):
            return time.perf_counter() - started


def outcomes(root: Path) -> tuple[list[dict[str, object]], str]:
    status = sh(root, sys.executable, "-m", "dvc", "queue", "status").stdout
    shown = json.loads(sh(root, sys.executable, "-m", "dvc", "exp", "show", "--json").stdout)
    rows = []
    for baseline in shown:
        for exp in (baseline.get("experiments") or []):
            for rev in exp.get("revs") or []:
                data = rev.get("data") or {}
                lr = data.get("params", {}).get("params.yaml", {}).get("data", {}).get("train", {}).get("lr")
                metrics = data.get("metrics", {}).get("reports/train/metrics.json", {}).get("data", {})
                rows.append({"name": rev.get("name") or exp.get("name"), "lr": lr,
                             "val_loss": (metrics.get("val") or {}).get("loss")})
    return rows, status


def mlflow_runs(root: Path) -> list[dict[str, str]]:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("gpt2")
    runs = client.search_runs([experiment.experiment_id]) if experiment else []
    return [{"name": r.info.run_name, "status": r.info.status, "threads": r.data.tags.get("threads"),
             "lr": r.data.params.get("train.lr")} for r in runs]


@click.command()
@click.option("--jobs", default=3, show_default=True, help="dvc queue start -j")
@click.option("--threads", default=0, show_default=True, help="train.threads of every experiment (0: PyTorch's)")
@click.option("--serial/--no-serial", default=True, show_default=True, help="also time the three with -j 1")
def main(jobs: int, threads: int, serial: bool) -> None:
    print(f"{os.cpu_count()} cores; {len(LRS)} queued experiments on a fresh project, train.threads {threads}\n")
    with tempfile.TemporaryDirectory() as tmp:
        root = project(Path(tmp), threads)
        wall = run_queue(root, jobs)
        rows, status = outcomes(root)
        runs = mlflow_runs(root)
        print(f"dvc queue start -j {jobs}: {wall:.0f} s for the three\n\n{status}")
        print("| experiment | train.lr | val loss |\n|---|---|---|")
        for row in rows:
            print(f"| {row['name']} | {row['lr']} | {row['val_loss']} |")
        print("\n| MLflow run | status | train.lr | threads |\n|---|---|---|---|")
        for run in runs:
            print(f"| {run['name']} | {run['status']} | {run['lr']} | {run['threads']} |")
        ok = len(runs) == len(LRS) and all(r["status"] == "FINISHED" for r in runs)
        print(f"\nall {len(LRS)} ran and are in MLflow: {'yes' if ok else 'NO'}")
    if serial:
        with tempfile.TemporaryDirectory() as tmp:
            root = project(Path(tmp), threads)
            print(f"dvc queue start -j 1 on another fresh project: {run_queue(root, 1):.0f} s for the three")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
