"""Ctrl-C and a scheduler's SIGTERM: finish the step, save a checkpoint, exit with 128 + the signal.

The handler only raises a flag; the loop reads it at its next sync point, where every rank agrees
to stop after the same step. A second Ctrl-C aborts at once, without saving.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gpt2.core import log
from gpt2.core.errors import UserError

logger = log.get("train")


class TrainingInterrupted(UserError):
    """SIGINT/SIGTERM: the step finished, a checkpoint was saved, the run can be resumed."""


class StopRequest:
    signum: int | None = None

    @property
    def asked(self) -> bool:
        return self.signum is not None

    def interrupted(self, step: int, total: int, saved: str) -> TrainingInterrupted:
        """The error that ends the run; a peer's signal (this rank got none) counts as SIGTERM."""
        signum = self.signum or signal.SIGTERM
        error = TrainingInterrupted(f"interrupted by {signal.Signals(signum).name} at step {step}/{total}; {saved}")
        error.exit_code = 128 + signum
        return error


@contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """The first SIGINT/SIGTERM asks the loop to stop after the current step; a second SIGINT aborts."""
    request = StopRequest()

    def handler(signum: int, frame: Any) -> None:
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
