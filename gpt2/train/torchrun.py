"""torchrun for the train stage: PyTorch's launcher, quiet when the run was stopped on purpose.

Ctrl-C or SIGTERM reaches the ranks through torchrun; they save and exit with 130 or 143. torchrun then
raises its ``SignalException``, printed as a traceback, or reports a ``ChildFailedError`` that blames a
"failed" rank: both misread a run that did what it was asked. This runs torchrun and exits 128 + the
signal instead, leaving the ranks' own line as the only word. A rank killed by another signal (out
of memory, ``kill -9``) printed nothing: one line names it and its signal. Every other failure is
reported as torchrun reports it.

    python -m gpt2.train.torchrun [torchrun's arguments]
"""

from __future__ import annotations

import signal
import sys
from typing import Any

INTERRUPTED = {130, 143}  # 128 + SIGINT, 128 + SIGTERM: a rank that saved and stopped


def main(argv: list[str]) -> int:
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.run(torchrun.parse_args(argv))  # not torchrun.main, whose error handler prints the summary
    except SignalException as exc:
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        codes = {failure.exitcode for failure in exc.failures.values()}
        if codes <= INTERRUPTED:
            return max(codes)
        killed = killed_ranks(exc.failures)
        for rank, pid, signum in killed:  # it printed nothing: its peers' errors are the consequence
            print(f"error: rank {rank} (pid {pid}) was killed by {signal.Signals(signum).name}: it could print no "
                  "error "
                  "of its own (out of memory, a scheduler, a `kill -9`?); the other ranks stopped because it vanished",
                  file=sys.stderr)
        if killed:
            return 128 + killed[0][2]
        print(exc.format_msg(), file=sys.stderr)
        return 1
    return 0


def killed_ranks(failures: dict[int, Any]) -> list[tuple[int, int, int]]:
    """(rank, pid, signal) of each rank a signal other than this launcher's own stop (SIGINT, SIGTERM) ended."""
    ended = [(rank, f.pid, -f.exitcode) for rank, f in sorted(failures.items()) if f.exitcode < 0]
    return [(rank, pid, signum) for rank, pid, signum in ended if signum not in (signal.SIGINT, signal.SIGTERM)]


if __name__ == "__main__":
    from gpt2.core.entry import end

    end(main(sys.argv[1:]))
