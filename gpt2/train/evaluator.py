"""Validation during training: when to evaluate, the val loss, and the watch for a target loss."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from gpt2.core import log
from gpt2.train import distributed
from gpt2.train.loader import BatchSampler, TokenSplit
from gpt2.train.reports import History
from gpt2.train.setup import Setup
from gpt2.train.tracking import Tracker

logger = log.get("train")


@torch.no_grad()
def estimate_loss(s: Setup, split: TokenSplit) -> float:
    """Mean loss over ``eval_iters`` batches drawn with ``eval_seed``: the same windows at every eval and
    in every run whatever its ``seed``, so two runs' val losses (and times to a target) differ by the
    models, not by the text they were scored on (under DDP each rank scores its slice of the global
    batch, as in training)."""
    cfg = s.params.train
    sampler = BatchSampler(split, cfg.micro_batch_size, s.seq_len, cfg.eval_seed, cfg.batching, s.runtime.device,
                           s.dist.rank, s.dist.world)
    s.eval_model.eval()
    total = torch.zeros((), device=s.runtime.device)
    for _ in range(cfg.eval_iters):
        x, y = sampler.next()
        with s.runtime.autocast(), s.runtime.attention():
            _, loss = s.eval_model(x, y)
        total += loss.float()
    s.eval_model.train()
    return float(distributed.mean(total, s.dist)) / cfg.eval_iters


class Evaluator:
    """Scores the val split every ``eval_interval`` steps and at the end; notes when it first reaches
    ``target_val_loss`` (time from the run's start, earlier sessions included, tokens and steps)."""

    def __init__(self, s: Setup, history: History, tracker: Tracker, elapsed_s: Callable[[], float]) -> None:
        self.s, self.cfg, self.history, self.tracker, self.elapsed_s = s, s.params.train, history, tracker, elapsed_s

    def due(self, step: int) -> bool:
        return step % self.cfg.eval_interval == 0 or (step == self.s.total_steps and self.cfg.final_eval)

    @property
    def stop(self) -> bool:
        """The target was reached and the run should end there (``train.stop_at_target``)."""
        return self.history.target is not None and self.cfg.stop_at_target

    def evaluate(self, step: int) -> None:
        with self.s.compile_watch.phase("eval"):
            val = estimate_loss(self.s, self.s.val_data)
        self.history.val.append({"step": step, "val/loss": val})
        self.tracker.log_metrics({"val/loss": val, "val/ppl": math.exp(min(val, 50))}, step=step)
        logger.info(f"step {step}/{self.s.total_steps} | val loss {val:.4f}")
        target = self.cfg.target_val_loss
        if target is None or self.history.target is not None or val > target:
            return
        self.history.target = {"time_s": round(self.elapsed_s(), 3), "tokens": step * self.s.tokens_per_step,
                               "steps": step}
        self.tracker.log_metrics({f"target/{k}": v for k, v in self.history.target.items()}, step=step)
        logger.info(f"step {step}/{self.s.total_steps} | reached the target val loss {target} in "
                    f"{self.history.target['time_s']:.1f} s, {self.history.target['tokens']:,} tokens"
                    + ("; stopping (train.stop_at_target)" if self.cfg.stop_at_target else ""))
