"""The optional GPU levers alone, before a training uses them: FP8 on GPT-2 124M's MLP (torchao's and ours), and
Liger's fused linear + cross-entropy on its LM head, each against bf16 (docs/benchmarks.md, "GPT-2 124M on one
H100").

    pip install torchao liger-kernel   # optional, or carried as wheels to a box without network (docs/gpu.md)
    python3 benchmarks/gpu_levers.py

CUDA only. The MLP sees 16 × 1024 tokens of width 768 (3072 inside), forward and backward under bf16 autocast,
eager and compiled, FP8 with torchao's tensorwise and rowwise scaling and with ours (``train.fp8:
rowwise_fwd_dgrad``); the loss sees 16 × 1024 bf16 hidden states against the 50,304-row head, Liger's against
``F.cross_entropy`` on the whole logits (time and peak memory). Each figure is the mean of 10 calls after one
warm-up, timed with CUDA events.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project, run as copied (no install)


def bench(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(768, 3072), torch.nn.GELU(approximate="tanh"),
                               torch.nn.Linear(3072, 768)).cuda()


def fp8_mlp() -> None:
    """Each FP8 recipe against bf16, eager and compiled: torchao's (where it is installed) and ours."""
    from gpt2.model.fp8 import RowwiseFp8Linear

    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        print("torchao is not installed: its recipes are left out (pip install torchao)")
        convert_to_float8_training = None

    def ours(module: torch.nn.Module) -> None:
        for layer in (module[0], module[2]):
            layer.__class__ = RowwiseFp8Linear

    recipes = {"rowwise_fwd_dgrad (ours)": ours}
    if convert_to_float8_training is not None:
        recipes = {name: (lambda m, name=name: convert_to_float8_training(
            m, config=Float8LinearConfig.from_recipe_name(name))) for name in ("tensorwise", "rowwise")} | recipes
    for recipe, convert in recipes.items():
        for compiled in (False, True):
            low, ref = mlp(), mlp()
            ref.load_state_dict(low.state_dict())
            convert(low)
            x = torch.randn(16 * 1024, 768, device="cuda", requires_grad=True)
            low_run, ref_run = (torch.compile(low), torch.compile(ref)) if compiled else (low, ref)

            def step(module: torch.nn.Module) -> None:
                with torch.autocast("cuda", torch.bfloat16):
                    y = module(x)
                y.float().pow(2).mean().backward()

            with torch.autocast("cuda", torch.bfloat16):
                diff = (low_run(x).float() - ref_run(x).float()).abs().max().item()
            t_low, t_ref = bench(lambda: step(low_run)), bench(lambda: step(ref_run))
            print(f"float8 {recipe} compiled={compiled}: max|diff| {diff:.4f}; fwd+bwd {t_low:.3f} ms vs bf16 "
                  f"{t_ref:.3f} ms ({t_ref / t_low:.2f}x)")


def liger_head() -> None:
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    n, d, v = 16 * 1024, 768, 50304
    hidden = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(v, d, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    targets = torch.randint(0, 50257, (n,), device="cuda")
    fused_loss = LigerFusedLinearCrossEntropyLoss()

    def fused() -> torch.Tensor:
        loss = fused_loss(weight, hidden, targets)
        loss.backward()
        return loss

    def plain() -> torch.Tensor:
        loss = F.cross_entropy((hidden @ weight.t()).float(), targets)
        loss.backward()
        return loss

    fused_value, plain_value = fused().item(), plain().item()
    torch.cuda.reset_peak_memory_stats()
    t_fused, gb_fused = bench(fused), torch.cuda.max_memory_allocated() / 1e9
    torch.cuda.reset_peak_memory_stats()
    t_plain, gb_plain = bench(plain), torch.cuda.max_memory_allocated() / 1e9
    print(f"liger fused linear+CE: loss {fused_value:.5f} vs {plain_value:.5f}; {t_fused:.3f} ms ({gb_fused:.2f} GB) "
          f"vs plain {t_plain:.3f} ms ({gb_plain:.2f} GB)")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("error: gpu_levers.py measures CUDA kernels and this machine has no CUDA device")
    torch.manual_seed(0)
    print("torch", torch.__version__, "compute capability", torch.cuda.get_device_capability())
    fp8_mlp()
    try:
        liger_head()
    except ImportError:
        print("liger-kernel is not installed: its loss is left out (pip install liger-kernel)")


if __name__ == "__main__":
    main()
