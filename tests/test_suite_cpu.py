"""benchmarks/suite_cpu.py, the plugin that says where the suite's time goes: a test's own CPU and its children's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TESTS = '''
import subprocess, sys

def test_in_a_child():
    subprocess.run([sys.executable, "-c", "sum(range(3 * 10**7))"], check=True)

def test_in_itself():
    sum(range(3 * 10**7))
'''


def test_each_test_s_own_cpu_and_its_children_s_are_counted_apart(tmp_path):
    (tmp_path / "test_work.py").write_text(TESTS)
    out = tmp_path / "cpu.tsv"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_cpu", "-p", "no:cacheprovider",
                           "-n", "0", "test_work.py"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "benchmarks"), "SUITE_CPU_OUT": str(out)})
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split("\t")[0]: [float(v) for v in line.split("\t")[1:]] for line in out.read_text().splitlines()[1:]}
    child, itself = rows["test_work.py::test_in_a_child"], rows["test_work.py::test_in_itself"]
    assert child[2] > 0.1 and child[1] < child[2]  # wall, own, children: the work was the child's
    assert itself[1] > 0.1 and itself[2] == 0.0
    assert "suite_cpu: 2 tests, " in done.stdout and "children), " in done.stdout
