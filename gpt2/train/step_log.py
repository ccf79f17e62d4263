"""Step timing, sync points and the record of each log step.

Between sync points the loop reads nothing from the GPU: losses stay on the device, each step's
start is a CUDA event (``StepTimer``), and both are read together at the next sync point (a log,
eval or checkpoint step), where NaN losses and stop signals are checked across ranks in one
all-reduce. Off CUDA a sync costs nothing, so every step is one.

A log step builds one record, ``{"train/loss": …, "perf/step_ms": …, "mem/rss_gb": …}``, and hands
it to every sink: the history (plots and summary), MLflow, and the console line.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

from gpt2.core import log
from gpt2.core.errors import Diverged
from gpt2.core.progress import clock
from gpt2.run import machine_load
from gpt2.run.device import Runtime, memory_gb
from gpt2.run.mfu import raised
from gpt2.run.tracking import Tracker
from gpt2.train import distributed
from gpt2.train.build import Setup
from gpt2.train.length import Budget, Steps
from gpt2.train.history import History

logger = log.get("train")


class StepTimer:
    """Step times that do not stall the GPU.

    Reading a clock honestly needs the device's queue drained first; doing that at every step leaves
    the GPU idle while the host launches the next step. On CUDA each step's start is instead marked
    with an event in the stream, and the events are read only at the loop's sync points (log, eval and
    checkpoint steps): the time between two step starts on the GPU's own timeline is that step's time,
    host stalls and compilation included, and the GPU never waits for the host to look. Other devices
    synchronize at each mark (there the sync costs nothing)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.cuda = runtime.device.type == "cuda"
        self.marks: list[torch.cuda.Event | float] = []

    def mark(self) -> None:
        """At each step's start, and once more after the last step before ``durations``."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.runtime.synchronize()
            self.marks.append(time.perf_counter())

    def durations(self) -> list[float]:
        """Seconds of each step marked since the last call; waits for the device once."""
        marks, self.marks = self.marks, []
        if len(marks) < 2:
            return []
        if self.cuda:
            marks[-1].synchronize()
            return [start.elapsed_time(end) / 1000 for start, end in zip(marks, marks[1:])]
        return [end - start for start, end in zip(marks, marks[1:])]


RISEN = 0.5  # nats above the run's best logged loss: a checkpoint saved there may hold the divergence's start


def what_helps(s: Setup, history: History, saved_step: int | None) -> str:
    """Advice for a diverged run: what this run can change (bf16 only where it trains in fp16), and whether its last
    checkpoint is worth resuming. One saved where the logged loss had already risen well above the run's best holds
    weights and optimizer moments on their way out: resumed, with any learning rate, it tends to diverge again."""
    clip = "a lower train.grad_clip" if s.params.train.grad_clip else "train.grad_clip (it is off)"
    fp16 = ", or train.dtype bf16 instead of fp16" if s.runtime.dtype == "fp16" else ""
    change = f"a lower train.lr or {clip}{fp16}"
    logged = [r for r in history.train if saved_step is not None and r["step"] <= saved_step and "train/loss" in r]
    if saved_step is None:
        return f"start again with {change}"
    if logged:
        best, last = min(logged, key=lambda r: r["train/loss"]), logged[-1]
        if last["train/loss"] > best["train/loss"] + RISEN:
            return (f"that checkpoint's loss had already risen ({last['train/loss']:.3f} at step {last['step']}, from "
                    f"{best['train/loss']:.3f} at step {best['step']}), so resuming from it may diverge again: start "
                    f"afresh with {change} (train.resume: never)")
    return f"resume it with {change}"


def sync_every_step(runtime: Runtime) -> bool:
    """Off CUDA a sync costs nothing: check losses and signals after every step there."""
    return runtime.device.type != "cuda"


class StepLog:
    """Owns the step clock, the losses not yet read, and when to log."""

    def __init__(self, s: Setup, history: History, tracker: Tracker, last_checkpoint: Callable[[], str],
                 saved_step: Callable[[], int | None], length: Steps | Budget, first_step: int = 0) -> None:
        self.s, self.cfg, self.history, self.tracker, self.length = s, s.params.train, history, tracker, length
        self.throughput = s.throughput  # raised where the run goes faster than its peak (gpt2/run/mfu.py)
        self.warm_until = first_step + self.cfg.timing_warmup_steps  # this session's untimed steps end here
        self.session_start = len(history.step_s)
        history.sessions.append(self.session_start)
        self.last_checkpoint = last_checkpoint  # named in the error when the loss diverges (settles the write)
        self.saved_step = saved_step
        self.timer = StepTimer(s.runtime)
        self.train_s = history.train_s  # this rank's training time, kept as a running sum (read at every sync)
        self.every_step = sync_every_step(s.runtime)
        self.pending: list[torch.Tensor] = []  # losses of the steps since the last sync point
        self.synced = False
        self.steady_from: tuple[int, float] | None = None  # the sync point (step, clock) the steady state counts from
        self.cpu_from: machine_load.CpuClock | None = None  # the machine's CPU clock at that sync point
        self.recent_load = machine_load.tally()  # since the last log step: the log line's and MLflow's figure
        self.load_warned = False

    def step_started(self) -> None:
        self.timer.mark()
        self.s.compile_watch.enter("train")  # compilations after the first step are recompilations

    def step_done(self, loss: torch.Tensor, fp16_skipped: bool) -> None:
        self.s.compile_watch.leave()
        self.pending.append(loss)
        self.history.fp16_skipped += fp16_skipped

    def due(self, step: int, last: bool) -> bool:
        """A log step: the first, every ``log_interval``-th and the last."""
        return step % self.cfg.log_interval == 0 or last or step == 1

    def must_sync(self, step: int) -> bool:
        """Whether the step times and losses must be read now (the loop also syncs for evals and checkpoints)."""
        return self.every_step or self.due(step, False) or step == self.warm_until

    def sync(self, step: int, stop_here: bool) -> bool:
        """Read the pending step times and losses; raise if a loss is not finite. Returns whether any
        rank was asked to stop. Every rank calls this at the same steps; they agree on the training time here."""
        self.timer.mark()
        durations = self.timer.durations()
        self.history.step_s.extend(durations)
        self.train_s += sum(durations)
        self.losses, stopping, spent_s = distributed.step_consensus(self.pending, stop_here, self.train_s,
                                                                    self.s.dist)
        self.length.agree(step, spent_s)
        self.count_steady(step, time.perf_counter())  # the device is synchronized: the losses were read
        first = step - len(self.pending) + 1
        self.pending.clear()
        bad = next((i for i, value in enumerate(self.losses) if not math.isfinite(value)), None)
        if bad is not None:
            saved = self.last_checkpoint()
            raise Diverged(f"loss is {self.losses[bad]} at step {first + bad}: training diverged; last checkpoint: "
                           f"{saved}; {what_helps(self.s, self.history, self.saved_step())}")
        if not self.synced:
            distributed.set_step_deadline(self.cfg, self.s.dist)  # the first sync point: compilation is done
            self.synced = True
        if step == self.warm_until:  # this session's warm-up
            session = self.history.step_s[self.session_start:self.session_start + self.cfg.timing_warmup_steps]
            n = len(self.history.sessions)  # one figure per session: a tag, not a one-point chart
            self.tracker.set_tags({"perf.warmup_s" + (f".session_{n}" if n > 1 else ""): round(sum(session), 3)})
        return stopping

    def count_steady(self, step: int, now: float) -> None:
        """Add the steps and wall time since the last sync point to the steady state, which begins at the
        first sync point after the warm-up steps (in a resumed session: its first sync point)."""
        cpu = machine_load.read() if self.steady_from is not None or step >= self.warm_until else None
        if self.steady_from is not None:
            self.history.steady_steps += step - self.steady_from[0]
            self.history.steady_s += now - self.steady_from[1]
            for counts in (self.history.load, self.recent_load):  # how busy other work kept the cores meanwhile
                machine_load.add(counts, self.cpu_from, cpu)
        if self.steady_from is not None or step >= self.warm_until:
            self.steady_from, self.cpu_from = (step, now), cpu

    def set_aside(self, seconds: float) -> None:
        """Leave ``seconds`` (the first eval's compilation) out of the steady state: a warm-up, counted apart."""
        if seconds and self.steady_from is not None:
            self.history.steady_s -= seconds
            self.history.eval_warmup_s += seconds
            self.cpu_from = machine_load.read()  # the compilation's workers would read as other work: count after it

    def log(self, step: int, grad_norm: torch.Tensor) -> None:
        """One record for this step, to the history, MLflow and the console. The learning rates are the
        ones the optimizers held for this step: AdamW's (``train/lr``), and Muon's (``train/muon_lr``)."""
        s = self.s
        lr = s.optimizers[-1].param_groups[0]["lr"]  # AdamW comes last (train/optim.py)
        record = {"train/loss": self.losses[-1], "train/lr": lr, "train/grad_norm": float(grad_norm)}
        if self.cfg.optimizer == "muon":
            record["train/muon_lr"] = s.optimizers[0].param_groups[0]["lr"]
        # warm-up steps (compilation, autotuning) stay out of the speed series: one 30 s step would flatten
        # every plot of step time; their total is its own figure, the tag perf.warmup_s
        dt = self.history.step_s[-1]
        tokens_per_s = self.throughput.tokens_per_s(dt)
        if step > self.warm_until and (faster := raised(self.throughput, tokens_per_s, s.runtime.dtype)):
            self.throughput, warning = faster
            logger.warning(warning)
        utilization, own = self.throughput.mfu(tokens_per_s), self.throughput.mfu_dtype(tokens_per_s)
        if step > self.warm_until:
            record |= {"perf/step_ms": 1000 * dt, "perf/tokens_per_s": tokens_per_s,
                       "perf/tokens_per_s_per_device": tokens_per_s / s.dist.world, "perf/mfu": utilization}
            if own is not None:
                record["perf/mfu_dtype"] = own
        if (load := machine_load.figures(self.recent_load)) is not None:
            record |= {f"machine/{k}": v for k, v in load.items()}
            self.recent_load = machine_load.tally()
            if not self.load_warned and (warning := machine_load.warning(load)):
                logger.warning(warning.replace("while it was timed", "since the last log step"))
                self.load_warned = True
        if s.scaler.is_enabled():  # fp16: steps GradScaler skipped after an overflow (always 0 otherwise)
            record["perf/fp16_skipped_steps"] = self.history.fp16_skipped
        record |= memory_gb(s.runtime)
        self.history.train.append({"step": step, **record})
        self.tracker.log_metrics(record, step=step)
        # the session's warm-up steps hold the compile and the first allocations (minutes under compile): the ETA
        # reads the steps past them once there are any, the steps after the first before, and no step alone
        # (a time budget's ETA is the budget left, known from the start)
        session = self.history.step_s[self.session_start:]
        later = session[self.cfg.timing_warmup_steps:] or session[1:]
        eta = (f" | ETA {clock(self.length.eta_s(step, statistics.median(later[-20:]) if later else 0.0))}"
               if later or isinstance(self.length, Budget) else "")
        shown = f" | MFU {100 * utilization:.1f}%" if utilization is not None else ""
        kind = "tf32" if s.runtime.dtype == "fp32" and s.runtime.tf32 else s.runtime.dtype
        shown += f" ({100 * own:.0f}% of the {kind} peak)" if own is not None else ""
        logger.info(f"step {self.length.shown(step)} | loss {record['train/loss']:.4f} | lr {lr:.2e} | "
                    f"norm {record['train/grad_norm']:.2f} | {1000 * dt:.0f} ms | {tokens_per_s / 1000:.1f}K tok/s"
                    f"{shown}{eta}")
