"""The ladder's arms and its report: each rung against the rung it builds on, what really ran, what wins.

A rung whose switch resolves to what already ran (TF32 or AMP on a CPU) has no effect on this
device, read from what the trainer recorded, not from a rule of thumb: it is an *inert* arm, and
its move is this machine's noise, the floor under every other gain. gpt2/measure/compare.py judges
the arms, gpt2/measure/report.py writes the verdict, the table's shared columns and the PNG,
gpt2/measure/parent_run.py the MLflow parent; this module adds what only a ladder has (the rungs,
what ran, a target val loss).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from gpt2.core.atomic import write_files
from gpt2.core.config import RESOLVED_ON_DEVICE
from gpt2.measure.apply import Change
from gpt2.measure.compare import Arm, Judged, Run, confirm, win
from gpt2.measure.ladder.spec import Ladder, Resolved, Rung, flat
from gpt2.measure.report import (METHOD, Column, Words, as_data, columns, held_back, ratio_shown, render_png, table,
                                 verdict)
from gpt2.run.compiled import flag

LADDER_FILES = ("ladder.*", "dvc.log")  # what the report folder holds: refused if it holds more
RESOLVED = {key.removeprefix("train."): ran for key, ran in RESOLVED_ON_DEVICE.items()}  # as rungs name them
NO_EFFECT = "no effect on this device"
CANNOT_SHOW = "not run: cannot show on this device"


def arms(ladder: Ladder, resolved: Resolved, runs: list[list[Run]]) -> list[Arm]:
    """One arm per rung, by repeat, compared with the last rung above it that ran here and carries its change
    (a rung beside the ladder is compared with it too, and the rungs below do not build on it)."""
    out: list[Arm] = []
    previous: int | None = None
    for i, (rung, group) in enumerate(zip(ladder.rungs, runs)):
        arm = Arm(rung.name, group, setting=rung.changes if i else {}, skipped=resolved.cannot_show[i] or "",
                  changes=tuple(k if "." in k else f"train.{k}" for k in rung.changes))
        done = [r for r in group if r.ok]
        if done:
            arm.reference = previous if i else None
            if arm.reference is not None:
                arm.inert = no_effect(rung, flat(resolved.sections[i]), done[0].runtime,
                                      next((r.runtime for r in out[previous].runs if r.ok), {}))
            if rung.carries(resolved.device):
                previous = i
        out.append(arm)
    return out


def _resolved(key: str, params: dict[str, Any], runtime: dict[str, Any]) -> Any:
    return runtime.get(RESOLVED[key], params[key]) if key in RESOLVED else params[key]


def no_effect(rung: Rung, params: dict[str, Any], runtime: dict[str, Any], before: dict[str, Any]) -> bool:
    """Whether every change of the rung resolved to what the rung above ran (the trainers' records say)."""
    return (all(k in RESOLVED for k in rung.changes)
            and all(_resolved(k, params, runtime) == before.get(RESOLVED[k]) for k in rung.changes))


def what_ran(rung: Rung, params: dict[str, Any], runtime: dict[str, Any]) -> str:
    """Each change as asked, and as it resolved here where that differs (``tf32=true → false``)."""
    parts = []
    for key in rung.changes:
        asked, ran = params[key], _resolved(key, params, runtime)
        parts.append(f"{key}={_fmt(asked)}" + (f" → {_fmt(ran)}" if key in RESOLVED and ran != asked else ""))
    return ", ".join(parts)


def _fmt(value: Any) -> str:
    return json.dumps(value) if isinstance(value, bool) or value is None else str(value)


def beside(ladder: Ladder, resolved: Resolved, index: int) -> bool:
    """Measured beside the ladder: the rungs below do not take its change (ladder.yaml's carry)."""
    return not ladder.rungs[index].carries(resolved.device)


def rung_note(ladder: Ladder, resolved: Resolved, arms_: list[Arm], index: int) -> str:
    """A rung's note: what it did here where it is not plainly "acts", and on which rung it stands where that is
    not the row above."""
    arm = arms_[index]
    if arm.skipped:
        return f"{CANNOT_SHOW}: {arm.skipped}"
    if not arm.done:
        return "failed: see dvc.log"
    said = [NO_EFFECT if arm.inert else "", "no rung above ran: not compared"
            if index and arm.reference is None else ""]
    if arm.reference is not None and beside(ladder, resolved, index):
        said.append(f"beside the ladder: on rung {arm.reference}, and the rungs below do not take it")
    elif arm.reference is not None and any(beside(ladder, resolved, j) and arms_[j].done
                                           for j in range(arm.reference + 1, index)):
        said.append(f"on rung {arm.reference} (the rungs between are beside the ladder)")
    elif arm.reference is not None and arm.reference != index - 1:
        failed = [str(j) for j in range(arm.reference + 1, index) if not arms_[j].skipped and not arms_[j].done]
        said.append(f"on rung {arm.reference}" + (f" (rung {', '.join(failed)} between failed: its change is "
                                                  "measured here too)" if failed else
                                                  " (the rungs between cannot run here)"))
    return "; ".join(filter(None, [*said, flag(arm.runtime)]))


def decide(judged: Judged, ladder: Ladder, resolved: Resolved, at_equal_time: bool, report: str,
           held_out: bool = False) -> tuple[list[Change], str]:
    """The changes of the rungs that win against the rung above outside noise and lose nowhere outside it
    (``compare.win``) and, ``held_out``, whose quality win holds on the held-out windows; and what to say of the
    rungs left out. Later rungs' values win where two set a key. Of the rungs measured beside the ladder (each
    alone on the same rung), only the fastest that wins is applied: two were never measured together."""
    won = [(i, w[1]) for i, arm in enumerate(judged.arms) if i and (w := win(arm, at_equal_time))]
    said = "".join(held_back(judged.arms[i], held_out) for i, _ in won).strip()  # an arm's label is its rung's name
    won = [(i, why) for i, why in won if not held_back(judged.arms[i], held_out)]
    levers = sorted((i for i, _ in won if beside(ladder, resolved, i)),
                    key=lambda i: judged.arms[i].versus.speed.median or 0.0, reverse=True)
    changes: dict[str, Change] = {}
    for i, why in won:
        if i in levers[1:]:
            continue
        others = "".join(f"; {ladder.rungs[j].name!r} also won alone, not applied with it (never measured "
                         "together)" for j in levers[1:]) if i in levers else ""
        section, above = flat(resolved.sections[i]), flat(resolved.sections[judged.arms[i].reference])
        for key in (k for k in section if above.get(k) != section[k]):
            full = key if key.startswith("model.") else f"train.{key}"
            changes[full] = Change(full, section[key], f"rung {i} {ladder.rungs[i].name!r} against the rung above: "
                                                       f"{why}{others} ({report})")
    if not held_out and any(confirm(judged.arms[i]) for i, _ in won):
        said += (" A quality win: `--apply` first scores the runs on held-out val windows (train.holdout_windows) "
                 "and writes it only where it holds there.")
    return list(changes.values()), said.strip()


def describe(resolved: Resolved, judged: Judged) -> str:
    from gpt2.core.sizes import sequence_length

    runtime = next((a.runtime for a in judged.arms if a.done), {})
    model, train = resolved.sections[0]["model"], resolved.sections[0]["train"]
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


def write_report(out: Path, judged: Judged, ladder: Ladder, resolved: Resolved, changes: list[Change],
                 note: str = "") -> tuple[str, dict[str, Any]]:
    """ladder.md, .json and .png, written as one; returns the markdown and the JSON's content."""
    today = datetime.date.today().isoformat()
    budget = resolved.sections[0]["train"].get("time_budget_s")
    words = Words("rung", "the rung above", budget)
    said = verdict(judged, words, resolved.profile.repeats, changes, lambda a: a.label, note)
    own = [Column("#", lambda i, a: str(i)), Column("rung", lambda i, a: a.label),
           Column("what ran", lambda i, a: "baseline" if i == 0 else what_ran(
               ladder.rungs[i], flat(resolved.sections[i]), a.runtime) if a.done else "")]
    last = [Column("wall tokens/s", lambda i, a: f"{a.tokens_per_s_wall:,.0f}" if a.tokens_per_s_wall else "")]
    if (target := resolved.profile.target) is not None:
        last += target_columns(target)
    last.append(Column("note", lambda i, a: rung_note(ladder, resolved, judged.arms, i)))
    text = (f"# Optimization ladder: {ladder.source} ({today})\n\n{said}\n\n{describe(resolved, judged)}\n\n"
            + table(judged, own, columns(judged, words), last)
            + f"\nEach rung adds one change to the rung above ({ladder.source}); a rung \"beside the ladder\" is "
              "measured on the rung above, and the rungs below do not take its change. A rung marked \"no effect on "
              "this device\" ran the same configuration as the rung above: its difference from it is this machine's "
              f"run-to-run noise, the floor under every other figure. {METHOD} Experiments: "
            + "; ".join(f"{a.label}: {', '.join(r.name for r in a.runs) or 'none'}" for a in judged.arms)
            + ". Inspect them with `dvc exp show`.\n")
    data = {"date": today, "device": resolved.device, "model": resolved.sections[0]["model"]["size"],
            "report": str(out / "ladder.md"), "time_budget_s": budget,
            "repeats": resolved.profile.repeats, **as_data(judged, said, changes)}
    write_files(out, {"ladder.md": text, "ladder.json": json.dumps(data, indent=2) + "\n",
                      "ladder.png": render_png(judged, describe(resolved, judged), words,
                                               lambda a: f"{judged.arms.index(a)} {a.label}")})
    return text, data


def target_columns(target: float) -> list[Column]:
    """Time and tokens to a target val loss, against the rung above."""
    def time_to(i: int, a: Arm) -> str:
        if a.target is None:
            return ""
        if not a.target.reached:
            return "not reached"
        runs = len(a.done)
        return a.target.time_s.shown(".1f") + (f" reached {a.target.reached}/{runs}" if a.target.reached < runs
                                               else "")

    return [Column(f"time to {target} (s)", time_to),
            Column("time to it vs the rung above", lambda i, a: ratio_shown(
                a.versus.to_target.median, a.versus.to_target.inside_noise) if a.versus and a.versus.to_target
                else ""),
            Column("tokens to it", lambda i, a: f"{a.target.tokens:,.0f}" if a.target and a.target.tokens else "")]

