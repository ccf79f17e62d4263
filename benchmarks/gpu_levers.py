"""The optional GPU levers alone, before a training uses them: FP8's matmuls on GPT-2 124M's shapes, the attention
kernels, FP8 on its MLP (torchao's recipes and ours), and Liger's fused linear + cross-entropy on its LM head
(docs/benchmarks.md, "GPT-2 124M on one H100").

    pip install torchao liger-kernel   # optional, or carried as wheels to a box without network (docs/gpu.md)
    python3 benchmarks/gpu_levers.py                 # every part
    python3 benchmarks/gpu_levers.py gemms fp8-mlp   # some: gemms, attention, fp8-mlp, liger
    python3 benchmarks/gpu_levers.py gemms attention --json out/levers.json  # the tables' rows also as JSON

CUDA only. ``gemms`` times each of GPT-2 124M's matmul shapes (64 × 1024 positions) in bf16 and in FP8 with
one scale per tensor and one per row: what FP8 can buy before its casts. ``attention``: every attention kernel
this box has (SDPA's flash, cuDNN and memory-efficient backends, FlashAttention-3 and -4 where a package
provides them, FlexAttention compiled) on GPT-2 124M's causal attention at 64 × 1024 positions, forward and
backward, each checked against the math backend. ``fp8-mlp``: the MLP sees 16 × 1024 tokens of width 768
(3072 inside), forward and backward under bf16 autocast, eager and compiled, FP8 with torchao's tensorwise and
rowwise scaling and with ours (``train.fp8: rowwise_fwd_dgrad``). ``liger``: the loss sees 16 × 1024 bf16
hidden states against the 50,304-row head, Liger's against ``F.cross_entropy`` on the whole logits (time and
peak memory). Each figure is the mean of 10 calls after one warm-up, timed with CUDA events.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project, run as copied (no install)


def bench(fn, reps: int = 10, device: str = "cuda") -> float:
    """Milliseconds per call: CUDA events on a GPU, the host's clock elsewhere (the CPU smoke test)."""
    fn()
    if device != "cuda":
        started = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - started) * 1000 / reps
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def attention(device: str = "cuda", batch: int = 64, heads: int = 12, seq: int = 1024, head_dim: int = 64
              ) -> list[dict]:
    """The attention's share of the step is the kernel's rate at this shape: causal, d = 64, T = 1024, q, k and v
    views of the packed qkv projection as the model makes them. One row per kernel: forward alone, the backward
    (forward and backward, less the forward), and how far its output and input gradient are from the math
    backend's. FLOPs as the profile counts them: 2·B·H·T²·d forward (the causal half of four matmul-passes' worth),
    2.5 times that backward. Returns the rows: each kernel's milliseconds and differences, or why it is unavailable."""
    from torch.nn.attention import SDPBackend

    qkv = torch.randn(batch, seq, 3, heads, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    grad_out = torch.randn(batch, heads, seq, head_dim, device=device, dtype=torch.bfloat16)
    forward_flop = 2 * batch * heads * seq * seq * head_dim

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    kernels = {"math (reference)": (sdpa, SDPBackend.MATH), "flash (SDPA)": (sdpa, SDPBackend.FLASH_ATTENTION),
               "cuDNN (SDPA)": (sdpa, SDPBackend.CUDNN_ATTENTION),
               "memory-efficient (SDPA)": (sdpa, SDPBackend.EFFICIENT_ATTENTION),
               "FA3 (SDPA's flash backend)": (sdpa, "FA3"), "FA4 (SDPA's flash backend)": (sdpa, "FA4"),
               "FlexAttention (compiled)": (flex(q, k, v), None)}

    def gradient(run):
        qkv.grad = None
        run().backward(grad_out)
        return qkv.grad

    with kernel(SDPBackend.MATH):
        with torch.no_grad():
            reference = sdpa()
        reference_grad = gradient(sdpa).clone()
    print(f"| kernel (B {batch}, H {heads}, T {seq}, d {head_dim}, causal, bf16) | forward ms (TFLOP/s) | "
          "backward ms (TFLOP/s) | max abs diff: output, input gradient |")
    print("|---|---|---|---|")
    rows = []
    for name, (run, backend) in kernels.items():
        try:
            with kernel(backend):
                with torch.no_grad():
                    diff = (run() - reference).abs().max().item()
                    fwd = bench(run, device=device)
                grad_diff = (gradient(run) - reference_grad).abs().max().item()
                bwd = bench(lambda: gradient(run), device=device) - fwd
        except Exception as exc:  # a kernel this box or this shape lacks: say which and why
            why = str(exc).strip().splitlines()[0][:100]
            print(f"| {name} | unavailable: {why} | | |", flush=True)
            rows.append({"kernel": name, "unavailable": why})
            continue
        rates = forward_flop / fwd / 1e9, 2.5 * forward_flop / bwd / 1e9
        print(f"| {name} | {fwd:.3f} ({rates[0]:.0f}) | {bwd:.3f} ({rates[1]:.0f}) | {diff:.4f}, {grad_diff:.4f} |",
              flush=True)
        rows.append({"kernel": name, "forward_ms": fwd, "backward_ms": bwd, "output_diff": diff,
                     "gradient_diff": grad_diff})
    return rows


@contextlib.contextmanager
def kernel(backend):
    """SDPA restricted to one backend; "FA3" or "FA4": FlashAttention's Hopper or Blackwell kernels put behind the
    flash backend by torch's registry (torch 2.13 has it; the package that brings the kernels is separate)."""
    from torch.nn import attention

    if backend is None:
        yield
    elif isinstance(backend, str):
        if not hasattr(attention, "activate_flash_attention_impl"):
            raise RuntimeError(f"torch {torch.__version__} has no registry of FlashAttention implementations")
        attention.activate_flash_attention_impl(backend)
        try:
            with attention.sdpa_kernel([attention.SDPBackend.FLASH_ATTENTION]):
                yield
        finally:
            attention.restore_flash_attention_impl()
    else:
        with attention.sdpa_kernel([backend]):
            yield


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """FlexAttention's Triton kernels, generated by compile for a causal block mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def causal(batch, head, query, key):
        return query >= key

    mask = create_block_mask(causal, None, None, q.size(2), k.size(2), device=q.device.type)
    compiled = torch.compile(flex_attention)
    return lambda: compiled(q, k, v, block_mask=mask)


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(768, 3072), torch.nn.GELU(approximate="tanh"),
                               torch.nn.Linear(3072, 768)).cuda()


def fp8_mlp() -> None:
    """Each FP8 recipe against bf16, eager and compiled: torchao's (where it is installed) and ours."""
    from gpt2.model.fp8 import to_own_recipe

    def ours(module: torch.nn.Module) -> None:
        for layer in (module[0], module[2]):
            to_own_recipe(layer, torch.device("cuda"))

    recipes = {}
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        for name in ("tensorwise", "rowwise"):
            recipes[name] = functools.partial(convert_to_float8_training,
                                              config=Float8LinearConfig.from_recipe_name(name))
    except ImportError:
        print("torchao is not installed: its recipes are left out (pip install torchao)")
    recipes["rowwise_fwd_dgrad (ours)"] = ours
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


# GPT-2 124M's matmul shapes at 64 × 1024 positions (M × K × N, the output M × N): what FP8's kernels buy on each
GEMMS = {
    "MLP c_fc forward, c_proj input gradient": (65536, 768, 3072),
    "MLP c_proj forward, c_fc input gradient": (65536, 3072, 768),
    "attention qkv forward": (65536, 768, 2304),
    "attention qkv input gradient": (65536, 2304, 768),
    "attention c_proj, forward and input gradient": (65536, 768, 768),
    "LM head logits, one 8,192-row chunk": (8192, 768, 50304),
    "LM head hidden-state gradient, one chunk": (8192, 50304, 768),
}


def fp8_gemms(device: str = "cuda", shapes: dict[str, tuple[int, int, int]] = GEMMS) -> list[dict]:
    """Each shape's matmul in bf16 (cuBLAS) and from e4m3 operands with one scale per tensor (cuBLAS) and one per
    row (CUTLASS's rowwise kernel), fast accumulation on, bf16 out: the ceiling of what each FP8 recipe can buy
    before its casts. Returns the rows: each shape's milliseconds per kernel (None where it failed)."""
    e4m3 = torch.float8_e4m3fn
    print("| shape (M × K × N) | bf16 ms (TFLOP/s) | FP8 tensorwise | FP8 rowwise |")
    print("|---|---|---|---|")
    table = []
    for name, (m, k, n) in shapes.items():
        a, b = (torch.randn(rows, k, device=device).to(torch.bfloat16) for rows in (m, n))
        a8, b8 = a.to(e4m3), b.to(e4m3)
        one = torch.ones((), device=device)
        rows, cols = torch.ones(m, 1, device=device), torch.ones(1, n, device=device)
        flop = 2 * m * k * n
        cells, times = [], []
        for call in (lambda: a @ b.t(),
                     lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                              use_fast_accum=True),
                     lambda: torch._scaled_mm(a8, b8.t(), scale_a=rows, scale_b=cols, out_dtype=torch.bfloat16,
                                              use_fast_accum=True)):
            try:
                ms = bench(call, device=device)
                cells.append(f"{ms:.3f} ({flop / ms / 1e9:.0f})")
                times.append(ms)
            except RuntimeError as exc:
                cells.append(f"failed: {str(exc).splitlines()[0][:80]}")
                times.append(None)
        print(f"| {name}: {m:,} × {k:,} × {n:,} | " + " | ".join(cells) + " |", flush=True)
        table.append({"shape": name, "m": m, "k": k, "n": n, "bf16_ms": times[0], "tensorwise_ms": times[1],
                     "rowwise_ms": times[2]})
    return table


PARTS = {"gemms": fp8_gemms, "attention": attention, "fp8-mlp": fp8_mlp, "liger": liger_head}


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description="the optional GPU levers alone, on GPT-2 124M's shapes")
    parser.add_argument("parts", nargs="*", metavar="PART", help=f"some of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--json", type=Path, help="also write the gemms and attention tables' rows here")
    args = parser.parse_args(argv)
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        sys.exit(f"error: unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if not torch.cuda.is_available():
        sys.exit("error: gpu_levers.py measures CUDA kernels and this machine has no CUDA device")
    torch.manual_seed(0)
    print("torch", torch.__version__, "compute capability", torch.cuda.get_device_capability(),
          torch.cuda.get_device_name())
    out: dict = {"device": torch.cuda.get_device_name(), "torch": str(torch.__version__)}
    for part in args.parts or list(PARTS):
        try:
            out[part] = PARTS[part]()
        except ImportError as exc:
            print(f"{part}: {exc.name} is not installed: left out (pip install {exc.name})")
        if args.json is not None:  # each table the moment it is measured: a job stopped midway keeps the first
            partial = args.json.with_name(args.json.name + ".partial")
            partial.write_text(json.dumps({k: v for k, v in out.items() if v is not None}, indent=1))
            partial.replace(args.json)  # whole or not at all: a reader never sees half a file


if __name__ == "__main__":
    main()
