"""Each optimization switch must change what runs, not just a config value."""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import micro_params
from torch.profiler import ProfilerActivity, profile

from gpt2.core.config import TrainConfig
from gpt2.model.gpt import GPT, GPTConfig
from gpt2.run.device import resolve
from gpt2.train import describe, loader, trainer
from gpt2.train.loader import BatchSampler, TokenSplit
from gpt2.train.optim import build_optimizers

ROOT = Path(__file__).resolve().parents[1]


def setup(tokens, **train):
    return trainer.build(micro_params(**train), tokens)


def ops_in_forward(model: torch.nn.Module, idx: torch.Tensor) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(idx, idx)
    return {event.key for event in prof.key_averages()}


def test_attention_switch_changes_the_kernels():
    cfg = dict(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=100, padded_vocab_size=100)
    idx = torch.randint(0, 100, (2, 16))
    flash = ops_in_forward(GPT(GPTConfig(**cfg, attention="flash")), idx)
    manual = ops_in_forward(GPT(GPTConfig(**cfg, attention="manual")), idx)
    assert "aten::scaled_dot_product_attention" in flash and "aten::softmax" not in flash
    assert "aten::scaled_dot_product_attention" not in manual
    assert {"aten::softmax", "aten::masked_fill"} <= manual


def test_pad_vocab_switch_changes_the_embedding_shape(tokens):
    assert setup(tokens, model={"pad_vocab": True}).model.transformer.wte.weight.shape[0] == 50304
    assert setup(tokens, model={"pad_vocab": False}).model.transformer.wte.weight.shape[0] == 50257


@pytest.mark.parametrize("dtype, expected", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                             ("fp16", torch.float16)])
def test_dtype_switch_changes_the_compute_dtype(tokens, dtype, expected):
    s = setup(tokens, dtype=dtype)
    x, y = s.sampler.next()
    with s.runtime.autocast():
        logits, _ = s.model(x)  # the training loss returns no logits (train.loss_chunk): ask for them
    assert logits.dtype == expected
    assert s.scaler.is_enabled() == (dtype == "fp16")


def test_bf16_residual_stream_carries_bf16_between_blocks_and_trains_as_fp32_to_bf16_precision(tokens, tmp_path):
    def block_inputs(s) -> set[torch.dtype]:
        seen: set[torch.dtype] = set()
        for block in s.model.transformer.h:
            block.register_forward_pre_hook(lambda module, args: seen.add(args[0].dtype))
        x, y = s.sampler.next()
        with s.runtime.autocast():
            s.model(x, y)
        return seen

    assert block_inputs(setup(tokens, dtype="bf16")) == {torch.float32}
    assert block_inputs(setup(tokens, dtype="bf16", residual_stream="bf16")) == {torch.bfloat16}
    inert = setup(tokens, dtype="fp32", residual_stream="bf16")
    assert block_inputs(inert) == {torch.float32}
    assert any("residual_stream bf16 is inert" in w for w in describe.inert_switch_warnings(inert))
    fp32, bf16 = (trainer.train(micro_params(max_steps=6, dtype="bf16", residual_stream=stream), tokens,
                                tmp_path / stream / "ckpt.pt", report_dir=None) for stream in ("fp32", "bf16"))
    assert bf16["train"]["loss"] == pytest.approx(fp32["train"]["loss"], rel=1e-2)
    assert bf16["runtime"]["residual_stream"] == "bf16" and fp32["runtime"]["residual_stream"] == "fp32"


def test_auto_dtype_is_fp32_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    assert resolve(TrainConfig(dtype="auto")).dtype == "fp32"


def test_tf32_switch_sets_matmul_precision_and_is_declared_inert_on_cpu():
    runtime = resolve(TrainConfig(tf32=True))
    if runtime.device.type == "cuda":
        assert torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "high"
        resolve(TrainConfig(tf32=False))
        assert not torch.backends.cuda.matmul.allow_tf32
    else:
        assert not runtime.tf32 and torch.get_float32_matmul_precision() == "highest"


def test_a_cpu_run_names_its_cpu_model_not_its_architecture(monkeypatch):
    """The name a run records (MLflow's device tag, the ladder's header) tells two CPUs apart."""
    from gpt2.core import cpu

    monkeypatch.setattr(cpu, "cpu_info", lambda field: {"model name": "AMD EPYC 7B13"}.get(field, ""))
    assert resolve(TrainConfig(device="cpu")).device_name == "AMD EPYC 7B13"
    monkeypatch.setattr(cpu, "cpu_info", lambda field: "")  # no /proc/cpuinfo (macOS): the architecture
    assert resolve(TrainConfig(device="cpu")).device_name in (platform.processor(), platform.machine())


def test_fused_adamw_switch_selects_the_fused_kernel(tokens):
    assert setup(tokens, fused_adamw=True).optimizers[0].defaults["fused"] is True
    assert not setup(tokens, fused_adamw=False).optimizers[0].defaults["fused"]


def test_weight_decay_only_on_matrices():
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=4, vocab_size=10, padded_vocab_size=10))
    [optimizer] = build_optimizers(model, TrainConfig(weight_decay=0.1))
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_data_loading_preload_holds_ram_memmap_maps_per_batch(tokens):
    preload = TokenSplit(tokens, "train", "preload")
    assert type(preload.array()) is np.ndarray and preload.array() is preload.array()
    mapped = TokenSplit(tokens, "train", "memmap")
    first, second = mapped.array(), mapped.array()
    assert isinstance(first, np.memmap) and first is not second
    assert np.array_equal(np.asarray(first), preload.array())


def test_batching_loop_makes_python_calls_per_sample_vectorized_one(tokens, monkeypatch):
    calls = {"n": 0}
    original = torch.from_numpy

    def counting(array):
        calls["n"] += 1
        return original(array)

    monkeypatch.setattr(loader.torch, "from_numpy", counting)
    data = TokenSplit(tokens, "train", "preload")
    batches = {}
    for mode in ("vectorized", "loop"):
        calls["n"] = 0
        batches[mode] = BatchSampler(data, 8, 16, seed=3, batching=mode, device=torch.device("cpu")).next()
        batches[mode + "_calls"] = calls["n"]
    assert batches["vectorized_calls"] == 1 and batches["loop_calls"] == 16
    for a, b in zip(batches["vectorized"], batches["loop"]):
        assert torch.equal(a, b)  # same windows, different cost
    x, y = batches["vectorized"]
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_compile_switch_wraps_the_model(tokens, monkeypatch):
    compiled = []

    def fake_compile(model, mode=None, options=None):
        compiled.append(options if options is not None else mode)
        return model

    monkeypatch.setattr(trainer.torch, "compile", fake_compile)
    setup(tokens, compile=True, compile_mode="max-autotune")
    setup(tokens, compile=False)
    setup(tokens, compile=True, compile_tuning=True)  # torch.compile takes a mode or options: the tuning as options
    setup(tokens, compile=True, compile_mode="reduce-overhead", compile_tuning=True)
    assert compiled == ["max-autotune", {"coordinate_descent_tuning": True},
                        {"triton.cudagraphs": True, "coordinate_descent_tuning": True}]
    monkeypatch.undo()  # Inductor takes the options by name, and refuses a name it does not know at compile time
    from gpt2.run.compiled import compile_options

    assert torch.compile(lambda x: (2 * x).sum(), **compile_options("default", True))(torch.ones(4)) == 8


@pytest.mark.slow
def test_compiled_training_really_compiles_without_a_break_and_checkpoints_clean_names(tmp_path, tokens):
    """The default model, chunked loss included (two uneven chunks), compiles whole: no graph break, and
    no recompilation in later steps or in the second eval. Its graphs go to AOTAutograd's cache, which
    PyTorch would bypass for the loss's autograd.Function unless train.compile_cache allows it."""
    from torch._dynamo.utils import counters

    params = micro_params(compile=True, max_steps=4, eval_interval=2, loss_chunk=40, model={"n_layer": 1})
    s = trainer.build(params, tokens)
    assert hasattr(s.step_model, "_orig_mod")
    before = dict(counters["aot_autograd"])
    metrics = trainer.train(params, tokens, tmp_path / "ckpt.pt", tmp_path / "reports")
    assert metrics["steps"] == 4
    cache = {k: n - before.get(k, 0) for k, n in counters["aot_autograd"].items() if k.startswith("autograd_cache")}
    assert not cache.get("autograd_cache_bypass") and cache.get("autograd_cache_saved", 0) + \
        cache.get("autograd_cache_hit", 0) >= 1, cache
    assert metrics["runtime"]["graph_breaks"] == 0 and metrics["runtime"]["recompiles"] == 0
    assert metrics["perf"]["eval_warmup_s"] > 0  # the first eval compiled its graph: left out of the steady state
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert not any(k.startswith("_orig_mod.") for k in state["model"])


def test_compile_caches_are_set_for_a_compiled_run_and_restored():
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from gpt2.run.compiled import compile_caches

    def settings():
        return (inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache,
                functorch_config.autograd_cache_allow_custom_autograd_functions)

    before = settings()
    with compile_caches(compile=True, cache=False):
        assert settings() == (False, False, False)
    with compile_caches(compile=True, cache=True):
        assert settings() == (True, True, True)
    with compile_caches(compile=False, cache=False):
        assert settings() == before
    assert settings() == before


CAPPED_COMPILE = """
import torch
from gpt2.model.fp8 import rowwise
from gpt2.run.compiled import compile_caches
x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
with compile_caches(compile=True, cache=True):
    (values, scales), (want, want_scales) = torch.compile(rowwise)(x), rowwise(x)
print(torch.equal(values.view(torch.uint8), want.view(torch.uint8)) and torch.equal(scales, want_scales))
"""


@pytest.mark.slow
@pytest.mark.skipif(not torch.cpu._is_avx512_supported(),  # the hardware's, whatever ATEN_CPU_CAPABILITY says
                    reason="the AVX2 cap changes nothing on a CPU without AVX-512: both runs compile the same code")
def test_a_run_capped_to_avx2_and_one_without_never_share_compiled_cpu_code():
    """Inductor's cache key leaves ATEN_CPU_CAPABILITY out: a graph cached under the AVX2 cap (docs/benchmarks.md's
    emulation) and reused without it was compiled for wider vectors and wrote past its buffers (a crash), and the
    other way round gave wrong values. Two runs on the cache every compiled run of the suite uses (the user's,
    as a user's two runs would), capped then uncapped: each computes eager's numbers. A fresh cache would cost
    each run Inductor's vector-instruction probes on top (24 s against 10 on a 2-core AMD EPYC with AVX-512)."""
    env = dict(os.environ)
    for name in ("ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CACHE_DIR"):  # the latter set by a capped suite run
        env.pop(name, None)
    for capped in (True, False):
        run_env = {**env, "ATEN_CPU_CAPABILITY": "avx2"} if capped else env
        done = subprocess.run([sys.executable, "-c", CAPPED_COMPILE], env=run_env, capture_output=True, text=True,
                              cwd=ROOT, timeout=120)  # a corrupted heap can hang the process
        assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr[-2000:]


def test_graph_breaks_and_recompilations_are_counted():
    from gpt2.run.compiled import CompileWatch, flag

    def logs_in_the_middle(x):
        x = x.sin()
        print("a graph break")
        return x.cos()

    watch = CompileWatch(enabled=True)
    # Dynamo alone breaks graphs and recompiles; Inductor's kernels (a second of g++ each) would add nothing here
    broken, scaled = torch.compile(logs_in_the_middle, backend="eager"), torch.compile(lambda x: x * 2, backend="eager")
    for shape in ((3,), (3,), (3, 4, 5)):  # the third call changes the rank: a recompilation
        with watch.phase("train"):
            broken(torch.ones(3))
            scaled(torch.ones(shape))
    figures = watch.figures()
    assert figures["graph_breaks"] == 1 and figures["recompiles"] >= 1
    assert "graph break" in watch.complaint() and flag(figures).startswith("1 graph break, ")
    assert CompileWatch(enabled=False).figures() == {"graph_breaks": None, "recompiles": None}


def test_grad_accumulation_equals_one_big_batch(tokens):
    s = setup(tokens)
    data = TokenSplit(tokens, "train", "preload")
    x, y = BatchSampler(data, 8, 16, seed=0, batching="vectorized", device=torch.device("cpu")).next()

    def grads(batches, steps):
        s.model.zero_grad()
        trainer.backward_micro_batches(s.model, iter(batches), steps, s.runtime, s.scaler)
        return [p.grad.clone() for p in s.model.parameters()]

    big = grads([(x, y)], 1)
    accumulated = grads([(x[:2], y[:2]), (x[2:4], y[2:4]), (x[4:6], y[4:6]), (x[6:], y[6:])], 4)
    for a, b in zip(big, accumulated):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_grad_clip_switch_clips_the_update(tokens, monkeypatch):
    seen, updates = [], {}
    original = torch.nn.utils.clip_grad_norm_

    def recording(params, max_norm):
        seen.append(max_norm)
        return original(params, max_norm)

    monkeypatch.setattr(trainer.torch.nn.utils, "clip_grad_norm_", recording)
    for clip in (1.0e-3, 0.0):
        s = setup(tokens, grad_clip=clip, fused_adamw=False, lr_schedule="constant", warmup_steps=0)
        before = [p.detach().clone() for p in s.model.parameters()]
        trainer.backward_micro_batches(s.model, iter([s.sampler.next()]), 1, s.runtime, s.scaler)
        norm, _ = trainer.optimizer_step(s.model, s.optimizers, s.scaler, s.params.train.grad_clip)
        updates[clip] = [p.detach() - b for p, b in zip(s.model.parameters(), before)]
        assert norm > 1.0e-3  # the logged norm is the norm before clipping
    assert seen == [1.0e-3, float("inf")]
    assert any(not torch.equal(a, b) for a, b in zip(updates[1.0e-3], updates[0.0]))


def test_requested_inert_switches_are_warned(tokens):
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    s = setup(tokens, compile_mode="max-autotune", compile_tuning=True)
    text = " ".join(describe.inert_switch_warnings(s))
    assert "compile_mode max-autotune is inert" in text
    # the defaults meant for a GPU are said once, in one line, not warned in every default run
    assert "tf32" not in text and "pinned" not in text
    assert describe.inert_defaults(s) == ["train.tf32 (TF32 is a CUDA matmul mode)", "the pinned memory and "
                                          "non_blocking copies of train.batching vectorized (CUDA's)"]
    assert describe.inert_defaults(setup(tokens, tf32=False, batching="loop")) == []
    assert "compile_tuning is inert: it tunes the compiled Triton kernels of a CUDA run, and train.compile is false" \
        in text
    assert "MFU is not reported" not in text  # a CPU's peak is measured (gpt2/run/peak.py)


def test_keep_host_memory_switch_sets_the_allocator_only_when_on(monkeypatch):
    from gpt2.run import device

    calls = []
    monkeypatch.setattr(device, "keep_freed_memory", lambda: calls.append("mallopt") or True)
    device.resolve(TrainConfig(device="cpu", keep_host_memory=False))
    assert calls == []
    device.resolve(TrainConfig(device="cpu", keep_host_memory=True))
    assert calls == ["mallopt"]


def test_keep_host_memory_really_reaches_glibc():
    from gpt2.run.device import keep_freed_memory

    assert keep_freed_memory() is sys.platform.startswith("linux")


@pytest.mark.parametrize("capability, expected",
                         [((7, 0), "fp16"), ((7, 5), "fp16"), ((8, 0), "bf16"), ((9, 0), "bf16")])
def test_auto_dtype_on_cuda_follows_compute_capability_not_emulated_bf16(monkeypatch, capability, expected):
    """V100 (7.0) and T4 (7.5) report is_bf16_supported() (emulation): auto must pick fp16 + GradScaler there."""
    from gpt2.run import device

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)
    warnings: list[str] = []
    assert device._dtype("auto", torch.device("cuda"), warnings, "train") == expected and not warnings
    device._dtype("bf16", torch.device("cuda"), warnings, "train")
    assert bool(warnings) == (expected == "fp16")  # bf16 asked on a pre-Ampere GPU: allowed, with a warning


def test_checkpoint_rng_holds_no_cuda_state_without_cuda(tmp_path):
    from gpt2.run import checkpoint

    states = checkpoint.rng_states()
    assert "cuda" not in states
    checkpoint.restore_rng_states({**states, "cuda": [torch.zeros(1)]})  # an older checkpoint's list: ignored


def test_sdpa_backend_switch_picks_the_kernel_or_says_why_it_cannot(tmp_path, tokens):
    from gpt2.core.errors import UserError
    from gpt2.train.trainer import train

    metrics = train(micro_params(sdpa_backend="math", max_steps=2), tokens, tmp_path / "a" / "c.pt", tmp_path / "a")
    assert metrics["runtime"]["sdpa_backend"] == "math"
    if not torch.cuda.is_available():
        with pytest.raises(UserError,
                           match="train.sdpa_backend efficient cannot run on .*set train.sdpa_backend: auto"):
            train(micro_params(sdpa_backend="efficient", max_steps=2), tokens, tmp_path / "b" / "c.pt", tmp_path / "b")


def test_bf16_on_a_cpu_is_warned_about_only_where_it_is_emulated(monkeypatch):
    from gpt2.run import device

    for native in (True, False):
        monkeypatch.setattr(device, "bf16_is_native", lambda where, native=native: native)
        warned = any("emulated" in w for w in device.runtime_for("cpu", "bf16").warnings)
        assert warned is not native


def test_loss_chunk_auto_runs_cache_sized_chunks_on_a_cpu_and_says_so(tokens):
    from gpt2.model.loss import chunk_rows

    auto = setup(tokens)  # params default: auto, 128 positions, or 512 on an AMD CPU
    assert auto.model.head.chunk == chunk_rows("auto", "cpu", 50304) in (128, 512)
    assert describe.what_runs(auto)["loss_chunk"] == auto.model.head.chunk
    assert setup(tokens, loss_chunk=0).model.head.chunk == 0 and setup(tokens, loss_chunk=40).model.head.chunk == 40


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this PyTorch build")
def test_cpu_gemm_switch_changes_the_head_s_and_the_blocks_kernels(tokens):
    """train.cpu_gemm onednn runs the training loss's three head matmuls (the logits and both gradients, done in
    forward) and the blocks' linear layers through oneDNN's linear, blas through aten::mm; the run says which one
    it used."""
    idx = torch.randint(0, 50257, (2, 16))
    onednn_calls, keys = {}, {}
    for gemm in ("blas", "onednn"):
        s = setup(tokens, cpu_gemm=gemm)
        assert describe.what_runs(s)["cpu_gemm"] == gemm and s.model.head.chunk >= 32  # one chunk
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            s.model(idx, idx)
        onednn_calls[gemm] = sum(e.count for e in prof.key_averages() if e.key == "mkldnn::_linear_pointwise")
        keys[gemm] = list(s.model.state_dict())
        layers = s.model.cfg.n_layer
    # the head's three, and each block's four linear layers (the blocks' gradients come in backward)
    assert onednn_calls == {"blas": 0, "onednn": 3 + 4 * layers}
    assert keys["onednn"] == keys["blas"]  # the same checkpoint either way


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this PyTorch build")
def test_a_run_says_cpu_gemm_onednn_is_inert_where_the_step_is_compiled(tokens):
    """oneDNN's path runs eager fp32 code only: a compiled step runs Inductor's matmuls, so the run must not
    report oneDNN (the ladder would credit a rung that changed nothing) and a set onednn is warned inert."""
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    compiled = setup(tokens, cpu_gemm="onednn", compile=True)
    assert describe.what_runs(compiled)["cpu_gemm"] == "inductor"
    assert any("train.cpu_gemm onednn is inert: the compiled step runs Inductor's matmuls" in w
               for w in describe.inert_switch_warnings(compiled))
    eager = setup(tokens, cpu_gemm="onednn")
    assert not any("cpu_gemm" in w for w in describe.inert_switch_warnings(eager))
    eager.model.set_head(dataclasses.replace(eager.model.head, gemm="blas"))  # as on a GPU: cpu_gemm picks nothing
    on_gpu = dataclasses.replace(eager, runtime=dataclasses.replace(eager.runtime, device=torch.device("cuda")))
    assert any("train.cpu_gemm onednn is inert: it picks a CPU's matmul library, and this run is on cuda" in w
               for w in describe.inert_switch_warnings(on_gpu))
