"""The t-tests a comparison's verdicts rest on (Student's t, two-sided), apart from what they judge.

``mean_test`` tests a mean against 0 given the spread of one value and its degrees of freedom;
``paired_test`` is the paired t-test of per-seed differences; ``block_noise`` reads one run's
noise from runs laid out as randomized blocks (arms × passes), for the speed test.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

POWER = 0.8  # the chance a real effect of the detectable size is found, for "seeds needed"


@dataclass
class Test:
    """A t-test of a mean: its (1 - alpha) interval, the p-value, and what these runs can detect."""

    n: int  # values (seeds, pairs)
    mean: float
    low: float
    high: float
    p: float
    alpha: float
    significant: bool
    detectable: float  # the smallest true mean these runs find with POWER's chance at alpha
    seeds_needed: int | None = None  # seeds (a speed test: repeats) that would decide the mean measured, where not


def mean_test(values: list[float], sd: float, df: int, alpha: float) -> Test:
    """The t-test of the mean of ``values`` against 0, where one value spreads by ``sd`` (an estimate with ``df``
    degrees of freedom). A spread of 0 decides alone: p = 1 for a mean of 0, else 0."""
    from scipy import stats

    n, mean = len(values), statistics.fmean(values)
    error = sd / math.sqrt(n)
    p = (1.0 if mean == 0 else 0.0) if error == 0 else float(2 * stats.t.sf(abs(mean) / error, df))
    quantile = float(stats.t.ppf(1 - alpha / 2, df))
    return Test(n, mean, mean - quantile * error, mean + quantile * error, p, alpha, p < alpha,
                float(quantile + stats.t.ppf(POWER, df)) * error)


def paired_test(differences: list[float], alpha: float, resolution: float = 0.0) -> Test | None:
    """Student's paired t-test of ``differences`` (one per seed) against 0; None with fewer than two.

    ``resolution``: the values the differences are taken between were rounded to it. Rounding alone spreads a
    difference by resolution / √6 (standard deviation), so the spread is taken as at least that: differences
    that agree only because they were rounded alike are not read as certain.

    Where the test does not hold, also how many seeds would decide the difference measured."""
    n = len(differences)
    if n < 2 or not all(math.isfinite(d) for d in differences):
        return None
    sd = max(statistics.stdev(differences), resolution / math.sqrt(6))
    test = mean_test(differences, sd, n - 1, alpha)
    if not test.significant and test.mean != 0:
        test.seeds_needed = next((m for m in range(n + 1, 1001) if detectable(sd, m, alpha) <= abs(test.mean)),
                                 None)
    return test


def blocks_needed(mean: float, sd: float, arms: int, n: int, alpha: float) -> int | None:
    """How many passes (repeats) of ``arms`` arms would detect ``mean`` with POWER's chance at ``alpha``, where a
    pair's value spreads by ``sd`` and the test has (arms - 1)(passes - 1) degrees of freedom (``block_noise``);
    None past 1000 or where ``mean`` is 0."""
    from scipy import stats

    if mean == 0 or sd <= 0:
        return None
    return next((m for m in range(n + 1, 1001) if float(stats.t.ppf(1 - alpha / 2, (arms - 1) * (m - 1))
                                                         + stats.t.ppf(POWER, (arms - 1) * (m - 1)))
                 * sd / math.sqrt(m) <= abs(mean)), None)


def detectable(sd: float, n: int, alpha: float) -> float:
    """The smallest true mean ``n`` values spreading by ``sd`` find with POWER's chance at ``alpha``."""
    from scipy import stats

    return float(stats.t.ppf(1 - alpha / 2, n - 1) + stats.t.ppf(POWER, n - 1)) * sd / math.sqrt(n)


def block_noise(rows: list[list[float]]) -> tuple[float, int]:
    """One value's noise (standard deviation) and its degrees of freedom, from ``rows`` (an arm each, a value per
    pass) as randomized blocks: value = the arm's level + the pass's shift + noise, the residuals after both
    taken out, (arms - 1)(passes - 1) degrees of freedom. (0, 0) with fewer than two full rows of equal length."""
    if len(rows) < 2 or len({len(row) for row in rows}) > 1 or len(rows[0]) < 2:
        return 0.0, 0
    k, n = len(rows), len(rows[0])
    df = (k - 1) * (n - 1)
    grand = statistics.fmean(v for row in rows for v in row)
    arm_means = [statistics.fmean(row) for row in rows]
    pass_means = [statistics.fmean(row[j] for row in rows) for j in range(n)]
    return math.sqrt(sum((row[j] - arm_means[i] - pass_means[j] + grand) ** 2
                         for i, row in enumerate(rows) for j in range(n)) / df), df


def p_text(p: float) -> str:
    """``p = 0.00312`` (three figures below 0.1, so one just under a level never reads as the level itself), or
    ``p < 0.0001``."""
    return "p < 0.0001" if p < 1e-4 else f"p = {p:.3g}" if p < 0.1 else f"p = {p:.2g}"
