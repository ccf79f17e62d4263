"""The sections of ``params.yaml``: one frozen dataclass each, every field declared once.

Each field's ``param(default, doc, range)`` is its whole documentation: the type and range checks,
the ``error:`` line a bad value gets, and docs/params.md (``python -m gpt2.core.config`` writes it;
a test keeps it current) all come from it. Checks that involve two fields are each section's
``check``. The engine is gpt2/core/schema.py.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gpt2.core import paths
from gpt2.core.errors import UserError
from gpt2.core.schema import ParamError, build, markdown_table, override, param, read_yaml, require, to_dict

__all__ = ["DownloadConfig", "TokenizeConfig", "StatsConfig", "ModelParams", "TrainConfig", "EvalConfig", "Params",
           "ParamError", "build", "load_params", "read_yaml", "to_dict"]

# Keys that moved or were replaced, and what nanoGPT's train.py or Hugging Face's Trainer call a key of ours (a
# newcomer's first -S): each gets an error saying what to write instead.
MOVED = {"train.attention": "is now model.attention: move it there",
         "train.pad_vocab": "is now model.pad_vocab: move it there",
         "train.eval_iters": "was replaced by train.eval_windows, the val set counted in windows, the same whatever "
                             "the micro-batch and the ranks (it was eval_iters x micro_batch_size x ranks); write "
                             "train.eval_windows: 80 for the old default's amount of text",
         "train.dropout": "is model.dropout here: write that",
         "train.learning_rate": "is nanoGPT's and Hugging Face's name; here it is train.lr",
         "train.max_iters": "is nanoGPT's name; here it is train.max_steps",
         "train.warmup_iters": "is nanoGPT's name; here it is train.warmup_steps",
         "train.batch_size": "is nanoGPT's name for the micro-batch; here it is train.micro_batch_size "
                             "(train.batch_tokens sets the whole batch)",
         "train.per_device_train_batch_size": "is Hugging Face's name; here it is train.micro_batch_size",
         "train.gradient_accumulation_steps": "is nanoGPT's and Hugging Face's name; here it is train.grad_accum_steps",
         "train.max_grad_norm": "is Hugging Face's name; here it is train.grad_clip",
         "train.beta1": "is nanoGPT's; here both betas are one list: train.betas=[0.9,0.95]",
         "train.beta2": "is nanoGPT's; here both betas are one list: train.betas=[0.9,0.95]"}

# Params that change the numbers a training step computes, never its work: two runs apart only in these take the
# same time per step, so a comparison reads any speed difference between them as the machine's noise.
SAME_WORK = frozenset({"train.lr", "train.lr_schedule", "train.min_lr", "train.warmup_steps", "train.weight_decay",
                       "train.betas", "train.muon_lr", "train.muon_momentum", "train.muon_weight_decay", "train.seed",
                       "train.eval_seed", "train.price_per_hour", "train.target_val_loss"})

# Params the trainer resolves on the device it runs on, each with the key of summary.json's "runtime" that records
# what it ran as (train.tf32 is off on a CPU; dtype auto is bf16 on an H100, fp32 on a CPU; cpu_gemm auto is
# oneDNN on an AMD CPU). A comparison reads a change of one as what ran, and --apply keeps a file's auto.
RESOLVED_ON_DEVICE = {"train.dtype": "dtype", "train.tf32": "tf32", "train.keep_host_memory": "keep_host_memory",
                      "model.attention": "sdpa_backend", "train.cpu_gemm": "cpu_gemm"}


URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # http(s):// is fetched; another scheme is refused


def refuse_other_scheme(source: str) -> None:
    """A URL whose scheme is not http(s) (``s3://``): one message, from the validate stage and from download."""
    if URL_SCHEME.match(source) and not source.startswith(("http://", "https://")):
        raise UserError(f"download.source: unsupported scheme in {source!r}; use http(s)://, hf:, a path or embedded")


def local_source(source: str) -> bool:
    """A ``download.source`` that names a file, folder or glob on this machine: not ``embedded``, not ``hf:``, and
    not a URL of any scheme."""
    source = source.strip()
    return not (source == "embedded" or source.startswith("hf:") or URL_SCHEME.match(source))


@dataclass(frozen=True)
class DownloadConfig:
    """Where the raw text comes from (docs/data.md)."""

    source: str = param("embedded", "embedded | a file, dir or glob | http(s)://URL | hf:<dataset>[:<config>] | "
                                    ".bin token shards")
    sha256: str | None = param(None, "expected sha256 of a URL download or a single local file (null: no check)")
    timeout_s: float = param(30.0, "a network read that waits longer than this fails and is retried", gt=0)
    retries: int = param(3, "extra attempts for a failed or truncated transfer (resumes where it stopped)", ge=0)
    backoff_s: float = param(1.0, "first retry delay in seconds; doubles every retry", ge=0)
    text_field: str = param("text", "JSON field with the text, for .jsonl files and hf: datasets")
    hf_split: str = param("train", "the dataset split, for hf: sources")
    hf_docs_per_shard: int = param(100_000, "documents per JSON Lines shard, for hf: sources", ge=1)
    hf_gzip_level: int = param(1, "hf: shards stored as .jsonl.gz (about 3x smaller, read in place)", ge=0, le=9,
                               note="0 = plain .jsonl")

    def check(self, at: str) -> None:
        require(bool(self.source.strip()), f"{at}.source", self.source, "a non-empty source")
        if self.sha256 is not None:
            ok = len(self.sha256) == 64 and all(c in "0123456789abcdefABCDEF" for c in self.sha256)
            require(ok, f"{at}.sha256", self.sha256, "null or 64 hex digits")


@dataclass(frozen=True)
class TokenizeConfig:
    """How raw documents become ``train.bin`` / ``val.bin``."""

    val_fraction: float = param(0.1, "share of documents held out for validation (of tokens, for one document)",
                                gt=0, le=0.5)
    seed: int = param(1337, "which documents go to val")
    workers: int = param(0, "tokenizer threads", ge=0, note="0 = all cores")
    chunk_kb: int = param(1024, "text per task; bounds memory (about 2 x workers chunks in flight)", ge=1)
    on_decode_error: Literal["replace", "strict"] = param(
        "replace", "invalid UTF-8: replace (U+FFFD, counted in meta.json) or strict (stop at the first bad byte)")
    max_replaced_fraction: float = param(0.01, "a document with more replaced characters than this is not text: "
                                               "refused", ge=0, le=1)


@dataclass(frozen=True)
class StatsConfig:
    """What the dataset report shows."""

    top_tokens: int = param(20, "most frequent tokens listed in the report", ge=1)
    length_bins: int = param(40, "bars in the document-length histogram", ge=2)


@dataclass(frozen=True)
class ModelParams:
    """The model: a named GPT-2 size, any dimension overridable, and the two switches that shape it."""

    size: Literal["tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"] = param(
        "tiny", "tiny (7.2M, CPU) | gpt2 (124M) | gpt2-medium | gpt2-large | gpt2-xl")
    n_layer: int | None = param(None, "overrides the size's layers (null: the size's value)", ge=1)
    n_head: int | None = param(None, "overrides the size's attention heads", ge=1)
    n_embd: int | None = param(None, "overrides the size's width", ge=1)
    block_size: int | None = param(None, "longest context (position embeddings)", ge=1)
    dropout: float = param(0.0, "dropout probability", ge=0, lt=1)
    bias: bool = param(True, "biases in the linear layers and LayerNorms (Hugging Face's GPT-2 has them)")
    attention: Literal["flash", "manual"] = param(
        "flash", "flash (F.scaled_dot_product_attention) | manual (materialized T x T scores)")
    pad_vocab: bool = param(True, "50257 -> 50304 rows (multiple of 64); padded logits masked")


@dataclass(frozen=True)
class TrainConfig:
    """The training loop and every optimization switch (docs/training.md)."""

    # where and in what precision
    device: Literal["auto", "cpu", "cuda", "mps"] = param("auto", "auto | cpu | cuda | mps; cuda without CUDA is an "
                                                                  "error")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = param(
        "auto", "auto (bf16 on CUDA with bf16, fp16 on older CUDA, fp32 on CPU) | fp32 | bf16 | fp16")
    tf32: bool = param(True, "TF32 tensor-core matmuls for fp32 work (CUDA Ampere+)")
    compile: bool = param(False, "torch.compile the model")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = param(
        "default", "torch.compile's mode")
    compile_tuning: bool = param(
        False, "Inductor's coordinate-descent tuning: at compile time each of its own (Triton) kernels tries "
               "neighbouring block sizes and warp counts and keeps the fastest; minutes more compile. The max-autotune "
               "modes include it; inert off CUDA")
    compile_cache: bool = param(True, "reuse compiled graphs across runs (Inductor's on-disk caches): later runs "
                                      "skip most of compile's warm-up", note="false: a cold compile every run")
    sdpa_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = param(
        "auto", "the kernel behind model.attention flash: auto (PyTorch's choice) | flash | cudnn | efficient | math")
    fused_adamw: bool = param(True, "one fused AdamW kernel instead of PyTorch's default (foreach)")
    residual_stream: Literal["fp32", "bf16"] = param(
        "fp32", "the residual stream's dtype under bf16 autocast: fp32 | bf16 (half the bytes of every residual add "
                "and saved block input; the sum rounds to bf16 at every block)")
    fp8: Literal["off", "tensorwise", "rowwise", "rowwise_fwd_dgrad"] = param(
        "off", "FP8 matmuls in the blocks' linear layers: off | tensorwise | rowwise (torchao's float8 training: "
               "inputs and weights round to e4m3, gradients to e5m2, one scale per tensor or per row) | "
               "rowwise_fwd_dgrad (this project's, no torchao: the forward's and the input gradient's matmuls in "
               "e4m3 with one scale per row, the weight's gradient in bf16; needs train.dtype bf16). Sums in fp32; "
               "evaluation (the val loss) runs the plain layers; weights and optimizer unchanged. CUDA compute "
               "capability 8.9+; a CPU emulates it",
        note="tensorwise and rowwise need torchao (pip install torchao)")
    fp8_head: bool = param(
        False, "FP8 matmuls for the LM head inside the chunked loss (torch._scaled_mm): the logits and the loss's "
               "two gradient matmuls. Hidden states and the tied weight round to e4m3, each scaled to its largest "
               "value; the loss's gradient (in [-1, 1]) to e5m2 at a fixed scale; sums in fp32; evaluation and the "
               "val loss stay in full precision. CUDA compute capability 8.9+ (a CPU runs it through oneDNN: its "
               "numerics, slower); n_embd, the padded vocabulary, the positions per micro-batch and loss_chunk "
               "multiples of 16")
    loss_kernel: Literal["torch", "liger"] = param(
        "torch", "the training loss: torch (plain or chunked, train.loss_chunk) | liger (Liger-Kernel's fused linear "
                 "+ cross-entropy in Triton, never all logits at once: the same loss, summed in another order; CUDA "
                 "only; evaluation keeps torch's)",
        note="liger needs liger-kernel (pip install liger-kernel)")
    loss_chunk: int | Literal["auto"] = param(
        "auto", "training loss in chunks of this many positions, never all logits at once; auto: 8192 on a GPU, on "
                "a CPU 32 MB of logits (128 positions), on an AMD CPU 128 MB (512)", ge=0,
        note="0 = plain loss")
    cpu_gemm: Literal["auto", "blas", "onednn"] = param(
        "auto", "the library of training's matmuls on a CPU (fp32, eager): the loss's three LM-head matmuls, the "
                "blocks' linear layers and the head's own (the plain loss): blas (PyTorch's BLAS, MKL on x86) | "
                "onednn (oneDNN's kernels, built for this CPU at run time: on an AMD EPYC with AVX-512 2x MKL's "
                "rate, the tiny step 1.7x faster) | auto (onednn on AMD CPUs, where MKL's fp32 kernels run at half "
                "the chip's rate; blas elsewhere); the last bits of the loss differ between them")
    keep_host_memory: bool = param(True, "CPU/Linux: glibc reuses freed big blocks instead of page-faulting them in "
                                         "every step")
    threads: int = param(0, "CPU intra-op threads; the count changes the last digits of CPU results", ge=0,
                         note="0 = PyTorch's default (the physical cores)")
    deterministic: bool = param(False, "bit-identical reruns on every device: deterministic kernels (CUDA's ordered "
                                       "ones); on a CPU the thread count decides (train.threads)")
    init_from: str = param("scratch", "scratch | gpt2 | gpt2-medium | gpt2-large | gpt2-xl (OpenAI's) | a Hugging "
                                      "Face dir or file | a checkpoint of this project (its weights, a new run)")
    # data
    data_loading: Literal["preload", "memmap"] = param("preload", "preload (RAM) | memmap (open the file per batch)")
    batching: Literal["vectorized", "loop"] = param(
        "vectorized", "vectorized (one gather, pinned, non_blocking) | loop (per-sample Python)")
    micro_batch_size: int | Literal["auto"] = param(
        8, "sequences per forward and backward; auto: the largest that the memory model fits in the device's free "
           "memory (with train.batch_tokens; on CPU, 8)", ge=1)
    block_size: int | None = param(None, "sequence length; null = model.block_size", ge=1)
    grad_accum_steps: int = param(1, "micro-batches per optimizer step", ge=1, le=10**6)
    batch_tokens: int | None = param(None, "tokens per optimizer step, all ranks together; the accumulation follows "
                                           "from it (leave grad_accum_steps at 1)", ge=1, le=10**10,
                                     note="null = micro_batch_size x grad_accum_steps x ranks x block_size")
    memory_margin: float = param(0.15, "with micro_batch_size auto: share of the device's free memory left unused "
                                       "(allocator slack, fragmentation, kernels' workspace)", ge=0, lt=1)
    # length and schedule
    max_steps: int | None = param(320, "optimizer steps; or null, with max_tokens set", ge=1, le=10**9)
    max_tokens: int | None = param(None, "tokens to train on, rounded up to whole steps; or null", ge=1, le=10**14)
    time_budget_s: float | None = param(
        None, "train for this many seconds of training steps instead (compile included; evals, checkpoints and the "
              "build before the first step not), the lr decaying over the budget; or null", gt=0)
    lr: float = param(1.0e-3, "peak learning rate", gt=0, le=10)
    lr_schedule: Literal["cosine", "constant"] = param(
        "cosine", "cosine (linear warmup, cosine decay to min_lr) | constant (after warmup)")
    min_lr: float = param(1.0e-4, "learning rate at the end of the cosine decay (at most lr)", ge=0)
    warmup_steps: int = param(40, "linear warmup from lr/warmup_steps to lr", ge=0, le=10**9)
    weight_decay: float = param(0.1, "AdamW weight decay, on matrices only", ge=0)
    betas: tuple[float, float] = param((0.9, 0.95), "AdamW's betas", ge=0, lt=1)
    grad_clip: float = param(1.0, "max global gradient norm", ge=0, note="0 = off")
    optimizer: Literal["adamw", "muon"] = param(
        "adamw", "adamw | muon (torch.optim.Muon for the hidden matrices, AdamW for the rest)")
    muon_lr: float = param(0.02, "Muon's peak learning rate; follows lr's warmup and decay", gt=0)
    muon_momentum: float = param(0.95, "Muon's (Nesterov) momentum", ge=0, lt=1)
    muon_weight_decay: float = param(0.0, "Muon's decoupled weight decay", ge=0)
    muon_ns_dtype: Literal["auto", "bf16", "fp32"] = param(
        "auto", "precision of Muon's orthogonalization: auto (bf16 where the device's bf16 matmuls are native, "
                "else fp32) | bf16 (torch.optim.Muon) | fp32")
    seed: int = param(1337, "model init, batches, dropout")
    # measuring
    eval_interval: int = param(40, "val loss every this many steps", ge=1, le=10**9)
    final_eval: bool = param(True, "and after the last step (false: speed runs, where the eval compiles again)")
    eval_windows: int = param(80, "val windows (of the sequence length) per val loss, the same whatever the "
                                  "micro-batch and the ranks", ge=1, le=10**8)
    eval_seed: int = param(1337, "which val windows: the same in every run (not train.seed), so runs compare on "
                                 "one text")
    eval_from: Literal["random", "start"] = param(
        "random", "random: the val windows drawn with eval_seed from the whole split | start: laid end to end from "
                  "the split's first token, as the speedrun scores its first 10,485,760 (eval_windows 10240 at "
                  "block_size 1024)")
    holdout_windows: int = param(0, "val windows disjoint from eval_windows, scored once after the last step: text "
                                    "no verdict is read on, where gpt2 grid/ladder --apply confirm a quality win "
                                    "(0: none)", ge=0, le=10**8)
    log_interval: int = param(10, "a log line and a metrics record every this many steps", ge=1, le=10**9)
    checkpoint_interval: int = param(40, "a checkpoint every this many steps (and at the end)", ge=1, le=10**9)
    save_checkpoint: bool = param(True, "false: write no checkpoint (measurement runs such as `gpt2 ladder`)")
    async_checkpoint: bool = param(True, "write checkpoints on a background thread from a CPU copy (exact, "
                                         "atomic)")
    timing_warmup_steps: int = param(5, "first steps (compile, autotune) left out of the medians", ge=0, le=10**9)
    target_val_loss: float | None = param(None, "time to target: the first eval at or below it records time, "
                                                "tokens and steps", gt=0)
    stop_at_target: bool = param(True, "... and ends the run there")
    price_per_hour: float | None = param(
        None, "USD per device-hour, for each run's cost", ge=0,
        note="null = the assumed price of a known GPU (gpt2 plan's), no cost on a CPU")
    peak_tflops: float | None = param(
        None, "this device's dense bf16 peak for MFU; null = a GPU's data sheet, a CPU's measured matmul peak "
              "(gpt2 peak)", gt=0)
    resume: Literal["auto", "never"] = param(
        "auto", "auto (continue an unfinished run of this model and data) | never")
    # many processes
    distributed: Literal["off", "ddp", "fsdp"] = param(
        "off", "off | ddp (DistributedDataParallel: a full replica per rank) | fsdp (FSDP2's fully_shard: weights, "
               "gradients and optimizer state sharded over the ranks); under torchrun, NCCL on CUDA, gloo on CPU")
    nproc_per_node: int = param(1, "with ddp or fsdp: processes the stage launches on this machine (torchrun "
                                   "--standalone)", ge=1)
    dist_timeout_s: float = param(600.0, "a collective waiting longer than this (a peer died or hangs) fails every "
                                         "rank", gt=0)
    dist_first_step_timeout_s: float = param(1800.0, "the same deadline for the first step, which compiles", gt=0)
    # tracking
    mlflow: bool = param(True, "log to MLflow (sqlite DB at the project root unless MLFLOW_TRACKING_URI)")
    experiment: str = param("gpt2", "the MLflow experiment")

    def check(self, at: str) -> None:
        lengths = {"max_steps": self.max_steps, "max_tokens": self.max_tokens, "time_budget_s": self.time_budget_s}
        given = [k for k, v in lengths.items() if v is not None]
        require(len(given) == 1, f"{at}.{given[-1] if given else 'max_steps'}", lengths[given[-1]] if given else None,
                "exactly one of train.max_steps, train.max_tokens and train.time_budget_s set (the others null)"
                + (f"; {' and '.join(given)} are both set (to keep {given[-1]}: "
                   f"{' '.join(f'-S {at}.{k}=null' for k in given[:-1])}, or null in params.yaml)"
                   if len(given) > 1 else ""))
        require(self.min_lr <= self.lr, f"{at}.min_lr", self.min_lr, "a number in [0, train.lr]")
        require(bool(self.init_from.strip()), f"{at}.init_from", self.init_from,
                "scratch, gpt2, gpt2-medium, gpt2-large, gpt2-xl or a path")
        require(self.nproc_per_node == 1 or self.distributed != "off", f"{at}.nproc_per_node", self.nproc_per_node,
                "1 unless train.distributed is ddp or fsdp")
        require(self.micro_batch_size != "auto" or self.batch_tokens is not None, f"{at}.micro_batch_size",
                self.micro_batch_size, "an integer, or auto together with train.batch_tokens (the batch that auto "
                "splits into micro-batches, so that the result does not depend on the card)")
        require(self.batch_tokens is None or self.grad_accum_steps == 1, f"{at}.grad_accum_steps",
                self.grad_accum_steps, "1 when train.batch_tokens is set (the accumulation follows from it)")
        require(self.distributed != "fsdp" or self.optimizer == "adamw", f"{at}.optimizer", self.optimizer,
                "adamw under train.distributed fsdp (Muon orthogonalizes whole matrices; each fsdp rank holds "
                "a shard: use ddp for Muon)")


# Train fields that change neither the weights nor the measured figures: a finished run is reused across them.
REUSABLE_TRAIN_FIELDS = {"mlflow", "experiment", "resume", "dist_timeout_s", "dist_first_step_timeout_s",
                         "async_checkpoint"}


@dataclass(frozen=True)
class EvalConfig:
    """Validation loss of the trained checkpoint, and samples from it (docs/evaluation.md)."""

    device: Literal["auto", "cpu", "cuda", "mps"] = param("auto", "as train.device")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = param("auto", "as train.dtype")
    cpu_gemm: Literal["auto", "blas", "onednn"] = param(
        "auto", "as train.cpu_gemm, for the val loss's and the samples' matmuls (on an AMD EPYC with AVX-512 oneDNN "
                "scores 1.7x faster)")
    batch_size: int = param(16, "windows of block_size scored at once", ge=1)
    max_tokens: int | None = param(65_536, "val splits larger than this are scored on a seeded subset of windows; "
                                           "null = all", ge=1)
    unigram_max_tokens: int | None = param(100_000_000, "the unigram baseline counts at most this many train tokens "
                                                        "(evenly spaced); null = all", ge=1)
    seed: int = param(1337, "that subset, and the sampling")
    prompts: Literal["auto"] | tuple[str, ...] = param(
        "auto", "sample from each; a prompt longer than the context is an error",
        note="auto = Shakespeare's on the embedded corpus, else the first words of 3 val documents; [] = none")
    max_new_tokens: int = param(100, "tokens per sample", ge=0)
    temperature: float = param(0.8, "sampling temperature", ge=0, note="0 = greedy")
    top_k: int = param(200, "keep the k likeliest tokens", ge=0, note="0 = off")
    top_p: float = param(0.95, "keep the smallest set of tokens reaching this probability", gt=0, le=1,
                         note="1.0 = off")
    num_samples: int = param(2, "continuations per prompt", ge=1)
    stop_at_eot: bool = param(True, "stop a sample at <|endoftext|>")
    kv_cache: bool = param(True, "generate with a KV cache (one position per token)")
    keep_host_memory: bool = param(True, "as train.keep_host_memory")
    pretrained: str | None = param(None, "null: the checkpoint; gpt2 | gpt2-medium | ... | a Hugging Face dir: "
                                         "score that instead")
    hellaswag: bool = param(False, "HellaSwag val accuracy (acc_norm, acc); the file is downloaded once into the "
                                   "cache")
    hellaswag_limit: int | None = param(None, "the first N of its 10,042 items (a quick look); null = all", ge=1)
    hellaswag_file: str | None = param(None, "a local hellaswag_val.jsonl instead of the download (offline "
                                             "machines)")
    mlflow: bool = param(True, "log to the checkpoint's MLflow run")


@dataclass(frozen=True)
class Params:
    """All of params.yaml. A missing section takes its defaults."""

    download: DownloadConfig = field(default_factory=DownloadConfig)
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)
    model: ModelParams = field(default_factory=ModelParams)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def sections_with(key: str) -> list[str]:
    """The params sections that have a key of that name (``lr`` → ``["train"]``), for a hint where one is missing."""
    params = Params()
    return [s.name for s in dataclasses.fields(params)
            if key in {f.name for f in dataclasses.fields(getattr(params, s.name))}]


def load_params(path: str | os.PathLike = paths.PARAMS, sets: tuple[str, ...] = ()) -> Params:
    """Read and validate params.yaml, with ``-S section.key=value`` overrides; raise :class:`UserError` on any
    problem."""
    data = read_yaml(path, "params", "--params")
    if data == {}:
        raise ParamError(f"params file {str(path)!r} is empty: it must hold the stages' sections (download, tokenize, "
                         "model, train, eval...); `git checkout HEAD -- params.yaml` restores the committed one")
    if not isinstance(data, dict):
        raise ParamError(f"params file {str(path)!r} must be a mapping of sections, got {type(data).__name__}")
    try:
        return build(Params, override(data, sets), "", MOVED)
    except ParamError as exc:
        if not _written_by_dvc_exp_run(path):
            raise
        raise ParamError(f"{exc} (if `dvc exp run -S` wrote it there, it stays after the failed run: `git checkout "
                         f"HEAD -- {path}` takes it out)") from None


def _written_by_dvc_exp_run(path: str | os.PathLike) -> bool:
    """Whether ``path`` is the params file of a workspace where ``dvc exp run`` runs (not ``--temp``'s copy):
    DVC writes the ``-S`` values into it before the stages run, and leaves them there when one fails."""
    root = os.environ.get("DVC_ROOT")
    return bool(os.environ.get("DVC_EXP_NAME") and root
                and Path(path).resolve().parent == Path(root).resolve() == paths.root())


def params_markdown() -> str:
    """docs/params.md: every key of every section, from the dataclasses."""
    parts = ["# Params", "",
             "Every key of `params.yaml`, generated from `gpt2/core/config.py` (`python -m gpt2.core.config > "
             "docs/params.md`). Loading is strict: an unknown key (`tokenize.val_fracton` → \"did you mean "
             "'tokenize.val_fraction'?\"), a wrong type or an out-of-range value stops the stage before it writes "
             "anything, with one `error:` line naming the key and what it allows. A float may be written `6e-4` or "
             "`6.0e-4` (DVC's `-S` writes the first).", ""]
    for section, cls in typing.get_type_hints(Params).items():
        parts += [f"## `{section}`", "", (cls.__doc__ or "").strip(), "", markdown_table(cls, section), ""]
    return "\n".join(parts)


def yaml_comments() -> dict[tuple[str, str], str]:
    """Each key's comment in params.yaml: its doc, and what a special value means (a test keeps them equal)."""
    return {(section, f.name): f.metadata["doc"] + (f"; {f.metadata['note']}" if f.metadata.get("note") else "")
            for section, cls in typing.get_type_hints(Params).items() for f in dataclasses.fields(cls)}


if __name__ == "__main__":
    print(params_markdown(), end="")
