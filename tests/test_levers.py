"""The GPU levers that are optional extras: FP8 matmuls (torchao, emulated on a CPU) and Liger's fused linear +
cross-entropy (CUDA only). The CUDA runs of both are in tests/test_gpu.py."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import micro_params

from gpt2.core.errors import UserError
from gpt2.model import fp8
from gpt2.model.gpt import GPT, gpt_config
from gpt2.model.loss import liger_loss
from gpt2.train import describe, trainer

torchao = pytest.importorskip("torchao")


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_trains_close_to_bf16_and_keeps_the_checkpoint_layout(tokens, tmp_path, scaling):
    """Emulated FP8 in the blocks' linear layers: the losses follow bf16's to FP8's precision, and the
    checkpoint loads into the plain model (the weights stay bf16/fp32 tensors of the same names)."""
    runs = {}
    for setting in ("off", scaling):
        runs[setting] = trainer.train(micro_params(dtype="bf16", fp8=setting, max_steps=8), tokens,
                                      tmp_path / setting / "c.pt", tmp_path / setting)
    bf16, low = runs["off"], runs[scaling]
    assert low["runtime"]["fp8"] == f"{scaling} (8 layers)" and bf16["runtime"]["fp8"] == "off"
    assert low["val"]["loss"] == pytest.approx(bf16["val"]["loss"], rel=0.02)
    assert low["val"]["loss"] != bf16["val"]["loss"]  # FP8 really ran
    state = torch.load(tmp_path / scaling / "c.pt", weights_only=False)["model"]
    plain = GPT(gpt_config("tiny", {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}, 50257, True, "flash"))
    plain.load_state_dict(state)


def test_fp8_converts_the_blocks_linear_layers_only():
    model = GPT(gpt_config("tiny", {}, 50257, True, "flash"))
    names = fp8.convert(model, "tensorwise", torch.device("cpu"))
    assert names == [f"transformer.h.{i}.{m}" for i in range(model.cfg.n_layer)
                     for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is model.transformer.wte.weight
    assert fp8.convert(GPT(gpt_config("tiny", {}, 50257, True, "flash")), "off", torch.device("cpu")) == []


def test_fp8_refused_without_fp8_tensor_cores_or_without_torchao(monkeypatch):
    model = GPT(gpt_config("tiny", {}, 50257, True, "flash"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError, match=r"A100.*8\.0\) has no FP8 tensor cores.*train.fp8: off"):
        fp8.convert(model, "rowwise", torch.device("cuda"))
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(UserError, match=r"needs torchao.*pip install torchao"):
        fp8.convert(model, "rowwise", torch.device("cpu"))


def test_fp8_on_a_cpu_warns_that_it_is_emulated(tokens):
    s = trainer.build(micro_params(fp8="rowwise"), tokens)
    assert any("emulated on cpu" in w for w in describe.inert_switch_warnings(s))


def test_liger_loss_is_refused_off_cuda_and_without_the_package(tokens, monkeypatch):
    with pytest.raises(UserError, match=r"liger runs Triton kernels on CUDA only.*loss_kernel: torch"):
        trainer.build(micro_params(loss_kernel="liger"), tokens)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.fused_linear_cross_entropy", None)
    with pytest.raises(UserError, match=r"needs liger-kernel.*pip install liger-kernel"):
        liger_loss(torch.device("cuda"))


def test_a_fused_loss_gets_the_real_vocabulary_only_and_trains_as_the_chunked_loss():
    """The fused loss is handed the head's real rows (padding takes no probability, as the mask does): with a
    reference fused loss, the training loss and the gradients equal the chunked path's."""
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", {"n_layer": 1}, 50257, True, "flash"), loss_chunk=64)
    idx = torch.randint(0, 50257, (2, 16))
    _, chunked = model(idx, idx)
    chunked.backward()
    expected = model.transformer.wte.weight.grad.clone()
    model.zero_grad()
    seen = []

    def reference(weight, hidden, targets):
        seen.append(weight.shape[0])
        return F.cross_entropy(hidden @ weight.t(), targets)

    model.fused_loss = reference
    _, fused = model(idx, idx)
    fused.backward()
    assert seen == [50257]
    assert fused.item() == pytest.approx(chunked.item(), rel=1e-5)
    torch.testing.assert_close(model.transformer.wte.weight.grad, expected, rtol=1e-4, atol=1e-7)
    with torch.no_grad():  # evaluation keeps the chunked path (per-window losses)
        assert model(idx, idx, per_window=True)[1].shape == (2,) and seen == [50257]
