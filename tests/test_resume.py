"""Where a run starts: a resume, a finished run reused or kept, and the refusals (train/resume.py)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import micro_params
from training import fake_run, interrupt_at, losses, run, stop_at_step_3

from gpt2.core.errors import UserError
from gpt2.run import checkpoint
from gpt2.train import trainer
from gpt2.train.trainer import TrainingInterrupted


def test_a_new_run_never_overwrites_a_finished_model(tmp_path, tokens, capsys, monkeypatch):
    """Other params onto a finished checkpoint start a new run, and the finished model is kept beside it; so is
    any checkpoint that train.resume: never replaces. Under DVC a model its cache holds is not copied again."""
    from gpt2.core.digest import file_md5
    from gpt2.run import checkpoint
    from gpt2.train import resume

    monkeypatch.delenv("DVC_ROOT", raising=False)
    ckpt = tmp_path / "run/ckpt.pt"
    run(tmp_path, tokens, micro_params(max_steps=4))
    first = file_md5(ckpt)
    run(tmp_path, tokens, micro_params(max_steps=4, lr=1.0e-3))
    err = capsys.readouterr().err
    kept = ckpt.parent / f"ckpt.{first[:12]}.pt"
    said = [line for line in err.splitlines() if "was a finished run" in line]  # what, where and why: one line
    assert len(said) == 1 and said[0].endswith("delete it once you no longer need it; starting a new run")
    assert f"was a finished run (4 steps) of other params or data (train.lr 0.01 → 0.001); kept as {kept} (" in said[0]
    assert file_md5(kept) == first and checkpoint.load(kept)["params"]["train"]["lr"] == 1.0e-2
    assert checkpoint.load(ckpt)["params"]["train"]["lr"] == 1.0e-3
    second = file_md5(ckpt)
    run(tmp_path, tokens, micro_params(max_steps=4, lr=1.0e-3, resume="never"))
    assert (ckpt.parent / f"ckpt.{second[:12]}.pt").is_file()

    project = tmp_path / "project"
    (project / ".dvc").mkdir(parents=True)
    monkeypatch.setenv("DVC_ROOT", str(project))
    moved, where = resume.keep_replaced(ckpt)
    assert moved is not None and moved.parent == project / ".dvc/tmp/gpt2-kept" and not ckpt.exists()
    assert where.startswith(f"kept as {moved} (") and where.endswith("delete it once you no longer need it")
    md5 = file_md5(moved)
    cached = project / ".dvc/cache/files/md5" / md5[:2] / md5[2:]
    cached.parent.mkdir(parents=True)
    cached.write_bytes(moved.read_bytes())
    assert resume.keep_replaced(moved) == (None, f"DVC's cache keeps it ({cached}: `dvc checkout` brings back the "
                                                 "one dvc.lock records)") and moved.is_file()
    # a cache that `dvc cache dir` put outside the project (a team's shared cache) holds it too
    shared = tmp_path / "shared-cache"
    (project / ".dvc/config").write_text(f"[cache]\n    dir = {shared}\n")
    kept_again, _ = resume.keep_replaced(moved)
    assert kept_again is not None and kept_again.is_file()  # not in the shared cache yet: kept
    in_shared = shared / "files/md5" / md5[:2] / md5[2:]
    in_shared.parent.mkdir(parents=True)
    in_shared.write_bytes(kept_again.read_bytes())
    assert resume.keep_replaced(kept_again)[0] is None and kept_again.is_file()
    # `gpt2 train` in a DVC project, not under DVC: the train stage's output folder does not grow a second model
    monkeypatch.delenv("DVC_ROOT")
    (project / ".dvc/config").unlink()
    output = project / "checkpoints/ckpt.pt"
    output.parent.mkdir()
    output.write_bytes(b"another run")
    moved, _ = resume.keep_replaced(output)
    assert moved.parent == project / ".dvc/tmp/gpt2-kept" and list(output.parent.iterdir()) == []


def test_a_finished_run_made_longer_goes_on_from_its_last_step(tmp_path, tokens, capsys, monkeypatch):
    """Only train.max_steps raised: the finished run goes on from its last step (its steps are not trained again),
    its model is kept (a copy: the file stays until the first save) and the summary says where it went on.
    Another change beside it, a grid's or ladder's run, or a run that stopped early trains anew, saying why."""
    from gpt2.core.digest import file_md5
    from gpt2.run.names import COMPARISON_RUN_ENV

    monkeypatch.delenv("DVC_ROOT", raising=False)
    monkeypatch.delenv(COMPARISON_RUN_ENV, raising=False)
    ckpt = tmp_path / "run/ckpt.pt"
    run(tmp_path, tokens, micro_params(max_steps=4))
    short, first = losses(tmp_path), file_md5(ckpt)
    capsys.readouterr()
    updates = []
    original = trainer.optimizer_step
    monkeypatch.setattr(trainer, "optimizer_step", lambda *a: updates.append(1) or original(*a))
    longer = run(tmp_path, tokens, micro_params(max_steps=6))
    monkeypatch.setattr(trainer, "optimizer_step", original)
    err = capsys.readouterr().err
    assert len(updates) == 2 and longer["steps"] == 6 and losses(tmp_path)[:4] == short  # steps 5 and 6 alone
    assert longer["lengthened_at"] == [4] and checkpoint.load(ckpt)["history"]["lengthened_at"] == [4]
    assert file_md5(ckpt.parent / f"ckpt.{first[:12]}.pt") == first  # the 4-step model, kept
    assert "was a finished run of 4 steps; kept as" in err
    assert ("going on from step 4 to 6: only its length changed (train.max_steps 4 → 6); the learning rate follows "
            "the 6-step cosine from there: 1.00e-02 at step 4, 7.55e-03 at step 5; a fresh run of 6 steps differs "
            "(train.resume: never trains one)") in err and "starting a new run" not in err
    assert "train: finished 6 steps (steps 5 to 6 in this session's 0:00:0" in err  # the last line: what it left
    assert (f"; the model in {ckpt}, the reports in {tmp_path / 'run/reports'}/ (metrics.json, "
            "summary.json, plots/)") in err
    run(tmp_path, tokens, micro_params(max_steps=8, lr=1.0e-3))
    err = capsys.readouterr().err
    assert "was a finished run (6 steps) of other params or data (" in err and "train.lr 0.01 → 0.001" in err
    assert "train.max_steps 6 → 8" in err and "starting a new run" in err
    monkeypatch.setenv(COMPARISON_RUN_ENV, "grid-1")
    run(tmp_path, tokens, micro_params(max_steps=10, lr=1.0e-3))
    assert ("of other params or data (train.max_steps 8 → 10), and it does not go on from there: a grid's or "
            "ladder's run trains anew, so that a longer arm never continues a shorter one's weights; kept as") \
        in capsys.readouterr().err
    monkeypatch.delenv(COMPARISON_RUN_ENV)
    state = checkpoint.load(ckpt)
    state["step"] = 7  # as a run that reached train.target_val_loss at step 7 of 10 leaves it
    torch.save(state, ckpt)
    run(tmp_path, tokens, micro_params(max_steps=12, lr=1.0e-3))
    assert ("and it does not go on from there: it ended at step 7, before its 10 (train.target_val_loss or a time "
            "budget stopped it)") in capsys.readouterr().err


def test_the_closing_line_of_a_run_whose_tokens_lack_the_byte_counts():
    """Token folders written before the byte counts give no bits per byte: the line leaves them out."""
    from gpt2.train.describe import closing_line

    assert closing_line({"steps": 4, "wall_s": 3.2, "val": {"loss": 5.0}}, 0, None, None) == \
        "train: finished 4 steps in 0:00:03, val loss 5.0000; no checkpoint (train.save_checkpoint: false)"


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
        want = params.train.lr * trainer.lr_at(step, params.train, 12)  # the schedule's multiplier of the new lr
        assert [g[0] for g in groups] == pytest.approx([want] * len(groups), rel=1e-12)
        assert [g[1] for g in groups] == [0.0] * len(groups) and {g[2] for g in groups} == {(0.8, 0.9)}
    assert seen[-1][0][0] == pytest.approx(params.train.lr * trainer.lr_at(11, params.train, 12))  # the new end
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


@pytest.mark.parametrize("damage", ["truncate", "garbage", "foreign", b"q", b"h\x80."])
def test_corrupt_checkpoint_is_a_clear_error(tmp_path, tokens, damage, recwarn):
    """Whatever the damage, one error naming the file; a head overwritten with these bytes makes torch.load's
    unpickler raise an IndexError or a KeyError (and warn of an unknown pickle protocol)."""
    run(tmp_path, tokens, micro_params(max_steps=2))
    path = tmp_path / "run/ckpt.pt"
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "garbage":
        path.write_bytes(b"not a checkpoint" * 100)
    elif damage == "foreign":
        torch.save({"weights": torch.zeros(2)}, path)
    else:
        path.write_bytes(damage + path.read_bytes()[len(damage):])
    with pytest.raises(UserError, match="corrupt or truncated|not a checkpoint of this pipeline|is not a checkpoint: "
                                        "it begins b'(not |qK|h\\\\x80)"):
        run(tmp_path, tokens, micro_params(max_steps=2))
    assert not [w for w in recwarn if "pickle protocol" in str(w.message)]


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


# ------------------------------------------------ the rules alone: a fake run and hand-made checkpoints, no training


def saved(s, step, metrics=None, model_config=None, weights=None, **train):
    """A checkpoint's state as the rules read it: trained by ``s`` with ``train`` changed."""
    import dataclasses

    from gpt2.core.config import to_dict

    from gpt2.core.provenance import training_code_digest

    return {"step": step, "total_steps": s.total_steps, "metrics": metrics,
            "model": weights or {"w": torch.zeros(2)}, "data": s.data_identity, "code": training_code_digest(),
            "model_config": model_config or dataclasses.asdict(s.model_cfg),
            "params": {"model": to_dict(s.params.model), "train": {**to_dict(s.params.train), **train}}}


@pytest.fixture
def on_disk(tmp_path, monkeypatch):
    """Put a hand-made state where the rules look for a checkpoint; returns the path."""
    from gpt2.run import checkpoint as module

    path = tmp_path / "ckpt.pt"

    def put(state):
        path.write_bytes(b"stand-in")
        monkeypatch.setattr(module, "load", lambda p: dict(state))
        return path
    return put


def test_rules_no_checkpoint_or_resume_never_start_afresh(tmp_path, on_disk, monkeypatch):
    from gpt2.train import resume

    monkeypatch.delenv("DVC_ROOT", raising=False)
    s = fake_run()
    assert resume.load_for_resume(tmp_path / "none.pt", s) is None
    path = on_disk(saved(s, 3))
    assert resume.load_for_resume(path, fake_run(resume="never")) is None
    assert not path.exists() and len(list(tmp_path.glob("ckpt.*.pt"))) == 1  # kept beside, not overwritten


def test_rules_an_unfinished_run_resumes_with_its_changed_settings_listed(on_disk):
    from gpt2.train import resume

    s = fake_run()
    state = resume.load_for_resume(on_disk(saved(s, 3, lr=5.0e-3)), s)
    assert state["step"] == 3 and resume.changed_settings(state, s) == {"lr": (5.0e-3, s.params.train.lr)}


def test_rules_a_finished_run_is_reused_only_with_the_same_params(tmp_path, on_disk, monkeypatch):
    from gpt2.train import resume

    monkeypatch.delenv("DVC_ROOT", raising=False)
    s = fake_run()
    assert resume.load_for_resume(on_disk(saved(s, 12, metrics={"steps": 12}, mlflow=True)), s)["metrics"]
    assert resume.load_for_resume(on_disk(saved(s, 12, metrics={"steps": 12}, lr=0.5)), s) is None
    assert len(list(tmp_path.glob("ckpt.*.pt"))) == 1  # the finished model of other params is kept
    older = saved(s, 12, metrics={"steps": 12})  # a version before train.fp8_head and model.dropout existed
    del older["params"]["train"]["fp8_head"], older["params"]["model"]["dropout"]
    assert resume.load_for_resume(on_disk(older), s)["metrics"]  # trained as their defaults do: reused
    older["params"]["train"]["lr"] = 0.5
    assert resume.load_for_resume(on_disk(older), s) is None


def test_rules_a_finished_run_is_reused_only_by_the_code_that_trained_it(tmp_path, on_disk, monkeypatch, capsys):
    """DVC reruns the train stage when the training code changed: the finished model of the old code is kept, and
    a new run trains (it was reused, and dvc.lock then named new code for the old model). An unfinished run
    resumes across a change (a fix to a long run), and says that it does."""
    from gpt2.train import resume

    monkeypatch.delenv("DVC_ROOT", raising=False)
    s = fake_run()
    other = saved(s, 12, metrics={"steps": 12})
    other["code"] = "0" * 32
    assert resume.load_for_resume(on_disk(other), s) is None
    err = capsys.readouterr().err
    assert "was a finished run (12 steps) trained by other code (the training code in gpt2/ changed since); kept as" \
        in err
    assert ("delete it once you no longer need it; starting a new run; a change that trains the same (a refactor, "
            "a comment) keeps the model if `dvc commit train -f` runs before `dvc repro` (to get it back now, stop "
            "this run: docs/training.md, \"Checkpoints and resume\", says how)") in err
    assert len(list(tmp_path.glob("ckpt.*.pt"))) == 1  # kept beside, not overwritten
    del other["code"]  # written before checkpoints recorded their code
    assert resume.load_for_resume(on_disk(other), s) is None
    unfinished = saved(s, 3)
    unfinished["code"] = "0" * 32
    assert resume.load_for_resume(on_disk(unfinished), s)["step"] == 3
    assert "resuming a run begun by other code (the training code in gpt2/ changed since): the steps from 3 on run " \
           "this code" in capsys.readouterr().err


@pytest.mark.parametrize("change, refused", [
    ({"model_config": {"n_layer": 2}}, r"another model or data: n_layer 2 → 1"),
    ({"optimizer": "muon"}, r"trained with train.optimizer muon; adamw's state cannot continue it"),
    ({"step": 20}, r"at step 20, past this run's 12 steps"),
    ({"weights": {"w": torch.tensor([float("nan")])}}, r"holds NaN or inf weights \(1 tensors, w first\)"),
])
def test_rules_what_a_resume_refuses(on_disk, change, refused):
    from gpt2.train import resume

    s = fake_run()
    state = saved(s, change.get("step", 3), weights=change.get("weights"), **({"optimizer": change["optimizer"]}
                                                                                if "optimizer" in change else {}))
    state["model_config"] = {**state["model_config"], **change.get("model_config", {})}
    state["total_steps"] = 30 if "step" in change else state["total_steps"]
    with pytest.raises(UserError, match=refused):
        resume.load_for_resume(on_disk(state), s)


def test_a_signal_while_the_reports_are_written_says_the_finished_checkpoint_is_kept(tmp_path, tokens, capsys,
                                                                                    monkeypatch):
    """SIGTERM after the last checkpoint, while the reports are written: the message says the model is saved (not
    "no output was written"), and the next run writes the reports from it without training."""
    import os
    import signal

    from gpt2.core.cli import user_errors
    from gpt2.train import describe

    record_end = describe.record_end

    def terminated_midway(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        record_end(*args, **kwargs)

    monkeypatch.setattr(describe, "record_end", terminated_midway)
    params = micro_params(max_steps=4)
    with pytest.raises(SystemExit) as stopped:
        user_errors(run)(tmp_path, tokens, params)
    assert stopped.value.code == 143
    err = capsys.readouterr().err
    ckpt = tmp_path / "run/ckpt.pt"
    assert f"terminated (SIGTERM) while writing the reports; the run had finished and its checkpoint {ckpt}" in err
    assert "no output was written" not in err and not (tmp_path / "run/reports/summary.json").exists()
    monkeypatch.setattr(describe, "record_end", record_end)
    assert run(tmp_path, tokens, params)["steps"] == 4
    assert "is a finished run of these params and data (4 steps); rebuilt" in capsys.readouterr().err
