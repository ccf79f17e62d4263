"""A teammate gets the exact model without retraining: docs/sharing.md's round trip, on this machine.

    python benchmarks/sharing_round_trip.py            # prints each step, its time and every check
    python benchmarks/sharing_round_trip.py --keep     # and leaves the folders to look at

Alice copies this project into a fresh git repo (a small corpus and model, so the pipeline runs in
seconds), adds a DVC remote (a local folder, as a team's shared disk would be) and a team MLflow
server (``mlflow server`` with a SQLite DB and an artifact folder), runs ``dvc repro`` and one
``dvc exp run --temp``, then ``dvc push``, ``git push`` and ``dvc exp push``. Bob clones the bare repo,
``dvc pull``s, and checks that he has what Alice has: the same checkpoint (its MD5), reports,
``dvc status`` up to date, ``dvc repro`` running nothing, the experiment in ``dvc exp show``, samples
from the checkpoint with ``gpt2 sample``, and Alice's MLflow runs and artifacts through the server.
Any mismatch ends it with exit status 1.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import click

from parallel_queue import small_project

SMALL = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
         "train": {"max_steps": 30, "micro_batch_size": 8, "eval_interval": 15, "log_interval": 10,
                   "checkpoint_interval": 30, "warmup_steps": 5},
         "eval": {"max_new_tokens": 10, "num_samples": 1}}
failures: list[str] = []


def env(tracking: str) -> dict[str, str]:
    return {**os.environ, "DVC_NO_ANALYTICS": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_TRACKING_URI": tracking,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # the stages' python is this one
            "GIT_AUTHOR_NAME": "alice", "GIT_AUTHOR_EMAIL": "alice@example.org",
            "GIT_COMMITTER_NAME": "alice", "GIT_COMMITTER_EMAIL": "alice@example.org"}


def sh(cwd: Path, tracking: str, *cmd: str) -> str:
    started = time.perf_counter()
    result = subprocess.run(cmd, cwd=cwd, env=env(tracking), capture_output=True, text=True)
    shown = " ".join(c if len(c) < 60 else "…" + c[-40:] for c in cmd).replace(sys.executable, "python")
    print(f"  {cwd.name:>5}$ {shown}  ({time.perf_counter() - started:.1f} s)", flush=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout + result.stderr


def check(ok: bool, what: str) -> None:
    print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        failures.append(what)


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_mlflow(team: Path) -> tuple[subprocess.Popen, str]:
    """The team's tracking server: runs in a SQLite DB, artifacts served from a folder (proxied, so clients
    need no access to the folder itself)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                               f"sqlite:///{team / 'mlflow.db'}", "--artifacts-destination", str(team / "artifacts"),
                               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    uri = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=1)
            return server, uri
        except OSError:
            if server.poll() is not None:
                raise SystemExit(f"mlflow server ended: {server.stderr.read()[-2000:]}") from None
            time.sleep(0.5)
    raise SystemExit("mlflow server did not answer in 60 s")


@click.command()
@click.option("--keep", is_flag=True, help="leave the temporary folders (printed) to look at")
def main(keep: bool) -> None:
    base = Path(tempfile.mkdtemp(prefix="gpt2-sharing-"))
    team = base / "team"  # what a team shares: a DVC remote folder, a bare git repo, the MLflow server's store
    (team / "dvc-remote").mkdir(parents=True)
    started = time.perf_counter()
    server, uri = start_mlflow(team)
    print(f"team MLflow server at {uri} (store {team / 'mlflow.db'}, artifacts {team / 'artifacts'})")
    try:
        print("Alice: trains, pushes")
        alice = small_project(base, "alice", SMALL, documents=12, lines=300)
        sh(alice, uri, "git", "init", "-q")
        sh(alice, uri, sys.executable, "-m", "dvc", "init", "-q")
        sh(alice, uri, sys.executable, "-m", "dvc", "remote", "add", "-d", "team", str(team / "dvc-remote"))
        sh(alice, uri, sys.executable, "-m", "dvc", "repro")
        sh(alice, uri, "git", "add", "-A")
        sh(alice, uri, "git", "commit", "-qm", "a trained model")
        sh(alice, uri, sys.executable, "-m", "dvc", "exp", "run", "--temp", "-n", "lr-2e-3", "-S", "train.lr=2.0e-3")
        sh(alice, uri, sys.executable, "-m", "dvc", "push")
        sh(base, uri, "git", "init", "-q", "--bare", str(team / "origin.git"))
        sh(alice, uri, "git", "remote", "add", "origin", str(team / "origin.git"))
        sh(alice, uri, "git", "push", "-q", "origin", "HEAD:main")
        sh(alice, uri, sys.executable, "-m", "dvc", "exp", "push", "origin", "lr-2e-3")

        print("Bob: clones, pulls")
        sh(base, uri, "git", "clone", "-q", "-b", "main", str(team / "origin.git"), "bob")
        bob = base / "bob"
        sh(bob, uri, sys.executable, "-m", "dvc", "pull")
        ckpt = "checkpoints/ckpt.pt"
        check((bob / ckpt).is_file() and md5(bob / ckpt) == md5(alice / ckpt),
              f"the same {ckpt} (MD5 {md5(alice / ckpt)})")
        for report in ("reports/train/metrics.json", "reports/eval/metrics.json", "reports/eval/samples.md"):
            check((bob / report).read_text() == (alice / report).read_text(), f"the same {report}")
        check("Data and pipelines are up to date" in sh(bob, uri, sys.executable, "-m", "dvc", "status"),
              "dvc status: up to date")
        check("Data and pipelines are up to date" in sh(bob, uri, sys.executable, "-m", "dvc", "repro"),
              "dvc repro: up to date, nothing retrained")
        sh(bob, uri, sys.executable, "-m", "dvc", "exp", "pull", "origin", "lr-2e-3")
        check("lr-2e-3" in sh(bob, uri, sys.executable, "-m", "dvc", "exp", "show", "--csv"),
              "dvc exp show: Alice's experiment lr-2e-3, with its figures")
        sample = sh(bob, uri, sys.executable, "-m", "gpt2.cli", "sample", "--prompt", "the king",
                    "--max-new-tokens", "8")
        check(sample.startswith("the king"), "gpt2 sample continues a prompt with the pulled checkpoint")

        import mlflow

        client = mlflow.MlflowClient(uri)
        runs = client.search_runs([client.get_experiment_by_name("gpt2").experiment_id])
        check(len(runs) == 2, f"MLflow at {uri}: Alice's 2 training runs (the repro and the experiment)")
        artifacts = {a.path for r in runs for a in client.list_artifacts(r.info.run_id)}
        check(bool(artifacts), f"their artifacts through the server ({', '.join(sorted(artifacts)[:4])})")
    finally:
        server.terminate()
        server.wait(timeout=30)
        if keep:
            print(f"kept: {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    print(f"{'all checks passed' if not failures else f'{len(failures)} FAILED'} in "
          f"{time.perf_counter() - started:.0f} s")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
