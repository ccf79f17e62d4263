"""Data-parallel training on PyTorch's own engines: torchrun launches, DDP or FSDP2 averages gradients.

``train.distributed: ddp`` (a full replica per rank) or ``fsdp`` (sharded, train/sharded.py) with
``nproc_per_node: N > 1`` makes ``gpt2 train`` (and so the DVC stage) re-launch itself under
``torchrun --standalone``; on several nodes, start ``torchrun`` on
each node yourself (docs/many-gpus.md): a process that finds torchrun's ``RANK`` in its
environment joins the group instead of launching. NCCL on CUDA, gloo on CPU. Every collective
has a deadline (``train.dist_timeout_s``), so a rank that died or hangs becomes an error on the
others rather than a job that waits forever.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from gpt2.core import log
from gpt2.core.config import TrainConfig
from gpt2.core.errors import UserError
from gpt2.train.processes import under_torchrun

logger = log.get("train")


@dataclass(frozen=True)
class Dist:
    """This process's place in the job (rank 0 of 1 when not distributed)."""

    rank: int = 0
    local_rank: int = 0
    world: int = 1
    grouped: bool = False  # in a process group (ddp or fsdp, even of one process)
    sharded: bool = False  # fsdp: the model is split over the ranks

    @property
    def nodes(self) -> int:
        """The machines the job runs on: its ranks over the ranks torchrun started on this one."""
        return max(1, self.world // int(os.environ.get("LOCAL_WORLD_SIZE", self.world) or self.world))

    @property
    def main(self) -> bool:
        """Rank 0: the one that logs, writes reports and checkpoints."""
        return self.rank == 0


def init(cfg: TrainConfig, device: torch.device) -> tuple[Dist, torch.device]:
    """Join the process group (a one-process group when ddp runs without torchrun) and pick this rank's device."""
    if cfg.distributed == "off":
        if under_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
            raise UserError(f"started by torchrun with WORLD_SIZE={os.environ['WORLD_SIZE']} but train.distributed "
                            "is off: every process would train alone; set train.distributed: ddp (or fsdp)")
        return Dist(), device
    alone = not under_torchrun()  # ddp/fsdp in one process: their code path, measurable against plain training
    rank, world = (0, 1) if alone else (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    local_rank = 0 if alone else int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {local_rank} but only {torch.cuda.device_count()} CUDA devices here; "
                            "lower train.nproc_per_node (or torchrun's --nproc-per-node) to the GPU count")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # the first step compiles (minutes, at different speeds per rank): its collectives get a longer
    # deadline; set_step_deadline() shortens it once that step is done
    timeout = datetime.timedelta(seconds=max(cfg.dist_timeout_s, cfg.dist_first_step_timeout_s))
    if not dist.is_initialized():
        where = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if alone else {}
        dist.init_process_group(backend, timeout=timeout, **where,
                                **({"device_id": device} if device.type == "cuda" else {}))
    return Dist(rank=rank, local_rank=local_rank, world=world, grouped=True, sharded=cfg.distributed == "fsdp"), device


def set_step_deadline(cfg: TrainConfig, d: Dist) -> None:
    """After the first step: collectives that wait longer than ``dist_timeout_s`` fail every rank."""
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)  # PyTorch >= 2.2
    if d.world > 1 and set_timeout is not None and cfg.dist_first_step_timeout_s > cfg.dist_timeout_s:
        set_timeout(datetime.timedelta(seconds=cfg.dist_timeout_s))


KEPT_UNTIL_EXIT: list[object] = []  # left process groups, never freed (shutdown says why)


def shutdown(d: Dist, finished: bool) -> None:
    """Leave the process group. After a finished run every rank first waits for rank 0, which writes the
    checkpoint and the reports after the last step: a rank that left early and then crashed in its own
    teardown would make torchrun stop rank 0 halfway through writing them. A peer gone by then is no
    error here: this rank's share of the run is done and written.

    The group itself is kept referenced until the process ends (with ``os._exit``, gpt2/core/entry.py, which
    frees nothing). Freed with the DDP model's reducer, the last to hold it, gloo's destructor joins its worker
    thread while holding the GIL, and a worker that waits for the GIL to run a callback never ends: a rank of a
    finished run hung there until its job's timeout (both threads' stacks seen on a 2-core CPU, torch 2.13)."""
    if d.grouped and dist.is_initialized():
        if finished and d.world > 1:
            try:
                dist.barrier()
            except Exception as exc:  # noqa: BLE001 - any collective failure: the run itself is complete
                logger.warning(f"rank {d.rank}/{d.world}: a peer left before the run's last barrier "
                               f"({exc.__class__.__name__}); this rank's work is complete", extra=log.EVERY_RANK)
        if dist.group.WORLD is not None:
            KEPT_UNTIL_EXIT.append(dist.group.WORLD)
        dist.destroy_process_group()


def total(value: torch.Tensor, d: Dist) -> torch.Tensor:
    """The sum of ``value`` over all ranks."""
    if d.world > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def agree_on_start(step: int, finished: bool, d: Dist, device: torch.device, path: Path) -> None:
    """Every rank must begin where the others do. Each reads the checkpoint from its own disk: on nodes that do
    not share ``path``'s folder, some would resume and some start afresh, train apart and wait for each other at
    the end. One all-reduce of the highest and (negated) lowest step and finished flag finds it first."""
    if d.world < 2:
        return
    seen = torch.tensor([step, -step, int(finished), -int(finished)], dtype=torch.int64, device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    high, low, any_finished, all_finished = seen.tolist()
    if high != -low or any_finished != -all_finished:
        raise UserError(f"the ranks found different checkpoints at {path} (this one at step {step}, others from "
                        f"step {-low} to {high}): every node must read the same {path.parent}/, on a filesystem "
                        "they share (or storage mounted there on each); train.resume: never starts afresh on all")


def step_consensus(losses: list[torch.Tensor], stop: bool, clock_s: float, d: Dist) -> tuple[list[float], bool, float]:
    """(each step's loss averaged over ranks, whether any rank must stop, the ranks' mean of ``clock_s``), in one
    all-reduce at a sync point: a signal that reached one rank stops every rank after the same step, and a time
    budget is read from one clock."""
    device = losses[0].device
    extra = torch.tensor([float(stop), clock_s], device=device)  # fp32: MPS has no fp64; 0.01 s in a day
    both = torch.cat([torch.stack([loss.detach().float() for loss in losses]), extra])
    if d.world > 1:
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
    values = both.tolist()  # the one read of the device between sync points
    return [v / d.world for v in values[:-2]], values[-2] > 0, values[-1] / d.world


def gather(obj: object, d: Dist) -> list[object]:
    """Every rank's ``obj``, in rank order (a list of one when not distributed)."""
    if d.world == 1:
        return [obj]
    out: list[object] = [None] * d.world
    dist.all_gather_object(out, obj)
    return out


def is_collective_failure(exc: BaseException) -> bool:
    """Whether an error raised under a process group is a collective's: a peer died or hung."""
    text = str(exc).lower()
    return isinstance(exc, getattr(dist, "DistError", ())) or any(
        word in text for word in ("gloo", "nccl", "timed out", "timeout", "connection", "peer"))


def collective_error(exc: BaseException, d: Dist, timeout_s: float, ckpt_path: Path) -> UserError:
    """What a rank says when a collective fails: the cause is a peer's, and what is on disk is what was saved."""
    saved = (f"nothing more was saved: the last checkpoint is {ckpt_path} (train.resume auto continues from it)"
             if ckpt_path.is_file() else "no checkpoint was saved")
    return UserError(f"rank {d.rank}/{d.world}: a collective failed ({exc.__class__.__name__}: "
                     f"{str(exc).splitlines()[0][:300] if str(exc) else ''}); a peer process died or hung longer than "
                     f"train.dist_timeout_s = {timeout_s:g} s (the first rank to fail, or the launcher, says which); "
                     f"{saved}")
