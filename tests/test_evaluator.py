"""Val loss during training: the same windows whatever the seed, micro-batch or ranks; time to a target loss
(train/evaluator.py)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fake_token_bytes, micro_params
from training import interrupt_at, run

from gpt2.model.head import Head
from gpt2.run import checkpoint
from gpt2.train.trainer import TrainingInterrupted


def test_reaching_the_target_records_time_tokens_steps_and_stops(tmp_path, tokens, capsys):
    metrics = run(tmp_path, tokens, micro_params(max_steps=40, eval_interval=4, target_val_loss=9.0))
    target = metrics["target"]
    val = [row.split("\t")[:2] for row in (tmp_path / "run/reports/plots/val.tsv").read_text().splitlines()[1:]]
    first = next(int(step) for step, loss in val if float(loss) <= 9.0)
    assert target["reached"] is True and target["steps"] == first == metrics["steps"] < 40
    assert target["tokens"] == first * 4 * 16 and 0 < target["time_s"] <= metrics["wall_s"] + 0.01  # 2 decimals
    assert all(float(loss) > 9.0 for step, loss in val[:-1])  # the run ended at the first eval at or below it
    compared = json.loads((tmp_path / "run/reports/metrics.json").read_text())
    assert compared["target"] == {k: target[k] for k in ("reached", "time_s", "tokens", "steps", "train_s")}
    train_s = next(float(r.split("\t")[4]) for r in (tmp_path / "run/reports/plots/val.tsv").read_text()
                   .splitlines()[1:] if int(r.split("\t")[0]) == first)
    assert 0 < target["train_s"] == train_s < target["time_s"]  # the steps' time alone: evals and build left out
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
    assert metrics["target"] == {"val_loss": 0.5, "reached": False, "time_s": None, "tokens": None, "steps": None,
                                 "train_s": None}


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
    mean, se, bpb = evaluator.estimate_loss(s, s.val_data)
    cfg = s.params.train
    sampler = BatchSampler(s.val_data, 1, s.seq_len, cfg.eval_seed, cfg.batching, s.runtime.device)
    s.model.set_head(Head())
    windows, text = [], 0
    with torch.no_grad():
        for start in evaluator.val_windows(s.val_data.length, s.seq_len, 12, cfg.eval_seed):
            x, y = sampler.at(np.array([start]))
            windows.append(s.model(x, y)[1].item())
            text += int(fake_token_bytes()[y.numpy()].sum())
    assert mean == pytest.approx(np.mean(windows), rel=1e-5)
    assert se == pytest.approx(np.std(windows, ddof=1) / np.sqrt(len(windows)), rel=1e-4)
    # bits per byte: every scored token's nats, over ln 2 times the bytes of text the targets stand for
    assert bpb == pytest.approx(sum(windows) * s.seq_len / (np.log(2) * text), rel=1e-5)
    (tokens / "token_bytes.npy").unlink()  # a token folder an older version wrote: no bytes, no bits per byte
    older = trainer.build(micro_params(eval_windows=12), tokens)
    assert evaluator.estimate_loss(older, older.val_data)[2] is None


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
    assert (partial[0][0] != 0).sum() == 11 and (partial[1][0] != 0).sum() == 10  # each rank scored its share
    assert len(set(scores.values())) == 1, scores


def test_held_out_windows_are_scored_after_the_last_step_on_text_no_val_window_covers(tmp_path, tokens):
    """train.holdout_windows: text no verdict reads, where a comparison's --apply confirms a quality win."""
    import numpy as np

    from gpt2.train.evaluator import holdout_windows, val_windows

    taken = val_windows(5000, 16, 40, 1337)
    held = holdout_windows(5000, 16, 40, 1337, taken)
    assert len(held) == 40 and min(abs(int(h) - int(t)) for h in held for t in taken) > 16  # no token shared
    assert np.array_equal(held, holdout_windows(5000, 16, 40, 1337, taken))  # the same text in every run
    summary = run(tmp_path, tokens, micro_params(max_steps=4, eval_interval=2, holdout_windows=6))
    assert summary["val"]["holdout_loss"] > 0 and summary["val"]["holdout_loss_se"] > 0
    compared = json.loads((tmp_path / "run/reports/metrics.json").read_text())  # dvc exp show's columns: unchanged
    assert "holdout_loss" not in compared["val"]
    assert summary["val"]["holdout_loss"] != summary["val"]["loss"]
    assert "holdout_loss" not in run(tmp_path, tokens, micro_params(max_steps=4, eval_interval=2), "off")["val"]
