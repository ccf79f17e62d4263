"""A run's length: a time budget ends the run, decays the lr over it, and survives a resume."""

from __future__ import annotations

import math

import pytest
from conftest import micro_params
from training import interrupt_at, losses, run

from gpt2.run import checkpoint
from gpt2.train import step_log, trainer
from gpt2.train.length import Budget
from gpt2.train.optim import lr_at
from gpt2.train.history import History
from gpt2.train.trainer import TrainingInterrupted


@pytest.fixture
def one_second_steps(monkeypatch):
    """Every training step takes exactly one second on the run's clock, so a budget ends at a known step."""
    def durations(self):
        marks, self.marks = self.marks, []
        return [1.0] * max(0, len(marks) - 1)

    monkeypatch.setattr(step_log.StepTimer, "durations", durations)


def budget_params(**train):
    return micro_params(**{"max_steps": None, "time_budget_s": 8.0, "warmup_steps": 2, "eval_interval": 3, **train})


def lrs(tmp_path, name="run"):
    rows = (tmp_path / name / "reports/plots/train.tsv").read_text().splitlines()
    return [float(r.split("\t")[2]) for r in rows[1:]]


def test_a_budget_run_trains_until_the_budget_is_spent_and_ends_decayed(tmp_path, tokens, one_second_steps):
    metrics = run(tmp_path, tokens, budget_params(price_per_hour=3600.0))  # a dollar a second: easy to read
    assert metrics["steps"] == 8 and metrics["train_s"] == 8.0  # 8 one-second steps
    cost = metrics["cost"]  # the run's wall time (build and evals too) at the price it was given
    assert cost["usd"] == pytest.approx(3600.0 * cost["device_hours"], rel=1e-3) and cost["usd"] > 0
    assert cost["price_source"] == "train.price_per_hour"
    assert cost["device_hours"] == pytest.approx(metrics["wall_s"] / 3600, abs=0.006 / 3600)  # wall_s: to 10 ms
    rates = lrs(tmp_path)
    assert rates[1] == pytest.approx(1.0e-2)  # step 2: the peak, at the end of the warm-up
    assert rates == sorted(rates[:2]) + sorted(rates[2:], reverse=True)  # then a decay over the budget
    # step 8's lr: 5 of the 6 s after the warm-up spent
    assert rates[-1] == pytest.approx(2.0e-4 + 0.5 * (1 + math.cos(math.pi * 5 / 6)) * (1.0e-2 - 2.0e-4))
    val = (tmp_path / "run/reports/plots/val.tsv").read_text().splitlines()
    assert val[0].split("\t") == ["step", "val_loss", "val_loss_se", "val_bpb", "train_s", "tokens"]
    assert [r.split("\t")[0] for r in val[1:]] == ["3", "6", "8"]  # the interval, and the end of the budget
    assert [float(r.split("\t")[4]) for r in val[1:]] == [3.0, 6.0, 8.0]
    assert metrics["val"]["loss"] is not None


def test_a_resumed_budget_run_continues_the_budget(tmp_path, tokens, monkeypatch, one_second_steps, caplog):
    params = budget_params()
    run(tmp_path, tokens, params, "straight")
    interrupt_at(monkeypatch, 4)
    with pytest.raises(TrainingInterrupted, match=r"SIGINT at step 5 \(5/8 s\)"):
        run(tmp_path, tokens, params, "resumed")
    assert checkpoint.load(tmp_path / "resumed/ckpt.pt")["step"] == 5
    monkeypatch.setattr(trainer, "lr_at", lr_at)  # no more interrupts
    metrics = run(tmp_path, tokens, params, "resumed")
    assert "train: resuming at step 5, 5.0 s of the 8 s budget spent" in caplog.text
    assert metrics["steps"] == 8 and metrics["train_s"] == 8.0  # the budget went on, not a fresh one
    assert losses(tmp_path, "resumed") == losses(tmp_path, "straight")
    assert lrs(tmp_path, "resumed") == lrs(tmp_path, "straight")


def test_the_ranks_agree_on_the_schedule_between_sync_points():
    """Between sync points the time spent is extrapolated from agreed figures only, so every rank computes the
    same lr; the loop syncs where the budget may end."""
    budget = Budget(10.0, warmup_steps=0, history=History(), step=0)
    budget.agree(1, 3.0)  # the first step compiled: 3 s
    budget.agree(4, 6.0)  # then 1 s a step
    assert budget.spent_at(6) == 8.0 and not budget.may_end(7) and budget.may_end(8)
    assert not budget.ends(8)  # the budget ends at a sync point, where the clock is read
    budget.agree(8, 10.2)
    assert budget.ends(8)


def test_a_budget_that_ends_inside_the_timing_warm_up_says_its_speed_includes_it(tmp_path, tokens, one_second_steps,
                                                                                  capfd):
    metrics = run(tmp_path, tokens, budget_params(time_budget_s=3.0, timing_warmup_steps=5))
    assert metrics["steps"] == 3 and metrics["perf"]["timed_steps"] == 3  # the medians fall back on every step
    assert ("warning: every step of this run was in its warm-up (the first 5 of a session, "
            "train.timing_warmup_steps): its speed figures include compilation") in (err := capfd.readouterr().err)
    assert "train longer (a larger train.time_budget_s)" in err
    run(tmp_path, tokens, micro_params(max_steps=2, timing_warmup_steps=5), name="steps")
    assert "train longer (train.max_steps above 5) to time its steps" in capfd.readouterr().err


def test_a_stop_in_the_step_that_spends_the_budget_says_the_run_is_finished(tmp_path, tokens, one_second_steps,
                                                                          monkeypatch, capfd):
    """Ctrl-C while the last step of the budget runs: the run is finished and saved, and the rerun rebuilds its
    reports from it, saying so once."""
    interrupt_at(monkeypatch, 7)  # step 8 of 8 one-second steps (lr_at is called with the 0-based step)
    with pytest.raises(TrainingInterrupted, match=r"at step 8 \(8/8 s\); the run is finished and saved to .*ckpt.pt; "
                                                  r"run the same command again to write its reports"):
        run(tmp_path, tokens, budget_params())
    monkeypatch.undo()
    capfd.readouterr()
    assert run(tmp_path, tokens, budget_params())["steps"] == 8
    assert capfd.readouterr().err.count("is a finished run of these params and data (8 steps)") == 1
