"""Sharded training (``train.distributed: fsdp``) on PyTorch's FSDP2, ``fully_shard``.

Each block is its own FSDP unit, and the root holds the rest (the tied embedding and LM head, the
position embedding, the last LayerNorm). Every rank keeps 1/world of the weights, gradients and
AdamW state; a block's full weights exist only while it computes (all-gathered, then freed), and
its gradients are reduce-scattered, averaged as DDP averages them (after every micro-batch:
deferring it, as DDP's ``no_sync`` does, would hold full-size gradients). So a GPT-2 too large for
one card's replica with its optimizer state trains on several.

Checkpoints stay those of one process: the full weights and the optimizer state in torch.optim's
own layout, gathered onto rank 0. A run resumes across off, ddp and fsdp and across world sizes.
"""

from __future__ import annotations

from typing import Any

import torch

from gpt2.model.gpt import GPT

_FULL = dict(full_state_dict=True, cpu_offload=True)


def shard(model: GPT, device: torch.device, param_dtype: torch.dtype | None = None) -> None:
    """Split ``model`` over the process group onto ``device``, in place (it becomes an FSDP module).

    Called on the model still on the CPU: each rank moves only its shards to its GPU, never the
    whole model. With ``param_dtype`` (bf16 runs) the all-gathers move and the forward uses bf16
    weights, half the bytes of fp32 and no recast of every gathered weight by autocast; gradients
    are still reduced, and the shards and AdamW's state kept, in fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def full_model_state(model: GPT) -> dict[str, torch.Tensor]:
    """The full weights on rank 0's CPU (other ranks get {}); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(**_FULL))


def full_optimizer_state(model: GPT, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` as one process would have it, on rank 0; every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    by_name = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(**_FULL))
    if not by_name:
        return {}
    index = {name: i for i, name in enumerate(n for g in by_name["param_groups"] for n in g["params"])}
    return {"state": {index[name]: value for name, value in by_name["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]]}


def load_model_state(model: GPT, state: dict[str, torch.Tensor]) -> None:
    """Every rank loads the full weights and keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def load_optimizer_state(model: GPT, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Every rank loads a full ``optimizer.state_dict()`` (one process's layout) and keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    name_of = {id(p): name for name, p in model.named_parameters()}
    names = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]  # torch.optim's numbering
    by_name = {"state": {names[i]: value for i, value in state["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
