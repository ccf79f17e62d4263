"""How busy other work kept the machine while a run was timed (gpt2/run/machine_load.py), and where it is said."""

from __future__ import annotations

import json
import os
import time

import pytest

from conftest import micro_params
from test_grid import fake_grid, run

from gpt2.core import paths
from gpt2.measure import grid
from gpt2.run import checkpoint, machine_load
from gpt2.run.machine_load import CpuClock
from gpt2.train.trainer import train


def test_other_work_is_what_was_busy_and_not_this_run_nor_its_sibling_ranks():
    counts = machine_load.tally()
    start = CpuClock(wall_s=100.0, busy_s=1000.0, steal_s=10.0, own_s=50.0)
    # 10 s on 4 cores: 40 core-seconds; 30 of them busy, 12 of those this process's
    machine_load.add(counts, start, CpuClock(110.0, 1030.0, 10.0, 62.0), cores=4, ranks_here=1)
    assert counts == {"window_s": 40.0, "others_s": 18.0, "steal_s": 0.0}
    assert machine_load.figures(counts) == {"others_busy": 0.45, "steal": 0.0}
    # a second stretch (a resumed session), where a sibling rank did what this one did and a hypervisor stole 2
    machine_load.add(counts, start, CpuClock(110.0, 1024.0, 12.0, 62.0), cores=4, ranks_here=2)
    assert counts == {"window_s": 80.0, "others_s": 18.0, "steal_s": 2.0}
    assert machine_load.figures(counts) == {"others_busy": 0.225, "steal": 0.025}
    machine_load.add(counts, None, start)  # psutil could not read the machine: nothing is counted
    assert counts["window_s"] == 80.0 and machine_load.figures(machine_load.tally()) is None


def test_a_warning_names_the_share_and_the_cores_only_past_the_line():
    assert machine_load.warning(None) is None
    assert machine_load.warning({"others_busy": 0.25, "steal": 0.10}) is None  # a shared VM steals a few percent
    said = machine_load.warning({"others_busy": 0.62, "steal": 0.0}, cores=2)
    assert said.startswith("other work kept 62% of the 2 cores this run may use busy while it was timed: its speed "
                           "is not representative")
    assert "hypervisor gave 12% to other guests" in machine_load.warning({"others_busy": 0.1, "steal": 0.12}, cores=2)


def test_this_machine_reads_and_a_busy_loop_is_this_process_s_own_time():
    before = machine_load.read()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    after = machine_load.read()
    assert after.own_s - before.own_s >= 0.25 and after.busy_s - before.busy_s >= 0.2
    assert after.wall_s > before.wall_s and after.steal_s >= before.steal_s


def test_only_the_cores_this_process_may_run_on_are_read(monkeypatch):
    """Pinned to CPU 2 (taskset, a Slurm cpuset) of a machine whose CPU 1 is offline: a build on CPU 0 does not
    slow it, and is not counted; CPUs are matched by number, not by place in a list."""
    monkeypatch.setattr(machine_load, "cpu_times", lambda psutil: {0: (500.0, 1.0), 2: (70.0, 2.0)})
    monkeypatch.setattr(machine_load, "usable_cores", lambda: [2])
    clock = machine_load.read()
    assert (clock.busy_s, clock.steal_s, clock.cores) == (70.0, 2.0, 1) and machine_load.cores_here() >= 1
    monkeypatch.setattr(machine_load, "usable_cores", lambda: [7])  # none the machine lists: the whole machine
    assert machine_load.read().cores == 2


def test_each_cpu_s_times_are_the_ones_psutil_reads():
    import psutil

    mine, theirs = machine_load.cpu_times(psutil), psutil.cpu_times(percpu=True)
    assert len(mine) == len(theirs)
    busy = sum(sum(getattr(t, n, 0.0) for n in machine_load.BUSY) for t in theirs)
    assert sum(b for b, _ in mine.values()) == pytest.approx(busy, abs=0.05 * len(theirs) + 1)


def test_a_machine_psutil_cannot_read_is_no_reading(monkeypatch):
    import psutil

    def denied(*args, **kwargs):
        raise psutil.AccessDenied(1)

    monkeypatch.setattr(psutil, "Process", denied)
    assert machine_load.read() is None


def test_a_stretch_set_aside_for_a_compilation_is_not_counted_as_other_work(monkeypatch):
    """The first eval compiles with worker processes, which read as other work: the load restarts after it."""
    from types import SimpleNamespace

    from gpt2.train.history import History
    from gpt2.train.step_log import StepLog

    readings = iter([CpuClock(20.0, 12.0, 0.0, 2.0, 1),  # after the eval: its workers kept the core busy 10 s
                     CpuClock(22.0, 14.0, 0.0, 4.0, 1)])  # two steps later: all of it this run's
    monkeypatch.setattr(machine_load, "read", lambda: next(readings))
    log = SimpleNamespace(steady_from=(3, 10.0), warm_until=2, history=History(), recent_load=machine_load.tally(),
                          cpu_from=CpuClock(10.0, 0.0, 0.0, 0.0, 1))
    StepLog.set_aside(log, 8.0)
    StepLog.count_steady(log, 5, 22.0)
    assert log.history.steady_s == 4.0 and log.history.steady_steps == 2
    assert log.history.load == {"window_s": 2.0, "others_s": 0.0, "steal_s": 0.0}


def test_a_grid_names_the_runs_other_work_slowed(tmp_path, monkeypatch):
    def results(name, sets):
        exp = run(name, 100.0 if sets.get("train.lr") == 0.001 else 80.0)
        if name == "lr-2-1":
            exp.metrics[paths.TRAIN_METRICS]["machine"] = {"others_busy": 0.62, "steal": 0.04}
        return exp

    fake_grid(monkeypatch, tmp_path, results)
    data = grid.run_grid(("train.lr=1.0e-3,3.0e-3",), name="lr", target="train", repeats=1)
    assert ("**Measured beside other work:** lr-2-1 (other work kept 62% of the cores busy, steal 4%). Their speed "
            "reads low") in data["verdict"]
    assert data["rows"][1]["runs"][0]["machine"] == {"others_busy": 0.62, "steal": 0.04}
    assert "Measured beside other work" in (tmp_path / "reports/grid/lr.md").read_text()
    assert json.loads((tmp_path / "reports/grid/lr.json").read_text())["rows"][0]["runs"][0]["machine"] is None


def test_a_run_beside_other_work_says_so_as_it_trains_and_in_its_summary(tmp_path, tokens, monkeypatch, capfd):
    """Other work takes three quarters of every core while this run is timed (a fake clock): the log says so at
    the first log step past the warm-up and at the end, and the summary and each log step's record keep it."""
    clock = iter(range(1000))

    def busy_machine():
        t = next(clock)
        return CpuClock(wall_s=float(t), busy_s=t * 0.75 * os.cpu_count() + 0.1 * t, steal_s=0.0, own_s=0.1 * t)

    monkeypatch.setattr(machine_load, "read", busy_machine)
    summary = train(micro_params(max_steps=6), tokens, tmp_path / "ckpt.pt", tmp_path / "reports")
    said = capfd.readouterr().err
    cores = machine_load.cores_here()
    assert f"other work kept 75% of the {cores} cores this run may use busy since the last log step" in said
    assert f"other work kept 75% of the {cores} cores this run may use busy while it was timed: its speed" in said
    assert summary["machine"] == {"others_busy": 0.75, "steal": 0.0, "cores": cores}
    assert json.loads((tmp_path / "reports/summary.json").read_text())["machine"]["others_busy"] == 0.75
    logged = checkpoint.load(tmp_path / "ckpt.pt")["history"]["train"]  # each log step's record: MLflow's too
    assert logged[-1]["machine/others_busy"] == 0.75 and "machine/others_busy" not in logged[0]  # step 1: warm-up
