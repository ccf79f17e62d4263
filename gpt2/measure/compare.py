"""How two settings compare, and whether the difference is outside noise: the one judge of the ladder and the grid.

A setting's runs are paired with the runs of the setting it is compared with that ran next to
them in time (the same repeat, in alternating order), so slow drift of the machine cancels in
each ratio; the speed ratio is the median of the paired ratios. A gain is *inside noise* when
the paired ratios disagree on its direction, or when it is no larger than the noise floor: how
far paired ratios typically disagree on this machine (the median over the settings of their
max - min), or a move that a setting which changed nothing made. Val losses differ beyond noise
when they are more than 2 × √(se₁² + se₂²) apart, the standard errors being over the scored windows.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

ADVICE = "run it on an idle machine, with more steps per run (--steps) or more repeats (--repeats)"
TOO_NOISY = 0.10  # paired ratios that disagree by more than this: no gain of that size can be read


@dataclass(frozen=True)
class Spread:
    """A figure over a setting's runs: their median, and the lowest and highest of them."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))

    def shown(self, form: str) -> str:
        """``110.0 (100.0–120.0)`` for ``form`` ``.1f``."""
        return f"{self.median:{form}} ({self.low:{form}}–{self.high:{form}})"

    def overlaps(self, other: Spread) -> bool:
        return self.low <= other.high and other.low <= self.high


def paired_ratios(values: list[float], against: list[float]) -> list[float]:
    """Each run's figure over the compared setting's run of the same repeat."""
    return [a / b for a, b in zip(values, against) if b]


def typical_disagreement(paired: list[list[float]]) -> float:
    """How far a setting's paired ratios typically disagree: the median of their max - min (0 with no pairs)."""
    spreads = [max(p) - min(p) for p in paired if len(p) > 1]
    return statistics.median(spreads) if spreads else 0.0


def ratio_inside_noise(paired: list[float], floor: float) -> bool:
    """Whether a speed ratio is no gain that these runs can tell from noise (one pair alone never can)."""
    if len(paired) < 2:
        return True
    ratio = statistics.median(paired)
    return min(paired) <= 1 <= max(paired) or abs(ratio - 1) <= floor


def losses_apart(loss: float | None, se: float | None, other: float | None, other_se: float | None) -> bool | None:
    """Whether two val losses differ by more than twice the standard error of their difference; None when
    a figure or its error is missing (one window has none)."""
    if None in (loss, se, other, other_se) or not all(math.isfinite(x) for x in (loss, se, other, other_se)):
        return None
    return abs(loss - other) > 2 * math.hypot(se, other_se)


def as_metric(verdict: bool | None) -> float | None:
    """A yes/no verdict as an MLflow metric (1.0 or 0.0; None where there is none), so a runs list can show it."""
    return None if verdict is None else float(verdict)


def ratio_shown(value: float | None, inside_noise: bool = False) -> str:
    if value is None:
        return ""
    return f"{value:.2f}× (inside noise)" if inside_noise else f"{value:.2f}×"


def loss_shown(value: float | None, error: float | None) -> str:
    """'5.938 ± 0.059': a val loss with its standard error over the scored windows, when known."""
    if value is None:
        return ""
    return f"{value:.3f} ± {error:.3f}" if error is not None and math.isfinite(error) else f"{value:.3f}"


def noise_verdict(spread: float, floor: float, noisy: int, compared: int, repeats: int, what: str,
                  against: str) -> str:
    """A report's first words: too noisy to read, or how noisy, and how many gains are inside that.
    ``spread``: the typical disagreement of paired ratios; ``floor``: the noise floor (at least the spread);
    ``what`` names the compared things ("rung"), ``against`` what each is paired with ("the rung above's")."""
    if repeats < 2:
        return f"**One run per {what}: no interval, so no gain can be told from noise.** To read it, {ADVICE}."
    if floor > TOO_NOISY:
        return (f"**Too noisy to read:** a {what}'s paired runs disagree by {100 * spread:.0f}% (median)"
                + (f" and a {what} that changed nothing here moved tokens/s by {100 * floor:.0f}%" if floor > spread
                   else "")
                + f"; {noisy} of {compared} {what}s' gains are inside that noise. To read it, {ADVICE}.")
    shown = f"; {what}s that changed nothing here moved it by up to {100 * floor:.1f}%" if floor > spread else ""
    return (f"Noise: each {what}'s runs, paired with {against} of the same repeat, agree on its tokens/s ratio within "
            f"{100 * spread:.1f}% (median over the {what}s){shown}. A gain whose paired runs disagree on its "
            f"direction, or no larger than {100 * floor:.1f}%, is marked *inside noise*: it buys nothing this "
            f"machine can measure ({noisy} of {compared} {what}s).")
