"""The training loop: AMP, compile, accumulation, clipping, checkpoints and honest timing.

Timing: a step's time is the time its work really took on the device (data loading and host
stalls included): CUDA events at each step's start, read at sync points (log, eval, checkpoint
steps), so the GPU is never drained just to look at a clock (train/timing.py); elsewhere the
device is synchronized before each clock read. The first ``timing_warmup_steps`` steps
(compilation, autotuning) are left out of the summaries, which are medians.

Between sync points the loop reads nothing from the GPU: losses stay on the device and are
checked (NaN, mean over ranks, a stop signal) together at the next sync point.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpt2.core.atomic import atomic_dir, write_json
from gpt2.core.config import Params, to_dict
from gpt2.core.errors import UserError
from gpt2.core.progress import clock
from gpt2.core.tokens import read_meta
from gpt2.model.gpt import GPT, GPTConfig, gpt_config
from gpt2.model.sizes import SIZES
from gpt2.train import checkpoint, distributed
from gpt2.train.curves import render_curves
from gpt2.train.device import Runtime, resolve, sdpa_backend
from gpt2.train.distributed import Dist
from gpt2.train.flops import flops_per_token, peak_flops
from gpt2.train.loader import BatchSampler, TokenSplit
from gpt2.train.optim import build_optimizers, lr_at, set_lr
from gpt2.train.timing import StepTimer
from gpt2.train.tracking import MlflowTracker, Tracker, flatten, git_commit

TRAIN_COLUMNS = ("step", "loss", "lr", "grad_norm", "step_ms", "tokens_per_s", "mfu", "mem_gb")
VAL_COLUMNS = ("step", "val_loss")


class TrainingInterrupted(UserError):
    """SIGINT/SIGTERM: the step finished, a checkpoint was saved, the run can be resumed."""


class Diverged(UserError):
    """The loss became NaN or infinite."""


@dataclass
class History:
    """Logged rows (for the DVC plot files) and every step time (for the summaries)."""

    train: list[dict[str, float]] = field(default_factory=list)
    val: list[dict[str, float]] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    fp16_skipped: int = 0
    elapsed_s: float = 0.0  # wall time of the run up to its last checkpoint (earlier sessions of a resumed run)
    target: dict[str, float] | None = None  # when val loss first reached train.target_val_loss


@dataclass
class Setup:
    """Everything the loop needs, built once from params."""

    params: Params
    runtime: Runtime
    model_cfg: GPTConfig
    model: GPT
    step_model: torch.nn.Module  # what trains: DDP around the compiled model, or either alone
    eval_model: torch.nn.Module  # the compiled model or the model itself: no DDP, no collectives
    dist: Dist
    optimizers: list[torch.optim.Optimizer]  # AdamW; or Muon (hidden matrices) and AdamW (the rest)
    scaler: torch.amp.GradScaler
    sampler: BatchSampler
    train_data: TokenSplit
    val_data: TokenSplit
    seq_len: int
    tokens_per_step: int  # of the whole job: micro-batch × seq_len × accumulation × world size
    total_steps: int
    flops_per_token: float
    peak_flops: float | None
    meta: dict[str, Any]
    init: dict[str, str] = field(default_factory=dict)  # where the weights came from (train.init_from)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build(params: Params, tokens_dir: str | Path) -> Setup:
    cfg = params.train
    runtime = resolve(cfg)
    dist_info, device = distributed.init(cfg, runtime.device)
    runtime = dataclasses.replace(runtime, device=device)
    meta = read_meta(tokens_dir)
    seed_everything(cfg.seed)
    overrides = {k: v for k, v in to_dict(params.model).items() if k != "size"}
    model_cfg = gpt_config(params.model.size, overrides, meta["vocab_size"], cfg.pad_vocab, cfg.attention)
    seq_len = cfg.block_size or model_cfg.block_size
    if seq_len > model_cfg.block_size:
        raise UserError(f"train.block_size {seq_len} exceeds the model's block_size {model_cfg.block_size}; "
                        "lower train.block_size or raise model.block_size")
    model = GPT(model_cfg)  # the same seed on every rank: the same initial weights
    init = load_pretrained(model, cfg.init_from, params) if cfg.init_from != "scratch" else {}
    model = model.to(runtime.device)
    model.loss_chunk = cfg.loss_chunk
    if dist_info.world > 1:
        torch.manual_seed(cfg.seed + dist_info.rank)  # each rank its own dropout masks
    optimizers = build_optimizers(model, cfg)
    scaler = torch.amp.GradScaler(runtime.device.type, enabled=runtime.dtype == "fp16")
    shared = dist_info.world > 1  # ranks on one machine share the page cache's copy of the tokens
    train_data = TokenSplit(tokens_dir, "train", cfg.data_loading, meta, shared)
    val_data = TokenSplit(tokens_dir, "val", cfg.data_loading, meta, shared)
    sampler = BatchSampler(train_data, cfg.micro_batch_size, seq_len, cfg.seed, cfg.batching, runtime.device,
                           dist_info.rank, dist_info.world)
    BatchSampler(val_data, cfg.micro_batch_size, seq_len, cfg.seed, cfg.batching, runtime.device)  # length check
    tokens_per_step = cfg.micro_batch_size * seq_len * cfg.grad_accum_steps * dist_info.world
    total = cfg.max_steps or math.ceil(cfg.max_tokens / tokens_per_step)
    eval_model = model
    if cfg.compile:
        eval_model = torch.compile(model, mode=None if cfg.compile_mode == "default" else cfg.compile_mode)
    step_model = eval_model
    if dist_info.ddp:
        from torch.nn.parallel import DistributedDataParallel

        step_model = DistributedDataParallel(eval_model, device_ids=[device.index] if device.type == "cuda" else None,
                                             gradient_as_bucket_view=True,  # grads live in the buckets: no copy
                                             broadcast_buffers=False)  # the only buffer, the logit mask, is constant
    return Setup(
        params=params, runtime=runtime, model_cfg=model_cfg, model=model, step_model=step_model,
        eval_model=eval_model, dist=dist_info,
        optimizers=optimizers, scaler=scaler, sampler=sampler, train_data=train_data, val_data=val_data,
        seq_len=seq_len, tokens_per_step=tokens_per_step, total_steps=total,
        flops_per_token=flops_per_token(model_cfg, model.num_params(exclude_position_embedding=True), seq_len),
        peak_flops=peak_flops(runtime.device_name, runtime.dtype, runtime.tf32, cfg.peak_tflops), meta=meta,
        init=init,
    )


def load_pretrained(model: GPT, source: str, params: Params) -> dict[str, str]:
    """Start ``model`` from pretrained GPT-2 weights; the model section must describe them."""
    from gpt2.model import hf

    weights = hf.locate(source)
    state, config = hf.read_pretrained(weights)
    have = hf.dims_from_state(state)
    if config is not None:
        have["n_head"] = hf.config_dims(config)["n_head"]
    want = {k: getattr(model.cfg, k) for k in have}
    if have != want:
        diffs = ", ".join(f"{k} {have[k]} (model section: {want[k]})" for k in have if have[k] != want[k])
        named = next((size for size, dims in SIZES.items() if all(dims.get(k) == have.get(k) for k in dims)), None)
        fix = f"set model.size: {named} and no overrides" if named else "set the model overrides to these dimensions"
        raise UserError(f"train.init_from {source}: the weights have {diffs}, which the model section "
                        f"(model.size {params.model.size}) contradicts; {fix}")
    model.load_state_dict(hf.from_hf(state, model.cfg))
    return {"init_from": source, "init_file": str(weights), "init_sha256": hf.sha256(weights)}


def run_name(s: Setup) -> str:
    """What a run outside ``dvc exp`` is called in MLflow: what it trained, how, and when."""
    cfg = s.params.train
    switches = [s.runtime.dtype, cfg.attention] + ["compile"] * cfg.compile
    if s.dist.world > 1:
        switches.append(f"ddp×{s.dist.world}")
    return f"{s.params.model.size} {s.total_steps} steps {' '.join(switches)} {time.strftime('%m-%d %H:%M')}"


def inert_switch_warnings(s: Setup) -> list[str]:
    cfg, device = s.params.train, s.runtime.device.type
    warnings = list(s.runtime.warnings)
    if cfg.attention == "manual" and cfg.sdpa_backend != "auto":
        warnings.append(f"train.sdpa_backend {cfg.sdpa_backend} is inert: train.attention is manual (no SDPA)")
    if not cfg.compile and cfg.compile_mode != "default":
        warnings.append(f"train.compile_mode {cfg.compile_mode} is inert: train.compile is false")
    if cfg.compile and device != "cuda" and cfg.compile_mode in ("reduce-overhead",):
        warnings.append("train.compile_mode reduce-overhead uses CUDA graphs: inert on this device")
    if device != "cuda" and cfg.batching == "vectorized":
        warnings.append("pinned memory and non_blocking copies (part of batching: vectorized) are inert off CUDA")
    if s.peak_flops is None:
        warnings.append(f"no peak FLOP/s known for {s.runtime.device_name!r} in {s.runtime.dtype}: MFU is not "
                        "reported; set train.peak_tflops to get it")
    return warnings


def backward_micro_batches(model: torch.nn.Module, batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
                           steps: int, runtime: Runtime, scaler: torch.amp.GradScaler) -> torch.Tensor:
    """Forward and backward ``steps`` micro-batches; each loss is divided by ``steps``, so the
    accumulated gradient equals the gradient of one batch ``steps`` times larger. Returns the mean loss.

    Under DDP the gradients are all-reduced once per step: every micro-batch but the last runs
    in ``no_sync``."""
    total = torch.zeros((), device=runtime.device)
    for i in range(steps):
        x, y = next(batches)
        last = i == steps - 1
        with nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
            with runtime.autocast(), runtime.attention():
                _, loss = model(x, y)
            loss = loss / steps
            total += loss.detach()
            scaler.scale(loss).backward()
    return total


def optimizer_step(s: Setup) -> tuple[torch.Tensor, bool]:
    """Unscale, measure (and clip) the gradient norm, step. Returns (grad norm, still on the device;
    skipped by GradScaler, which reads the device: fp16 only)."""
    cfg = s.params.train
    for optimizer in s.optimizers:
        s.scaler.unscale_(optimizer)
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(s.model.parameters(), max_norm)
    scale = s.scaler.get_scale() if s.scaler.is_enabled() else None
    for optimizer in s.optimizers:
        s.scaler.step(optimizer)
    s.scaler.update()
    for optimizer in s.optimizers:
        optimizer.zero_grad(set_to_none=True)
    skipped = scale is not None and s.scaler.get_scale() < scale
    return norm, skipped


@torch.no_grad()
def estimate_loss(s: Setup, split: TokenSplit) -> float:
    """Mean loss over ``eval_iters`` batches drawn with ``eval_seed``: the same windows at every eval and
    in every run whatever its ``seed``, so two runs' val losses (and times to a target) differ by the
    models, not by the text they were scored on (under DDP each rank scores its slice of the global
    batch, as in training)."""
    cfg = s.params.train
    sampler = BatchSampler(split, cfg.micro_batch_size, s.seq_len, cfg.eval_seed, cfg.batching, s.runtime.device,
                           s.dist.rank, s.dist.world)
    s.eval_model.eval()
    total = torch.zeros((), device=s.runtime.device)
    for _ in range(cfg.eval_iters):
        x, y = sampler.next()
        with s.runtime.autocast(), s.runtime.attention():
            _, loss = s.eval_model(x, y)
        total += loss.float()
    s.eval_model.train()
    return float(distributed.mean(total, s.dist)) / cfg.eval_iters


def memory_gb(runtime: Runtime) -> dict[str, float]:
    if runtime.device.type == "cuda":
        return {"mem/allocated_gb": torch.cuda.memory_allocated(runtime.device) / 1e9,
                "mem/peak_gb": torch.cuda.max_memory_allocated(runtime.device) / 1e9}
    return {"mem/rss_gb": rss_bytes() / 1e9}


def rss_bytes() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:  # minimal environments: Linux's /proc
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def stop_on_signals() -> Iterator[dict[str, int | None]]:
    """The first SIGINT/SIGTERM asks the loop to stop after the current step; a second SIGINT aborts."""
    flag: dict[str, int | None] = {"signal": None}

    def handler(signum: int, frame: Any) -> None:
        if flag["signal"] is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        flag["signal"] = signum
        print(f"\n{signal.Signals(signum).name}: finishing the current step, then saving a checkpoint "
              "(Ctrl-C again to abort without saving)", file=sys.stderr)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def checkpoint_state(s: Setup, step: int, history: History, run_id: str | None,
                     rngs: list[Any], metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "metrics": metrics,  # set once the run is finished: its reports can be rebuilt without training
        "model": checkpoint.clean_state_dict(s.model.state_dict()),
        "optimizer": [optimizer.state_dict() for optimizer in s.optimizers],
        "scaler": s.scaler.state_dict(),
        "step": step,
        "total_steps": s.total_steps,
        "rng": rngs[0],
        "rng_per_rank": rngs,  # restored rank by rank when the world size matches
        "world_size": s.dist.world,
        "sampler": s.sampler.state(),
        "model_config": dataclasses.asdict(s.model_cfg),
        "params": {"model": to_dict(s.params.model), "train": to_dict(s.params.train)},
        "data": {"manifest_sha256": s.meta.get("manifest_sha256"), "tokens": s.meta["splits"]["train"]["tokens"]},
        "history": dataclasses.asdict(history),
        "mlflow_run_id": run_id,
    }


# Model fields that do not change the weights' shapes or meaning: a checkpoint may resume across them.
_RESUMABLE_MODEL_FIELDS = {"attention", "dropout"}


def load_for_resume(path: Path, s: Setup) -> dict[str, Any] | None:
    """The checkpoint to continue from, None for a fresh start, or a refusal (UserError)."""
    if s.params.train.resume == "never" or not path.exists():
        return None
    state = checkpoint.load(path)
    if state["step"] >= state["total_steps"] or state.get("metrics") is not None:  # or it stopped at its target
        if not same_run(state, s):
            why = "of other params or data"
        elif state.get("metrics") is None:
            why = "written before checkpoints kept their summary"
        else:
            return state  # finished with these params and data: its reports are rebuilt, nothing retrains
        if s.dist.main:
            print(f"train: {path} is a finished run ({state['step']} steps) {why}; starting a new run",
                  file=sys.stderr)
        return None
    old, new = state["model_config"], dataclasses.asdict(s.model_cfg)
    diffs = [f"{k} {old.get(k)} → {v}" for k, v in new.items() if k not in _RESUMABLE_MODEL_FIELDS and old.get(k) != v]
    new_data = {"manifest_sha256": s.meta.get("manifest_sha256"), "tokens": s.meta["splits"]["train"]["tokens"]}
    if state["data"] != new_data:
        diffs.append("training data (data/tokens changed)")
    if diffs:
        raise UserError(f"{path} holds an unfinished run (step {state['step']}/{state['total_steps']}) of another "
                        f"model or data: {', '.join(diffs)}; restore those params to resume it, or set "
                        f"train.resume: never (or delete {path}) to start over")
    changed = {k: (v, getattr(s.params.train, k)) for k, v in state["params"]["train"].items()
               if k in {f.name for f in dataclasses.fields(s.params.train)}
               and _normal(v) != _normal(getattr(s.params.train, k))}
    for key, (was, now) in changed.items() if s.dist.main else ():
        print(f"train: resuming with train.{key} changed: {was} → {now}", file=sys.stderr)
    return state


# Train fields that change neither the weights nor the measured figures: a finished run is reused across them.
_REUSABLE_TRAIN_FIELDS = {"mlflow", "experiment", "resume", "dist_timeout_s", "dist_first_step_timeout_s",
                          "async_checkpoint"}


def same_run(state: dict[str, Any], s: Setup) -> bool:
    """Whether a checkpoint was trained with exactly these model and train params, on this data."""
    train = {k: _normal(v) for k, v in to_dict(s.params.train).items() if k not in _REUSABLE_TRAIN_FIELDS}
    saved = {k: _normal(v) for k, v in state["params"]["train"].items() if k not in _REUSABLE_TRAIN_FIELDS}
    return (state["params"]["model"] == to_dict(s.params.model) and saved == train
            and state["data"] == {"manifest_sha256": s.meta.get("manifest_sha256"),
                                  "tokens": s.meta["splits"]["train"]["tokens"]})


def _normal(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def restore(s: Setup, state: dict[str, Any]) -> tuple[int, History, str | None]:
    s.model.load_state_dict(state["model"])
    saved = state["optimizer"]
    for optimizer, optimizer_state in zip(s.optimizers, saved if isinstance(saved, list) else [saved], strict=True):
        optimizer.load_state_dict(optimizer_state)
    s.scaler.load_state_dict(state["scaler"])
    s.sampler.load_state(state["sampler"])  # the global-batch stream: the same on every rank
    if state.get("world_size", 1) == s.dist.world:
        checkpoint.restore_rng_states(state.get("rng_per_rank", [state["rng"]])[s.dist.rank])
    elif s.dist.main:
        print(f"train: the checkpoint was written by {state.get('world_size', 1)} process(es), this run has "
              f"{s.dist.world}: weights, optimizer, step and data stream continue; dropout RNG starts afresh",
              file=sys.stderr)
    return state["step"], History(**state["history"]), state["mlflow_run_id"]


def warmup_s(history: History, steps: int) -> float:
    """Seconds spent in the untimed first steps: compilation and autotuning, mostly."""
    return round(sum(history.step_s[:steps]), 3)


def summarize(s: Setup, history: History, step: int, wall_s: float, first_step: int = 0) -> dict[str, Any]:
    """The run's figures. ``tokens_per_s`` is the median step's; ``tokens_per_s_wall`` divides the
    tokens of this session (steps ``first_step``..``step``) by its whole wall time: model build,
    compilation, evals and checkpoints included."""
    cfg = s.params.train
    timed = history.step_s[cfg.timing_warmup_steps:] or history.step_s
    step_s = statistics.median(timed)
    tokens_per_s = s.tokens_per_step / step_s
    last_train = history.train[-1] if history.train else {}
    last_val = history.val[-1]["val_loss"] if history.val else None
    mem = memory_gb(s.runtime)
    return {
        "train": {"loss": last_train.get("loss")},
        "val": {"loss": last_val, "ppl": math.exp(last_val) if last_val is not None else None},
        "perf": {
            "step_ms": round(1000 * step_s, 3),
            "tokens_per_s": round(tokens_per_s, 1),
            "tokens_per_s_wall": round((step - first_step) * s.tokens_per_step / wall_s, 1) if wall_s > 0 else None,
            "tokens_per_s_per_device": round(tokens_per_s / s.dist.world, 1),
            "mfu": round(s.flops_per_token * tokens_per_s / (s.peak_flops * s.dist.world), 5) if s.peak_flops else None,
            "timed_steps": len(timed),
            "warmup_s": warmup_s(history, cfg.timing_warmup_steps),
            "world_size": s.dist.world,
        },
        "mem": {"peak_gb": round(mem.get("mem/peak_gb", mem.get("mem/rss_gb", 0.0)), 4)},
        **({"target": target_figures(cfg.target_val_loss, history.target)} if cfg.target_val_loss is not None else {}),
        "steps": step,
        "tokens": step * s.tokens_per_step,
        "params": s.model.num_params(),
        "fp16_skipped_steps": history.fp16_skipped,
        "wall_s": round(wall_s, 2),
    }


def target_figures(target: float, reached: dict[str, float] | None) -> dict[str, Any]:
    """Time, tokens and steps to the target val loss; a target never reached has no numbers, only ``reached: false``."""
    figures = reached or {"time_s": None, "tokens": None, "steps": None}
    return {"val_loss": target, "reached": reached is not None, **figures}


# What metrics.json (DVC metrics: `dvc exp show`, `dvc metrics show`) keeps: the figures people compare.
# Everything else about the run (steps, tokens, world size, what really ran) goes to summary.json.
COMPARED = {"train": ("loss",), "val": ("loss", "ppl"), "perf": ("step_ms", "tokens_per_s", "tokens_per_s_wall", "mfu"),
            "mem": ("peak_gb",), "target": ("reached", "time_s", "tokens", "steps"), "wall_s": None}


def compared_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """The compared figures, rounded to what is worth reading (4 decimals of loss, 2 of perplexity)."""
    figures = {key: summary[key] if keys is None else {k: summary[key][k] for k in keys}
               for key, keys in COMPARED.items() if key in summary}
    return {key: {k: _round(v, 2 if k == "ppl" else 4) for k, v in value.items()} if isinstance(value, dict) else value
            for key, value in figures.items()}


def _round(value: Any, digits: int) -> Any:
    return round(value, digits) if isinstance(value, float) else value


def write_reports(report_dir: Path, summary: dict[str, Any], history: History) -> None:
    """metrics.json (compared figures), summary.json (the whole summary), plots/*.tsv and plots/curves.png."""
    report_dir.mkdir(parents=True, exist_ok=True)
    with atomic_dir(report_dir / "plots") as tmp:
        for name, columns, rows in (("train.tsv", TRAIN_COLUMNS, history.train), ("val.tsv", VAL_COLUMNS, history.val)):
            lines = ["\t".join(columns)] + ["\t".join(_fmt(row.get(c)) for c in columns) for row in rows]
            (tmp / name).write_text("\n".join(lines) + "\n")
        png = render_curves(history.train, history.val, f"{summary['params']:,} parameters, {summary['steps']} steps")
        if png is not None:
            (tmp / "curves.png").write_bytes(png)
    write_json(report_dir / "summary.json", summary)
    write_json(report_dir / "metrics.json", compared_figures(summary))


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def train(params: Params, tokens_dir: str | Path = "data/tokens", ckpt_path: str | Path = "checkpoints/ckpt.pt",
          report_dir: str | Path = "reports/train") -> dict[str, Any]:
    """Train (or resume) as params say; write the checkpoint and the reports; return the summary metrics.

    Under DDP every rank runs this; rank 0 alone logs, tracks and writes."""
    cfg = params.train
    ckpt_path, report_dir = Path(ckpt_path), Path(report_dir)
    started = time.perf_counter()  # wall-clock throughput counts building the model and loading the data too
    s = build(params, tokens_dir)
    try:
        with checkpoint.exclusive(ckpt_path) if s.dist.main else nullcontext():
            return _train(s, ckpt_path, report_dir, started)
    except (getattr(torch.distributed, "DistError", RuntimeError), RuntimeError) as exc:
        if s.dist.world > 1 and _is_collective_failure(exc):
            raise distributed.collective_error(exc, s.dist, cfg.dist_timeout_s) from None
        raise
    finally:
        distributed.shutdown(s.dist)


def _is_collective_failure(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, getattr(torch.distributed, "DistError", ())) or any(
        word in text for word in ("gloo", "nccl", "timed out", "timeout", "connection", "peer"))


def _train(s: Setup, ckpt_path: Path, report_dir: Path, started: float) -> dict[str, Any]:
    params, cfg, main = s.params, s.params.train, s.dist.main
    history, step, run_id = History(), 0, None
    state = load_for_resume(ckpt_path, s)
    if state is not None and state.get("metrics") is not None:
        if main:
            write_reports(report_dir, state["metrics"], History(**state["history"]))
            print(f"train: {ckpt_path} is a finished run of these params and data ({state['step']} steps); "
                  f"rebuilt {report_dir} from it instead of training again (train.resume: never retrains)",
                  file=sys.stderr)
        return state["metrics"]
    if state is not None:
        step, history, run_id = restore(s, state)
        if main:
            print(f"train: resuming {ckpt_path} at step {step}/{s.total_steps}", file=sys.stderr)
    del state
    backend = sdpa_backend(s.runtime, s.model_cfg.n_head, s.model_cfg.n_embd // s.model_cfg.n_head, s.seq_len)
    info = {
        "device": str(s.runtime.device), "device_name": s.runtime.device_name, "dtype": s.runtime.dtype,
        "tf32": s.runtime.tf32, "compile": cfg.compile, "attention": cfg.attention,
        "sdpa_backend": backend if cfg.attention == "flash" else "manual (no SDPA)",
        "keep_host_memory": s.runtime.keep_host_memory, "world_size": s.dist.world,
        "params": s.model.num_params(), "torch": str(torch.__version__), **s.init,
    }
    if main:
        print("train: " + ", ".join(f"{k}={v}" for k, v in info.items()), file=sys.stderr)
        for warning in inert_switch_warnings(s):
            print(f"warning: {warning}", file=sys.stderr)
    tracker: Tracker = (MlflowTracker(cfg.experiment, run_id, os.environ.get("DVC_EXP_NAME") or run_name(s))
                        if cfg.mlflow and main else Tracker())
    tracker.log_params(flatten({"model": to_dict(params.model), "train": to_dict(params.train)}))
    tracker.set_tags({"git_commit": git_commit(), "dvc_exp_name": os.environ.get("DVC_EXP_NAME"),
                      "device": s.runtime.device_name, "torch_version": torch.__version__, **info})
    status = "FAILED"
    try:
        if not cfg.save_checkpoint and main:
            ckpt_path.parent.mkdir(parents=True, exist_ok=True)  # the stage's DVC out exists, empty
        runtime = {k: v for k, v in info.items() if k != "params"}  # what really ran (the ladder reads it)
        metrics = _loop(s, step, history, ckpt_path, tracker, runtime, started)
        if main:
            write_reports(report_dir, metrics, history)
        tracker.log_metrics({"summary/" + k: v for k, v in flatten(compared_figures(metrics)).items()
                             if isinstance(v, int | float) and not isinstance(v, bool)}, step=metrics["steps"])
        tracker.log_artifact(report_dir / "summary.json")
        status = "FINISHED"
        return metrics
    except TrainingInterrupted:
        status = "KILLED"
        raise
    finally:
        tracker.end(status)


def _loop(s: Setup, step: int, history: History, ckpt_path: Path, tracker: Tracker,
          runtime: dict[str, Any], started: float) -> dict[str, Any]:
    saver = checkpoint.BackgroundSaver(s.params.train.async_checkpoint)
    try:
        return _steps(s, step, history, ckpt_path, tracker, runtime, started, step, saver)
    finally:
        saver.wait()  # the last checkpoint is on disk before the run reports, returns or stops


def _steps(s: Setup, step: int, history: History, ckpt_path: Path, tracker: Tracker, runtime: dict[str, Any],
           started: float, first_step: int, saver: checkpoint.BackgroundSaver) -> dict[str, Any]:
    cfg, d = s.params.train, s.dist
    batches = iter(s.sampler.next, None)
    summary = None

    def finished() -> dict[str, Any]:
        return {**summarize(s, history, step, time.perf_counter() - started, first_step), "runtime": runtime}

    earlier_s = history.elapsed_s  # wall time of the sessions before this one (a resumed run)

    def elapsed() -> float:
        return earlier_s + time.perf_counter() - started

    last_saved = step if ckpt_path.exists() else None
    timer, pending = StepTimer(s.runtime), []  # losses of the steps since the last sync point
    every_step = sync_every_step(s.runtime)
    s.step_model.train()
    with stop_on_signals() as stop:
        while step < s.total_steps:
            lr = lr_at(step, cfg, s.total_steps)
            set_lr(s.optimizers, lr / cfg.lr)
            timer.mark()
            pending.append(backward_micro_batches(s.step_model, batches, cfg.grad_accum_steps, s.runtime, s.scaler))
            norm, skipped = optimizer_step(s)
            history.fp16_skipped += skipped
            step += 1
            logging = step % cfg.log_interval == 0 or step == s.total_steps or step == 1
            if not (every_step or logging or step == cfg.timing_warmup_steps or step % cfg.eval_interval == 0
                    or step % cfg.checkpoint_interval == 0):
                continue  # no host sync: the GPU keeps working while the host queues the next step
            # a sync point, at the same steps on every rank: step times, losses, and whether to stop
            timer.mark()
            history.step_s.extend(timer.durations())
            losses, stopping = distributed.step_consensus(pending, stop["signal"] is not None, d)
            first = step - len(pending) + 1
            pending.clear()
            bad = next((i for i, value in enumerate(losses) if not math.isfinite(value)), None)
            if bad is not None:
                where = f"{ckpt_path} (step {last_saved})" if last_saved is not None else "none was saved yet"
                raise Diverged(f"loss is {losses[bad]} at step {first + bad}: training diverged; last good "
                               f"checkpoint: {where}; lower train.lr, set train.grad_clip, or use bf16 instead of fp16")
            if first == first_step + 1:
                distributed.set_step_deadline(cfg, d)  # the first sync point: compilation is done
            if step == cfg.timing_warmup_steps and d.main:
                tracker.log_metrics({"perf/warmup_s": warmup_s(history, cfg.timing_warmup_steps)}, step=step)
            if d.main and logging:
                _log_step(s, history, step, losses[-1], lr, float(norm), history.step_s[-1], tracker)
            if step % cfg.eval_interval == 0 or step == s.total_steps:
                val = estimate_loss(s, s.val_data)
                history.val.append({"step": step, "val_loss": val})
                tracker.log_metrics({"val/loss": val, "val/ppl": math.exp(min(val, 50))}, step=step)
                if d.main:
                    print(f"step {step}/{s.total_steps} | val loss {val:.4f}", file=sys.stderr)
                if cfg.target_val_loss is not None and history.target is None and val <= cfg.target_val_loss:
                    history.target = {"time_s": round(elapsed(), 3), "tokens": step * s.tokens_per_step, "steps": step}
                    tracker.log_metrics({f"target/{k}": v for k, v in history.target.items()}, step=step)
                    if d.main:
                        print(f"step {step}/{s.total_steps} | reached the target val loss {cfg.target_val_loss} in "
                              f"{history.target['time_s']:.1f} s, {history.target['tokens']:,} tokens"
                              + ("; stopping (train.stop_at_target)" if cfg.stop_at_target else ""), file=sys.stderr)
            at_target = history.target is not None and cfg.stop_at_target
            if step == s.total_steps or at_target:
                summary = finished()
            due = step % cfg.checkpoint_interval == 0 or step == s.total_steps or stopping or at_target
            if due and cfg.save_checkpoint:
                history.elapsed_s = elapsed()
                rngs = distributed.gather(checkpoint.rng_states(), d)  # every rank takes part
                if d.main:
                    saver.save(ckpt_path, checkpoint_state(s, step, history, tracker.run_id, rngs, summary))
                last_saved = step
            if stopping:
                saver.wait()  # "checkpoint saved" must be true when it is said
                signum = stop["signal"] or signal.SIGTERM  # a peer was signalled
                saved = (f"checkpoint saved to {ckpt_path}; run the stage again to resume (train.resume: auto)"
                         if cfg.save_checkpoint else "no checkpoint saved (train.save_checkpoint is false)")
                error = TrainingInterrupted(f"interrupted by {signal.Signals(signum).name} at step "
                                            f"{step}/{s.total_steps}; {saved}")
                error.exit_code = 128 + signum
                raise error
            if at_target:
                break
    return summary or finished()


def sync_every_step(runtime: Runtime) -> bool:
    """Off CUDA a sync costs nothing: check losses and signals after every step there."""
    return runtime.device.type != "cuda"


def _log_step(s: Setup, history: History, step: int, loss: float, lr: float, norm: float, dt: float,
              tracker: Tracker) -> None:
    tps = s.tokens_per_step / dt
    mfu = s.flops_per_token * tps / (s.peak_flops * s.dist.world) if s.peak_flops else None
    # warm-up steps (compilation, autotuning) stay out of the speed series: one 30 s step would flatten
    # every plot of step time; their total is its own figure, perf/warmup_s
    timed = step > s.params.train.timing_warmup_steps
    perf = {"perf/step_ms": 1000 * dt, "perf/tokens_per_s": tps, "perf/tokens_per_s_per_device": tps / s.dist.world,
            "perf/mfu": mfu} if timed else {}
    row = {"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "step_ms": perf.get("perf/step_ms"),
           "tokens_per_s": perf.get("perf/tokens_per_s"), "mfu": perf.get("perf/mfu")}
    mem = memory_gb(s.runtime)
    row["mem_gb"] = mem.get("mem/allocated_gb", mem.get("mem/rss_gb"))
    history.train.append(row)
    if s.scaler.is_enabled():  # fp16: steps GradScaler skipped after an overflow (always 0 otherwise: not logged)
        perf["perf/fp16_skipped_steps"] = history.fp16_skipped
    tracker.log_metrics({"train/loss": loss, "train/lr": lr, "train/grad_norm": norm, **perf, **mem}, step=step)
    eta = (s.total_steps - step) * statistics.median(history.step_s[-20:])
    shown = f" | MFU {100 * mfu:.1f}%" if mfu is not None else ""
    print(f"step {step}/{s.total_steps} | loss {loss:.4f} | lr {lr:.2e} | norm {norm:.2f} | {1000 * dt:.0f} ms | "
          f"{tps / 1000:.1f}K tok/s{shown} | ETA {clock(eta)}", file=sys.stderr)
