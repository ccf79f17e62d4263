"""gpt2 plan: parameter and FLOP counts, and the memory estimate against what really happens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from gpt2.cli import main
from gpt2.core import memory_model
from gpt2.measure import plan
from gpt2.model import loss
from gpt2.model.gpt import GPT, gpt_config
from gpt2.run.flops import llmc_share

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("size", ["tiny", "gpt2"])
@pytest.mark.parametrize("pad", [False, True])
def test_parameter_count_matches_the_model(size, pad):
    with torch.device("meta"):
        model = GPT(gpt_config(size, {}, 50257, pad, "flash"))
    s = memory_model.shape(size, pad)
    assert s.params == model.num_params()
    assert s.params_without_wpe == model.num_params(exclude_position_embedding=True)


def test_flops_per_token_of_gpt2_small():
    s = memory_model.shape("gpt2")
    dense, attention = plan.flops_per_token(s.params_without_wpe, s.n_layer, s.n_embd, 1024)
    assert dense + attention == pytest.approx(855e6, rel=0.002)  # nanoGPT's figure for GPT-2 124M at T=1024
    # llm.c's gpt2_estimate_mfu: 6 × every parameter (the padded vocabulary's and wpe's) + 6·L·C·T
    llmc = 6 * s.params + 6 * s.n_layer * s.n_embd * 1024
    assert llmc_share(s.params_without_wpe, s.n_layer, s.n_embd, 1024) == pytest.approx(llmc / (dense + attention))
    assert round(0.473 * llmc / (dense + attention), 3) == 0.444  # the H100's 47.3% in llm.c's count


def saved_activation_bytes(model: GPT, batch: int, seq: int) -> int:
    """Bytes autograd keeps for backward (each storage once), parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    idx = torch.randint(0, 50257, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    return sum(storages.values())


@pytest.mark.parametrize("attention", ["flash", "manual"])
def test_activation_estimate_matches_what_autograd_saves(attention):
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", {}, 50257, True, attention))
    batch, seq = 2, 128
    saved, _ = memory_model.activation_bytes(memory_model.shape("tiny"), batch, seq, amp=False,
                                             flash=attention == "flash")
    log_softmax_out = 4 * batch * seq * model.cfg.padded_vocab_size  # the one vocabulary-wide saved tensor
    assert saved_activation_bytes(model, batch, seq) == pytest.approx(saved + log_softmax_out, rel=0.05)


PEAK_SCRIPT = textwrap.dedent("""
    import json, sys, threading, time
    import torch
    from gpt2.model.gpt import GPT, gpt_config
    from gpt2.model.head import Head

    def anon():  # anonymous memory only: library pages the kernel reclaims and faults back in are not the work's
        with open("/proc/self/status") as f:
            return 1024 * int(next(line for line in f if line.startswith("RssAnon:")).split()[1])

    peak, done = [0], threading.Event()

    def watch():  # every 0.5 ms: the loss's buffers live for tens of milliseconds at these sizes
        while not done.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.0005)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    warm = GPT(gpt_config("tiny", dict(n_layer=1, n_embd=32, n_head=2), 256, True, "flash"))  # kernels, pools
    warm(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))[1].backward()
    del warm
    batch, seq = int(sys.argv[1]), 128
    idx = torch.randint(0, 50257, (batch, seq))
    before = anon()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    model = GPT(gpt_config("tiny", {}, 50257, True, "flash"), Head(int(sys.argv[2])))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):  # the second step holds everything: activations, gradients, AdamW's state
        _, loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    done.set()
    watcher.join()
    print(json.dumps({"before": before, "peak": peak[0]}))
""")


@pytest.mark.parametrize("loss_chunk", [0, 2048])
def test_memory_estimate_matches_the_measured_cpu_peak(loss_chunk):
    # measured here, batch 8 (1024 positions), anonymous memory over the baseline: plain loss 1.02 GB, estimate
    # 0.98 GB; chunked loss in one chunk 0.43 GB, estimate 0.44 GB. glibc returns every block over 64 KB to the
    # kernel when it is freed (MALLOC_MMAP_THRESHOLD_): without that, the chunks it keeps for reuse vary from run
    # to run and come on top (0.70-0.78 GB at batch 16 against 0.67 with it). The GPU test checks small chunks
    # against torch's own count of allocated bytes
    batch = 8
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(batch), str(loss_chunk)], cwd=ROOT, check=True,
                         capture_output=True, text=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    measured = json.loads(out.stdout)
    estimate = memory_model.memory(memory_model.shape("tiny"), batch, 128, amp=False, flash=True,
                                   loss_chunk=loss_chunk).total
    assert measured["peak"] - measured["before"] == pytest.approx(estimate, rel=0.1)


def test_chunked_loss_fits_gpt2_micro_batch_64_on_80_gb_without_compile():
    s = memory_model.shape("gpt2")
    assert memory_model.largest_micro_batch(s, 1024, amp=True, flash=True, memory_gb=80, loss_chunk=8192) >= 64
    assert (memory_model.memory(s, 64, 1024, True, True, 8192).logits
            < memory_model.memory(s, 64, 1024, True, True).logits / 10)


def test_plan_for_gpt2_on_h100_prints_a_budget(runner, tmp_path):
    result = runner.invoke(main, ["plan", "--model", "gpt2", "--tokens", "10e9", "--device", "h100",
                                  "--root", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for expected in ("124,475,904", "855M", "8.554e+18", "largest micro-batch", "assumed", "time", "cost"):
        assert expected in result.output


def test_plan_with_the_fp8_head_counts_its_gradients_and_picks_the_micro_batch_auto_picks(runner, tmp_path):
    """The docs' GPT-2 command runs the FP8 head: planned without it, 128 sequences looked like 52 GB where the H100
    measured 58; with it, the plan holds 2 bytes more per token and vocabulary column, as the trainer's auto does."""
    args = ["plan", "--model", "gpt2", "--tokens", "10e9", "--device", "h100", "--root", str(tmp_path), "--json"]
    plain, fp8 = (json.loads(runner.invoke(main, args + extra).output) for extra in ([], ["--fp8-head"]))
    extra_gb = (fp8["memory"]["amp flash"]["logits"] - plain["memory"]["amp flash"]["logits"]) / 1e9
    assert extra_gb == pytest.approx(2 * 50304 * 16 * 1024 / 1e9)  # --micro-batch 16 by default
    assert fp8["largest_micro_batch"]["amp flash"] < plain["largest_micro_batch"]["amp flash"]
    assert fp8["step"]["micro_batch"] == 128 and fp8["fp8_head"] is True
    shown = runner.invoke(main, args[:-1] + ["--fp8-head"]).output
    assert "FP8 head, loss in chunks of 8192 positions" in shown


@pytest.mark.parametrize("args, message", [
    (["--tokens", "1e300"], "'--tokens': 1e+300 is not in the range 0<x<=1e+16"),  # it printed `inf h`, JSON Infinity
    (["--tokens", "nan"], "'--tokens': 'nan' is not a finite number"),
    (["--tokens", "1e9", "--peak-tflops", "1e-30"], "'--peak-tflops': 1e-30 is not in the range 0.01<=x<=100000.0"),
    (["--tokens", "1e9", "--memory-gb", "0.001"], "'--memory-gb': 0.001 is not in the range 0.1<=x<=100000.0"),
    (["--tokens", "1e9", "--root", "/no/such/folder"], "'--root': Directory '/no/such/folder' does not exist"),
])
def test_plan_refuses_nonsense_inputs(runner, args, message):
    result = runner.invoke(main, ["plan", "--model", "gpt2", *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_plan_gives_the_memory_per_gpu_under_fsdp_and_with_muon(runner, tmp_path):
    args = ["plan", "--model", "gpt2-xl", "--tokens", "1e9", "--device", "l4", "--gpus", "4", "--root", str(tmp_path)]
    replica = runner.invoke(main, args)
    sharded = runner.invoke(main, [*args, "--distributed", "fsdp", "--optimizer", "muon"])
    assert replica.exit_code == sharded.exit_code == 0, sharded.output
    assert "largest micro-batch that fits (amp flash): 0" in replica.output and "unsharded" not in replica.output
    assert "adamw, loss in chunks" in replica.output and "muon, fsdp over 4, loss in chunks" in sharded.output
    assert "  unsharded " in sharded.output and "largest micro-batch that fits (amp flash): 0" not in sharded.output


def test_plan_uses_the_mfu_measured_by_the_ladder(runner, tmp_path):
    report = tmp_path / "reports/ladder"
    report.mkdir(parents=True)
    rows = [{"label": "baseline", "mfu": 0.1, "runtime": {"device_name": "NVIDIA H100 80GB HBM3"}},
            {"label": "fused adamw", "mfu": 0.5, "runtime": {"device_name": "NVIDIA H100 80GB HBM3"}}]
    (report / "ladder.json").write_text(json.dumps({"rows": rows}))  # as written before it named its model
    assert plan.plan("gpt2", 10e9, "h100", root=tmp_path)["mfu_source"].startswith("assumed")
    (report / "ladder.json").write_text(json.dumps({"model": "gpt2", "rows": rows}))
    assert plan.plan("gpt2-medium", 10e9, "h100", root=tmp_path)["mfu_source"].startswith("assumed")  # another size
    p = plan.plan("gpt2", 10e9, "h100", root=tmp_path)
    assert p["mfu"] == 0.5 and "measured" in p["mfu_source"]
    assert p["hours"] == pytest.approx(8.554e18 / (989e12 * 0.5) / 3600, rel=0.01)
    assert plan.plan("gpt2", 10e9, "a100", root=tmp_path)["mfu_source"].startswith("assumed")  # another device
    assert plan.plan("gpt2", 10e9, "h100-pcie", root=tmp_path)["mfu_source"].startswith("assumed")


def test_plan_falls_back_to_the_gpu_checks_committed_run_for_gpt2_on_its_card(tmp_path):
    """No ladder report or MLflow run of its own: the H100's 100 steps at GPT-2's batch (benchmarks/results), not
    an assumed 40%; another size or card stays assumed."""
    import shutil

    from conftest import ROOT

    shutil.copytree(ROOT / "benchmarks/results", tmp_path / "benchmarks/results")
    p = plan.plan("gpt2", 10e9, "h100", root=tmp_path)
    assert p["mfu"] == pytest.approx(0.465, abs=0.001)
    assert p["mfu_source"].startswith("measured by the GPU check on an NVIDIA H100")
    assert "GPT-2 batch, evals and checkpoints (benchmarks/results/gpu_check.json)" in p["mfu_source"]
    assert plan.plan("gpt2", 10e9, "a100", root=tmp_path)["mfu_source"].startswith("assumed")
    assert plan.plan("gpt2-medium", 10e9, "h100", root=tmp_path)["mfu_source"].startswith("assumed")
    assert plan.plan("gpt2", 10e9, "h100", dtype="fp32", root=tmp_path)["mfu_source"].startswith("assumed")  # bf16's


def test_plan_uses_the_mfu_of_a_finished_mlflow_run_and_skips_a_store_without_one(tmp_path, tmp_path_factory):
    mlflow = pytest.importorskip("mlflow")
    from conftest import mlflow_store

    assert plan._has_metric(tmp_path / "none.db", "x") is True  # unreadable: let MLflow decide
    mlflow.set_tracking_uri(mlflow_store(tmp_path_factory, tmp_path))
    mlflow.create_experiment("gpt2", artifact_location=(tmp_path / "artifacts").as_uri())
    mlflow.set_experiment("gpt2")
    with mlflow.start_run():
        mlflow.log_param("model.size", "gpt2")
        mlflow.log_metric("train/loss", 3.0)
    assert not plan._has_metric(tmp_path / "mlflow.db", "summary/perf.mfu")
    assert plan.plan("gpt2", 10e9, "h100", root=tmp_path)["mfu_source"].startswith("assumed")
    with mlflow.start_run():
        mlflow.log_param("model.size", "gpt2")
        mlflow.set_tags({"device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3"})  # as a training tags them
        mlflow.log_metric("summary/perf.mfu", 0.42)
    p = plan.plan("gpt2", 10e9, "h100", root=tmp_path)
    assert p["mfu"] == 0.42 and p["mfu_source"].startswith("measured: MLflow run")
    with mlflow.start_run() as newer:  # as runs log it since MLflow's columns were named
        mlflow.log_param("model.size", "gpt2")
        mlflow.set_tags({"device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3"})  # as a training tags them
        mlflow.log_metric("MFU", 0.45)
    p = plan.plan("gpt2", 10e9, "h100", root=tmp_path)
    assert p["mfu"] == 0.45 and p["mfu_source"].startswith(f"measured: MLflow run {newer.info.run_id}")


def test_largest_micro_batch_fits_and_the_next_does_not():
    s = memory_model.shape("gpt2")
    b = memory_model.largest_micro_batch(s, 1024, amp=True, flash=True, memory_gb=80)
    assert (memory_model.memory(s, b, 1024, True, True).total <= 0.9 * 80e9
            < memory_model.memory(s, b + 1, 1024, True, True).total)


@pytest.mark.parametrize("args, message", [
    (["--device", "tpu"], "tpu"),
    (["--model", "gpt5"], "gpt5"),
    (["--tokens", "-1"], "tokens"),
    (["--seq-len", "4096"], "context"),
])
def test_bad_plan_arguments_are_one_clear_error(runner, args, message):
    result = runner.invoke(main, ["plan", "--tokens", "1e9", *args])
    assert result.exit_code != 0
    assert message in result.output


def test_plan_says_what_does_not_fit_the_step_auto_would_run_and_this_cpus_peak(runner, tmp_path):
    def planned(*args: str) -> str:
        result = runner.invoke(main, ["plan", "--tokens", "1e9", "--root", str(tmp_path), *args])
        assert result.exit_code == 0, result.output
        return result.output

    l4 = planned("--model", "gpt2", "--device", "l4", "--micro-batch", "64")
    assert "micro-batch 64 does NOT fit (amp flash): 28.6 GB of the 21.6 GB usable per GPU" in l4
    assert ("a step of 524,288 tokens (512 sequences per GPU): train.micro_batch_size 32 × train.grad_accum_steps 16 "
            "(what micro_batch_size: auto picks") in l4  # 44 fit; 32 is the largest that divides 512
    assert "does NOT fit" not in planned("--model", "gpt2", "--device", "h100")
    assert "--batch-tokens must be a multiple of 3,072" in planned("--model", "gpt2", "--gpus", "3")
    cpu = planned("--model", "tiny", "--device", "cpu")  # the peak tests/conftest.py keeps for this machine
    assert "0.2 TFLOP/s fp32 peak, measured here before" in cpu and "time              " in cpu and "unknown" not in cpu
    # on a CPU auto keeps params.yaml's micro-batch (gpt2/train/batch.py), whatever the RAM would hold
    assert "micro-batch 8 × 128" in cpu and "train.micro_batch_size 8 × train.grad_accum_steps 512" in cpu
    small = planned("--model", "gpt2", "--device", "cpu", "--memory-gb", "4")  # RAM for fewer than 8: auto takes 8
    assert "train.micro_batch_size 8 × train.grad_accum_steps 64" in small and "micro-batch 8 does NOT fit" in small
    assert f"loss in chunks of {loss.chunk_rows('auto', 'cpu', 50304)} positions" in cpu
    assert "micro-batch 16 × 1024, adamw, loss in chunks of 8192" in planned("--model", "gpt2")


@pytest.mark.parametrize("device, tags, found", [
    ("cpu", {"tags.device": "cpu", "tags.device_name": "AMD EPYC"}, True),
    ("h100", {"tags.device": "cuda:0", "tags.device_name": "NVIDIA H100 80GB HBM3"}, True),
    ("h100", {"tags.device": "cpu", "tags.device_name": "AMD EPYC"}, False),
    ("cpu", {"tags.device": "cuda:0", "tags.device_name": "NVIDIA H100 80GB HBM3"}, False)])
def test_the_plan_reads_the_mfu_a_finished_run_measured_on_the_device(tmp_path, monkeypatch, device, tags, found):
    """A training run tags its device (``cpu``, ``cuda:0``) and the device's name: the plan matched the peak table's
    GPU names against the former, so no run was ever found, on a GPU or on this CPU."""
    import sqlite3

    import mlflow
    import pandas

    from gpt2.measure import plan

    with sqlite3.connect(tmp_path / "mlflow.db") as db:  # a store whose runs logged an MFU
        db.execute("CREATE TABLE metrics (key TEXT)")
        db.execute("INSERT INTO metrics VALUES ('MFU')")
    runs = pandas.DataFrame([{"run_id": "r1", "metrics.MFU": 0.42, "params.model.size": "tiny", **tags}])
    monkeypatch.setattr(mlflow, "search_runs", lambda **kwargs: runs)
    monkeypatch.setattr(mlflow, "set_tracking_uri", lambda uri: None)
    measured = plan._mlflow_mfu(plan.DEVICES[device], "tiny", tmp_path)
    assert (measured == (0.42, f"measured: MLflow run r1 (tiny on {tags['tags.device_name']})")) if found else (
        measured is None)
    if device == "cpu" and found:  # an fp32 plan divides by the fp32 peak: the MFU an fp32 run measured against it
        runs = pandas.DataFrame([{"run_id": "r1", "metrics.MFU": 0.3, "metrics.perf/mfu_dtype": 0.6,
                                  "params.model.size": "tiny", "tags.dtype": "fp32", **tags}])
        monkeypatch.setattr(mlflow, "search_runs", lambda **kwargs: runs)
        assert plan._mlflow_mfu(plan.DEVICES[device], "tiny", tmp_path, "fp32")[0] == 0.6
        assert plan._mlflow_mfu(plan.DEVICES[device], "tiny", tmp_path, "bf16")[0] == 0.3  # the bf16 yardstick
        runs["metrics.perf/mfu"] = 0.2  # the last step's, against the yardstick: its own dtype's median is 0.3 × 2
        runs["metrics.perf/mfu_dtype"] = 0.4
        assert plan._mlflow_mfu(plan.DEVICES[device], "tiny", tmp_path, "fp32")[0] == pytest.approx(0.6)
        runs["tags.dtype"] = "bf16"
        assert plan._mlflow_mfu(plan.DEVICES[device], "tiny", tmp_path, "fp32") is None  # another dtype's run
    if device == "h100" and found:  # a GPU fp32 plan divides by the TF32 peak: a run without TF32 measured another
        runs = pandas.DataFrame([{"run_id": "r1", "metrics.MFU": 0.05, "metrics.perf/mfu_dtype": 0.4,
                                  "params.model.size": "tiny", "tags.dtype": "fp32", **tags}])
        monkeypatch.setattr(mlflow, "search_runs", lambda **kwargs: runs)
        assert plan._mlflow_mfu(plan.DEVICES[device], "tiny", tmp_path, "fp32")[0] == 0.4
        runs["params.train.tf32"] = "False"
        assert plan._mlflow_mfu(plan.DEVICES[device], "tiny", tmp_path, "fp32") is None
