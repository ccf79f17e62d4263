"""Step times that do not stall the GPU.

Reading a clock honestly needs the device's queue drained first; doing that at every step leaves
the GPU idle while the host launches the next step. On CUDA each step's start is instead marked
with an event in the stream, and the events are read only at the loop's sync points (log, eval and
checkpoint steps): the time between two step starts on the GPU's own timeline is that step's time,
host stalls and compilation included, and the GPU never waits for the host to look. Other devices
synchronize at each mark (there the sync costs nothing).
"""

from __future__ import annotations

import time

import torch

from gpt2.run.device import Runtime


class StepTimer:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.cuda = runtime.device.type == "cuda"
        self.marks: list[torch.cuda.Event | float] = []

    def mark(self) -> None:
        """At each step's start, and once more after the last step before ``durations``."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.runtime.synchronize()
            self.marks.append(time.perf_counter())

    def durations(self) -> list[float]:
        """Seconds of each step marked since the last call; waits for the device once."""
        marks, self.marks = self.marks, []
        if len(marks) < 2:
            return []
        if self.cuda:
            marks[-1].synchronize()
            return [start.elapsed_time(end) / 1000 for start, end in zip(marks, marks[1:])]
        return [end - start for start, end in zip(marks, marks[1:])]
