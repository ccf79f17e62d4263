"""benchmarks/gpu_check.py in smoke mode: the GPU evidence script must not rot between GPU sessions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_mode_prints_one_table_and_writes_every_row(tmp_path, tokens):
    out = tmp_path / "check.json"
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--smoke", "--json", str(out),
                             "--tokens", str(tokens)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    names = [r["name"] for r in report["rows"]]
    assert names[:8] == ["fp32", "+ tf32", "+ bf16 autocast", "+ torch.compile", "+ flash attention",
                         "+ padded vocab (50304)", "+ fused AdamW", "+ largest micro-batch"]
    assert names[8:] == ["nanoGPT train.py defaults", "best, plain (for DDP)", "best, DDP in 1 process",
                         "best, Muon optimizer", "4 steps, GPT-2 batch, evals and checkpoints"]
    assert not [r for r in report["rows"] if "failed" in r], report["rows"]
    rows = {r["name"]: r for r in report["rows"]}
    assert rows["+ bf16 autocast"]["dtype"] == "bf16" and rows["fp32"]["dtype"] == "fp32"
    assert rows["+ largest micro-batch"]["micro_batch"] == 4 and rows["+ flash attention"]["sdpa"] != "manual (no SDPA)"
    assert "DDP overhead" in rows["best, DDP in 1 process"]["note"]
    assert "step time vs AdamW" in rows["best, Muon optimizer"]["note"]
    assert "of the step median" in rows["4 steps, GPT-2 batch, evals and checkpoints"]["note"]
    table = result.stdout
    assert table.count("\n| ") == len(names) + 1 and "| run | micro-batch × accum |" in table
