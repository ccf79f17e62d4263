"""train.optimizer (AdamW, or Muon for the hidden matrices) and the learning-rate schedule (train/optim.py, muon.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import micro_params
from test_distributed import torchrun, train_losses
from training import interrupt_at, losses, run

from gpt2.core.config import TrainConfig
from gpt2.model.gpt import GPT, GPTConfig
from gpt2.run import checkpoint
from gpt2.train import muon
from gpt2.train.optim import build_optimizers, lr_at
from gpt2.train.trainer import TrainingInterrupted

needs_muon = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch without torch.optim.Muon")


def test_cosine_schedule_with_warmup():
    """The multiplier of every peak rate: train.lr's rate over train.lr."""
    cfg = TrainConfig(lr=1.0e-3, min_lr=1.0e-4, warmup_steps=10)
    assert lr_at(0, cfg, 100) == pytest.approx(0.1)  # never 0 at step 0
    assert lr_at(9, cfg, 100) == pytest.approx(1.0)
    assert lr_at(10, cfg, 100) == pytest.approx(1.0)
    assert lr_at(55, cfg, 100) == pytest.approx(0.55)
    assert lr_at(100, cfg, 100) == pytest.approx(0.1)
    steps = [lr_at(i, cfg, 100) for i in range(10, 101)]
    assert steps == sorted(steps, reverse=True)
    constant = TrainConfig(lr=1.0e-3, warmup_steps=0, lr_schedule="constant")
    assert {lr_at(i, constant, 100) for i in range(100)} == {1.0}


@needs_muon
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=4, vocab_size=10, padded_vocab_size=16))
    muon, adamw = build_optimizers(model, TrainConfig(optimizer="muon", muon_lr=0.03, lr=1e-3))
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = sorted(names[id(p)] for g in muon.param_groups for p in g["params"])
    in_adamw = sorted(names[id(p)] for g in adamw.param_groups for p in g["params"])
    assert in_muon == sorted(f"transformer.h.{i}.{m}.weight" for i in range(2)
                             for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight"} <= set(in_adamw)
    assert not set(in_muon) & set(in_adamw)
    assert len(in_muon) + len(in_adamw) == len(list(model.parameters()))  # the tied head is the embedding
    assert muon.param_groups[0]["lr"] == 0.03 and adamw.param_groups[0]["lr"] == 1e-3


@needs_muon
def muon_steps(optimizer_class, steps=3):
    """Parameters after ``steps`` of ``optimizer_class`` on fixed gradients: a tall and a wide matrix."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(12, 5)), torch.nn.Parameter(torch.randn(4, 9))]
    optimizer = optimizer_class(params, lr=0.02, weight_decay=0.1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
    return [p.detach().clone() for p in params], optimizer


@needs_muon
def test_fp32_muon_is_pytorchs_muon_with_another_precision():
    class BF16(muon.FP32Muon):
        ns_dtype = torch.bfloat16

    reference, _ = muon_steps(torch.optim.Muon)
    same, _ = muon_steps(BF16)
    assert all(torch.equal(a, b) for a, b in zip(same, reference))  # the step is PyTorch's, bit for bit
    fp32, fp32_muon = muon_steps(muon.FP32Muon)
    assert all(torch.allclose(a, b, atol=2e-3) for a, b in zip(fp32, reference))
    assert not all(torch.equal(a, b) for a, b in zip(fp32, reference))
    singular = torch.linalg.svdvals(muon.orthogonalize(torch.randn(64, 16), (3.4445, -4.7750, 2.0315), 5, 1e-7))
    assert 0.5 < singular.min() and singular.max() < 1.5  # near-orthogonal, as Muon's iteration leaves it
    fresh = torch.optim.Muon([torch.nn.Parameter(torch.zeros(12, 5)), torch.nn.Parameter(torch.zeros(4, 9))])
    fresh.load_state_dict(fp32_muon.state_dict())  # a checkpoint resumes with either
    assert torch.equal(fresh.state_dict()["state"][1]["momentum_buffer"],
                       fp32_muon.state_dict()["state"][1]["momentum_buffer"])


@needs_muon
def test_muon_orthogonalizes_in_bf16_only_where_bf16_is_native(monkeypatch):
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=4, vocab_size=10, padded_vocab_size=16))
    for native, auto in ((True, torch.optim.Muon), (False, muon.FP32Muon)):
        monkeypatch.setattr(muon, "bf16_is_native", lambda device, native=native: native)
        assert type(build_optimizers(model, TrainConfig(optimizer="muon"))[0]) is auto
        assert type(build_optimizers(model, TrainConfig(optimizer="muon", muon_ns_dtype="bf16"))[0]) is torch.optim.Muon
        assert type(build_optimizers(model, TrainConfig(optimizer="muon", muon_ns_dtype="fp32"))[0]) is muon.FP32Muon


@needs_muon
def test_muon_learns_and_follows_the_schedule(tmp_path, tokens):
    metrics = run(tmp_path, tokens, micro_params(optimizer="muon", max_steps=40, eval_interval=40))
    assert metrics["runtime"]["muon_ns_dtype"] == muon.ns_dtype("auto", torch.device("cpu"))
    trained = losses(tmp_path)
    assert trained[-1] < trained[0] - 2.0 and metrics["val"]["loss"] < 9.0  # AdamW: 8.79 here
    state = checkpoint.load(tmp_path / "run/ckpt.pt")
    muon_state, adamw = state["optimizer"]
    assert muon_state["param_groups"][0]["lr"] == pytest.approx(0.02 * adamw["param_groups"][0]["lr"] / 1e-2)


@needs_muon
def test_muon_interrupted_and_resumed_matches_uninterrupted(tmp_path, tokens, monkeypatch):
    params = micro_params(optimizer="muon", grad_accum_steps=2)
    run(tmp_path, tokens, params, "straight")
    interrupt_at(monkeypatch, 5)
    with pytest.raises(TrainingInterrupted):
        run(tmp_path, tokens, params, "resumed")
    monkeypatch.undo()
    run(tmp_path, tokens, params, "resumed")
    assert losses(tmp_path, "resumed") == losses(tmp_path, "straight")


@needs_muon
def test_muon_under_ddp_matches_one_process(tmp_path, tokens):
    from gpt2.train.trainer import train

    train(micro_params(optimizer="muon", micro_batch_size=4), tokens, tmp_path / "one/ckpt.pt",
          tmp_path / "one/reports")
    result = torchrun(tmp_path / "two", tokens, optimizer="muon", micro_batch_size=2)
    assert result.returncode == 0, result.stderr[-3000:]
    # Newton-Schulz (in bf16 where bf16 is native) amplifies all-reduce's last-bit differences a little
    assert train_losses(tmp_path / "two") == pytest.approx(train_losses(tmp_path / "one"), abs=2e-3)


@needs_muon
def test_muon_with_compile(tmp_path, tokens):
    metrics = run(tmp_path, tokens, micro_params(optimizer="muon", compile=True, max_steps=3, eval_interval=3,
                                                 model={"n_layer": 1}))
    assert metrics["runtime"]["compile"] is True and metrics["steps"] == 3
