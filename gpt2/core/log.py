"""Messages to the user: one ``logging`` tree under ``gpt2``, written to stderr, rank 0 only.

Stages print what they do as plain lines (``train: resuming …``, ``step 10/320 | loss …``);
warnings and errors get a ``warning:`` or ``error:`` prefix, so a log reads the same
whether it came from a terminal, DVC or a CI job. Under torchrun every rank runs the same
code: only rank 0 speaks, unless a record asks for every rank (``extra=EVERY_RANK``).
"""

from __future__ import annotations

import logging
import sys

ROOT = "gpt2"
EVERY_RANK = {"every_rank": True}
_PREFIX = {logging.WARNING: "warning: ", logging.ERROR: "error: ", logging.CRITICAL: "error: "}


class _Stderr(logging.Handler):
    """Writes to whatever ``sys.stderr`` is at the time (pytest and click swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # a closed stream must not break training
            self.handleError(record)


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return _PREFIX.get(record.levelno, "") + record.getMessage()


class _RankFilter(logging.Filter):
    """Lets rank 0's records through, and any record marked for every rank."""

    rank = 0

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or getattr(record, "every_rank", False)


_filter = _RankFilter()


def _configure() -> logging.Logger:
    root = logging.getLogger(ROOT)
    if not root.handlers:
        handler = _Stderr()
        handler.setFormatter(_Format())
        handler.addFilter(_filter)
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False  # the application owns its console; no duplicate lines through the root logger
    return root


def get(name: str) -> logging.Logger:
    """The logger of one part of the flow (``train``, ``download``, ...)."""
    _configure()
    return logging.getLogger(f"{ROOT}.{name}")


def set_rank(rank: int) -> None:
    """This process's rank in a distributed job: only rank 0 speaks."""
    _filter.rank = rank
