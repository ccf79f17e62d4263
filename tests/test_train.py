"""The training loop on a micro model: results, reports, resume, errors."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import time

import numpy as np
import pytest
import torch
from conftest import micro_params

from gpt2.core.errors import UserError
from gpt2.run import checkpoint
from gpt2.run.tracking import flatten
from gpt2.train import step_log, trainer
from gpt2.train.reports import PLOT_COLUMNS
from gpt2.core.errors import Diverged
from gpt2.train.trainer import TrainingInterrupted, train


def run(tmp_path, tokens, params, name="run"):
    return train(params, tokens, tmp_path / name / "ckpt.pt", tmp_path / name / "reports")


def losses(tmp_path, name="run"):
    rows = (tmp_path / name / "reports/plots/train.tsv").read_text().splitlines()
    return [float(r.split("\t")[1]) for r in rows[1:]]


def test_micro_training_learns_and_writes_reports(tmp_path, tokens):
    metrics = run(tmp_path, tokens, micro_params(max_steps=30, eval_interval=10))
    assert metrics["steps"] == 30 and metrics["tokens"] == 30 * 4 * 16
    assert metrics["val"]["loss"] < 10.0 < math.log(50257)  # starts at about ln(50257) = 10.8
    assert metrics["val"]["ppl"] == pytest.approx(math.exp(metrics["val"]["loss"]))
    assert 0 < metrics["val"]["loss_se"] < 1 and metrics["val"]["best_loss"] <= metrics["val"]["loss"]
    assert metrics["val"]["best_step"] in (10, 20, 30)
    assert metrics["perf"]["step_ms"] > 0 and metrics["perf"]["tokens_per_s"] > 0
    assert metrics["perf"]["timed_steps"] == 29  # the first (warm-up) step is excluded
    assert metrics["mem"]["peak_gb"] > 0
    report = tmp_path / "run/reports"
    assert json.loads((report / "summary.json").read_text()) == metrics
    # DVC's metrics file keeps only the figures people compare (dvc exp show stays readable)
    compared = json.loads((report / "metrics.json").read_text())
    assert sorted(flatten(compared)) == ["cost.device_hours", "cost.usd", "mem.peak_gb", "perf.mfu", "perf.step_ms", "perf.step_ms_iqr",
                                         "perf.tokens_per_s", "perf.tokens_per_s_iqr", "perf.tokens_per_s_steady",
                                         "perf.tokens_per_s_wall", "train.loss", "train_s", "val.loss", "val.loss_se",
                                         "val.ppl", "wall_s"]
    # wall-clock throughput: every token over the whole run's time, evals and model build included; the steady
    # state: the 29 steps after the warm-up over their wall time (evals included), between the two
    wall = metrics["wall_s"]  # rounded to 10 ms: the bounds allow for it
    assert 30 * 4 * 16 / (wall + 0.006) < metrics["perf"]["tokens_per_s_wall"] < 30 * 4 * 16 / (wall - 0.006)
    assert metrics["perf"]["tokens_per_s_wall"] < metrics["perf"]["tokens_per_s_steady"]
    history = checkpoint.load(tmp_path / "run/ckpt.pt")["history"]
    assert history["steady_steps"] == 29 and history["steady_s"] < metrics["wall_s"]
    assert metrics["perf"]["tokens_per_s_steady"] == pytest.approx(29 * 4 * 16 / history["steady_s"], rel=0.01)
    assert metrics["perf"]["tokens_per_s_wall"] < metrics["perf"]["tokens_per_s"]
    assert metrics["runtime"]["graph_breaks"] is None  # not compiled: nothing to count
    assert compared["val"]["loss"] == round(metrics["val"]["loss"], 4) and compared["perf"] == {
        k: round(metrics["perf"][k], 4) for k in ("step_ms", "step_ms_iqr", "tokens_per_s", "tokens_per_s_iqr", "tokens_per_s_steady",
                                        "tokens_per_s_wall", "mfu")}
    history_ms = sorted(1000 * s for s in history["step_s"][1:])  # the spread: the timed steps' interquartile range
    assert metrics["perf"]["step_ms_iqr"] == pytest.approx(
        float(np.percentile(history_ms, 75) - np.percentile(history_ms, 25)), abs=1e-3)
    assert (report / "plots/curves.png").read_bytes().startswith(b"\x89PNG")
    train_rows = (report / "plots/train.tsv").read_text().splitlines()
    assert train_rows[0].split("\t") == list(PLOT_COLUMNS["train.tsv"])
    assert len(train_rows) == 31
    val_rows = (report / "plots/val.tsv").read_text().splitlines()
    assert [r.split("\t")[0] for r in val_rows[1:]] == ["10", "20", "30"]
    state = checkpoint.load(tmp_path / "run/ckpt.pt")
    assert state["step"] == 30 and set(state) >= {"model", "optimizer", "scaler", "rng_per_rank", "sampler",
                                                "model_config"}


def test_final_eval_off_skips_the_val_loss_after_the_last_step(tmp_path, tokens, capsys):
    # the last step on the eval interval: still no eval there; Muon's own learning rate is logged
    params = micro_params(max_steps=8, eval_interval=4, final_eval=False, optimizer="muon", lr_schedule="constant",
                          min_lr=1.0e-3)
    metrics = run(tmp_path, tokens, params)
    val_rows = (tmp_path / "run/reports/plots/val.tsv").read_text().splitlines()
    assert [r.split("\t")[0] for r in val_rows[1:]] == ["4"] and metrics["steps"] == 8
    rows = checkpoint.load(tmp_path / "run/ckpt.pt")["history"]["train"]
    assert [r["train/muon_lr"] for r in rows[-2:]] == [params.train.muon_lr] * 2  # constant after the warm-up
    assert [r["train/lr"] for r in rows[-2:]] == [params.train.lr] * 2
    assert "train.min_lr 0.001 is inert: train.lr_schedule is constant" in capsys.readouterr().err
    assert run(tmp_path, tokens, micro_params(max_steps=6, eval_interval=100, final_eval=False),
               name="none")["val"]["loss"] is None


def test_measurement_run_writes_no_checkpoint_but_records_what_ran(tmp_path, tokens):
    metrics = run(tmp_path, tokens, micro_params(save_checkpoint=False, tf32=True, dtype="auto"))
    assert (tmp_path / "run").is_dir() and not (tmp_path / "run/ckpt.pt").exists()  # the DVC out exists, empty
    runtime = metrics["runtime"]
    assert runtime["device"] == "cpu" and runtime["dtype"] == "fp32"  # auto on CPU is fp32
    assert runtime["tf32"] is False  # asked for, inert on CPU: recorded as what ran
    assert runtime["sdpa_backend"] != "manual (no SDPA)"


def test_same_seed_same_losses(tmp_path, tokens):
    run(tmp_path, tokens, micro_params(), "a")
    run(tmp_path, tokens, micro_params(), "b")
    assert losses(tmp_path, "a") == losses(tmp_path, "b")


def interrupt_at(monkeypatch, step_to_stop: int, sig=signal.SIGINT):
    """Send ``sig`` to this process while step ``step_to_stop`` runs, as Ctrl-C or a scheduler would."""
    original = trainer.lr_at

    def lr_at(step, cfg, *rest):
        if step == step_to_stop:
            os.kill(os.getpid(), sig)
        return original(step, cfg, *rest)

    monkeypatch.setattr(trainer, "lr_at", lr_at)


def stop_at_step_3(tmp_path, tokens, monkeypatch, params):
    """Train ``params`` until a Ctrl-C in step 3 stops it: the checkpoint holds step 3 of 12."""
    interrupt_at(monkeypatch, 2)
    with pytest.raises(TrainingInterrupted):
        run(tmp_path, tokens, params)
    monkeypatch.undo()


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
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys\n"
                               f"with open({str(log)!r}, 'w') as log:\n"
                               f"    child = subprocess.Popen({command!r}, stderr=log)\n"
                               "    print(child.pid, flush=True)\n    child.wait()\n"],
                              stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    while "| loss " not in log.read_text():  # it trains
        time.sleep(0.2)
    parent.kill()
    parent.wait()
    trainer_process = child.children()[0] if through_a_shell else child
    trainer_process.wait(timeout=60)
    assert "interrupted by SIGTERM at step" in log.read_text()
    assert 0 < checkpoint.load(tmp_path / "ckpt.pt")["step"] < 100_000


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
    with pytest.raises(TrainingInterrupted, match="run the same `dvc exp run` command again to resume it"):
        run(tmp_path, tokens, micro_params())
    monkeypatch.undo()
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    shutil.copy(tmp_path / "baseline/ckpt.pt", tmp_path / "run/ckpt.pt")  # what dvc exp run does before running
    assert run(tmp_path, tokens, micro_params())["steps"] == 12
    assert "resuming the interrupted run of these params and data kept in" in capsys.readouterr().err
    assert losses(tmp_path) == losses(tmp_path, "straight")
    assert not list((tmp_path / ".dvc/tmp/gpt2-interrupted").iterdir())  # finished: no longer kept


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
    assert not list(folder.iterdir())  # finished: neither its copy nor the stale one is left
    assert interrupted.kept_interrupted(resume_setup(tokens)) is None


def resume_setup(tokens):
    from gpt2.train.build import build

    return build(micro_params(), tokens)


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


def test_a_new_run_never_overwrites_a_finished_model(tmp_path, tokens, capsys, monkeypatch):
    """Other params onto a finished checkpoint start a new run, and the finished model is kept beside it; so is
    any checkpoint that train.resume: never replaces. Under DVC a model its cache holds is not copied again."""
    from gpt2.core.provenance import file_md5
    from gpt2.run import checkpoint
    from gpt2.train import resume

    monkeypatch.delenv("DVC_ROOT", raising=False)
    ckpt = tmp_path / "run/ckpt.pt"
    run(tmp_path, tokens, micro_params(max_steps=4))
    first = file_md5(ckpt)
    run(tmp_path, tokens, micro_params(max_steps=4, lr=1.0e-3))
    err = capsys.readouterr().err
    kept = ckpt.parent / f"ckpt.{first[:12]}.pt"
    assert "was a finished run (4 steps) of other params or data; starting a new run" in err
    assert f"held a finished run (4 steps) of other params or data; kept as {kept}" in err
    assert file_md5(kept) == first and checkpoint.load(kept)["params"]["train"]["lr"] == 1.0e-2
    assert checkpoint.load(ckpt)["params"]["train"]["lr"] == 1.0e-3
    second = file_md5(ckpt)
    run(tmp_path, tokens, micro_params(max_steps=4, lr=1.0e-3, resume="never"))
    assert (ckpt.parent / f"ckpt.{second[:12]}.pt").is_file()

    project = tmp_path / "project"
    (project / ".dvc").mkdir(parents=True)
    monkeypatch.setenv("DVC_ROOT", str(project))
    moved = resume.keep_replaced(ckpt, "a run")
    assert moved is not None and moved.parent == project / ".dvc/tmp/gpt2-kept" and not ckpt.exists()
    md5 = file_md5(moved)
    cached = project / ".dvc/cache/files/md5" / md5[:2] / md5[2:]
    cached.parent.mkdir(parents=True)
    cached.write_bytes(moved.read_bytes())
    assert resume.keep_replaced(moved, "a run") is None and moved.is_file()  # DVC has it: nothing copied


def test_finished_checkpoint_of_the_same_params_rebuilds_the_reports_without_training(tmp_path, tokens, capsys,
                                                                                       monkeypatch):
    first = run(tmp_path, tokens, micro_params(max_steps=4))
    reports = tmp_path / "run" / "reports"
    saved = {name: (reports / name).read_text() for name in ("metrics.json", "summary.json", "plots/train.tsv")}
    for name in saved:
        (reports / name).unlink()  # what DVC does to a stage's outs before running it
    capsys.readouterr()
    monkeypatch.setattr(trainer, "fit", lambda *a, **k: pytest.fail("trained again"))
    again = run(tmp_path, tokens, micro_params(max_steps=4, mlflow=False))  # a tracking switch is not a new run
    assert again == first
    assert {name: (reports / name).read_text() for name in saved} == saved
    assert "is a finished run of these params and data (4 steps); rebuilt" in capsys.readouterr().err
    # a checkpoint written by an older version: its summary lacks figures added since; the reports still rebuild
    state = checkpoint.load(tmp_path / "run/ckpt.pt")
    for section, key in (("val", "loss_se"), ("perf", "tokens_per_s_steady"), ("perf", "step_ms_iqr")):
        del state["metrics"][section][key]
    torch.save(state, tmp_path / "run/ckpt.pt")
    older = run(tmp_path, tokens, micro_params(max_steps=4))
    assert "loss_se" not in older["val"] and json.loads((reports / "metrics.json").read_text())["val"]["loss"]


def test_unfinished_checkpoint_of_another_model_is_refused(tmp_path, tokens, monkeypatch):
    stop_at_step_3(tmp_path, tokens, monkeypatch, micro_params())
    with pytest.raises(UserError, match=r"unfinished run \(step 3/12\) of another model or data: n_layer 2 → 3.*"
                                        r"train.resume: never"):
        run(tmp_path, tokens, micro_params(model={"n_layer": 3}))
    metrics = run(tmp_path, tokens, micro_params(model={"n_layer": 3}, resume="never"))
    assert metrics["steps"] == 12


def test_resume_with_a_changed_setting_says_so(tmp_path, tokens, monkeypatch, capsys):
    stop_at_step_3(tmp_path, tokens, monkeypatch, micro_params())
    run(tmp_path, tokens, micro_params(max_steps=14))
    err = capsys.readouterr().err
    assert "resuming" in err and "train.max_steps changed: 12 → 14" in err


def test_a_resumed_run_trains_with_the_hyperparameters_it_logs(tmp_path, tokens, monkeypatch, capsys):
    stop_at_step_3(tmp_path, tokens, monkeypatch, micro_params(weight_decay=0.1))
    seen = []
    original = trainer.optimizer_step

    def recording(model, optimizers, scaler, grad_clip):
        seen.append([(g["lr"], g["weight_decay"], g["betas"]) for o in optimizers for g in o.param_groups])
        return original(model, optimizers, scaler, grad_clip)

    monkeypatch.setattr(trainer, "optimizer_step", recording)
    params = micro_params(lr=5.0e-3, weight_decay=0.0, betas=[0.8, 0.9])  # the interrupted run's lr halved
    run(tmp_path, tokens, params)
    assert len(seen) == 9  # steps 3..11 (0-based) after the checkpoint at step 3
    for step, groups in enumerate(seen, start=3):
        want = trainer.lr_at(step, params.train, 12)
        assert [g[0] for g in groups] == pytest.approx([want] * len(groups), rel=1e-12)
        assert [g[1] for g in groups] == [0.0] * len(groups) and {g[2] for g in groups} == {(0.8, 0.9)}
    assert seen[-1][0][0] == pytest.approx(trainer.lr_at(11, params.train, 12))  # ends at the new schedule's end
    err = capsys.readouterr().err
    assert "train.lr changed: 0.01 → 0.005 (applies from step 3)" in err


def test_resuming_into_another_optimizer_is_refused_and_fp16_starts_its_scaler(tmp_path, tokens, monkeypatch, capsys):
    stop_at_step_3(tmp_path, tokens, monkeypatch, micro_params())
    with pytest.raises(UserError, match=r"trained with train.optimizer adamw; muon's state cannot continue it; set "
                                        r"train.optimizer: adamw to resume it, or train.resume: never"):
        run(tmp_path, tokens, micro_params(optimizer="muon"))
    metrics = run(tmp_path, tokens, micro_params(dtype="fp16"))  # from an fp32 checkpoint: no scaler state
    assert metrics["steps"] == 12
    assert "with no fp16 loss scale; GradScaler starts at its initial scale" in capsys.readouterr().err


def test_the_memory_peak_is_the_runs_peak_not_its_end(tmp_path, tokens, monkeypatch):
    import mmap

    original = trainer.lr_at

    def lr_at(step, cfg, *rest):
        if step == 3:  # 400 MB held for a moment, then returned to the system
            block = mmap.mmap(-1, 400 * 2**20)
            for page in range(0, len(block), mmap.PAGESIZE):
                block[page] = 1
            block.close()
        return original(step, cfg, *rest)

    monkeypatch.setattr(trainer, "lr_at", lr_at)
    mem = run(tmp_path, tokens, micro_params(max_steps=6))["mem"]
    assert mem["peak_gb"] == mem["peak_rss_gb"] > mem["rss_gb"] + 0.4


@pytest.mark.parametrize("damage", ["truncate", "garbage", "foreign"])
def test_corrupt_checkpoint_is_a_clear_error(tmp_path, tokens, damage):
    run(tmp_path, tokens, micro_params(max_steps=2))
    path = tmp_path / "run/ckpt.pt"
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "garbage":
        path.write_bytes(b"not a checkpoint" * 100)
    else:
        torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(UserError, match="corrupt or truncated|not a checkpoint of this pipeline"):
        run(tmp_path, tokens, micro_params(max_steps=2))


def test_nan_loss_stops_with_step_and_last_checkpoint(tmp_path, tokens, monkeypatch):
    original = trainer.backward_micro_batches
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        loss = original(*args, **kwargs)
        return loss * float("nan") if calls["n"] == 6 else loss

    monkeypatch.setattr(trainer, "backward_micro_batches", poisoned)
    with pytest.raises(Diverged, match=r"loss is nan at step 6: training diverged; last good checkpoint: .*ckpt.pt "
                                       r"\(step 4\)") as raised:  # steps counted from 1, as in the log lines
        run(tmp_path, tokens, micro_params(checkpoint_interval=2))
    assert str(raised.value).endswith("resume it with a lower train.lr or a lower train.grad_clip")  # no fp16 in fp32


def test_resuming_past_max_steps_is_refused_with_what_would_finish_it(tmp_path, tokens):
    path = tmp_path / "run/ckpt.pt"
    run(tmp_path, tokens, micro_params(max_steps=4, checkpoint_interval=2))
    state = checkpoint.load(path)
    state.update(metrics=None, step=3)  # interrupted at step 3 of 4
    torch.save(state, path)
    with pytest.raises(UserError, match=r"unfinished run at step 3, past this run's 2 steps.*set train.max_steps 3 "
                                        r"or more to finish it, or train.resume: never"):
        run(tmp_path, tokens, micro_params(max_steps=2, checkpoint_interval=2))


def test_a_checkpoint_with_nan_weights_is_not_resumed(tmp_path, tokens):
    """Its first step would diverge whatever the learning rate: refused, naming train.resume: never."""
    path = tmp_path / "run/ckpt.pt"
    run(tmp_path, tokens, micro_params(max_steps=4, checkpoint_interval=2))
    state = checkpoint.load(path)
    state.update(metrics=None, step=2)  # an interrupted run
    state["model"]["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("inf")
    torch.save(state, path)
    with pytest.raises(UserError, match=r"holds NaN or inf weights \(1 tensors, transformer.h.0.mlp.c_fc.weight "
                                        r"first\).*set train.resume: never to start over"):
        run(tmp_path, tokens, micro_params(max_steps=4, checkpoint_interval=2))


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
    with pytest.raises(Diverged, match=r"the weights hold NaN or inf after step 4 \(\d+ tensors, transformer.wte.weight "
                                       r"first\).*this step was not saved; last good checkpoint: .*ckpt.pt \(step 2\)"):
        run(tmp_path, tokens, micro_params(checkpoint_interval=2))
    assert checkpoint.load(tmp_path / "run/ckpt.pt")["step"] == 2


def test_fp16_overflow_steps_are_skipped_and_counted(tmp_path, tokens, monkeypatch):
    original = trainer.build

    def huge_scale(*args, **kwargs):
        setup = original(*args, **kwargs)
        setup.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # overflows fp16 grads for a few steps
        return setup

    monkeypatch.setattr(trainer, "build", huge_scale)
    metrics = run(tmp_path, tokens, micro_params(dtype="fp16", max_steps=8))
    assert metrics["fp16_skipped_steps"] >= 1
    state = checkpoint.load(tmp_path / "run/ckpt.pt")
    assert state["scaler"]["scale"] < 2.0**40  # the GradScaler's state is checkpointed


def test_max_tokens_sets_the_number_of_steps(tmp_path, tokens):
    metrics = run(tmp_path, tokens, micro_params(max_steps=None, max_tokens=64 * 5 + 1))
    assert metrics["steps"] == 6


def test_block_size_longer_than_the_model_is_refused(tmp_path, tokens):
    with pytest.raises(UserError, match="train.block_size 64 exceeds the model's block_size 32"):
        run(tmp_path, tokens, micro_params(block_size=64))


def test_cuda_without_cuda_is_an_error(tmp_path, tokens):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UserError, match="train.device is cuda but this machine has no usable CUDA device"):
        run(tmp_path, tokens, micro_params(device="cuda"))


def test_split_shorter_than_a_window_is_refused(tmp_path):
    from conftest import make_tokens

    small = make_tokens(tmp_path / "t", n_train=2000, n_val=8)
    with pytest.raises(UserError, match="val.bin has 8 tokens, fewer than block_size \\+ 1 = 17"):
        run(tmp_path, small, micro_params())


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


def test_async_checkpoint_off_writes_in_the_loop(tmp_path, monkeypatch):
    """train.async_checkpoint: false: the file is complete when save returns, and no thread is started."""
    import threading

    monkeypatch.setattr(threading.Thread, "start", lambda self: pytest.fail("started a writer thread"))
    saver = checkpoint.BackgroundSaver(enabled=False)
    saver.save(tmp_path / "ckpt.pt", {"step": 3})
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 3


def test_a_run_without_a_report_folder_writes_only_its_checkpoint(tmp_path, tokens):
    """What the benchmarks' measurement children do: the returned summary is their result."""
    metrics = train(micro_params(max_steps=3), tokens, tmp_path / "run" / "ckpt.pt", report_dir=None)
    assert metrics["steps"] == 3 and metrics["perf"]["tokens_per_s"] > 0
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["ckpt.pt"]


@pytest.mark.parametrize("failure", ["cuda", "cpu"])
def test_out_of_memory_is_an_answer_and_the_last_checkpoint_stays(tmp_path, tokens, monkeypatch, failure):
    original, calls = trainer.backward_micro_batches, []

    def backward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # step 5, after the checkpoint of step 4
            raise (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB") if failure == "cuda" else
                   RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                                "you tried to allocate 2147483648 bytes. Error code 12 (Cannot allocate memory)"))
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer, "backward_micro_batches", backward)
    with pytest.raises(UserError) as caught:
        run(tmp_path, tokens, micro_params(micro_batch_size=6, grad_accum_steps=2, checkpoint_interval=2))
    message = str(caught.value)
    assert re.match(r"out of memory on cpu \(\d+\.\d GB of RAM\) at micro-batch 6 × 16 tokens \(tiny, fp32\); the "
                    r"memory model expected 0.1 GB: ", message), message
    if failure == "cpu":
        assert message.endswith("(the CPU allocator failed)")
        return
    assert "set train.micro_batch_size 3 and train.grad_accum_steps 4 (the same batch of 12 sequences)" in message
    assert "or train.micro_batch_size auto with train.batch_tokens 192 and train.grad_accum_steps 1" in message
    assert "ckpt.pt) is intact and train.resume auto continues from it (OutOfMemoryError)" in message
    assert checkpoint.load(tmp_path / "run/ckpt.pt")["step"] == 4
    calls.clear()
    with pytest.raises(UserError, match=r"micro-batch 8 × 16 tokens .*: auto chose 8: raise train.memory_margin "
                                        r"\(now 0.15\) so it leaves more free, or set train.micro_batch_size 4"):
        run(tmp_path, tokens, micro_params(micro_batch_size="auto", batch_tokens=16 * 16), "auto")
    from gpt2.train.oom import smaller_micro_batch

    assert smaller_micro_batch(7, 1) == (1, 7) and smaller_micro_batch(1, 4) is None


@pytest.mark.parametrize("bad_id, loading", [(60000, "preload"), (50300, "preload"), (50300, "memmap")])
def test_token_ids_outside_the_vocab_are_refused_with_the_cause(tmp_path, tokens, bad_id, loading):
    """Past the embedding (an IndexError deep in torch) or in its padded rows (an infinite loss blamed on lr)."""
    ids = np.fromfile(tokens / "train.bin", dtype=np.uint16)
    ids[::13] = bad_id  # in every window: the first batch read from the map meets one
    ids.tofile(tokens / "train.bin")
    with pytest.raises(UserError, match=rf"train.bin holds token id {bad_id}, outside the vocab of 50257 .* run the "
                                        "tokenize stage again"):
        run(tmp_path, tokens, micro_params(data_loading=loading))


@pytest.mark.parametrize("meta", [[1, 2], {"dtype": "uint16", "vocab_size": 50257, "eot_id": 50256},
                                  {"dtype": "uint16", "vocab_size": 50257, "eot_id": 50256, "splits": {"train": {}}}])
def test_a_malformed_meta_json_is_named_not_a_traceback(tmp_path, tokens, meta):
    (tokens / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"meta.json (holds a JSON list|lacks .*splits).*run the tokenize stage again"):
        run(tmp_path, tokens, micro_params())


def test_an_evaluation_of_another_run_is_withdrawn_and_one_of_this_run_kept(tmp_path):
    from gpt2.train.reports import withdraw_other_evaluation

    def evaluation(scored: str | None) -> None:
        (tmp_path / "eval").mkdir(exist_ok=True)
        summary = {"checkpoint_step": 5, **({"checkpoint_run_uid": scored} if scored else {})}
        (tmp_path / "eval/summary.json").write_text(json.dumps(summary))
        (tmp_path / "eval/metrics.json").write_text(json.dumps({"eval": {"val_loss": 5.1, "hellaswag_acc": 0.3}}))
        (tmp_path / "eval/samples.md").write_text("# Samples")

    (tmp_path / "summary.json").write_text(json.dumps({"run_uid": "this"}))
    evaluation("this")
    assert not withdraw_other_evaluation(tmp_path / "eval", tmp_path / "summary.json")
    assert (tmp_path / "eval/samples.md").exists()
    for other in ("another", None):  # None: an evaluation written before runs had an identity
        evaluation(other)
        assert withdraw_other_evaluation(tmp_path / "eval", tmp_path / "summary.json")
        assert json.loads((tmp_path / "eval/metrics.json").read_text()) == {"eval": {"val_loss": None,
                                                                                     "hellaswag_acc": None}}
        assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["metrics.json"]


def test_a_run_no_longer_than_its_warmup_says_so(tmp_path, tokens, capfd):
    train(micro_params(max_steps=3, eval_interval=3), tokens, tmp_path / "ckpt.pt", tmp_path / "r")  # warmup 3
    said = capfd.readouterr().err
    assert ("warning: the run is 3 steps and train.warmup_steps is 3: the learning rate is still warming up when the "
            "run ends (it never reaches train.lr); lower train.warmup_steps (e.g. 1) or train longer") in said
    train(micro_params(max_steps=4, eval_interval=4), tokens, tmp_path / "four.pt", tmp_path / "r4")
    assert "still warming up" not in capfd.readouterr().err


def test_the_curves_flag_a_noisy_step_time_and_keep_a_flat_memory_line_off_the_frame(monkeypatch):
    import matplotlib.pyplot as plt

    from gpt2.train import reports

    titles, limits = {}, {}
    savefig = plt.Figure.savefig

    def seen(fig, *args, **kwargs):  # what the PNG shows, read from the figure before it is written
        for ax in fig.axes:
            titles[ax.get_ylabel()] = ax.get_title()
            limits[ax.get_ylabel()] = ax.get_ylim()
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", seen)
    train = [{"step": s, "train/loss": 5.0, "perf/step_ms": ms, "perf/tokens_per_s": 1000.0, "mem/rss_gb": 0.88}
             for s, ms in zip(range(1, 9), (100, 150, 90, 160, 100, 140, 95, 155))]
    reports.render_curves(train, [], "noisy")
    said = titles["ms (warm-up steps left out)"]
    assert said.startswith("Step time: median 120 ms, IQR") and said.endswith("(noisy)")
    assert limits["GB"][1] > 0.88 * 1.1  # the flat line below the top frame
    steady = [{**row, "perf/step_ms": 100.0 + row["step"] % 2} for row in train]
    reports.render_curves(steady, [], "steady")
    assert "noisy" not in titles["ms (warm-up steps left out)"]
