"""One command that shows what the CUDA path does on this GPU: the evidence for docs/benchmarks.md.

    python3 benchmarks/gpu_check.py --json $OUT/gpu_check.json               # every part, in order
    python3 benchmarks/gpu_check.py --part ladder --json $OUT/gpu_check.json # one part (repeatable)
    python3 benchmarks/gpu_check.py --smoke --json /tmp/smoke.json           # anywhere: `tiny` (the tests)

Each training runs in a fresh process (compile caches, allocator state and peak-memory counters do
not leak between them), with the trainer's own figures (medians after the warm-up steps, CUDA events
for step times) and no final evaluation (``train.final_eval: false``: it would compile again). Every
row has ms/step, tokens/s (the median step's), the steady state (the timed steps over their wall
time) and the whole run (process start and compilation included), MFU against the card's dense bf16
peak (the yardstick the peers use; fp32 and tf32 rows also against their own), peak memory, and the
run's graph breaks and recompilations (a row with any says so). The parts, in the order they run:

- ``tests``: the compiled CUDA test of ``tests/test_gpu.py`` first (a CUDA-only compile failure is
  known in the first minute), the rest of the file last;
- ``best``: every switch of the ladder at once, at the largest micro-batch (the headline row);
- ``nanogpt``: our code at nanoGPT's settings (micro-batch 12, T=1024, bf16, compile); with
  ``--nanogpt DIR`` (a checkout of karpathy/nanoGPT), alternating with nanoGPT's own ``train.py`` on
  the same tokens, card, micro-batch, T and dtype (benchmarks/nanogpt_peer.py), and their ratio;
- ``levers``: Liger's fused loss, FP8 matmuls in the blocks (two recipes), the FP8 LM head, Inductor's
  coordinate-descent tuning and max-autotune, each alone on top of ``best``;
- ``ladder``: GPT-2 124M at T=1024 (smoke: no TF32, compile or cuDNN rows), each rung on top
  of the last: fp32 → tf32 → bf16 → compile → flash attention → padded vocab → fused AdamW → the
  largest micro-batch ``gpt2 plan`` says fits, up to 64 → cuDNN attention → bf16 residual stream (the
  levers are not rungs: ``levers`` measures each alone); peak memory against the plan's estimate.
  64 × 1024 positions already fill an H100's matmuls (llm.c's H100 setting);
- ``long``: the fastest row for 100 steps at GPT-2's 0.5M-token batch, an eval and a checkpoint every 25
  steps: the steady-state wall clock against the step median, with the evals after the first (which
  compiles, set aside) and the checkpoints before the last step inside it;
- ``peers``: the fastest row plain, under DDP in one process (its overhead) and with Muon;
- ``fit``: the fastest row with ``micro_batch_size: auto`` at GPT-2's batch (what the memory model
  chose, its peak against the estimate), the next micro-batch up (which should not fit: out of
  memory), and the fastest row under FSDP in one process (its overhead: FSDP's gain needs several
  GPUs);
- ``profile``: the fastest row under torch.profiler (benchmarks/profile_step.py): device time per
  step by kind and the top kernels, in ``<json>.profile.md``: where the time goes.

Built for jobs with a wall-time limit (a SLURM job, a Colab session, the 10-minute commands of a lent
GPU box): every row reaches the JSON the moment it is measured, a second run with the same ``--json``
skips the rows already there (but a row that failed for lack of a package runs again where the package
imports), and a row of the same configuration on the same card is reused. Each
job probes its card (``machine_probe``) and every row records which card measured it and what it
cost. A row starts only if what it is expected to cost fits what is left of ``--budget-s``; else it
is left to the next job, and cheaper rows still run. A child past ``--timeout-s`` (by default 300 s on a
GPU, or its expected cost where that is more) or past the end of the budget is stopped with a row that
says so and the time it had; the next job measures it again with twice that time or its own --timeout-s,
whichever is more, and starts it
only where it can have more than it had. Each
child's stderr tail is kept in ``<json>.stderr.log``, pytest's output in ``<json>.tests_first.log``
and ``<json>.tests.log``. Where the output folder starts empty every job (the lent box), ``--carried
DIR`` first copies the files the last job returned. The plan and the figures are in
docs/benchmarks.md ("GPU check").

Needs only torch, numpy, click and pyyaml (and pytest for the tests): it runs as copied on a box with
torch preinstalled, with no install, no dvc, no mlflow and no network; uses data/tokens when present,
else synthetic tokens.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import nanogpt_peer  # noqa: E402
from train_switches import run_child, synthetic_tokens  # noqa: E402

from gpt2.core.memory_model import shape  # noqa: E402
from gpt2.measure.compare import ratio_inside_noise, typical_disagreement  # noqa: E402
from gpt2.run.compiled import flag  # noqa: E402
from gpt2.run.flops import llmc_share  # noqa: E402

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
    ("+ bf16 residual stream", {"residual_stream": "bf16"}),
]
# The levers: off until this table shows they win, so each is measured alone on top of every switch (--part
# levers), never on top of another (Liger's loss and the FP8 head cannot even run together), as ladder.yaml's
# levers are measured beside the ladder.
LEVERS: list[tuple[str, dict[str, Any]]] = [
    ("+ Liger fused loss", {"loss_kernel": "liger"}),
    ("+ FP8 matmuls (tensorwise)", {"fp8": "tensorwise"}),
    ("+ FP8 matmuls (rowwise, forward and input gradient)", {"fp8": "rowwise_fwd_dgrad"}),
    ("+ FP8 LM head", {"fp8_head": True}),
    ("+ coordinate-descent tuning", {"compile_tuning": True}),  # Inductor's kernels tuned, cuBLAS's matmuls kept
    ("+ max-autotune", {"compile_mode": "max-autotune-no-cudagraphs"}),  # the dearest last: a cold compile of minutes
]
LARGEST = "+ largest micro-batch"
# A lever that beats every switch by this much won: twice what three runs of one configuration spread on one
# H100 (nanoGPT's settings on our code, card B: 435,257-437,365 tokens/s, 0.5%)
LEVER_WINS = 1.01
# FP8 on a CPU gives its numerics, slower by design (tests/test_levers.py): no row there
CUDA_ONLY = {"+ tf32", "+ cuDNN attention", "+ bf16 residual stream", "+ Liger fused loss",
             "+ FP8 matmuls (tensorwise)", "+ FP8 LM head", "+ FP8 matmuls (rowwise, forward and input gradient)",
             "+ coordinate-descent tuning"}
COMPILE_ONLY = {"+ torch.compile", "+ max-autotune", "+ coordinate-descent tuning"}
NANOGPT = {"micro_batch_size": 12, "dtype": "bf16", "compile": True, "attention": "flash", "pad_vocab": True,
           "fused_adamw": True}
GPT2_BATCH_TOKENS = 524_288  # GPT-2's 0.5M-token batch
MODEL_KEYS = ("attention", "pad_vocab")  # the rows' switches that params.yaml keeps in its model section


def profile(smoke: bool) -> dict[str, Any]:
    if smoke:  # CPU-sized: plumbing, not speed; no compile (30 s per process on a CPU)
        return {"model": {"size": "tiny", "n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 64},
                "seq": 8, "micro_batch": 1, "max_micro_batch": 4, "steps": 2, "warmup": 1, "long_steps": 4,
                "memory_gb": 8.0,
                "eval_windows": 2, "compile": False}
    return {"model": {"size": "gpt2"}, "seq": 1024, "micro_batch": 16, "max_micro_batch": 64, "steps": 20,
            "warmup": 3, "long_steps": 100, "memory_gb": None,
            "eval_windows": 320, "compile": True}


def train_params(prof: dict[str, Any], train: dict[str, Any], steps: int) -> dict[str, Any]:
    base = {"max_steps": steps, "block_size": prof["seq"], "micro_batch_size": prof["micro_batch"],
            "eval_interval": 10**9, "eval_windows": 2, "final_eval": False, "log_interval": 10,
            "checkpoint_interval": 10**9,
            "save_checkpoint": False, "mlflow": False, "resume": "never", "timing_warmup_steps": prof["warmup"]}
    train = {**base, **train}
    if not prof["compile"]:
        train["compile"] = False
    model = {**prof["model"], **{k: train.pop(k) for k in MODEL_KEYS if k in train}}
    return {"model": model, "train": train}


def estimate_gb(prof: dict[str, Any], params: dict[str, Any], micro: int) -> float | None:
    """The memory model's figure for a row (``params`` as ``train_params`` makes them: attention and the padded
    vocabulary are in the model section)."""
    from gpt2.core import memory_model
    from gpt2.core.sizes import SIZES

    model, train = params["model"], params["train"]
    size = prof["model"]["size"]
    if size not in SIZES or len(prof["model"]) > 1:
        return None  # the plan knows the named sizes only
    s = memory_model.shape(size, model.get("pad_vocab", True))
    chunk = train.get("loss_chunk", "auto")
    amp, flash = train.get("dtype") != "fp32", model.get("attention", "flash") == "flash"
    return memory_model.memory(s, micro, prof["seq"], amp, flash, 8192 if chunk == "auto" else chunk,
                               train.get("optimizer", "adamw"), fp8_head=train.get("fp8_head", False)).total / 1e9


def largest_micro_batch(prof: dict[str, Any]) -> int:
    import torch

    from gpt2.core import memory_model
    from gpt2.core.sizes import SIZES

    if prof["memory_gb"] is not None:
        memory_gb = prof["memory_gb"]
    else:
        memory_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    size = prof["model"]["size"]
    s = memory_model.shape(size if size in SIZES and len(prof["model"]) == 1 else "tiny")
    fits = memory_model.largest_micro_batch(s, prof["seq"], amp=True, flash=True, memory_gb=memory_gb, loss_chunk=8192)
    return max(prof["micro_batch"], min(fits, prof["max_micro_batch"]))


def _rates(seconds: float) -> tuple[float, float]:
    """(bf16 TFLOP/s of an 8192³ GEMM, TB/s of a 1 GiB device copy counting reads and writes)."""
    import torch

    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    src = torch.empty(2**30, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)

    def rate(work, amount: float) -> float:
        work()
        torch.cuda.synchronize()
        reps, begun = 0, time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        while time.perf_counter() - begun < seconds / 2:
            work()
            reps += 1
            if reps % 8 == 0:
                torch.cuda.synchronize()
        end.record()
        torch.cuda.synchronize()
        return amount * reps / (start.elapsed_time(end) / 1e3)

    return rate(lambda: a @ b, 2 * n**3) / 1e12, rate(lambda: dst.copy_(src), 2 * src.numel()) / 1e12


def machine_probe(seconds: float = 2.0) -> dict[str, Any]:
    """Which card measured a row, and how fast it is right now: the GPU's uuid, a bf16 GEMM rate and a
    device-to-device copy rate, about ``seconds`` in all. Two instances of one card model differ by a few
    percent, about one rung's gain, so rows compare directly only where their probes match."""
    import torch

    if not torch.cuda.is_available():
        return {"uuid": None, "name": platform.machine()}
    props = torch.cuda.get_device_properties(0)
    tflops, copy = _rates(seconds)
    torch.cuda.empty_cache()  # the children train in this card's memory, all of it
    return {"uuid": str(props.uuid), "name": torch.cuda.get_device_name(), "sms": props.multi_processor_count,
            "bf16_gemm_tflops": round(tflops, 1), "copy_tb_s": round(copy, 2)}


def row(name: str, metrics: dict[str, Any] | None, error: str, estimate: float | None,
        train: dict[str, Any], note: str = "") -> dict[str, Any]:
    if metrics is None:
        return {"name": name, "failed": error, "train": train}
    perf, runtime = metrics["perf"], metrics.get("runtime", {})
    return {"name": name, "step_ms": perf["step_ms"], "step_ms_iqr": perf.get("step_ms_iqr"),
            "tokens_per_s": perf["tokens_per_s"],
            "tokens_per_s_steady": perf.get("tokens_per_s_steady"), "tokens_per_s_wall": perf.get("tokens_per_s_wall"),
            "mfu": perf["mfu"], "mfu_dtype": perf.get("mfu_dtype"),
            "peak_gb": metrics["mem"]["peak_gb"], "peak_reserved_gb": metrics["mem"].get("peak_reserved_gb"),
            "estimate_gb": estimate, "warmup_s": perf.get("warmup_s"),
            "sdpa": runtime.get("sdpa_backend"), "dtype": runtime.get("dtype"), "tf32": runtime.get("tf32"),
            "graph_breaks": runtime.get("graph_breaks"), "recompiles": runtime.get("recompiles"),
            "micro_batch": runtime.get("micro_batch_size", train["micro_batch_size"]),
            "accum": runtime.get("grad_accum_steps", train.get("grad_accum_steps", 1)), "note": note,
            "train": train}


def mfu_cell(r: dict[str, Any]) -> str:
    """'41.2%' against the bf16 peak; fp32 and tf32 rows add their own dtype's: '3.1% (46% of tf32)'."""
    if r.get("mfu") is None:
        return "n/a"
    own = r.get("mfu_dtype")
    kind = "tf32" if r.get("dtype") == "fp32" and r.get("tf32") else r.get("dtype")
    return f"{100 * r['mfu']:.1f}%" + (f" ({100 * own:.0f}% of {kind})" if own is not None else "")


PARTS = ("tests", "best", "nanogpt", "levers", "ladder", "long", "peers", "fit", "profile")  # the headline rows first
BEST_ROW_PARTS = {"peers", "long", "fit", "profile"}  # each starts from the fastest row measured
FIRST_TESTS = "compiled_bf16"  # pytest -k: the compiled CUDA test, run first; the rest of test_gpu.py runs last
# What a row costs on a GPU (process start, compile, the steps) until this card has measured one of its kind: the
# dearest of each kind on an H100 (compiled rows 19-58 s on 2026-11-26, 72-75 s cold on card E on 2026-11-27; the
# tests 30 and 60 s). The long row took 125 s
# on the H200 with a warm compile cache; cold, 200-290 s is the estimate. max-autotune's is the least it takes: cold,
# it compiled past 443 s on an H100 (2026-11-27), so it gets the rest of a job that has 450 s left, and a job stopped
# by its budget leaves the row to the next (docs/benchmarks.md, "GPU check"). Coordinate-descent tuning alone
# (Inductor's own kernels, not the matmuls) is unmeasured: three times a compiled row is the estimate.
COST_S = {"plain": 30.0, "compiled": 75.0, "tuned": 225.0, "autotune": 450.0, "long": 250.0, "tests first": 40.0,
          "tests": 90.0}
# A compiled row whose configuration this job ran already, its compile cached: 19-34 s on an H100 (2026-11-26/27)
WARM_S = 30.0
MORE_THAN_LAST = 1.25  # a row that timed out starts again only with a quarter more time than it had at least
SMOKE_COST_S = 20.0


@dataclasses.dataclass(frozen=True)
class Limit:
    """A child's time limit, and whether it is the job's budget (not the child's own limit) that set it. A child
    stopped by either is recorded as timed out, with the time it had, so that the next job gives it more; one the
    budget stopped also ends the job's run of rows (``check``)."""

    seconds: float | None
    by_budget: bool

    def check(self, error: str) -> None:
        if self.by_budget and error.startswith("timed out"):
            raise OutOfBudget


class OutOfBudget(Exception):
    """The job's time budget (``--budget-s``) is nearly spent: stop before a child that would not finish."""


def stepper(left: list[str]) -> Any:
    """``step(what, action, *args)``: ``action(*args)``, or, where the budget cannot fit it, None with ``what``
    added to ``left`` (what the next job does) and said."""
    def step(what: str, action: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return action(*args, **kwargs)
        except OutOfBudget:
            left.append(what)
            print(f"gpu_check: {what}: left for the next job (too little of --budget-s left)", file=sys.stderr)
            return None

    return step


@dataclasses.dataclass
class Budget:
    """This job's time (``--budget-s``; None: no end) and a child's own limit (``--timeout-s``). ``stretch``: the
    limit is the default one, which a row expected to cost more (a cold max-autotune) stretches to that cost."""

    seconds: float | None
    timeout_s: float | None
    clock: Any = time.perf_counter
    stretch: bool = False
    started: float = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.started = self.clock()

    def spent(self) -> float:
        return self.clock() - self.started

    def limit(self, expected_s: float, own_s: float | None = None) -> Limit:
        """The next child's time: its own limit, cut to what is left of the budget. A child starts only if what
        it is expected to cost fits what is left; else ``OutOfBudget``, and the next job measures it."""
        own = own_s if own_s is not None else self.timeout_s
        if own is not None and self.stretch:
            own = max(own, expected_s)
        if self.seconds is None:
            return Limit(own, False)
        left = self.seconds - self.spent()
        if left < expected_s:
            raise OutOfBudget
        return Limit(left, True) if own is None or left < own else Limit(own, False)


def bring_carried(carried: Path, json_path: Path) -> list[str]:
    """Copy the files an earlier job returned (the JSON and its logs, carried into this job) beside ``json_path``,
    as writable files: the lent box starts every command with an empty output folder."""
    brought = []
    for source in sorted(carried.glob(f"{json_path.stem}*")):
        target = json_path.parent / source.name
        if source.is_file() and not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
            brought.append(source.name)
    return brought


class Report:
    """The check's JSON, rewritten (atomically) after every row: a job killed at its time limit keeps every
    finished row, and a second job with the same ``--json`` skips them. Each child's stderr tail goes to
    ``<json>.stderr.log`` beside it, for post-mortems."""

    def __init__(self, path: Path | None, header: dict[str, Any]) -> None:
        self.path = path
        self.data = {**header, "rows": [], "machines": {}}
        if path is not None and path.is_file():
            old = json.loads(path.read_text())
            if {k: old.get(k) for k in ("device", "smoke")} == {k: header[k] for k in ("device", "smoke")}:
                self.data = {**old, **header, "rows": old.get("rows", []), "machines": old.get("machines", {})}
        self.log = path.with_suffix(".stderr.log") if path is not None else None

    def row(self, name: str) -> dict[str, Any] | None:
        return next((r for r in self.data["rows"] if r["name"] == name), None)

    def add(self, result: dict[str, Any], stderr: str = "") -> None:
        """A new row, or one measured again (a timeout, a pair redone) in its old row's place."""
        rows = self.data["rows"]
        at = next((i for i, r in enumerate(rows) if r["name"] == result["name"]), None)
        if at is None:
            rows.append(result)
        else:
            rows[at] = result
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


def timed_out(r: dict[str, Any] | None) -> bool:
    """A row its child's own limit stopped: never final, the next job measures it again with more time."""
    return r is not None and str(r.get("failed", "")).startswith("timed out")


def installed_since(r: dict[str, Any] | None) -> bool:
    """A row that failed for a package the box lacked (``needs liger-kernel, which is not installed here``),
    which imports now: a job that brought the wheel measures it again."""
    failed = str((r or {}).get("failed", ""))
    if ", which is not installed here" not in failed:
        return False
    package = failed.split(", which is not installed here")[0].rsplit(" needs ", 1)[-1]
    return importlib.util.find_spec(package.replace("-", "_")) is not None


def measure_again(r: dict[str, Any] | None) -> bool:
    """A row that is not final: it ran out of time, or the package it lacked is here now."""
    return timed_out(r) or installed_since(r)


def reusable(r: dict[str, Any]) -> bool:
    """Whether a row may stand in for another of its configuration: measured, and not ``superseded`` (a row of code
    that has changed since, kept in the table under a name of its own for the record)."""
    return "failed" not in r and "superseded" not in r


def config_key(params: dict[str, Any]) -> str:
    """A training configuration as one string: the model and train settings a child ran."""
    return json.dumps([params.get("model"), params.get("train")], sort_keys=True, default=str)


def lever_verdict(v: dict[str, Any]) -> str:
    """A lever's rounds in one line: its median gain, the rounds' range, and whether it is outside noise."""
    if "failed" in v:
        return f"failed: {v['failed']}"
    each = [100 * (r - 1) for r in v["paired"]]
    return (f"{100 * (v['median'] - 1):+.1f}% tokens/s vs every switch, median of {len(each)} alternating rounds on "
            f"one card ({min(each):+.1f} to {max(each):+.1f}%): "
            + ("inside noise" if v["inside_noise"] else "outside noise")
            + f" (floor {100 * v['floor']:.1f}%)")


def apart(*rows: dict[str, Any]) -> str:
    """A note for a comparison between rows that different cards measured (instances of one model differ by a
    few percent, about one rung's gain)."""
    return " (rows from different cards: see the probes)" if len({r.get("machine") for r in rows}) > 1 else ""


def table(rows: list[dict[str, Any]], machines: dict[str, Any] | None = None, llmc: float | None = None) -> str:
    """The rows as markdown; where different cards measured them, a card column and each card's probe. ``llmc``:
    llm.c's FLOP count over nanoGPT's for the model measured (gpt2/run/flops.py), said under the table so an MFU
    is compared with llm.c's in its own count."""
    cards = list(dict.fromkeys(r.get("machine") for r in rows))
    labels = {uuid: chr(ord("A") + i) for i, uuid in enumerate(cards)} if len(cards) > 1 else {}
    head = ("| run | micro-batch × accum | ms/step (IQR) | tokens/s | steady tokens/s | whole-run tokens/s "
            "| MFU (bf16 peak) | peak GB allocated / reserved (plan) | kernel | note |")
    lines = [head + (" card |" if labels else ""), "|---" * (10 + bool(labels)) + "|"]

    def number(value: float | None) -> str:
        return f"{value:,.0f}" if value else ""

    for r in rows:
        card = f" {labels[r.get('machine')]} |" if labels else ""
        if "failed" in r:
            lines.append(f"| {r['name']} | | failed | | | | | | | {r['failed']} |{card}")
            continue
        plan_gb = f" ({r['estimate_gb']:.1f})" if r.get("estimate_gb") is not None else ""
        reserved = f" / {r['peak_reserved_gb']:.1f}" if r.get("peak_reserved_gb") is not None else ""
        peak = f"{r['peak_gb']:.1f}{reserved}{plan_gb}" if r.get("peak_gb") is not None else ""
        note = "; ".join(filter(None, [r.get("note", ""), flag(r)]))
        spread = f" ({r['step_ms_iqr']:.1f})" if r.get("step_ms_iqr") is not None else ""
        lines.append(f"| {r['name']} | {r['micro_batch']} × {r['accum']} | {r['step_ms']:.1f}{spread} "
                     f"| {number(r['tokens_per_s'])} | {number(r.get('tokens_per_s_steady'))} "
                     f"| {number(r.get('tokens_per_s_wall'))} | {mfu_cell(r)} | {peak} | {r.get('sdpa') or ''} "
                     f"| {note} |{card}")
    text = "\n".join(lines) + "\n"
    if labels:
        probes = []
        for uuid, label in labels.items():
            p = (machines or {}).get(uuid) or {}
            figures = (f"{p['bf16_gemm_tflops']:g} TFLOP/s bf16 GEMM, {p['copy_tb_s']:g} TB/s copy"
                       if "bf16_gemm_tflops" in p else "no probe")
            probes.append(f"{label}: {uuid or 'unknown'} ({figures})")
        text += "\nCards: " + "; ".join(probes) + ". Compare rows of one card.\n"
    if llmc is not None:
        text += (f"\nMFU counts a token's FLOPs as nanoGPT and nanochat do (attention as a full square); llm.c counts "
                 f"its causal half and every parameter: in llm.c's count each MFU is {llmc:.3f} × the one shown.\n")
    return text


def profile_best(params: dict[str, Any], tokens: str, report: Report, timeout_s: float | None) -> dict[str, Any]:
    """The best row's step under torch.profiler, in a fresh process: time by kind (kept in the JSON) and the
    full table (beside it, ``<json>.profile.md``)."""
    sets = [f"{section}.{key}={json.dumps(value)}"
            for section, values in params.items() for key, value in values.items()]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.json"
        command = [sys.executable, str(ROOT / "benchmarks/profile_step.py"), "--tokens", tokens, "--json", str(out),
                   *[arg for s in sets for arg in ("--set", s)]]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"failed": f"timed out after {timeout_s:g} s"}
        if result.returncode != 0 or not out.is_file():
            return {"failed": (result.stderr.strip().splitlines() or ["no output"])[-1][:300]}
        figures = json.loads(out.read_text())
    if report.path is not None:
        report.path.with_suffix(".profile.md").write_text(result.stdout)
    print(result.stdout, file=sys.stderr)
    return {"ms_per_step": round(figures["total_ms"], 3), "step_ms": round(figures["step_ms"], 3),
            "coverage": figures["coverage"], "by_kind": figures["by_kind"], "top": figures["top"][:10]}


def run_tests(report: Report, limit: Limit, key: str, selection: str, machine: str) -> None:
    """``pytest tests/test_gpu.py -k selection``: its summary line in the JSON under ``key`` (the latest card's) and
    under ``tests by card`` for this card, its whole output beside it (``<json>.<key>.log``). A run past its own
    time keeps what it printed and does not end the job."""
    command = [sys.executable, "-m", "pytest", "-v", "-n", "0", "-p", "no:cacheprovider", "tests/test_gpu.py",
               "-k", selection]
    try:
        tests = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=limit.seconds)
        output, summary = tests.stdout + tests.stderr, (tests.stdout.strip().splitlines() or ["no output"])[-1]
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        summary = f"timed out after {limit.seconds:g} s; what ran is in the tests log"
    report.data[key] = summary
    report.data.setdefault("tests by card", {}).setdefault(machine, {})[key] = summary
    if report.path is not None:
        report.path.with_suffix(f".{key.replace(' ', '_')}.log").write_text(output)
    report.save()
    print(f"gpu_check: tests/test_gpu.py -k '{selection}': {summary}", file=sys.stderr)
    limit.check(summary)


class Check:
    """The parts of one job, each row measured in a fresh process and saved the moment it is measured. A row
    already in the JSON is kept, except one that timed out (measured again with more time)."""

    def __init__(self, report: Report, prof: dict[str, Any], gpu: bool, smoke: bool, token_dir: str, tmp: str,
                 budget: Budget, machine: str | None) -> None:
        self.report, self.prof, self.gpu, self.smoke = report, prof, gpu, smoke
        self.token_dir, self.tmp, self.budget, self.machine = token_dir, tmp, budget, machine
        self.warm: dict[str, float] = {}  # what each configuration cost when this job last ran it (compile cached)

    def runs_here(self, name: str) -> bool:
        """Whether a ladder rung or a lever can show anything here: CUDA-only switches get no row on a CPU, nor
        compile's where the profile turns compile off (smoke)."""
        if not self.gpu and name in CUDA_ONLY:
            return False
        return self.prof["compile"] or name not in COMPILE_ONLY

    def expected_s(self, kind: str, params: dict[str, Any] | None = None) -> float:
        """What a row of this kind is expected to cost here: what ``params`` cost when this job last ran them (its
        compile is cached now: at most WARM_S), else the dearest row of the kind this card measured, else COST_S."""
        if self.smoke:
            return SMOKE_COST_S
        if params is not None and config_key(params) in self.warm:
            return min(self.warm[config_key(params)], WARM_S)
        seen = [r["seconds"] for r in self.report.data["rows"]
                if r.get("kind") == kind and r.get("machine") == self.machine and "seconds" in r and "failed" not in r]
        return max(seen) if seen else COST_S[kind]

    def kind(self, train: dict[str, Any]) -> str:
        """What a row costs like: the long row's 100 steps of GPT-2's batch are a kind of their own, so that they
        do not raise what the next 20-step row is expected to cost."""
        if train.get("max_steps", 0) > self.prof["steps"]:
            return "long"
        if not (train.get("compile", True) and self.prof["compile"]):
            return "plain"
        if str(train.get("compile_mode", "")).startswith("max-autotune"):
            return "autotune"
        return "tuned" if train.get("compile_tuning") else "compiled"

    def limit(self, kind: str, before: dict[str, Any] | None, params: dict[str, Any] | None = None) -> Limit:
        """The limit of a row's child: ``--timeout-s``, and where it timed out before, at least twice the limit
        it had then (a row stopped at 2 s under an old limit gets this command's 600 s, not 4). A row that timed
        out starts only where it can have more than it had (``MORE_THAN_LAST``): with less it would be stopped
        again, and the time spent on it lost."""
        if timed_out(before):
            needs = max(self.expected_s(kind, params), MORE_THAN_LAST * before["timeout_s"])
            given = self.budget.timeout_s
            return self.budget.limit(needs, None if given is None else max(given, 2 * before["timeout_s"]))
        return self.budget.limit(self.expected_s(kind, params))

    def record(self, result: dict[str, Any], stderr: str, kind: str, seconds: float, limit: Limit) -> dict[str, Any]:
        """Save a measured row with what it cost and which card measured it, and say it; then, if the job's budget
        stopped it, end the job's run of rows (``OutOfBudget``)."""
        result.update(kind=kind, seconds=round(seconds, 1), machine=self.machine)
        if timed_out(result):
            result["timeout_s"] = limit.seconds
        self.report.add(result, stderr)
        shown = f"{result['tokens_per_s']:,.0f} tok/s" if "failed" not in result else f"failed: {result['failed']}"
        print(f"gpu_check: [{self.budget.spent():.0f} s] {result['name']}: {shown}", file=sys.stderr)
        limit.check(str(result.get("failed", "")))
        return result

    def measure(self, name: str, train: dict[str, Any], steps: int | None = None, note: str = "", run: bool = True,
                fresh: bool = False, reuse: bool = True) -> dict[str, Any] | None:
        """The row ``name``: from the JSON if measured before, else measured now (when ``run``). A row of the same
        configuration that this card measured already is reused, not run again, unless ``reuse`` is False (a
        repeat). ``fresh``: measured now whatever the JSON holds (a pair's halves run back to back)."""
        before = self.report.row(name)
        if not fresh and ((before is not None and not measure_again(before)) or not run):
            return before
        params = train_params(self.prof, train, steps or self.prof["steps"])
        twin = None if fresh or not reuse else self.run_of(params, self.machine)
        if twin is not None:
            copy = {**twin, "name": name, "note": f"the run of '{twin['name']}' (the same configuration)"}
            self.report.add(copy)
            return copy
        kind = self.kind(params["train"])
        limit = self.limit(kind, before, params)
        begun = self.budget.clock()
        metrics, error, stderr = run_child(params, self.token_dir, f"{self.tmp}/{len(self.report.data['rows'])}",
                                           limit.seconds)
        if not error:
            self.warm[config_key(params)] = self.budget.clock() - begun
        micro = (metrics or {}).get("runtime", {}).get("micro_batch_size", params["train"]["micro_batch_size"])
        estimate = estimate_gb(self.prof, params, micro) if micro != "auto" else None
        result = {**row(name, metrics, error, estimate, params["train"], note), "model": params["model"]}
        return self.record(result, stderr, kind, self.budget.clock() - begun, limit)

    def all_switches(self) -> dict[str, Any]:
        """Every ladder switch at once, at the largest micro-batch: the headline row."""
        config: dict[str, Any] = {}
        for name, change in RUNGS:
            if self.runs_here(name):
                config.update({"micro_batch_size": largest_micro_batch(self.prof)} if name == LARGEST else change)
        return config

    def ladder(self, run: bool, step: Any) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Each rung on top of the last that ran; the (row, configuration) of each measured rung. A rung left to
        the next job leaves the rungs below it too (each one builds on it)."""
        config: dict[str, Any] = {}
        measured = []
        for name, change in RUNGS:
            if not self.runs_here(name):
                continue
            candidate = {**config, **({"micro_batch_size": largest_micro_batch(self.prof)} if name == LARGEST
                                      else change)}
            result = step(f"the ladder from '{name}'", self.measure, name, candidate, None, "", run)
            if result is None and run:  # left to the next job
                break
            if result is not None and "failed" not in result:
                config = candidate  # a rung that failed (out of memory, a kernel missing here) is not carried on
                measured.append((result, candidate))
        return measured

    def levers(self, base: dict[str, Any], base_row: dict[str, Any] | None, step: Any) -> None:
        """Each lever alone on top of every switch: what it buys where everything else is on already. Where the
        baseline came from another card and a lever is still to measure, this card measures the baseline first:
        instances of one GPU differ by a few percent, as much as a lever's gain."""
        measured = [self.report.row(f"all switches {name}") for name, _ in LEVERS if self.runs_here(name)]
        elsewhere = base_row is not None and "failed" not in base_row and base_row.get("machine") != self.machine
        if elsewhere and any(r is None or measure_again(r) for r in measured):
            base_row = step("all switches on this card", self.measure, f"all switches (card {str(self.machine)[:8]})",
                            base) or base_row
        for name, change in LEVERS:
            if not self.runs_here(name):
                continue
            result = step(f"all switches {name}", self.measure, f"all switches {name}", {**base, **change})
            if result is not None and base_row is not None and "failed" not in result and "failed" not in base_row:
                baseline = self.same_card(base_row, result.get("machine"))
                gain = 100 * (result["tokens_per_s"] / baseline["tokens_per_s"] - 1)
                result["note"] = f"{gain:+.1f}% tokens/s vs all switches" + apart(result, baseline)
        self.report.save()
        if together := self.winners_together(base):  # each won alone: together they are our side's best
            step(together[0], self.measure, *together)

    def lever_rounds(self, base: dict[str, Any], levers: list[tuple[str, dict[str, Any]]], rounds: int, step: Any
                     ) -> dict[str, dict[str, Any]]:
        """Every switch and each lever on top of it, ``rounds`` times on this card, alternating (every other round
        in reverse order, so that a drift of the card's speed weighs on each alike); each lever judged by the CPU
        grid's noise rule (gpt2.measure.compare): its tokens/s over the same round's baseline, round by round, must
        agree on the direction and their median lie beyond the noise floor (how far the levers' paired ratios
        typically disagree). A lever is judged only on all its rounds: one that a job's budget cut short is left
        unjudged, for a later job to measure again. Every row is named after its card and the set of levers it
        was measured with, so pairs never mix sets. A lever whose row failed (not for time) is judged failed, with
        why, as is every lever where the baseline failed. The verdicts, by lever, also under ``lever rounds`` in
        the JSON, by card."""
        card = str(self.machine)[:8]
        of = ", ".join(name.removeprefix("+ ") for name, _ in levers)
        arms = [("all switches", base)] + [(f"all switches {name}", {**base, **change}) for name, change in levers]
        rows: dict[str, list[dict[str, Any] | None]] = {name: [] for name, _ in arms}
        for k in range(1, rounds + 1):
            for name, config in (arms if k % 2 else arms[::-1]):
                rows[name].append(step(f"{name}, round {k}", self.measure, f"{name} (card {card}, round {k} of: {of})",
                                       config, None, "", True, False, False))
        verdicts: dict[str, dict[str, Any]] = {}
        complete: dict[str, list[float]] = {}
        for name, _ in levers:
            mine = rows[f"all switches {name}"]
            broken = [("" if series is mine else "every switch failed: ") + r["failed"]
                      for series in (rows["all switches"], mine) for r in series
                      if r is not None and "failed" in r and not timed_out(r)]
            if broken:
                verdicts[name] = {"failed": broken[0], "paired": [], "median": None, "inside_noise": True}
                continue
            pairs = [(r, b) for r, b in zip(mine, rows["all switches"]) if r is not None and b is not None
                     and "failed" not in r and "failed" not in b]
            if len(pairs) == rounds:
                complete[name] = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in pairs]
        floor = typical_disagreement(list(complete.values()))
        for name, ratios in complete.items():
            verdicts[name] = {"paired": [round(r, 4) for r in ratios], "median": round(statistics.median(ratios), 4),
                              "floor": round(floor, 4), "inside_noise": ratio_inside_noise(ratios, floor)}
            rows[f"all switches {name}"][-1]["note"] = lever_verdict(verdicts[name])
        self.report.data.setdefault("lever rounds", {}).setdefault(str(self.machine), {}).update(verdicts)
        self.report.save()
        return verdicts

    def gain(self, r: dict[str, Any]) -> float | None:
        """Row ``r``'s tokens/s over every switch's on the card that measured ``r`` (None without that row)."""
        baseline = self.report.row("all switches")
        if baseline is None or "failed" in baseline or "failed" in r:
            return None
        return r["tokens_per_s"] / self.same_card(baseline, r.get("machine"))["tokens_per_s"]

    def winning_levers(self, base: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """The levers whose row beat every switch on its own card by ``LEVER_WINS`` or more, fastest first; of two
        that set the same key (two FP8 recipes), the faster one."""
        gains = [(gain, name, change) for name, change in LEVERS for r in [self.report.row(f"all switches {name}")]
                 if r is not None for gain in [self.gain(r)] if gain is not None]
        winners: list[tuple[str, dict[str, Any]]] = []
        for gain, name, change in sorted(gains, key=lambda g: -g[0]):
            if gain >= LEVER_WINS and not any(change.keys() & taken.keys() for _, taken in winners):
                winners.append((name, change))
        return winners

    def winners_together(self, base: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """The row of every switch with the winning levers on together, where more than one won: its name (the levers
        in LEVERS' order) and its configuration."""
        winners = self.winning_levers(base)
        if len(winners) < 2:
            return None
        ordered = [(name, change) for name, change in LEVERS if (name, change) in winners]
        config = dict(base)
        for _, change in ordered:
            config.update(change)
        return "all switches " + " ".join(name for name, _ in ordered), config

    def run_of(self, config: dict[str, Any], machine: str | None) -> dict[str, Any] | None:
        """A reusable row of ``config``'s model and train settings that ``machine`` measured, if any."""
        return next((r for r in self.report.data["rows"] if r.get("machine") == machine and reusable(r)
                     and (r.get("model"), r.get("train")) == (config.get("model"), config.get("train"))), None)

    def same_card(self, row: dict[str, Any], machine: str | None) -> dict[str, Any]:
        """``row``, or a run of its configuration that ``machine`` measured: a lever measured by an earlier job on
        another card is compared with its own card's baseline, not with this card's (instances differ by a few
        percent, as much as a lever's gain)."""
        return row if row.get("machine") == machine else self.run_of(row, machine) or row

    def fastest_switches(self, base: dict[str, Any]) -> dict[str, Any]:
        """Every switch, with the lever (or the levers together) that beat it by the most where one did, each
        against its own card's run of every switch: our side's best."""
        measured = self.headline_and_levers(base)
        if not measured or self.gain(measured[0][0]) is None:
            return base
        return max(measured, key=lambda m: self.gain(m[0]) or 0.0)[1]

    def headline_and_levers(self, base: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """The measured rows of every switch, of each lever on top of it and of the levers that won together, each
        with its configuration."""
        named = [("all switches", base)] + [(f"all switches {name}", {**base, **change}) for name, change in LEVERS]
        if together := self.winners_together(base):
            named.append(together)
        return [(r, config) for name, config in named
                for r in [self.report.row(name)] if r is not None and "failed" not in r]

    def nanogpt_pairs(self, nanogpt: Path, repeats: int, base: dict[str, Any], step: Any,
                      best: dict[str, Any] | None = None) -> None:
        """Ours and nanoGPT's own train.py, alternating, both halves of a pair in one job on one card (a pair split
        by a job's end, or measured on two cards, is measured again whole). First each side at its best (every
        switch of ours, with the lever, or the levers together, that beat it; nanoGPT's defaults at the same
        micro-batch), then both at nanoGPT's settings. The best pair's name says which levers ours ran with, so a
        pair from before a lever won stays in the table as it was. ``best``: ours at these settings, in the best
        pair only (the levers do not change nanoGPT's settings, whose pairs stand)."""
        settings = {**NANOGPT, **({} if self.gpu else {"dtype": "fp32"})}  # nanoGPT on a CPU runs fp32 whatever asked
        given, best = best is not None, best or self.fastest_switches(base)
        largest = best.get("micro_batch_size", settings["micro_batch_size"])
        changed = {key: value for key, value in best.items() if base.get(key) != value}
        named = [(name, change) for name, change in LEVERS if change.items() <= changed.items()]
        levers = "".join(f" {name}" for name, _ in named) + "".join(
            f" + {key}={value}" for key, value in changed.items() if not any(key in c for _, c in named))
        tag = "best pair {k}" + (f", ours{levers}" if levers else "")
        matchups = (("nanogpt_best_ratio", "nanoGPT best pair", best, largest,
                     (f"every switch{levers} on our code ({tag})",
                      f"nanoGPT's own train.py, micro-batch {largest} ({tag})")),
                    ("nanogpt_ratio", "nanoGPT settings pair", settings, settings["micro_batch_size"],
                     ("nanoGPT's settings on our code (run {k})", "nanoGPT's own train.py (run {k})")))
        for key, what, ours_config, micro, labels in matchups[:1] if given else matchups:
            pairs = []
            for k in range(1, repeats + 1):
                names = tuple(label.format(k=k) for label in labels)
                ours, theirs = (self.report.row(n) for n in names)
                whole = ours is not None and theirs is not None and not timed_out(ours) and not timed_out(theirs)
                if not (whole and ours.get("machine") == theirs.get("machine")):
                    pair = step(f"{what} {k}", self.nanogpt_pair, names, ours_config, micro, nanogpt)
                    if pair is None:
                        continue
                    ours, theirs = pair
                pairs.append((ours, theirs))
            done = [(o, t) for o, t in pairs if "failed" not in o and "failed" not in t]
            if done:
                ratio = round(statistics.median(o["tokens_per_s"] for o, _ in done)
                              / statistics.median(t["tokens_per_s"] for _, t in done), 3)
                each = [o["tokens_per_s"] / t["tokens_per_s"] for o, t in done]
                self.report.data[key] = ratio
                done[-1][1]["note"] = (f"ours ÷ nanoGPT: {ratio:.2f}× tokens/s (medians of {len(done)} alternating "
                                       f"runs each; pairs {min(each):.2f}–{max(each):.2f}×)")
            self.report.save()

    def nanogpt_pair(self, names: tuple[str, str], settings: dict[str, Any], micro: int, nanogpt: Path
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
        kind = self.kind(settings)
        self.budget.limit(2 * self.expected_s(kind))  # both halves fit, or neither starts
        ours = self.measure(names[0], settings, fresh=True)
        return ours, self.measure_nanogpt(names[1], ours, micro, nanogpt, kind)

    def measure_nanogpt(self, name: str, ours: dict[str, Any], micro: int, nanogpt: Path, kind: str
                        ) -> dict[str, Any]:
        """nanoGPT's own train.py at ``micro`` sequences a step, its other settings its own; MFU scaled from our
        row (the same model FLOPs)."""
        prof = self.prof
        args = nanogpt_peer.overrides(prof, self.token_dir, f"{self.tmp}/nanogpt-{len(self.report.data['rows'])}",
                                      micro, prof["steps"], self.gpu)
        limit = self.limit(kind, self.report.row(name))
        begun = self.budget.clock()
        times, wrapper, error, stderr = nanogpt_peer.run(nanogpt, args, limit.seconds)
        if error:
            result = {"name": name, "failed": error, "train": {"nanogpt": args}}
        else:
            result = {"name": name, **nanogpt_peer.figures(times, wrapper, micro * prof["seq"], prof["warmup"]),
                      "estimate_gb": None, "sdpa": "nanoGPT's", "dtype": "bf16" if self.gpu else "fp32",
                      "micro_batch": micro, "accum": 1, "note": "", "train": {"nanogpt": args}}
            ok = "failed" not in ours and ours.get("mfu") is not None
            result["mfu"] = ours["mfu"] * result["tokens_per_s"] / ours["tokens_per_s"] if ok else None
        return self.record(result, stderr, kind, self.budget.clock() - begun, limit)

    def tests(self, key: str, selection: str) -> None:
        """The CUDA tests, on every card that has not run them (a JSON carried from another card holds that
        card's): a compile that fails on one card model may pass on another."""
        ran = self.report.data.get("tests by card", {}).get(str(self.machine), {}).get(key)
        if ran is None or ran.startswith("timed out"):
            run_tests(self.report, self.budget.limit(COST_S[key]), key, selection, str(self.machine))

    def peers(self, best: dict[str, Any]) -> None:
        plain = self.measure("best, plain (for DDP)", best)
        ddp = self.measure("best, DDP in 1 process", {**best, "distributed": "ddp"})
        if "failed" not in plain and "failed" not in ddp:
            ddp["note"] = f"DDP overhead {100 * (ddp['step_ms'] / plain['step_ms'] - 1):+.1f}%" + apart(ddp, plain)
        muon = self.measure("best, Muon optimizer", {**best, "optimizer": "muon"})
        if "failed" not in plain and "failed" not in muon:
            muon["note"] = (f"step time vs AdamW {100 * (muon['step_ms'] / plain['step_ms'] - 1):+.1f}%"
                            + apart(muon, plain))
        self.report.save()

    def long(self, best: dict[str, Any]) -> None:
        prof = self.prof
        batch = best.get("micro_batch_size", prof["micro_batch"]) * prof["seq"]
        accum = max(1, round(GPT2_BATCH_TOKENS / batch)) if not self.smoke else 2
        steps = prof["long_steps"]
        every = max(1, steps // 4)
        evals = list(range(every, steps, every))  # none after the last step (final_eval: false)
        # the steady figure runs from the first sync after the warm-up to the last step's: the first eval under
        # compile is set aside whole (it compiles), a checkpoint after the last step falls outside
        timed_evals = evals[1:] if best.get("compile", prof["compile"]) else evals
        timed_saves = [s for s in evals if s > prof["warmup"]]
        long = self.measure(f"{steps} steps, GPT-2 batch, evals and checkpoints every {every}",
                            {**best, "grad_accum_steps": accum, "eval_interval": every,
                             "eval_windows": prof["eval_windows"], "checkpoint_interval": every,
                             "save_checkpoint": True, "timing_warmup_steps": prof["warmup"]}, steps)
        if "failed" not in long and long.get("tokens_per_s_steady"):
            long["note"] = (f"steady-state wall clock {100 * long['tokens_per_s_steady'] / long['tokens_per_s']:.1f}%"
                            f" of the step median, with the evals at steps {', '.join(map(str, timed_evals))} and "
                            f"the checkpoints at {', '.join(map(str, timed_saves))} inside it")
        self.report.save()

    def fit(self, best: dict[str, Any]) -> None:
        batch_tokens = GPT2_BATCH_TOKENS if not self.smoke else 16 * self.prof["seq"]
        fitted = {**best, "micro_batch_size": "auto", "batch_tokens": batch_tokens, "grad_accum_steps": 1}
        auto = self.measure("best, micro-batch auto (GPT-2 batch)", fitted)
        if "failed" not in auto:
            sequences = batch_tokens // self.prof["seq"]
            up = next((d for d in range(auto["micro_batch"] + 1, sequences + 1) if sequences % d == 0), None)
            if up is not None:
                over = self.measure("auto's next micro-batch up", {**fitted, "micro_batch_size": up})
                over["note"] = ("out of memory, as the model said" if "out of memory" in over.get("failed", "")
                                else "failed otherwise" if "failed" in over else "fits: the model is cautious here")
        fsdp = self.measure("best, FSDP in 1 process", {**best, "distributed": "fsdp"})
        plain = self.report.row("best, plain (for DDP)")
        if plain is not None and "failed" not in plain and "failed" not in fsdp:
            fsdp["note"] = (f"FSDP overhead {100 * (fsdp['step_ms'] / plain['step_ms'] - 1):+.1f}% (one process)"
                            + apart(fsdp, plain))
        self.report.save()

    def profile(self, best: dict[str, Any]) -> None:
        """The fastest row's step under torch.profiler; again when the fastest row is another configuration than
        the one profiled (a lever won since), the earlier profile kept under ``earlier profiles``."""
        params = train_params(self.prof, best, self.prof["steps"])
        old = self.report.data.get("profile")
        if old is not None and not str(old.get("failed", "")).startswith("timed"):
            if old.get("train") == params["train"]:
                return
            self.report.data.setdefault("earlier profiles", []).append(old)
            del self.report.data["profile"]
        limit = self.budget.limit(self.expected_s(self.kind(best), params))
        profiled = profile_best(params, self.token_dir, self.report, limit.seconds)
        self.report.data["profile"] = {**profiled, "train": params["train"], "machine": self.machine}
        self.report.save()
        limit.check(profiled.get("failed", ""))

    def run(self, parts: tuple[str, ...], nanogpt: Path | None, nanogpt_repeats: int) -> list[str]:
        """Every part asked for, in ``PARTS``' order: the compiled CUDA test first (a CUDA-only compile failure is
        known in the first minute), then the headline rows, the rest of the tests last. What does not fit the
        budget is left to the next job, and the job goes on with what does; the names of what was left."""
        left: list[str] = []
        step = stepper(left)

        if "tests" in parts:
            step("tests (compiled)", self.tests, "tests first", FIRST_TESTS)
        base = self.all_switches()
        base_row = step("all switches", self.measure, "all switches", base) if {"best", "levers"} & set(parts) else None
        if "nanogpt" in parts:
            if nanogpt is None:
                step("nanogpt", self.measure, "nanoGPT's settings on our code",
                     {**NANOGPT, **({} if self.gpu else {"dtype": "fp32"})}, None,
                     "micro-batch 12, bf16, compile: not nanoGPT's own train.py (see --nanogpt)")
            else:
                self.nanogpt_pairs(nanogpt, nanogpt_repeats, base, step)
        if "levers" in parts:
            self.levers(base, base_row, step)
        measured = self.ladder("ladder" in parts, step)
        candidates = measured + self.headline_and_levers(base)
        if not candidates and BEST_ROW_PARTS & set(parts):
            asked = ", ".join(p for p in PARTS if p in BEST_ROW_PARTS & set(parts))
            raise click.UsageError(f"{asked} start(s) from the fastest row, and no ladder or headline row is measured: "
                                   "run --part ladder or --part best first (with the same --json, or --carried with "
                                   "its JSON)")
        best = max(candidates, key=lambda m: m[0]["tokens_per_s"])[1] if candidates else {}  # the fastest
        for part in ("long", "peers", "fit", "profile"):
            if part in parts:
                step(part, getattr(self, part), best)
        if "tests" in parts:
            step("tests (the rest)", self.tests, "tests", f"not {FIRST_TESTS}")
        return left


@click.command()
@click.option("--smoke", is_flag=True, help="tiny model, a few steps, no compile, no CUDA tests: checks the script")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
              help="rows go here as they are measured; rows already in it are kept and skipped")
@click.option("--tokens", default=None, help="token folder (default: data/tokens, else synthetic)")
@click.option("--part", "parts", multiple=True, type=click.Choice(PARTS),
              help="what to run (repeatable; default: all): tests (the compiled one first, the rest last), best (every "
                   "switch at once), nanogpt (our code at nanoGPT's settings; with --nanogpt, against nanoGPT's own "
                   "train.py), levers (each on top of best), ladder (one switch per rung), and long (GPT-2 batch, "
                   "evals, checkpoints), peers (DDP, Muon), fit (micro-batch auto, FSDP), profile, which start from "
                   "the fastest row")
@click.option("--nanogpt", "nanogpt", default=None, type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="a checkout of karpathy/nanoGPT: the nanogpt part runs its train.py beside ours, alternating")
@click.option("--nanogpt-repeats", default=2, show_default=True, type=click.IntRange(min=1),
              help="runs of each side in the nanogpt part")
@click.option("--timeout-s", default=None, type=float,
              help="a child running longer is stopped and its row says 'timed out'; the next job measures it again "
                   "with this limit or twice its old one, whichever is more (default: 300 on a GPU, which a cold "
                   "compiled GPT-2 124M row fits)")
@click.option("--budget-s", default=None, type=float,
              help="this job's time (set it from what is left of the command's and the device's time): no child "
                   "starts unless what it is expected to cost fits; the next job continues")
@click.option("--carried", default=None, type=click.Path(file_okay=False, path_type=Path),
              help="a folder with the files earlier jobs returned (the JSON, its logs): copied beside --json first")
@click.option("--skip-tests", is_flag=True, help="same as leaving out --part tests")
def main(smoke: bool, json_path: str | None, tokens: str | None, parts: tuple[str, ...], nanogpt: Path | None,
         nanogpt_repeats: int, timeout_s: float | None, budget_s: float | None, carried: Path | None,
         skip_tests: bool) -> None:
    import torch

    budget = Budget(budget_s, None)
    if carried is not None and json_path is not None and carried.is_dir():
        brought = bring_carried(carried, Path(json_path))
        print(f"gpu_check: carried from {carried}: {', '.join(brought) or 'nothing new'}", file=sys.stderr)
    gpu = torch.cuda.is_available()
    if not gpu and not smoke:
        raise click.UsageError("no CUDA device here; run with --smoke to check the script on this machine")
    parts = tuple(parts) or PARTS
    if nanogpt is not None:
        try:
            nanogpt_peer.check_checkout(nanogpt)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--nanogpt") from None
    if skip_tests or smoke or not gpu:
        parts = tuple(p for p in parts if p != "tests")
    if timeout_s is not None:
        budget.timeout_s = timeout_s
    elif gpu and not smoke:
        budget.timeout_s, budget.stretch = 300.0, True
    prof = profile(smoke)
    report = Report(Path(json_path) if json_path else None,
                    {"device": torch.cuda.get_device_name() if gpu else platform.machine(),
                     "torch": str(torch.__version__), "smoke": smoke, "date": time.strftime("%Y-%m-%d")})
    probe = machine_probe() if gpu and not smoke else {"uuid": None, "name": platform.machine()}
    report.data["machines"][str(probe["uuid"])] = probe
    report.save()
    print(f"gpu_check: this card: {json.dumps(probe)}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        token_dir = tokens or (str(ROOT / "data/tokens") if (ROOT / "data/tokens/meta.json").exists()
                               else str(synthetic_tokens(Path(tmp) / "tokens", 5_000_000 if not smoke else 200_000)))
        check = Check(report, prof, gpu, smoke, token_dir, tmp, budget, probe["uuid"])
        left = check.run(parts, nanogpt, nanogpt_repeats)
        if left:
            print(f"gpu_check: --budget-s {budget_s:g} left {', '.join(left)} to the next job: run the same command "
                  "again, carrying what this job returned, to continue", file=sys.stderr)
    report.data["seconds"] = round(report.data.get("seconds", 0.0) + budget.spent(), 1)
    report.save()
    print(f"\nDevice: {report.data['device']}, torch {report.data['torch']}, {report.data['date']}; "
          f"{'smoke mode (tiny)' if smoke else 'GPT-2 124M, T=1024'}; {prof['steps']} steps per run "
          f"(the first {prof['warmup']} untimed); {report.data['seconds']:.0f} s in all.\n")
    model = shape(prof["model"]["size"]) if not smoke else None
    print(table(report.data["rows"], report.data["machines"],
                llmc_share(model.params_without_wpe, model.n_layer, model.n_embd, prof["seq"]) if model else None))


if __name__ == "__main__":
    main()
