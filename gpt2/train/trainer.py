"""The training loop. Read ``fit`` top to bottom: it is the whole of a training step and its schedule.

Each concern around the step is a component that owns its schedule and state:

- ``StepLog`` (train/step_log.py): step timing, sync points, the record of each log step and its sinks;
- ``Evaluator`` (train/evaluator.py): val loss every ``eval_interval`` steps, time to a target loss;
- ``Checkpointer`` (train/saving.py): when to save, the background writer, the last good step;
- ``stop_on_signals`` (train/signals.py): Ctrl-C and SIGTERM end the run after a saved step.

Around the loop, ``train`` builds the run (train/build.py), decides whether it resumes or is already
done (train/resume.py), opens its MLflow run, and writes its reports (train/reports.py).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from gpt2.core import log
from gpt2.core.config import Params, to_dict
from gpt2.core.provenance import checkpoint_hashes, describe_tokens, model_tags
from gpt2.run import checkpoint
from gpt2.run.device import memory_gb, reset_memory_peak
from gpt2.run.compiled import compile_caches
from gpt2.run.cost import price_per_hour
from gpt2.run.tracking import MlflowTracker, Tracker, experiment_run_name, flatten, git_commit
from gpt2.train import distributed
from gpt2.train.catch_up import catch_up, replay_hint
from gpt2.train.build import Setup, above_peak, build, inert_switch_warnings, run_name, what_runs
from gpt2.train.determinism import reproducible
from gpt2.train.evaluator import Evaluator
from gpt2.train.length import length_of
from gpt2.train.oom import is_cpu_out_of_memory, out_of_memory_error
from gpt2.train.optim import lr_at, set_lr
from gpt2.train.history import History
from gpt2.train.reports import summarize, tracked_summary, write_reports
from gpt2.train.resume import (changed_settings, drop_interrupted, keep_interrupted, load_for_resume, restore,
                               tidy_interrupted)
from gpt2.train.saving import Checkpointer
from gpt2.train.signals import StopVote, TrainingInterrupted, stop_on_signals, stop_with_parent
from gpt2.train.step import backward_micro_batches, optimizer_step
from gpt2.train.step_log import StepLog

__all__ = ["TrainingInterrupted", "train", "fit"]

logger = log.get("train")


def fit(s: Setup, step: int, history: History, checkpointer: Checkpointer, tracker: Tracker,
        finish: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """Train from ``step`` to the last step, the end of the time budget or the target loss; return the run's
    summary, ``finish(step)``."""
    cfg = s.params.train
    length = length_of(cfg.time_budget_s, s.total_steps, cfg.warmup_steps, history, step)
    step_log = StepLog(s, history, tracker, checkpointer.last_good, length, first_step=step)
    evaluator = Evaluator(s, history, tracker, checkpointer.elapsed_s, length)
    batches = iter(s.sampler.next, None)
    s.step_model.train()
    with stop_on_signals() as signals, checkpointer:
        vote = StopVote(signals, s.dist.world, step_log.every_step, cfg.dist_timeout_s)
        while not length.ends(step):
            lr = lr_at(step, cfg, s.total_steps, length.decay_progress(step))
            set_lr(s.optimizers, lr / cfg.lr)
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
                step_log.set_aside(evaluator.evaluate(step))  # a compiled run's first eval compiles: not steady
            done = last or evaluator.stop
            summary = finish(step) if done else None
            signals.saving = stopping  # from here a second Ctrl-C waits for the write (checkpointer's exit)
            if checkpointer.due(step, last=done or stopping):
                checkpointer.save(step, summary)
            if stopping:
                raise signals.interrupted(length.shown(step), checkpointer.what_was_saved())
            if done:
                return summary
    return finish(step)  # resumed past a lowered max_steps: nothing left to train


def train(params: Params, tokens_dir: str | Path = "data/tokens", ckpt_path: str | Path = "checkpoints/ckpt.pt",
          report_dir: str | Path | None = "reports/train") -> dict[str, Any]:
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
        try:
            with checkpoint.exclusive(ckpt_path) if s.dist.main else nullcontext():
                return run(s, ckpt_path, report_dir, started)
        except torch.OutOfMemoryError as exc:
            raise out_of_memory_error(exc, s, ckpt_path) from None
        except (getattr(torch.distributed, "DistError", RuntimeError), RuntimeError) as exc:
            if is_cpu_out_of_memory(exc):
                raise out_of_memory_error(exc, s, ckpt_path) from None
            if s.dist.world > 1 and distributed.is_collective_failure(exc):
                raise distributed.collective_error(exc, s.dist, params.train.dist_timeout_s, ckpt_path) from None
            raise
        finally:
            distributed.shutdown(s.dist)


def run(s: Setup, ckpt_path: Path, report_dir: Path | None, started: float) -> dict[str, Any]:
    """One session of a run: resume or reuse, track, fit, report."""
    params, cfg = s.params, s.params.train
    history, step, run_id, changes = History(), 0, None, None
    if s.dist.main:
        tidy_interrupted(s)
    state = load_for_resume(ckpt_path, s)
    resumed_from = Path(state["kept_from"]) if state is not None and "kept_from" in state else None
    if state is not None and state.get("metrics") is not None:
        if s.dist.main and report_dir is not None:
            write_reports(report_dir, state["metrics"], History(**state["history"]))
        logger.info(f"train: {ckpt_path} is a finished run of these params and data ({state['step']} steps); "
                    f"rebuilt {report_dir} from it instead of training again (train.resume: never retrains)")
        return state["metrics"]
    if state is not None:
        step, history, run_id = restore(s, state)
        changes = changed_settings(state, s)
        logger.info(f"train: resuming at step {step}/{s.total_steps}" if s.total_steps else
                    f"train: resuming at step {step}, {history.train_s:.1f} s of the {cfg.time_budget_s:g} s budget spent")
    del state
    info = what_runs(s)
    logger.info("train: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    if cfg.batch_tokens is not None:
        logger.info(f"train: batch of {s.tokens_per_step:,} tokens = micro-batch {s.batch.micro} × {s.seq_len} tokens "
                    f"× accumulation {s.batch.accum} × {s.dist.world} rank(s); micro-batch {s.batch.why}")
    for warning in inert_switch_warnings(s):
        logger.warning(warning)
    kept_in = f"{report_dir or 'the returned summary'} and the checkpoint's history"
    tracker: Tracker = (MlflowTracker(cfg.experiment, run_id, experiment_run_name() or run_name(s), kept_in,
                                      catch_up_hint=replay_hint(ckpt_path), run_uid=history.run_uid)
                        if cfg.mlflow and s.dist.main else Tracker())
    if run_id is not None and isinstance(tracker, MlflowTracker):  # figures an earlier session could not send
        catch_up(tracker, dataclasses.asdict(history))
    tracker.log_params(flatten({"model": to_dict(params.model), "train": to_dict(params.train)}))
    tracker.set_tags({"git_commit": git_commit(), "dvc_exp_name": os.environ.get("DVC_EXP_NAME"),
                      "device": s.runtime.device_name, "torch_version": torch.__version__, **info})
    if changes is not None:  # MLflow keeps a run's first params: each resume records what it changed
        tracker.set_tags({f"resume.step_{step}": "; ".join(f"train.{k}: {old} → {new}" for k, (old, new)
                                                           in changes.items()) or "no params changed"})
    dataset = describe_tokens(s.tokens_dir, s.meta) if tracker.run_id else {}  # no dvc.lock reading untracked
    if dataset:
        tracker.log_dataset(dataset, context="training")
    runtime = {k: v for k, v in info.items() if k != "params"}  # what really ran (the ladder reads it)
    earlier_s, first_step = history.elapsed_s, step  # a resumed run: the time and steps of its earlier sessions

    def finish(last_step: int) -> dict[str, Any]:
        if history.step_s and (warning := above_peak(s, s.throughput.tokens_per_s(
                statistics.median(history.timed_s(cfg.timing_warmup_steps))))):
            logger.warning(warning)  # the median step can be faster than every logged one
        summary = summarize(history, last_step, time.perf_counter() - started, first_step,
                            throughput=s.throughput, timing_warmup_steps=cfg.timing_warmup_steps,
                            target_val_loss=cfg.target_val_loss, num_params=s.model.num_params(),
                            memory=memory_gb(s.runtime), run_wall_s=earlier_s + time.perf_counter() - started,
                            price=price_per_hour(cfg.price_per_hour, s.runtime.device.type, s.runtime.device_name))
        return {**summary, "runtime": {**runtime, **s.compile_watch.figures()}}

    checkpointer = Checkpointer(s, ckpt_path, history, tracker, step=step,
                                elapsed_s=lambda: earlier_s + time.perf_counter() - started)
    try:
        with tracker:  # ends the MLflow run as FINISHED, KILLED (stopped on purpose) or FAILED
            summary = fit(s, step, history, checkpointer, tracker, finish)
            if complaint := s.compile_watch.complaint():
                logger.warning(complaint)
            tracker.set_tags(s.compile_watch.figures())
            if tracker.run_id and cfg.save_checkpoint and ckpt_path.is_file():  # DVC's hash: dvc exp apply finds it
                hashes = checkpoint_hashes(ckpt_path)
                tracker.set_tags(hashes)  # and an MLflow model: the summary's metrics below are its too
                tracker.log_model(f"gpt2-{params.model.size}", model_tags(ckpt_path, hashes, dataset, git_commit(),
                                                                         os.environ.get("DVC_EXP_NAME")),
                                  flatten({"model": to_dict(params.model), "train": to_dict(params.train)}))
            if s.dist.main and report_dir is not None:
                write_reports(report_dir, summary, history)
                tracker.log_artifact(report_dir / "summary.json")
            metrics, tags = tracked_summary(summary)
            tracker.log_metrics(metrics, step=summary["steps"])
            tracker.set_tags(tags)
    except TrainingInterrupted:
        if s.dist.main and cfg.save_checkpoint:
            keep_interrupted(ckpt_path, s, resumed_from)
        raise
    if s.dist.main:
        drop_interrupted(s, resumed_from)
    return summary

