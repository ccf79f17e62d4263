"""The parts of a run a checkpoint restores, in one table: a save writes each part's state, a resume loads each.

A part that is not in ``PARTS`` is not restored, and a part that is gets saved: the two cannot drift apart.
Every rank calls each ``state`` in the table's order (under FSDP the weights and the optimizer state are
gathered from the shards, and every rank's RNG states by all ranks); what rank 0 gets is the file's, in
the layout one process would write.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpt2.core import log
from gpt2.run import checkpoint
from gpt2.train import distributed, sharded
from gpt2.train.build import Setup

logger = log.get("train")


@dataclass(frozen=True)
class Part:
    state: Callable[[Setup], Any]  # what the checkpoint keeps of it; called on every rank, in PARTS' order
    load: Callable[[Setup, Any, dict[str, Any]], None]  # put it back, given the whole checkpoint for context


def model_state(s: Setup) -> dict[str, Any]:
    """The whole model's weights, without torch.compile's prefix, whatever the distribution."""
    if s.dist.sharded:
        return sharded.full_model_state(s.model)
    return checkpoint.clean_state_dict(s.model.state_dict()) if s.dist.main else {}


def load_model(s: Setup, weights: dict[str, Any], _: dict[str, Any]) -> None:
    if s.dist.sharded:  # each rank keeps its shard of the full state
        sharded.load_model_state(s.model, weights)
    else:
        s.model.load_state_dict(weights)


def optimizer_states(s: Setup) -> list[dict[str, Any]]:
    """Each optimizer's state in torch.optim's own layout, as one process holds it."""
    if s.dist.sharded:
        return [sharded.full_optimizer_state(s.model, optimizer) for optimizer in s.optimizers]
    return [optimizer.state_dict() for optimizer in s.optimizers] if s.dist.main else []


def load_optimizers(s: Setup, saved: list[dict[str, Any]], _: dict[str, Any]) -> None:
    for optimizer, optimizer_state in zip(s.optimizers, saved, strict=True):
        load_optimizer(s, optimizer, optimizer_state)


def load_optimizer(s: Setup, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """The checkpoint's optimizer state (moments, step counts) under this run's hyperparameters.

    ``load_state_dict`` takes every param-group value from the file: the old peak learning rate, weight
    decay and betas would go on training while the log and MLflow show the new ones."""
    configured = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    if s.dist.sharded:
        sharded.load_optimizer_state(s.model, optimizer, saved)
    else:
        optimizer.load_state_dict(saved)
    for group, values in zip(optimizer.param_groups, configured, strict=True):
        group.update(values)
        on_device = group.get("fused") or group.get("capturable")  # where torch.optim keeps the step count
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor):
                optimizer.state[p]["step"] = step.to(p.device if on_device else "cpu", torch.float32)


def load_scaler(s: Setup, saved: dict[str, Any], state: dict[str, Any]) -> None:
    if s.scaler.is_enabled() and not saved:
        logger.info(f"train: the checkpoint trained in {state['params']['train'].get('dtype')}, with no fp16 loss "
                    "scale; GradScaler starts at its initial scale")
    else:
        s.scaler.load_state_dict(saved)


def load_rngs(s: Setup, per_rank: list[dict[str, Any]], state: dict[str, Any]) -> None:
    """Each rank's RNG states (its dropout continues exactly), where the world size is the checkpoint's."""
    if state["world_size"] == s.dist.world:
        checkpoint.restore_rng_states(per_rank[s.dist.rank])
    else:
        logger.info(f"train: the checkpoint was written by {state['world_size']} process(es), this run has "
                    f"{s.dist.world}: weights, optimizer, step and data stream continue; dropout RNG starts afresh")


PARTS: dict[str, Part] = {
    "model": Part(model_state, load_model),
    "optimizer": Part(optimizer_states, load_optimizers),
    "scaler": Part(lambda s: s.scaler.state_dict(), load_scaler),
    # the global-batch stream: the same on every rank
    "sampler": Part(lambda s: s.sampler.state(), lambda s, saved, _: s.sampler.load_state(saved)),
    "rng_per_rank": Part(lambda s: distributed.gather(checkpoint.rng_states(), s.dist), load_rngs),
}


def states(s: Setup) -> dict[str, Any]:
    """Every part's state (every rank calls it; rank 0's is the checkpoint's)."""
    return {key: part.state(s) for key, part in PARTS.items()}


def load(s: Setup, state: dict[str, Any]) -> None:
    """Put every part of a checkpoint back in place."""
    for key, part in PARTS.items():
        part.load(s, state[key], state)
