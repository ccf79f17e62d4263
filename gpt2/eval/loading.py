"""A checkpoint, or OpenAI's or a Hugging Face GPT-2, as a model in eval mode on the asked device: what
evaluation, sampling and the benchmarks score and generate with."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpt2.core import log
from gpt2.core.errors import UserError
from gpt2.model import loss, onednn
from gpt2.model.gpt import GPT, GPTConfig
from gpt2.model.head import Head
from gpt2.run import checkpoint
from gpt2.run.device import Runtime, runtime_for

logger = log.get("evaluate")


@dataclass
class Loaded:
    model: GPT
    state: dict[str, Any]
    runtime: Runtime


def eval_runtime(device: str, dtype: str, keep_host_memory: bool = True) -> Runtime:
    return runtime_for(device, dtype, keep_host_memory=keep_host_memory, section="eval")


def scoring_model(cfg: GPTConfig, runtime: Runtime, cpu_gemm: str) -> GPT:
    """A model that scores as training does, without its FP8 or fused head: the loss in chunks of positions
    (the batch's logits, 16 x 128 x 50,304 fp32: 0.4 GB and as much again for the mask and the log-softmax,
    never exist at once), its matmuls and the linear layers' by ``eval.cpu_gemm`` (``cpu_gemm``)."""
    gemm = loss.cpu_gemm(cpu_gemm, runtime.device.type, "eval.cpu_gemm")
    model = GPT(cfg, Head(loss.chunk_rows("auto", runtime.device.type, cfg.padded_vocab_size), gemm))
    if gemm == "onednn":
        onednn.convert(model)
    return model


def load_model(ckpt_path: str | Path, runtime: Runtime, cpu_gemm: str = "blas") -> Loaded:
    """Rebuild the model from a checkpoint (compiled or not) on ``runtime.device``."""
    state = checkpoint.load(ckpt_path)
    try:
        config, weights = checkpoint.trained_model(state, ckpt_path)
        model = scoring_model(GPTConfig(**config), runtime, cpu_gemm)
        model.load_state_dict(weights)
    except (KeyError, TypeError, RuntimeError) as exc:
        raise UserError(f"checkpoint {ckpt_path} does not hold a model this code can rebuild "
                        f"({exc.__class__.__name__}); retrain it (dvc repro train)") from None
    if model.cfg.block_size < state["model_config"]["block_size"]:
        logger.info(f"evaluate: {ckpt_path} trained on {model.cfg.block_size} of its model's "
                    f"{state['model_config']['block_size']} positions (train.block_size); scoring and sampling use "
                    f"those {model.cfg.block_size}")
    model.to(runtime.device).eval()
    return Loaded(model=model, state=state, runtime=runtime)


def load_pretrained_model(source: str, runtime: Runtime, cpu_gemm: str = "blas") -> Loaded:
    """OpenAI's GPT-2 (by name) or a Hugging Face GPT-2 directory, scored like a checkpoint."""
    from gpt2.model import hf

    weights = hf.locate(source, "eval.pretrained (gpt2 evaluate --pretrained)")
    state, config = hf.read_pretrained(weights, "eval.pretrained")
    if config is None:
        raise UserError(f"eval.pretrained {source}: no config.json beside {weights.name} (the number of heads is "
                        "not in the weights); point it at the model's directory")
    dims = hf.config_dims(config)
    cfg = GPTConfig(n_layer=dims["n_layer"], n_head=dims["n_head"], n_embd=dims["n_embd"],
                    block_size=dims["block_size"], vocab_size=dims["vocab_size"], padded_vocab_size=dims["vocab_size"])
    model = scoring_model(cfg, runtime, cpu_gemm)
    model.load_state_dict(hf.from_hf(state, cfg))
    model.to(runtime.device).eval()
    pseudo = {"step": 0, "model_config": dataclasses.asdict(cfg), "mlflow_run_id": None, "pretrained": source,
              "params": {"train": {"experiment": "gpt2"}}}
    return Loaded(model=model, state=pseudo, runtime=runtime)
