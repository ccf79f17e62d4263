"""An interrupted `dvc exp run` keeps its checkpoint and resumes when run again (train/interrupted.py)."""

from __future__ import annotations

import pytest
from conftest import micro_params
from training import fake_run, interrupt_at, losses, run

from gpt2.train import trainer
from gpt2.train.trainer import TrainingInterrupted


def test_an_interrupted_experiment_resumes_though_dvc_restored_its_baseline_checkpoint(tmp_path, tokens, monkeypatch,
                                                                                      capsys):
    """`dvc exp run -S ...` interrupted, then run again: DVC first puts its baseline's (finished) checkpoint back
    in checkpoints/. The interrupted run, kept in .dvc/tmp, continues, exactly."""
    import shutil

    (tmp_path / ".dvc").mkdir()
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.setenv("DVC_EXP_NAME", "my-exp")
    run(tmp_path, tokens, micro_params(max_steps=4), "baseline")  # the committed, finished run of other params
    run(tmp_path, tokens, micro_params(), "straight")
    interrupt_at(monkeypatch, 5)
    with pytest.raises(TrainingInterrupted, match=r"checkpoint saved to .*run/ckpt.pt and copied to "
                                                  r"\.dvc/tmp/gpt2-interrupted/ \(DVC puts its baseline's checkpoint "
                                                  r"back in .*run/ckpt.pt before a run; the next run of these params "
                                                  r"resumes from the copy\); run the same `dvc exp run` command again "
                                                  r"to resume it"):
        run(tmp_path, tokens, micro_params())
    monkeypatch.undo()
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    shutil.copy(tmp_path / "baseline/ckpt.pt", tmp_path / "run/ckpt.pt")  # what dvc exp run does before running
    assert run(tmp_path, tokens, micro_params())["steps"] == 12
    assert "resuming the interrupted run of these params and data kept in" in capsys.readouterr().err
    assert losses(tmp_path) == losses(tmp_path, "straight")
    assert not (tmp_path / ".dvc/tmp/gpt2-interrupted").exists()  # finished: no longer kept, nor its folder


def test_an_experiment_killed_outright_resumes_from_its_last_save(tmp_path, tokens, monkeypatch, capsys):
    """`kill -9` on the trainer under `dvc exp run`: no handler runs, and DVC puts its baseline's checkpoint back
    before the same command runs again. Each save under `dvc exp run` is kept (a hard link), so the run goes on
    from its last save, exactly; the finished run keeps nothing. A copy whose run still trains (a queued or
    parallel experiment) is taken up by no other run."""
    import shutil

    from gpt2.core.digest import file_md5

    (tmp_path / ".dvc").mkdir()
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.setenv("DVC_EXP_NAME", "my-exp")
    run(tmp_path, tokens, micro_params(max_steps=4), "baseline")  # the committed, finished run of other params
    run(tmp_path, tokens, micro_params(checkpoint_interval=4), "straight")
    original = trainer.optimizer_step

    def killed_in_step_7(*args):
        if len(losses_so_far) == 6:
            raise SystemExit(-9)  # nothing of the trainer's runs after it, as after SIGKILL
        losses_so_far.append(1)
        return original(*args)

    losses_so_far: list[int] = []
    monkeypatch.setattr(trainer, "optimizer_step", killed_in_step_7)
    with pytest.raises(SystemExit):  # saves written in line: the step-4 save is kept before step 7 starts
        run(tmp_path, tokens, micro_params(checkpoint_interval=4, async_checkpoint=False))
    monkeypatch.setattr(trainer, "optimizer_step", original)
    [kept] = (tmp_path / ".dvc/tmp/gpt2-interrupted").glob("*.pt")
    assert kept.stat().st_ino == (tmp_path / "run/ckpt.pt").stat().st_ino  # the step-4 save, linked: no 2nd write
    from gpt2.train import interrupted

    assert not interrupted._running(kept)  # its writer is gone (here: this process, which never takes its own)
    (tmp_path / "run/ckpt.pt").unlink()  # what dvc exp run does before running: the file deleted, the baseline's
    shutil.copy(tmp_path / "baseline/ckpt.pt", tmp_path / "run/ckpt.pt")  # written in its place
    assert file_md5(kept) != file_md5(tmp_path / "run/ckpt.pt")
    capsys.readouterr()
    assert run(tmp_path, tokens, micro_params(checkpoint_interval=4))["steps"] == 12
    err = capsys.readouterr().err
    assert "resuming the interrupted run of these params and data kept in" in err and "resuming at step 4/12" in err
    assert losses(tmp_path) == losses(tmp_path, "straight")
    assert not (tmp_path / ".dvc/tmp/gpt2-interrupted").exists()  # finished: no longer kept, nor its folder
    import json
    import subprocess
    import sys

    from training import fake_run

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # another run, still training
    try:
        s = fake_run(lr=5.0e-3)
        kept = interrupted._exact(tmp_path / ".dvc/tmp/gpt2-interrupted", s)
        kept.parent.mkdir(parents=True)
        kept.write_bytes(b"its latest save")
        kept.with_suffix(".json").write_text(json.dumps({"running": live.pid}))
        assert interrupted.kept_interrupted(fake_run()) is None and interrupted.kept_interrupted(s) is None
    finally:
        live.kill()
        live.wait()
    assert interrupted.kept_interrupted(fake_run()) == kept  # its process gone: a run killed outright, resumed


def test_an_interrupted_experiment_resumed_with_a_changed_setting_continues_and_leaves_no_copy(tmp_path, tokens,
                                                                                              monkeypatch, capsys):
    """`dvc exp run` interrupted, then `dvc exp run -S train.lr=...` (a learning rate that spiked): the kept run
    continues under the new lr, as a plain resume would, and no copy is left behind. A kept run that trained on
    other data (it can never resume) is removed at the next start; the others are listed."""
    import shutil

    from gpt2.train import interrupted

    (tmp_path / ".dvc").mkdir()
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    run(tmp_path, tokens, micro_params(max_steps=4), "baseline")
    interrupt_at(monkeypatch, 5)
    with pytest.raises(TrainingInterrupted):
        run(tmp_path, tokens, micro_params())
    monkeypatch.undo()
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    folder = tmp_path / ".dvc/tmp/gpt2-interrupted"
    stale = folder / "0123456789abcdef.0123456789abcdef.pt"  # a run on data that is gone
    shutil.copy(next(folder.glob("*.pt")), stale)
    stale.with_suffix(".json").write_text('{"data": {"train_md5": "gone"}}')
    shutil.copy(tmp_path / "baseline/ckpt.pt", tmp_path / "run/ckpt.pt")  # what dvc exp run does before running
    assert run(tmp_path, tokens, micro_params(lr=5.0e-3))["steps"] == 12
    err = capsys.readouterr().err
    assert f"removed the interrupted run kept in {stale}: it trained on other data" in err
    assert "1 interrupted run(s) kept in" in err and "… (lr=0.01); each resumes when" in err
    assert "resuming the interrupted run of these params and data kept in" in err
    assert "resuming with train.lr changed: 0.01 → 0.005 (applies from step" in err
    assert not folder.exists()  # finished: neither its copy nor the stale one is left, nor their folder
    assert interrupted.kept_interrupted(resume_setup(tokens)) is None


def resume_setup(tokens):
    from gpt2.train.build import build

    return build(micro_params(), tokens)


def test_a_kept_run_is_found_by_its_model_data_and_optimizer_whatever_else_changed(tmp_path, monkeypatch):
    """The exact params' copy first, else the newest copy of the same model, data and optimizer; none of another."""
    import os

    from gpt2.train import interrupted

    (tmp_path / ".dvc").mkdir()
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    folder = tmp_path / ".dvc/tmp/gpt2-interrupted"
    folder.mkdir(parents=True)
    base, other_lr, muon = fake_run(), fake_run(lr=5.0e-3), fake_run(optimizer="muon")
    assert interrupted.run_key(base) == interrupted.run_key(other_lr) != interrupted.run_key(muon)
    assert interrupted.params_key(base) != interrupted.params_key(other_lr)
    assert interrupted.kept_interrupted(base) is None
    older, newer = (folder / f"{interrupted.run_key(base)}.{key}.pt" for key in ("a" * 16, "b" * 16))
    for age, path in ((100, older), (10, newer)):
        path.write_bytes(b"kept")
        os.utime(path, (path.stat().st_mtime - age,) * 2)
    assert interrupted.kept_interrupted(other_lr) == newer and interrupted.kept_interrupted(muon) is None
    exact = folder / f"{interrupted.run_key(base)}.{interrupted.params_key(base)}.pt"
    exact.write_bytes(b"kept")
    os.utime(exact, (exact.stat().st_mtime - 1000,) * 2)  # the oldest, and still the one
    assert interrupted.kept_interrupted(base) == exact


def test_a_comparisons_run_resumes_only_its_own_kept_run(tmp_path, monkeypatch, caplog):
    """A grid's or a ladder's run (GPT2_COMPARISON_RUN) never continues another run's kept checkpoint under its own
    settings: it would be compared as if it had trained those weights. Its own stopped run it does resume, and the
    other copy stays kept for the run it belongs to."""
    from gpt2.run.names import COMPARISON_RUN_ENV
    from gpt2.train import interrupted

    (tmp_path / ".dvc").mkdir()
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    folder = tmp_path / ".dvc/tmp/gpt2-interrupted"
    folder.mkdir(parents=True)
    base, other_lr = fake_run(), fake_run(lr=5.0e-3)
    someone_elses = folder / f"{interrupted.run_key(base)}.{interrupted.params_key(other_lr)}.pt"
    someone_elses.write_bytes(b"kept")
    assert interrupted.kept_interrupted(base) == someone_elses  # a plain `dvc exp run` continues it, changed
    monkeypatch.setenv(COMPARISON_RUN_ENV, "lr-1-1")
    with caplog.at_level("INFO"):
        assert interrupted.kept_interrupted(base) is None
    assert f"the interrupted run kept in {someone_elses} (other train settings) is not resumed" in caplog.text
    own = folder / f"{interrupted.run_key(base)}.{interrupted.params_key(base)}.pt"
    own.write_bytes(b"kept")
    assert interrupted.kept_interrupted(base) == own and someone_elses.is_file()


def test_a_shorter_run_of_other_settings_starts_anew_beside_a_kept_run_it_cannot_finish(tmp_path, tokens, monkeypatch,
                                                                                       capsys):
    """A kept run stopped at step 6 of 12, then `dvc exp run -S train.max_steps=4 -S train.lr=...`: the kept run is
    another run's, past this one's end. The short run trains its own 4 steps from scratch, says why, and the kept run
    stays for the command that made it (not a refusal asking to train 6 steps or more)."""
    from gpt2.train import interrupted

    (tmp_path / ".dvc").mkdir()
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    interrupt_at(monkeypatch, 5)
    with pytest.raises(TrainingInterrupted):
        run(tmp_path, tokens, micro_params())
    monkeypatch.undo()
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    [kept] = (tmp_path / ".dvc/tmp/gpt2-interrupted").glob("*.pt")
    (tmp_path / "run/ckpt.pt").unlink()  # as `dvc exp run` leaves it: the baseline has none
    short = micro_params(max_steps=4, lr=5.0e-3)
    assert run(tmp_path, tokens, short, "short")["steps"] == 4
    assert (f"the interrupted run kept in {kept} (other train settings) is at step 6, past this run's 4 steps: this "
            "run starts anew" in capsys.readouterr().err)
    monkeypatch.delenv("DVC_ROOT")  # outside DVC nothing is kept: a run from scratch
    run(tmp_path, tokens, short, "scratch")
    assert losses(tmp_path, "short") == losses(tmp_path, "scratch")
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    assert kept.is_file() and interrupted.kept_interrupted(resume_setup(tokens)) == kept
