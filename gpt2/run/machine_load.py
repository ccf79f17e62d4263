"""How busy the machine's cores were with other work while a run was timed.

A run beside other work reads slow, and nothing in its own figures says why: on a 2-core box shared with
a build, the default run took ten times its usual time. So every timed stretch of a run also reads the
machine's CPU clock: the core-seconds every process spent busy (``/proc/stat``), the core-seconds a
hypervisor gave to other guests (steal, where the OS reports it), and this process's own CPU time. What
is busy and not this run is other work. Only the cores this process may run on count (its CPU affinity:
``taskset``, a Slurm or container cpuset): work on the others does not slow it. Ranks of one job on one
machine count as the run: each is taken to use what this one does (``LOCAL_WORLD_SIZE`` times its time).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NOT_REPRESENTATIVE = 0.25  # other work on more than this share of the cores: timing reads low
STEAL_NOT_REPRESENTATIVE = 0.10  # a shared VM loses a few percent to steal at all times: past this, a run reads slow


@dataclass(frozen=True)
class CpuClock:
    """One reading of the machine's and this process's CPU time, in core-seconds."""

    wall_s: float
    busy_s: float  # every usable core, every process: user, nice, system, interrupts (idle, iowait, steal not)
    steal_s: float
    own_s: float  # this process's threads, and the children it reaped (compile workers)
    cores: int = 0  # the cores read: those this process may run on (0: unknown, the machine's)


BUSY = ("user", "nice", "system", "irq", "softirq")


def usable_cores() -> list[int] | None:
    """The CPUs this process may run on; None where the OS does not say (macOS)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def read() -> CpuClock | None:
    """Now's reading; None where psutil cannot read the machine's CPU times."""
    try:
        import psutil
    except ImportError:  # psutil is a dependency, but the library runs without an install on a GPU box
        return None
    try:
        per_core, own = cpu_times(psutil), psutil.Process().cpu_times()
    except (OSError, ValueError, psutil.Error):
        return None
    usable = [i for i in usable_cores() or [] if i in per_core] or list(per_core)  # unknown: the whole machine
    return CpuClock(time.perf_counter(), sum(per_core[i][0] for i in usable), sum(per_core[i][1] for i in usable),
                    own.user + own.system + own.children_user + own.children_system, len(usable))


def cpu_times(psutil: Any) -> dict[int, tuple[float, float]]:
    """Each CPU's busy and steal seconds since boot, by its number: Linux's /proc/stat names each line's CPU (an
    offline one has none, so a list's position is not its number); elsewhere psutil's list, in its order."""
    stat = Path("/proc/stat")
    if not stat.is_file():
        return {i: (sum(getattr(t, name, 0.0) for name in BUSY), getattr(t, "steal", 0.0))
                for i, t in enumerate(psutil.cpu_times(percpu=True))}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for line in stat.read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            ticks = [int(f) for f in fields] + [0] * 8  # user nice system idle iowait irq softirq steal
            out[int(name[3:])] = (sum(ticks[i] for i in (0, 1, 2, 5, 6)) / tick, ticks[7] / tick)
    return out


def tally() -> dict[str, float]:
    """Core-seconds over a run's timed stretches, summed over its sessions (the history keeps it, checkpointed):
    ``window_s`` (wall seconds times the cores read), ``others_s`` and ``steal_s``."""
    return {"window_s": 0.0, "others_s": 0.0, "steal_s": 0.0}


def add(counts: dict[str, float], start: CpuClock | None, end: CpuClock | None, cores: int | None = None,
        ranks_here: int | None = None) -> None:
    """Add the stretch from ``start`` to ``end`` to ``counts``."""
    if start is None or end is None:
        return
    cores = cores or end.cores or os.cpu_count() or 1
    ranks_here = ranks_here or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    counts["window_s"] += (end.wall_s - start.wall_s) * cores
    counts["others_s"] += max(0.0, (end.busy_s - start.busy_s) - ranks_here * (end.own_s - start.own_s))
    counts["steal_s"] += max(0.0, end.steal_s - start.steal_s)


def figures(counts: dict[str, float]) -> dict[str, float] | None:
    """``others_busy``: the share of the cores other work kept busy; ``steal``: the share a hypervisor gave to
    other guests. None before a timed stretch was read."""
    if counts["window_s"] <= 0:
        return None
    return {"others_busy": round(min(1.0, counts["others_s"] / counts["window_s"]), 3),
            "steal": round(min(1.0, counts["steal_s"] / counts["window_s"]), 3)}


def warning(figures: dict[str, float] | None, cores: int | None = None) -> str | None:
    """A line for a run whose timing other work spoiled, else None."""
    if not figures or (figures["others_busy"] <= NOT_REPRESENTATIVE and figures["steal"] <= STEAL_NOT_REPRESENTATIVE):
        return None
    steal = (f" and the hypervisor gave {100 * figures['steal']:.0f}% to other guests"
             if figures["steal"] >= 0.005 else "")
    return (f"other work kept {100 * figures['others_busy']:.0f}% of the {cores or cores_here()} cores this run may "
            f"use busy while it was timed{steal}: its speed is not representative; measure again on a quiet "
            f"machine before comparing it")


def cores_here() -> int:
    """How many cores this process may run on."""
    return len(usable_cores() or []) or os.cpu_count() or 1
