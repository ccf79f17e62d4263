"""How exactly a run repeats: the CPU thread count and PyTorch's deterministic kernels.

A CPU result depends on the intra-op thread count: each thread sums its own slice of a matmul
or a reduction, so another count adds in another order and changes the last digits. PyTorch's
default count is the machine's physical cores, which does not move with the load, so two runs
on one idle or busy machine already agree bit for bit (tests/test_train.py checks it).
``train.deterministic`` makes that a promise on CUDA too: the kernels that add with atomics (some
backward passes, cuBLAS's split-K with a shared workspace) are replaced by ordered ones. It leaves
the thread count alone: ``train.threads`` fixes that. Its cost is in docs/benchmarks.md.

Both settings are process-wide in PyTorch; ``reproducible`` restores them when the run ends,
so a benchmark or a test that trains in-process leaves the next run as it found it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# the fixed workspace cuBLAS needs to be deterministic (its docs, "Results reproducibility")
CUBLAS_WORKSPACE = ":4096:8"


@contextmanager
def reproducible(threads: int, deterministic: bool) -> Iterator[int]:
    """Run with ``threads`` intra-op threads (0: PyTorch's default) and, if asked, deterministic kernels.

    Yields the thread count in force, which the run logs: it is part of what a CPU result depends on."""
    fill = torch.utils.deterministic
    before = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.benchmark,
              torch.backends.cudnn.deterministic, os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
              fill.fill_uninitialized_memory)
    if threads:
        torch.set_num_threads(threads)
    if deterministic:
        # Read when cuBLAS makes its first handle, which the run's first matmul does: early enough here.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
        # PyTorch would also fill every fresh torch.empty with NaN, a guard for code that reads memory
        # it never wrote; this code writes before it reads, and the fill is a pass over every new buffer.
        fill.fill_uninitialized_memory = False
    try:
        yield torch.get_num_threads()
    finally:
        n, enabled, warn_only, benchmark, cudnn_det, workspace, fill.fill_uninitialized_memory = before
        torch.set_num_threads(n)
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = benchmark, cudnn_det
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
