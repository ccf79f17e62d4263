"""The ladder's report: a markdown table with its noise verdict, a PNG, a JSON file and an MLflow run."""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
from pathlib import Path
from typing import Any

from gpt2.core import paths
from gpt2.core.atomic import atomic_dir
from gpt2.core.plots import png, pyplot
from gpt2.measure import experiments
from gpt2.measure.apply import Change
from gpt2.measure.compare import as_metric, loss_shown, quality_shown, ratio_shown, usd_shown
from gpt2.measure.ladder.spec import Resolved
from gpt2.measure.ladder.stats import CANNOT_SHOW, NO_EFFECT, Row, noise_verdict
from gpt2.run.compiled import flag
from gpt2.run.tracking import json_value

LADDER_FILES = ("ladder.*", "dvc.log")  # what the report folder holds: refused if it holds more


def table(rows: list[Row], steps: int, target: float | None = None, time_budget_s: float | None = None) -> str:
    ending = (f"val loss after {time_budget_s:g} s (± s.e.)" if time_budget_s else
              f"val loss after {steps} steps (± s.e.)" if target is None else "val loss at the end (± s.e.)")
    quality = any(r.quality for r in rows)
    priced = any(r.cost_usd is not None or r.quality and r.quality.cost_usd is not None for r in rows)
    head = ["#", "rung", "what ran", "ms/step median (min–max)", "tokens/s median (min–max)", "wall tokens/s",
            "vs previous", "cumulative", "peak mem (GB)", "MFU", ending, "loss vs previous",
            *(["time to the baseline's loss (s)", "vs baseline at equal loss", "vs previous at equal loss"]
              if quality else []),
            "device-hours", *(["cost per run (USD)", "cost to the baseline's loss (USD)"] if priced else []), "note"]
    if target is not None:
        head[8:8] = [f"time to {target} (s)", "time speedup", "tokens to target"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        if not row.runs and row.effect.startswith(CANNOT_SHOW):
            cells = [str(row.index), row.rung, "", "not run"] + [""] * (len(head) - 5) + [row.effect]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        if not row.runs:
            cells = [str(row.index), row.rung, "", "failed"] + [""] * (len(head) - 5) + ["see dvc.log"]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        noise = row.inside_noise
        time_to, at_loss = quality_shown(row.quality)
        loss_move = ("" if row.loss_vs_previous is None else f"{row.loss_vs_previous:+.3f}"
                     + ("" if row.loss_apart else " (inside noise)"))
        cells = [str(row.index), row.rung, row.ran or "baseline",
                 row.step_ms.shown(".1f"), row.tokens_per_s.shown(",.0f"),
                 f"{row.tokens_per_s_wall:,.0f}" if row.tokens_per_s_wall else "",
                 ratio_shown(row.vs_previous, noise.get("tokens_per_s")), ratio_shown(row.cumulative),
                 f"{row.peak_mem_gb:.2f}", f"{100 * row.mfu:.1f}%" if row.mfu is not None else "n/a",
                 loss_shown(row.val_loss, row.val_loss_se), loss_move,
                 *([time_to, "baseline" if row.index == 0 and time_to else at_loss,
                    ratio_shown(row.quality_vs_previous, noise.get("quality"))] if quality else []),
                 f"{row.device_hours:.4f}" if row.device_hours is not None else "",
                 *([usd_shown(row.cost_usd), usd_shown(row.quality.cost_usd if row.quality else None)]
                   if priced else []),
                 "; ".join(filter(None, ["" if row.effect in ("acts", "baseline") else row.effect,
                                         built_on(row, rows), flag(row.runtime)]))]
        if target is not None:
            reached = row.time_s.shown(".1f") if row.time_s else ""
            if row.reached < row.runs:
                reached += f" reached {row.reached}/{row.runs}" if row.reached else "not reached"
            cells[8:8] = [reached.strip(), ratio_shown(row.time_speedup, noise.get("time_s")),
                          f"{row.tokens_to_target:,.0f}" if row.tokens_to_target else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def built_on(row: Row, rows: list[Row]) -> str:
    """Where a rung's comparison is not with the row above it: a rung measured beside the ladder, or the first
    rung below such rungs, which builds on the last rung that carries."""
    if row.beside:
        return f"beside the ladder: on rung {row.previous}, and the rungs below do not take it"
    between = rows[row.previous + 1:row.index] if row.previous is not None else []
    return f"on rung {row.previous} (the rungs between are beside the ladder)" if any(
        r.beside and r.runs for r in between) else ""


def describe(resolved: Resolved, rows: list[Row]) -> str:
    first = next((r for r in rows if r.runs), None)
    runtime = first.runtime if first else {}
    model, train = resolved.sections[0]["model"], resolved.sections[0]["train"]
    from gpt2.core.sizes import sequence_length

    seq = sequence_length(model["size"], model["block_size"], train["block_size"])
    return (f"Device: {runtime.get('device_name', resolved.device)} ({resolved.device}), "
            f"torch {runtime.get('torch', '?')}. "
            f"Model {model['size']}, micro-batch {train['micro_batch_size']} × {seq} tokens, "
            + (f"{train['time_budget_s']:g} s of training steps per run (train.time_budget_s: val losses compare at "
               f"equal time; the first {train['timing_warmup_steps']} steps untimed), " if train.get("time_budget_s")
               else f"{resolved.profile.steps} steps per run (the first {train['timing_warmup_steps']} untimed), ")
            + f"{resolved.profile.repeats} run(s) per rung in alternating order; speedups compare tokens/s"
            + (f"; MFU against {runtime['mfu_against']}" if runtime.get("mfu_against") else "")
            + (f"; with a target val loss of {resolved.profile.target}, every run trains until its val loss (measured "
               f"every {train['eval_interval']} steps) reaches it, or {resolved.profile.steps} steps: time to target "
               "is wall clock from the start of the run, compile and evals included." if resolved.profile.target
               else "."))


def decision(rows: list[Row], changes: list[Change], time_budget_s: float | None) -> str:
    """Under a budget, which rungs end lower or higher than the rung above outside noise; then what ``--apply``
    writes."""
    said = ""
    if time_budget_s:
        moved = [(r, r.loss_vs_previous) for r in rows if r.loss_apart and r.loss_vs_previous is not None]
        lower, higher = [m for m in moved if m[1] < 0], [m for m in moved if m[1] > 0]
        parts = [f"{label}: " + "; ".join(f"{r.rung} ({d:+.3f})" for r, d in group)
                 for label, group in (("lower val loss than the rung above outside noise", lower),
                                      ("higher", higher)) if group]
        said = (f"At equal time ({time_budget_s:g} s), " + ("; ".join(parts) if parts else
                "no rung's val loss differs from the rung above's outside noise") + ". ")
    if not changes:
        return said + "Nothing for `--apply` to write: no rung wins outside noise without losing elsewhere."
    return (said + "What `--apply` writes into params.yaml, the changes of the rungs that win outside noise: "
            + ", ".join(f"{c.key}={json_value(c.value)}" for c in changes) + ".")


def write_report(out: Path, rows: list[Row], resolved: Resolved, runs: list[list[experiments.Experiment]],
                 changes: list[Change] | None = None, as_json: bool = False) -> dict[str, Any]:
    """ladder.md, .json and .png, written as one; the table on stdout (unless ``as_json``: the caller prints
    the JSON). Returns the JSON's content."""
    today = datetime.date.today().isoformat()
    budget = resolved.sections[0]["train"].get("time_budget_s")
    verdict = noise_verdict(rows, resolved.profile.repeats)
    text = (f"# Optimization ladder ({today})\n\n{verdict}\n\n{decision(rows, changes or [], budget)}\n\n"
            f"{describe(resolved, rows)}"
            f"\n\n{table(rows, resolved.profile.steps, resolved.profile.target, budget)}\n"
            "Each rung adds one change to the rung above (ladder.yaml); a rung \"beside the ladder\" is measured on "
            "the rung above, and the rungs below do not take its change. A rung marked \"no effect on this device\" "
            "ran the same configuration as the rung above: its difference from it is this machine's run-to-run "
            "noise, the floor under every other figure. Experiments: "
            + "; ".join(f"{row.rung}: {', '.join(row.experiments) or 'none'}" for row in rows)
            + ". Inspect them with `dvc exp show`. Loss vs previous: outside noise when more than 2 × √(se₁² + "
            "se₂²) apart. Time to the baseline's loss: the training time (compile included, evals not) at which a "
            "run's val curve first reaches the val loss its repeat's baseline run ends with, interpolated between "
            "evals; the ratios at equal loss compare two runs of the same repeat at the higher of their final val "
            "losses (a loss both reach).\n")
    data = {"date": today, "device": resolved.device, "report": str(out / "ladder.md"), "time_budget_s": budget,
            "verdict": verdict, "apply": {c.key: c.value for c in changes or []},
            "apply_why": {c.key: c.why for c in changes or []},
            "failed": [r.rung for r in rows if not r.runs and not r.effect.startswith(CANNOT_SHOW)],
            "rows": [dataclasses.asdict(r) for r in rows]}
    log = out / "dvc.log"
    kept_log = log.read_bytes() if log.exists() else None
    with atomic_dir(out, owns=LADDER_FILES, command="gpt2 ladder") as tmp:
        (tmp / "ladder.md").write_text(text)
        (tmp / "ladder.json").write_text(json.dumps(data, indent=2) + "\n")
        (tmp / "ladder.png").write_bytes(render_png(rows, describe(resolved, rows), verdict))
        if kept_log is not None:
            (tmp / "dvc.log").write_bytes(kept_log)
    if not as_json:
        print(text, file=sys.stdout)
    return data


def bar_style(row: Row) -> tuple[str, str]:
    """A rung's bar color and note: gray for a change inside noise, red for a rung the repeats show slower than
    the one above (its cumulative bar may still read above 1, so the note gives its own ratio), else blue."""
    if not row.runs:
        return "tab:gray", ""
    beside = f"beside the ladder, on rung {row.previous}: " if row.beside else ""
    if row.effect == NO_EFFECT or row.inside_noise.get("tokens_per_s"):
        return "tab:gray", f"{row.cumulative:.2f}× ({beside}its gain: inside noise)"
    if row.vs_previous is not None and row.vs_previous < 1:
        return "tab:red", (f"{row.cumulative:.2f}× ({beside}{row.vs_previous:.2f}× it)" if beside
                           else f"{row.cumulative:.2f}× (this rung: {row.vs_previous:.2f}× the rung above)")
    return "tab:blue", f"{row.cumulative:.2f}×" + (f" ({beside.removesuffix(': ')})" if beside else "")


def render_png(rows: list[Row], subtitle: str, verdict: str = "") -> bytes:
    """Cumulative speedup and peak memory per rung, the noise verdict on top. Every rung has a line: one
    that did not run here or failed says so where its bar would be, so a gap never reads as a clean ladder."""
    import textwrap

    plt = pyplot()

    shown = rows[::-1]
    labels = [f"{r.index} {r.rung}" for r in shown]
    head = textwrap.fill(verdict.replace("**", ""), 150) if verdict else ""
    lines = head.count("\n") + 1 if head else 0
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 0.4 * len(rows) + 2.0 + 0.17 * lines), dpi=100,
                                        sharey=True, gridspec_kw={"width_ratios": [3, 2]})
    colors = [bar_style(r)[0] for r in shown]
    speed.barh(labels, [r.cumulative or 0 for r in shown], color=colors)
    speed.axvline(1.0, color="black", linewidth=0.8)
    speed.set_xlim(0, 1.45 * max([r.cumulative or 0 for r in rows] + [1.0]))  # room for the notes
    speed.set(xlabel="cumulative speedup (tokens/s vs baseline; gray: inside noise; red: slower than the rung above)",
              title="Speed")
    for y, r in enumerate(shown):
        if r.runs:
            note = bar_style(r)[1]
            speed.annotate(note, (r.cumulative or 0, y), xytext=(3, 0), textcoords="offset points", va="center",
                           fontsize=8)
        else:
            why = "not run here" if r.effect.startswith(CANNOT_SHOW) else "FAILED: see dvc.log"
            speed.annotate(why, (0, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8,
                           color="tab:red" if why.startswith("FAILED") else "dimgray", style="italic")
    memory.barh(labels, [r.peak_mem_gb or 0 for r in shown], color="tab:orange")
    memory.set(xlabel="peak memory (GB)", title="Memory")
    fig.suptitle(f"{head}\n{subtitle}" if head else subtitle, fontsize=8, wrap=True)
    return png(fig)


def log_to_mlflow(rows: list[Row], resolved: Resolved, runs: list[list[experiments.Experiment]],
                  out: Path, started: float | None = None) -> None:
    """Log the ladder as a parent run (its table, plot, figures and data), lasting from ``started`` (its first
    run) to its report, with every rung's training runs as children, each carrying its rung's verdict.

    A rung's run reused from an earlier ladder moves under this one: a run has one parent."""
    from gpt2.run.tracking import MlflowTracker, adopt

    with MlflowTracker(resolved.sections[0]["train"]["experiment"], run_name=f"ladder {resolved.device}",
                       kept_in=str(out), started_at=started) as tracker:
        rungs = {exp.name: {"ladder.rung": row.rung, "ladder.index": str(row.index)}
                 for row, group in zip(rows, runs) for exp in group}
        verdicts = {exp.name: {"vs_previous/speedup": row.vs_previous,
                               "vs_previous/speed_inside_noise": as_metric(row.inside_noise.get("tokens_per_s")),
                               "vs_baseline/speedup": row.cumulative}
                    for row, group in zip(rows, runs) for exp in group}
        adopt(tracker, list(rungs), rungs, verdicts)
        if dataset := experiments.workspace_dataset(paths.root()):
            tracker.log_dataset(dataset, context="training")
        tracker.set_tags({"kind": "ladder", "device": rows[0].runtime.get("device_name", resolved.device)})
        tracker.log_params({"ladder.steps": resolved.profile.steps, "ladder.repeats": resolved.profile.repeats,
                            "ladder.model": resolved.sections[0]["model"]["size"], "ladder.device": resolved.device})
        for row in rows:
            if row.runs:
                tracker.log_metrics({"ladder/step_ms": row.step_ms.median,
                                     "ladder/tokens_per_s": row.tokens_per_s.median,
                                     "ladder/tokens_per_s_wall": row.tokens_per_s_wall,
                                     "ladder/cumulative_speedup": row.cumulative,
                                     "ladder/speedup_vs_previous": row.vs_previous,
                                     "ladder/speed_inside_noise": as_metric(row.inside_noise.get("tokens_per_s")),
                                     "ladder/peak_mem_gb":
                                     row.peak_mem_gb, "ladder/mfu": row.mfu, "ladder/val_loss": row.val_loss,
                                     "ladder/time_to_target_s": row.time_s.median if row.time_s else None,
                                     "ladder/tokens_to_target": row.tokens_to_target,
                                     "ladder/time_to_baseline_loss_s": (
                                         row.quality.time_s.median if row.quality and row.quality.time_s else None),
                                     "ladder/speedup_at_equal_loss": row.quality.speedup if row.quality else None,
                                     "ladder/cost_usd": row.cost_usd},
                                    step=row.index)
        for name in ("ladder.md", "ladder.png", "ladder.json"):
            tracker.log_artifact(out / name)
        tracker.describe((out / "ladder.md").read_text(), "ladder.md")
