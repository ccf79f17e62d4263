"""A DDP training process for tests, run under torchrun, that can misbehave on purpose.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/ddp_driver.py PARAMS TOKENS CKPT OUT \\
        [--fault signal|hang|die|kill --fault-rank R --fault-step S] [--defer-syncs] [--crash-at-exit R]

signal: SIGTERM to this rank while step S runs (the other rank must stop at the same step);
hang: this rank sleeps --hang-s seconds at step S (or at each of S1,S2) (the others must time out first);
die: this rank exits at step S.
--defer-syncs: sync only at log, eval and checkpoint steps, as on CUDA.
--crash-at-exit R: rank R aborts (SIGABRT, as a crash in gloo's teardown does) once training returns, while
rank 0 takes 2 s more to write its reports.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpt2.core.cli import user_errors  # noqa: E402
from gpt2.core.config import load_params  # noqa: E402
from gpt2.train import describe, step_log, trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("params", "tokens", "ckpt", "out"):
        parser.add_argument(name)
    parser.add_argument("--fault", choices=["signal", "hang", "die", "kill"])
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=lambda text: {int(step) for step in text.split(",")}, default={3},
                        help="the step(s), comma-separated")
    parser.add_argument("--hang-s", type=float, default=15.0)
    parser.add_argument("--defer-syncs", action="store_true")
    parser.add_argument("--crash-at-exit", type=int)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    if args.defer_syncs:
        step_log.sync_every_step = lambda runtime: False
    if args.crash_at_exit is not None and rank == 0:
        write_reports = describe.write_reports

        def slow_write_reports(*a, **kw):
            time.sleep(2.0)
            write_reports(*a, **kw)

        describe.write_reports = slow_write_reports
    if args.fault and rank == args.fault_rank:
        original = trainer.lr_at

        def lr_at(step, cfg, *rest):
            if step in args.fault_step:
                if args.fault == "signal":
                    os.kill(os.getpid(), signal.SIGTERM)
                elif args.fault == "hang":
                    time.sleep(args.hang_s)
                elif args.fault == "kill":  # as the kernel's out-of-memory killer or `kill -9` would
                    os.kill(os.getpid(), signal.SIGKILL)
                else:
                    os._exit(3)
            return original(step, cfg, *rest)

        trainer.lr_at = lr_at
    user_errors(trainer.train)(load_params(args.params), args.tokens, args.ckpt, args.out)
    if rank == args.crash_at_exit:
        os.abort()


if __name__ == "__main__":
    from gpt2.core.entry import end

    main()
    end(0)  # a rank ends as the train stage's ranks do: no module teardown (gpt2/core/entry.py)
