"""The training loop on a micro model: it learns, repeats, measures and reports (train/trainer.py, reports.py)."""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import pytest
import torch
from conftest import micro_params
from training import losses, run

from gpt2.core.errors import UserError
from gpt2.run import checkpoint
from gpt2.run.names import flatten
from gpt2.train import trainer
from gpt2.train.reports import PLOT_COLUMNS
from gpt2.train.trainer import train


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
    assert sorted(flatten(compared)) == ["cost.device_hours", "cost.usd", "machine.others_busy", "machine.steal",
                                         "mem.peak_gb", "perf.mfu", "perf.step_ms",
                                         "perf.step_ms_iqr", "perf.tokens_per_s", "perf.tokens_per_s_iqr",
                                         "perf.tokens_per_s_steady", "perf.tokens_per_s_wall", "train.loss", "train_s",
                                         "val.bpb", "val.loss", "val.loss_se", "val.ppl", "wall_s"]
    # wall-clock throughput: every token over the whole run's time, evals and model build included; the steady
    # state: the 29 steps after the warm-up over their wall time (evals included), between the two
    wall = metrics["wall_s"]  # rounded to 10 ms: the bounds allow for it
    assert 30 * 4 * 16 / (wall + 0.006) < metrics["perf"]["tokens_per_s_wall"] < 30 * 4 * 16 / (wall - 0.006)
    assert metrics["perf"]["tokens_per_s_wall"] < metrics["perf"]["tokens_per_s_steady"]
    history = checkpoint.load(tmp_path / "run/ckpt.pt")["history"]
    assert history["steady_steps"] == 29 and history["steady_s"] < metrics["wall_s"]
    # how busy other work kept the cores while the steady state was timed: its window is that state's, every core
    assert history["load"]["window_s"] == pytest.approx(history["steady_s"] * os.cpu_count(), rel=0.05)
    assert 0 <= metrics["machine"]["others_busy"] <= 1 and metrics["machine"]["cores"] == os.cpu_count()
    assert metrics["perf"]["tokens_per_s_steady"] == pytest.approx(29 * 4 * 16 / history["steady_s"], rel=0.01)
    assert metrics["perf"]["tokens_per_s_wall"] < metrics["perf"]["tokens_per_s"]
    assert metrics["runtime"]["graph_breaks"] is None  # not compiled: nothing to count
    assert compared["val"]["loss"] == round(metrics["val"]["loss"], 4) and compared["perf"] == {
        k: round(metrics["perf"][k], 4) for k in ("step_ms", "step_ms_iqr", "tokens_per_s", "tokens_per_s_iqr",
                                                  "tokens_per_s_steady", "tokens_per_s_wall", "mfu")}
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
    train(micro_params(max_steps=2, eval_interval=2), tokens, tmp_path / "ckpt.pt", tmp_path / "r")  # warmup 3
    said = capfd.readouterr().err
    assert ("warning: the run is 2 steps and train.warmup_steps is 3: the learning rate is still warming up when the "
            "run ends (it never reaches train.lr); lower train.warmup_steps (e.g. 1) or train longer") in said
    assert ("warning: the run is 2 steps and its first 1 (train.timing_warmup_steps: compilation, autotuning) are "
            "left out of its speed: its medians rest on 1 step(s); time at least 10 steps") in said
    train(micro_params(max_steps=3, eval_interval=3), tokens, tmp_path / "three.pt", tmp_path / "r3")
    assert "still warming up" not in capfd.readouterr().err  # its third step trains at train.lr
    train(micro_params(max_steps=11, eval_interval=11), tokens, tmp_path / "ten.pt", tmp_path / "r10")
    assert "left out of its speed" not in capfd.readouterr().err  # 10 timed steps


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
    reports.render_curves(steady, [], "summary", {"step_ms": 184.055, "step_ms_iqr": 9.2})  # every timed step's
    assert titles["ms (warm-up steps left out)"] == "Step time: median 184 ms, IQR 5%"  # as metrics.json says
