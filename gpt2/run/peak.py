"""A CPU's matmul peak, measured: what MFU divides by where no data sheet gives one.

A GPU's dense peak comes from its vendor (gpt2/run/flops.py). A CPU has no such figure that a
step could reach: its clock, cores, vector units and memory vary too much. So the peak is measured:
the best sustained throughput of a few large matmuls in fp32, and in bf16 where the CPU does bf16
in hardware (AVX512-BF16 or AMX), with the thread count the run uses. fp32 takes the faster of
PyTorch's two libraries, its BLAS (MKL) and oneDNN: on an AMD CPU with AVX-512, MKL's fp32 kernels
run at half the chip's rate, oneDNN's at all of it, and training uses oneDNN there
(``train.cpu_gemm``). It is measured once per CPU model, core count, thread count and torch
version, and kept in a small JSON file
(``~/.cache/gpt2-pipeline/matmul_peaks.json``, or ``$GPT2_PEAK_CACHE``). ``gpt2 peak`` measures it
again. A later measurement only raises the kept figure: one taken beside other work reads low, and
a lower peak would inflate every MFU divided by it. ``gpt2 peak --fresh`` forgets the kept figure
(the machine changed).

Three guards keep a peak read under load from standing. A measurement notes how busy the machine
was just before it (other processes' share of the cores); one taken under load is marked so, and
the next run measures again until a quiet measurement replaces it. And a run that reaches a higher
FLOP rate than the kept peak raises the kept peak to that rate (the run proves the CPU can do it),
so MFU never reads above 100%.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from gpt2.core.atomic import atomic_file, json_text
from gpt2.core.cpu import cpu_name
from gpt2.core.errors import UserError
from gpt2.run.device import bf16_is_native

# (M, K, N): a big square and two shapes of GPT-2's step (the MLP, the LM head on a 1024-row chunk)
SHAPES = ((2048, 2048, 2048), (4096, 768, 3072), (1024, 768, 50304))
SECONDS_PER_SHAPE = 0.3
CACHE_ENV = "GPT2_PEAK_CACHE"


def cache_path() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "gpt2-pipeline" / "matmul_peaks.json"


# Variables that cap the vector instructions PyTorch's, oneDNN's and MKL's kernels use (an AVX2 machine emulated on
# an AVX-512 one): a peak measured without them is not the peak with them.
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


def isa_caps() -> str:
    """The environment's caps on the CPU's vector instructions, e.g. ``ATEN_CPU_CAPABILITY=avx2``; '' for none."""
    return " ".join(f"{name}={os.environ[name]}" for name in ISA_CAPS if os.environ.get(name))


def cpu_label() -> str:
    """This CPU as a benchmark's header names it: its model, the caps on its vector instructions in force, and the
    cores this process may use (fewer than the machine's where its affinity is limited, e.g. ``taskset``)."""
    caps = isa_caps()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = f"{usable} cores" if usable == os.cpu_count() else f"{usable} of {os.cpu_count()} cores (affinity)"
    return f"{cpu_name()}{f' ({caps})' if caps else ''}, {cores}"


def machine_key(threads: int) -> str:
    key = f"{cpu_name()} | {os.cpu_count()} logical cores | {threads} threads | torch {torch.__version__}"
    caps = isa_caps()
    return f"{key} | {caps}" if caps else key


def matmul_flops(dtype: torch.dtype, shapes: tuple[tuple[int, int, int], ...] | None = None,
                 seconds_per_shape: float | None = None) -> float:
    """The best FLOP/s over ``shapes`` (SHAPES) and libraries (BLAS; oneDNN too in fp32, where the build has it):
    each one's median over repeats that fill ``seconds_per_shape`` (SECONDS_PER_SHAPE)."""
    from gpt2.model.loss import onednn_available, onednn_mm

    best = 0.0
    seconds_per_shape = SECONDS_PER_SHAPE if seconds_per_shape is None else seconds_per_shape
    for m, k, n in SHAPES if shapes is None else shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        out = torch.empty(m, n, dtype=dtype)
        kernels = [lambda: torch.mm(a, b, out=out)]
        if dtype == torch.float32 and onednn_available():
            kernels.append(lambda: onednn_mm(a, b.t()))
        for kernel in kernels:
            kernel()  # warm-up: thread pool, packing buffers, oneDNN's JIT
            times: list[float] = []
            started = time.perf_counter()
            while len(times) < 3 or time.perf_counter() - started < seconds_per_shape:
                tick = time.perf_counter()
                kernel()
                times.append(time.perf_counter() - tick)
            best = max(best, 2 * m * k * n / statistics.median(times))
    return best


LOADED = 0.25  # other processes busy on more than this share of the cores: a measurement beside them reads low


def busy_share(seconds: float = 0.3) -> float:
    """The share of the machine's cores other processes kept busy over ``seconds`` (this one sleeps)."""
    try:
        import psutil

        return psutil.cpu_percent(interval=seconds) / 100
    except ImportError:  # psutil is a dependency, but the library runs without an install on a GPU box
        return min(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def measure() -> dict[str, float | str | bool | None]:
    """This CPU's fp32 peak, and bf16's where it is native (None elsewhere), in FLOP/s, with how busy the
    machine was just before (``load``) and whether that was enough to spoil it (``under_load``)."""
    load = busy_share()
    bf16 = matmul_flops(torch.bfloat16) if bf16_is_native(torch.device("cpu")) else None
    return {"fp32": matmul_flops(torch.float32), "bf16": bf16, "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
            "load": round(load, 3), "under_load": load > LOADED}


def read_cache() -> dict:
    """The kept peaks by machine; an unreadable or foreign file reads as empty."""
    try:
        cached = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def keep(measured: dict[str, float | str | None], fresh: bool = False) -> dict[str, float | str | None]:
    """Keep ``measured`` for this machine, each dtype's figure raised to the kept one where that is higher
    (unless ``fresh``), and return what is kept. It stays marked ``under_load`` only while no quiet
    measurement was ever kept. A cache that cannot be written is left as it is."""
    cached, key = read_cache(), machine_key(torch.get_num_threads())
    kept = dict(measured)
    before = cached.get(key) if isinstance(cached.get(key), dict) and not fresh else {}
    for kind in ("fp32", "bf16"):
        earlier = before.get(kind)
        if isinstance(earlier, (int, float)) and earlier > (kept.get(kind) or 0):
            kept[kind] = earlier
    if before.get("fp32"):
        kept["under_load"] = bool(measured.get("under_load")) and bool(before.get("under_load"))
        if "raised_by_run" in before:
            kept["raised_by_run"] = before["raised_by_run"]
    _write(cached, key, kept)
    return kept


def raise_to_run(kind: str, flops: float) -> dict[str, float | str | None]:
    """A run on this CPU reached ``flops`` in ``kind`` (fp32 or bf16), above the kept peak: keep its rate as
    the peak, since the CPU has just done it. Returns the kept peaks."""
    cached, key = read_cache(), machine_key(torch.get_num_threads())
    kept = dict(cached.get(key) if isinstance(cached.get(key), dict) else {})
    if (kept.get(kind) or 0) < flops:
        kept[kind] = flops
        kept["raised_by_run"] = time.strftime("%Y-%m-%d %H:%M:%S")
        _write(cached, key, kept)
    return kept


def _write(cached: dict, key: str, kept: dict[str, float | str | None]) -> bool:
    """Whether the figures were kept: a read-only home or a full disk leaves them unkept (the next run measures
    again)."""
    try:
        with atomic_file(cache_path()) as temp:
            temp.write_text(json_text({**cached, key: kept}))
    except (OSError, UserError):
        return False
    return True


def kept_on_disk(kept: dict[str, float | str | None]) -> bool:
    """Whether ``kept`` is what the cache file now holds for this machine."""
    return read_cache().get(machine_key(torch.get_num_threads())) == json.loads(json_text(kept))


def cpu_peaks(may_measure: bool = True) -> tuple[dict[str, float | str | None] | None, bool]:
    """(this CPU's peaks at the current thread count, whether they were measured now): from the cache,
    else measured and kept; measured again while the kept one is marked ``under_load``. None when not
    cached and ``may_measure`` is false (a second rank of a run, which would measure beside the first
    and halve both figures). A cache that cannot be read or written is measured around, not an error."""
    cached = read_cache().get(machine_key(torch.get_num_threads()))
    if isinstance(cached, dict) and cached.get("fp32") and (not cached.get("under_load") or not may_measure):
        return cached, False
    if not may_measure:
        return None, False
    return keep(measure()), True
