"""What users read of a judged comparison, for the grid and the ladder alike: the verdict, the table, the PNG and the
JSON (the MLflow parent run is gpt2/measure/parent_run.py's).

Each command names its arms and adds its own columns (a grid's keys, a ladder's rung and what ran);
everything that judges is written here once, over :class:`gpt2.measure.compare.Judged`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

from gpt2.core.plots import png, pyplot
from gpt2.measure.apply import Change
from gpt2.measure.compare import (ADVICE, TOO_NOISY, AtQuality, Arm, Judged, LossDiff, Ratio, confirm, final_loss,
                                  ratio_inside_noise, warming_up, win)
from gpt2.measure.significance import Test, p_text
from gpt2.run import machine_load
from gpt2.run.figures import FEW_EVALS
from gpt2.run.names import json_value


METHOD = ("A speed ratio is the median of each run's tokens/s over its reference's run of the same repeat. Repeat r"
          " trains the same seed for every arm, its own: a val loss difference is the mean over the seeds of each "
          "run's final val loss minus its reference's run of the same seed, ± its interval, with a paired t-test's "
          "p-value; it counts (is outside noise) where p is under the level and the two losses are also more than 2"
          " × √(se₁² + se₂²) apart where the runs give them, the standard errors over the scored windows "
          "(evaluate's val loss where every run has it). Time to the baseline's loss: the training time (compile "
          "included, evals not) at which a run's val curve first reaches the val loss its repeat's baseline run "
          "ends with, interpolated between evals; a ratio at equal loss compares two runs of the same repeat at the"
          " higher of their final val losses (a loss both reach), and counts where its paired runs are outside the "
          "speed noise and the t-test on their logarithms holds. Speeds and times: median (min–max) over the runs; "
          "costs at each run's price per device-hour (train.price_per_hour).")


@dataclass(frozen=True)
class Words:
    """How a command's report names its arms and what each is compared with."""

    what: str  # "setting", "rung"
    against: str  # "the baseline", "the rung above"
    at_equal_time_s: float | None = None  # every run trained this long (train.time_budget_s)
    log: str = "dvc.log"  # the DVC log beside the report, which holds a failed run's output


@dataclass(frozen=True)
class Column:
    head: str
    cell: Callable[[int, Arm], str]


def counted(n: int, word: str) -> str:
    """``1 setting``, ``3 settings``."""
    return f"{n} {word}" + ("" if n == 1 else "s")


def ratio_shown(value: float | None, inside_noise: bool | None = False) -> str:
    if value is None:
        return ""
    return f"{value:.2f}× (inside noise)" if inside_noise else f"{value:.2f}×"


def loss_shown(value: float | None, error: float | None) -> str:
    """'5.938 ± 0.059': a val loss with its standard error over the scored windows, when known."""
    if value is None:
        return ""
    return f"{value:.3f} ± {error:.3f}" if error is not None and math.isfinite(error) else f"{value:.3f}"


def usd_shown(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}" if value < 0.01 else f"{value:.2f}"


def p_shown(test: Test | None) -> str:
    return "" if test is None else p_text(test.p)


def loss_diff_shown(loss: LossDiff | None) -> str:
    """'-0.050 ± 0.012 (p = 0.003)': the mean difference over seeds, its interval's half-width, its p-value."""
    if loss is None:
        return ""
    test = loss.test
    shown = f"{loss.delta:+.3f}" + (f" ± {test.high - test.mean:.3f} ({p_shown(test)})" if test else "")
    return shown + ("" if loss.apart else " (inside noise)")


def quality_shown(figures: AtQuality | None) -> str:
    """An arm's time to the baseline's final val loss, as a table shows it. A run whose first eval is already below
    its mark got there before that eval, when is not known: said apart from a run that never gets there."""
    if figures is None:
        return ""
    early = (f"≤ {figures.early_by_s:.1f} s (already at the first eval, {figures.early}/{figures.runs})"
             if figures.early else "")
    if not figures.reached:
        return early or f"not reached (0/{figures.runs})"
    return figures.time_s.shown(".1f") + (f" reached {figures.reached}/{figures.runs}"
                                          if figures.reached < figures.runs else "") + (f", {early}" if early else "")


def sooner_shown(ratio: Ratio | None) -> str:
    if ratio is None or ratio.median is None:
        return ""
    return ratio_shown(ratio.median, ratio.inside_noise) + (f" ({p_shown(ratio.test)})" if ratio.test else "")


def columns(judged: Judged, words: Words) -> list[Column]:
    """The columns every comparison shows, after the command's own: runs, speed, quality and cost, each against
    the arm's reference; ``vs baseline`` columns too where some arm's reference is not the baseline."""
    arms, by = judged.arms, judged.by
    chained = any(a.reference not in (None, 0) for a in arms)
    ref = "the rung above" if chained else "baseline"
    quality = any(a.at_quality for a in arms)
    priced = any(a.cost_usd is not None or a.at_quality and a.at_quality.cost_usd is not None for a in arms)
    has_mfu = any(a.mfu is not None for a in arms)

    def versus(cell: Callable[[Arm], str]) -> Callable[[int, Arm], str]:
        return lambda i, a: "baseline" if i == 0 else cell(a) if a.versus else ""

    out = [Column("runs", lambda i, a: f"{len(a.done)}/{len(a.runs)}"),
           Column("ms/step median (min–max)", lambda i, a: a.step_ms.shown(".1f") if a.step_ms else ""),
           Column("tokens/s median (min–max)", lambda i, a: a.tokens_per_s.shown(",.0f") if a.tokens_per_s else ""),
           Column(f"speed vs {ref}", versus(lambda a: ratio_shown(a.versus.speed.median, a.versus.speed.inside_noise)))]
    if chained:
        out.append(Column("speed vs baseline", lambda i, a: ratio_shown(a.vs_baseline.median) if a.done else ""))
    out += [Column(f"{by}'s val loss, median over seeds (± s.e.)",
                   lambda i, a: loss_shown(a.val_loss.median, a.val_loss_se) if a.val_loss else ""),
            Column(f"loss vs {ref}, mean over seeds (± {100 * (1 - judged.noise.alpha):g}% interval)",
                   versus(lambda a: loss_diff_shown(a.versus.loss)))]
    if any(a.versus and a.versus.holdout for a in arms):  # --apply's check, on windows no verdict reads
        out.append(Column(f"held-out loss vs {ref}", versus(lambda a: loss_diff_shown(a.versus.holdout)
                                                            if a.versus.holdout else "")))
    if any(a.val_bpb is not None for a in arms):  # the field's unit: runs of other tokenizers or text compare
        out.append(Column("val bits per byte", lambda i, a: f"{a.val_bpb:.4f}" if a.val_bpb is not None else ""))
    if quality:
        out += [Column("time to the baseline's loss (s)", lambda i, a: quality_shown(a.at_quality)),
                Column("vs baseline at equal loss", lambda i, a: "baseline" if i == 0 and a.at_quality else
                       sooner_shown(a.at_quality.vs_baseline) if a.at_quality else "")]
        if chained:
            out.append(Column(f"vs {ref} at equal loss", versus(lambda a: sooner_shown(a.versus.sooner))))
    out.append(Column("peak mem (GB)", lambda i, a: f"{a.peak_mem_gb:.2f}" if a.peak_mem_gb is not None else ""))
    if has_mfu:
        out.append(Column("MFU", lambda i, a: f"{100 * a.mfu:.1f}%" if a.mfu is not None else ""))
    out.append(Column("device-hours", lambda i, a: f"{a.device_hours:.4f}" if a.device_hours is not None else ""))
    if priced:
        out += [Column("cost per run (USD)", lambda i, a: usd_shown(a.cost_usd)),
                Column("cost to the baseline's loss (USD)",
                       lambda i, a: usd_shown(a.at_quality.cost_usd if a.at_quality else None))]
    return out


def table(judged: Judged, own: list[Column], shared: list[Column], last: list[Column] = ()) -> str:
    """One row per arm: the command's ``own`` columns, the ``shared`` ones, then ``last``. An arm not run or
    failed says so in its first shared cell."""
    head = [c.head for c in (*own, *shared, *last)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, arm in enumerate(judged.arms):
        cells = [c.cell(i, arm) for c in own]
        if arm.skipped:
            cells += ["not run"] + [""] * (len(shared) - 1)
        elif not arm.done:
            cells += [f"0/{len(arm.runs)}", "failed"] + [""] * (len(shared) - 2)
        else:
            cells += [c.cell(i, arm) for c in shared]
        cells += [c.cell(i, arm) for c in last]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def verdict(judged: Judged, words: Words, repeats: int, changes: list[Change], label: Callable[[Arm], str],
            note: str = "") -> str:
    """The report's first words: what failed, the noise, the seeds, what is decided and how firmly, and what
    ``--apply`` writes (``note``: what more to say of it, or instead where it writes nothing)."""
    what, compared, parts = words.what, judged.compared, []
    if judged.failed:
        parts.append(failures(judged, words))
    if busy := loaded_runs(judged):
        parts.append(busy)
    evals = [len(r.curve) for a in judged.arms for r in a.done if r.curve]
    if evals and min(evals) < FEW_EVALS:
        parts.append(f"Some runs evaluated only {min(evals)} time(s): too few to read when a run reached the "
                     "baseline's val loss, so the figures at equal loss are missing or rough. Evaluate more often "
                     "(-S train.eval_interval=N, a few evals per run).")
    if compared or not judged.failed:
        parts.append(noise_sentence(judged, words, repeats))
        parts.append(same_work_moves(judged, words, label))
        parts.append(seeds_sentence(judged, words, repeats))
        parts.append(decided(judged, words, label))
    if unshown := [a for a in judged.arms if a.skipped]:
        parts.append("Not run, as this device cannot show them: "
                     + "; ".join(f"{label(a)} ({a.skipped})" for a in unshown) + ".")
    if changes:
        writes = ("would write had every run finished" if judged.failed
                  else "writes into params.yaml where it holds others")
        parts.append(f"The winning settings, which `--apply` {writes}: "
                     + ", ".join(f"{c.key}={json_value(c.value)}" for c in changes) + f". {note}".rstrip())
    else:
        parts.append(note or f"Nothing for `--apply` to write: no {what} wins outside noise without losing elsewhere.")
    return "\n\n".join(p for p in parts if p)


def loaded_runs(judged: Judged) -> str:
    """The runs that other work on the machine slowed while they were timed (gpt2/run/machine_load.py)."""
    loaded = [(r, r.machine) for a in judged.arms for r in a.done if machine_load.warning(r.machine)]
    if not loaded:
        return ""
    return ("**Measured beside other work:** " + "; ".join(
        f"{r.name} (other work kept {100 * m['others_busy']:.0f}% of the cores busy"
        + (f", steal {100 * m['steal']:.0f}%" if m["steal"] >= 0.005 else "") + ")" for r, m in loaded)
        + ". Their speed reads low and their pairs' ratios are not this machine's; measure again on a quiet "
          "machine (nothing else running) before trusting a speed verdict.")


def degrees_of_freedom(df: int) -> str:
    return f"{df} degree{'s' if df != 1 else ''} of freedom"


SEEDS_FOR_A_VERDICT = 3  # the fewest repeats to ask for a verdict: two seeds leave the quality test 1 degree of freedom


def noise_sentence(judged: Judged, words: Words, repeats: int) -> str:
    what, noise = words.what, judged.noise
    spread, floor = noise.speed_spread, noise.speed_floor
    compared = judged.compared
    noisy = sum(1 for a in compared if a.versus.speed.inside_noise)
    if repeats < 2:
        seeds = any("train.seed" in (a.setting or {}) for a in judged.arms)  # -S train.seed=1,2,3: one run each
        return (f"**One run per {what}: no interval, so no gain can be told from noise.** To read it, run it with "
                f"--repeats {SEEDS_FOR_A_VERDICT} or more" + (" (and without -S train.seed: the repeats set the seeds)"
                                                              if seeds else "")
                + ": each repeat's paired runs give the speed its noise, its seed the quality test its spread.")
    if floor > TOO_NOISY:
        return (f"**Too noisy to read speed:** a {what}'s paired runs disagree by {100 * spread:.0f}% (median)"
                + (f" and a {what} that changed no step's work here moved tokens/s by {100 * floor:.0f}%"
                   if floor > spread else "")
                + f"; the speed gains of {noisy} of {counted(len(compared), what)} are inside that noise, and no "
                  f"speed verdict below is firmer than it. To read it, {ADVICE[what]}.")
    shown = f"; {what}s that changed no step's work here moved it by up to {100 * floor:.1f}%" if floor > spread else ""
    tested = (f"no larger than {100 * floor:.1f}%, or where a t-test on the logarithms of its paired ratios, against "
              f"a run's noise read from every {what}'s runs ({degrees_of_freedom(noise.speed_df)}), does not hold at "
              f"p < {noise.alpha:g}" if noise.speed_df
              else f"or no larger than {100 * floor:.1f}%")
    return (f"Speed noise: each {what}'s runs, paired with {words.against}'s of the same repeat, agree on its tokens/s "
            f"ratio within {100 * spread:.1f}% (median over the {what}s){shown}. A gain whose paired runs disagree "
            f"on its direction, {tested}, is marked *inside noise*: it buys nothing this machine can measure "
            f"({noisy} of {counted(len(compared), what)}).")


def same_work_moves(judged: Judged, words: Words, label: Callable[[Arm], str]) -> str:
    """The arms that change no step's work (a learning rate, a seed) whose speed moved beyond the pairs' spread:
    the machine moved it, and the reader should know before reading any other speed verdict."""
    moved = [a for a in judged.compared if a.same_work and len(a.versus.speed.paired) > 1
             and not ratio_inside_noise(a.versus.speed.paired, judged.noise.speed_spread)]
    if not moved:
        return ""
    return ("**Speed moved where it cannot:** " + "; ".join(f"{label(a)} ({a.versus.speed.median:.2f}×)" for a in moved)
            + f" changes what a step computes, never how much, yet read at another speed than {words.against}. "
              "That move is this machine's (other work, a changing clock), so it is counted as noise: no speed "
              f"verdict here is firmer than it, and no such {words.what} is called faster or slower.")


def seeds_sentence(judged: Judged, words: Words, repeats: int) -> str:
    noise = judged.noise
    seeds = [s for s in noise.seeds if s is not None]
    if repeats < 2 or not seeds:
        return ""
    level = f"p < {noise.alpha:g}"
    said = (f"Quality noise: repeat r trains seed {', '.join(map(str, seeds))} (train.seed) for every {words.what}, "
            f"so each {words.what}'s val loss is compared with {words.against}'s seed by seed, by a paired t-test "
            f"at {level}; a lower val loss must also be more than 2 standard errors of the scored text apart (where "
            "the runs give their standard errors), a higher one needs the test alone.")
    if noise.loss is not None:
        said += (f" The baseline's final val loss ({judged.by}'s) moves by {noise.loss_sd:.4f} (standard deviation) "
                 f"from seed to seed ({noise.loss.low:.4f}–{noise.loss.high:.4f})")
        on = "" if judged.by == "training" else " (training's, on its val curve)"
        said += (f"; its time to its median final val loss{on}, {noise.time_to_loss.shown('.1f')} s."
                 if noise.time_to_loss else ".")
    # an arm whose loss moves by the same amount on every seed (one that ran the same numerics, or nearly: a fused
    # kernel's last bits) says nothing of the spread from seed to seed
    tests = [a.versus.loss.test for a in judged.compared if a.versus.loss and a.versus.loss.test
             and len(set(a.versus.loss.per_seed)) > 1]
    if tests:
        import statistics

        counts = sorted({t.n for t in tests})
        seeds = "–".join(map(str, counts[::len(counts) - 1 or 1]))  # "3", or "2–3" where a failed run left fewer
        said += (f" With {seeds} seeds, a val loss difference smaller than "
                 f"{statistics.median(t.detectable for t in tests):.4f} is likely missed at {level} (80% power, from "
                 f"the measured spread of the differences; median over the {words.what}s whose difference moves "
                 "from seed to seed).")
    return said


def failures(judged: Judged, words: Words, bold: str = "**") -> str:
    """Which runs failed, where their output is, and what that leaves of the verdict ("" where none failed)."""
    if not (failed := judged.failed):
        return ""
    total = sum(len(a.runs) for a in judged.arms if not a.skipped)
    return (f"{bold}{len(failed)} of {total} runs failed{bold} ({', '.join(failed)}; their output is in {words.log}): "
            + ("the verdict covers only the runs that finished." if judged.compared else
               f"no {words.what} could be compared, so there is no verdict."))


def headline(judged: Judged, words: Words, label: Callable[[Arm], str]) -> str:
    """The PNG's title: which runs failed, then what was decided; never "nothing differs" where nothing ran."""
    parts = [failures(judged, words, bold=""), decided(judged, words, label) if judged.compared or not judged.failed
             else ""]
    return " ".join(part for part in parts if part)


def decided(judged: Judged, words: Words, label: Callable[[Arm], str]) -> str:
    """Which arms are faster, sooner to the same val loss or lower outside noise, and which only more seeds
    would decide."""
    compared = [a for a in judged.arms if a.versus and not a.inert]
    speed = [a for a in compared if a.versus.speed.inside_noise is False]
    sooner = [a for a in compared if a.versus.sooner.inside_noise is False]
    apart = [a for a in compared if a.versus.loss and a.versus.loss.apart]
    when = f" at equal time ({words.at_equal_time_s:g} s)" if words.at_equal_time_s else ""
    groups = (("Faster outside noise", [a for a in speed if a.versus.speed.median > 1],
               lambda a: f"{a.versus.speed.median:.2f}×"),
              ("Slower outside noise", [a for a in speed if a.versus.speed.median < 1],
               lambda a: f"{a.versus.speed.median:.2f}×"),
              (f"Sooner than {words.against} to the same val loss outside noise",
               [a for a in sooner if a.versus.sooner.median > 1],
               lambda a: f"{a.versus.sooner.median:.2f}×, {p_shown(a.versus.sooner.test)}"),
              (f"Later than {words.against} to the same val loss outside noise",
               [a for a in sooner if a.versus.sooner.median < 1],
               lambda a: f"{a.versus.sooner.median:.2f}×, {p_shown(a.versus.sooner.test)}"),
              (f"Lower val loss{when} outside noise", [a for a in apart if a.versus.loss.delta < 0],
               lambda a: f"{a.versus.loss.delta:+.3f}, {p_shown(a.versus.loss.test)}"),
              (f"Higher val loss{when} outside noise", [a for a in apart if a.versus.loss.delta > 0],
               lambda a: f"{a.versus.loss.delta:+.3f}, {p_shown(a.versus.loss.test)}"))
    parts = [f"{head}: " + "; ".join(f"{label(a)} ({how(a)})" for a in group) for head, group, how in groups if group]
    said = ". ".join(parts) + "." if parts else (
        f"No {words.what} differs from {words.against} outside noise, in speed or val loss "
        f"({counted(len(judged.compared), words.what)} compared).")
    slow_to_tell = [a for a in compared if not a.same_work and a.versus.speed.test
                    and not a.versus.speed.test.significant
                    and not ratio_inside_noise(a.versus.speed.paired, judged.noise.speed_floor)]
    if slow_to_tell:
        said += (" Too few repeats to decide the speed of: "
                 + "; ".join(f"{label(a)} ({a.versus.speed.median:.2f}×, {p_shown(a.versus.speed.test)}"
                             + (f"; about {a.versus.speed.test.seeds_needed} repeats would decide a ratio this size"
                                if a.versus.speed.test.seeds_needed else "") + ")" for a in slow_to_tell)
                 + f" (the t-test has {degrees_of_freedom(judged.noise.speed_df)}: more repeats, or more "
                   f"{words.what}s compared at once, give it more).")
    undecided = [a for a in compared if a.versus.loss and a.versus.loss.test and not a.versus.loss.test.significant
                 and a.versus.loss.beyond_text_noise]
    if undecided:
        said += (" Too few seeds to decide the val loss of: " + "; ".join(
            f"{label(a)} ({a.versus.loss.delta:+.3f}, {p_shown(a.versus.loss.test)}"
            + (f"; about {a.versus.loss.test.seeds_needed} seeds would decide a difference this size"
               if a.versus.loss.test.seeds_needed else "") + ")" for a in undecided) + ".")
    return said


def as_data(judged: Judged, said: str, changes: list[Change]) -> dict[str, Any]:
    """The JSON's judged part: the verdict, what ``--apply`` writes and why, what failed, the noise and seeds,
    and every arm with its runs (per-seed figures) and its comparison (p-values and intervals)."""
    return {"verdict": said, "apply": {c.key: c.value for c in changes}, "apply_why": {c.key: c.why for c in changes},
            "failed": judged.failed, "judged_by": f"{judged.by}'s val loss", "alpha": judged.noise.alpha,
            "noise": dataclasses.asdict(judged.noise), "rows": [dataclasses.asdict(a) for a in judged.arms]}


def render_png(judged: Judged, title: str, words: Words, label: Callable[[Arm], str]) -> bytes:
    """Speed against the baseline, how much sooner at the baseline's val loss, and the val loss with one point per
    seed; blue where an arm differs from its reference outside noise, gray inside, a note where not run. Its title
    is what was decided; the noise and the method are the report's (the PNG sits beside it)."""
    import textwrap

    plt = pyplot()
    arms = judged.arms
    shown = arms[::-1]
    head = textwrap.fill(headline(judged, words, label), 150)
    title = "\n".join(textwrap.fill(line, 150) for line in title.splitlines())  # a long title was cut at both edges
    height = 0.42 * len(arms) + 2.6 + 0.18 * (head.count("\n") + title.count("\n") + 1)
    fig, (speed, sooner, loss) = plt.subplots(1, 3, figsize=(15, height), dpi=100, sharey=True,
                                              layout="constrained")
    _bars(speed, arms, lambda a: (a.vs_baseline, a.versus.speed if a.versus else None))
    _bars(sooner, arms, lambda a: (a.at_quality.vs_baseline, a.versus.sooner if a.versus else None)
          if a.at_quality else (None, None), lambda a: quality_shown(a.at_quality) or "no eval to read it from")
    for y, arm in enumerate(shown):
        seeds = [v for r in arm.done if (v := final_loss(r, judged.by)[0]) is not None]
        if not seeds:
            continue
        apart = bool(arm.versus and arm.versus.loss and arm.versus.loss.apart)
        color = "tab:blue" if apart else "tab:gray"
        loss.scatter(seeds, [y] * len(seeds), s=14, color=color, alpha=0.7)
        loss.errorbar(arm.val_loss.median, y, xerr=2 * arm.val_loss_se if arm.val_loss_se else None, fmt="|",
                      markersize=12, capsize=3, color=color)
    speed.set_yticks(range(len(shown)), [textwrap.shorten(label(a), 48) for a in shown])
    speed.set_ylim(-0.6, len(shown) - 0.4)
    wrap = functools.partial(textwrap.fill, width=52)  # three panels side by side: each label within its own
    speed.set(xlabel=wrap("tokens/s vs the baseline (median of runs paired by repeat, min–max)"), title="Speed")
    sooner.set(xlabel=wrap("how much sooner at the baseline's final val loss (paired by repeat)"),
               title="At equal loss")
    loss.set(xlabel=wrap(f"{judged.by}'s final val loss: a dot per seed, the median ± 2 s.e. of the scored text"),
             title="Quality (blue: apart from its reference)")
    fig.suptitle(f"{title}\n{head}", fontsize=9)
    return png(fig, tight=False)  # laid out by the constrained layout, title and wrapped labels included


def _bars(ax: Any, arms: list[Arm], figures: Callable[[Arm], tuple[Ratio | None, Ratio | None]],
          missing: Callable[[Arm], str] = lambda arm: "") -> None:
    """One bar per arm: its ratio to the baseline with the paired min–max, colored by its verdict against its
    reference (gray inside noise, blue a gain, red a loss); a note where it was not run or failed, and
    ``missing``'s where it ran and has no ratio (the table's words)."""
    ax.axvline(1.0, color="black", linewidth=0.8)
    highest = [1.0]
    for y, (i, arm) in enumerate(list(enumerate(arms))[::-1]):
        if not arm.done:
            ax.annotate("not run here" if arm.skipped else "FAILED", (0, y), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=8, style="italic",
                        color="dimgray" if arm.skipped else "tab:red")
            continue
        total, versus = figures(arm)
        if total is None or total.median is None:
            if note := missing(arm):
                ax.annotate(note, (0, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8,
                            style="italic", color="dimgray")
            continue
        low, high = (min(total.paired), max(total.paired)) if total.paired else (total.median, total.median)
        highest.append(high)
        gain = None if i == 0 or versus is None or versus.inside_noise is not False else versus.median > 1
        color = "tab:gray" if gain is None else "tab:blue" if gain else "tab:red"
        ax.barh(y, total.median, color=color, xerr=[[total.median - low], [high - total.median]], capsize=3)
        note = "baseline" if i == 0 else f"{total.median:.2f}×"
        if versus is not None and versus.median is not None and i and arm.reference != 0:
            note += f" ({versus.median:.2f}× its reference)"
        if i and gain is None:
            note += " (inside noise)"
        ax.annotate(note, (high, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_xlim(0, 1.5 * max(highest))


def held_back(arm: Arm, held_out: bool) -> str:
    """Why a winning ``arm`` is not applied, as the verdict says it ("" where it is): its quality win was measured
    inside the learning rate's warm-up, or (``held_out``) does not hold on the held-out windows. The grid's and the
    ladder's rule alike."""
    if why := warming_up(arm):
        return f" Measured inside the learning rate's warm-up, so not applied: {arm.label} ({why})."
    if held_out and (why := confirm(arm)):
        return f" Not confirmed on the held-out windows, so not applied: {arm.label} ({why})."
    return ""


def decide_best(judged: Judged, words: Words, held_out: bool,
                among: Callable[[Arm], bool] = lambda arm: True) -> tuple[tuple[Arm, str] | None, str]:
    """The arm that wins against its reference by the most, and why (``compare.win``), and what to say of the
    winners left out. ``held_out``: the runs scored held-out windows, and a quality win counts only where it holds
    there (``compare.confirm``); else a quality win is named as what ``--apply`` would confirm first."""
    scored = [(won, arm) for arm in judged.arms[1:] if among(arm) and (won := win(arm, bool(words.at_equal_time_s)))]
    said = "".join(held_back(arm, held_out) for _, arm in scored)
    scored = [(won, arm) for won, arm in scored if not held_back(arm, held_out)]
    if not scored:
        return None, said.strip()
    (_, why), best = max(scored, key=lambda pair: pair[0][0])
    if not held_out and confirm(best):
        said += (" A quality win: `--apply` first scores the runs on held-out val windows (train.holdout_windows) and "
                 "writes it only where it holds there.")
    return (best, why), said.strip()
