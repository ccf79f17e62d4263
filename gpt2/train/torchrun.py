"""torchrun for the train stage: PyTorch's launcher, quiet when the run was stopped on purpose.

Ctrl-C or SIGTERM reaches the ranks through torchrun; they save and exit with 130 or 143. torchrun then
raises its ``SignalException``, printed as a traceback, or reports a ``ChildFailedError`` that blames a
"failed" rank: both misread a run that did what it was asked. This runs torchrun and exits 128 + the
signal instead, leaving the ranks' own line as the only word. Every other failure is reported as
torchrun reports it.

    python -m gpt2.train.torchrun [torchrun's arguments]
"""

from __future__ import annotations

import sys

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
        print(exc.format_msg(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
