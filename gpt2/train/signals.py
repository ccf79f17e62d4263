"""Ctrl-C and a scheduler's SIGTERM: finish the step, save a checkpoint, exit with 128 + the signal.

The handler only raises a flag. The loop looks at it after every step (``StopVote``) and, once it is
up, syncs there, where every rank agrees to stop after the same step. A second Ctrl-C aborts at
once, without saving.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from gpt2.core import log
from gpt2.core.cli import interrupt_pending
from gpt2.core.errors import Stopped

logger = log.get("train")


class TrainingInterrupted(Stopped):
    """SIGINT/SIGTERM: the step finished, a checkpoint was saved, the run can be resumed."""

    every_rank = False  # all ranks stopped at the same step: one line says it


class StopRequest:
    signum: int | None = None
    saving = False  # the stop's checkpoint is being written: a second signal waits for it, not abort it

    @property
    def asked(self) -> bool:
        return self.signum is not None

    def interrupted(self, step: str, saved: str) -> TrainingInterrupted:
        """The error that ends the run; a peer's signal (this rank got none) counts as SIGTERM. ``step``: where
        it stopped, as the log shows it (``12/320``)."""
        signum = self.signum or signal.SIGTERM
        error = TrainingInterrupted(f"interrupted by {signal.Signals(signum).name} at step {step}; {saved}")
        error.exit_code = 128 + signum
        return error


@contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """The first SIGINT/SIGTERM asks the loop to stop after the current step; a second SIGINT aborts."""
    request = StopRequest()

    def handler(signum: int, frame: Any) -> None:
        if request.saving:  # aborting now would leave half a file and kill the writer mid-write
            logger.info(f"\n{signal.Signals(signum).name}: the checkpoint is being written; the run stops as soon "
                        "as it is", extra=log.EVERY_RANK)
            return
        if request.asked:
            if signum == signal.SIGINT:  # Ctrl-C again: abort
                raise KeyboardInterrupt(aborted_without_saving())
            return  # SIGTERM again (a killed DVC's shell and the kernel may both send one): asked and said already
        request.signum = signum
        logger.info(f"\n{signal.Signals(signum).name}: finishing the current step, then saving a checkpoint "
                    "(Ctrl-C again to abort without saving)", extra=log.EVERY_RANK)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    if interrupt_pending():  # a Ctrl-C while the run started, whose KeyboardInterrupt Python lost: a first Ctrl-C
        handler(signal.SIGINT, None)
    try:
        yield request
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def aborted_without_saving() -> str:
    """What a second Ctrl-C cost. Under ``dvc exp run`` the whole run: only a stop that saves keeps it
    (train/interrupted.py), and DVC puts its baseline's checkpoint back before the same command runs again."""
    if os.environ.get("DVC_EXP_NAME"):
        return ("aborted by a second Ctrl-C, without saving: this run is lost (`dvc exp run` puts its baseline's "
                "checkpoint back before it runs again; one Ctrl-C saves the run and keeps it to resume)")
    return ("aborted by a second Ctrl-C, without saving: the steps since the last checkpoint "
            "(train.checkpoint_interval) are lost; the same command resumes from that checkpoint, if one was saved")


class StopVote:
    """Whether the run must stop after this step, known to every rank at the same step, without a host sync.

    One process reads its own flag. Ranks that sync only at log, eval and checkpoint steps (CUDA) would
    otherwise learn of a signal up to ``log_interval`` steps late, and a scheduler's grace period can
    run out in that time: so after each step every rank adds its flag to an all-reduce on the CPU (a
    gloo group, apart from the GPU's stream) and reads the previous step's sum, long done. A signal is
    then acted on one step later on every rank alike. Ranks that sync every step (CPU) need no vote."""

    def __init__(self, request: StopRequest, world: int, every_step: bool, timeout_s: float) -> None:
        self.request = request
        self.group = None
        if world > 1 and not every_step:
            import datetime

            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.flag = torch.zeros(1)
        self.pending: Any = None

    def after_step(self) -> bool:
        """Whether a rank was asked to stop: this process's flag, or the ranks' vote of the step before."""
        if self.group is None:
            return self.request.asked
        voted = False
        if self.pending is not None:
            self.pending.wait()
            voted = bool(self.flag.item())
        self.flag = torch.tensor([float(self.request.asked)])
        self.pending = dist.all_reduce(self.flag, group=self.group, async_op=True)
        return voted
