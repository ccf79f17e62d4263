"""Ctrl-C and a scheduler's SIGTERM: finish the step, save a checkpoint, exit with 128 + the signal.

The handler only raises a flag. The loop looks at it after every step (``StopVote``) and, once it is
up, syncs there, where every rank agrees to stop after the same step. A second Ctrl-C aborts at
once, without saving.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from gpt2.core import log
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
        if request.asked and signum == signal.SIGINT:
            raise KeyboardInterrupt
        request.signum = signum
        logger.info(f"\n{signal.Signals(signum).name}: finishing the current step, then saving a checkpoint "
                    "(Ctrl-C again to abort without saving)", extra=log.EVERY_RANK)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield request
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def stop_with_parent() -> None:
    """Have the kernel send this process SIGTERM when its parent dies (Linux; elsewhere nothing).

    DVC, ``timeout`` or a job scheduler that is killed would otherwise leave the trainer orphaned: it would
    train on to the end and write a checkpoint no one records. With this it stops as on SIGTERM: it
    finishes the step, saves, and exits. Also used as the ``preexec_fn`` of a process this one starts."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        parent = os.getppid()
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):  # not Linux, or no prctl
        return
    if os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if _name(parent) in SHELLS:  # `sh -c CMD` (DVC's shell) outlives the one who started it: watch that one
        grandparent = _parent_of(parent)
        started = _started(grandparent) if grandparent > 1 else None
        if started is not None:
            threading.Thread(target=_term_when_gone, args=(grandparent, started), daemon=True,
                             name="parent-watch").start()


PR_SET_PDEATHSIG = 1  # linux/prctl.h
SHELLS = {"sh", "dash", "bash", "zsh", "fish", "ksh"}


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (which may hold spaces)."""
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def _parent_of(pid: int) -> int:
    try:
        return int(_stat(pid)[1])
    except (OSError, IndexError, ValueError):
        return 0


def _started(pid: int) -> str | None:
    try:
        return _stat(pid)[19]  # start time: a reused PID is another process
    except (OSError, IndexError):
        return None


def _term_when_gone(pid: int, started: str, every_s: float = 1.0) -> None:
    while _started(pid) == started:
        time.sleep(every_s)
    os.kill(os.getpid(), signal.SIGTERM)


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
