"""benchmarks/gpu_check.py's plan on a GPU, with fake children and a fake clock: what runs first, what a job leaves
to the next, a timed-out row measured again, rows of different cards flagged; and gpu_next.py's plan for the next GPU
minutes, replayed at the costs the committed table measured."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks")]

import gpu_check  # noqa: E402
import gpu_next  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def metrics(tokens_per_s: float) -> dict:
    return {"perf": {"step_ms": 1e3 / tokens_per_s, "tokens_per_s": tokens_per_s, "mfu": 0.4},
            "mem": {"peak_gb": 20.0}, "runtime": {}}


def fake_children(monkeypatch, clock: Clock, cost_s: dict[str, float], calls: list) -> None:
    """Each child costs ``cost_s[kind]`` seconds of the fake clock; past its limit it is a timeout."""
    def run_child(params, tokens, out, timeout_s):
        train = params["train"]
        kind = ("autotune" if str(train.get("compile_mode", "")).startswith("max-autotune")
                else "compiled" if train.get("compile", True) else "plain")
        calls.append((train, timeout_s))
        cost = cost_s.get("long", cost_s[kind]) if train["max_steps"] > 20 else cost_s[kind]
        if timeout_s is not None and cost > timeout_s:
            clock.now += timeout_s
            return None, f"timed out after {timeout_s:g} s", ""
        clock.now += cost
        return metrics(1000.0 + len(calls)), "", ""

    monkeypatch.setattr(gpu_check, "run_child", run_child)


def new_check(tmp_path, budget_s, clock, machine="card-1", rows=(), stretch=False) -> gpu_check.Check:
    report = gpu_check.Report(tmp_path / "check.json", {"device": "H100", "torch": "2.11", "smoke": False,
                                                        "date": "d"})
    report.data["rows"] = [dict(r) for r in rows]
    prof = {**gpu_check.profile(False), "memory_gb": 80.0}
    return gpu_check.Check(report, prof, True, False, "tokens", str(tmp_path), gpu_check.Budget(budget_s, 300.0, clock,
                                                                                             stretch), machine)


def test_a_row_that_does_not_fit_is_left_to_the_next_job_and_cheaper_rows_still_run(tmp_path, monkeypatch):
    clock, calls = Clock(), []
    fake_children(monkeypatch, clock, {"plain": 30.0, "compiled": 100.0, "autotune": 400.0}, calls)
    check = new_check(tmp_path, 610.0, clock)
    left = check.run(("best", "levers", "ladder"), None, 1)
    names = [r["name"] for r in check.report.data["rows"]]
    assert names[:5] == ["all switches", "all switches + Liger fused loss", "all switches + FP8 matmuls (tensorwise)",
                         "all switches + FP8 matmuls (rowwise, forward and input gradient)",
                         "all switches + FP8 LM head"]
    # max-autotune (450 s until measured) does not fit the 110 s left: left, and the ladder's first rungs run instead
    assert "all switches + max-autotune" in left and "all switches + max-autotune" not in names
    assert names[5:] == ["fp32", "+ tf32", "+ bf16 autocast"]  # 20 s left: no compiled rung (100 s here)
    assert left[-1] == "the ladder from '+ torch.compile'"  # a rung left leaves the rungs below it
    rows = check.report.data["rows"]
    assert all(r["machine"] == "card-1" and r["seconds"] > 0 for r in rows)
    assert rows[0]["kind"] == "compiled" and rows[5]["kind"] == "plain"
    assert check.expected_s("compiled") == 100.0  # what this card measured, not the cold default (150)


def test_a_timed_out_row_is_measured_again_with_twice_the_time_in_its_place(tmp_path, monkeypatch):
    clock, calls = Clock(), []
    fake_children(monkeypatch, clock, {"plain": 30.0, "compiled": 400.0, "autotune": 400.0}, calls)
    check = new_check(tmp_path, None, clock)
    check.run(("best",), None, 1)
    first = check.report.row("all switches")
    assert first["failed"] == "timed out after 300 s" and first["timeout_s"] == 300.0 and calls[-1][1] == 300.0
    check.report.data["rows"].insert(0, {"name": "fp32", "step_ms": 1.0, "tokens_per_s": 1.0})
    check.run(("best",), None, 1)  # the next job: the same row, with 600 s
    assert calls[-1][1] == 600.0
    assert [r["name"] for r in check.report.data["rows"]] == ["fp32", "all switches"]
    assert "failed" not in check.report.row("all switches")
    smoke = {"name": "smoke row", "failed": "timed out after 2 s", "timeout_s": 2.0}  # an earlier job's own limit
    again = new_check(tmp_path, None, clock, rows=[smoke])  # this job's --timeout-s: 300 s
    again.measure("smoke row", {"compile": False})
    assert calls[-1][1] == 300.0 and "failed" not in again.report.row("smoke row")  # not 4 s


def test_a_row_the_budget_stops_is_recorded_with_its_time_and_starts_again_only_with_more(tmp_path, monkeypatch):
    """What an H100 job did (2026-11-27): max-autotune, timed out at 300 s before, got the 450 s left of the job and
    was stopped by the budget. The time it had is recorded, so the next job gives it more, not the same again."""
    clock, calls = Clock(), []
    fake_children(monkeypatch, clock, {"plain": 30.0, "compiled": 50.0, "autotune": 900.0}, calls)
    before = {"name": "all switches + max-autotune", "failed": "timed out after 300 s", "timeout_s": 300.0,
              "machine": "card-1", "kind": "autotune", "seconds": 300.0}
    check = new_check(tmp_path, 750.0, clock, rows=[before])
    left = check.run(("best", "levers"), None, 1)
    cut = check.report.row("all switches + max-autotune")
    assert calls[-1][1] == 450.0 and left == ["all switches + max-autotune"]
    assert cut["failed"] == "timed out after 450 s" and cut["timeout_s"] == 450.0 and cut["seconds"] == 450.0
    short = new_check(tmp_path, 500.0, clock, rows=check.report.data["rows"])
    assert short.run(("levers",), None, 1) == ["all switches + max-autotune"]  # 500 s: not more than 450 s
    assert len(calls) == 7
    longer = new_check(tmp_path, 1000.0, clock, rows=check.report.data["rows"])
    assert longer.run(("levers",), None, 1) == []
    assert calls[-1][1] == 900.0 and "failed" not in longer.report.row("all switches + max-autotune")


def test_the_default_timeout_stretches_to_a_rows_expected_cost_and_a_chosen_one_does_not(tmp_path, monkeypatch):
    clock, calls = Clock(), []
    fake_children(monkeypatch, clock, {"plain": 30.0, "compiled": 50.0, "autotune": 400.0}, calls)
    check = new_check(tmp_path, None, clock, stretch=True)  # 300 s; a cold max-autotune row is expected to cost 450 s
    check.measure("autotune", {"compile_mode": "max-autotune-no-cudagraphs"})
    assert calls[-1][1] == gpu_check.COST_S["autotune"] and "failed" not in check.report.row("autotune")
    chosen = new_check(tmp_path, None, clock)  # --timeout-s 300 given: the user's limit holds
    chosen.measure("autotune, 300 s", {"compile_mode": "max-autotune-no-cudagraphs"})
    assert calls[-1][1] == 300.0 and chosen.report.row("autotune, 300 s")["failed"] == "timed out after 300 s"


def test_the_long_row_is_a_kind_of_its_own_and_leaves_the_next_rows_cost_alone(tmp_path, monkeypatch):
    clock, calls = Clock(), []
    fake_children(monkeypatch, clock, {"plain": 30.0, "compiled": 50.0, "autotune": 400.0, "long": 200.0}, calls)
    check = new_check(tmp_path, 340.0, clock)
    left = check.run(("best", "long", "peers"), None, 1)
    rows = {r["name"]: r for r in check.report.data["rows"]}
    assert rows["100 steps, GPT-2 batch, evals and checkpoints every 25"]["kind"] == "long"
    [long] = [train for train, _ in calls if train["max_steps"] == 100]  # three evals: the first compiles, set aside
    assert long["eval_interval"] == long["checkpoint_interval"] == 25 and long["final_eval"] is False
    assert check.expected_s("compiled") == 50.0 and check.expected_s("long") == 200.0
    assert "best, DDP in 1 process" in rows and left == ["peers"]  # 90 s left: DDP (50 s) runs, then Muon does not


def test_a_row_that_lacked_a_package_is_measured_again_once_the_package_imports(tmp_path, monkeypatch):
    clock, calls = Clock(), []
    fake_children(monkeypatch, clock, {"plain": 30.0, "compiled": 50.0, "autotune": 400.0}, calls)
    lacked = {"name": "liger", "machine": "card-1", "kind": "compiled", "seconds": 16.0,
              "failed": "gpt2.core.errors.UserError: train.loss_kernel liger needs liger-kernel, which is not "
                        "installed here: pip install liger-kernel (or set train.loss_kernel: torch)"}
    check = new_check(tmp_path, None, clock, rows=[lacked])
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None)
    assert check.measure("liger", {"loss_kernel": "liger"})["failed"].startswith("gpt2.core.errors.UserError")
    assert calls == []  # still not installed: the failure stands
    found = []
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: found.append(name) or object())
    assert "failed" not in check.measure("liger", {"loss_kernel": "liger"}) and found == ["liger_kernel"]
    assert len(calls) == 1 and [r["name"] for r in check.report.data["rows"]] == ["liger"]  # in its old place


def test_a_row_of_the_same_configuration_on_the_same_card_is_reused_not_run_again(tmp_path, monkeypatch):
    clock, calls = Clock(), []
    fake_children(monkeypatch, clock, {"plain": 30.0, "compiled": 100.0, "autotune": 400.0}, calls)
    check = new_check(tmp_path, None, clock)
    check.run(("best", "ladder"), None, 1)
    rows = {r["name"]: r for r in check.report.data["rows"]}
    assert rows["+ bf16 residual stream"]["note"] == "the run of 'all switches' (the same configuration)"
    assert rows["+ bf16 residual stream"]["tokens_per_s"] == rows["all switches"]["tokens_per_s"]
    other = new_check(tmp_path, None, clock, machine="card-2", rows=check.report.data["rows"])
    before = len(calls)
    other.measure("again", rows["all switches"]["train"] | {"attention": "flash", "pad_vocab": True})
    assert len(calls) == before + 1  # another card measures it itself
    for r in check.report.data["rows"]:
        r["superseded"] = "measured before a change to the code it runs"
    check.measure("after the change", rows["all switches"]["train"] | {"attention": "flash", "pad_vocab": True})
    assert len(calls) == before + 2  # a superseded row stands in for nothing


def test_a_lever_from_an_earlier_card_keeps_its_own_cards_baseline(tmp_path, monkeypatch):
    clock, calls = Clock(), []
    fake_children(monkeypatch, clock, {"plain": 30.0, "compiled": 100.0, "autotune": 400.0}, calls)
    first = new_check(tmp_path, None, clock)
    first.run(("best", "ladder"), None, 1)  # card 1: 'all switches', and '+ bf16 residual stream' its twin
    lever = {**first.report.row("all switches"), "name": "all switches + FP8 LM head", "tokens_per_s": 2000.0}
    rows = [r for r in first.report.data["rows"] if r["name"] != "all switches"] + [lever]
    second = new_check(tmp_path, 250.0, clock, machine="card-2", rows=rows)  # 'all switches' measured again
    second.run(("best", "levers"), None, 1)
    own = first.report.row("all switches")["tokens_per_s"]
    assert second.report.row("all switches")["machine"] == "card-2"
    note = second.report.row("all switches + FP8 LM head")["note"]
    assert note == f"{100 * (2000.0 / own - 1):+.1f}% tokens/s vs all switches"  # card 1's, not flagged


def test_a_lever_still_to_measure_on_a_new_card_gets_that_cards_baseline_first(tmp_path, monkeypatch):
    clock, calls = Clock(), []
    fake_children(monkeypatch, clock, {"plain": 30.0, "compiled": 100.0, "autotune": 250.0}, calls)
    first = new_check(tmp_path, None, clock)
    first.run(("best",), None, 1)
    second = new_check(tmp_path, None, clock, machine="card-2", rows=first.report.data["rows"])
    second.run(("best", "levers"), None, 1)
    rows = second.report.data["rows"]
    assert [r["name"] for r in rows[:3]] == ["all switches", "all switches (card card-2)",
                                              "all switches + Liger fused loss"]
    assert rows[1]["machine"] == "card-2" and rows[0]["machine"] == "card-1"
    baseline = rows[1]["tokens_per_s"]
    note = second.report.row("all switches + FP8 LM head")["note"]
    assert note == f"{100 * (second.report.row('all switches + FP8 LM head')['tokens_per_s'] / baseline - 1):+.1f}% " \
                   "tokens/s vs all switches"  # this card's baseline: not flagged as across cards
    before = len(calls)
    second.run(("best", "levers"), None, 1)  # every lever measured: no baseline again
    assert len(calls) == before


def test_nanogpt_pairs_best_first_each_measured_whole_on_one_card(tmp_path, monkeypatch):
    clock, calls = Clock(), []
    fake_children(monkeypatch, clock, {"plain": 30.0, "compiled": 100.0, "autotune": 400.0}, calls)
    theirs = []
    monkeypatch.setattr(gpu_check.nanogpt_peer, "run", lambda folder, args, timeout_s: (
        theirs.append(args) or clock.__setattr__("now", clock.now + 100.0) or [30.0] * 20, {"peak_gb": 9.0},
        "", ""))
    ours_elsewhere = {"name": "nanoGPT's settings on our code (run 1)", "tokens_per_s": 5.0, "step_ms": 1.0,
                      "machine": "card-0"}
    check = new_check(tmp_path, 650.0, clock, rows=[ours_elsewhere])
    left = check.run(("nanogpt",), tmp_path, 2)
    rows = {r["name"]: r for r in check.report.data["rows"]}
    largest = check.all_switches()["micro_batch_size"]
    best = f"nanoGPT's own train.py, micro-batch {largest} (best pair 2)"
    assert [c[0]["micro_batch_size"] for c in calls] == [largest, largest, 12]  # each side at its best first
    assert f"--batch_size={largest}" in theirs[0] and "--batch_size=12" in theirs[2]
    assert "ours ÷ nanoGPT" in rows[best]["note"] and "nanogpt_best_ratio" in check.report.data
    assert rows["nanoGPT's settings on our code (run 1)"]["machine"] == "card-1"  # measured again, beside theirs
    assert rows["nanoGPT's own train.py (run 1)"]["machine"] == "card-1" and len(theirs) == 3
    assert left == ["nanoGPT settings pair 2"] and "nanoGPT's own train.py (run 2)" not in rows  # 50 s: not half
    assert "ours ÷ nanoGPT" in rows["nanoGPT's own train.py (run 1)"]["note"]


def test_rows_of_different_cards_are_flagged_with_each_cards_probe():
    rows = [{"name": n, "step_ms": 1.0, "tokens_per_s": 1.0, "micro_batch": 1, "accum": 1, "machine": m}
            for n, m in (("a", "uuid-1"), ("b", "uuid-2"))]
    machines = {"uuid-1": {"bf16_gemm_tflops": 675.4, "copy_tb_s": 3.0}, "uuid-2": {"bf16_gemm_tflops": 690.0,
                                                                                  "copy_tb_s": 3.01}}
    text = gpu_check.table(rows, machines)
    assert "| card |" in text and text.count(" A |") == 1 and text.count(" B |") == 1
    assert "A: uuid-1 (675.4 TFLOP/s bf16 GEMM, 3 TB/s copy); B: uuid-2" in text
    assert gpu_check.apart(*rows) == " (rows from different cards: see the probes)"
    assert gpu_check.apart(rows[0], rows[0]) == "" and "| card |" not in gpu_check.table(rows[:1], machines)
    assert "in llm.c's count each MFU is 0.939 × the one shown" in gpu_check.table(rows, machines, 0.9393)


RUN_UNINSTALLED = """
import runpy, sys
sys.meta_path = [f for f in sys.meta_path if "Editable" not in type(f).__name__ and "editable" not in str(f)]
sys.path = [p for p in sys.path if p not in ("", ".")]
try:
    import gpt2
except ImportError:
    pass
else:
    raise SystemExit(f"gpt2 is importable here: {gpt2.__file__}")
sys.argv = [sys.argv[1], "--help"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("script", ["nanogpt_peer.py", "gpu_check.py", "gpu_next.py", "gpu_levers.py"])
def test_the_gpu_box_scripts_run_as_copied_without_installing_the_project(script, tmp_path):
    result = subprocess.run([sys.executable, "-c", RUN_UNINSTALLED, str(ROOT / "benchmarks" / script)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout.lower()


def test_peers_and_fit_compare_with_the_plain_row_and_say_what_the_memory_model_got(tmp_path, monkeypatch):
    """peers and fit from the fastest row: DDP's and FSDP's overhead and Muon's step time against the plain row,
    micro-batch auto's choice and the next size up (out of memory, as the model said)."""
    calls = []

    def run_child(params, tokens, out, timeout_s):
        train = params["train"]
        calls.append(train)
        if train["micro_batch_size"] == 16:
            return None, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", ""
        step_ms = {"ddp": 11.0, "fsdp": 12.0}.get(train.get("distributed"), 15.0 if train.get("optimizer") else 10.0)
        result = metrics(1e3 / step_ms)
        result["perf"]["step_ms"] = step_ms
        if train["micro_batch_size"] == "auto":
            result["runtime"] = {"micro_batch_size": 8, "grad_accum_steps": 64}
        return result, "", ""

    monkeypatch.setattr(gpu_check, "run_child", run_child)
    check = new_check(tmp_path, None, Clock(), rows=[{"name": "+ fused AdamW", "tokens_per_s": 100.0, "step_ms": 10.0,
                                                     "machine": "card-1"}])
    best = {"micro_batch_size": 8, "compile": True}
    check.peers(best)
    check.fit(best)
    rows = {r["name"]: r for r in check.report.data["rows"]}
    assert rows["best, DDP in 1 process"]["note"] == "DDP overhead +10.0%"
    assert rows["best, Muon optimizer"]["note"] == "step time vs AdamW +50.0%"
    assert rows["best, FSDP in 1 process"]["note"] == "FSDP overhead +20.0% (one process)"
    auto = rows["best, micro-batch auto (GPT-2 batch)"]
    assert (auto["micro_batch"], auto["accum"]) == (8, 64) and calls[3]["batch_tokens"] == 524_288
    assert rows["auto's next micro-batch up"]["note"] == "out of memory, as the model said"


def test_a_rows_memory_estimate_reads_attention_from_the_model_section():
    prof = gpu_check.profile(False)
    flash = gpu_check.train_params(prof, {"attention": "flash", "micro_batch_size": 64}, 20)
    manual = gpu_check.train_params(prof, {"attention": "manual", "micro_batch_size": 64}, 20)
    assert "attention" not in flash["train"]  # train_params moves it where params.yaml keeps it
    assert gpu_check.estimate_gb(prof, flash, 64) < 0.5 * gpu_check.estimate_gb(prof, manual, 64)



def measured_rows() -> list[dict]:
    """Every row of our code that a GPU measured, compiled, with its peak: the H100s' and the H200's."""
    import json

    return [r for card in ("gpu_check.json", "gpu_check_h200.json")
            for r in json.loads((ROOT / "benchmarks" / "results" / card).read_text())["rows"]
            if r.get("peak_gb") and r.get("model") and r["train"].get("compile")]


def test_micro_batch_autos_margin_covers_every_compiled_peak_the_gpus_measured():
    """Compiled, the peak moves away from the memory model's count both ways (8-17% under it at micro-batch 64,
    4% over at 256 on the H200): train.memory_margin, which micro-batch auto leaves free, has to cover it."""
    from gpt2.core.config import TrainConfig

    prof = gpu_check.profile(smoke=False)
    rows = measured_rows()
    assert len(rows) > 10
    for r in rows:
        estimate = gpu_check.estimate_gb(prof, {"model": r["model"], "train": r["train"]}, r["micro_batch"])
        assert r["peak_gb"] <= estimate / (1 - TrainConfig.memory_margin), r["name"]


def test_the_memory_model_counts_what_the_fp8_head_held_on_an_h100():
    """The FP8 head held 6.3 GB more than every switch without it on the same H100 at 64 x 1024 tokens: two bytes
    per token and vocabulary column. Before the model counted them it planned the same memory for both, and
    micro-batch auto would fill an H200 with 256 sequences that need about 129 GB."""
    prof = gpu_check.profile(smoke=False)
    fp8 = next(r for r in measured_rows() if r["train"].get("fp8_head") and r["micro_batch"] == 64
               and r["name"].startswith("all switches + FP8 LM head") and "superseded" not in r
               and "fp32 loss gradient" not in r["name"])
    base = next(r for r in measured_rows() if r["machine"] == fp8["machine"] and r["name"].startswith("all switches (")
                and not r["train"].get("fp8_head"))
    planned = [gpu_check.estimate_gb(prof, {"model": r["model"], "train": r["train"]}, 64) for r in (fp8, base)]
    assert planned[0] - planned[1] == pytest.approx(fp8["peak_gb"] - base["peak_gb"], rel=0.1)


def test_the_best_pair_runs_ours_with_the_lever_that_beat_every_switch_on_its_own_card(tmp_path, monkeypatch):
    """The FP8 head beat every switch by 2.5% on one H100, which ran every switch slower than the card that measured
    'all switches': ours goes into the next best pair with the head, and the pairs from before keep their rows."""
    clock, calls = Clock(), []
    fake_children(monkeypatch, clock, {"plain": 30.0, "compiled": 100.0, "autotune": 400.0}, calls)
    monkeypatch.setattr(gpu_check.nanogpt_peer, "run", lambda folder, args, timeout_s: (
        clock.__setattr__("now", clock.now + 100.0) or [30.0] * 20, {"peak_gb": 9.0}, "", ""))
    first = new_check(tmp_path, None, clock)
    first.run(("best",), None, 1)
    base = first.all_switches()
    own = {**first.report.row("all switches"), "name": "all switches (card card-2)", "tokens_per_s": 900.0,
           "machine": "card-2"}
    lever = {**own, "name": "all switches + FP8 LM head", "tokens_per_s": 950.0,
             "train": {**own["train"], "fp8_head": True}}
    slower = {**own, "name": "all switches + max-autotune", "tokens_per_s": 990.0, "machine": "card-1"}
    old_pair = [{"name": "every switch on our code (best pair 1)", "tokens_per_s": 5.0, "machine": "card-0"},
                {"name": "nanoGPT's own train.py, micro-batch 64 (best pair 1)", "tokens_per_s": 4.0,
                 "machine": "card-0"}]
    check = new_check(tmp_path, None, clock, machine="card-2",
                      rows=first.report.data["rows"] + [own, lever, slower] + old_pair)
    assert check.fastest_switches(base) == {**base, "fp8_head": True}  # +5.6% on its card; max-autotune -1%
    before = len(calls)
    check.run(("nanogpt",), tmp_path, 1)
    rows = {r["name"]: r for r in check.report.data["rows"]}
    assert calls[before][0]["fp8_head"] is True and "fp8_head" not in calls[-1][0]  # the best pair, then nanoGPT's
    assert {"every switch + FP8 LM head on our code (best pair 1, ours + FP8 LM head)",
            "nanoGPT's own train.py, micro-batch 64 (best pair 1, ours + FP8 LM head)"} <= set(rows)
    assert rows["every switch on our code (best pair 1)"]["tokens_per_s"] == 5.0
    assert rows["nanoGPT's own train.py, micro-batch 64 (best pair 1)"]["tokens_per_s"] == 4.0


def test_the_profile_is_taken_again_once_a_lever_makes_another_row_the_fastest(tmp_path, monkeypatch):
    clock, calls, profiled = Clock(), [], []
    fake_children(monkeypatch, clock, {"plain": 30.0, "compiled": 100.0, "autotune": 400.0}, calls)
    monkeypatch.setattr(gpu_check, "profile_best", lambda params, tokens, report, timeout_s: (
        profiled.append(params["train"]) or {"ms_per_step": 1.0, "by_kind": {"matmul": 1.0}}))
    check = new_check(tmp_path, None, clock)
    check.run(("best", "profile"), None, 1)
    check.run(("profile",), None, 1)
    assert len(profiled) == 1 and "fp8_head" not in profiled[0]  # the same fastest row: profiled once
    lever = {**check.report.row("all switches"), "name": "all switches + FP8 LM head", "tokens_per_s": 1e6}
    check.report.data["rows"].append(lever)
    check.run(("profile",), None, 1)
    assert len(profiled) == 2 and profiled[1]["fp8_head"] is True
    assert check.report.data["profile"]["train"]["fp8_head"] is True
    assert check.report.data["earlier profiles"][0]["train"] == profiled[0]


def test_levers_that_each_won_are_measured_together_and_the_best_pair_runs_them(tmp_path, monkeypatch):
    """Two FP8 recipes and the FP8 head on top of every switch: the faster FP8 recipe and the head each won alone,
    so one more row runs them together; it is our side's best, and the best pair is named after both."""
    clock, calls = Clock(), []
    gains = {"fp8_head": 1.03, "fp8": {"rowwise_fwd_dgrad": 1.02, "tensorwise": 1.01}, "loss_kernel": 0.5,
             "compile_mode": 0.97}

    def run_child(params, tokens, out, timeout_s):
        train = params["train"]
        calls.append(train)
        clock.now += 50.0
        speed = 1000.0
        for key, gain in gains.items():
            if train.get(key) not in (None, False, "off", "torch", "default"):
                speed *= gain[train[key]] if isinstance(gain, dict) else gain
        return metrics(speed), "", ""

    monkeypatch.setattr(gpu_check, "run_child", run_child)
    monkeypatch.setattr(gpu_check.nanogpt_peer, "run", lambda folder, args, timeout_s: (
        clock.__setattr__("now", clock.now + 50.0) or [30.0] * 20, {"peak_gb": 9.0}, "", ""))
    check = new_check(tmp_path, None, clock)
    check.run(("best", "levers"), None, 1)
    base = check.all_switches()
    both = "all switches + FP8 matmuls (rowwise, forward and input gradient) + FP8 LM head"
    assert calls[-1]["fp8"] == "rowwise_fwd_dgrad" and calls[-1]["fp8_head"] is True  # the winners, together
    assert check.report.row(both)["tokens_per_s"] == pytest.approx(1000 * 1.02 * 1.03)
    assert check.fastest_switches(base) == {**base, "fp8": "rowwise_fwd_dgrad", "fp8_head": True}
    check.run(("nanogpt",), tmp_path, 1)
    names = {r["name"] for r in check.report.data["rows"]}
    assert ("every switch + FP8 matmuls (rowwise, forward and input gradient) + FP8 LM head on our code (best pair 1, "
            "ours + FP8 matmuls (rowwise, forward and input gradient) + FP8 LM head)") in names
    runs = len(calls)
    check.run(("levers",), None, 1)  # every lever and the winners together measured: nothing runs again
    assert len(calls) == runs


def test_the_ladder_part_never_stacks_a_lever_on_another(tmp_path, monkeypatch):
    """The levers are measured alone on every switch (--part levers); stacked as rungs, Liger's loss would make
    the FP8 head's rung fail and a lever that loses would slow every rung below it."""
    clock, calls = Clock(), []
    fake_children(monkeypatch, clock, {"plain": 1.0, "compiled": 1.0, "autotune": 1.0}, calls)
    check = new_check(tmp_path, 10_000.0, clock)
    check.run(("ladder",), None, 1)
    assert [r["name"] for r in check.report.data["rows"]] == [name for name, _ in gpu_check.RUNGS]
    levers = {key for _, change in gpu_check.LEVERS for key in change}
    assert not any(levers & {k for k, v in train.items() if v not in (None, False, "off", "torch", "default")}
                   for train, _ in calls)


def test_the_cuda_tests_run_again_on_every_card_that_has_not_run_them(tmp_path, monkeypatch):
    """A JSON carried from another card holds that card's test results: a new card runs the tests itself (a
    compile that passes on one card model may fail on another); the same card does not run them twice."""
    ran = []

    def run_tests(report, limit, key, selection, machine):
        ran.append((key, machine))
        report.data.setdefault("tests by card", {}).setdefault(machine, {})[key] = "1 passed"

    monkeypatch.setattr(gpu_check, "run_tests", run_tests)
    earlier = new_check(tmp_path, None, Clock(), machine="card-1")
    earlier.report.data["tests first"] = "1 passed"  # as a JSON from before tests by card
    earlier.tests("tests first", gpu_check.FIRST_TESTS)
    assert ran == [("tests first", "card-1")]
    carried = new_check(tmp_path, None, Clock(), machine="card-2")
    carried.report.data.update(earlier.report.data)
    carried.tests("tests first", gpu_check.FIRST_TESTS)
    carried.tests("tests first", gpu_check.FIRST_TESTS)
    assert ran == [("tests first", "card-1"), ("tests first", "card-2")]


COMMITTED = json.loads((ROOT / "benchmarks/results/gpu_check.json").read_text())


def committed_costs() -> tuple[float, float, dict[str, float]]:
    """What the H100 that measured the committed table took: a compiled row of every switch cold (its first
    compile), the same warm (the best pairs' second runs, compile cached), and the CUDA tests."""
    rows = {r["name"]: r for r in COMMITTED["rows"]}
    cold = max(rows["all switches (card e54119b9)"]["seconds"], rows["all switches + FP8 LM head"]["seconds"])
    warm = max(rows[f"every switch on our code (best pair {k})"]["seconds"] for k in (1, 2))
    tests = {key: float(re.search(r"in ([\d.]+)s", COMMITTED[key]).group(1)) for key in ("tests first", "tests")}
    return cold, warm, tests


def levers_table(rowwise_speedup: float, flash_speedup: float) -> dict:
    """gpu_levers.py gemms attention's JSON: the rowwise FP8 matmuls at ``rowwise_speedup`` × bf16 on every shape,
    SDPA's flash kernel at ``flash_speedup`` × cuDNN's, FlexAttention faster than both, FA3 missing."""
    gemms = [{"shape": name, "m": m, "k": k, "n": n, "bf16_ms": 1.0, "tensorwise_ms": 0.7,
              "rowwise_ms": 1.0 / rowwise_speedup} for name, (m, k, n) in gpu_next.GEMMS.items()]
    attention = [{"kernel": "math (reference)", "forward_ms": 9.0, "backward_ms": 20.0},
                 {"kernel": "cuDNN (SDPA)", "forward_ms": 1.0, "backward_ms": 2.0},
                 {"kernel": "flash (SDPA)", "forward_ms": 1.0 / flash_speedup, "backward_ms": 2.0 / flash_speedup},
                 {"kernel": "FA3 (SDPA's flash backend)", "unavailable": "no FA3 package"},
                 {"kernel": "FlexAttention (compiled)", "forward_ms": 0.8, "backward_ms": 1.6}]
    return {"device": "H100", "gemms": gemms, "attention": attention}


def replay(tmp_path, monkeypatch, levers: dict, gains: dict, nanogpt: Path | None = None, data: dict | None = None):
    """One job of gpu_next's plan on a new card (or on the card of ``data``, the table the last job returned), each
    child costing what the committed table measured (cold the first time this job runs a configuration, warm
    after), the tokens/s of every switch times each lever's gain in that round."""
    clock, events, seen = Clock(), [], set()
    cold, warm, tests = committed_costs()

    def run_child(params, tokens, out, timeout_s):
        train, key = params["train"], gpu_check.config_key(params)
        cost = warm if key in seen else cold * (3 if train.get("compile_tuning") else 1)
        seen.add(key)
        if timeout_s is not None and cost > timeout_s:
            clock.now += timeout_s
            return None, f"timed out after {timeout_s:g} s", ""
        clock.now += cost
        changed = tuple(k for k in ("fp8_head", "fp8", "sdpa_backend", "compile_tuning")
                        if train.get(k) not in (None, False, "off", "cudnn"))
        events.append(("row", changed))
        speed = 500_000.0 * (1 + 0.002 * (-1) ** len(events))  # every run a little apart
        for k in changed:
            speed *= gains.get(k, [1.0] * 3)[sum(1 for e in events if e == ("row", changed)) - 1]
        return metrics(speed), "", ""

    def run_tests(report, limit, key, selection, machine):
        clock.now += tests[key]
        events.append(("tests", key))
        report.data.setdefault("tests by card", {}).setdefault(machine, {})[key] = "passed"

    def probe(out, timeout_s):
        clock.now += 75.0  # 15 s of matmuls, a minute of attention kernels
        events.append(("probe", timeout_s))
        return levers

    def profile_best(params, tokens, report, timeout_s):
        clock.now += warm + 10.0  # a run under the profiler
        events.append(("profile", tuple(k for k in ("fp8_head", "fp8") if params["train"].get(k) not in
                                        (None, False, "off"))))
        return {"ms_per_step": 1.0, "by_kind": {"matmul": 1.0}}

    def nanogpt_run(folder, args, timeout_s):
        clock.now += warm
        events.append(("nanogpt", None))
        return [30.0] * 20, {"peak_gb": 9.0}, "", ""

    monkeypatch.setattr(gpu_check, "run_child", run_child)
    monkeypatch.setattr(gpu_check, "run_tests", run_tests)
    monkeypatch.setattr(gpu_check, "profile_best", profile_best)
    monkeypatch.setattr(gpu_check.nanogpt_peer, "run", nanogpt_run)
    check = new_check(tmp_path, gpu_next.BUDGET_S, clock, machine="new-card", stretch=True,
                      rows=(data or COMMITTED)["rows"])
    check.report.data.update({k: json.loads(json.dumps(v)) for k, v in (data or {}).items() if k != "rows"})
    lines = gpu_next.run_plan(check, tmp_path, nanogpt, probe)
    assert clock.now <= 9 * 60, (clock.now, lines)  # one command under 9 minutes, the start of the box apart
    return check, events, lines


GAINS = {"fp8_head": [1.024, 1.026, 1.025], "fp8": [1.001, 0.998, 1.002], "compile_tuning": [0.985, 0.99, 0.988]}
ROWWISE_RECIPE = "+ FP8 matmuls (rowwise, forward and input gradient)"


def test_the_next_gpu_minutes_fit_9_minutes_a_job_at_the_committed_costs_and_judge_each_lever(tmp_path, monkeypatch):
    """Three jobs on a new H100. The first: the go/no-go (our FP8 recipe's matmuls 1.3 × bf16's: go; FlexAttention
    faster but not selectable), then every switch and the FP8 head in three alternating rounds (the head wins
    outside noise), its profile and the CUDA tests. The second races nanoGPT with the head first, then judges our
    FP8 recipe (inside noise); the third, Inductor's tuning (slower, outside noise). Each under 9 minutes."""
    check, events, lines = replay(tmp_path, monkeypatch, levers_table(1.3, 1.0), GAINS, nanogpt=tmp_path)
    base, head, recipe, tuning = (), ("fp8_head",), ("fp8",), ("compile_tuning",)
    assert events[0][0] == "probe"
    assert [changed for kind, changed in events if kind == "row"] == [base, head, head, base, base, head]
    assert events[7:] == [("profile", head), ("tests", "tests first"), ("tests", "tests")]
    assert "FP8 rowwise recipe: go: rowwise FP8 matmuls 1.30× bf16's on the blocks' shapes (needs 1.15×)" in lines
    assert any(line.startswith("attention: FlexAttention (compiled) runs 1.25× cuDNN's") for line in lines)
    assert "attention: no-go: no kernel the trainer can select beats cuDNN's by 1.03× (FlexAttention (compiled) " \
           "1.25×, flash (SDPA) 1.00×)" in lines
    assert f"rounds: every switch and + FP8 LM head, 3 each; left for the next job: {ROWWISE_RECIPE}, " \
           "+ coordinate-descent tuning" in lines
    verdict = check.report.data["lever rounds"]["new-card"]["+ FP8 LM head"]
    assert verdict["inside_noise"] is False and verdict["median"] > 1.02
    note = check.report.row("all switches + FP8 LM head (card new-card, round 3 of: FP8 LM head)")["note"]
    assert note.startswith("+2.1% tokens/s vs every switch, median of 3 alternating rounds on one card (+2.0 to ")
    assert note.endswith("outside noise (floor 1.0%)")
    assert check.report.row("all switches (card new-card, round 2 of: FP8 LM head)") is not None
    assert lines[-1] == "left for the next job (too little of --budget-s): nanoGPT best pair 1"  # 150 s; 40 s left
    assert check.report.data["plans"][-1]["decisions"] == lines

    check, events, lines = replay(tmp_path, monkeypatch, levers_table(1.3, 1.0), GAINS, tmp_path, check.report.data)
    assert "judged in rounds by an earlier job: + FP8 LM head" in lines
    assert [kind for kind, _ in events[:3]] == ["probe", "row", "nanogpt"]  # the pair the head earned, first
    assert check.report.row("every switch + FP8 LM head on our code (best pair 1, ours + FP8 LM head)") is not None
    assert not any(r["name"].startswith("nanoGPT's settings on our code") and r.get("machine") == "new-card"
                   for r in check.report.data["rows"])  # the levers leave nanoGPT's settings, and that ratio, alone
    assert [changed for kind, changed in events[3:] if kind == "row"] == [base, recipe, recipe, base, base, recipe]
    assert check.report.data["lever rounds"]["new-card"][ROWWISE_RECIPE]["inside_noise"] is True  # no direction
    assert [kind for kind, _ in events[9:]] == []  # the head's profile and the tests: the first job's

    check, events, lines = replay(tmp_path, monkeypatch, levers_table(1.3, 1.0), GAINS, tmp_path, check.report.data)
    assert [changed for kind, changed in events if kind == "row"] == [base, tuning, tuning, base, base, tuning]
    slower = check.report.data["lever rounds"]["new-card"]["+ coordinate-descent tuning"]
    assert slower["inside_noise"] is False and slower["median"] < 1  # a loss, outside noise
    assert ("nanogpt", None) not in events  # its best is the head's, raced already


def test_without_a_lever_that_wins_outside_noise_nanogpt_is_not_raced_again(tmp_path, monkeypatch):
    check, events, lines = replay(tmp_path, monkeypatch, levers_table(1.05, 1.10),
                                  {"fp8_head": [1.01, 0.995, 1.02]}, nanogpt=tmp_path)
    assert "FP8 rowwise recipe: no-go: rowwise FP8 matmuls 1.05× bf16's on the blocks' shapes (needs 1.15×)" in lines
    assert "attention: go: flash (SDPA) 1.10× cuDNN's forward and backward" in lines
    assert {changed for kind, changed in events if kind == "row"} == {(), ("fp8_head",)}
    assert ("nanogpt", None) not in events and ("profile", ()) in events  # nothing won: every switch profiled
    assert "nanoGPT: not raced again: no lever won outside noise, so its ratio stands" in lines
    assert any(line.startswith("rounds: every switch and + FP8 LM head, 3 each; left for the next job: "
                               "+ SDPA flash backend") for line in lines)


def test_the_go_no_go_names_a_faster_kernel_the_trainer_cannot_select_and_trains_one_it_can():
    chosen, lines = gpu_next.go_no_go(levers_table(1.2, 1.05))
    assert [name for name, _ in chosen] == ["+ FP8 LM head", ROWWISE_RECIPE, "+ SDPA flash backend"]
    assert chosen[-1][1] == {"sdpa_backend": "flash"}
    assert lines[-2].startswith("attention: FlexAttention (compiled) runs 1.25× cuDNN's forward and backward, but "
                                "the trainer cannot select it yet")
    chosen, lines = gpu_next.go_no_go({})  # the probe failed or timed out: only the head, and why
    assert [name for name, _ in chosen] == ["+ FP8 LM head"]
    assert lines[1:] == ["FP8 rowwise recipe: no-go: the rowwise FP8 matmuls did not run here (gpu_levers.py gemms)",
                         "attention: no-go: cuDNN's kernel, which every switch runs, did not run here"]


def test_a_table_is_carried_from_the_last_job_else_continued_from_the_committed_one(tmp_path):
    out = tmp_path / "out/gpu_check.json"
    assert gpu_next.start_table(out, tmp_path / "nothing", "NVIDIA H200").startswith("no table of the NVIDIA H200")
    assert json.loads(out.read_text())["device"] == "NVIDIA H200"
    carried = tmp_path / "carried"
    carried.mkdir()
    (carried / "gpu_check.json").write_text('{"device": "NVIDIA H100 80GB HBM3", "rows": []}')
    again = tmp_path / "again/gpu_check.json"
    assert gpu_next.start_table(again, carried, "NVIDIA H100 80GB HBM3") == f"carried from {carried}: gpu_check.json"
    assert json.loads(again.read_text())["rows"] == []
    other = tmp_path / "other/gpu_check.json"  # an H100's table carried to an H200: the H200's committed one
    assert gpu_next.start_table(other, carried, "NVIDIA H200").startswith("no table of the NVIDIA H200 carried")
    assert json.loads(other.read_text())["device"] == "NVIDIA H200"
    new = tmp_path / "new/gpu_check.json"
    assert gpu_next.start_table(new, carried, "NVIDIA B200") == "no table of the NVIDIA B200 carried or committed: " \
                                                                 "a new table"
    assert not new.exists()


def test_a_lever_cut_short_by_the_budget_stays_unjudged_and_a_failing_one_is_judged_failed(tmp_path, monkeypatch):
    """Rounds a job's budget cut leave the lever for a later job (one pair is no verdict); a lever whose rows fail
    for another reason than time is judged failed, with why, so no later job spends its minutes on it again."""
    clock, calls = Clock(), []
    fake_children(monkeypatch, clock, {"plain": 30.0, "compiled": 100.0, "autotune": 400.0}, calls)
    check = new_check(tmp_path, 350.0, clock)
    base, head = check.all_switches(), [("+ FP8 LM head", {"fp8_head": True})]
    left = []

    def step(what, action, *args):
        try:
            return action(*args)
        except gpu_check.OutOfBudget:
            left.append(what)

    assert check.lever_rounds(base, head, 3, step) == {}  # 350 s: round 1 and half of round 2
    assert "all switches + FP8 LM head, round 2" not in left and "all switches, round 2" in left
    assert "lever rounds" not in check.report.data or not check.report.data["lever rounds"]["card-1"]

    def failing(params, tokens, out, timeout_s):
        clock.now += 10.0
        if params["train"].get("fp8_head"):
            return None, "torch._inductor.exc.InductorError: LoweringException", ""
        return metrics(1000.0), "", ""

    monkeypatch.setattr(gpu_check, "run_child", failing)
    again = new_check(tmp_path / "again", None, clock, machine="card-2")
    verdicts = again.lever_rounds(base, head, 3, step)
    assert verdicts["+ FP8 LM head"] == {"failed": "torch._inductor.exc.InductorError: LoweringException",
                                         "paired": [], "median": None, "inside_noise": True}
    assert gpu_next.judged(again)["+ FP8 LM head"]["failed"].startswith("torch._inductor")
    assert gpu_next.winners(again, base) == base  # a failed lever never joins the best


def test_a_best_pair_whose_nanogpt_half_failed_is_raced_again(tmp_path):
    check = new_check(tmp_path, None, Clock())
    best = {**check.all_switches(), "fp8_head": True}
    train = gpu_check.train_params(check.prof, best, check.prof["steps"])["train"]
    tag = " (best pair 1, ours + FP8 LM head)"
    ours = {"name": "every switch + FP8 LM head on our code" + tag, "train": train, "tokens_per_s": 1.0}
    theirs = {"name": "nanoGPT's own train.py, micro-batch 64" + tag, "failed": "timed out after 60 s"}
    check.report.data["rows"] = [ours, theirs]
    assert not gpu_next.raced(check, best)
    theirs.pop("failed")
    assert gpu_next.raced(check, best) and not gpu_next.raced(check, check.all_switches())


def test_a_folder_that_is_no_nanogpt_checkout_stops_the_plan_before_anything_runs(tmp_path):
    from click.testing import CliRunner

    result = CliRunner().invoke(gpu_next.main, ["--out", str(tmp_path / "out"), "--nanogpt", str(tmp_path)])
    assert result.exit_code == 2 and "no train.py, model.py, configurator.py there" in result.output
    assert not (tmp_path / "out").exists()  # no table started, no probe run
