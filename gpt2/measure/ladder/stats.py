"""What the runs say: each rung's medians and intervals, its speedups, what really ran, and the noise.

A rung whose switch resolves to what already ran (TF32 or AMP on a CPU) has no effect on this
device, read from what the trainer recorded, not from a rule of thumb; its move is this machine's
noise, the floor under every other gain.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from typing import Any

from gpt2.core import paths
from gpt2.measure import experiments
from gpt2.measure.apply import Change
from gpt2.measure.compare import (AtQuality, Curve, Spread, at_baseline_quality, losses_apart, median_known,
                                  noise_verdict as verdict_text, paired_ratios, ratio_inside_noise, sooner,
                                  typical_disagreement, win)
from gpt2.measure.ladder.spec import Ladder, Resolved, Rung, flat

# A rung's change that the trainer resolves on the device: the key of what really ran in summary.json's "runtime".
RESOLVED = {"dtype": "dtype", "tf32": "tf32", "keep_host_memory": "keep_host_memory",
            "model.attention": "sdpa_backend", "cpu_gemm": "cpu_gemm"}
NO_EFFECT = "no effect on this device"
CANNOT_SHOW = "not run: cannot show on this device"


@dataclass
class Row:
    """One rung of the report. Figures are medians over its runs, with their min–max; None where a
    rung has no finished run (``effect: failed``) or the figure does not apply (no target)."""

    index: int
    rung: str
    changes: dict[str, Any]  # what this rung sets on top of the rung above ({} for the baseline)
    runs: int  # finished runs
    experiments: list[str]
    effect: str = "failed"  # baseline | acts | no effect on this device | acts (rung above failed) | failed
    ran: str = ""  # each change as asked, and as it resolved here when that differs
    runtime: dict[str, Any] = field(default_factory=dict)  # what really ran (the trainer's summary)
    step_ms: Spread | None = None
    tokens_per_s: Spread | None = None
    tokens_per_s_wall: float | None = None
    peak_mem_gb: float | None = None
    mfu: float | None = None
    val_loss: float | None = None
    val_loss_se: float | None = None  # its standard error over the scored windows (the median run's)
    previous: int | None = None  # the measured rung this one is compared with: the last above it that carries
    beside: bool = False  # measured beside the ladder: the rungs below do not take its change (ladder.yaml's carry)
    vs_previous: float | None = None  # tokens/s ratio
    cumulative: float | None = None  # tokens/s ratio to the baseline
    reached: int | None = None  # runs that reached the target val loss
    time_s: Spread | None = None  # time to target
    tokens_to_target: float | None = None
    steps_to_target: float | None = None
    time_speedup: float | None = None
    time_vs_previous: float | None = None
    tokens_per_s_runs: list[float] = field(default_factory=list)  # newest first, as the runs were paired
    paired: list[float] = field(default_factory=list)  # tokens/s ratio to the rung above, run by run (same repeat)
    inside_noise: dict[str, bool] = field(default_factory=dict)  # per figure: a gain the repeats cannot tell apart
    noise_floor: float | None = None
    loss_vs_previous: float | None = None  # val loss minus the rung above's
    loss_apart: bool | None = None  # beyond 2 × the standard error of the difference
    quality: AtQuality | None = None  # time and tokens to the val loss the baseline (rung 0) ends with
    quality_paired: list[float] = field(default_factory=list)  # the rung above's time to it over this one's, by repeat
    quality_vs_previous: float | None = None  # their median: above 1, this rung gets there sooner
    cost_usd: float | None = None  # a run's cost (median; None without a price)
    device_hours: float | None = None


def analyse(ladder: Ladder, resolved: Resolved, runs: list[list[experiments.Experiment]],
            curves: dict[str, Curve | None] | None = None) -> list[Row]:
    """Every rung's figures and comparisons; with the runs' val ``curves`` (by experiment name), also at the
    baseline's final val loss."""
    rows: list[Row] = []
    base: Row | None = None
    previous: Row | None = None
    for i, (rung, group) in enumerate(zip(ladder.rungs, runs)):
        metrics = [e.metrics[paths.TRAIN_METRICS] for e in group]
        row = Row(index=i, rung=rung.name, changes=rung.changes if i else {}, runs=len(metrics),
                  experiments=[e.name for e in group])
        rows.append(row)
        if not metrics:
            if resolved.cannot_show and resolved.cannot_show[i]:
                row.effect = f"{CANNOT_SHOW}: {resolved.cannot_show[i]}"
            continue
        step_ms = [m["perf"]["step_ms"] for m in metrics]
        tps = [m["perf"]["tokens_per_s"] for m in metrics]
        walls = [m["perf"].get("tokens_per_s_wall") for m in metrics if m["perf"].get("tokens_per_s_wall")]
        mfus = [m["perf"].get("mfu") for m in metrics if m["perf"].get("mfu") is not None]
        losses = [m["val"]["loss"] for m in metrics if m.get("val", {}).get("loss") is not None]
        errors = [m["val"]["loss_se"] for m in metrics if m.get("val", {}).get("loss_se") is not None]
        row.runtime = (group[0].files.get(paths.TRAIN_SUMMARY) or {}).get("runtime") or {}
        row.step_ms, row.tokens_per_s = Spread.of(step_ms), Spread.of(tps)
        row.tokens_per_s_wall = statistics.median(walls) if walls else None
        row.peak_mem_gb = max(m["mem"]["peak_gb"] for m in metrics)
        row.mfu = statistics.median(mfus) if mfus else None
        row.val_loss = statistics.median(losses) if losses else None
        row.val_loss_se = statistics.median(errors) if errors else None
        costs = [m.get("cost") or {} for m in metrics]
        row.cost_usd = median_known([c.get("usd") for c in costs])
        row.device_hours = median_known([c.get("device_hours") for c in costs])
        if previous:
            row.loss_vs_previous = (row.val_loss - previous.val_loss
                                    if None not in (row.val_loss, previous.val_loss) else None)
            row.loss_apart = losses_apart(row.val_loss, row.val_loss_se, previous.val_loss, previous.val_loss_se)
        row.ran = _what_ran(rung, flat(resolved.sections[i]), row.runtime)
        if resolved.profile.target is not None:
            _add_target_figures(row, metrics)
        row.tokens_per_s_runs = tps
        base = base or (row if i == 0 else None)
        if previous:  # each run against the rung above's run of the same repeat: neighbours in time
            row.paired = paired_ratios(tps, previous.tokens_per_s_runs)
            row.vs_previous = statistics.median(row.paired)
        row.cumulative = row.tokens_per_s.median / base.tokens_per_s.median if base else None
        if row.time_s:
            row.time_speedup = base.time_s.median / row.time_s.median if base and base.time_s else None
            row.time_vs_previous = (previous.time_s.median / row.time_s.median
                                    if previous and previous.time_s else None)
        row.effect = _effect(rung, flat(resolved.sections[i]), row.runtime, previous) if i else "baseline"
        row.previous = previous.index if previous else None
        row.beside = not rung.carries(resolved.device)
        if not row.beside:
            previous = row
    if curves is not None:
        add_quality(rows, runs, curves)
    mark_noise(rows)
    return rows


def add_quality(rows: list[Row], runs: list[list[experiments.Experiment]], curves: dict[str, Curve | None]) -> None:
    """Each rung's time to the baseline's final val loss, and its ratio to the rung above's, run by run."""
    by_rung = [[curves.get(e.name) for e in group] for group in runs]
    prices = [[experiments.hourly_price(e, paths.TRAIN_SUMMARY) for e in group] for group in runs]
    for row, figures in zip(rows, at_baseline_quality(by_rung, prices)):
        row.quality = figures
    for row in rows:
        if row.quality and row.previous is not None:
            pairs = zip(by_rung[row.previous], by_rung[row.index])
            row.quality_paired = [r for above, mine in pairs if (r := sooner(above, mine)) is not None]
            row.quality_vs_previous = statistics.median(row.quality_paired) if row.quality_paired else None



def _add_target_figures(row: Row, metrics: list[dict[str, Any]]) -> None:
    """Time (s), tokens and steps to the target over the runs that reached it; how many did."""
    reached = [m["target"] for m in metrics if (m.get("target") or {}).get("reached")]
    row.reached = len(reached)
    if reached:
        times = [t["time_s"] for t in reached]
        row.time_s = Spread.of(times)
        row.tokens_to_target = statistics.median(t["tokens"] for t in reached)
        row.steps_to_target = statistics.median(t["steps"] for t in reached)


def mark_noise(rows: list[Row]) -> None:
    """Flag each rung's gain that its repeats cannot tell from noise, and measure the noise itself.

    A rung's runs are paired with the rung above's runs of the same repeat, which ran next to them
    in time, so slow drift of the machine cancels in each ratio. A tokens/s gain is "inside noise"
    when the paired ratios do not agree on its direction (one above 1, one below), or when it is no
    larger than the largest move of a rung that changed nothing here (``no effect on this device``:
    its difference from the rung above is this machine's noise) or than the typical disagreement of
    a rung's paired ratios (the median over the rungs of their max - min): with two or three pairs a
    rung's own agreement on the direction is a weak test, the machine's typical spread is not. Time
    to target, measured once per run, is judged on the min–max intervals. The floor goes on every
    measured row for the report."""
    measured = {r.index: r for r in rows if r.runs}
    floor = max(max((abs(r.vs_previous - 1) for r in measured.values() if r.effect == NO_EFFECT and r.vs_previous),
                    default=0.0), paired_spread(rows))
    for row in measured.values():
        row.noise_floor = floor
        above = measured.get(row.previous) if row.previous is not None else None
        if above is None or row.effect == NO_EFFECT:
            continue
        if row.vs_previous is not None:
            row.inside_noise["tokens_per_s"] = ratio_inside_noise(row.paired, floor)
        if row.time_vs_previous is not None:
            overlap = row.time_s.overlaps(above.time_s)
            row.inside_noise["time_s"] = overlap or abs(row.time_vs_previous - 1) <= floor
        if row.quality_vs_previous is not None:
            row.inside_noise["quality"] = ratio_inside_noise(row.quality_paired, floor)


def paired_spread(rows: list[Row]) -> float:
    """How far a rung's paired tokens/s ratios typically disagree: the median of their max - min."""
    return typical_disagreement([r.paired for r in rows if r.effect != NO_EFFECT])


def noise_verdict(rows: list[Row], repeats: int) -> str:
    """The report's first words: too noisy to read, or how noisy, and which rungs this device cannot show."""
    acting = [r for r in rows if r.runs and r.effect not in ("baseline", NO_EFFECT, "failed")]
    floor = max((r.noise_floor or 0.0 for r in rows if r.runs), default=0.0)
    noisy = [r for r in acting if r.inside_noise.get("tokens_per_s")]
    unshown = [r for r in rows if r.effect.startswith(CANNOT_SHOW)]
    skipped = ("" if not unshown else " Not run, as this device cannot show them: " + "; ".join(
        f"{r.rung} ({r.effect.removeprefix(CANNOT_SHOW + ': ')})" for r in unshown) + ".")
    return verdict_text(paired_spread(rows), floor, len(noisy), len(acting), repeats, "rung",
                        "the rung above's") + skipped


def decide(rows: list[Row], resolved: Resolved, time_budget_s: float | None, report: str) -> list[Change]:
    """The changes of the rungs that win against the rung above outside noise and lose nowhere outside it
    (gpt2/measure/compare.py's ``win``: a larger batch can raise tokens/s and still reach a loss later).
    Later rungs' values win where two set a key. Nothing wins from one run per rung. Of the rungs measured beside
    the ladder (each alone on the same rung), only the fastest that wins is applied: two were never measured
    together."""
    changes: dict[str, Change] = {}
    won_rows = []
    for row in rows:
        if row.runs < 2 or row.effect in ("baseline", NO_EFFECT, "failed") or row.previous is None:
            continue
        won = win(row.vs_previous, row.inside_noise.get("tokens_per_s"), row.quality_vs_previous,
                  row.inside_noise.get("quality"), row.loss_vs_previous, row.loss_apart, bool(time_budget_s))
        if won:
            won_rows.append((row, won[1]))
    beside = sorted((r for r, _ in won_rows if r.beside), key=lambda r: r.vs_previous or 0.0, reverse=True)
    for row, why in won_rows:
        if row.beside and row is not beside[0]:
            continue
        others = "".join(f"; {r.rung!r} also won alone, not applied with it (never measured together)"
                         for r in beside[1:]) if row.beside else ""
        section = flat(resolved.sections[row.index])
        for key in ladder_changes(resolved, row.previous, row.index):
            full = key if key.startswith("model.") else f"train.{key}"
            changes[full] = Change(full, section[key], f"rung {row.index} {row.rung!r} against the rung above: "
                                                       f"{why}{others} ({report})")
    return list(changes.values())


def ladder_changes(resolved: Resolved, above: int, index: int) -> list[str]:
    """The keys rung ``index`` changes from the measured rung above it, as it ran (``grad_accum_steps: target``
    resolved)."""
    before, after = flat(resolved.sections[above]), flat(resolved.sections[index])
    return [k for k in after if before.get(k) != after[k]]


def _resolved(key: str, params: dict[str, Any], runtime: dict[str, Any]) -> Any:
    return runtime.get(RESOLVED[key], params[key]) if key in RESOLVED else params[key]


def _what_ran(rung: Rung, params: dict[str, Any], runtime: dict[str, Any]) -> str:
    parts = []
    for key in rung.changes:
        asked, ran = params[key], _resolved(key, params, runtime)
        parts.append(f"{key}={_fmt(asked)}" + (f" → {_fmt(ran)}" if key in RESOLVED and ran != asked else ""))
    return ", ".join(parts)


def _effect(rung: Rung, params: dict[str, Any], runtime: dict[str, Any], previous: Row | None) -> str:
    if previous is None:
        return "acts (rung above failed)"
    before = previous.runtime
    same = all(_resolved(k, params, runtime) == before.get(RESOLVED[k]) for k in rung.changes if k in RESOLVED)
    if same and all(k in RESOLVED for k in rung.changes):
        return NO_EFFECT
    return "acts"


def _fmt(value: Any) -> str:
    return json.dumps(value) if isinstance(value, bool) or value is None else str(value)
