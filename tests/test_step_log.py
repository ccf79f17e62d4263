"""Sync points: deferred reads log the same numbers and still catch a NaN loss; the ETA (train/step_log.py)."""

from __future__ import annotations

import pytest
from conftest import micro_params
from training import losses, run

from gpt2.core.errors import Diverged
from gpt2.train import step_log, trainer


def test_nan_loss_stops_with_step_and_last_checkpoint(tmp_path, tokens, monkeypatch):
    original = trainer.backward_micro_batches
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        loss = original(*args, **kwargs)
        return loss * float("nan") if calls["n"] == 6 else loss

    monkeypatch.setattr(trainer, "backward_micro_batches", poisoned)
    with pytest.raises(Diverged, match=r"loss is nan at step 6: training diverged; last checkpoint: .*ckpt.pt "
                                       r"\(step 4\)") as raised:  # steps counted from 1, as in the log lines
        run(tmp_path, tokens, micro_params(checkpoint_interval=2))
    assert str(raised.value).endswith("resume it with a lower train.lr or a lower train.grad_clip")  # no fp16 in fp32


def test_a_checkpoint_saved_after_the_loss_rose_is_not_advised_for_resuming(tmp_path, tokens, monkeypatch):
    """The loss climbs at steps 3-4 (the step-4 checkpoint holds the climb), then is NaN at step 6: resuming from
    step 4 with a lower lr would likely diverge again, so the advice is to start afresh."""
    original = trainer.backward_micro_batches
    calls = {"n": 0}

    def climbing(*args, **kwargs):
        calls["n"] += 1
        loss = original(*args, **kwargs)
        return loss * float("nan") if calls["n"] == 6 else loss * 2 if calls["n"] in (3, 4) else loss

    monkeypatch.setattr(trainer, "backward_micro_batches", climbing)
    with pytest.raises(Diverged, match=r"last checkpoint: .*ckpt.pt \(step 4\); that checkpoint's loss had "
                                       r"already risen \(\d+\.\d+ at step 4, from \d+\.\d+ at step \d\), so "
                                       r"resuming from it may diverge again: start afresh with a lower train.lr .*"
                                       r"\(train.resume: never\)"):
        run(tmp_path, tokens, micro_params(checkpoint_interval=2))


def test_deferred_syncs_log_the_same_numbers_and_still_catch_a_nan(tmp_path, tokens, monkeypatch):
    """CUDA's loop reads the device only at log, eval and checkpoint steps: same losses, every step timed."""
    params = micro_params(log_interval=4, eval_interval=6, checkpoint_interval=100)
    every = run(tmp_path, tokens, params, "every")
    monkeypatch.setattr(step_log, "sync_every_step", lambda runtime: False)
    deferred = run(tmp_path, tokens, params, "deferred")
    assert losses(tmp_path, "deferred") == losses(tmp_path, "every")  # rows at steps 1, 4, 8, 12
    assert deferred["val"] == every["val"] and deferred["perf"]["timed_steps"] == every["perf"]["timed_steps"] == 11
    original, calls = trainer.backward_micro_batches, {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        loss = original(*args, **kwargs)
        return loss * float("nan") if calls["n"] == 2 else loss

    monkeypatch.setattr(trainer, "backward_micro_batches", poisoned)
    with pytest.raises(Diverged, match=r"loss is nan at step 2: "):  # found at step 4's sync, named by its step
        run(tmp_path, tokens, params, "nan")


def test_the_eta_leaves_out_the_first_step_which_holds_the_warm_up(tmp_path, tokens, monkeypatch, caplog):
    """A compiled run's first step takes minutes: an ETA read from it would promise hours for a run of minutes."""
    import logging
    import re
    import time

    original, calls = trainer.backward_micro_batches, {"n": 0}

    def slow_first(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            time.sleep(2.0)  # as a first step that compiles
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer, "backward_micro_batches", slow_first)
    with caplog.at_level(logging.INFO, logger="gpt2.train"):
        run(tmp_path, tokens, micro_params(max_steps=12))
    lines = {int(m.group(1)): m.group(0) for m in re.finditer(r"step (\d+)/12 \| loss .*", caplog.text)}
    assert "ETA" not in lines[1]
    eta = re.search(r"ETA (\d+):(\d\d):(\d\d)", lines[2])
    hours, minutes, seconds = map(int, eta.groups())
    assert 3600 * hours + 60 * minutes + seconds < 10  # 10 steps of a micro model, not 10 × the first's 2 s
