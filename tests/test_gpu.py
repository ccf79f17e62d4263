"""CUDA paths. Skipped without a GPU; run them where one exists (see docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch
from conftest import micro_params

from gpt2.core.config import TrainConfig
from gpt2.run.device import resolve, sdpa_backend
from gpt2.run import device
from gpt2.train import trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_auto_picks_cuda_and_bf16_with_tf32():
    runtime = resolve(TrainConfig())
    assert runtime.device.type == "cuda"
    assert runtime.dtype == ("bf16" if torch.cuda.get_device_capability() >= (8, 0) else "fp16")
    assert runtime.tf32 and torch.backends.cuda.matmul.allow_tf32


def test_flash_path_gets_a_fused_kernel_in_bf16():
    runtime = resolve(TrainConfig(dtype="bf16"))
    assert sdpa_backend(runtime, n_head=12, head_dim=64, seq_len=1024) in {"flash_attention", "cudnn_attention",
                                                                           "efficient_attention"}


def test_cuda_training_reports_gpu_memory_and_pins_batches(tmp_path, tokens):
    s = trainer.build(micro_params(device="cuda"), tokens)
    x, y = s.sampler.next()
    assert x.is_cuda and y.is_cuda
    metrics = trainer.train(micro_params(device="cuda", max_steps=4), tokens, tmp_path / "c.pt", tmp_path / "r")
    assert metrics["mem"]["peak_gb"] > 0
    assert {"mem/peak_allocated_gb", "mem/peak_reserved_gb"} <= set(device.memory_gb(s.runtime))
    assert metrics["mem"]["peak_reserved_gb"] >= metrics["mem"]["peak_allocated_gb"] == metrics["mem"]["peak_gb"]


def test_compiled_bf16_training_on_cuda(tmp_path, tokens):
    """bf16 autocast, compiled, the chunked loss in two uneven chunks: one graph, no break, no recompilation
    in later steps or in the second eval (the CPU test checks fp32)."""
    params = micro_params(device="cuda", dtype="bf16", compile=True, max_steps=6, eval_interval=3, loss_chunk=40)
    metrics = trainer.train(params, tokens, tmp_path / "c.pt", tmp_path / "r")
    assert metrics["steps"] == 6 and metrics["runtime"]["dtype"] == "bf16"
    assert metrics["runtime"]["graph_breaks"] == 0 and metrics["runtime"]["recompiles"] == 0


@pytest.mark.parametrize("loss_chunk", [0, 1024])
@pytest.mark.parametrize("amp", [False, True])
def test_memory_estimate_matches_the_cuda_peak(amp, loss_chunk):
    """gpt2 plan's estimate against torch's own count of the peak, GPT-2 124M at batch 4 x 1024."""
    from gpt2.core import memory_model
    from gpt2.model.gpt import GPT, gpt_config
    from gpt2.model.head import Head

    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    model = GPT(gpt_config("gpt2", {}, 50257, True, "flash"), Head(loss_chunk)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, 50257, (4, 1024), device="cuda")
    for _ in range(2):
        with torch.autocast("cuda", torch.bfloat16, enabled=amp):
            _, loss = model(idx, idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    estimate = memory_model.memory(memory_model.shape("gpt2"), 4, 1024, amp=amp, flash=True,
                                   loss_chunk=loss_chunk).total
    assert torch.cuda.max_memory_allocated() == pytest.approx(estimate, rel=0.25)


def test_ddp_on_one_gpu_uses_nccl(tmp_path, tokens):
    metrics = trainer.train(micro_params(device="cuda", distributed="ddp", max_steps=4), tokens, tmp_path / "c.pt",
                            tmp_path / "r")
    assert metrics["perf"]["world_size"] == 1 and metrics["runtime"]["device"] == "cuda:0"


def test_checkpoint_keeps_the_cuda_rng_of_this_device_only():
    from gpt2.run import checkpoint

    torch.cuda.init()
    states = checkpoint.rng_states()
    assert isinstance(states["cuda"], torch.Tensor)  # one device's state, restorable on any machine with one GPU
    expected = torch.rand(3, device="cuda")
    checkpoint.restore_rng_states(states)
    assert torch.equal(torch.rand(3, device="cuda"), expected)


GPT2_FULL = {"size": "gpt2", "n_layer": None, "n_head": None, "n_embd": None, "block_size": None}


def test_auto_micro_batch_fits_and_the_next_size_up_does_not(tmp_path, tokens):
    """The memory model's choice trains on this card; twice that micro-batch (the next candidate) runs out."""
    from gpt2.core.errors import UserError

    torch.cuda.empty_cache()
    run = {"device": "cuda", "dtype": "bf16", "block_size": 1024, "batch_tokens": 512 * 1024, "max_steps": 2,
           "final_eval": False, "save_checkpoint": False, "resume": "never"}
    chosen = trainer.train(micro_params(GPT2_FULL, micro_batch_size="auto", **run), tokens, tmp_path / "a.pt", None)
    micro = chosen["runtime"]["micro_batch_size"]
    assert micro * chosen["runtime"]["grad_accum_steps"] == 512 and chosen["mem"]["peak_gb"] > 0
    if micro == 512:
        pytest.skip("the whole batch fits in one micro-batch here: no next size up")
    torch.cuda.empty_cache()
    with pytest.raises(UserError, match="out of memory on cuda"):
        trainer.train(micro_params(GPT2_FULL, micro_batch_size=2 * micro, **run), tokens, tmp_path / "b.pt", None)


def test_fsdp_on_one_gpu_writes_a_plain_checkpoint(tmp_path, tokens):
    from gpt2.run import checkpoint

    metrics = trainer.train(micro_params(device="cuda", distributed="fsdp", max_steps=4), tokens, tmp_path / "c.pt",
                            tmp_path / "r")
    assert metrics["runtime"]["distributed"] == "fsdp" and metrics["runtime"]["device"] == "cuda:0"
    assert all(not t.is_cuda for t in checkpoint.load(tmp_path / "c.pt")["model"].values())


def test_fp8_and_the_liger_loss_train_compiled_close_to_bf16(tmp_path, tokens):
    """The two optional levers on CUDA, compiled: FP8 matmuls (torchao; compute capability 8.9+) and Liger's
    fused linear + cross-entropy; each run's val loss follows bf16's with the chunked loss."""
    pytest.importorskip("torchao")
    pytest.importorskip("liger_kernel")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    base = dict(device="cuda", dtype="bf16", compile=True, max_steps=6, model={"n_embd": 64})
    runs = {name: trainer.train(micro_params(**base, **change), tokens, tmp_path / name / "c.pt", tmp_path / name)
            for name, change in {"bf16": {}, "fp8": {"fp8": "rowwise"}, "liger": {"loss_kernel": "liger"}}.items()}
    assert runs["fp8"]["runtime"]["fp8"].startswith("rowwise") and runs["liger"]["runtime"]["loss_kernel"] == "liger"
    for name in ("fp8", "liger"):
        assert runs[name]["val"]["loss"] == pytest.approx(runs["bf16"]["val"]["loss"], rel=0.02), name


def test_fp8_head_and_rowwise_fwd_dgrad_train_compiled_close_to_bf16_in_one_graph(tmp_path, tokens):
    """The FP8 paths of our own (torch._scaled_mm, no torchao), compiled: the LM head's three matmuls inside the
    chunked loss, and the blocks' layers with rowwise scales (CUDA's rowwise kernel); no graph break, and the val
    loss (computed in bf16 for the head) follows the bf16 run's."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    base = dict(device="cuda", dtype="bf16", compile=True, max_steps=6, model={"n_embd": 64})
    changes = {"bf16": {}, "fp8_head": {"fp8_head": True}, "rowwise": {"fp8": "rowwise_fwd_dgrad"}}
    runs = {name: trainer.train(micro_params(**base, **change), tokens, tmp_path / name / "c.pt", tmp_path / name)
            for name, change in changes.items()}
    assert runs["fp8_head"]["runtime"]["fp8_head"] is True
    assert runs["rowwise"]["runtime"]["fp8"] == "rowwise_fwd_dgrad (8 layers)"
    for name in ("fp8_head", "rowwise"):
        assert runs[name]["runtime"]["graph_breaks"] == 0, name
        assert runs[name]["val"]["loss"] == pytest.approx(runs["bf16"]["val"]["loss"], rel=0.02), name
