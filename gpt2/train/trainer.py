"""The training loop. Read ``fit`` top to bottom: it is the whole of a training step and its schedule.

Each concern around the step is a component that owns its schedule and state:

- ``StepLog`` (train/step_log.py): step timing, sync points, the record of each log step and its sinks;
- ``Evaluator`` (train/evaluator.py): val loss every ``eval_interval`` steps, time to a target loss;
- ``Checkpointer`` (train/saving.py): when to save, the background writer, the last good step;
- ``stop_on_signals`` (train/signals.py): Ctrl-C and SIGTERM end the run after a saved step.

Around the loop, ``train`` builds the run (train/build.py) and ``session`` runs one session of it:
where it starts (train/resume.py), what it says and tracks (train/describe.py), the copy kept if it
is interrupted (train/interrupted.py), and its summary and reports (train/reports.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from gpt2.core import log, paths
from gpt2.core.cli import interrupt_pending
from gpt2.core.config import Params
from gpt2.core.errors import Stopped, Terminated
from gpt2.run import checkpoint
from gpt2.run.compiled import compile_caches
from gpt2.run.device import reset_memory_peak
from gpt2.run.flops import Throughput
from gpt2.run.tracking import Tracker
from gpt2.train import describe, distributed, resume
from gpt2.train.build import Setup, build
from gpt2.train.determinism import reproducible
from gpt2.train.evaluator import Evaluator
from gpt2.train.history import History
from gpt2.train.interrupted import kept_if_interrupted
from gpt2.train.length import length_of
from gpt2.train.oom import is_cpu_out_of_memory, out_of_memory_error
from gpt2.train.optim import lr_at, set_lr
from gpt2.train.reports import run_summary
from gpt2.train.saving import Checkpointer
from gpt2.train.processes import stop_with_parent
from gpt2.train.signals import StopVote, TrainingInterrupted, stop_on_signals
from gpt2.train.step import backward_micro_batches, optimizer_step
from gpt2.train.step_log import StepLog

__all__ = ["TrainingInterrupted", "train", "fit"]


def fit(s: Setup, step: int, history: History, checkpointer: Checkpointer, tracker: Tracker,
        finish: Callable[[int, Throughput], dict[str, Any]]) -> dict[str, Any]:
    """Train from ``step`` to the last step, the end of the time budget or the target loss; return the run's
    summary, ``finish(step, the step log's throughput figures)``."""
    cfg = s.params.train
    length = length_of(cfg.time_budget_s, s.total_steps, cfg.warmup_steps, history, step)
    step_log = StepLog(s, history, tracker, checkpointer.last_good, lambda: checkpointer.last_saved, length,
                       first_step=step)
    evaluator = Evaluator(s, history, tracker, checkpointer.elapsed_s, length)
    batches = iter(s.sampler.next, None)
    s.step_model.train()
    with stop_on_signals() as signals, checkpointer:
        vote = StopVote(signals, s.dist.world, step_log.every_step, cfg.dist_timeout_s)
        while not length.ends(step):
            length.step_begins(step)
            set_lr(s.optimizers, lr_at(step, cfg, s.total_steps, length.decay_progress(step)))
            step_log.step_started()
            loss = backward_micro_batches(s.step_model, batches, s.batch.accum, s.runtime, s.scaler)
            grad_norm, skipped = optimizer_step(s.model, s.optimizers, s.scaler, cfg.grad_clip)
            step += 1
            step_log.step_done(loss, skipped)
            checkpointer.settle()  # a failed background save stops the run here
            asked = vote.after_step()  # a stop signal is acted on now, not at the next log step
            if not (length.may_end(step) or asked or step_log.must_sync(step) or evaluator.due(step, False)
                    or checkpointer.due(step)):
                continue  # no host sync: the GPU keeps working while the host queues the next step
            stopping = step_log.sync(step, signals.asked)  # every rank, at the same steps: the clock agreed
            last = length.ends(step)
            if step_log.due(step, last):
                step_log.log(step, grad_norm)
            if evaluator.due(step, last):
                step_log.set_aside(evaluator.evaluate(step, last))  # a compiled run's first eval compiles: not steady
            done = last or evaluator.stop
            summary = finish(step, step_log.throughput) if done else None
            signals.saving = stopping  # from here a second Ctrl-C waits for the write (checkpointer's exit)
            if checkpointer.due(step, last=done or stopping):
                checkpointer.save(step, summary)
            if stopping:  # asked in the last step too: DVC then stops the pipeline, as its user asked
                raise signals.interrupted(length.shown(step), checkpointer.what_was_saved(finished=done))
            if done:
                return summary
    return finish(step, step_log.throughput)  # resumed past a lowered max_steps: nothing left to train


def train(params: Params, tokens_dir: str | Path = paths.TOKENS, ckpt_path: str | Path = paths.CHECKPOINT,
          report_dir: str | Path | None = paths.TRAIN_REPORTS) -> dict[str, Any]:
    """Train (or resume) as params say; write the checkpoint and the reports; return the summary metrics.

    ``report_dir`` None writes no report files: a benchmark's measurement run reads the returned summary.
    Under DDP every rank runs this; rank 0 alone logs, tracks and writes."""
    ckpt_path, report_dir = Path(ckpt_path), Path(report_dir) if report_dir is not None else None
    started = time.perf_counter()  # wall-clock throughput counts building the model and loading the data too
    cfg = params.train
    stop_with_parent()  # DVC or a scheduler killed: save and stop, never train on orphaned
    with reproducible(cfg.threads, cfg.deterministic), compile_caches(cfg.compile, cfg.compile_cache):
        reset_memory_peak()  # this run's peak, from building the model and loading the data on
        s = build(params, tokens_dir)
        log.set_rank(s.dist.rank)
        finished = False
        try:
            with checkpoint.exclusive(ckpt_path) if s.dist.main else nullcontext():
                summary = session(s, ckpt_path, report_dir, started)
            finished = True
            return summary
        except torch.OutOfMemoryError as exc:
            raise out_of_memory_error(exc, s, ckpt_path) from None
        except (getattr(torch.distributed, "DistError", RuntimeError), RuntimeError) as exc:
            if is_cpu_out_of_memory(exc):
                raise out_of_memory_error(exc, s, ckpt_path) from None
            if s.dist.world > 1 and distributed.is_collective_failure(exc):
                raise distributed.collective_error(exc, s.dist, params.train.dist_timeout_s, ckpt_path) from None
            raise
        finally:
            distributed.shutdown(s.dist, finished)


def session(s: Setup, ckpt_path: Path, report_dir: Path | None, started: float) -> dict[str, Any]:
    """One session of a run: start (resume, reuse or afresh), announce and track, fit, report."""
    if interrupt_pending():  # a Ctrl-C during the build whose KeyboardInterrupt Python lost: nothing written yet
        raise KeyboardInterrupt
    start = resume.start(ckpt_path, s)
    distributed.agree_on_start(start.step, start.finished is not None, s.dist, s.runtime.device, ckpt_path)
    if start.finished is not None:
        return resume.reuse(start, ckpt_path, report_dir, s.dist.main)
    info = describe.announce(s)
    tracker, dataset = describe.open_tracker(s, start, ckpt_path, report_dir, info)
    earlier_s = start.history.elapsed_s  # a resumed run: the wall time of its earlier sessions

    def run_wall_s() -> float:
        return earlier_s + time.perf_counter() - started

    def finish(last_step: int, throughput: Throughput) -> dict[str, Any]:
        return run_summary(s, throughput, start.history, last_step, start.step, time.perf_counter() - started,
                           run_wall_s(), info)

    checkpointer = Checkpointer(s, ckpt_path, start.history, tracker, step=start.step, elapsed_s=run_wall_s)
    with kept_if_interrupted(ckpt_path, s, start.kept_from), tracker:  # the MLflow run ends FINISHED, KILLED or FAILED
        summary = fit(s, start.step, start.history, checkpointer, tracker, finish)
        with finished_model_kept(ckpt_path, s.params.train.save_checkpoint):
            describe.record_end(s, tracker, summary, start.history, ckpt_path, report_dir, dataset)
    if s.dist.main:
        saved = ckpt_path if s.params.train.save_checkpoint else None
        log.get("train").info(describe.closing_line(summary, start.step, saved, report_dir))
    return summary


@contextmanager
def finished_model_kept(ckpt_path: Path, saved: bool) -> Iterator[None]:
    """Ctrl-C or SIGTERM while the reports are written says what is on disk: the finished run's checkpoint, from
    which the next run writes the reports without training."""
    try:
        yield
    except KeyboardInterrupt as exc:
        if not (saved and ckpt_path.is_file()):
            raise
        what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        error = Stopped(f"{what} while writing the reports; the run had finished and its checkpoint {ckpt_path} is "
                        "saved: run the same command again to write the reports from it without "
                        "training")
        error.exit_code, error.every_rank = (143 if isinstance(exc, Terminated) else 130), False
        raise error from None
