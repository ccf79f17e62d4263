"""Where the test suite's time goes, test by test: a pytest plugin.

    PYTHONPATH=benchmarks python -m pytest -p suite_cpu

Each test's wall time, its own CPU time (the xdist worker's) and the CPU time of the processes it
started and waited for (stages, DVC, torchrun ranks, compilers), appended to the file
``SUITE_CPU_OUT`` names (default: suite_cpu.tsv in the folder pytest runs in); at the end the
totals and the tests that cost the most CPU. The suite is CPU-bound on a 2-core machine, so its
CPU time, not its wall time, says what a slower CPU will take: compare the totals on two machines.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import pytest

OUT = Path(os.environ.get("SUITE_CPU_OUT", "suite_cpu.tsv")).resolve()


def cpu_seconds() -> tuple[float, float]:
    """This process's CPU seconds, and those of its children it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller, before its workers start
        OUT.write_text("test\twall_s\tcpu_s\tchildren_cpu_s\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    own, children = cpu_seconds()
    start = time.perf_counter()
    yield
    own_after, children_after = cpu_seconds()
    with OUT.open("a") as sink:  # one short line per test: the workers' appends do not interleave
        sink.write(f"{item.nodeid}\t{time.perf_counter() - start:.2f}\t{own_after - own:.2f}\t"
                   f"{children_after - children:.2f}\n")


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not OUT.is_file():
        return
    rows = [line.split("\t") for line in OUT.read_text().splitlines()[1:]]
    rows = [(name, float(wall), float(own), float(kids)) for name, wall, own, kids in rows]
    write = terminalreporter.write_line
    write(f"suite_cpu: {len(rows)} tests, {sum(r[1] for r in rows):.0f} s of test wall time, "
          f"{sum(r[2] for r in rows):.0f} s of CPU in the test processes, {sum(r[3] for r in rows):.0f} s in the "
          f"processes they started ({OUT})")
    for name, wall, own, kids in sorted(rows, key=lambda r: -(r[2] + r[3]))[:15]:
        write(f"  {own + kids:6.1f} s CPU ({own:5.1f} own, {kids:5.1f} children), {wall:6.1f} s wall  {name}")
