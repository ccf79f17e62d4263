"""The batch of a run: train.batch_tokens, micro_batch_size auto against a (faked) device memory, the memory model
of Muon's state and of FSDP's shards."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import MICRO_MODEL, micro_params

from gpt2.core import memory_model
from gpt2.core.config import ParamError
from gpt2.core.errors import UserError
from gpt2.core.tokens import read_meta
from gpt2.measure import plan
from gpt2.model.gpt import GPT, gpt_config
from gpt2.train import batch as batching
from gpt2.train.batch import Recipe, resolve_batch
from gpt2.train.loader import BatchSampler, TokenSplit
from gpt2.train.optim import build_optimizers
from gpt2.train.trainer import train

CUDA = torch.device("cuda", 0)


def gpt2_recipe(optimizer: str = "adamw", shards: int = 1) -> Recipe:
    return Recipe(memory_model.shape("gpt2"), 1024, amp=True, flash=True, loss_chunk=8192, optimizer=optimizer,
                  shards=shards)


def fake_free_memory(monkeypatch, gb: float) -> None:
    monkeypatch.setattr(batching, "free_bytes", lambda device: int(gb * 1e9))


def test_batch_tokens_sets_the_accumulation_and_must_split_evenly():
    cfg = micro_params(batch_tokens=16 * 1024 * 8, micro_batch_size=4).train
    got = resolve_batch(cfg, gpt2_recipe(), world=2, device=torch.device("cpu"))
    assert (got.micro, got.accum) == (4, 16)  # 128 sequences: 64 per rank, 4 at a time
    with pytest.raises(UserError, match=r"multiple of 1024 tokens × 2 rank\(s\) = 2,048; "
                                        r"the nearest are 129,024 and 131,072"):
        resolve_batch(micro_params(batch_tokens=130_000).train, gpt2_recipe(), world=2, device=torch.device("cpu"))
    with pytest.raises(UserError, match=r"is 6 sequences per rank, which train.micro_batch_size 4 does not "
                                        r"divide.*6, 3, 2"):
        resolve_batch(micro_params(batch_tokens=6 * 1024, micro_batch_size=4).train, gpt2_recipe(), 1,
                      torch.device("cpu"))


def test_auto_on_a_cpu_keeps_the_default_micro_batch():
    cfg = micro_params(batch_tokens=48 * 1024, micro_batch_size="auto").train
    got = resolve_batch(cfg, gpt2_recipe(), world=1, device=torch.device("cpu"))
    assert (got.micro, got.accum) == (8, 6) and "no device memory" in got.why
    odd = resolve_batch(micro_params(batch_tokens=21 * 1024, micro_batch_size="auto").train, gpt2_recipe(), 1,
                        torch.device("cpu"))
    assert (odd.micro, odd.accum) == (7, 3)  # the largest divisor of 21 up to 8


@pytest.mark.parametrize("gb", [24, 40, 80])
def test_auto_takes_the_largest_micro_batch_that_fits_and_keeps_the_batch(monkeypatch, gb):
    fake_free_memory(monkeypatch, gb)
    cfg = micro_params(batch_tokens=512 * 1024, micro_batch_size="auto").train
    recipe = gpt2_recipe()
    got = resolve_batch(cfg, recipe, world=1, device=CUDA)
    budget = (1 - cfg.memory_margin) * gb * 1e9
    assert got.micro * got.accum == 512  # the batch, and so the result, is the card's choice of neither
    assert recipe.bytes(got.micro) <= budget < recipe.bytes(2 * got.micro)  # 512's divisors are powers of two
    assert f"{2 * got.micro} would need" in got.why and "train.memory_margin 0.15" in got.why
    cautious = resolve_batch(micro_params(batch_tokens=512 * 1024, micro_batch_size="auto", memory_margin=0.6).train,
                             recipe, world=1, device=CUDA)
    assert cautious.micro < got.micro and recipe.bytes(cautious.micro) <= 0.4 * gb * 1e9  # a larger margin, less used


def test_auto_counts_the_fp8_heads_gradients(monkeypatch):
    """On an H200 (about 140 GB free) every switch fits 256 sequences of 1024 (102.9 GB measured); the FP8 head holds
    two bytes more per token and vocabulary column (26 GB at 256), so auto takes 128."""
    fake_free_memory(monkeypatch, 140)
    cfg = micro_params(batch_tokens=512 * 1024, micro_batch_size="auto").train
    plain = resolve_batch(cfg, gpt2_recipe(), 1, CUDA).micro
    fp8 = resolve_batch(cfg, dataclasses.replace(gpt2_recipe(), fp8_head=True), 1, CUDA).micro
    assert (plain, fp8) == (256, 128)


def test_auto_counts_muon_state_and_fsdp_shards(monkeypatch):
    fake_free_memory(monkeypatch, 12)
    cfg = micro_params(batch_tokens=512 * 1024, micro_batch_size="auto").train
    adamw, muon = (resolve_batch(cfg, gpt2_recipe(o), 1, CUDA).micro for o in ("adamw", "muon"))
    assert muon >= adamw
    fake_free_memory(monkeypatch, 2)
    with pytest.raises(UserError, match=r"not even one sequence of 1024 tokens fits.*train.distributed fsdp"):
        resolve_batch(cfg, gpt2_recipe(), 1, CUDA)
    xl = Recipe(memory_model.shape("gpt2-xl"), 1024, True, True, 8192, "adamw", shards=4)
    fake_free_memory(monkeypatch, 24)
    sharded = resolve_batch(micro_params(batch_tokens=64 * 1024, micro_batch_size="auto").train, xl, 4, CUDA)
    assert sharded.micro >= 1  # GPT-2 XL on 4 × 24 GB with fsdp; one 24 GB card cannot hold its AdamW state


def test_memory_model_of_muon_matches_the_optimizer_split():
    """Muon's one buffer covers exactly the parameters build_optimizers gives it; AdamW's two the rest."""
    with torch.device("meta"):
        model = GPT(gpt_config("gpt2", {}, 50257, True, "flash"))
    muon, adamw = build_optimizers(model, micro_params(optimizer="muon").train)
    s = memory_model.shape("gpt2")
    assert memory_model.hidden_matrices(s) == sum(p.numel() for g in muon.param_groups for p in g["params"])
    saved = (memory_model.memory(s, 1, 1024, True, True).optimizer
             - memory_model.memory(s, 1, 1024, True, True, optimizer="muon").optimizer)
    assert saved == 4 * memory_model.hidden_matrices(s)


def test_fsdp_divides_the_states_and_gathers_two_blocks():
    s = memory_model.shape("gpt2-xl")
    one, four = memory_model.memory(s, 1, 1024, True, True), memory_model.memory(s, 1, 1024, True, True, shards=4)
    assert four.weights == one.weights / 4 and four.optimizer == one.optimizer / 4
    assert four.activations == one.activations and four.unsharded > 0 == one.unsharded
    p = plan.plan("gpt2-xl", 1e9, "l4", gpus=4, distributed="fsdp")
    assert p["largest_micro_batch"]["amp flash"] >= 1 == 1 + plan.plan("gpt2-xl", 1e9, "l4", gpus=4)[
        "largest_micro_batch"]["amp flash"]


def test_a_steps_windows_do_not_depend_on_how_it_is_split(tokens):
    """What makes auto safe: micro-batch × accumulation × ranks is one draw from the seeded stream."""
    data = TokenSplit(tokens, "train", "preload")

    def step(micro: int, accum: int, world: int) -> list[np.ndarray]:
        samplers = [BatchSampler(data, micro, 16, 7, "vectorized", torch.device("cpu"), r, world) for r in range(world)]
        return sorted(x.numpy().tobytes() for _ in range(accum) for s in samplers for x in s.next()[0])

    assert step(8, 1, 1) == step(4, 2, 1) == step(2, 2, 2) == step(1, 4, 2)


def test_params_refuse_auto_without_a_batch_and_muon_under_fsdp():
    with pytest.raises(ParamError, match="auto together with train.batch_tokens"):
        micro_params(micro_batch_size="auto")
    with pytest.raises(ParamError, match=r"train.grad_accum_steps = 2 .* 1 when train.batch_tokens is set"):
        micro_params(batch_tokens=1024, grad_accum_steps=2)
    with pytest.raises(ParamError, match="use ddp for Muon"):
        micro_params(distributed="fsdp", optimizer="muon")
    with pytest.raises(ParamError, match=r"micro_batch_size = 'big' has the wrong type; expected an integer or auto"):
        micro_params(micro_batch_size="big")
    with pytest.raises(ParamError, match=r"micro_batch_size = 0 is not allowed; expected an integer >= 1 or auto"):
        micro_params(micro_batch_size=0)


def test_training_with_auto_on_a_faked_device_trains_the_same_batch(tmp_path, tokens, monkeypatch, caplog):
    """On a CPU whose memory is faked small, auto picks a smaller micro-batch; the run is the one of micro-batch 8."""
    whole = train(micro_params(micro_batch_size=8), tokens, tmp_path / "a/ckpt.pt", tmp_path / "a/reports")
    model = GPT(gpt_config("tiny", MICRO_MODEL, read_meta(tokens)["vocab_size"], True, "flash"))
    recipe = Recipe(batching.model_shape(model), 16, False, True, 8192, "adamw", 1)
    free = (recipe.bytes(2) + recipe.bytes(4)) / 2 / 0.85  # between micro-batch 2 and 4, margin 0.15
    monkeypatch.setattr(batching, "free_bytes", lambda device: int(free))
    caplog.set_level("INFO")
    split = train(micro_params(micro_batch_size="auto", batch_tokens=8 * 16), tokens, tmp_path / "b/ckpt.pt",
                  tmp_path / "b/reports")
    assert (split["runtime"]["micro_batch_size"], split["runtime"]["grad_accum_steps"]) == (2, 4)
    assert "micro-batch 2 × 16 tokens × accumulation 4 × 1 rank(s); micro-batch auto: the memory model" in caplog.text
    assert split["tokens"] == whole["tokens"]
    assert train_losses(tmp_path / "b") == pytest.approx(train_losses(tmp_path / "a"), abs=1e-4)
    assert split["val"]["loss"] == pytest.approx(whole["val"]["loss"], abs=1e-4)


def train_losses(folder) -> list[float]:
    rows = (folder / "reports/plots/train.tsv").read_text().splitlines()[1:]
    return [float(r.split("\t")[1]) for r in rows]


def test_a_gpu_sized_batch_on_a_cpu_is_warned_about(tokens):
    from gpt2.train import trainer
    from gpt2.train.describe import inert_switch_warnings

    s = trainer.build(micro_params(batch_tokens=64 * 4 * 16, micro_batch_size=4), tokens)
    assert any("one step is 64 micro-batches of 4 × 16 tokens (4,096 tokens) on cpu" in w and "Ctrl-C waits" in w
               for w in inert_switch_warnings(s))
    assert not any("micro-batches of" in w for w in inert_switch_warnings(trainer.build(micro_params(), tokens)))
