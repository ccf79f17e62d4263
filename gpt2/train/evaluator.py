"""Validation during training: when to evaluate, the val loss, and the watch for a target loss."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import torch

from gpt2.core import log
from gpt2.core.tokens import bits_per_byte
from gpt2.run.figures import val_metrics
from gpt2.run.tracking import Tracker
from gpt2.train import distributed
from gpt2.train.build import Setup
from gpt2.train.length import Budget, Steps
from gpt2.train.loader import BatchSampler, TokenSplit
from gpt2.train.history import History

logger = log.get("train")


def val_windows(n_tokens: int, seq_len: int, count: int, seed: int, start: bool = False) -> np.ndarray:
    """Where the val set's ``count`` windows begin in a split of ``n_tokens``: drawn with ``seed`` alone, so
    the same text in every run, whatever its ``seed``, micro-batch or number of ranks; or, from the ``start``,
    end to end (the speedrun's first tokens)."""
    if start:
        return np.arange(count, dtype=np.int64) * seq_len
    return np.random.default_rng(seed).integers(0, n_tokens - seq_len, size=count)


def windows_of(s: Setup, split: TokenSplit) -> np.ndarray:
    """The val windows every eval scores (train.eval_windows, eval_seed, eval_from)."""
    cfg = s.params.train
    return val_windows(split.length, s.seq_len, cfg.eval_windows, cfg.eval_seed, cfg.eval_from == "start")


def holdout_windows(n_tokens: int, seq_len: int, count: int, seed: int, taken: np.ndarray) -> np.ndarray:
    """Up to ``count`` more windows, none overlapping a window of ``taken`` (the val windows every eval scores):
    text no verdict was read on. Drawn with ``seed`` + 1 alone, so the same in every run."""
    used = np.sort(taken)
    candidates = np.random.default_rng(seed + 1).integers(0, n_tokens - seq_len, size=20 * count)
    at = np.searchsorted(used, candidates)
    below, above = used[np.clip(at - 1, 0, len(used) - 1)], used[np.clip(at, 0, len(used) - 1)]
    return candidates[(np.abs(candidates - below) > seq_len) & (np.abs(above - candidates) > seq_len)][:count]


@torch.no_grad()
def estimate_loss(s: Setup, split: TokenSplit, starts: np.ndarray | None = None) -> tuple[float, float, float | None]:
    """Mean loss over the ``eval_windows`` val windows (or the windows at ``starts``), its standard error over
    them, and the same loss in bits per byte of the text scored (None where the token folder does not say how
    many bytes each id stands for).

    Each rank scores its share of the windows in micro-batches of the training's micro-batch; the
    per-window losses then meet in window order and are summed exactly (``math.fsum``), so neither
    the micro-batch nor the number of ranks moves the figure. The standard error says how much
    another draw of text would move it."""
    cfg = s.params.train
    if starts is None:
        starts = windows_of(s, split)
    mine = np.array_split(np.arange(len(starts)), s.dist.world)[s.dist.rank]
    sampler = BatchSampler(split, s.batch.micro, s.seq_len, cfg.eval_seed, cfg.batching, s.runtime.device)
    losses = torch.zeros(len(starts), device=s.runtime.device, dtype=torch.float64)  # the other ranks' stay 0
    text = torch.zeros_like(losses)  # each window's bytes of text (its targets')
    table = None if split.token_bytes is None else torch.as_tensor(split.token_bytes.astype(np.int64),
                                                                   device=s.runtime.device)
    s.eval_model.eval()
    for lo in range(0, len(mine), s.batch.micro):
        rows = mine[lo:lo + s.batch.micro]
        x, y = sampler.at(starts[rows])
        with s.runtime.autocast(), s.runtime.attention():
            _, per_window = s.eval_model(x, y, per_window=True)
        at = torch.as_tensor(rows, device=losses.device)
        losses[at] = per_window.double()
        if table is not None:
            text[at] = table[y].sum(1).double()
    s.eval_model.train()
    # x + 0 is exact: every rank gets every window's loss and bytes, in one collective
    values, text_bytes = distributed.total(torch.stack([losses, text]), s.dist).tolist()
    n, total = len(values), math.fsum(values)
    bpb = None if table is None else bits_per_byte(total / n, n * s.seq_len, int(math.fsum(text_bytes)))
    return total / n, standard_error(n, total, math.fsum(v * v for v in values)), bpb


def standard_error(n: float, total: float, squares: float) -> float:
    """The standard error of a mean from the count, sum and sum of squares (sample variance, n - 1)."""
    if n < 2:
        return float("nan")
    variance = max(squares - total * total / n, 0.0) / (n - 1)
    return math.sqrt(variance / n)


class Evaluator:
    """Scores the val split every ``eval_interval`` steps and at the end; notes when it first reaches
    ``target_val_loss`` (time from the run's start, earlier sessions included, tokens and steps)."""

    def __init__(self, s: Setup, history: History, tracker: Tracker, elapsed_s: Callable[[], float],
                 length: Steps | Budget) -> None:
        self.s, self.cfg, self.history, self.tracker, self.elapsed_s = s, s.params.train, history, tracker, elapsed_s
        self.length = length
        self.compiles = self.cfg.compile  # this session's first eval compiles the eval graph

    def due(self, step: int, last: bool) -> bool:
        """Every ``eval_interval`` steps; the last step only with ``final_eval`` (even on the interval)."""
        if last:
            return self.cfg.final_eval
        return step % self.cfg.eval_interval == 0

    @property
    def stop(self) -> bool:
        """The target was reached and the run should end there (``train.stop_at_target``)."""
        return self.history.target is not None and self.cfg.stop_at_target

    def evaluate(self, step: int, last: bool = False) -> float:
        """Score the val set at ``step`` (after the ``last`` step, the held-out windows too); return the seconds to
        leave out of the steady state: the whole eval when it is the session's first under compile (the eval graph
        compiles, 30-60 s for GPT-2 on a GPU), else 0."""
        started = time.perf_counter()
        with self.s.compile_watch.phase("eval"):
            val, se, bpb = estimate_loss(self.s, self.s.val_data)
            held = self.holdout() if last and self.cfg.holdout_windows else {}
        compiling, self.compiles = self.compiles, False
        # with the training time and tokens so far: the curve a comparison at equal quality reads (measure/compare.py)
        self.history.val.append({"step": step, "val/loss": val, "val/loss_se": se,
                                 **({"val/bpb": bpb} if bpb is not None else {}),
                                 "train_s": round(self.length.spent_s, 3), "tokens": step * self.s.tokens_per_step,
                                 **held})
        if held:
            logger.info(f"step {self.length.shown(step)} | held-out val loss {held['val/holdout_loss']:.4f} ± "
                        f"{held['val/holdout_loss_se']:.4f} ({self.cfg.holdout_windows} windows apart from the "
                        "val windows)")
        best = min(self.history.val, key=lambda r: r["val/loss"])
        self.tracker.log_metrics(val_metrics(self.history.val[-1], best), step=step)
        logger.info(f"step {self.length.shown(step)} | val loss {val:.4f} ± {se:.4f}"
                    + (f", {bpb:.4f} bits per byte" if bpb is not None else ""))
        self.check_target(step, val)
        return time.perf_counter() - started if compiling else 0.0

    def holdout(self) -> dict[str, float]:
        """The loss on ``holdout_windows`` windows disjoint from the val windows, with its standard error."""
        split, cfg = self.s.val_data, self.cfg
        taken = windows_of(self.s, split)
        starts = holdout_windows(split.length, self.s.seq_len, cfg.holdout_windows, cfg.eval_seed, taken)
        if len(starts) == 0:
            return {}
        loss, se, _ = estimate_loss(self.s, split, starts)
        return {"val/holdout_loss": loss, "val/holdout_loss_se": se}

    def check_target(self, step: int, val: float) -> None:
        """Note when the val loss first reaches ``target_val_loss``: wall time since the run began, tokens, steps, and
        the steps' own time (``train_s``: evals and checkpoints left out, as the speedrun's clock leaves its
        validation out)."""
        target = self.cfg.target_val_loss
        if target is None or self.history.target is not None or val > target:
            return
        self.history.target = {"time_s": round(self.elapsed_s(), 3), "tokens": step * self.s.tokens_per_step,
                               "steps": step, "train_s": round(self.length.spent_s, 3)}  # steps' time alone
        self.tracker.log_metrics({f"target/{k}": v for k, v in self.history.target.items()}, step=step)
        logger.info(f"step {self.length.shown(step)} | reached the target val loss {target} in "
                    f"{self.history.target['time_s']:.1f} s, {self.history.target['tokens']:,} tokens"
                    + ("; stopping (train.stop_at_target)" if self.cfg.stop_at_target else ""))
