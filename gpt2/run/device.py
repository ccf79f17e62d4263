"""Device honesty: what was asked for, what actually runs, and what is inert here.

``device: cuda`` on a machine without CUDA is an error, never a silent CPU
run. ``dtype: auto`` means bf16 on CUDA with bf16 support, fp16 (with a
GradScaler) on older CUDA, and fp32 on CPU: there bf16 is emulated and many times slower than fp32
without AVX512-BF16 or AMX, and a default that changed with the CPU would not repeat across
machines (docs/benchmarks.md measures both kinds of CPU).

It also reads the process's memory (``memory_gb``): what the device holds now and at its peak.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from dataclasses import dataclass, field

import torch

from gpt2.core.config import TrainConfig
from gpt2.core.cpu import cpu_name
from gpt2.core.errors import UserError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}


@dataclass
class Runtime:
    """The resolved execution settings, logged at start and tagged on the run."""

    device: torch.device
    device_name: str
    dtype: str  # fp32 | bf16 | fp16: what autocast really uses
    tf32: bool  # whether TF32 matmuls are enabled (CUDA only)
    keep_host_memory: bool = False  # whether glibc was told to keep big blocks (CPU on Linux only)
    sdpa: str = "auto"  # the attention kernel asked for (train.sdpa_backend); auto: the dispatcher's choice
    warnings: list[str] = field(default_factory=list)

    @property
    def autocast_dtype(self) -> torch.dtype:
        """The dtype matmuls run in (float32 for fp32, where autocast is off)."""
        return DTYPES[self.dtype]

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def attention(self) -> contextlib.AbstractContextManager:
        """Restrict scaled_dot_product_attention to the kernel asked for (no-op for auto)."""
        if self.sdpa == "auto":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[self.sdpa]))

    def synchronize(self) -> None:
        """Wait for queued device work, so that a clock read afterwards is honest."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            torch.mps.synchronize()


def resolve(cfg: TrainConfig) -> Runtime:
    """The training runtime, with a warning for each train switch that is inert here."""
    runtime = runtime_for(cfg.device, cfg.dtype, tf32=cfg.tf32, keep_host_memory=cfg.keep_host_memory,
                          sdpa=cfg.sdpa_backend)
    if cfg.fused_adamw and runtime.device.type == "mps":
        runtime.warnings.append("train.fused_adamw may be unsupported on mps; PyTorch falls back or errors")
    return runtime


def runtime_for(device: str, dtype: str, *, tf32: bool = True, keep_host_memory: bool = True, sdpa: str = "auto",
                section: str = "train") -> Runtime:
    """What ``device`` and ``dtype`` (``auto`` or named) resolve to here; TF32 on where it exists.

    ``section`` names the params section in warnings and errors (evaluate resolves its own)."""
    where = pick_device(device, f"{section}.device")
    warnings: list[str] = []
    resolved = _dtype(dtype, where, warnings, section)
    tf32 = tf32 and where.type == "cuda"
    if where.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        name = torch.cuda.get_device_name(where)
    else:
        name = cpu_name()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    kept = keep_host_memory and where.type == "cpu" and keep_freed_memory()
    if keep_host_memory and not kept:
        why = "it needs Linux with glibc" if where.type == "cpu" else "it acts on CPU work only"
        warnings.append(f"{section}.keep_host_memory is inert here: {why}")
    return Runtime(device=where, device_name=name, dtype=resolved, tf32=tf32, keep_host_memory=kept, sdpa=sdpa,
                   warnings=warnings)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> bool:
    """Tell glibc to serve big blocks from its heap and never give them back to the OS.

    By default glibc mmaps every block above a few MB and unmaps it on free, so a
    CPU training step that allocates ~1 GB of logits and their gradients pays for
    zero-filled page faults on all of it, every step (half the step time of the
    tiny model here: the "sys" time). Kept, the memory is reused; RSS stays at its peak.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        limit = 2**31 - 1  # mallopt takes an int
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, limit)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, limit))
    except (OSError, AttributeError):
        return False


def pick_device(asked: str, key: str = "train.device") -> torch.device:
    """``auto``: CUDA, else MPS, else the CPU. A device asked for by name must exist: never a silent CPU run."""
    if asked == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if asked == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{key} is cuda but this machine has no usable CUDA device "
                        f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); "
                        f"set {key}: auto or cpu, or install a CUDA build of torch")
    if asked == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"{key} is mps but MPS is not available here; set {key}: auto or cpu")
    return torch.device(asked)


def bf16_is_native(device: torch.device) -> bool:
    """bf16 matmuls in hardware on ``device``: a CUDA GPU of compute capability 8.0 (Ampere) or newer, a
    CPU with AVX512-BF16 or AMX. Elsewhere bf16 is emulated and slow. ``torch.cuda.is_bf16_supported()``
    also says yes on a V100 or T4; fp16 with a GradScaler is right there. The one rule for the dtype
    ``auto`` picks, Muon's orthogonalization and the CPU peaks MFU divides by."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type == "cpu":
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
    return False  # mps: bf16 support varies by chip; fp32 is never wrong


def dtype_for(asked: str, device: torch.device) -> str:
    """The dtype ``asked`` runs as on ``device``: ``auto`` is bf16 on a GPU that has it, fp16 on an older one,
    fp32 elsewhere."""
    if asked != "auto":
        return asked
    if device.type == "cuda":
        return "bf16" if bf16_is_native(device) else "fp16"
    return "fp32"


def _dtype(asked: str, device: torch.device, warnings: list[str], section: str) -> str:
    if asked == "auto":
        return dtype_for(asked, device)
    if device.type == "cpu" and asked == "bf16" and not bf16_is_native(device):
        warnings.append(f"{section}.dtype bf16 on a CPU without AVX512-BF16 or AMX: emulated, many times slower "
                        "than fp32")
    if device.type == "cpu" and asked == "fp16":
        warnings.append(f"{section}.dtype fp16 on CPU: emulated and slow; it exists for testing the GradScaler path")
    if device.type == "cuda" and asked == "bf16" and not bf16_is_native(device):
        warnings.append(f"{section}.dtype bf16 on a GPU older than Ampere (compute capability < 8.0): emulated and "
                        "slow; fp16 (dtype: auto) is the fast choice here")
    return asked


def sdpa_backend(runtime: Runtime, n_head: int, head_dim: int, seq_len: int) -> str:
    """The kernel that runs the ``flash`` path with these shapes and dtype.

    One of flash_attention, efficient_attention, cudnn_attention, overrideable or math
    (math means no fused kernel: slow, and a sign that shapes or dtype rule the others out).
    With ``train.sdpa_backend`` set, that kernel, after checking it can run here at all, forward and
    backward. The probe is laid out as the model's attention is (q, k and v strided views of one
    projection, needing gradients): the dispatcher's choice depends on strides and on autograd.
    """
    from torch.nn.attention import SDPBackend

    width = n_head * head_dim
    qkv = torch.zeros(1, seq_len, 3 * width, device=runtime.device, dtype=runtime.autocast_dtype, requires_grad=True)
    q, k, v = (t.view(1, seq_len, n_head, head_dim).transpose(1, 2) for t in qkv.split(width, dim=2))
    if runtime.sdpa != "auto":
        try:
            with runtime.attention():
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        except RuntimeError as exc:
            raise UserError(f"train.sdpa_backend {runtime.sdpa} cannot run on {runtime.device_name} in "
                            f"{runtime.dtype} with head size {head_dim} ({str(exc).splitlines()[0][:200]}); "
                            "set train.sdpa_backend: auto") from None
        return SDPA_BACKENDS[runtime.sdpa].lower()
    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, True)).name.lower()
    except (AttributeError, RuntimeError, ValueError):  # private API: absent in some builds
        return "unknown"


def memory_gb(runtime: Runtime) -> dict[str, float]:
    """Memory now and at its peak since ``reset_memory_peak``. CUDA: PyTorch's allocated and reserved
    bytes (reserved adds the caching allocator's free blocks). CPU: the process's resident set; its peak
    is the kernel's high-water mark, which sees a transient allocation that the end of a run no longer
    holds."""
    if runtime.device.type == "cuda":
        return {"mem/allocated_gb": torch.cuda.memory_allocated(runtime.device) / 1e9,
                "mem/peak_allocated_gb": torch.cuda.max_memory_allocated(runtime.device) / 1e9,
                "mem/peak_reserved_gb": torch.cuda.max_memory_reserved(runtime.device) / 1e9}
    return {"mem/rss_gb": rss_bytes() / 1e9, "mem/peak_rss_gb": peak_rss_bytes() / 1e9}


def reset_memory_peak() -> None:
    """Start the peaks afresh: a run's peak is its own, not that of an earlier run in the same process."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    try:
        with open("/proc/self/clear_refs", "w") as handle:  # Linux: "5" resets the peak resident set
            handle.write("5")
    except OSError:  # other systems: the peak since the process began
        pass


def peak_rss_bytes() -> int:
    """The process's peak resident set (children excluded)."""
    try:
        with open("/proc/self/status") as handle:
            return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux KiB


def rss_bytes() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:  # minimal environments: Linux's /proc
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
