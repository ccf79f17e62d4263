"""When a run ends: after a number of steps, or when a budget of training time is spent.

A time budget (``train.time_budget_s``) counts the time of the training steps, the first step's
compilation included, and not the evals, the checkpoints or the build before the first step. So a
budget buys the same training whatever ``eval_interval`` is, and a compile that costs a minute
costs it from the budget, as it would cost a user. The learning rate decays over the share of the
budget spent after the warm-up, so a budget run ends decayed like a run of fixed length. A resumed
run continues its budget: the time spent is the sum of the step times its history keeps.

Every rank must use the same learning rate at every step and stop after the same step, without
reading another rank's clock at every step. So the clock is agreed where the loop already syncs
(the mean over the ranks, in the all-reduce that reads the losses), and between sync points the
time spent is extrapolated from the rate agreed at the last two. When the extrapolation says the
budget is spent, the loop syncs to know.
"""

from __future__ import annotations

from gpt2.train.history import History


class Steps:
    """A run of ``total`` steps (train.max_steps, or train.max_tokens in whole steps). ``spent_s``: the training
    time so far, as the ranks agreed it at the last sync point (the val curve records it)."""

    def __init__(self, total: int, spent_s: float) -> None:
        self.total, self.spent_s = total, spent_s

    def step_begins(self, step: int) -> None:
        """Nothing to note: the schedule decays over the steps."""

    def decay_progress(self, step: int) -> float | None:
        """None: the schedule decays over the steps."""
        return None

    def ends(self, step: int) -> bool:
        return step >= self.total

    def may_end(self, step: int) -> bool:
        return step >= self.total

    def agree(self, step: int, spent_s: float) -> None:
        self.spent_s = spent_s

    def shown(self, step: int) -> str:
        return f"{step}/{self.total}"

    def eta_s(self, step: int, step_s: float) -> float:
        return (self.total - step) * step_s


class Budget:
    """A run that trains until ``budget_s`` seconds of training steps are spent (module docstring)."""

    def __init__(self, budget_s: float, warmup_steps: int, history: History, step: int) -> None:
        self.budget_s, self.warmup_steps, self.history = budget_s, warmup_steps, history
        self.spent_s = history.train_s  # agreed at the last sync point (a resumed run: its earlier sessions)
        self.at_step = step
        self.rate_s = 0.0  # seconds per step between the last two sync points

    def spent_at(self, step: int) -> float:
        """The time spent after ``step``: agreed at the last sync point, extrapolated since."""
        return self.spent_s + (step - self.at_step) * self.rate_s

    def step_begins(self, step: int) -> None:
        """Note where the lr's decay begins: the time spent when the first step after the warm-up begins, kept in
        the history, so a resumed run decays over the same span."""
        if step >= self.warmup_steps and self.history.budget_warm_s is None:
            self.history.budget_warm_s = self.spent_at(step)

    def decay_progress(self, step: int) -> float:
        """The share of the budget left after the warm-up that is spent before ``step``: 0 to 1."""
        warm = self.history.budget_warm_s
        if step < self.warmup_steps or warm is None:
            return 0.0
        return min(1.0, max(0.0, (self.spent_at(step) - warm) / max(self.budget_s - warm, 1e-9)))

    def ends(self, step: int) -> bool:
        """Whether the budget is spent after ``step``: known at a sync point only."""
        return self.at_step == step and self.spent_s >= self.budget_s

    def may_end(self, step: int) -> bool:
        """Whether the budget may be spent after ``step``: the loop must sync to know."""
        return self.spent_at(step) >= self.budget_s

    def agree(self, step: int, spent_s: float) -> None:
        """At a sync point: the time spent, agreed by the ranks."""
        if step > self.at_step:
            self.rate_s = max(0.0, (spent_s - self.spent_s) / (step - self.at_step))
        self.spent_s, self.at_step = spent_s, step

    def shown(self, step: int) -> str:
        return f"{step} ({self.spent_at(step):.0f}/{self.budget_s:g} s)"

    def eta_s(self, step: int, step_s: float) -> float:
        return max(0.0, self.budget_s - self.spent_at(step))


def length_of(budget_s: float | None, total_steps: int | None, warmup_steps: int, history: History,
              step: int) -> Steps | Budget:
    return Budget(budget_s, warmup_steps, history, step) if budget_s is not None else Steps(total_steps,
                                                                                            history.train_s)
