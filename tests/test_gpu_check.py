"""benchmarks/gpu_check.py in smoke mode: the GPU evidence script must not rot between GPU sessions."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks")]
import gpu_check  # noqa: E402
import nanogpt_peer  # noqa: E402

pytestmark = pytest.mark.slow


def check(out: Path, tokens: Path, *args: str):
    """gpu_check in this process (its children, the trainings, are processes of their own): running it as a
    script, copied without an install, is test_gpu_check_plan's."""
    return CliRunner().invoke(gpu_check.main, ["--smoke", "--json", str(out), "--tokens", str(tokens), *args],
                              catch_exceptions=False)


FAKE_NANOGPT = """
import os, sys
settings = dict(arg[2:].split("=", 1) for arg in sys.argv[1:])
assert os.path.isfile("configurator.py"), "runs from its own folder, as nanoGPT reads configurator.py from there"
assert os.path.isfile(os.path.join("data", settings["dataset"], "train.bin")), settings["dataset"]
assert settings["batch_size"] in ("12", "4") and settings["gradient_accumulation_steps"] == "1", settings
for i in range(int(settings["max_iters"]) + 1):
    print(f"iter {i}: loss 5.0000, time {500 if i == 0 else 10 * (i + 1):.2f}ms, mfu -100.00%")
"""


def fake_nanogpt(folder: Path) -> Path:
    """A stand-in for a karpathy/nanoGPT checkout: its three files, a train.py that checks how it is called
    and prints nanoGPT's iteration lines (the real one runs the same way; CI has no network to clone it)."""
    folder.mkdir()
    (folder / "train.py").write_text(FAKE_NANOGPT)
    (folder / "model.py").write_text("")
    (folder / "configurator.py").write_text("")
    return folder


def test_parts_in_separate_jobs_build_one_table_and_every_row_is_saved_as_measured(tmp_path, tokens):
    out = tmp_path / "check.json"
    first = check(out, tokens, "--part", "ladder")  # a job that ends (or is killed) after the ladder
    assert first.exit_code == 0, first.stderr[-3000:]
    ladder = json.loads(out.read_text())["rows"]
    # no TF32 on a CPU, no compile in smoke
    assert [r["name"] for r in ladder] == ["fp32", "+ bf16 autocast", "+ flash attention", "+ padded vocab (50304)",
                                           "+ fused AdamW", "+ largest micro-batch"]
    nanogpt = fake_nanogpt(tmp_path / "nanoGPT")
    second = check(out, tokens, "--part", "ladder", "--part", "nanogpt", "--nanogpt", str(nanogpt),
                   "--nanogpt-repeats", "1", "--part", "long", "--part", "profile")  # peers, fit: test_gpu_check_plan
    assert second.exit_code == 0, second.stderr[-3000:]
    assert "fp32:" not in second.stderr  # the ladder's rows were read back, not measured again
    report = json.loads(out.read_text())
    names = [r["name"] for r in report["rows"]]
    assert names[6:] == ["every switch on our code (best pair 1)",
                         "nanoGPT's own train.py, micro-batch 4 (best pair 1)",
                         "nanoGPT's settings on our code (run 1)", "nanoGPT's own train.py (run 1)",
                         "4 steps, GPT-2 batch, evals and checkpoints every 1"]
    assert not [r for r in report["rows"] if "failed" in r], report["rows"]
    rows = {r["name"]: r for r in report["rows"]}
    assert rows["+ bf16 autocast"]["dtype"] == "bf16" and rows["fp32"]["dtype"] == "fp32"
    assert rows["+ largest micro-batch"]["micro_batch"] == 4 and rows["+ flash attention"]["sdpa"] != "manual (no SDPA)"
    fastest = max(ladder, key=lambda r: r["tokens_per_s"])  # "best" is the fastest ladder row, not the last one
    long = rows["4 steps, GPT-2 batch, evals and checkpoints every 1"]
    assert long["micro_batch"] == fastest["micro_batch"] and long["accum"] == 2
    assert "of the step median" in long["note"]
    theirs = rows["nanoGPT's own train.py (run 1)"]  # iterations of 500 (warm-up, left out) and 20 ms
    assert theirs["step_ms"] == 20.0 and theirs["tokens_per_s"] == 12 * 8 / 0.02 and theirs["dtype"] == "fp32"
    ours = rows["nanoGPT's settings on our code (run 1)"]
    assert ours["micro_batch"] == 12 and ours["dtype"] == "fp32" and ours["graph_breaks"] is None  # smoke: no compile
    for key, at_best in (("nanogpt_ratio", theirs), ("nanogpt_best_ratio", rows[names[7]])):
        ratio = report[key]
        assert ratio > 0 and f"ours ÷ nanoGPT: {ratio:.2f}×" in at_best["note"]
    assert rows[names[7]]["micro_batch"] == 4
    assert all(r["tokens_per_s_steady"] > 0 for r in report["rows"])
    profiled = report["profile"]  # the best row's step under torch.profiler: time by kind, the table beside
    assert profiled["ms_per_step"] > 0 and "matmul" in profiled["by_kind"], profiled
    assert 0.7 < profiled["coverage"] < 1.3, profiled  # the table's total is the measured step, not twice it
    assert "| kind | ms/step | share |" in out.with_suffix(".profile.md").read_text()
    assert "===== 4 steps, GPT-2 batch" in out.with_suffix(".stderr.log").read_text()  # each child's stderr tail
    table = second.stdout
    assert table.count("\n| ") == len(names) + 1 and "| run | micro-batch × accum |" in table


def test_a_child_past_its_time_limit_is_a_timed_out_row_and_peers_need_the_ladder(tmp_path, tokens):
    out = tmp_path / "check.json"
    refused = check(out, tokens, "--part", "fit", "--part", "long")
    assert refused.exit_code != 0 and "long, fit start(s) from the fastest row" in refused.stderr
    assert "run --part ladder or --part best first" in refused.stderr
    not_nanogpt = check(out, tokens, "--part", "nanogpt", "--nanogpt", str(tmp_path))
    assert not_nanogpt.exit_code != 0 and "no train.py, model.py, configurator.py there" in not_nanogpt.stderr
    fp32 = {"name": "fp32", "step_ms": 9.0, "tokens_per_s": 1.0, "tokens_per_s_wall": None, "mfu": None, "peak_gb": 0.1,
            "estimate_gb": None, "warmup_s": 0.0, "sdpa": "manual (no SDPA)", "dtype": "fp32", "micro_batch": 1,
            "accum": 1, "note": "", "train": {}}
    carried = tmp_path / "carried"  # what the last job returned, read-only, carried into this one
    carried.mkdir()
    (carried / "check.json").write_text(json.dumps({"device": platform.machine(), "smoke": True, "rows": [fp32]}))
    (carried / "check.stderr.log").write_text("===== fp32\n")
    for path in carried.iterdir():
        path.chmod(0o444)
    out = tmp_path / "out/check.json"  # an empty output folder, as every job on the lent box starts with
    out_of_budget = check(out, tokens, "--part", "long", "--carried", str(carried), "--budget-s", "1")
    assert out_of_budget.exit_code == 0 and "--budget-s 1 left long to the next job" in out_of_budget.stderr
    assert [r["name"] for r in json.loads(out.read_text())["rows"]] == ["fp32"]  # carried; nothing started
    # forked from a server that imported torch, the smoke row takes 0.4 s on a fast CPU: 0.05 s stops it anywhere
    result = check(out, tokens, "--part", "long", "--timeout-s", "0.05")
    assert result.exit_code == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["name"] == "fp32" and rows[-1]["failed"] == "timed out after 0.05 s"
    assert out.with_suffix(".stderr.log").read_text().startswith("===== fp32")  # the carried log, appended to
    assert "timed out" in result.stdout


def test_nanogpt_side_by_side_on_a_cpu_reports_each_pair_and_the_ratio(tmp_path, tokens):
    nanogpt = fake_nanogpt(tmp_path / "nanoGPT")
    (nanogpt / "train.py").write_text(FAKE_NANOGPT.replace('"12"', '"8"'))  # the tiny config's micro-batch
    result = CliRunner().invoke(nanogpt_peer.main, ["--nanogpt", str(nanogpt), "--pairs", "1", "--steps", "3",
                                                    "--warmup", "1", "--tokens", str(tokens), "--set", "loss_chunk=64"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.stderr[-3000:]
    assert result.stderr.count("nanoGPT 25.0 ms") == 1  # the median of its timed iterations (20, 30 ms)
    assert "ours: loss_chunk=64" in result.stdout and "nanoGPT train.py: 40,960 tok/s" in result.stdout
    assert "ours ÷ nanoGPT:" in result.stdout
