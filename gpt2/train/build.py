"""Everything the training loop needs, built once from params: device, model, optimizers, data."""

from __future__ import annotations

import dataclasses
import inspect
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpt2.core.config import Params, to_dict
from gpt2.core.digest import sha256_file
from gpt2.core.errors import UserError
from gpt2.core.sizes import SIZES, sequence_length
from gpt2.core.tokens import read_meta
from gpt2.model.gpt import GPT, GPTConfig, gpt_config
from gpt2.model import fp8, onednn
from gpt2.model.head import Head
from gpt2.model.loss import chunk_rows, cpu_gemm, liger_loss
from gpt2.run.compiled import CompileWatch, compile_options
from gpt2.run.device import Runtime, resolve
from gpt2.run.flops import Throughput, flops_per_token
from gpt2.run.mfu import mfu_peaks
from gpt2.train import distributed, sharded
from gpt2.train.batch import Batch, Recipe, model_shape, resolve_batch
from gpt2.train.distributed import Dist
from gpt2.train.loader import BatchSampler, TokenSplit
from gpt2.train.optim import build_optimizers


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
    throughput: Throughput  # tokens/s and MFU, from the step time; the step log keeps it, raised past a low peak
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
    if cfg.fp8_head:
        fp8.require_fp8_device(runtime.device, "train.fp8_head", "train.fp8_head: false")
    head = Head(loss_chunk, cpu_gemm(cfg.cpu_gemm, runtime.device.type), cfg.fp8_head,
                liger_loss(runtime.device) if cfg.loss_kernel == "liger" else None)
    residual = torch.bfloat16 if cfg.residual_stream == "bf16" and runtime.dtype == "bf16" else None
    model = GPT(model_cfg, head, residual)  # one seed on every rank: the same weights
    init = load_pretrained(model, cfg.init_from, params) if cfg.init_from != "scratch" else {}
    amp = runtime.dtype in ("bf16", "fp16")
    if dist_info.sharded and runtime.dtype == "fp16":
        raise UserError("train.distributed fsdp with fp16: GradScaler's overflow check would differ per shard; "
                        "set train.dtype bf16 (Ampere or newer) or fp32, or use ddp")
    recipe = Recipe(model_shape(model), seq_len, amp, model_cfg.attention == "flash", loss_chunk, cfg.optimizer,
                    dist_info.world if dist_info.sharded else 1, cfg.fp8_head)
    batch = resolve_batch(cfg, recipe, dist_info.world, runtime.device)  # before the model takes device memory
    fp8_layers = fp8.convert(model, cfg.fp8, runtime.device, runtime.dtype)  # before FSDP shards the layers it swaps
    if head.gemm == "onednn":
        onednn.convert(model)  # before FSDP shards the layers it swaps
    if dist_info.sharded:
        sharded.shard(model, runtime.device, torch.bfloat16 if runtime.dtype == "bf16" else None)
    model = model.to(runtime.device)  # under FSDP: the unsharded buffer (the logit mask)
    if cfg.fp8_head:
        fp8.head_fp8_check(model_cfg.n_embd, model_cfg.padded_vocab_size, batch.micro * seq_len, loss_chunk,
                           cfg.loss_kernel == "liger")
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
    if cfg.eval_from == "start" and cfg.eval_windows * seq_len + 1 > val_data.length:
        raise UserError(f"train.eval_windows {cfg.eval_windows} × {seq_len} tokens from the start of the val split "
                        f"need {cfg.eval_windows * seq_len + 1:,} tokens, and {val_data.label} has "
                        f"{val_data.length:,}; lower train.eval_windows to {(val_data.length - 1) // seq_len} or less")
    tokens_per_step = batch.micro * seq_len * batch.accum * dist_info.world
    peaks = mfu_peaks(runtime, cfg.peak_tflops, dist_info.main)
    total = cfg.max_steps or (math.ceil(cfg.max_tokens / tokens_per_step) if cfg.max_tokens else None)
    eval_model = model
    if cfg.compile:
        eval_model = torch.compile(model, **compile_options(cfg.compile_mode, cfg.compile_tuning))
    step_model = eval_model
    if dist_info.grouped and not dist_info.sharded:
        step_model = _ddp(eval_model, device)
    return Setup(
        params=params, runtime=runtime, model_cfg=model_cfg, model=model, step_model=step_model,
        eval_model=eval_model, dist=dist_info,
        optimizers=optimizers, scaler=scaler, batch=batch, recipe=recipe, sampler=sampler, train_data=train_data,
        val_data=val_data,
        seq_len=seq_len, tokens_per_step=tokens_per_step, total_steps=total,
        throughput=Throughput(tokens_per_step, sum(flops_per_token(
            model.num_params(exclude_position_embedding=True), model_cfg.n_layer, model_cfg.n_embd, seq_len)),
            dist_info.world, peaks["peak_flops"], peaks["dtype_peak_flops"], peaks["mfu_against"]),
        meta=meta,
        tokens_dir=Path(tokens_dir),
        compile_watch=CompileWatch(cfg.compile), init=init, fp8_layers=fp8_layers,
    )


def _ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """DDP around the (compiled) model: Dynamo compiles the model's forward inside DDP's, sees DDP active and
    splits the graph at the gradient buckets (DDPOptimizer), so each bucket's all-reduce starts while the backward
    goes on (tests/test_distributed.py); compiling around DDP would split the same way but also break the graph at
    DDP's own Python code."""
    from torch.nn.parallel import DistributedDataParallel

    # the only buffer, the logit mask, is constant: no sync before each forward (torch 2.13 renamed the switch)
    constant_buffers = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                        inspect.signature(DistributedDataParallel).parameters else {"broadcast_buffers": False})
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   gradient_as_bucket_view=True,  # grads live in the buckets: no copy
                                   **constant_buffers)


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
