"""benchmarks/gpu_check.py in smoke mode: the GPU evidence script must not rot between GPU sessions."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def check(out: Path, tokens: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--smoke", "--json", str(out), "--tokens",
                           str(tokens), *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_parts_in_separate_jobs_build_one_table_and_every_row_is_saved_as_measured(tmp_path, tokens):
    out = tmp_path / "check.json"
    first = check(out, tokens, "--part", "ladder")  # a job that ends (or is killed) after the ladder
    assert first.returncode == 0, first.stderr[-3000:]
    ladder = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in ladder] == ["fp32", "+ tf32", "+ bf16 autocast", "+ torch.compile",
                                           "+ flash attention", "+ padded vocab (50304)", "+ fused AdamW",
                                           "+ largest micro-batch"]
    second = check(out, tokens, "--part", "ladder", "--part", "peers", "--part", "long")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "fp32:" not in second.stderr  # the ladder's rows were read back, not measured again
    report = json.loads(out.read_text())
    names = [r["name"] for r in report["rows"]]
    assert names[8:] == ["nanoGPT's settings on our code", "best, plain (for DDP)", "best, DDP in 1 process",
                         "best, Muon optimizer", "4 steps, GPT-2 batch, evals and checkpoints"]
    assert not [r for r in report["rows"] if "failed" in r], report["rows"]
    rows = {r["name"]: r for r in report["rows"]}
    assert rows["+ bf16 autocast"]["dtype"] == "bf16" and rows["fp32"]["dtype"] == "fp32"
    assert rows["+ largest micro-batch"]["micro_batch"] == 4 and rows["+ flash attention"]["sdpa"] != "manual (no SDPA)"
    fastest = max(ladder, key=lambda r: r["tokens_per_s"])  # "best" is the fastest ladder row, not the last one
    assert rows["best, plain (for DDP)"]["micro_batch"] == fastest["micro_batch"]
    assert "DDP overhead" in rows["best, DDP in 1 process"]["note"]
    assert "step time vs AdamW" in rows["best, Muon optimizer"]["note"]
    assert "of the step median" in rows["4 steps, GPT-2 batch, evals and checkpoints"]["note"]
    assert "===== best, Muon optimizer" in out.with_suffix(".stderr.log").read_text()  # each child's stderr tail
    table = second.stdout
    assert table.count("\n| ") == len(names) + 1 and "| run | micro-batch × accum |" in table


def test_a_child_past_its_time_limit_is_a_timed_out_row_and_peers_need_the_ladder(tmp_path, tokens):
    out = tmp_path / "check.json"
    refused = check(out, tokens, "--part", "long")
    assert refused.returncode != 0 and "run --part ladder first" in refused.stderr
    fp32 = {"name": "fp32", "step_ms": 9.0, "tokens_per_s": 1.0, "tokens_per_s_wall": None, "mfu": None, "peak_gb": 0.1,
            "estimate_gb": None, "warmup_s": 0.0, "sdpa": "manual (no SDPA)", "dtype": "fp32", "micro_batch": 1,
            "accum": 1, "note": "", "train": {}}
    out.write_text(json.dumps({"device": platform.machine(), "smoke": True, "rows": [fp32]}))  # a job cut after one row
    result = check(out, tokens, "--part", "long", "--timeout-s", "0.5")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["name"] == "fp32" and rows[-1]["failed"] == "timed out after 0.5 s"
    assert "timed out" in result.stdout
