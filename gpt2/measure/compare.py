"""The one judge of a comparison: each arm's runs against its reference arm's, run paired with run of the same repeat.

An *arm* is what a comparison measures: a grid's setting, a ladder's rung. Each arm runs once
per repeat, in alternating order, and repeat r trains one seed for every arm (procedure.repeat_seeds), so an
arm's run and
its reference's run of the same repeat are neighbours in time and start from the same draw of
weights and batches. The grid and the ladder build their arms from DVC experiments
(:func:`read_run`), give each its reference (the grid: the first setting; the ladder: the carried
rung above), and call :func:`judge`; report.py writes what users read.

Speed. An arm's tokens/s over its reference's, run by run; the ratio is their median. A gain is
*inside noise* when the paired ratios disagree on its direction, when it is no larger than
the noise floor (how far paired ratios typically disagree on this machine: the median over the
arms of their max - min, or the move of an arm that ran what its reference ran, ``inert``), or
when a t-test on the logarithms of its paired ratios does not hold at ``alpha``. That test weighs
an arm's mean against a run's noise read from every arm's runs (:func:`speed_tests`: one machine,
one noise; a ladder of ten rungs run twice has nine degrees of freedom where one rung has one), so a
verdict "faster" on noise alone comes about ``alpha`` of the time; the floor alone let a change that
does nothing read faster or slower in about 3 of 10 two-repeat comparisons.

Quality. The final val loss an arm ends with minus its reference's, repeat by repeat, samples
how the change moves the loss across seeds. A paired t-test on those differences (Student's t,
n - 1 degrees of freedom) gives the p-value and a (1 - alpha) interval. The losses it reads are
kept to 4 decimals (metrics.json), so the spread it tests against is never taken below what that
rounding alone spreads a difference by: two seeds that both read -0.0001 are no proof. It suits a few runs: it
weighs the size of the differences, where a sign or permutation test cannot go below p = 2/2^n
(0.25 with 3 seeds) whatever they show; its assumption, differences spread normally, is what
seed-to-seed losses of one setup are close to. A lower loss counts when the test holds at
``alpha`` and it is larger than the scored text's noise (2 × √(se₁² + se₂²), the windows'
standard errors), so neither a lucky seed nor a lucky choice of windows passes for a gain
(README, "Compare optimizations"). A higher loss counts on the test alone: that bound treats the two runs'
windows as independent where they are the same windows, so it is wide, and it may keep a gain from being
claimed but never excuses a loss every seed agrees on.

At equal quality. Each run's val curve (val loss against training time) is read where it first
reaches the val loss its repeat's baseline run ends with, interpolated between evals. How much
sooner an arm gets somewhere is read against its reference's run of the same repeat at the
higher of their two final val losses (a loss both reach: "the same val loss"); it counts when its paired ratios
are outside the noise floor and the t-test on their logarithms holds at ``alpha``. An arm that ends higher
outside noise does not win by it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable

from gpt2.core import paths
from gpt2.core.config import SAME_WORK
from gpt2.measure.significance import Test, block_noise, blocks_needed, mean_test, p_text, paired_test

ALPHA = 0.01  # the significance level of every test of a comparison: modded-nanogpt's for a record
LOSS_RESOLUTION = 1e-4  # the val losses a comparison reads are rounded to 4 decimals (run/figures.py)
TOO_NOISY = 0.10  # paired ratios that disagree by more than this: no gain of that size can be read
ADVICE = {"rung": "run it on an idle machine, with more steps per run (--steps) or more repeats (--repeats)",
          "setting": "run it on an idle machine, with more steps per run (-S train.max_steps=...) or more repeats "
                     "(--repeats)"}

Curve = list[tuple[float, float, float]]  # a run's val curve: (training seconds, tokens, val loss) per eval


@dataclass(frozen=True)
class Spread:
    """A figure over an arm's runs: their median, and the lowest and highest of them."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Spread | None:
        return cls(statistics.median(values), min(values), max(values)) if values else None

    def shown(self, form: str) -> str:
        """``110.0 (100.0–120.0)`` for ``form`` ``.1f``."""
        return f"{self.median:{form}} ({self.low:{form}}–{self.high:{form}})"

    def overlaps(self, other: Spread) -> bool:
        return self.low <= other.high and other.low <= self.high


@dataclass
class Run:
    """One experiment of a comparison as its files recorded it; ``ok`` is False where it failed or is missing."""

    name: str
    repeat: int
    seed: int | None = None  # train.seed it trained
    ok: bool = False
    tokens_per_s: float | None = None
    tokens_per_s_wall: float | None = None
    step_ms: float | None = None
    peak_mem_gb: float | None = None
    mfu: float | None = None
    val_loss: float | None = None  # training's last val loss, ± its standard error over the scored windows
    val_loss_se: float | None = None
    eval_val_loss: float | None = None  # the evaluate stage's, where the experiment ran it
    eval_val_loss_se: float | None = None
    val_bpb: float | None = None  # training's last val loss in bits per byte of text
    eval_val_bpb: float | None = None  # the evaluate stage's
    holdout_loss: float | None = None  # on windows no verdict reads (train.holdout_windows), after the last step
    holdout_loss_se: float | None = None
    cost_usd: float | None = None
    device_hours: float | None = None
    price_per_hour: float | None = None  # all its devices together (USD)
    target: dict[str, Any] | None = None  # the trainer's record of a target val loss: reached, time_s, tokens, steps
    curve: Curve | None = None
    runtime: dict[str, Any] = field(default_factory=dict)  # what really ran (the trainer's summary)
    machine: dict[str, float] | None = None  # how busy other work kept the cores while it was timed
    warming_up: tuple[int, int] | None = None  # (its last step, train.warmup_steps) where it ended in the lr warm-up


def read_run(name: str, repeat: int, seed: int | None, exp: Any, curve: Curve | None = None) -> Run:
    """A run's figures from its experiment (``experiments.Experiment``; None where it did not finish)."""
    run = Run(name, repeat, seed)
    metrics = (exp.metrics.get(paths.TRAIN_METRICS) or {}) if exp else {}
    perf = metrics.get("perf") or {}
    if not perf.get("tokens_per_s"):
        return run
    val, cost = metrics.get("val") or {}, metrics.get("cost") or {}
    scored = (exp.metrics.get(paths.EVAL_METRICS) or {}).get("eval") or {}
    summary = exp.files.get(paths.TRAIN_SUMMARY) or {}
    price = (summary.get("cost") or {}).get("price_per_hour")
    run.ok = True
    run.tokens_per_s, run.tokens_per_s_wall = perf["tokens_per_s"], perf.get("tokens_per_s_wall")
    run.step_ms, run.mfu = perf.get("step_ms"), perf.get("mfu")
    run.peak_mem_gb = (metrics.get("mem") or {}).get("peak_gb")
    run.val_loss, run.val_loss_se = val.get("loss"), val.get("loss_se")
    run.eval_val_loss, run.eval_val_loss_se = scored.get("val_loss"), scored.get("val_loss_se")
    run.val_bpb, run.eval_val_bpb = val.get("bpb"), scored.get("val_bpb")
    run.cost_usd, run.device_hours = cost.get("usd"), cost.get("device_hours")
    run.price_per_hour = None if price is None else price * ((summary.get("perf") or {}).get("world_size") or 1)
    held = summary.get("val") or {}
    run.holdout_loss, run.holdout_loss_se = held.get("holdout_loss"), held.get("holdout_loss_se")
    run.target, run.curve = metrics.get("target"), curve
    run.runtime = summary.get("runtime") or {}
    run.machine = metrics.get("machine")
    steps, warmup = summary.get("steps"), (exp.params.get("train") or {}).get("warmup_steps")
    if isinstance(steps, int) and isinstance(warmup, int) and steps < warmup:
        run.warming_up = (steps, warmup)
    return run


@dataclass
class Ratio:
    """An arm's figure over another arm's, run by run (the same repeat), and whether it can be told from noise."""

    paired: list[float] = field(default_factory=list)
    median: float | None = None
    inside_noise: bool | None = None
    test: Test | None = None  # over the logarithms of ``paired``; a speed ratio's against every arm's noise

    @classmethod
    def of(cls, paired: list[float]) -> Ratio:
        return cls(paired, statistics.median(paired) if paired else None)


@dataclass
class LossDiff:
    """An arm's final val loss minus its reference's, seed by seed, with the verdict on it."""

    by: str  # "evaluate" or "training": whose val loss (evaluate's where every run has it)
    per_seed: list[float]
    delta: float  # their mean
    apart: bool | None  # the verdict: lower, significant at alpha and beyond the scored text's noise; higher,
    # significant at alpha; None: cannot tell
    beyond_text_noise: bool | None = None  # |delta| more than 2 × √(se₁² + se₂²), the runs' median errors
    test: Test | None = None


@dataclass
class Versus:
    """An arm against its reference arm, run paired with run of the same repeat."""

    reference: int
    speed: Ratio  # tokens/s
    sooner: Ratio  # how many times sooner it reaches the higher of the two final val losses
    loss: LossDiff | None = None
    holdout: LossDiff | None = None  # the same on the held-out windows, where the runs scored them
    to_target: Ratio | None = None  # the reference's time to the target over this arm's, run by run, where both
    # reached it (``--target``): how many times sooner, tested as ``sooner`` is


@dataclass
class AtQuality:
    """What an arm took to reach the val loss the baseline ends with, run by run (the same repeat's baseline run
    sets each run's mark), and how that compares with the baseline's own time to it."""

    reached: int  # runs that reached their mark
    runs: int
    early: int = 0  # runs whose first eval was already below their mark: there some time before it, unknown when
    early_by_s: float | None = None  # the latest of those first evals' training times: each got there by then
    time_s: Spread | None = None  # training time to the mark (compile included, evals not)
    tokens: float | None = None  # median tokens to the mark
    cost_usd: float | None = None  # median cost of that time, at the run's price per device-hour
    vs_baseline: Ratio = field(default_factory=Ratio)  # how much sooner than the baseline's run of the same repeat


@dataclass
class Target:
    """Time and tokens to a target val loss over the runs that reached it. No test of the final losses: a run stops
    at the first eval at or below the target (``train.stop_at_target``), so its final loss says only that it
    got there; how many did (``reached`` of the runs) is the figure."""

    loss: float
    reached: int
    time_s: Spread | None = None
    tokens: float | None = None
    steps: float | None = None


@dataclass
class Arm:
    """One thing a comparison measures (a setting, a rung): its runs by repeat and, once judged, its figures."""

    label: str
    runs: list[Run]  # by repeat; a failed run is there with ok False
    reference: int | None = None  # the arm it is compared with; None for the baseline
    inert: bool = False  # ran what its reference ran (the trainer says so): its move is this machine's noise
    same_work: bool = False  # differs from its reference only in params that change no step's work (SAME_WORK):
    # compared for quality, while its speed move, like an inert arm's, is this machine's noise
    skipped: str = ""  # why it was not run (it cannot act on this device)
    setting: dict[str, Any] = field(default_factory=dict)  # what it sets (a grid's setting, a rung's changes)
    changes: tuple[str, ...] | None = None  # the params.yaml keys it changes against its reference (section.key);
    # None: the keys where its setting and its reference's differ (a grid's settings are whole)
    runtime: dict[str, Any] = field(default_factory=dict)  # what really ran, its first finished run's
    tokens_per_s: Spread | None = None
    tokens_per_s_wall: float | None = None
    step_ms: Spread | None = None
    peak_mem_gb: float | None = None
    mfu: float | None = None
    val_loss: Spread | None = None  # the final val loss it is judged by, over its seeds
    val_loss_se: float | None = None  # the median run's standard error over the scored windows
    val_bpb: float | None = None  # its val loss in bits per byte of text, median over its seeds
    cost_usd: float | None = None
    device_hours: float | None = None
    vs_baseline: Ratio = field(default_factory=Ratio)  # tokens/s over the baseline's, paired by repeat
    versus: Versus | None = None
    at_quality: AtQuality | None = None
    target: Target | None = None

    @property
    def done(self) -> list[Run]:
        return [r for r in self.runs if r.ok]


@dataclass
class Noise:
    """How noisy the comparison was: the speed floor, and the baseline's own spread over its seeds."""

    speed_spread: float  # the typical disagreement of arms' paired tokens/s ratios
    speed_floor: float  # at least that, or the largest move of an inert arm
    sooner_floor: float
    alpha: float
    seeds: list[int | None]  # by repeat
    speed_df: int = 0  # the speed tests' degrees of freedom: a run's noise, read from every arm's runs
    loss_sd: float | None = None  # the baseline's final val loss, standard deviation over its seeds
    loss: Spread | None = None
    time_to_loss: Spread | None = None  # the baseline's runs' time to the median of their curves' last val loss


@dataclass
class Judged:
    """Every arm judged, with the comparison's noise; ``by``: whose val loss decides ("evaluate", "training")."""

    arms: list[Arm]
    noise: Noise
    by: str

    @property
    def failed(self) -> list[str]:
        return [r.name for a in self.arms if not a.skipped for r in a.runs if not r.ok]

    @property
    def compared(self) -> list[Arm]:
        return [a for a in self.arms if a.versus and a.versus.speed.median is not None and not a.inert]


def judge(arms: list[Arm], alpha: float = ALPHA, target: float | None = None) -> Judged:
    """Every arm's figures and its comparison with its reference; ``target``: a val loss the runs trained to."""
    by = "evaluate" if all(r.eval_val_loss is not None for a in arms for r in a.done) and any(
        a.done for a in arms) else "training"
    for arm in arms:
        _figures(arm, by, alpha, target)
    base = arms[0]
    for arm in arms:
        arm.vs_baseline = Ratio.of(_paired(arm, base, lambda r: r.tokens_per_s))
        if arm.reference is not None and arm.done and arms[arm.reference].done:
            arm.versus = _versus(arm, arm.reference, arms[arm.reference], by, alpha)
    _at_quality(arms, alpha)
    compared = [a for a in arms if a.versus]
    for arm in compared:
        above = arms[arm.reference].setting
        changed = set(arm.changes) if arm.changes is not None else {
            k for k in {*arm.setting, *above} if arm.setting.get(k) != above.get(k)}
        arm.same_work = bool(changed) and changed <= SAME_WORK
    speed_df = speed_tests(arms, alpha)
    spread = typical_disagreement([a.versus.speed.paired for a in compared if not a.inert])
    inert = [abs(a.versus.speed.median - 1) for a in compared
             if (a.inert or a.same_work) and a.versus.speed.median]
    floor = max([spread, *inert])
    sooner_floor = max(floor, typical_disagreement([a.versus.sooner.paired for a in compared]))
    for arm in compared:
        versus, above = arm.versus, arms[arm.reference]
        versus.speed.inside_noise = arm.inert or arm.same_work or _ratio_noise(versus.speed, floor)
        versus.sooner.inside_noise = _ratio_noise(versus.sooner, sooner_floor)
        if versus.to_target is not None:
            versus.to_target.inside_noise = _ratio_noise(versus.to_target, sooner_floor)
    for arm in arms[1:]:
        if arm.at_quality:
            arm.at_quality.vs_baseline.inside_noise = _ratio_noise(arm.at_quality.vs_baseline, sooner_floor)
    return Judged(arms, _noise(base, spread, floor, sooner_floor, speed_df, alpha, by), by)


def _figures(arm: Arm, by: str, alpha: float, target: float | None) -> None:
    done = arm.done
    if not done:
        return
    arm.runtime = done[0].runtime
    arm.tokens_per_s = Spread.of([r.tokens_per_s for r in done])
    arm.step_ms = Spread.of([r.step_ms for r in done if r.step_ms is not None])
    arm.tokens_per_s_wall = median_known([r.tokens_per_s_wall for r in done])
    arm.peak_mem_gb = max((r.peak_mem_gb for r in done if r.peak_mem_gb is not None), default=None)
    arm.mfu = median_known([r.mfu for r in done])
    losses = [final_loss(r, by) for r in done if final_loss(r, by)[0] is not None]
    arm.val_loss = Spread.of([loss for loss, _ in losses])
    arm.val_loss_se = median_known([se for _, se in losses])
    arm.val_bpb = median_known([r.eval_val_bpb if by == "evaluate" else r.val_bpb for r in done])
    arm.cost_usd = median_known([r.cost_usd for r in done])
    arm.device_hours = median_known([r.device_hours for r in done])
    if target is not None:
        arm.target = _target(done, target)


def final_loss(run: Run, by: str) -> tuple[float | None, float | None]:
    """The val loss a run is judged by, with its standard error over the scored windows."""
    return (run.eval_val_loss, run.eval_val_loss_se) if by == "evaluate" else (run.val_loss, run.val_loss_se)


def _paired(arm: Arm, other: Arm, figure: Callable[[Run], float | None]) -> list[float]:
    """``figure`` of each of the arm's runs over the other arm's run of the same repeat."""
    out = []
    for mine, theirs in zip(arm.runs, other.runs):
        a, b = (figure(mine), figure(theirs)) if mine.ok and theirs.ok else (None, None)
        if a is not None and b:
            out.append(a / b)
    return out


def _versus(arm: Arm, index: int, above: Arm, by: str, alpha: float) -> Versus:
    versus = Versus(index, Ratio.of(_paired(arm, above, lambda r: r.tokens_per_s)),
                    _sooner_ratio(above.runs, arm.runs, alpha))
    versus.loss = loss_diff(arm.runs, above.runs, lambda r: final_loss(r, by), by, alpha)
    versus.holdout = loss_diff(arm.runs, above.runs, lambda r: (r.holdout_loss, r.holdout_loss_se), "held-out",
                               alpha)
    if arm.target and above.target:
        versus.to_target = _tested(_paired(above, arm, lambda r: r.target["time_s"]
                                           if (r.target or {}).get("reached") else None), alpha)
    return versus


def loss_diff(runs: list[Run], reference: list[Run], figure: Callable[[Run], tuple[float | None, float | None]],
              by: str, alpha: float) -> LossDiff | None:
    """A loss (``figure``: value and standard error) of ``runs`` minus ``reference``'s, seed by seed, tested."""
    pairs = [(figure(a), figure(b)) for a, b in zip(runs, reference) if a.ok and b.ok]
    pairs = [(a, b) for a, b in pairs if a[0] is not None and b[0] is not None]
    if not pairs:
        return None
    per_seed = [a[0] - b[0] for a, b in pairs]
    test = paired_test(per_seed, alpha, LOSS_RESOLUTION)
    delta = statistics.fmean(per_seed)
    errors = [median_known([a[1] for a, _ in pairs]), median_known([b[1] for _, b in pairs])]
    text = (abs(delta) > 2 * math.hypot(*errors) if None not in errors and all(map(math.isfinite, errors))
            else None)  # the mean difference against the scored text's noise (the runs' median standard errors)
    apart = None if test is None else bool(test.significant and (delta > 0 or text is not False))
    return LossDiff(by, per_seed, delta, apart, text, test)


def confirm(arm: Arm) -> str:
    """Why a quality win of ``arm`` does not hold on the held-out windows ("" where it does, or where it claims no
    quality): a lower val loss must be lower there too, at the level; sooner to the same loss must not end higher
    there outside noise. "not scored" where the runs scored no held-out windows."""
    versus = arm.versus
    lower = bool(versus and versus.loss and versus.loss.apart and versus.loss.delta < 0)
    if not claims_quality(arm):
        return ""
    held = versus.holdout
    if held is None or held.test is None:
        return "not scored on held-out windows"
    if lower and not (held.delta < 0 and held.test.significant):
        return f"held-out val loss {held.delta:+.3f} ({p_text(held.test.p)})"
    if held.apart and held.delta > 0:
        return f"held-out val loss {held.delta:+.3f} ({p_text(held.test.p)}): higher"
    return ""


def claims_quality(arm: Arm) -> bool:
    """Whether ``arm`` claims a better model: a lower val loss, or the same loss sooner, outside noise."""
    versus = arm.versus
    return bool(versus and ((versus.loss and versus.loss.apart and versus.loss.delta < 0)
                            or (versus.sooner.inside_noise is False and versus.sooner.median > 1)))


def warming_up(arm: Arm) -> str:
    """Why a quality win of ``arm`` says nothing of training at its learning rate ("" where it claims none, or its
    runs trained past the warm-up): its runs ended inside the learning rate's warm-up, so their losses compare
    warm-ups, and a learning rate chosen there is chosen for the first steps alone."""
    ends = [run.warming_up for run in arm.done if run.warming_up]
    if not ends or not claims_quality(arm):
        return ""
    return (f"its runs end at step {ends[0][0]}, inside the learning rate's warm-up (train.warmup_steps "
            f"{ends[0][1]}): their val losses compare warm-ups; train longer or lower train.warmup_steps")


def _sooner_ratio(reference: list[Run], runs: list[Run], alpha: float) -> Ratio:
    return _tested([r for above, mine in zip(reference, runs)
                    if above.ok and mine.ok and (r := sooner(above.curve, mine.curve)) is not None], alpha)


def _tested(paired: list[float], alpha: float) -> Ratio:
    """A quality ratio, run by run, with the t-test on its logarithms."""
    ratio = Ratio.of(paired)
    ratio.test = paired_test([math.log(r) for r in paired], alpha) if all(r > 0 for r in paired) else None
    return ratio


def _ratio_noise(ratio: Ratio, floor: float) -> bool | None:
    """A ratio is inside noise when its paired runs cannot tell it from the machine's noise, or the t-test on its
    logarithms does not hold; None where it has no pairs."""
    if ratio.median is None:
        return None
    return ratio_inside_noise(ratio.paired, floor) or not (ratio.test and ratio.test.significant)


def _at_quality(arms: list[Arm], alpha: float) -> None:
    """Each arm's time and tokens to the baseline's final val loss, run by run, and how much sooner than the
    baseline's run of the same repeat. Nothing where the baseline has no curve."""
    marks = [run.curve[-1][2] if run.ok and run.curve else None for run in arms[0].runs]
    if all(mark is None for mark in marks):
        return
    for arm in arms:
        ran = [r for r in arm.done if r.curve]
        if not ran:
            continue
        hits = [(hit, run) for run, mark in zip(arm.runs, marks)
                if run.ok and run.curve and mark is not None and (hit := reaches(run.curve, mark))]
        early = [run.curve[0][0] for run, mark in zip(arm.runs, marks)
                 if run.ok and run.curve and mark is not None and run.curve[0][2] < mark]
        figures = AtQuality(reached=len(hits), runs=len(ran), early=len(early), early_by_s=max(early, default=None))
        if hits:
            figures.time_s = Spread.of([hit[0] for hit, _ in hits])
            figures.tokens = statistics.median(hit[1] for hit, _ in hits)
            figures.cost_usd = median_known([hit[0] * r.price_per_hour / 3600 if r.price_per_hour is not None
                                             else None for hit, r in hits])
        figures.vs_baseline = _sooner_ratio(arms[0].runs, arm.runs, alpha)
        arm.at_quality = figures


def _target(done: list[Run], target: float) -> Target:
    reached = [r.target for r in done if (r.target or {}).get("reached")]
    figures = Target(target, len(reached))
    if reached:
        figures.time_s = Spread.of([t["time_s"] for t in reached])
        figures.tokens = statistics.median(t["tokens"] for t in reached)
        figures.steps = statistics.median(t["steps"] for t in reached)
    return figures


def _noise(base: Arm, spread: float, floor: float, sooner_floor: float, speed_df: int, alpha: float,
           by: str) -> Noise:
    noise = Noise(spread, floor, sooner_floor, alpha, [r.seed for r in base.runs], speed_df)
    losses = [loss for r in base.done if (loss := final_loss(r, by)[0]) is not None]
    if len(losses) >= 2:
        noise.loss_sd, noise.loss = statistics.stdev(losses), Spread.of(losses)
        curves = [r.curve for r in base.done if r.curve]  # the mark from the curves it is read on (training's)
        mark = statistics.median(curve[-1][2] for curve in curves) if curves else None
        times = [hit[0] for curve in curves if (hit := reaches(curve, mark))]
        noise.time_to_loss = Spread.of(times) if len(times) >= 2 else None
    return noise


def speed_tests(arms: list[Arm], alpha: float) -> int:
    """Each compared arm's t-test on its speed (``versus.speed.test``): the mean logarithm of its paired tokens/s
    ratios against a run's noise read from every arm at once. The runs form blocks: repeat r of every arm ran
    in one pass, in turn, so log tokens/s = the arm's level + the pass's drift + noise (``block_noise``), from
    the arms that ran every repeat: one machine's one noise. Two repeats of ten rungs give nine degrees of
    freedom where one rung against its reference gives one (there the test is the plain paired t-test).
    Returns the degrees of freedom (0: no test)."""
    rows = [[math.log(r.tokens_per_s) for r in arm.runs] for arm in arms
            if not arm.skipped and all(r.ok and r.tokens_per_s for r in arm.runs)]
    sd, df = block_noise(rows)
    for arm in arms if df else []:
        ratio = arm.versus.speed if arm.versus else None
        if ratio is not None and len(ratio.paired) > 1 and all(r > 0 for r in ratio.paired):
            ratio.test = mean_test([math.log(r) for r in ratio.paired], sd * math.sqrt(2), df, alpha)  # of a pair
            if not ratio.test.significant:
                ratio.test.seeds_needed = blocks_needed(ratio.test.mean, sd * math.sqrt(2), len(rows), len(rows[0]),
                                                        alpha)
    return df


def typical_disagreement(paired: list[list[float]]) -> float:
    """How far an arm's paired ratios typically disagree: the median of their max - min (0 with no pairs)."""
    spreads = [max(p) - min(p) for p in paired if len(p) > 1]
    return statistics.median(spreads) if spreads else 0.0


def ratio_inside_noise(paired: list[float], floor: float) -> bool:
    """Whether a ratio is no gain that these runs can tell from noise (one pair alone never can)."""
    if len(paired) < 2:
        return True
    ratio = statistics.median(paired)
    return min(paired) <= 1 <= max(paired) or abs(ratio - 1) <= floor


def median_known(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def reaches(curve: Curve, loss: float) -> tuple[float, float] | None:
    """The training time and tokens at which a val curve first reaches ``loss``: interpolated linearly between
    the two evals around it; None when it never does, or when its first eval is already below it (it got there
    some time before, unknown: the run evaluates too seldom). A first eval exactly at ``loss`` (the mark a run's
    own last eval sets) is read there."""
    before = None
    for time_s, tokens, value in curve:
        if value <= loss:
            if before is None:
                return (time_s, tokens) if value == loss else None
            if before[2] <= value:
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


def win(arm: Arm, at_equal_time: bool) -> tuple[tuple[float, float], str] | None:
    """Whether an arm wins against its reference, and why; None when it does not.

    It wins by a gain outside noise and loses nowhere outside it. Reaching the same val loss sooner
    is the fullest measure (it counts the speed of a step and what a step learns) and decides where
    it is outside noise; a lower val loss wins too. More tokens/s wins when the runs train the same
    steps, not under a time budget, where only what the time bought counts. A higher val loss, or
    the same loss reached later, loses; so does fewer tokens/s over the same steps unless the loss
    comes sooner all the same. Nothing wins from one run on either side. The score ranks winners: how
    much sooner, else faster, then how much lower."""
    versus = arm.versus
    if versus is None or arm.inert or len(arm.done) < 2 or len(versus.speed.paired) < 2:
        return None
    sooner_by = versus.sooner.median if versus.sooner.inside_noise is False else None
    faster = versus.speed.median if versus.speed.inside_noise is False else None
    loss = versus.loss
    lower, higher = bool(loss and loss.apart and loss.delta < 0), bool(loss and loss.apart and loss.delta > 0)
    if higher or (sooner_by is not None and sooner_by < 1):
        return None
    if not at_equal_time and faster is not None and faster < 1 and sooner_by is None:
        return None
    reasons = []
    if sooner_by is not None and sooner_by > 1:
        reasons.append(f"{sooner_by:.2f}× sooner to the same val loss ({p_text(versus.sooner.test.p)})")
    if not at_equal_time and faster is not None and faster > 1:
        reasons.append(f"{faster:.2f}× the tokens/s")
    if lower:
        reasons.append(f"val loss {loss.delta:+.3f}" + (" at equal time" if at_equal_time else "")
                       + f" ({p_text(loss.test.p)})")
    if not reasons:
        return None
    score = sooner_by if sooner_by is not None and sooner_by > 1 else faster if not at_equal_time and faster else 1.0
    return (score, -(loss.delta if loss else 0.0)), ", ".join(reasons) + ", outside noise"
