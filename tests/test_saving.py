"""Checkpoints during training: the background writer, failed saves, never a broken model kept (train/saving.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import micro_params
from training import fake_run, interrupt_at, run

from gpt2.core.errors import Diverged, UserError
from gpt2.run import checkpoint
from gpt2.train import trainer
from gpt2.train.trainer import TrainingInterrupted


def test_weights_broken_by_an_update_are_never_saved_as_the_last_good_checkpoint(tmp_path, tokens, monkeypatch):
    """The update of step 4 breaks the weights after its loss was computed (finite): the step-4 save is refused,
    and the message names step 2, the checkpoint that really is good."""
    original, calls = trainer.optimizer_step, {"n": 0}

    def breaking(model, *args):
        result = original(model, *args)
        calls["n"] += 1
        if calls["n"] == 4:
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("nan")
        return result

    monkeypatch.setattr(trainer, "optimizer_step", breaking)
    with pytest.raises(Diverged, match=r"the weights hold NaN or inf after step 4 \(\d+ tensors, "
                                       r"transformer.wte.weight first\).*this step was not saved; "
                                       r"last checkpoint: .*ckpt.pt \(step 2\); resume it with"):
        run(tmp_path, tokens, micro_params(checkpoint_interval=2))
    assert checkpoint.load(tmp_path / "run/ckpt.pt")["step"] == 2


def test_two_trainings_on_one_checkpoint_do_not_race(tmp_path, tokens):
    with checkpoint.exclusive(tmp_path / "run" / "ckpt.pt"):  # as a second `gpt2 train` would hold it
        with pytest.raises(UserError, match=r"another training is using .*ckpt.pt .*its own --checkpoint"):
            run(tmp_path, tokens, micro_params(max_steps=2))
    assert run(tmp_path, tokens, micro_params(max_steps=2))["steps"] == 2  # released with its holder


def test_background_checkpoint_is_the_state_at_save_time_and_errors_surface(tmp_path, monkeypatch):
    saver = checkpoint.BackgroundSaver()
    weights = torch.zeros(1000)
    saver.save(tmp_path / "ckpt.pt", {"model": {"w": weights}, "step": 1, "nested": [weights]})
    weights += 1  # the next optimizer step, while the writer may still be busy
    saver.wait()
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert state["step"] == 1 and state["model"]["w"].sum() == 0 and state["nested"][0].sum() == 0
    assert state["model"]["w"].data_ptr() == state["nested"][0].data_ptr()  # one tensor, stored once

    def disk_full(path, state):
        raise UserError(f"disk full while writing {path}")

    monkeypatch.setattr(checkpoint, "save", disk_full)
    saver.save(tmp_path / "ckpt.pt", {"step": 2})  # returns at once: the write fails on the thread
    with pytest.raises(UserError, match="disk full"):
        saver.wait()  # ... and the training thread hears of it
    saver.wait()  # reported once


@pytest.mark.parametrize("background", [True, False])
def test_a_failed_save_stops_the_run_at_once_and_keeps_the_last_good_checkpoint(tmp_path, tokens, background,
                                                                                monkeypatch):
    """A run resumed from a good checkpoint (step 5) under a file-size limit (ulimit -f) no checkpoint fits: its
    save at step 8 fails, the run stops at the next step with one line naming the cause and the checkpoint that
    is still good, and leaves no temporary (nor the one a killed writer left)."""
    import resource
    import subprocess
    import sys

    import yaml
    from conftest import MICRO_MODEL, MICRO_TRAIN

    train = {**MICRO_TRAIN, "checkpoint_interval": 4, "async_checkpoint": background}
    interrupt_at(monkeypatch, 4)
    with pytest.raises(TrainingInterrupted):
        run(tmp_path, tokens, micro_params(**train))
    monkeypatch.undo()
    params, ckpt = tmp_path / "params.yaml", tmp_path / "run/ckpt.pt"
    params.write_text(yaml.safe_dump({"model": MICRO_MODEL, "train": train}))
    (ckpt.parent / ".ckpt.pt.tmp-999999").write_bytes(b"a killed writer's partial file")  # PID 999999: dead
    limit = 2**20
    result = subprocess.run([sys.executable, "-m", "gpt2.cli", "train", "--params", str(params), "--tokens",
                             str(tokens), "--checkpoint", str(ckpt), "--out", str(tmp_path / "run/reports")],
                            capture_output=True, text=True, cwd=tmp_path,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert errors[0].startswith("error: the checkpoint of step 8 was not saved: writing ")
    assert "file larger than this system or the shell's file-size limit allows (ulimit -f)" in errors[0]
    assert errors[0].endswith(f"the last good checkpoint, {ckpt} (step 5), is kept for train.resume auto")
    steps = [line for line in result.stderr.splitlines() if line.startswith("step ") and "| loss" in line]
    assert steps[-1].startswith("step 8/12")  # stopped at once (the next step at most), not at step 12
    assert checkpoint.load(ckpt)["step"] == 5 and [p.name for p in ckpt.parent.iterdir()] == ["ckpt.pt"]


def test_async_checkpoint_off_writes_in_the_loop(tmp_path, monkeypatch):
    """train.async_checkpoint: false: the file is complete when save returns, and no thread is started."""
    import threading

    monkeypatch.setattr(threading.Thread, "start", lambda self: pytest.fail("started a writer thread"))
    saver = checkpoint.BackgroundSaver(enabled=False)
    saver.save(tmp_path / "ckpt.pt", {"step": 3})
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 3


def test_a_checkpoint_is_due_every_interval_and_at_the_last_step_unless_saving_is_off(tmp_path):
    from gpt2.run.tracking import Tracker
    from gpt2.train.history import History
    from gpt2.train.saving import Checkpointer

    def checkpointer(**train):
        return Checkpointer(fake_run(**train), tmp_path / "ckpt.pt", History(), Tracker(), elapsed_s=lambda: 0.0,
                            step=0)

    every_4 = checkpointer(checkpoint_interval=4)
    assert [step for step in range(1, 13) if every_4.due(step)] == [4, 8, 12] and every_4.due(5, last=True)
    off = checkpointer(checkpoint_interval=4, save_checkpoint=False)
    assert not any(off.due(step, last=True) for step in range(1, 13))
