"""The code holds the style pyproject.toml declares (ruff: pyflakes, pycodestyle's errors, 120 columns)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_code_passes_ruff():
    pytest.importorskip("ruff", reason="ruff comes with the test extra")
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                             "gpt2", "stages", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
