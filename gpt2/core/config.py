"""Typed, validated configuration built from ``params.yaml``.

Every section of params.yaml maps to a frozen dataclass. Loading is strict on
purpose: a typo such as ``tokenize.val_fracton`` must stop the stage before it
writes anything, not silently fall back to a default and cost a user an
afternoon. Each error names the key, the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gpt2.core.errors import UserError


class ParamError(UserError):
    """A value in params.yaml is unknown, of the wrong type or out of range."""


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    """Raise a :class:`ParamError` naming ``key`` unless ``ok``."""
    if not ok:
        raise ParamError(f"params: {key} = {value!r} is not allowed; expected {allowed}")


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class DownloadConfig:
    """Where the raw text comes from (see README, "Data sources")."""

    source: str = "embedded"  # embedded | path | dir | glob | http(s)://... | hf:<name>[:<config>]
    sha256: str | None = None  # expected sha256 of a downloaded URL or a single local file
    timeout_s: float = 30.0  # per network read; a stalled server fails after this
    retries: int = 3  # extra attempts after a failed or truncated transfer
    backoff_s: float = 1.0  # first retry delay; doubles each time
    hf_split: str = "train"
    text_field: str = "text"  # JSON field holding the text, for .jsonl files and hf datasets
    hf_docs_per_shard: int = 100_000
    hf_gzip_level: int = 1  # hf: shards stored as .jsonl.gz at this gzip level (about 3x smaller); 0 = plain .jsonl

    def check(self, at: str) -> None:
        require(bool(self.source.strip()), f"{at}.source", self.source, "a non-empty source")
        if self.sha256 is not None:
            ok = len(self.sha256) == 64 and all(c in "0123456789abcdefABCDEF" for c in self.sha256)
            require(ok, f"{at}.sha256", self.sha256, "null or 64 hex digits")
        require(self.timeout_s > 0, f"{at}.timeout_s", self.timeout_s, "a number > 0")
        require(self.retries >= 0, f"{at}.retries", self.retries, "an integer >= 0")
        require(self.backoff_s >= 0, f"{at}.backoff_s", self.backoff_s, "a number >= 0")
        require(self.hf_docs_per_shard > 0, f"{at}.hf_docs_per_shard", self.hf_docs_per_shard, "an integer > 0")
        require(0 <= self.hf_gzip_level <= 9, f"{at}.hf_gzip_level", self.hf_gzip_level,
                "an integer in [0, 9] (0 = uncompressed)")


@dataclass(frozen=True)
class TokenizeConfig:
    """How raw documents become ``train.bin`` / ``val.bin``."""

    val_fraction: float = 0.1  # share of documents (or of tokens, for a one-document corpus)
    seed: int = 1337  # which documents go to val
    workers: int = 0  # tokenizer threads; 0 = all cores
    chunk_kb: int = 1024  # text handed to a worker at once; bounds memory per worker
    on_decode_error: Literal["replace", "strict"] = "replace"
    max_replaced_fraction: float = 0.01  # a document with more invalid UTF-8 than this is refused (not text)

    def check(self, at: str) -> None:
        require(0 < self.val_fraction <= 0.5, f"{at}.val_fraction", self.val_fraction, "a number in (0, 0.5]")
        require(0 <= self.max_replaced_fraction <= 1, f"{at}.max_replaced_fraction", self.max_replaced_fraction,
                "a number in [0, 1]")
        require(self.workers >= 0, f"{at}.workers", self.workers, "an integer >= 0 (0 = all cores)")
        require(self.chunk_kb >= 1, f"{at}.chunk_kb", self.chunk_kb, "an integer >= 1")


@dataclass(frozen=True)
class StatsConfig:
    """What the dataset report shows."""

    top_tokens: int = 20
    length_bins: int = 40  # bars in the document-length histogram

    def check(self, at: str) -> None:
        require(self.top_tokens >= 1, f"{at}.top_tokens", self.top_tokens, "an integer >= 1")
        require(self.length_bins >= 2, f"{at}.length_bins", self.length_bins, "an integer >= 2")


@dataclass(frozen=True)
class ModelParams:
    """A named GPT-2 size, with any dimension overridable (null: the size's value)."""

    size: Literal["tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"] = "tiny"
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    block_size: int | None = None  # longest context the model can see (position embeddings)
    dropout: float = 0.0
    bias: bool = True

    def check(self, at: str) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size"):
            value = getattr(self, name)
            require(value is None or value >= 1, f"{at}.{name}", value, "null or an integer >= 1")
        require(0.0 <= self.dropout < 1.0, f"{at}.dropout", self.dropout, "a number in [0, 1)")


@dataclass(frozen=True)
class TrainConfig:
    """The training loop and every optimization switch (README, "Training switches")."""

    # where and in what precision
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    tf32: bool = True
    compile: bool = False
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    attention: Literal["flash", "manual"] = "flash"
    sdpa_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"  # the kernel behind flash
    pad_vocab: bool = True
    fused_adamw: bool = True
    loss_chunk: int = 8192  # positions whose logits exist at once in the training loss; 0 = all (plain path)
    keep_host_memory: bool = True  # CPU: glibc keeps freed big blocks for reuse instead of re-faulting them
    # where the weights start: scratch (GPT-2's init), OpenAI's GPT-2 by name, or a Hugging Face directory / file
    init_from: str = "scratch"
    # data
    data_loading: Literal["preload", "memmap"] = "preload"
    batching: Literal["vectorized", "loop"] = "vectorized"
    micro_batch_size: int = 8
    block_size: int | None = None  # sequence length; null = the model's block_size
    grad_accum_steps: int = 1
    # length and schedule
    max_steps: int | None = 320
    max_tokens: int | None = None  # alternative to max_steps: steps = ceil(max_tokens / tokens per step)
    lr: float = 2.0e-3
    lr_schedule: Literal["cosine", "constant"] = "cosine"  # cosine: linear warmup, then cosine decay to min_lr
    min_lr: float = 2.0e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # 0 = no clipping
    # optimizer: adamw for every parameter, or muon for the hidden matrices (AdamW, with the keys above, for the rest)
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_lr: float = 0.02  # peak; follows the same warmup and decay as lr
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    seed: int = 1337
    # measuring
    eval_interval: int = 40
    eval_iters: int = 10
    eval_seed: int = 1337  # which val windows every eval scores: not train.seed, so all runs score the same text
    log_interval: int = 10
    checkpoint_interval: int = 40
    save_checkpoint: bool = True  # false: measurement runs (the ladder) write no checkpoint
    async_checkpoint: bool = True  # write checkpoints on a thread from a CPU copy; training goes on meanwhile
    timing_warmup_steps: int = 5
    target_val_loss: float | None = None  # time to target: first eval at or below it records time, tokens, steps
    stop_at_target: bool = True  # ... and ends the run there
    peak_tflops: float | None = None  # peak FLOP/s of this device for MFU; null = look it up by name
    resume: Literal["auto", "never"] = "auto"
    # many processes (README, "Many GPUs")
    distributed: Literal["off", "ddp"] = "off"  # ddp: DistributedDataParallel, launched by torchrun
    nproc_per_node: int = 1  # processes on this machine when the stage launches torchrun itself
    dist_timeout_s: float = 600.0  # a collective waiting longer (a peer died or hangs) fails every rank
    dist_first_step_timeout_s: float = 1800.0  # the same for the first step, which compiles
    # tracking
    mlflow: bool = True
    experiment: str = "gpt2"

    def check(self, at: str) -> None:
        positive = "an integer >= 1"
        for name in ("micro_batch_size", "grad_accum_steps", "eval_interval", "eval_iters", "log_interval",
                     "checkpoint_interval"):
            require(getattr(self, name) >= 1, f"{at}.{name}", getattr(self, name), positive)
        for name in ("block_size", "max_steps", "max_tokens"):
            value = getattr(self, name)
            require(value is None or value >= 1, f"{at}.{name}", value, "null or an integer >= 1")
        require((self.max_steps is None) != (self.max_tokens is None), f"{at}.max_steps", self.max_steps,
                "exactly one of train.max_steps and train.max_tokens set (the other null)")
        require(self.lr > 0, f"{at}.lr", self.lr, "a number > 0")
        require(0 <= self.min_lr <= self.lr, f"{at}.min_lr", self.min_lr, "a number in [0, train.lr]")
        require(self.warmup_steps >= 0, f"{at}.warmup_steps", self.warmup_steps, "an integer >= 0")
        require(self.weight_decay >= 0, f"{at}.weight_decay", self.weight_decay, "a number >= 0")
        require(all(0 <= b < 1 for b in self.betas), f"{at}.betas", list(self.betas), "two numbers in [0, 1)")
        require(self.grad_clip >= 0, f"{at}.grad_clip", self.grad_clip, "a number >= 0 (0 = off)")
        require(self.muon_lr > 0, f"{at}.muon_lr", self.muon_lr, "a number > 0")
        require(0 <= self.muon_momentum < 1, f"{at}.muon_momentum", self.muon_momentum, "a number in [0, 1)")
        require(self.muon_weight_decay >= 0, f"{at}.muon_weight_decay", self.muon_weight_decay, "a number >= 0")
        require(self.target_val_loss is None or self.target_val_loss > 0, f"{at}.target_val_loss",
                self.target_val_loss, "null or a number > 0")
        require(bool(self.init_from.strip()), f"{at}.init_from", self.init_from,
                "scratch, gpt2, gpt2-medium, gpt2-large, gpt2-xl or a path")
        require(self.loss_chunk >= 0, f"{at}.loss_chunk", self.loss_chunk, "an integer >= 0 (0 = plain loss)")
        require(self.timing_warmup_steps >= 0, f"{at}.timing_warmup_steps", self.timing_warmup_steps,
                "an integer >= 0")
        require(self.nproc_per_node >= 1, f"{at}.nproc_per_node", self.nproc_per_node, positive)
        require(self.dist_timeout_s > 0, f"{at}.dist_timeout_s", self.dist_timeout_s, "a number > 0")
        require(self.dist_first_step_timeout_s > 0, f"{at}.dist_first_step_timeout_s", self.dist_first_step_timeout_s,
                "a number > 0")
        require(self.nproc_per_node == 1 or self.distributed == "ddp", f"{at}.nproc_per_node", self.nproc_per_node,
                "1 unless train.distributed is ddp")
        require(self.peak_tflops is None or self.peak_tflops > 0, f"{at}.peak_tflops", self.peak_tflops,
                "null or a number > 0")


@dataclass(frozen=True)
class EvalConfig:
    """Validation loss of the trained checkpoint, and samples from it."""

    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    batch_size: int = 16
    max_tokens: int | None = 65_536  # a larger val split is scored on a seeded subset of windows; null = all
    unigram_max_tokens: int | None = 100_000_000  # the baseline's train counts from at most this many tokens; null = all
    seed: int = 1337  # the subset of windows, and sampling
    prompts: tuple[str, ...] = ("ROMEO:", "To be, or not to be", "KING HENRY:")
    max_new_tokens: int = 100
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 200  # 0 = off
    top_p: float = 0.95  # 1.0 = off
    num_samples: int = 2
    stop_at_eot: bool = True
    kv_cache: bool = True
    keep_host_memory: bool = True  # as train.keep_host_memory
    pretrained: str | None = None  # score OpenAI's GPT-2 (gpt2, ...) or a Hugging Face directory instead of the checkpoint
    hellaswag: bool = False  # HellaSwag validation accuracy (acc_norm, acc), downloaded once into the cache
    hellaswag_limit: int | None = None  # score only the first N items (a quick look); null = all 10,042
    hellaswag_file: str | None = None  # a local copy of hellaswag_val.jsonl instead of the download
    mlflow: bool = True

    def check(self, at: str) -> None:
        require(self.batch_size >= 1, f"{at}.batch_size", self.batch_size, "an integer >= 1")
        require(self.max_tokens is None or self.max_tokens >= 1, f"{at}.max_tokens", self.max_tokens,
                "null or an integer >= 1")
        require(self.unigram_max_tokens is None or self.unigram_max_tokens >= 1, f"{at}.unigram_max_tokens",
                self.unigram_max_tokens, "null or an integer >= 1")
        require(self.max_new_tokens >= 0, f"{at}.max_new_tokens", self.max_new_tokens, "an integer >= 0")
        require(self.temperature >= 0, f"{at}.temperature", self.temperature, "a number >= 0 (0 = greedy)")
        require(self.top_k >= 0, f"{at}.top_k", self.top_k, "an integer >= 0 (0 = off)")
        require(0 < self.top_p <= 1, f"{at}.top_p", self.top_p, "a number in (0, 1]")
        require(self.num_samples >= 1, f"{at}.num_samples", self.num_samples, "an integer >= 1")
        require(self.hellaswag_limit is None or self.hellaswag_limit >= 1, f"{at}.hellaswag_limit",
                self.hellaswag_limit, "null or an integer >= 1")


@dataclass(frozen=True)
class Params:
    """All of params.yaml. A missing section takes its defaults."""

    download: DownloadConfig = field(default_factory=DownloadConfig)
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)
    model: ModelParams = field(default_factory=ModelParams)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# --------------------------------------------------------------------------- loading


def read_yaml(path: str | os.PathLike, kind: str, option: str) -> Any:
    """A YAML file's content ({} when empty), or a :class:`UserError` naming the ``kind`` of file and ``option``."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{kind} file {str(path)!r} not found; run from the project root or pass {option} PATH")
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{kind} file {str(path)!r} is not valid YAML: {exc}") from None


def load_params(path: str | os.PathLike = "params.yaml") -> Params:
    """Read and validate params.yaml; raise :class:`UserError` on any problem."""
    data = read_yaml(path, "params", "--params")
    if not isinstance(data, dict):
        raise ParamError(f"params file {str(path)!r} must be a mapping of sections, got {type(data).__name__}")
    return build(Params, data, "")


def build(cls: type, data: Any, at: str) -> Any:
    """Build dataclass ``cls`` from ``data`` (a dict), checking keys, types and ranges."""
    where = at or "params"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ParamError(f"params: {where} must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ParamError(
                f"params: unknown key {_join(at, key)!r}; {hint}allowed keys: {', '.join(sorted(fields))}"
            )
    hints = typing.get_type_hints(cls)
    values = {name: coerce(data[name], hints[name], _join(at, name)) for name in fields if name in data}
    obj = cls(**values)
    if hasattr(obj, "check"):
        obj.check(at)
    return obj


def coerce(value: Any, hint: Any, key: str) -> Any:
    """Return ``value`` as type ``hint`` or raise a :class:`ParamError` naming ``key``."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return coerce(value, inner[0], key)
        for candidate in inner:
            try:
                return coerce(value, candidate, key)
            except ParamError:
                continue
        raise ParamError(f"params: {key} = {value!r} has the wrong type; expected {_describe(hint)}")
    if origin is Literal:
        if value is False and "off" in args:  # YAML 1.1 (and so `dvc exp run -S`) reads a bare off as false
            value = "off"
        require(value in args, key, value, "one of " + ", ".join(repr(a) for a in args))
        return value
    if origin in (list, tuple):
        require(isinstance(value, list | tuple), key, value, f"a list ({_describe(hint)})")
        if origin is tuple and args and args[-1] is not Ellipsis:
            require(len(value) == len(args), key, value, f"a list of {len(args)} values")
            return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if hint is Any:
        return value
    if hint is bool:
        require(isinstance(value, bool), key, value, "true or false")
        return value
    if hint is int:
        require(isinstance(value, int) and not isinstance(value, bool), key, value, "an integer")
        return value
    if hint is float:
        if isinstance(value, str) and _parses_as_float(value):
            raise ParamError(
                f"params: {key} = {value!r} is a string, not a number; YAML reads exponents without a dot "
                f"as text, so write it like {float(value):.1e}"
            )
        require(isinstance(value, int | float) and not isinstance(value, bool), key, value, "a number")
        return float(value)
    if hint is str:
        require(isinstance(value, str), key, value, "a string")
        return value
    raise TypeError(f"unsupported type {hint!r} for {key}")  # a bug in a config dataclass, not user input


def to_dict(obj: Any) -> dict:
    """Plain-dict view of a config, for logging and for metadata files."""
    return dataclasses.asdict(obj)


def _join(at: str, key: Any) -> str:
    return f"{at}.{key}" if at else str(key)


def _parses_as_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _describe(hint: Any) -> str:
    names = getattr(hint, "__name__", None)
    return names or str(hint).replace("typing.", "")
