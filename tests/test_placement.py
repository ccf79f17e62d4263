"""Every tensor of a training step where the device is: the step run on PyTorch's meta device.

A CPU-only build cannot run CUDA kernels, and its fake CUDA tensors stop at the first ``.to("cuda")``,
``.contiguous()``, random fill or autograd edge ("PyTorch is not linked with support for cuda devices",
torch 2.13). The meta device has no kernels either, but runs shapes, dtypes, autograd and the
optimizer: built on it, the model's forward and backward (the chunked loss included), the optimizer
step, the batches the sampler places, the eval forward and the KV-cache path fail here the moment a
tensor is made on the CPU instead of the model's device (a missing ``device=``, a ``.to(device)``
forgotten), as they would on the first GPU.

What it cannot check: CUDA-only branches (``device.type == "cuda"``: pinned memory, CUDA events,
autocast's CUDA dtype), fused kernels (fused AdamW has no meta kernel: the test runs the foreach
path), and anything that reads a value (``.item()``, sampling), which meta tensors do not have.
"""

from __future__ import annotations

import dataclasses

import torch
from conftest import micro_params

from gpt2.model.gpt import KVCache
from gpt2.train import trainer
from gpt2.train.optim import build_optimizers
from gpt2.train.step import backward_micro_batches, optimizer_step


def test_a_training_step_eval_and_kv_cache_keep_every_tensor_on_the_models_device(tokens):
    s = trainer.build(micro_params(fused_adamw=False, grad_accum_steps=2), tokens)
    meta = torch.device("meta")
    s.model.to(meta)
    s.runtime = dataclasses.replace(s.runtime, device=meta)
    s.sampler.device = meta  # batches are placed where the run's device is
    optimizers = build_optimizers(s.model, s.params.train)
    batches = iter(s.sampler.next, None)
    loss = backward_micro_batches(s.model, batches, s.batch.accum, s.runtime, s.scaler)
    norm, _ = optimizer_step(s.model, optimizers, s.scaler, s.params.train.grad_clip)
    assert loss.device == norm.device == meta
    assert all(p.device == meta for p in s.model.parameters())
    assert all(v.device == meta for o in optimizers for state in o.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim())  # moments where the weights are
    with torch.no_grad():
        x, y = s.sampler.next()
        _, per_window = s.model.eval()(x, y, per_window=True)  # the val loss's forward
        cache = KVCache(s.model.cfg, 1, meta, torch.float32)
        logits, _ = s.model(x[:1, :5], cache=cache)  # a prompt, then one token at a time
        step_logits, _ = s.model(x[:1, 5:6], cache=cache)
    assert per_window.shape == (len(x),) and per_window.device == meta
    assert logits.device == step_logits.device == meta
