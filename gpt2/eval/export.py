"""``gpt2 export``: a checkpoint as a Hugging Face model directory.

``transformers.GPT2LMHeadModel.from_pretrained(OUT_DIR)`` loads it (config.json +
model.safetensors, padded vocabulary rows dropped) and ``AutoTokenizer.from_pretrained(OUT_DIR)``
gives the pipeline's token ids (vocab.json + merges.txt built offline from the BPE ranks): the
checkpoint goes on to generation, lm-evaluation-harness or serving with the Hugging Face stack.
Its ``n_positions`` is the sequence length the checkpoint trained on (``train.block_size``), which
may be shorter than the model's context: the position embeddings past it never learned.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from gpt2.core import log
from gpt2.core.atomic import atomic_dir, check_owned
from gpt2.core.errors import UserError
from gpt2.data.hf_tokenizer import write_tokenizer
from gpt2.model.gpt import GPTConfig
from gpt2.model.hf import hf_config, to_hf
from gpt2.run import checkpoint

logger = log.get("export")

EXPORT_FILES = ("*.json", "*.safetensors", "merges.txt")  # a Hugging Face model folder: refused if it holds more


def export(ckpt_path: str | Path, out_dir: str | Path) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    check_owned(out.absolute(), EXPORT_FILES, "gpt2 export")
    state = checkpoint.load(ckpt_path)
    config, trained = checkpoint.trained_model(state, ckpt_path)
    cfg = GPTConfig(**config)
    if not cfg.bias:
        raise UserError(f"{ckpt_path} was trained with model.bias: false; Hugging Face's GPT-2 always has biases, "
                        "so it cannot hold this model")
    weights = to_hf(trained, cfg)
    replaced = (out / "model.safetensors").is_file()
    with atomic_dir(out, owns=EXPORT_FILES, command="gpt2 export") as tmp:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp / "model.safetensors", 0o666 & ~umask)  # safetensors writes 0600; the rest of the folder 0644
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 50256, "eos_token_id": 50256}) + "\n")
        write_tokenizer(tmp)
    count = sum(w.numel() for w in weights.values())
    logger.info(f"export: {ckpt_path} (step {state['step']}, {count:,} parameters) → "
                f"{out}/ (GPT2LMHeadModel.from_pretrained and AutoTokenizer.from_pretrained load it)"
                + ("; it replaced the model exported there before" if replaced else ""))
    if "history" in state and state.get("metrics") is None and state["step"] < (state.get("total_steps") or math.inf):
        # trained here and not finished (imported weights are; a checkpoint of old at its last step lacks metrics)
        of = f" of {state['total_steps']}" if state.get("total_steps") else ""
        logger.warning(f"export: {ckpt_path} is an unfinished run (step {state['step']}{of}): the export holds its "
                       "weights at that step; finish it (train.resume: auto) and export again for the trained model")
    if cfg.block_size < state["model_config"]["block_size"]:
        logger.info(f"export: n_positions {cfg.block_size}, the positions it trained on (train.block_size), not the "
                    f"model's {state['model_config']['block_size']}: the position embeddings past them never learned")
    return out
