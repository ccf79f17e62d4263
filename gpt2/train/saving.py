"""Checkpoints during training: when to save, what a checkpoint holds, and the last one on disk.

A save gathers every rank's RNG states (each rank's dropout continues exactly on resume), and
under FSDP the full weights and optimizer state from the shards (train/sharded.py), so the file is
the one a single process writes. Then rank 0 hands the state to a background writer
(gpt2/run/checkpoint.py) and training goes on. Leaving
the ``with`` block waits for the last write, so "checkpoint saved" is true when the run says it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpt2.core import log
from gpt2.core.config import to_dict
from gpt2.core.errors import Diverged, UserError
from gpt2.core.provenance import training_code_digest
from gpt2.run import checkpoint
from gpt2.run.tracking import Tracker
from gpt2.train import run_state
from gpt2.train.build import Setup
from gpt2.train.history import History
from gpt2.train.interrupted import interrupted_dir, keep_saved
from gpt2.train.processes import parent_gone
from gpt2.train.step_log import what_helps


logger = log.get("train")

DVC_KILLED = ("; DVC itself was stopped, and may have left git on a detached HEAD: `git checkout -` returns to "
              "your branch (docs/experiments.md, \"When DVC itself is killed\")")


class Checkpointer:
    def __init__(self, s: Setup, path: Path, history: History, tracker: Tracker,
                 elapsed_s: Callable[[], float], step: int) -> None:
        self.s, self.cfg, self.path, self.history, self.tracker = s, s.params.train, path, history, tracker
        self.elapsed_s = elapsed_s
        self.saver = checkpoint.BackgroundSaver(self.cfg.async_checkpoint)
        self.last_saved = step if path.exists() else None  # the step of the checkpoint on disk
        self.writing: int | None = None  # the step being written in the background
        self.writing_finished = False  # ... and whether it is the finished run's
        if not self.cfg.save_checkpoint and s.dist.main:
            path.parent.mkdir(parents=True, exist_ok=True)  # the stage's DVC out exists, empty

    def due(self, step: int, last: bool = False) -> bool:
        """A save step: every ``checkpoint_interval``-th, and the run's last (finished or stopped)."""
        return self.cfg.save_checkpoint and (last or step % self.cfg.checkpoint_interval == 0)

    def save(self, step: int, summary: dict[str, Any] | None = None) -> None:
        """Save this step (every rank takes part); ``summary`` marks a finished run, whose reports
        can then be rebuilt from the checkpoint without training again. Called on the steps ``due`` names."""
        self.history.elapsed_s = self.elapsed_s()
        parts = run_state.states(self.s)
        if self.s.dist.main:
            refuse_non_finite(parts["model"], step, self.last_good,
                              lambda: what_helps(self.s, self.history, self.last_saved))
            self.settle(block=True)  # the previous write first: one at a time
            self.writing, self.writing_finished = step, summary is not None
            self.saver.save(self.path, {**records(self.s, step, self.history, self.tracker.run_id, summary),
                                        **parts})
            if not self.saver.enabled:
                self.settle(block=True)
        else:
            self.last_saved = step

    def settle(self, block: bool = False) -> None:
        """Learn how the background write ended (after every step, without waiting for it): a finished one is
        the last good checkpoint; a failed one stops the run now, not at the next save, so no step trains
        unsaved in the belief that it is saved."""
        if self.writing is None or (not block and self.saver.busy):
            return
        step, self.writing = self.writing, None
        try:
            self.saver.wait()
        except UserError as exc:
            raise UserError(f"the checkpoint of step {step} was not saved: {exc}; the last good checkpoint, "
                            f"{self.last_good()}, is kept for train.resume auto") from None
        self.last_saved = step
        if not self.writing_finished and os.environ.get("DVC_EXP_NAME"):  # found again after a kill -9, though
            try:  # `dvc exp run` restores its baseline's checkpoint (train/interrupted.py)
                keep_saved(self.path, self.s, running=True)
            except (OSError, UserError) as exc:  # the save itself is good: the run goes on
                logger.warning(f"train: the save of step {step} could not be kept in .dvc/tmp ({exc}): a run killed "
                               "outright now would start over under `dvc exp run`")

    def what_was_saved(self, finished: bool = False) -> str:
        """For the message of an interrupted run; ``finished``: the stop came in its last step."""
        if not self.cfg.save_checkpoint:
            return "no checkpoint saved (train.save_checkpoint is false)"
        experiment = bool(os.environ.get("DVC_EXP_NAME"))
        again = "run the same `dvc exp run` command again" if experiment else "run the same command again"
        if finished:
            return (f"the run is finished and saved to {self.path}; {again} to write its reports (nothing is "
                    "trained again)")
        killed = DVC_KILLED if experiment and parent_gone() else ""
        if self.cfg.resume == "never":  # run as it was, it would start afresh and set this checkpoint aside
            return (f"checkpoint saved to {self.path}; to resume it, run again with train.resume: auto (this run's "
                    f"train.resume: never starts afresh){killed}")
        resume = "to resume it (or `dvc repro` in this workspace)" if experiment else "to resume (train.resume: auto)"
        kept = (f" and copied to {kept_in.relative_to(Path(os.environ['DVC_ROOT']))}/ (DVC puts its baseline's "
                f"checkpoint back in {self.path} before a run; the next run of these params resumes from the copy)"
                if (kept_in := interrupted_dir()) is not None else "")
        return f"checkpoint saved to {self.path}{kept}; {again} {resume}{killed}"

    def last_good(self) -> str:
        """For messages: the checkpoint on disk, once the write in flight (if any) has ended."""
        with contextlib.suppress(UserError):
            self.settle(block=True)
        return f"{self.path} (step {self.last_saved})" if self.last_saved is not None else "none was saved yet"

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        """The last checkpoint is on disk before the run reports, returns or stops."""
        if kind is None:
            self.settle(block=True)
        else:  # already failing: the first error is the one to report
            with contextlib.suppress(Exception):
                self.saver.wait()


def refuse_non_finite(weights: dict[str, Any], step: int, last_good: Callable[[], str],
                      advice: Callable[[], str]) -> None:
    """Never save weights with NaN or inf: an update can break the weights while the loss that step reported was
    still finite, and resuming from them would fail again at once."""
    bad = checkpoint.non_finite(weights)
    if bad:
        saved = last_good()  # settles the write in flight first: the advice reads its step
        raise Diverged(f"the weights hold NaN or inf after step {step} ({len(bad)} tensors, {bad[0]} first): training "
                       f"diverged and this step was not saved; last checkpoint: {saved}; {advice()}")


def records(s: Setup, step: int, history: History, run_id: str | None,
            summary: dict[str, Any] | None) -> dict[str, Any]:
    """What a checkpoint says of its run beside the parts a resume restores (train/run_state.py): where it
    stands, what it was made of and by which code, its history."""
    return {
        "metrics": summary,  # set once the run is finished: its reports can be rebuilt without training
        "step": step,
        "total_steps": s.total_steps,
        "seq_len": s.seq_len,  # the positions trained: evaluation, sampling and export stop there
        "world_size": s.dist.world,
        "model_config": dataclasses.asdict(s.model_cfg),
        "params": {"model": to_dict(s.params.model), "train": to_dict(s.params.train)},
        "data": s.data_identity,
        "code": training_code_digest(),  # a finished run is reused only by the code that trained it
        "history": dataclasses.asdict(history),
        "mlflow_run_id": run_id,
    }
