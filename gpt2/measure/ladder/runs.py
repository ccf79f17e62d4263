"""Running the ladder: each rung's settings and run names, made in turn by procedure.py, then the report."""

from __future__ import annotations

import time
from pathlib import Path

from gpt2.core import log, paths
from gpt2.core.atomic import check_owned
from gpt2.core.config import read_yaml
from gpt2.core.errors import UserError
from gpt2.measure import procedure
from gpt2.measure.compare import ALPHA, Judged, judge
from gpt2.measure.ladder.report import LADDER_FILES, arms, decide, write_report
from gpt2.measure.ladder.spec import EXP_PREFIX, resolve, load_ladder
from gpt2.measure.parent_run import log_parent
from gpt2.measure.planned import Planned

logger = log.get("ladder")


def run_ladder(ladder_path: str | Path = paths.LADDER, params_path: str | Path = paths.PARAMS,
               out: str | Path = paths.LADDER_REPORTS, device: str = "auto", model: str | None = None,
               steps: int | None = None, repeats: int | None = None, mlflow: bool | None = None,
               target: float | None = None, time_budget_s: float | None = None, apply: bool = False,
               as_json: bool = False, alpha: float = ALPHA) -> Judged:
    """Measure every rung as DVC experiments, each run in its turn, then write the report. ``time_budget_s``:
    every run trains that long, and rungs compare val loss at equal time. ``apply``: write the winning rungs'
    changes into params.yaml. ``as_json``: the comparison on stdout as JSON, not the table."""
    root, started = paths.root(), time.time()
    out = Path(out)
    check_owned(out.absolute(), LADDER_FILES, "gpt2 ladder")  # before an hour of runs, not after
    procedure.check_before("ladder", root, params_path, apply)
    ladder = load_ladder(ladder_path)
    raw = read_yaml(params_path, "params", "--params")  # raw: the rungs override it key by key
    if not isinstance(raw, dict):
        raise UserError(f"params file {str(params_path)!r} must be a mapping of sections")
    device = resolve_device(device)
    resolved = resolve(ladder, raw, device, model, steps, repeats, mlflow, target, time_budget_s)
    repeats = resolved.profile.repeats
    seeds = procedure.repeat_seeds(raw, repeats)
    unshown = [i for i, why in enumerate(resolved.cannot_show) if why]
    todo = [(i, r) for i, r in procedure.alternating(len(ladder.rungs), repeats) if i not in unshown]
    held = ({"train.holdout_windows": procedure.holdout_size([section["train"] for section in resolved.sections])}
            if apply else {})
    run_sets = {(i, r): {**resolved.sets[i], "train.seed": seeds[r], **held} for i, r in todo}
    plan, stopped = procedure.stopped_plan(root, "ladder", params_path, "train", [run_sets[run] for run in todo])
    names, done = procedure.run_names(root, stopped, lambda taken: [
        [] if i in unshown else [_free(f"{EXP_PREFIX}{i:02d}-{rung.slug}", taken) for _ in range(repeats)]
        for i, rung in enumerate(ladder.rungs)], lambda used, taken: _free(used.rsplit("-", 1)[0], taken))
    started = (stopped or {}).get("started", started)  # a stopped ladder's MLflow run spans the runs it keeps
    shown = f"{len(ladder.rungs) - len(unshown)} of {len(ladder.rungs)}" if unshown else f"{len(ladder.rungs)}"
    logger.info(f"ladder: {shown} rungs × {repeats} repeat{'' if repeats == 1 else 's'} on {device} "
                f"(model {resolved.sections[0]['model']['size']}, {resolved.profile.steps} steps per run, "
                f"repeat r trains train.seed {', '.join(map(str, seeds))}): {len(todo)} run(s)"
                + "".join(f"; rung {i} {ladder.rungs[i].name!r} cannot show on {device}: {resolved.cannot_show[i]}"
                          for i in unshown))
    procedure.run_in_turn(root, [Planned(
        names[i][r], run_sets[i, r], f"rung {i} {ladder.rungs[i].name!r}, repeat {r + 1}/{repeats}",
        f"{i:02d} {ladder.rungs[i].name} · run {r + 1} · ladder") for i, r in todo], "train", out / "dvc.log", "ladder",
        plan={**plan, "names": names, "started": started}, done=done)
    runs = procedure.read_back(root, "ladder", names, seeds)
    judged = judge(arms(ladder, resolved, runs), alpha, resolved.profile.target)
    report = out / "ladder.md"
    changes, note = decide(judged, ladder, resolved, bool(time_budget_s), str(report), apply)
    text, data = write_report(out, judged, ladder, resolved, changes, note)
    if resolved.sections[0]["train"]["mlflow"]:
        log_parent("ladder", f"ladder {device}", judged, [out / f"ladder{s}" for s in (".md", ".json", ".png")], text,
                   resolved.sections[0]["train"]["experiment"], started,
                   {"ladder.steps": resolved.profile.steps, "ladder.repeats": repeats,
                    "ladder.model": resolved.sections[0]["model"]["size"], "ladder.device": device},
                   {"device": next((a.runtime.get("device_name") for a in judged.arms if a.runtime), device)},
                   {run.name: {"ladder.rung": arm.label, "ladder.index": str(i)}
                    for i, arm in enumerate(judged.arms) for run in arm.runs}, "ladder.rung", changes=changes)
    procedure.conclude("ladder", report, text, data, changes, params_path, apply, as_json, out / "dvc.log")
    return judged


def resolve_device(device: str) -> str:
    """``--device`` as a device type; a CPU needs no check (nor torch's import: seconds of a ladder that only
    reads its experiments back)."""
    if device == "cpu":
        return device
    from gpt2.run.device import pick_device

    return pick_device(device, "--device").type


def _free(prefix: str, taken: set[str]) -> str:
    """``prefix-1``, or the next number an earlier ladder has not taken."""
    n = 1
    while f"{prefix}-{n}" in taken:
        n += 1
    taken.add(f"{prefix}-{n}")
    return f"{prefix}-{n}"
