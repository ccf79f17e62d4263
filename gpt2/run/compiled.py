"""Graph breaks and recompilations: how often torch.compile fell back to Python or built a graph again.

Either makes a compiled run slower than it should be, silently: a graph break splits the step into
pieces run one after another with Python in between, and a recompilation (a guard that failed,
shapes that changed) spends compile time again in the middle of training. The watch counts both
for one run, so every summary, MLflow run and benchmark row can say "0 and 0" or be flagged.

A recompilation is a compilation in a phase (the training step, the evaluation) after that phase's
first call: the first eval compiles its own graph (no gradients, eval mode) by design, later ones
should not. The counters are Dynamo's (``torch._dynamo.utils.counters`` and the per-frame
compilation count); ``TORCH_LOGS=graph_breaks,recompiles`` prints where and why.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any


def compile_options(mode: str, tuning: bool) -> dict[str, Any]:
    """torch.compile's keyword arguments for ``train.compile_mode`` and ``train.compile_tuning``: the mode, or with
    the tuning the mode's Inductor options plus coordinate-descent tuning (torch.compile takes a mode or options,
    not both)."""
    named = None if mode == "default" else mode
    if not tuning:
        return {"mode": named}
    import torch._inductor

    options = dict(torch._inductor.list_mode_options(named)) if named else {}
    return {"options": {**options, "coordinate_descent_tuning": True}}


@contextmanager
def compile_caches(compile: bool, cache: bool) -> Iterator[None]:
    """Inductor's on-disk caches on (``cache``) or off for one compiled run, restored after it.

    With them a later run of the same graph skips most of compile's warm-up (docs/benchmarks.md,
    "Compile start-up"). PyTorch keeps AOTAutograd's cache off for graphs that hold a custom
    ``autograd.Function``, such as the chunked loss; Dynamo traces its forward and backward into
    the graph that the cache key hashes, so it is allowed here.
    Off, every run pays a cold compile: the figure to compare when compile's own cost matters
    (time to a target counts the warm-up). Nothing happens without ``compile``.

    A run whose vector instructions are capped (``ATEN_CPU_CAPABILITY``, as docs/benchmarks.md does to
    emulate an AVX2 CPU) keeps its caches in a folder of its own. Inductor's cache key leaves the cap
    out, and its CPU code is written for one vector width: a graph cached under ``avx2`` and reused
    without the cap is compiled for AVX-512's wider vectors and writes past its buffers (torch 2.13
    and 2.14: heap corruption, or wrong values the other way round).
    """
    with ExitStack() as stack:
        if compile:
            import torch._functorch.config as functorch_config
            import torch._inductor.config as inductor_config

            stack.enter_context(inductor_config.patch(fx_graph_cache=cache))
            stack.enter_context(functorch_config.patch(enable_autograd_cache=cache,
                                                       autograd_cache_allow_custom_autograd_functions=cache))
            if cache and (capability := os.environ.get("ATEN_CPU_CAPABILITY")):
                from torch._inductor.runtime.cache_dir_utils import cache_dir, temporary_cache_dir

                stack.enter_context(temporary_cache_dir(os.path.join(cache_dir(), f"capped_{capability}")))
        yield


def compilations() -> int:
    """Frames Dynamo has compiled in this process, recompilations included."""
    from torch._dynamo import convert_frame

    return sum(getattr(convert_frame, "FRAME_COMPILE_COUNTER", {}).values())


def graph_break_reasons() -> dict[str, int]:
    """Each graph break's reason (its first line) and how many times it happened in this process."""
    from torch._dynamo.utils import counters

    reasons: dict[str, int] = {}
    for text, count in counters["graph_break"].items():
        first = str(text).strip().splitlines()[0] if str(text).strip() else "unknown"
        reasons[first] = reasons.get(first, 0) + count
    return reasons


def flag(figures: dict) -> str:
    """'2 graph breaks, 1 recompilation' for a run that had any (from its summary's runtime), else ''."""
    parts = [f"{n} {what}{'s' if n > 1 else ''}" for n, what in ((figures.get("graph_breaks"), "graph break"),
                                                                 (figures.get("recompiles"), "recompilation")) if n]
    return ", ".join(parts)


class CompileWatch:
    """Counts one run's graph breaks and recompilations (from when it is made); inert without compile."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.recompiles = 0
        self.seen: set[str] = set()
        self.current: tuple[str, int] | None = None  # the phase entered, and the compilations before it
        self.breaks_before = graph_break_reasons() if enabled else {}

    def enter(self, name: str) -> None:
        """A call of phase ``name`` begins: compilations until ``leave`` after its first call are recompilations."""
        if self.enabled:
            self.current = (name, compilations())

    def leave(self) -> None:
        if self.current is None:
            return
        name, before = self.current
        if name in self.seen:
            self.recompiles += compilations() - before
        self.seen.add(name)
        self.current = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.enter(name)
        try:
            yield
        finally:
            self.leave()

    def graph_breaks(self) -> dict[str, int]:
        now = graph_break_reasons()
        return {k: n - self.breaks_before.get(k, 0) for k, n in now.items() if n > self.breaks_before.get(k, 0)}

    def figures(self) -> dict[str, int | None]:
        """``graph_breaks`` and ``recompiles`` of this run so far; None for both without compile."""
        if not self.enabled:
            return {"graph_breaks": None, "recompiles": None}
        return {"graph_breaks": sum(self.graph_breaks().values()), "recompiles": self.recompiles}

    def complaint(self) -> str | None:
        """One line for the log when the run had a graph break or a recompilation, else None."""
        figures = self.figures()
        if not figures["graph_breaks"] and not figures["recompiles"]:
            return None
        breaks = self.graph_breaks()
        first = f" (first: {next(iter(breaks))})" if breaks else ""
        return (f"torch.compile: {figures['graph_breaks']} graph break(s){first} and {figures['recompiles']} "
                "recompilation(s) in this run: each costs speed; TORCH_LOGS=graph_breaks,recompiles shows "
                "where and why")
