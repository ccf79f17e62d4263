"""How two settings compare, and whether the difference is outside noise: the one judge of the ladder and the grid.

A setting's runs are paired with the runs of the setting it is compared with that ran next to
them in time (the same repeat, in alternating order), so slow drift of the machine cancels in
each ratio; the speed ratio is the median of the paired ratios. A gain is *inside noise* when
the paired ratios disagree on its direction, or when it is no larger than the noise floor: how
far paired ratios typically disagree on this machine (the median over the settings of their
max - min), or a move that a setting which changed nothing made. Val losses differ beyond noise
when they are more than 2 × √(se₁² + se₂²) apart, the standard errors being over the scored windows.

At equal quality, each run's val curve (val loss against training time, measured every
``eval_interval`` steps of a run that trains its whole length) is read where it first reaches the
val loss its repeat's baseline run ends with, interpolated between the two evals around it. The
speedup compares a run with its repeat's baseline run at the higher of their two final val losses,
a loss both reach (a run that ends a hair above the baseline would otherwise read "never"): the
baseline's time to it over the run's, paired and judged as the tokens/s ratio is. Every run trains
its whole length: none stops at the mark, which would end a run on its luckiest eval.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

# how to read a noisy comparison, in each tool's own options
ADVICE = {"rung": "run it on an idle machine, with more steps per run (--steps) or more repeats (--repeats)",
          "setting": "run it on an idle machine, with more steps per run (-S train.max_steps=...) or more repeats "
                     "(--repeats)"}
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


def median_known(values: list[float | None]) -> float | None:
    """The median of the values that are known (None where none is)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def usd_shown(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}" if value < 1 else f"{value:,.2f}"


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
        return f"**One run per {what}: no interval, so no gain can be told from noise.** To read it, {ADVICE[what]}."
    if floor > TOO_NOISY:
        return (f"**Too noisy to read:** a {what}'s paired runs disagree by {100 * spread:.0f}% (median)"
                + (f" and a {what} that changed nothing here moved tokens/s by {100 * floor:.0f}%" if floor > spread
                   else "")
                + f"; {noisy} of {compared} {what}s' gains are inside that noise. To read it, {ADVICE[what]}.")
    shown = f"; {what}s that changed nothing here moved it by up to {100 * floor:.1f}%" if floor > spread else ""
    return (f"Noise: each {what}'s runs, paired with {against} of the same repeat, agree on its tokens/s ratio within "
            f"{100 * spread:.1f}% (median over the {what}s){shown}. A gain whose paired runs disagree on its "
            f"direction, or no larger than {100 * floor:.1f}%, is marked *inside noise*: it buys nothing this "
            f"machine can measure ({noisy} of {compared} {what}s).")


Curve = list[tuple[float, float, float]]  # a run's val curve: (training seconds, tokens, val loss) per eval


def reaches(curve: Curve, loss: float) -> tuple[float, float] | None:
    """The training time and tokens at which a val curve first reaches ``loss``: interpolated linearly between
    the two evals around it (the first eval's figures when it is already there); None when it never does."""
    before = None
    for time_s, tokens, value in curve:
        if value <= loss:
            if before is None or before[2] <= value:
                return time_s, tokens
            share = (before[2] - loss) / (before[2] - value)
            return before[0] + share * (time_s - before[0]), before[1] + share * (tokens - before[1])
        before = (time_s, tokens, value)
    return None


def sooner(reference: Curve | None, curve: Curve | None) -> float | None:
    """How many times sooner ``curve`` reaches a val loss than ``reference`` does (above 1: sooner), at the higher
    of their two final val losses: a loss both reach, so the ratio exists also for a run that ends a little
    above the other (a noisier init draw) instead of reading "never"."""
    if not reference or not curve:
        return None
    level = max(reference[-1][2], curve[-1][2])
    theirs, mine = reaches(reference, level), reaches(curve, level)
    return theirs[0] / mine[0] if theirs and mine and mine[0] > 0 else None


@dataclass
class AtQuality:
    """What a setting took to reach the val loss the baseline ends with, run by run (the same repeat's
    baseline run sets each run's mark), and how that compares with the baseline's own time to it."""

    reached: int  # runs that reached their mark
    runs: int
    time_s: Spread | None = None  # training time to the mark (compile included, evals not)
    tokens: float | None = None  # median tokens to the mark
    cost_usd: float | None = None  # median cost of that time, at the run's price per device-hour
    paired: list[float] = field(default_factory=list)  # how much sooner than the baseline's run of the same
    # repeat, at the higher of their final val losses (``sooner``)
    speedup: float | None = None  # their median: above 1, this setting gets there sooner
    inside_noise: bool | None = None


def at_baseline_quality(curves: list[list[Curve | None]],
                        prices: list[list[float | None]] | None = None) -> list[AtQuality | None]:
    """Per setting (the first is the baseline), given each run's val curve by repeat (None where a run failed or
    has no curve) and each run's price per hour of its time (USD; None: no cost): time and tokens to the
    baseline's final val loss, and the speedup with its noise. None for a setting with no curve at all."""
    marks = [curve[-1][2] if curve else None for curve in curves[0]]
    if all(mark is None for mark in marks):  # the baseline has no curve: there is no quality to reach
        return [None] * len(curves)
    found: list[list[tuple[float, float] | None]] = [
        [reaches(curve, mark) if curve and mark is not None else None for curve, mark in zip(runs, marks)]
        for runs in curves]
    out: list[AtQuality | None] = []
    for i, (runs, hits) in enumerate(zip(curves, found)):
        ran = [c for c in runs if c]
        if not ran:
            out.append(None)
            continue
        got = [(h, (prices[i][r] if prices else None)) for r, h in enumerate(hits) if h]
        figures = AtQuality(reached=len(got), runs=len(ran))
        if got:
            figures.time_s = Spread.of([h[0] for h, _ in got])
            figures.tokens = statistics.median(h[1] for h, _ in got)
            costs = [h[0] * price / 3600 for h, price in got if price is not None]
            figures.cost_usd = statistics.median(costs) if costs else None
        figures.paired = [r for base, mine in zip(curves[0], runs) if (r := sooner(base, mine)) is not None]
        figures.speedup = statistics.median(figures.paired) if figures.paired else None
        out.append(figures)
    floor = typical_disagreement([f.paired for f in out[1:] if f])
    for f in out[1:]:
        if f and f.speedup is not None:
            f.inside_noise = ratio_inside_noise(f.paired, floor)
    return out


def quality_shown(figures: AtQuality | None) -> tuple[str, str]:
    """(time to the baseline's loss, its ratio to the baseline's) as a table shows them."""
    if figures is None:
        return "", ""
    if not figures.reached:
        return f"not reached (0/{figures.runs})", ratio_shown(figures.speedup, bool(figures.inside_noise))
    time = figures.time_s.shown(".1f") + (f" reached {figures.reached}/{figures.runs}"
                                          if figures.reached < figures.runs else "")
    return time, ratio_shown(figures.speedup, bool(figures.inside_noise))


def win(speedup: float | None, speed_noisy: bool | None, sooner_by: float | None, sooner_noisy: bool | None,
        loss_delta: float | None, loss_apart: bool | None,
        at_equal_time: bool) -> tuple[tuple[float, float], str] | None:
    """Whether a setting wins against what it is compared with, and why; None when it does not.

    It wins by a gain outside noise and loses nowhere outside it. Reaching the same val loss sooner
    is the fullest measure (it counts the speed of a step and what a step learns) and decides where
    it is outside noise; a lower val loss wins too. More tokens/s wins when the runs train the same
    steps, not under a time budget, where only what the time bought counts. A higher val loss, or
    the same loss reached later, loses; so does fewer tokens/s over the same steps unless the loss
    comes sooner all the same. The score ranks winners: how much sooner, else faster, then how much lower."""
    sooner = sooner_by if sooner_by is not None and sooner_noisy is False else None
    faster = speedup if speedup is not None and speed_noisy is False else None
    lower, higher = bool(loss_apart and loss_delta < 0), bool(loss_apart and loss_delta > 0)
    if higher or (sooner is not None and sooner < 1):
        return None
    if not at_equal_time and faster is not None and faster < 1 and sooner is None:
        return None
    reasons = []
    if sooner is not None and sooner > 1:
        reasons.append(f"{sooner:.2f}× sooner to the baseline's val loss")
    if not at_equal_time and faster is not None and faster > 1:
        reasons.append(f"{faster:.2f}× the tokens/s")
    if lower:
        reasons.append(f"val loss {loss_delta:+.3f}" + (" at equal time" if at_equal_time else ""))
    if not reasons:
        return None
    score = sooner if sooner is not None and sooner > 1 else faster if not at_equal_time and faster else 1.0
    return (score, -(loss_delta or 0.0)), ", ".join(reasons) + ", outside noise"
