"""The GPU levers that are optional: FP8 matmuls in the blocks (torchao, emulated on a CPU), the LM head's matmuls in
FP8 (torch's own, oneDNN's on a CPU) and Liger's fused linear + cross-entropy (CUDA only). Their CUDA runs are in
tests/test_gpu.py."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import micro_params

from gpt2.core.errors import UserError
from gpt2.model import fp8
from gpt2.model.gpt import GPT, gpt_config
from gpt2.model.head import Head
from gpt2.model.loss import liger_loss
from gpt2.train import describe, trainer

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")


BLOCK_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


@pytest.mark.parametrize("scaling", [pytest.param("tensorwise", marks=needs_torchao),
                                     pytest.param("rowwise", marks=needs_torchao), "rowwise_fwd_dgrad"])
def test_fp8_trains_close_to_bf16_and_keeps_the_checkpoint_layout(tokens, tmp_path, scaling, monkeypatch):
    """Emulated FP8 in the blocks' linear layers: the losses follow bf16's to FP8's precision, and the
    checkpoint loads into the plain model (the weights stay bf16/fp32 tensors of the same names). Our own
    recipe runs without torchao."""
    if scaling == fp8.OWN_RECIPE:
        monkeypatch.setitem(sys.modules, "torchao.float8", None)
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


@needs_torchao
def test_fp8_converts_the_blocks_linear_layers_only():
    model = GPT(gpt_config("tiny", {}, 50257, True, "flash"))
    names = fp8.convert(model, "tensorwise", torch.device("cpu"))
    assert names == [f"transformer.h.{i}.{m}" for i in range(model.cfg.n_layer) for m in BLOCK_LINEARS]
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is model.transformer.wte.weight
    assert fp8.convert(GPT(gpt_config("tiny", {}, 50257, True, "flash")), "off", torch.device("cpu")) == []
    layer, x = model.get_submodule(names[0]), torch.randn(4, model.cfg.n_embd)
    with torch.autocast("cpu", torch.bfloat16):
        trained = layer(x)
        with torch.no_grad():  # evaluation: the plain layer, not FP8's rounding of it
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
            assert not torch.equal(trained, layer(x))


def test_fp8_refused_without_fp8_tensor_cores_or_without_torchao(monkeypatch):
    model = GPT(gpt_config("tiny", {}, 50257, True, "flash"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError, match=r"A100.*8\.0\) has no FP8 tensor cores.*train.fp8: off"):
        fp8.convert(model, "rowwise", torch.device("cuda"))
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(UserError, match=r"needs torchao.*pip install torchao"):
        fp8.convert(model, "rowwise", torch.device("cpu"))


@needs_torchao
def test_fp8_on_a_cpu_warns_that_it_is_emulated(tokens):
    s = trainer.build(micro_params(fp8="rowwise"), tokens)
    assert any("emulated on cpu" in w for w in describe.inert_switch_warnings(s))


def test_rowwise_fwd_dgrad_rounds_two_matmuls_to_fp8_and_leaves_the_weight_gradient_bf16s():
    """Our own FP8 layer against the bf16 layer it replaces: the output and the input's gradient within FP8's
    rounding of each operand (and not equal: FP8 ran), the weight's and the bias's gradients bit for bit bf16's."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(128, 256)
    low = torch.nn.Linear(128, 256)
    low.load_state_dict(plain.state_dict())
    fp8.to_own_recipe(low, torch.device("cpu"))
    x = torch.randn(2, 32, 128) * torch.logspace(-2, 2, 32)[:, None]  # rows of every magnitude: one scale each
    upstream = torch.randn(2, 32, 256, dtype=torch.bfloat16)
    outputs = {}
    for name, layer in (("plain", plain), ("low", low)):
        xin = x.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16):
            y = layer(xin)
        y.backward(upstream)
        outputs[name] = y.float(), xin.grad, layer.weight.grad, layer.bias.grad
    (y_ref, dx_ref, dw_ref, db_ref), (y, dx, dw, db) = outputs["plain"], outputs["low"]
    for got, want in ((y, y_ref), (dx, dx_ref)):
        error = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max()  # the worst row
        assert 0 < error < 0.08  # e4m3 rounds each operand by up to 6%
    assert torch.equal(dw, dw_ref) and torch.equal(db, db_ref) and dw.dtype == torch.float32
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):  # evaluation: the plain layer, bit for bit
        assert torch.equal(low(x), plain(x))


def test_rowwise_fwd_dgrad_emulated_where_the_cpus_fp8_matmul_has_no_row_scales(monkeypatch):
    """torch 2.11's CPU ``_scaled_mm`` takes one scale per tensor only: there the layer multiplies the same e4m3
    values in fp32, and matches the FP8 kernel (2.13's oneDNN) to bf16's rounding of the output."""
    has_row_scales = fp8.cpu_has_rowwise_matmul()
    monkeypatch.setattr(fp8, "cpu_has_rowwise_matmul", lambda: False)
    torch.manual_seed(0)
    layers = {}
    for emulated in (False, True):
        layers[emulated] = layer = torch.nn.Linear(64, 128)
        if emulated:
            layer.load_state_dict(layers[False].state_dict())
        fp8.to_own_recipe(layer, torch.device("cpu"))
        layer.emulated = emulated
    fp8.to_own_recipe(model := torch.nn.Linear(64, 128), torch.device("cpu"))
    assert model.emulated  # what a CPU without row scales converts to
    if not has_row_scales:
        pytest.skip("this torch's CPU FP8 matmul has no row scales to compare the emulation with")
    x, upstream = torch.randn(32, 64), torch.randn(32, 128, dtype=torch.bfloat16)
    results = []
    for layer in layers.values():
        xin = x.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16):
            y = layer(xin)
        y.backward(upstream)
        results.append((y.float(), xin.grad))
    for got, want in zip(results[1], results[0]):
        assert (got - want).norm() < 0.01 * want.norm()


def test_rowwise_fwd_dgrad_converts_torchaos_layers_and_is_refused_where_it_cannot_write_bf16(tokens):
    """The recipe converts the same layers as torchao's, and is refused where its matmuls cannot write their bf16
    results."""
    model = GPT(gpt_config("tiny", {}, 50257, True, "flash"))
    assert fp8.convert(model, "rowwise_fwd_dgrad", torch.device("cpu")) == [
        f"transformer.h.{i}.{m}" for i in range(model.cfg.n_layer) for m in BLOCK_LINEARS]
    with pytest.raises(UserError, match=r"rowwise_fwd_dgrad writes its matmuls' results in bf16 and this run "
                                         r"computes in fp32; set train.dtype: bf16"):
        trainer.build(micro_params(fp8="rowwise_fwd_dgrad"), tokens)


def test_fp8_head_trains_close_to_fp32_and_evaluates_in_full_precision(tokens, tmp_path):
    """The LM head's matmuls in FP8: the training losses follow fp32's to FP8's precision, the val loss is
    computed without FP8 (the same weights give the same val loss either way), and the run says what ran."""
    runs = {}
    for setting in (False, True):
        runs[setting] = trainer.train(micro_params(fp8_head=setting, max_steps=8), tokens,
                                      tmp_path / str(setting) / "c.pt", tmp_path / str(setting))
    assert runs[True]["runtime"]["fp8_head"] is True and runs[False]["runtime"]["fp8_head"] is False
    assert runs[True]["val"]["loss"] == pytest.approx(runs[False]["val"]["loss"], rel=0.02)
    assert runs[True]["val"]["loss"] != runs[False]["val"]["loss"]  # FP8 really trained
    s = trainer.build(micro_params(fp8_head=True), tokens)
    assert s.model.head.fp8 and any("fp8_head runs on cpu through oneDNN" in w
                                    for w in describe.inert_switch_warnings(s))
    idx = torch.randint(0, 50257, (2, 16))
    with torch.no_grad():
        in_fp8 = s.model(idx, idx)[1]
        s.model.set_head(dataclasses.replace(s.model.head, fp8=False))
        assert s.model(idx, idx)[1] == in_fp8  # evaluation never takes the FP8 path


@pytest.mark.parametrize("change, message", [
    ({"loss_chunk": 0}, r"inside the chunked loss; set train.loss_chunk auto"),
    ({"model": {"n_embd": 40}}, r"multiples of 16 \(FP8 tensor cores\): model.n_embd = 40; change them"),
    ({"micro_batch_size": 3, "block_size": 7}, r"positions per micro-batch .* = 21"),
    ({"model": {"pad_vocab": False}}, r"vocabulary rows .* = 50257"),
])
def test_fp8_head_is_refused_where_its_matmuls_cannot_run(tokens, change, message):
    with pytest.raises(UserError, match=message):
        trainer.build(micro_params(change.pop("model", None), fp8_head=True, **change), tokens)


def test_fp8_head_is_refused_without_fp8_tensor_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError, match=r"fp8_head: NVIDIA A100.*8\.0\) has no FP8 tensor cores.*fp8_head: false"):
        fp8.require_fp8_device(torch.device("cuda"), "train.fp8_head", "train.fp8_head: false")
    with pytest.raises(UserError, match=r"runs on CUDA \(or a CPU\), not on mps"):
        fp8.require_fp8_device(torch.device("mps"), "train.fp8_head", "train.fp8_head: false")


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
    model = GPT(gpt_config("tiny", {"n_layer": 1}, 50257, True, "flash"), Head(64))
    idx = torch.randint(0, 50257, (2, 16))
    _, chunked = model(idx, idx)
    chunked.backward()
    expected = model.transformer.wte.weight.grad.clone()
    model.zero_grad()
    seen = []

    def reference(weight, hidden, targets):
        seen.append(weight.shape[0])
        return F.cross_entropy(hidden @ weight.t(), targets)

    model.set_head(Head(64, fused=reference))
    _, fused = model(idx, idx)
    fused.backward()
    assert seen == [50257]
    assert fused.item() == pytest.approx(chunked.item(), rel=1e-5)
    torch.testing.assert_close(model.transformer.wte.weight.grad, expected, rtol=1e-4, atol=1e-7)
    with torch.no_grad():  # evaluation keeps the chunked path (per-window losses)
        assert model(idx, idx, per_window=True)[1].shape == (2,) and seen == [50257]


def test_rowwise_fwd_dgrad_compiles_in_one_graph_to_eagers_numbers():
    """Compiled, the recipe's casts become part of the kernels around them (no graph break for the autograd
    function, every operand in the layout ``_scaled_mm`` takes): a layer norm, the two FP8 layers of an MLP and
    the residual train to the eager step's numbers."""
    torch.manual_seed(0)
    width = 64
    ln, up, down = torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
    for layer in (up, down):
        fp8.to_own_recipe(layer, torch.device("cpu"))
    h = torch.randn(2, 32, width)

    def step(fn):
        x = h.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16):
            y = fn(x)
        y.float().square().mean().backward()
        grads = [x.grad] + [p.grad.clone() for p in (*up.parameters(), *down.parameters())]
        for p in (*up.parameters(), *down.parameters()):
            p.grad = None
        return [y.detach().float()] + grads

    def block(x):
        return x + down(F.gelu(up(ln(x)), approximate="tanh"))

    explained = torch._dynamo.explain(block)(h.clone().requires_grad_())
    assert explained.graph_break_count == 0
    eager, compiled = step(block), step(torch.compile(block))
    for got, want in zip(compiled, eager):  # compiled code rounds to bf16 less often: a few e4m3 roundings differ
        assert (got - want).norm() < 0.03 * want.norm()
