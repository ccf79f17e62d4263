"""train.optimizer (AdamW, or Muon for the hidden matrices) and time to a target val loss."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import micro_params
from test_distributed import torchrun, train_losses
from test_train import interrupt_at, losses, run

from gpt2.core.config import TrainConfig
from gpt2.model.gpt import GPT, GPTConfig
from gpt2.run import checkpoint
from gpt2.train import muon
from gpt2.train.optim import build_optimizers
from gpt2.train.trainer import TrainingInterrupted

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch without torch.optim.Muon")


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


def test_muon_orthogonalizes_in_bf16_only_where_bf16_is_native(monkeypatch):
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=4, vocab_size=10, padded_vocab_size=16))
    for native, auto in ((True, torch.optim.Muon), (False, muon.FP32Muon)):
        monkeypatch.setattr(muon, "bf16_is_native", lambda device, native=native: native)
        assert type(build_optimizers(model, TrainConfig(optimizer="muon"))[0]) is auto
        assert type(build_optimizers(model, TrainConfig(optimizer="muon", muon_ns_dtype="bf16"))[0]) is torch.optim.Muon
        assert type(build_optimizers(model, TrainConfig(optimizer="muon", muon_ns_dtype="fp32"))[0]) is muon.FP32Muon


def test_muon_learns_and_follows_the_schedule(tmp_path, tokens):
    metrics = run(tmp_path, tokens, micro_params(optimizer="muon", max_steps=40, eval_interval=40))
    assert metrics["runtime"]["muon_ns_dtype"] == muon.ns_dtype("auto", torch.device("cpu"))
    trained = losses(tmp_path)
    assert trained[-1] < trained[0] - 2.0 and metrics["val"]["loss"] < 9.0  # AdamW: 8.79 here
    state = checkpoint.load(tmp_path / "run/ckpt.pt")
    muon_state, adamw = state["optimizer"]
    assert muon_state["param_groups"][0]["lr"] == pytest.approx(0.02 * adamw["param_groups"][0]["lr"] / 1e-2)


def test_muon_interrupted_and_resumed_matches_uninterrupted(tmp_path, tokens, monkeypatch):
    params = micro_params(optimizer="muon", grad_accum_steps=2)
    run(tmp_path, tokens, params, "straight")
    interrupt_at(monkeypatch, 5)
    with pytest.raises(TrainingInterrupted):
        run(tmp_path, tokens, params, "resumed")
    monkeypatch.undo()
    run(tmp_path, tokens, params, "resumed")
    assert losses(tmp_path, "resumed") == losses(tmp_path, "straight")


def test_muon_under_ddp_matches_one_process(tmp_path, tokens):
    from gpt2.train.trainer import train

    train(micro_params(optimizer="muon", micro_batch_size=4), tokens, tmp_path / "one/ckpt.pt", tmp_path / "one/reports")
    result = torchrun(tmp_path / "two", tokens, optimizer="muon", micro_batch_size=2)
    assert result.returncode == 0, result.stderr[-3000:]
    # Newton-Schulz (in bf16 where bf16 is native) amplifies all-reduce's last-bit differences a little
    assert train_losses(tmp_path / "two") == pytest.approx(train_losses(tmp_path / "one"), abs=2e-3)


def test_muon_with_compile(tmp_path, tokens):
    metrics = run(tmp_path, tokens, micro_params(optimizer="muon", compile=True, max_steps=3, eval_interval=3,
                                                 model={"n_layer": 1}))
    assert metrics["runtime"]["compile"] is True and metrics["steps"] == 3


def test_a_format_1_checkpoint_resumes_exactly(tmp_path, tokens, monkeypatch):
    """The oldest layout: one optimizer state, one RNG state, history rows named as the plot columns."""
    run(tmp_path / "straight", tokens, micro_params())
    interrupt_at(monkeypatch, 3)
    with pytest.raises(TrainingInterrupted):
        run(tmp_path, tokens, micro_params())
    monkeypatch.undo()
    path = tmp_path / "run/ckpt.pt"
    state = checkpoint.load(path)
    names = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm", "perf/step_ms": "step_ms",
             "perf/tokens_per_s": "tokens_per_s", "perf/mfu": "mfu", "mem/rss_gb": "mem_gb", "val/loss": "val_loss"}
    for rows in (state["history"]["train"], state["history"]["val"]):
        rows[:] = [{names.get(k, k): v for k, v in row.items() if k in names or k == "step"} for row in rows]
    state.update(format="gpt2-checkpoint/1", optimizer=state["optimizer"][0], rng=state.pop("rng_per_rank")[0])
    del state["world_size"]
    torch.save(state, path)
    assert run(tmp_path, tokens, micro_params())["steps"] == 12
    assert (tmp_path / "run/reports/plots/train.tsv").read_text().splitlines()[1].split("\t")[:4] == (
        tmp_path / "straight/run/reports/plots/train.tsv").read_text().splitlines()[1].split("\t")[:4]
    straight, resumed = (checkpoint.load(p / "run/ckpt.pt")["history"] for p in (tmp_path / "straight", tmp_path))
    assert [r["train/loss"] for r in resumed["train"]] == [r["train/loss"] for r in straight["train"]]
    scored = [[(r["step"], r["val/loss"]) for r in run["val"]] for run in (resumed, straight)]
    assert scored[0] == scored[1] and all(r["mem/rss_gb"] > 0 for r in resumed["train"])  # format 1 had no loss_se


# --------------------------------------------------------------------------- time to target


def test_reaching_the_target_records_time_tokens_steps_and_stops(tmp_path, tokens, capsys):
    metrics = run(tmp_path, tokens, micro_params(max_steps=40, eval_interval=4, target_val_loss=9.0))
    target = metrics["target"]
    val = [row.split("\t")[:2] for row in (tmp_path / "run/reports/plots/val.tsv").read_text().splitlines()[1:]]
    first = next(int(step) for step, loss in val if float(loss) <= 9.0)
    assert target["reached"] is True and target["steps"] == first == metrics["steps"] < 40
    assert target["tokens"] == first * 4 * 16 and 0 < target["time_s"] <= metrics["wall_s"] + 0.01  # 2 decimals
    assert all(float(loss) > 9.0 for step, loss in val[:-1])  # the run ended at the first eval at or below it
    compared = json.loads((tmp_path / "run/reports/metrics.json").read_text())
    assert compared["target"] == {k: target[k] for k in ("reached", "time_s", "tokens", "steps")}
    assert "reached the target val loss 9.0" in capsys.readouterr().err
    # the checkpoint is a finished run: the same params rebuild the reports, nothing retrains
    again = run(tmp_path, tokens, micro_params(max_steps=40, eval_interval=4, target_val_loss=9.0))
    assert again == metrics


def test_stop_at_target_false_records_it_and_goes_on(tmp_path, tokens):
    metrics = run(tmp_path, tokens, micro_params(max_steps=24, eval_interval=4, target_val_loss=10.2,
                                                 stop_at_target=False))
    assert metrics["steps"] == 24 and metrics["target"]["reached"] and metrics["target"]["steps"] < 24


def test_a_target_never_reached_has_no_numbers(tmp_path, tokens):
    metrics = run(tmp_path, tokens, micro_params(max_steps=8, eval_interval=4, target_val_loss=0.5))
    assert metrics["steps"] == 8
    assert metrics["target"] == {"val_loss": 0.5, "reached": False, "time_s": None, "tokens": None, "steps": None}


def test_time_to_target_counts_the_earlier_sessions_of_a_resumed_run(tmp_path, tokens, monkeypatch):
    params = micro_params(max_steps=40, eval_interval=4, checkpoint_interval=4, target_val_loss=9.0)
    interrupt_at(monkeypatch, 5)
    with pytest.raises(TrainingInterrupted):
        run(tmp_path, tokens, params)
    before = checkpoint.load(tmp_path / "run/ckpt.pt")["history"]["elapsed_s"]
    monkeypatch.undo()
    metrics = run(tmp_path, tokens, params)
    assert before > 0 and metrics["target"]["time_s"] > before


def test_the_val_windows_are_the_same_whatever_the_training_seed(tokens):
    from gpt2.train import evaluator, trainer

    first, second, other = (trainer.build(micro_params(**kw), tokens)
                            for kw in ({"seed": 1}, {"seed": 2}, {"seed": 1, "eval_seed": 5}))
    for setup in (second, other):
        setup.model.load_state_dict(first.model.state_dict())
    assert evaluator.estimate_loss(first, first.val_data) == evaluator.estimate_loss(second, second.val_data)
    assert evaluator.estimate_loss(first, first.val_data) != evaluator.estimate_loss(other, other.val_data)


def test_the_val_loss_standard_error_is_the_spread_of_the_scored_windows(tokens):
    """Against numpy over the same windows' losses, scored one window at a time by the plain path."""
    import numpy as np

    from gpt2.train import evaluator, trainer
    from gpt2.train.loader import BatchSampler

    s = trainer.build(micro_params(eval_windows=12), tokens)
    mean, se = evaluator.estimate_loss(s, s.val_data)
    cfg = s.params.train
    sampler = BatchSampler(s.val_data, 1, s.seq_len, cfg.eval_seed, cfg.batching, s.runtime.device)
    s.model.loss_chunk = 0
    with torch.no_grad():
        windows = [s.model(*sampler.at(np.array([start])))[1].item()
                   for start in evaluator.val_windows(s.val_data.length, s.seq_len, 12, cfg.eval_seed)]
    assert mean == pytest.approx(np.mean(windows), rel=1e-5)
    assert se == pytest.approx(np.std(windows, ddof=1) / np.sqrt(len(windows)), rel=1e-4)


def test_the_val_set_is_the_same_whatever_the_micro_batch_and_the_ranks(tokens, monkeypatch):
    """One model scored with micro-batch 4, 8, 3 (an uneven last batch) and as 2 ranks of micro-batch 4."""
    import dataclasses

    from gpt2.train import distributed, evaluator, trainer
    from gpt2.train.distributed import Dist

    s = trainer.build(micro_params(eval_windows=21), tokens)
    scores = {}
    for micro in (4, 8, 3):
        s.batch = dataclasses.replace(s.batch, micro=micro)
        scores[micro] = evaluator.estimate_loss(s, s.val_data)
    s.batch = dataclasses.replace(s.batch, micro=4)
    partial = {}

    def all_reduce(x, d):  # rank 1 runs first: rank 0's sum gets both ranks' windows
        partial[d.rank] = x.clone()
        return x + partial.get(1 - d.rank, 0)

    monkeypatch.setattr(distributed, "total", all_reduce)
    for rank in (1, 0):
        s.dist = Dist(rank=rank, world=2, grouped=True)
        scores["2 ranks"] = evaluator.estimate_loss(s, s.val_data)
    assert (partial[0] != 0).sum() == 11 and (partial[1] != 0).sum() == 10  # each rank scored its share
    assert len(set(scores.values())) == 1, scores
