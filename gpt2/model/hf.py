"""GPT-2 in Hugging Face's layout: the same weights under the same names, four of them transposed.

``transformers.GPT2LMHeadModel`` names its tensors as this project does
(``transformer.wte/wpe/h.N.{ln_1,attn.c_attn,attn.c_proj,ln_2,mlp.c_fc,mlp.c_proj}/ln_f``), but
stores ``c_attn``, ``c_proj`` and ``c_fc`` as Conv1D weights, (in, out) where ``nn.Linear`` has
(out, in); it also keeps ``attn.bias`` / ``attn.masked_bias`` mask buffers that are not weights,
and ties ``lm_head.weight`` to ``wte``. This module converts both ways and maps the configs; it
needs torch only (reading and writing safetensors files is the caller's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gpt2.model.gpt import GPTConfig

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias")  # the causal-mask buffers, not c_attn.bias


def _strip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names as GPT2LMHeadModel's, whether saved from it or from GPT2Model (no ``transformer.``)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(NOT_WEIGHTS):
            continue
        if not name.startswith(("transformer.", "lm_head.")):
            name = f"transformer.{name}"
        out[name] = tensor
    return out


def dims_from_state(state: dict[str, torch.Tensor]) -> dict[str, int]:
    """n_layer, n_head is not in the weights (the config says it); the rest is read off the shapes."""
    state = _strip(state)
    vocab, n_embd = state["transformer.wte.weight"].shape
    layers = {int(name.split(".")[2]) for name in state if name.startswith("transformer.h.")}
    return {"n_layer": len(layers), "n_embd": int(n_embd), "block_size": int(state["transformer.wpe.weight"].shape[0]),
            "vocab_size": int(vocab)}


def from_hf(state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """A state dict for ``GPT(cfg)`` from a Hugging Face GPT-2 state dict (vocabulary padded if ``cfg`` is)."""
    out = {}
    for name, tensor in _strip(state).items():
        if name == "lm_head.weight":
            continue  # tied to wte
        tensor = tensor.detach().to(torch.float32)
        if name.endswith(CONV1D):
            tensor = tensor.t().contiguous()
        out[name] = tensor
    wte = out["transformer.wte.weight"]
    if cfg.padded_vocab_size > wte.shape[0]:  # padded rows: never looked up, masked out of the logits
        padding = wte.new_zeros(cfg.padded_vocab_size - wte.shape[0], wte.shape[1])
        out["transformer.wte.weight"] = torch.cat([wte, padding])
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def to_hf(state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """A GPT2LMHeadModel state dict from this project's (padded vocabulary rows dropped), without the
    tied ``lm_head.weight``: transformers ties it to wte again on load (tie_word_embeddings)."""
    out = {}
    for name, tensor in state.items():
        if name == "lm_head.weight":
            continue
        tensor = tensor.detach().to("cpu", torch.float32)
        if name.endswith(CONV1D):
            tensor = tensor.t()
        if name == "transformer.wte.weight":
            tensor = tensor[: cfg.vocab_size]
        out[name] = tensor.contiguous()
    return out


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    """config.json for GPT2LMHeadModel: GPT-2's own settings with these dimensions."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
        "activation_function": "gelu_new",  # GELU, tanh approximation: this model's
        "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "scale_attn_weights": True,
        "bos_token_id": 50256, "eos_token_id": 50256, "tie_word_embeddings": True, "torch_dtype": "float32",
    }


def config_dims(config: dict[str, Any]) -> dict[str, int]:
    """This project's model dimensions from a Hugging Face GPT-2 config.json."""
    return {"n_layer": int(config["n_layer"]), "n_head": int(config["n_head"]), "n_embd": int(config["n_embd"]),
            "block_size": int(config.get("n_positions") or config.get("n_ctx")),
            "vocab_size": int(config["vocab_size"])}


# --------------------------------------------------------------------------- reading a pretrained model

HUB_NAMES = {"gpt2": "openai-community/gpt2", "gpt2-medium": "openai-community/gpt2-medium",
             "gpt2-large": "openai-community/gpt2-large", "gpt2-xl": "openai-community/gpt2-xl"}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def locate(source: str, key: str = "train.init_from") -> Path:
    """The weights file that ``key`` (the param or option the user set) names: a directory, a file, or
    OpenAI's GPT-2 by name (the local Hugging Face cache, else the hub when reachable)."""
    from gpt2.core.errors import UserError

    if source in HUB_NAMES:
        return _from_hub(source, key)
    path = Path(source).expanduser()
    if path.is_dir():
        for name in WEIGHT_FILES:
            if (path / name).is_file():
                return path / name
        raise UserError(f"{key}: {path} holds neither {' nor '.join(WEIGHT_FILES)}; point it at a Hugging "
                        "Face GPT-2 directory (config.json + weights) or a .safetensors file")
    if path.is_file():
        return path
    raise UserError(f"{key}: {source!r} is no such file or directory, nor one of "
                    f"{', '.join(['scratch', *HUB_NAMES])}")


def _from_hub(name: str, key: str) -> Path:
    from gpt2.core.errors import UserError

    repo = HUB_NAMES[name]
    fix = (f"download it where the hub is reachable (`hf download {repo} --local-dir hf-{name}`), copy that folder "
           f"into the project and set {key} to ./hf-{name}")
    from gpt2.core.net import reachable

    try:
        from huggingface_hub import constants, hf_hub_download
    except ImportError:
        raise UserError(f"{key} {name}: reading {repo} needs huggingface_hub (pip install -c "
                        f"constraints.txt -e '.[hf]'); or {fix}") from None
    for local_only in (True, False):
        if not local_only and (constants.HF_HUB_OFFLINE or not reachable(constants.ENDPOINT)):
            break  # the client would spend half a minute on retries to learn the same
        try:
            weights = Path(hf_hub_download(repo, "model.safetensors", local_files_only=local_only))
            hf_hub_download(repo, "config.json", local_files_only=local_only)
            return weights
        except Exception:  # not cached (first pass); unreachable or unknown (second pass)
            continue
    raise UserError(f"{key} {name}: {repo} is neither in the Hugging Face cache ({constants.HF_HUB_CACHE}) nor "
                    f"reachable at {constants.ENDPOINT}; {fix}")


def read_pretrained(weights: Path, key: str = "train.init_from"
                    ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """(state dict, config.json beside it or None) of a safetensors or PyTorch weights file, in Hugging Face's
    layout; a checkpoint of this project (``gpt2 train``'s) is read as its export would be."""
    from gpt2.core.errors import UserError

    try:
        if weights.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(weights))
        else:
            state = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise UserError(f"{key}: {weights} is not a readable weights file ({exc.__class__.__name__}); "
                        "check the download") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict) and "model_config" in state:
        cfg = GPTConfig(**state["model_config"])  # a checkpoint of this project: its weights, as `gpt2 export` writes
        return to_hf(state["model"], cfg), hf_config(cfg)
    config_file = weights.parent / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else None
    return state, config
