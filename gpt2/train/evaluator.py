"""Validation during training: when to evaluate, the val loss, and the watch for a target loss."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from gpt2.core import log
from gpt2.train import distributed
from gpt2.train.batch import DEFAULT_MICRO_BATCH
from gpt2.train.loader import BatchSampler, TokenSplit
from gpt2.train.reports import History
from gpt2.train.setup import Setup
from gpt2.train.tracking import Tracker

logger = log.get("train")


@torch.no_grad()
def estimate_loss(s: Setup, split: TokenSplit) -> tuple[float, float]:
    """Mean loss over the windows of ``eval_iters`` batches drawn with ``eval_seed``, and its standard
    error over those windows. The same windows at every eval and in every run whatever its ``seed``, so
    two runs' val losses (and times to a target) differ by the models, not by the text they were
    scored on; the standard error says how much another draw of text would move the figure (under DDP
    or FSDP each rank scores its slice, as in training). With ``micro_batch_size: auto`` a batch here
    is 8 windows, scored in micro-batches of what fits: the windows do not depend on the card."""
    cfg = s.params.train
    sampler = BatchSampler(split, s.batch.micro, s.seq_len, cfg.eval_seed, cfg.batching, s.runtime.device,
                           s.dist.rank, s.dist.world)
    s.eval_model.eval()
    sums = torch.zeros(3, device=s.runtime.device, dtype=torch.float64)  # windows, Σ loss, Σ loss²
    left = cfg.eval_iters * (DEFAULT_MICRO_BATCH if cfg.micro_batch_size == "auto" else s.batch.micro)
    while left:
        sampler.batch_size = min(s.batch.micro, left)  # one seeded stream: the windows do not depend on the split
        x, y = sampler.next()
        left -= len(x)
        with s.runtime.autocast(), s.runtime.attention():
            _, losses = s.eval_model(x, y, per_window=True)
        losses = losses.double()
        sums += torch.stack([torch.tensor(float(len(losses)), device=sums.device, dtype=sums.dtype),
                             losses.sum(), (losses * losses).sum()])
    s.eval_model.train()
    n, total, squares = distributed.total(sums, s.dist).tolist()
    return total / n, standard_error(n, total, squares)


def standard_error(n: float, total: float, squares: float) -> float:
    """The standard error of a mean from the count, sum and sum of squares (sample variance, n - 1)."""
    if n < 2:
        return float("nan")
    variance = max(squares - total * total / n, 0.0) / (n - 1)
    return math.sqrt(variance / n)


class Evaluator:
    """Scores the val split every ``eval_interval`` steps and at the end; notes when it first reaches
    ``target_val_loss`` (time from the run's start, earlier sessions included, tokens and steps)."""

    def __init__(self, s: Setup, history: History, tracker: Tracker, elapsed_s: Callable[[], float]) -> None:
        self.s, self.cfg, self.history, self.tracker, self.elapsed_s = s, s.params.train, history, tracker, elapsed_s

    def due(self, step: int) -> bool:
        """Every ``eval_interval`` steps; the last step only with ``final_eval`` (even on the interval)."""
        if step == self.s.total_steps:
            return self.cfg.final_eval
        return step % self.cfg.eval_interval == 0

    @property
    def stop(self) -> bool:
        """The target was reached and the run should end there (``train.stop_at_target``)."""
        return self.history.target is not None and self.cfg.stop_at_target

    def evaluate(self, step: int) -> None:
        with self.s.compile_watch.phase("eval"):
            val, se = estimate_loss(self.s, self.s.val_data)
        self.history.val.append({"step": step, "val/loss": val, "val/loss_se": se})
        best = min(self.history.val, key=lambda r: r["val/loss"])
        # MLflow's runs table shows each metric's last value: the best so far is a metric of its own
        self.tracker.log_metrics({"val/loss": val, "val/loss_se": se, "val/ppl": math.exp(min(val, 50)),
                                  "val/best_loss": best["val/loss"], "val/best_step": best["step"]}, step=step)
        logger.info(f"step {step}/{self.s.total_steps} | val loss {val:.4f} ± {se:.4f}")
        target = self.cfg.target_val_loss
        if target is None or self.history.target is not None or val > target:
            return
        self.history.target = {"time_s": round(self.elapsed_s(), 3), "tokens": step * self.s.tokens_per_step,
                               "steps": step}
        self.tracker.log_metrics({f"target/{k}": v for k, v in self.history.target.items()}, step=step)
        logger.info(f"step {step}/{self.s.total_steps} | reached the target val loss {target} in "
                    f"{self.history.target['time_s']:.1f} s, {self.history.target['tokens']:,} tokens"
                    + ("; stopping (train.stop_at_target)" if self.cfg.stop_at_target else ""))
