"""GPT-2's model: parameter count, FLOPs per token and MFU, initialisation, attention paths, padded vocabulary,
generation."""

from __future__ import annotations

import math

import pytest
import torch

from gpt2.core.errors import UserError
from gpt2.model.gpt import GPT, GPTConfig, gpt_config, pad_vocab
from gpt2.run.flops import flops_per_token, peak_flops


def small(**overrides) -> GPTConfig:
    base = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=100, padded_vocab_size=100)
    return GPTConfig(**{**base, **overrides})


def test_gpt2_124m_parameter_count():
    cfg = gpt_config("gpt2", {}, vocab_size=50257, pad_vocab_to_64=False, attention="flash")
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.num_params() == 124_439_808
    assert model.lm_head.weight is model.transformer.wte.weight


def test_flops_per_token_matches_the_design_anchor():
    cfg = gpt_config("gpt2", {}, vocab_size=50257, pad_vocab_to_64=True, attention="flash")
    with torch.device("meta"):
        model = GPT(cfg)
    flops = sum(flops_per_token(model.num_params(exclude_position_embedding=True), cfg.n_layer, cfg.n_embd, 1024))
    assert flops == pytest.approx(855e6, rel=0.002)
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16", True) == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16", True) == 756e12
    assert peak_flops("NVIDIA A100-SXM4-40GB", "fp32", True) == 156e12


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200"), ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA H800", "H800"),
    ("NVIDIA GH200 480GB", "GH200"), ("NVIDIA B200", "B200"), ("NVIDIA L40S", "L40S"), ("NVIDIA L40", "L40"),
    ("NVIDIA L4", "L4"), ("NVIDIA A100-SXM4-40GB", "A100"), ("NVIDIA A100 80GB PCIe", "A100"), ("NVIDIA A10", "A10"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"), ("Tesla V100-SXM2-16GB", "V100"), ("NVIDIA A10G", None),
    ("x86_64", None)])
def test_peak_table_matches_the_most_specific_gpu_name(name, key):
    """Names as torch.cuda.get_device_name() returns them: an L40S is not an L4, an NVL not an SXM."""
    from gpt2.run.flops import device_key

    assert device_key(name) == key
    assert peak_flops("x86_64", "fp32", False) is None


def test_mfu_divides_by_the_bf16_peak_and_names_the_dtypes_own_where_it_differs():
    from gpt2.run.flops import dtype_peak_flops, yardstick_flops

    h100 = "NVIDIA H100 80GB HBM3"
    assert yardstick_flops(h100) == 989e12 and yardstick_flops("Tesla V100-SXM2-16GB") == 125e12  # no bf16: fp16
    assert dtype_peak_flops(h100, "fp32", False) == 67e12 and dtype_peak_flops(h100, "fp32", True) == 494e12
    assert dtype_peak_flops(h100, "bf16", False) is None  # the yardstick itself
    assert yardstick_flops("x86_64") is None and yardstick_flops("x86_64", 1.5) == 1.5e12
    assert dtype_peak_flops("x86_64", "fp32", False, 1.5) is None


def test_named_sizes_and_overrides():
    cfg = gpt_config("gpt2-medium", {"n_layer": 2, "dropout": 0.1, "block_size": None}, 50257, True, "manual")
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size) == (2, 16, 1024, 1024)
    assert cfg.padded_vocab_size == 50304 == pad_vocab(50257)
    assert cfg.dropout == 0.1 and cfg.attention == "manual"
    with pytest.raises(UserError, match="n_embd 100 is not divisible by model.n_head 3"):
        gpt_config("tiny", {"n_embd": 100, "n_head": 3}, 50257, True, "flash")


def test_gpt2_init_scales_residual_projections():
    torch.manual_seed(0)
    model = GPT(small(n_layer=8, n_embd=256, n_head=4))
    std = model.transformer.h[0].attn.c_proj.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert model.transformer.h[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.transformer.h[0].mlp.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_flash_and_manual_attention_agree(dtype, tol):
    torch.manual_seed(0)
    flash = GPT(small(attention="flash"))
    manual = GPT(small(attention="manual"))
    manual.load_state_dict(flash.state_dict())
    idx = torch.randint(0, 100, (3, 16))
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        a, loss_a = flash(idx, idx)
        b, loss_b = manual(idx, idx)
    assert torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)
    assert loss_a.item() == pytest.approx(loss_b.item(), abs=tol)


def test_padded_vocab_never_wins_and_never_counts_in_the_loss():
    torch.manual_seed(0)
    padded = GPT(small(vocab_size=100, padded_vocab_size=128))
    idx = torch.randint(0, 100, (2, 16))
    logits, loss = padded(idx, idx)
    assert logits.shape[-1] == 128
    assert torch.isneginf(logits[..., 100:]).all()
    probs = torch.softmax(logits, dim=-1)
    assert probs[..., 100:].sum() == 0
    real = torch.nn.functional.cross_entropy(logits[..., :100].reshape(-1, 100), idx.reshape(-1))
    assert loss.item() == pytest.approx(real.item(), rel=1e-6)
    assert torch.multinomial(probs[:, -1], 1000, replacement=True).max() < 100


def test_generation_path_returns_last_position_only():
    logits, loss = GPT(small())(torch.zeros(2, 5, dtype=torch.long))
    assert logits.shape == (2, 1, 100) and loss is None


def test_sequence_longer_than_block_size_is_refused():
    with pytest.raises(ValueError, match="exceeds the model's block_size 16"):
        GPT(small())(torch.zeros(1, 17, dtype=torch.long))
