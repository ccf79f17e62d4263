"""Ctrl-C, SIGTERM and a dead parent: the step ends, the checkpoint is saved, the run resumes exactly
(train/signals.py)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import micro_params
from training import interrupt_at, losses, run

from gpt2.run import checkpoint
from gpt2.train import step_log
from gpt2.train.trainer import TrainingInterrupted


def test_interrupted_and_resumed_run_matches_an_uninterrupted_one_exactly(tmp_path, tokens, monkeypatch):
    params = micro_params(grad_accum_steps=2, model={"dropout": 0.1})  # dropout: the torch RNG must resume too
    run(tmp_path, tokens, params, "straight")
    interrupt_at(monkeypatch, 5)
    with pytest.raises(TrainingInterrupted, match=r"SIGINT at step 6/12; checkpoint saved .*resume") as info:
        run(tmp_path, tokens, params, "resumed")
    assert info.value.exit_code == 130
    assert checkpoint.load(tmp_path / "resumed/ckpt.pt")["step"] == 6
    assert not (tmp_path / "resumed/reports").exists()  # no partial reports
    monkeypatch.undo()
    metrics = run(tmp_path, tokens, params, "resumed")
    assert losses(tmp_path, "resumed") == losses(tmp_path, "straight")  # every step, bit for bit
    assert metrics["steps"] == 12
    assert metrics["perf"]["timed_steps"] == 10  # each session's warm-up step (it compiles again) is left out


def test_a_signal_stops_after_this_step_where_syncs_are_rare(tmp_path, tokens, monkeypatch):
    """Syncing only at log steps, as on CUDA: SIGTERM in step 6 of 12 still saves step 6, not the next log step."""
    monkeypatch.setattr(step_log, "sync_every_step", lambda runtime: False)
    interrupt_at(monkeypatch, 5, signal.SIGTERM)
    with pytest.raises(TrainingInterrupted, match="SIGTERM at step 6/12"):
        run(tmp_path, tokens, micro_params(log_interval=50, eval_interval=50))
    assert checkpoint.load(tmp_path / "run/ckpt.pt")["step"] == 6


@pytest.mark.parametrize("through_a_shell", [False, True])
def test_a_trainer_whose_parent_is_killed_saves_and_stops(tmp_path, tokens, through_a_shell):
    """DVC (or a scheduler) killed: its trainer, started directly or through `sh -c` as DVC starts stages,
    stops as on SIGTERM (saves, exits) instead of training on orphaned."""
    import shlex
    import subprocess
    import sys

    import psutil
    import yaml
    from conftest import MICRO_MODEL, MICRO_TRAIN

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"model": MICRO_MODEL, "train": {**MICRO_TRAIN, "max_steps": 100_000}}))
    command = [sys.executable, "-m", "gpt2.cli", "train", "--params", str(params), "--tokens", str(tokens),
               "--checkpoint", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "r")]
    if through_a_shell:
        command = ["/bin/sh", "-c", shlex.join(command)]
    log = tmp_path / "train.log"
    env = {**os.environ, "DVC_EXP_NAME": "an-experiment"}  # as under `dvc exp run`, whose DVC was killed
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys\n"
                               f"with open({str(log)!r}, 'w') as log:\n"
                               f"    child = subprocess.Popen({command!r}, stderr=log, env={env!r})\n"
                               "    print(child.pid, flush=True)\n    child.wait()\n"],
                              stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    while "| loss " not in log.read_text():  # it trains
        time.sleep(0.2)
    parent.kill()
    parent.wait()
    trainer_process = child.children()[0] if through_a_shell else child
    trainer_process.wait(timeout=60)
    said = log.read_text()
    assert "interrupted by SIGTERM at step" in said and said.count("SIGTERM: finishing the current step") == 1
    assert "DVC itself was stopped, and may have left git on a detached HEAD: `git checkout -`" in said
    assert 0 < checkpoint.load(tmp_path / "ckpt.pt")["step"] < 100_000


def test_a_second_ctrl_c_while_the_stop_is_saved_waits_for_the_checkpoint(tmp_path, tokens, monkeypatch, capsys):
    """Ctrl-C twice, the second while the first's checkpoint is written: the write ends, whole, and the run stops
    as after one (it used to abort mid-write: exit 134 and half a temporary file)."""
    original = checkpoint.save

    def slow_save(path, state):
        os.kill(os.getpid(), signal.SIGINT)  # the impatient second Ctrl-C, mid-write
        time.sleep(0.2)
        original(path, state)

    interrupt_at(monkeypatch, 3)
    monkeypatch.setattr(checkpoint, "save", slow_save)
    with pytest.raises(TrainingInterrupted, match="interrupted by SIGINT at step 4/12"):
        run(tmp_path, tokens, micro_params(checkpoint_interval=100))
    assert "the checkpoint is being written; the run stops as soon as it is" in capsys.readouterr().err
    assert checkpoint.load(tmp_path / "run/ckpt.pt")["step"] == 4
    assert [f.name for f in (tmp_path / "run").iterdir() if f.name.startswith(".")] == []


def test_sigterm_exit_code(tmp_path, tokens, monkeypatch):
    interrupt_at(monkeypatch, 2, signal.SIGTERM)
    with pytest.raises(TrainingInterrupted, match="SIGTERM") as info:
        run(tmp_path, tokens, micro_params())
    assert info.value.exit_code == 143


def test_a_signal_in_the_last_step_stops_a_finished_run_and_says_so(tmp_path, tokens, monkeypatch, caplog):
    """The stop comes after the last step's work: the process still stops as asked (DVC then stops the pipeline),
    but the run is finished and saved, and it says so instead of "run the same command again to resume": the rerun
    writes the reports from the checkpoint, training nothing."""
    interrupt_at(monkeypatch, 11)  # while step 12 of 12 runs
    with pytest.raises(TrainingInterrupted, match=r"at step 12/12; the run is finished and saved to .*ckpt.pt; run "
                                                  r"the same command again to write its reports \(nothing is trained"):
        run(tmp_path, tokens, micro_params(max_steps=12))
    monkeypatch.undo()
    summary = run(tmp_path, tokens, micro_params(max_steps=12))
    assert summary["steps"] == 12 and "is a finished run of these params and data (12 steps)" in caplog.text
    assert (tmp_path / "run/reports/summary.json").is_file()


def test_a_second_ctrl_c_before_the_save_aborts_and_says_what_is_lost(caplog, monkeypatch):
    """The first Ctrl-C asks for a stop after the step; a second one before its save aborts, and the command's
    last line says what that cost instead of "no output was written" (an earlier checkpoint may be on disk)."""
    from gpt2.core.cli import user_errors
    from gpt2.train.signals import stop_on_signals

    @user_errors
    def command() -> None:
        with stop_on_signals() as request:
            os.kill(os.getpid(), signal.SIGINT)
            assert request.asked
            os.kill(os.getpid(), signal.SIGINT)
            pytest.fail("the second Ctrl-C did not abort")

    with pytest.raises(SystemExit) as stopped:
        command()
    assert stopped.value.code == 130
    assert "aborted by a second Ctrl-C, without saving: the steps since the last checkpoint" in caplog.text
    assert "no output was written" not in caplog.text
    from gpt2.train.signals import aborted_without_saving

    monkeypatch.setenv("DVC_EXP_NAME", "exp-1")  # DVC restores its baseline's checkpoint before the next run
    assert aborted_without_saving().endswith("this run is lost (`dvc exp run` puts its baseline's checkpoint back "
                                             "before it runs again; one Ctrl-C saves the run and keeps it to resume)")


def test_a_run_under_resume_never_says_how_to_resume_it(tmp_path, tokens, monkeypatch):
    """Stopped, a run under train.resume: never says to run again with train.resume: auto: the same command again
    would start afresh and set the checkpoint just saved aside. With it, the run continues from that checkpoint."""
    interrupt_at(monkeypatch, 5)
    with pytest.raises(TrainingInterrupted, match=r"SIGINT at step 6/12; checkpoint saved to .*; to resume it, run "
                                                  r"again with train.resume: auto \(this run's train.resume: never "
                                                  r"starts afresh\)"):
        run(tmp_path, tokens, micro_params(resume="never"))
    monkeypatch.undo()
    assert run(tmp_path, tokens, micro_params(resume="auto"))["steps"] == 12
    assert checkpoint.load(tmp_path / "run/ckpt.pt")["step"] == 12


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the lost one, printed by Python
def test_a_ctrl_c_python_loses_while_a_command_starts_still_stops_it(tmp_path, tokens, caplog):
    """A Ctrl-C in an import can come out as another error (a half-imported numpy recursing), and one in a
    finalizer is printed as "Exception ignored" and lost: either way the command ends as interrupted (130), and a
    training that goes on stops before it writes anything."""
    import gc

    from gpt2.core.cli import user_errors

    @user_errors
    def echoed() -> None:
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:
            raise RecursionError("maximum recursion depth exceeded") from None

    with pytest.raises(SystemExit) as stopped:
        echoed()
    assert stopped.value.code == 130 and "interrupted (Ctrl-C; it surfaced as RecursionError)" in caplog.text

    class Finalized:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGINT)  # raised inside __del__: Python prints it and goes on

    @user_errors
    def starts_training() -> None:
        Finalized()
        gc.collect()
        run(tmp_path, tokens, micro_params(max_steps=2))

    caplog.clear()
    with pytest.raises(SystemExit) as stopped:
        starts_training()
    assert stopped.value.code == 130 and "interrupted; no output was written" in caplog.text
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []  # no checkpoint, no reports

    from gpt2.train.signals import stop_on_signals

    @user_errors
    def lost_once_the_run_is_tracked() -> bool:
        Finalized()
        gc.collect()
        with stop_on_signals() as request:  # the loop's handling: a first Ctrl-C, a stop after the step
            return request.asked

    assert lost_once_the_run_is_tracked()

    @user_errors
    def not_interrupted() -> None:
        raise RecursionError("a bug's own")

    with pytest.raises(RecursionError):  # without a Ctrl-C an error is the bug it is, with its traceback
        not_interrupted()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own handler is back
