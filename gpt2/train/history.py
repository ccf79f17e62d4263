"""The run so far, kept in every checkpoint: what a resumed run reports from as if it had never stopped."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from gpt2.run import machine_load


@dataclass
class History:
    """The run so far: log records (for the plots), every step time (for the summaries), and a few tallies.

    Checkpointed whole, so a resumed run reports as if it had never stopped."""

    train: list[dict[str, float]] = field(default_factory=list)  # one record per log step (``train/loss`` …)
    val: list[dict[str, float]] = field(default_factory=list)  # one record per eval (``val/loss``)
    step_s: list[float] = field(default_factory=list)
    fp16_skipped: int = 0
    elapsed_s: float = 0.0  # wall time of the run up to its last checkpoint (earlier sessions of a resumed run)
    steady_steps: int = 0  # steps after each session's warm-up, and their wall time (evals, checkpoints included)
    steady_s: float = 0.0
    target: dict[str, float] | None = None  # when val loss first reached train.target_val_loss
    sessions: list[int] = field(default_factory=list)  # where each session's steps begin in step_s
    eval_warmup_s: float = 0.0  # the first eval of each compiled session (it compiles), left out of steady_s
    run_uid: str = field(default_factory=lambda: uuid.uuid4().hex)  # this run, over all its sessions: an
    # evaluation records the run it scored, so a report never passes another run's figures for its own
    budget_warm_s: float | None = None  # under train.time_budget_s: the time spent when the lr's decay began
    lengthened_at: list[int] = field(default_factory=list)  # where a finished run went on to a longer length
    load: dict[str, float] = field(default_factory=machine_load.tally)  # other work's core-seconds beside the
    # steady state's (gpt2/run/machine_load.py)

    @property
    def train_s(self) -> float:
        """The training time so far: every step's time, compilation included, evals and checkpoints not."""
        return sum(self.step_s)

    def warm(self, warmup_steps: int) -> list[bool]:
        """Which of ``step_s`` are warm-up steps: the first ``warmup_steps`` of every session (a resumed
        session compiles and autotunes again)."""
        flags = [False] * len(self.step_s)
        for start in {0, *self.sessions}:  # a checkpoint older than ``sessions`` names none
            flags[start:start + warmup_steps] = [True] * len(flags[start:start + warmup_steps])
        return flags

    def timed_s(self, warmup_steps: int) -> list[float]:
        """The step times the medians read: every step but the warm-up steps (all of them if none is left)."""
        timed = [t for t, warm in zip(self.step_s, self.warm(warmup_steps)) if not warm]
        return timed or self.step_s
