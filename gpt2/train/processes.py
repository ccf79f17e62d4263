"""The processes a training run spans: torchrun's ranks, launched with the signals forwarded to them,
and the kernel's SIGTERM to a trainer whose parent died.

Nothing here imports torch: the train stage decides to launch torchrun and starts it without
paying torch's import (seconds) in a process that never trains.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from gpt2.core import log
from gpt2.core.config import TrainConfig

logger = log.get("train")


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def must_launch(cfg: TrainConfig) -> bool:
    """Whether this process should start torchrun rather than train."""
    return cfg.distributed != "off" and cfg.nproc_per_node > 1 and not under_torchrun()


def launch(cfg: TrainConfig, args: list[str]) -> int:
    """Run ``python -m gpt2.train.cli ARGS`` in ``nproc_per_node`` processes under torchrun; its exit status."""
    command = [sys.executable, "-m", "gpt2.train.torchrun", "--standalone", f"--nproc-per-node={cfg.nproc_per_node}",
               "-m", "gpt2.train.cli", *args]
    logger.info(f"train: launching {cfg.nproc_per_node} processes: {' '.join(command[1:])}")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(_threads_per_rank(cfg)))}
    code = run_forwarding_signals(command, env)
    if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        return code
    if code > 128:  # a rank killed by a signal: the launcher's `error:` line above names it
        return code
    if code != 0:
        logger.info(f"train: {cfg.nproc_per_node} processes ended with exit status {code}. The first rank to fail "
                    "says why above (its `error:` line). On CUDA (NCCL) a rank that dies or hangs is noticed by "
                    "PyTorch's watchdog, "
                    f"which ends every rank after train.dist_timeout_s = {cfg.dist_timeout_s:g} s (the first step: "
                    f"train.dist_first_step_timeout_s = {cfg.dist_first_step_timeout_s:g} s, for compilation) with "
                    "'Watchdog caught collective operation timeout' or 'ProcessGroupNCCL' lines: those are the "
                    "consequence; the cause is the first rank's own error, or a rank that stopped printing.")
    return code


def run_forwarding_signals(command: list[str], env: dict[str, str]) -> int:
    """Run ``command`` and pass it each SIGINT/SIGTERM this process gets; wait for it to end.

    The ranks save a checkpoint when torchrun hands them the signal. Without this, a SIGTERM to the
    stage (DVC, a scheduler) would end this process at once and leave the ranks training, holding the
    checkpoint's lock. torchrun gets its own session, so a Ctrl-C in the terminal reaches it once,
    through here, not twice (a second SIGINT aborts a rank without saving). Returns 128 + the signal
    when one was forwarded, else torchrun's exit status."""
    child = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=stop_with_parent)
    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 + received[0] if received else code


def _threads_per_rank(cfg: TrainConfig) -> int:
    return max(1, (os.cpu_count() or 1) // cfg.nproc_per_node)


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
    _WATCHED["parent"] = parent
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
_WATCHED: dict[str, int | bool] = {}  # the parent stop_with_parent watches, and whether the watched shell's parent died


def parent_gone() -> bool:
    """Whether the process that started this one (DVC, a scheduler), as :func:`stop_with_parent` watches it, has
    died: a killed ``dvc exp run`` leaves work for the user that a stop through DVC does not."""
    parent = _WATCHED.get("parent")
    return parent is not None and (os.getppid() != parent or bool(_WATCHED.get("gone")))


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
    _WATCHED["gone"] = True
    os.kill(os.getpid(), signal.SIGTERM)
