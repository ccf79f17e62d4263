"""Everything the training loop needs, built once from params: device, model, optimizers, data."""

from __future__ import annotations

import dataclasses
import inspect
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpt2.core import log
from gpt2.core.config import Params, to_dict
from gpt2.core.digest import sha256_file
from gpt2.core.errors import UserError
from gpt2.core.sizes import SIZES, sequence_length
from gpt2.core.tokens import read_meta
from gpt2.model.gpt import GPT, GPTConfig, gpt_config
from gpt2.model import fp8, onednn
from gpt2.model.loss import chunk_rows, liger_loss
from gpt2.run.compiled import CompileWatch, compile_options
from gpt2.run.device import Runtime, resolve
from gpt2.run.flops import Throughput, dtype_peak_flops, flops_per_token, yardstick_flops
from gpt2.run.peak import cache_path, cpu_peaks
from gpt2.train import distributed, sharded
from gpt2.train.batch import Batch, Recipe, model_shape, resolve_batch
from gpt2.train.distributed import Dist
from gpt2.train.loader import BatchSampler, TokenSplit
from gpt2.train.optim import build_optimizers

logger = log.get("train")


@dataclass
class Setup:
    """Everything the loop needs, built once from params."""

    params: Params
    runtime: Runtime
    model_cfg: GPTConfig
    model: GPT
    step_model: torch.nn.Module  # what trains: DDP around the compiled model, or either alone
    eval_model: torch.nn.Module  # the compiled model or the model itself: no DDP (FSDP's gathers stay)
    dist: Dist
    optimizers: list[torch.optim.Optimizer]  # AdamW; or Muon (hidden matrices) and AdamW (the rest)
    scaler: torch.amp.GradScaler
    batch: Batch  # the micro-batch and the accumulation, as resolved for this device
    recipe: Recipe  # what the memory model knows of this run (for auto, and an out-of-memory error)
    sampler: BatchSampler
    train_data: TokenSplit
    val_data: TokenSplit
    seq_len: int
    tokens_per_step: int  # of the whole job: micro-batch × seq_len × accumulation × world size
    total_steps: int | None  # None: the run ends when train.time_budget_s is spent (train/length.py)
    throughput: Throughput  # tokens/s and MFU, from the step time
    mfu_against: str  # where MFU's peaks come from
    meta: dict[str, Any]
    tokens_dir: Path
    compile_watch: CompileWatch  # graph breaks and recompilations of this run
    init: dict[str, str] = field(default_factory=dict)  # where the weights came from (train.init_from)
    fp8_layers: list[str] = field(default_factory=list)  # the linear layers whose matmuls run in FP8 (train.fp8)

    @property
    def data_identity(self) -> dict[str, Any]:
        """What a checkpoint records of the training data, to refuse resuming on other tokens."""
        return {"manifest_sha256": self.meta.get("manifest_sha256"), "tokens": self.meta["splits"]["train"]["tokens"]}


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
    model = params.model
    overrides = {k: v for k, v in to_dict(model).items() if k not in ("size", "attention", "pad_vocab")}
    model_cfg = gpt_config(model.size, overrides, meta["vocab_size"], model.pad_vocab, model.attention)
    seq_len = sequence_length(model.size, model.block_size, cfg.block_size)
    if seq_len > model_cfg.block_size:
        raise UserError(f"train.block_size {seq_len} exceeds the model's block_size {model_cfg.block_size}; "
                        "lower train.block_size or raise model.block_size")
    loss_chunk = chunk_rows(cfg.loss_chunk, runtime.device.type, model_cfg.padded_vocab_size)
    residual = torch.bfloat16 if cfg.residual_stream == "bf16" and runtime.dtype == "bf16" else None
    model = GPT(model_cfg, loss_chunk=loss_chunk, residual_dtype=residual)  # one seed on every rank: the same weights
    init = load_pretrained(model, cfg.init_from, params) if cfg.init_from != "scratch" else {}
    amp = runtime.dtype in ("bf16", "fp16")
    if dist_info.sharded and runtime.dtype == "fp16":
        raise UserError("train.distributed fsdp with fp16: GradScaler's overflow check would differ per shard; "
                        "set train.dtype bf16 (Ampere or newer) or fp32, or use ddp")
    recipe = Recipe(model_shape(model), seq_len, amp, model_cfg.attention == "flash", loss_chunk, cfg.optimizer,
                    dist_info.world if dist_info.sharded else 1, cfg.fp8_head)
    batch = resolve_batch(cfg, recipe, dist_info.world, runtime.device)  # before the model takes device memory
    fp8_layers = fp8.convert(model, cfg.fp8, runtime.device, runtime.dtype)  # before FSDP shards the layers it swaps
    onednn.use(model, cfg.cpu_gemm, runtime.device.type)  # before FSDP shards the layers it swaps
    if dist_info.sharded:
        sharded.shard(model, runtime.device, torch.bfloat16 if runtime.dtype == "bf16" else None)
    model = model.to(runtime.device)  # under FSDP: the unsharded buffer (the logit mask)
    if cfg.loss_kernel == "liger":
        model.fused_loss = liger_loss(runtime.device)
    if cfg.fp8_head:
        fp8.require_fp8_device(runtime.device, "train.fp8_head", "train.fp8_head: false")
        fp8.head_fp8_check(model_cfg.n_embd, model_cfg.padded_vocab_size, batch.micro * seq_len, loss_chunk,
                           cfg.loss_kernel == "liger")
        model.fp8_head = True
    if dist_info.world > 1:
        torch.manual_seed(cfg.seed + dist_info.rank)  # each rank its own dropout masks
    optimizers = build_optimizers(model, cfg)
    scaler = torch.amp.GradScaler(runtime.device.type, enabled=runtime.dtype == "fp16")
    shared = dist_info.world > 1  # ranks on one machine share the page cache's copy of the tokens
    train_data = TokenSplit(tokens_dir, "train", cfg.data_loading, meta, shared)
    val_data = TokenSplit(tokens_dir, "val", cfg.data_loading, meta, shared)
    sampler = BatchSampler(train_data, batch.micro, seq_len, cfg.seed, cfg.batching, runtime.device,
                           dist_info.rank, dist_info.world)
    BatchSampler(val_data, batch.micro, seq_len, cfg.seed, cfg.batching, runtime.device)  # length check
    tokens_per_step = batch.micro * seq_len * batch.accum * dist_info.world
    peaks = mfu_peaks(runtime, cfg.peak_tflops, dist_info.main)
    total = cfg.max_steps or (math.ceil(cfg.max_tokens / tokens_per_step) if cfg.max_tokens else None)
    eval_model = model
    if cfg.compile:
        eval_model = torch.compile(model, **compile_options(cfg.compile_mode, cfg.compile_tuning))
    step_model = eval_model
    if dist_info.grouped and not dist_info.sharded:
        from torch.nn.parallel import DistributedDataParallel

        # DDP around the compiled model: Dynamo compiles the model's forward inside DDP's, sees DDP active and
        # splits the graph at the gradient buckets (DDPOptimizer), so each bucket's all-reduce starts while the
        # backward goes on (tests/test_distributed.py); compiling around DDP would split the same way but also
        # break the graph at DDP's own Python code
        # the only buffer, the logit mask, is constant: no sync before each forward (torch 2.13 renamed the switch)
        constant_buffers = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                            inspect.signature(DistributedDataParallel).parameters else {"broadcast_buffers": False})
        step_model = DistributedDataParallel(eval_model, device_ids=[device.index] if device.type == "cuda" else None,
                                             gradient_as_bucket_view=True,  # grads live in the buckets: no copy
                                             **constant_buffers)
    return Setup(
        params=params, runtime=runtime, model_cfg=model_cfg, model=model, step_model=step_model,
        eval_model=eval_model, dist=dist_info,
        optimizers=optimizers, scaler=scaler, batch=batch, recipe=recipe, sampler=sampler, train_data=train_data,
        val_data=val_data,
        seq_len=seq_len, tokens_per_step=tokens_per_step, total_steps=total,
        throughput=Throughput(tokens_per_step, sum(flops_per_token(
            model.num_params(exclude_position_embedding=True), model_cfg.n_layer, model_cfg.n_embd, seq_len)),
            dist_info.world, peaks["peak_flops"], peaks["dtype_peak_flops"]),
        mfu_against=peaks["mfu_against"], meta=meta,
        tokens_dir=Path(tokens_dir),
        compile_watch=CompileWatch(cfg.compile), init=init, fp8_layers=fp8_layers,
    )


def mfu_peaks(runtime: Runtime, peak_tflops: float | None, main: bool = True) -> dict[str, Any]:
    """What MFU divides by: ``train.peak_tflops`` if set, a GPU's data sheet, or a CPU's measured matmul
    peak (gpt2/run/peak.py; measured by the ``main`` rank only, the others read it if it is kept). The
    yardstick is the bf16 peak where bf16 is native, whatever the run's dtype, so fp32 and bf16 runs
    compare on one scale; ``dtype_peak_flops`` is the run's own dtype's."""
    if peak_tflops is not None or runtime.device.type != "cpu":
        return {"peak_flops": yardstick_flops(runtime.device_name, peak_tflops),
                "dtype_peak_flops": dtype_peak_flops(runtime.device_name, runtime.dtype, runtime.tf32, peak_tflops),
                "mfu_against": "train.peak_tflops" if peak_tflops is not None else "the data sheet's dense peak"}
    started = time.perf_counter()
    peaks, fresh = cpu_peaks(may_measure=main)
    if peaks is None:
        return {"peak_flops": None, "dtype_peak_flops": None, "mfu_against": "rank 0's measured CPU peak"}
    figures = cpu_peak_figures(peaks, runtime.dtype)
    if fresh:
        logger.info(f"train: measured this CPU's matmul peak in {time.perf_counter() - started:.1f} s: "
                    f"{figures['mfu_against'].removeprefix(CPU_PEAK)} (kept in {cache_path()}; `gpt2 peak` measures "
                    "it again)")
    if peaks.get("under_load"):
        logger.warning(f"the CPU's matmul peak was measured under load ({100 * peaks.get('load', 0):.0f}% of the "
                       "cores busy with other work): it may read low and MFU high; the next run on a quiet machine "
                       "measures it again, and a run faster than it raises it")
    return figures


CPU_PEAK = "this CPU's measured matmul peak "


def cpu_peak_figures(peaks: dict[str, Any], dtype: str) -> dict[str, Any]:
    """MFU's yardstick (bf16's peak where native, else fp32's) and the run's own dtype's where it differs."""
    shown = ", ".join(f"{kind} {peaks[kind] / 1e12:.2f} TFLOP/s" for kind in ("bf16", "fp32") if peaks.get(kind))
    yardstick = max(peaks.get("bf16") or 0.0, peaks["fp32"])
    own = peaks.get(dtype)
    return {"peak_flops": yardstick, "dtype_peak_flops": own if own and own != yardstick else None,
            "mfu_against": f"{CPU_PEAK}({shown})"}


def above_peak(s: Setup, tokens_per_s: float) -> str | None:
    """Raise the peak MFU divides by to this rate where the run goes faster than it, and say so.

    Model FLOP/s above a peak mean the peak is wrong: a CPU's measured beside other work, or a
    ``train.peak_tflops`` set too low. A CPU's kept peak is raised for later runs too. So MFU is never
    above 100%. Returns the warning, or None when the rate is within the peak."""
    t = s.throughput
    achieved = t.flops_per_token * tokens_per_s / t.world
    own = t.dtype_peak_flops or t.peak_flops
    if own is None or achieved <= own:
        return None
    if s.mfu_against.startswith(CPU_PEAK):
        from gpt2.run.peak import raise_to_run

        kind = s.runtime.dtype if s.runtime.dtype in ("fp32", "bf16") else "fp32"
        figures = cpu_peak_figures(raise_to_run(kind, achieved), s.runtime.dtype)
        s.throughput = dataclasses.replace(t, peak_flops=figures["peak_flops"],
                                           dtype_peak_flops=figures["dtype_peak_flops"])
        s.mfu_against = figures["mfu_against"]
        return (f"this run reached {achieved / 1e12:.3f} TFLOP/s in {kind}, above the kept CPU matmul peak of "
                f"{own / 1e12:.3f} (measured beside other work, most likely): the peak is raised to this run's rate "
                f"for this and later runs (kept in {cache_path()}; `gpt2 peak` on a quiet machine measures it again)")
    which = "dtype_peak_flops" if t.dtype_peak_flops else "peak_flops"
    raised = {which: achieved}
    if which == "dtype_peak_flops" and t.peak_flops:
        raised["peak_flops"] = max(t.peak_flops, achieved)
    s.throughput = dataclasses.replace(t, **raised)
    return (f"this run reached {achieved / 1e12:.1f} TFLOP/s, above the peak MFU divides by ({own / 1e12:.1f}, "
            f"{s.mfu_against}): MFU divides by this run's rate from here; set train.peak_tflops to the device's "
            "dense bf16 peak")


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
    return {"init_from": source, "init_file": str(weights), "init_sha256": sha256_file(weights)}
