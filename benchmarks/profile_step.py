"""Where a training step's time goes: torch.profiler over a few steps after the warm-up.

    python3 benchmarks/profile_step.py --set model.size=gpt2 --set train.micro_batch_size=64 \\
        --set train.compile=true --json $OUT/profile.json             # GPT-2 124M on a GPU
    python benchmarks/profile_step.py                                 # params defaults (tiny on a CPU)

Builds the run as the trainer does (``trainer.build``), runs ``timing_warmup_steps`` steps
(compilation, autotuning), then profiles ``--steps`` steps, the device synchronized at both ends.
Prints the operations and kernels that take the most time on the device (self time: a kernel's
own, not its callers'), and that time by kind (matmuls, attention, Inductor's fused kernels, the
optimizer, copies, the rest): the table that says which cost is left to cut. On CUDA only the
kernels' own rows count: the CPU-side operators and Inductor's launch records that started them
carry the same time again. The profile's total is held against the measured step time (the
steps' wall clock, synchronized): a total far from it means the table misses or repeats time, and
the report says so. Needs only torch, numpy, click and pyyaml; uses data/tokens when present,
else synthetic tokens.
"""

from __future__ import annotations

import json
import re
import sys
import time
import tempfile
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from train_switches import merge, parse_overrides, synthetic_tokens  # noqa: E402

# The first pattern that matches a kernel's (or, on a CPU, an operator's) name gives its kind.
KINDS = [
    ("attention", r"flash|fmha|attention|sdpa|cudnn"),
    ("optimizer", r"adam|foreach|multi_tensor|muon"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|\bmm\b|aten::mm|aten::addmm|aten::bmm|aten::matmul|aten::linear"
               r"|mkldnn::_linear_pointwise"),
    ("fused (Inductor)", r"^triton_|cpp_fused|graph_\d+_cpp"),
    ("copy", r"memcpy|memset|copy_|_to_copy|aten::cat|aten::clone|contiguous"),
    ("elementwise (eager)", r"elementwise|vectorized|aten::(add|mul|div|sub|exp|fill|gelu|tanh|pow|where|sqrt|rsqrt)"),
]


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, lowered)), "other")


def profile_steps(params: Any, tokens: str | Path, steps: int) -> dict[str, Any]:
    """Warm up, then profile ``steps`` training steps; the top operations and the time by kind, in ms per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from gpt2.train.build import build
    from gpt2.train.optim import lr_at, set_lr
    from gpt2.train.step import backward_micro_batches, optimizer_step

    s = build(params, tokens)
    cfg = s.params.train
    batches = iter(s.sampler.next, None)
    cuda = s.runtime.device.type == "cuda"

    def step(i: int) -> None:
        set_lr(s.optimizers, lr_at(i, cfg, s.total_steps))
        backward_micro_batches(s.step_model, batches, s.batch.accum, s.runtime, s.scaler)
        optimizer_step(s.model, s.optimizers, s.scaler, cfg.grad_clip)

    for i in range(max(cfg.timing_warmup_steps, 1)):
        step(i)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for i in range(steps):
            step(cfg.timing_warmup_steps + i)
        if cuda:
            torch.cuda.synchronize()
        step_ms = 1000 * (time.perf_counter() - started) / steps
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    if cuda:  # the kernels' own rows: an operator's row repeats the time of the kernels it launched
        from torch.autograd import DeviceType

        events = [e for e in events if e.device_type == DeviceType.CUDA]

    def self_us(e: Any) -> float:
        if cuda:
            return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
        return e.self_cpu_time_total

    timed = sorted(((e.key, self_us(e) / 1000 / steps, e.count // steps) for e in events if self_us(e) > 0),
                   key=lambda t: -t[1])
    total = sum(ms for _, ms, _ in timed)
    by_kind: dict[str, float] = {}
    for name, ms, _ in timed:
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + ms
    return {"device": s.runtime.device_name, "torch": str(torch.__version__), "steps": steps,
            "tokens_per_step": s.tokens_per_step, "total_ms": total, "step_ms": step_ms,
            "coverage": total / step_ms if step_ms else None,
            "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "top": [{"name": name, "ms": ms, "calls": calls} for name, ms, calls in timed[:25]]}


def report(result: dict[str, Any]) -> str:
    total = result["total_ms"] or 1.0
    coverage = result.get("coverage") or 0.0
    check = ("" if 0.85 <= coverage <= 1.15 else
             f" **The profile's total is {100 * coverage:.0f}% of the step: the table "
             + ("misses time (idle device: launch-bound, or host work)" if coverage < 0.85 else "counts time twice")
             + "; read its shares with care.**")
    lines = [f"Device: {result['device']}, torch {result['torch']}; {result['steps']} profiled steps of "
             f"{result['tokens_per_step']:,} tokens; {result['total_ms']:.1f} ms of device time per step, against "
             f"{result['step_ms']:.1f} ms measured ({100 * coverage:.0f}%).{check}", "",
             "| kind | ms/step | share |", "|---|---|---|"]
    lines += [f"| {kind} | {ms:.2f} | {100 * ms / total:.1f}% |" for kind, ms in result["by_kind"].items()]
    lines += ["", "| operation or kernel (self time) | kind | ms/step | calls/step |", "|---|---|---|---|"]
    lines += [f"| `{t['name'][:90]}` | {kind_of(t['name'])} | {t['ms']:.3f} | {t['calls']} |" for t in result["top"]]
    return "\n".join(lines) + "\n"


@click.command()
@click.option("--set", "sets", multiple=True, help="override, e.g. train.micro_batch_size=16 (repeatable)")
@click.option("--steps", default=3, show_default=True, help="profiled steps (after the warm-up)")
@click.option("--tokens", default=None, help="token folder (default: data/tokens, else synthetic)")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="write the figures here")
def main(sets: tuple[str, ...], steps: int, tokens: str | None, json_path: str | None) -> None:
    from gpt2.core.config import Params, build

    tree = merge({"train": {"mlflow": False, "resume": "never", "save_checkpoint": False}},
                 parse_overrides(list(sets)))
    params = build(Params, tree, "")
    with tempfile.TemporaryDirectory() as tmp:
        token_dir = tokens or (str(ROOT / "data/tokens") if (ROOT / "data/tokens/meta.json").exists()
                               else str(synthetic_tokens(Path(tmp) / "tokens")))
        result = profile_steps(params, token_dir, steps)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    print(report(result))


if __name__ == "__main__":
    from gpt2.core.entry import run

    run(main)  # a child ends once its result is out: no seconds of module teardown per row
