"""One command that shows what the CUDA path does on this GPU: the evidence for docs/benchmarks.md.

    python3 benchmarks/gpu_check.py --json $OUT/gpu_check.json               # every part, in order
    python3 benchmarks/gpu_check.py --part ladder --json $OUT/gpu_check.json # one part (repeatable)
    python3 benchmarks/gpu_check.py --smoke --json /tmp/smoke.json           # anywhere: `tiny` (the tests)

Each training runs in a fresh process (compile caches, allocator state and peak-memory counters do
not leak between them), with the trainer's own figures (medians after the warm-up steps, CUDA events
for step times). The parts:

- ``tests``: ``pytest tests/test_gpu.py``;
- ``ladder``: GPT-2 124M at T=1024, each rung on top of the last: fp32 → tf32 → bf16 → compile →
  flash attention → padded vocab → fused AdamW → the largest micro-batch ``gpt2 plan`` says fits →
  cuDNN attention; ms/step, tokens/s, MFU, peak memory against the plan's estimate;
- ``peers``: nanoGPT's settings on our code (micro-batch 12, T=1024, bf16, compile), then the best
  ladder row (the fastest measured) plain, under DDP in one process (its overhead) and with Muon;
- ``long``: the best row at GPT-2's 0.5M-token batch with evals and checkpoints: wall-clock tokens/s
  against the step median.

Built for jobs with a wall-time limit (a SLURM job, a Colab session, the 10-minute commands of a lent
GPU box): every row reaches the JSON the moment it is measured, a second run with the same ``--json``
skips the rows already there, and a child that runs past ``--timeout-s`` (420 s on a GPU) is stopped
with a row that says so. Each child's stderr tail is kept in ``<json>.stderr.log``.

Planning about 30 minutes on one H100 (a cold ``torch.compile`` of GPT-2 124M takes about a minute per
process), in the order that brings the headline rows first:

1. ``--part ladder`` (9 rows, 6 of them compiled: about 8 minutes; if cut, the next job finishes it);
2. ``--part ladder --part peers`` (the rest of the ladder, then 4 rows: about 5 minutes);
3. ``--part long --part tests`` (about 4 minutes).

Needs only torch, numpy, click and pyyaml (and pytest for the tests): it runs as copied on a box with
torch preinstalled, with no install, no dvc, no mlflow and no network; uses data/tokens when present,
else synthetic tokens.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from train_switches import synthetic_tokens  # noqa: E402

# Each rung adds its change to every rung above it.
RUNGS: list[tuple[str, dict[str, Any]]] = [
    ("fp32", {"dtype": "fp32", "tf32": False, "compile": False, "attention": "manual", "pad_vocab": False,
              "fused_adamw": False}),
    ("+ tf32", {"tf32": True}),
    ("+ bf16 autocast", {"dtype": "bf16"}),
    ("+ torch.compile", {"compile": True}),
    ("+ flash attention", {"attention": "flash"}),
    ("+ padded vocab (50304)", {"pad_vocab": True}),
    ("+ fused AdamW", {"fused_adamw": True}),
    ("+ largest micro-batch", {}),  # micro_batch_size filled in from gpt2 plan
    ("+ cuDNN attention", {"sdpa_backend": "cudnn"}),
]
NANOGPT = {"micro_batch_size": 12, "dtype": "bf16", "compile": True, "attention": "flash", "pad_vocab": True,
           "fused_adamw": True}
GPT2_BATCH_TOKENS = 524_288  # GPT-2's 0.5M-token batch
MODEL_KEYS = ("attention", "pad_vocab")  # the rows' switches that params.yaml keeps in its model section


def profile(smoke: bool) -> dict[str, Any]:
    if smoke:  # CPU-sized: plumbing, not speed; no compile (30 s per process on a CPU)
        return {"model": {"size": "tiny", "n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 64},
                "seq": 8, "micro_batch": 1, "max_micro_batch": 4, "steps": 2, "warmup": 1, "long_steps": 4,
                "memory_gb": 8.0,
                "eval_iters": 2, "compile": False}
    return {"model": {"size": "gpt2"}, "seq": 1024, "micro_batch": 16, "max_micro_batch": 128, "steps": 20,
            "warmup": 3, "long_steps": 100, "memory_gb": None,
            "eval_iters": 20, "compile": True}


def train_params(prof: dict[str, Any], train: dict[str, Any], steps: int) -> dict[str, Any]:
    base = {"max_steps": steps, "block_size": prof["seq"], "micro_batch_size": prof["micro_batch"],
            "eval_interval": 10**9, "eval_iters": 2, "log_interval": 10, "checkpoint_interval": 10**9,
            "save_checkpoint": False, "mlflow": False, "resume": "never", "timing_warmup_steps": prof["warmup"]}
    train = {**base, **train}
    if not prof["compile"]:
        train["compile"] = False
    model = {**prof["model"], **{k: train.pop(k) for k in MODEL_KEYS if k in train}}
    return {"model": model, "train": train}


def run_child(params: dict[str, Any], tokens: str, out: str, timeout_s: float | None
              ) -> tuple[dict[str, Any] | None, str, str]:
    """(the run's summary or None, why it failed, its stderr) of one training in a fresh process."""
    spec = json.dumps({"params": params, "tokens": tokens, "out": out})
    command = [sys.executable, str(ROOT / "benchmarks/train_switches.py"), "--child-spec", spec]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return None, f"timed out after {timeout_s:g} s", stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        return None, (result.stderr.strip().splitlines() or ["no output"])[-1][:300], result.stderr
    return json.loads(lines[-1][len("RESULT "):]), "", result.stderr


def estimate_gb(prof: dict[str, Any], train: dict[str, Any]) -> float | None:
    from gpt2.measure import plan

    size = prof["model"]["size"]
    if size not in plan.SIZES or len(prof["model"]) > 1:
        return None  # the plan knows the named sizes only
    s = plan.shape(size, train.get("pad_vocab", True))
    return plan.memory(s, train["micro_batch_size"], prof["seq"], train.get("dtype") != "fp32",
                       train.get("attention") == "flash", train.get("loss_chunk", 8192)).total / 1e9


def largest_micro_batch(prof: dict[str, Any]) -> int:
    import torch

    from gpt2.measure import plan

    if prof["memory_gb"] is not None:
        memory_gb = prof["memory_gb"]
    else:
        memory_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    size = prof["model"]["size"]
    s = plan.shape(size if size in plan.SIZES and len(prof["model"]) == 1 else "tiny")
    fits = plan.largest_micro_batch(s, prof["seq"], amp=True, flash=True, memory_gb=memory_gb, loss_chunk=8192)
    return max(prof["micro_batch"], min(fits, prof["max_micro_batch"]))


def row(name: str, metrics: dict[str, Any] | None, error: str, estimate: float | None,
        train: dict[str, Any], note: str = "") -> dict[str, Any]:
    if metrics is None:
        return {"name": name, "failed": error, "train": train}
    perf = metrics["perf"]
    return {"name": name, "step_ms": perf["step_ms"], "tokens_per_s": perf["tokens_per_s"],
            "tokens_per_s_wall": perf.get("tokens_per_s_wall"), "mfu": perf["mfu"],
            "peak_gb": metrics["mem"]["peak_gb"], "estimate_gb": estimate, "warmup_s": perf.get("warmup_s"),
            "sdpa": metrics.get("runtime", {}).get("sdpa_backend"), "dtype": metrics.get("runtime", {}).get("dtype"),
            "micro_batch": train["micro_batch_size"], "accum": train.get("grad_accum_steps", 1), "note": note,
            "train": train}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| run | micro-batch × accum | ms/step | tokens/s | wall tokens/s | MFU | peak GB (plan) | kernel | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['name']} | | failed | | | | | | {r['failed']} |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        plan_gb = f" ({r['estimate_gb']:.1f})" if r["estimate_gb"] is not None else ""
        wall = f"{r['tokens_per_s_wall']:,.0f}" if r.get("tokens_per_s_wall") else ""
        lines.append(f"| {r['name']} | {r['micro_batch']} × {r['accum']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} "
                     f"| {wall} | {mfu} | {r['peak_gb']:.1f}{plan_gb} | {r['sdpa']} | {r['note']} |")
    return "\n".join(lines) + "\n"


PARTS = ("tests", "ladder", "peers", "long")


class Report:
    """The check's JSON, rewritten (atomically) after every row: a job killed at its time limit keeps every
    finished row, and a second job with the same ``--json`` skips them. Each child's stderr tail goes to
    ``<json>.stderr.log`` beside it, for post-mortems."""

    def __init__(self, path: Path | None, header: dict[str, Any]) -> None:
        self.path = path
        self.data = {**header, "rows": []}
        if path is not None and path.is_file():
            old = json.loads(path.read_text())
            if {k: old.get(k) for k in ("device", "smoke")} == {k: header[k] for k in ("device", "smoke")}:
                self.data = {**old, **header, "rows": old.get("rows", [])}
                if old.get("tests"):
                    self.data["tests"] = old["tests"]
        self.log = path.with_suffix(".stderr.log") if path is not None else None

    def row(self, name: str) -> dict[str, Any] | None:
        return next((r for r in self.data["rows"] if r["name"] == name), None)

    def add(self, result: dict[str, Any], stderr: str = "") -> None:
        self.data["rows"].append(result)
        self.save()
        if self.log is not None and stderr:
            with open(self.log, "a") as handle:
                handle.write(f"===== {result['name']}\n" + "\n".join(stderr.splitlines()[-40:]) + "\n")

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n")
        tmp.replace(self.path)


@click.command()
@click.option("--smoke", is_flag=True, help="tiny model, a few steps, no compile, no CUDA tests: checks the script")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
              help="rows go here as they are measured; rows already in it are kept and skipped")
@click.option("--tokens", default=None, help="token folder (default: data/tokens, else synthetic)")
@click.option("--part", "parts", multiple=True, type=click.Choice(PARTS),
              help="what to run (repeatable; default: all): tests, ladder (the headline rows), peers (nanoGPT's "
                   "settings, DDP, Muon: need the ladder's rows), long (GPT-2 batch, evals, checkpoints)")
@click.option("--timeout-s", default=None, type=float,
              help="a child running longer is stopped and its row says 'timed out' (default: 420 on a GPU)")
@click.option("--skip-tests", is_flag=True, help="same as leaving out --part tests")
def main(smoke: bool, json_path: str | None, tokens: str | None, parts: tuple[str, ...], timeout_s: float | None,
         skip_tests: bool) -> None:
    import torch

    started = time.perf_counter()
    gpu = torch.cuda.is_available()
    if not gpu and not smoke:
        raise click.UsageError("no CUDA device here; run with --smoke to check the script on this machine")
    parts = tuple(parts) or PARTS
    if skip_tests or smoke or not gpu:
        parts = tuple(p for p in parts if p != "tests")
    timeout_s = timeout_s if timeout_s is not None else (420.0 if gpu and not smoke else None)
    prof = profile(smoke)
    report = Report(Path(json_path) if json_path else None,
                    {"device": torch.cuda.get_device_name() if gpu else platform.machine(),
                     "torch": str(torch.__version__), "smoke": smoke, "date": time.strftime("%Y-%m-%d")})
    if "tests" in parts and "tests" not in report.data:
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                                "tests/test_gpu.py"], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        report.data["tests"] = (tests.stdout.strip().splitlines() or ["no output"])[-1]
        report.save()
        print(f"gpu_check: tests/test_gpu.py: {report.data['tests']}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        token_dir = tokens or (str(ROOT / "data/tokens") if (ROOT / "data/tokens/meta.json").exists()
                               else str(synthetic_tokens(Path(tmp) / "tokens", 5_000_000 if not smoke else 200_000)))

        def measure(name: str, train: dict[str, Any], steps: int, note: str = "", run: bool = True
                    ) -> dict[str, Any] | None:
            """The row ``name``: from the JSON if measured before, else measured now (when ``run``)."""
            done = report.row(name)
            if done is not None or not run:
                return done
            params = train_params(prof, train, steps)
            metrics, error, stderr = run_child(params, token_dir, f"{tmp}/{len(report.data['rows'])}", timeout_s)
            result = row(name, metrics, error, estimate_gb(prof, params["train"]), params["train"], note)
            report.add(result, stderr)
            shown = f"{result['tokens_per_s']:,.0f} tok/s" if "failed" not in result else f"failed: {error}"
            print(f"gpu_check: [{time.perf_counter() - started:.0f} s] {name}: {shown}", file=sys.stderr)
            return result

        ladder: dict[str, Any] = {}
        measured: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (row, its configuration)
        for name, change in RUNGS:
            if name == "+ largest micro-batch":
                change = {"micro_batch_size": largest_micro_batch(prof)}
            if name == "+ cuDNN attention" and not gpu:
                continue  # no cuDNN attention on a CPU
            candidate = {**ladder, **change}
            result = measure(name, candidate, prof["steps"], run="ladder" in parts)
            if result is not None and "failed" not in result:
                ladder = candidate  # a rung that failed (out of memory, a kernel missing here) is not carried on
                measured.append((result, candidate))
        if not measured and {"peers", "long"} & set(parts):
            raise click.UsageError("the peers and long parts start from the ladder's best row: run --part ladder "
                                   "first (with the same --json)")
        best = max(measured, key=lambda m: m[0]["tokens_per_s"])[1] if measured else {}  # the fastest, not the last
        if "peers" in parts:
            measure("nanoGPT's settings on our code", {**NANOGPT}, prof["steps"],
                    "micro-batch 12, T=1024, bf16, compile (nanoGPT's defaults; not nanoGPT's own train.py)")
            plain = measure("best, plain (for DDP)", best, prof["steps"])
            ddp = measure("best, DDP in 1 process", {**best, "distributed": "ddp"}, prof["steps"])
            if "failed" not in plain and "failed" not in ddp:
                ddp["note"] = f"DDP overhead {100 * (ddp['step_ms'] / plain['step_ms'] - 1):+.1f}%"
            muon = measure("best, Muon optimizer", {**best, "optimizer": "muon"}, prof["steps"])
            if "failed" not in plain and "failed" not in muon:
                muon["note"] = f"step time vs AdamW {100 * (muon['step_ms'] / plain['step_ms'] - 1):+.1f}%"
            report.save()
        if "long" in parts:
            batch = best.get("micro_batch_size", prof["micro_batch"]) * prof["seq"]
            accum = max(1, round(GPT2_BATCH_TOKENS / batch)) if not smoke else 2
            steps = prof["long_steps"]
            long = measure(f"{steps} steps, GPT-2 batch, evals and checkpoints",
                           {**best, "grad_accum_steps": accum, "eval_interval": steps // 2,
                            "eval_iters": prof["eval_iters"], "checkpoint_interval": steps // 2,
                            "save_checkpoint": True, "timing_warmup_steps": prof["warmup"]}, steps)
            if "failed" not in long and long.get("tokens_per_s_wall"):
                long["note"] = (f"wall clock {100 * long['tokens_per_s_wall'] / long['tokens_per_s']:.1f}% of the "
                                "step median")
            report.save()
    report.data["seconds"] = round(report.data.get("seconds", 0.0) + time.perf_counter() - started, 1)
    report.save()
    print(f"\nDevice: {report.data['device']}, torch {report.data['torch']}, {report.data['date']}; "
          f"{'smoke mode (tiny)' if smoke else 'GPT-2 124M, T=1024'}; {prof['steps']} steps per run "
          f"(the first {prof['warmup']} untimed); {report.data['seconds']:.0f} s in all.\n")
    print(table(report.data["rows"]))


if __name__ == "__main__":
    main()
