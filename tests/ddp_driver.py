"""A DDP training process for tests, run under torchrun or forked by ``forked_job``, that can misbehave on purpose.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/ddp_driver.py PARAMS TOKENS CKPT OUT \\
        [--fault signal|hang|die|kill --fault-rank R --fault-step S] [--defer-syncs] [--crash-at-exit R]

signal: SIGTERM to this rank while step S runs (the other rank must stop at the same step);
hang: this rank sleeps --hang-s seconds at step S (or at each of S1,S2) (the others must time out first);
die: this rank exits at step S.
--defer-syncs: sync only at log, eval and checkpoint steps, as on CUDA.
--crash-at-exit R: rank R aborts (SIGABRT, as a crash in gloo's teardown does) once training returns, while
rank 0 takes 2 s more to write its reports.
--no-checkpoint-on R: rank R finds no checkpoint (a node whose checkpoints/ is its own disk).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpt2.core.cli import user_errors  # noqa: E402
from gpt2.core.config import load_params  # noqa: E402
from gpt2.train import describe, step_log, trainer  # noqa: E402


def main(argv: list[str] | None = None) -> None:
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
    parser.add_argument("--no-checkpoint-on", type=int, help="this rank's node cannot see the checkpoint")
    args = parser.parse_args(argv)
    rank = int(os.environ["RANK"])
    if rank == args.no_checkpoint_on:  # as a node whose checkpoints/ is its own local disk
        from gpt2.train import resume

        resume.load_for_resume = lambda path, s: None  # nothing there: a fresh start
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


def forked_job(argv: list[str], nproc: int, timeout: float = 300) -> subprocess.CompletedProcess:
    """The job ``torchrun --standalone --nproc-per-node NPROC ddp_driver.py ARGV`` runs, each rank a process of
    its own as there, but forked from a server that imported torch and this driver once per test worker: a
    launch costs no imports (on a slow 2-core CPU, 6 s per process and 16 CPU-seconds per 2-rank launch). For
    tests of what ranks do together; the launcher's own part (naming a killed rank, stopping the others) is
    tested with torchrun. What torch reads when it loads (OMP_NUM_THREADS) comes from the server's
    environment. As torchrun does, a failing rank stops the others (SIGTERM, SIGKILL 30 s later). Returns what
    ``subprocess.run`` would: the exit code of the lowest rank that failed before the others were stopped
    (128 + N for signal N) and the ranks' output, rank 0's first, as stderr; raises
    ``subprocess.TimeoutExpired`` past ``timeout``."""
    server = multiprocessing.get_context("forkserver")
    server.set_forkserver_preload(["torch", "torch._dynamo", "ddp_driver"])
    folder = Path(argv[3]).parent  # beside the checkpoint
    logs = [folder / f"rank{rank}.log" for rank in range(nproc)]
    port = free_port()
    ranks = [server.Process(target=_rank, args=(argv, log, {
        **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}, os.getcwd()))
        for rank, log in enumerate(logs)]
    try:
        for process in ranks:
            process.start()
        deadline = time.monotonic() + timeout
        while any(p.exitcode is None for p in ranks) and not any(p.exitcode for p in ranks):
            if time.monotonic() > deadline:  # what subprocess.run's timeout does: a hang is not a failure to accept
                raise subprocess.TimeoutExpired(["ddp_driver.py", *argv], timeout, stderr=_stacks(ranks, logs))
            time.sleep(0.1)  # torchrun's monitor interval
        failed = [p.exitcode for p in ranks if p.exitcode]  # before this job stops the others itself
        stop_by = time.monotonic() + 30  # a rank failed: torchrun stops the others, SIGKILL 30 s later
        for process in ranks:
            if process.exitcode is None:
                process.terminate()
        for process in ranks:
            process.join(max(0.0, stop_by - time.monotonic()))
    finally:  # a timeout, a failed start or Ctrl-C: no rank is left waiting for its peers
        for process in ranks:
            if process.pid is not None and process.exitcode is None:
                process.kill()
                process.join()
    code = next((128 - c if c < 0 else c for c in failed), 0)
    return subprocess.CompletedProcess(["ddp_driver.py", *argv], code, "", _output(logs))


def _stacks(ranks: list, logs: list[Path]) -> str:
    """The ranks' output with each live rank's Python stacks at the end: where a hung job waits. Where gdb is
    installed, each live rank's native stacks too: a rank stuck in C++ (a destructor, a collective) shows only
    the Python line that called it."""
    live = [process for process in ranks if process.exitcode is None]
    for process in live:
        with contextlib.suppress(ProcessLookupError):  # it may end between the check and the signal
            os.kill(process.pid, signal.SIGUSR1)  # faulthandler, registered in _rank, writes the stacks
    time.sleep(1.0)
    text = _output(logs)
    for process in live if shutil.which("gdb") else []:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            native = subprocess.run(["gdb", "-p", str(process.pid), "-batch", "-ex", "thread apply all bt 25"],
                                    capture_output=True, text=True, timeout=60).stdout
            text += f"\nnative stacks of pid {process.pid}:\n" + "\n".join(
                line for line in native.splitlines() if line.startswith(("Thread ", "#")))
    print(text[-20000:], file=sys.stderr)  # pytest shows a test's stderr, not an exception's attributes
    return text


def _output(logs: list[Path]) -> str:
    """The ranks' output, rank 0's first (a rank that died before it opened its log wrote nothing)."""
    return "".join(log.read_text(errors="replace") for log in logs if log.exists())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(argv: list[str], log: Path, env: dict[str, str], cwd: str) -> None:
    """One rank, in the forked process: its environment as torchrun sets it, its output to its own file."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # _stacks: where this rank waits if the job hangs
    from gpt2.core.entry import end

    main(argv)
    end(0)  # as under torchrun: the stage's early exit, its thread pools shut down and exit handlers run


if __name__ == "__main__":
    from gpt2.core.entry import end

    main()
    end(0)  # a rank ends as the train stage's ranks do: no module teardown (gpt2/core/entry.py)
