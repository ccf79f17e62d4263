"""Running the ladder: each rung's runs as DVC experiments, one at a time, reused when already measured."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from gpt2.core import log, paths
from gpt2.core.atomic import check_owned
from gpt2.core.config import ModelParams, TrainConfig, build, read_yaml, to_dict
from gpt2.core.errors import UserError
from gpt2.measure import experiments
from gpt2.measure.ladder.report import LADDER_FILES, log_to_mlflow, write_report
from gpt2.measure.ladder.spec import EXP_PREFIX, Ladder, Resolved, load_ladder, resolve
from gpt2.measure.ladder.stats import Row, analyse, decide

logger = log.get("ladder")


def normalized(params: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """An experiment's model and train params as the trainer sees them (defaults filled), or None if invalid."""
    try:
        return {"model": to_dict(build(ModelParams, params.get("model") or {}, "model")),
                "train": to_dict(build(TrainConfig, params.get("train") or {}, "train"))}
    except UserError:
        return None


def measured(resolved: Resolved, exps: list[experiments.Experiment]) -> list[list[experiments.Experiment]]:
    """Per rung: the finished ``ladder-`` experiments with exactly its params, newest first."""
    found: list[list[experiments.Experiment]] = [[] for _ in resolved.sections]
    for exp in exps:
        if not exp.name.startswith(EXP_PREFIX) or paths.TRAIN_METRICS not in exp.metrics:
            continue
        sections = normalized(exp.params)
        for i, wanted in enumerate(resolved.sections):
            if sections == wanted:
                found[i].append(exp)
    return [sorted(runs, key=lambda e: e.timestamp, reverse=True) for runs in found]


def schedule(repeats: int, have: list[int]) -> list[tuple[int, int]]:
    """(rung, repeat) pairs still to run: repeat r goes forward when r is even, backward when odd."""
    order = []
    for r in range(repeats):
        rungs = range(len(have)) if r % 2 == 0 else reversed(range(len(have)))
        order += [(i, r) for i in rungs if r >= have[i]]
    return order


def run_ladder(ladder_path: str | Path = paths.LADDER, params_path: str | Path = paths.PARAMS,
               out: str | Path = paths.LADDER_REPORTS, device: str = "auto", model: str | None = None,
               steps: int | None = None, repeats: int | None = None, fresh: bool = False,
               mlflow: bool | None = None, target: float | None = None, time_budget_s: float | None = None,
               apply: bool = False, as_json: bool = False) -> list[Row]:
    """Measure every rung as DVC experiments (reusing ones already measured), then write the report.
    ``time_budget_s``: every run trains that long, and rungs compare val loss at equal time. ``apply``: write
    the winning rungs' changes into params.yaml. ``as_json``: the comparison on stdout as JSON, not the table."""
    root, started = paths.root(), time.time()
    check_owned(Path(out).absolute(), LADDER_FILES, "gpt2 ladder")  # before an hour of runs, not after
    if apply:
        from gpt2.measure.apply import refuse_uncommitted

        refuse_uncommitted(Path(params_path))
    ladder = load_ladder(ladder_path)
    raw = read_yaml(params_path, "params", "--params")  # raw: the rungs override it key by key
    if not isinstance(raw, dict):
        raise UserError(f"params file {str(params_path)!r} must be a mapping of sections")
    device = resolve_device(device)
    resolved = resolve(ladder, raw, device, model, steps, repeats, mlflow, target, time_budget_s)
    experiments.check_repo(root)
    if changed := experiments.uncommitted_params(root, params_path):
        logger.warning(f"ladder: {params_path} differs from the last commit ({changed}), and every rung starts from "
                       "it, as dvc exp run does; to measure from the committed params: git checkout "
                       f"{params_path} (an earlier dvc exp run -S leaves its setting there)")
    running = experiments.pending(root, ("Running",))
    if running:
        raise UserError(f"{len(running)} queued DVC experiment(s) running ({', '.join(running[:5])}); the ladder "
                        "times one experiment at a time on an otherwise idle machine: wait for them or stop "
                        "them (dvc queue kill NAME) first")
    existing = experiments.finished(root, (paths.TRAIN_SUMMARY,))
    have = [0] * len(resolved.sections) if fresh else [len(runs) for runs in measured(resolved, existing)]
    unshown = [i for i, why in enumerate(resolved.cannot_show) if why]
    repeats = resolved.profile.repeats
    todo = schedule(repeats, [repeats if i in unshown else h for i, h in enumerate(have)])
    reused = sum(min(h, resolved.profile.repeats) for i, h in enumerate(have) if i not in unshown)
    logger.info(f"ladder: {len(ladder.rungs)} rungs × {resolved.profile.repeats} repeats on {device} "
                f"(model {resolved.sections[0]['model']['size']}, {resolved.profile.steps} steps per run): "
                f"{len(todo)} to run, {reused} reused"
                + "".join(f"; rung {i} {ladder.rungs[i].name!r} cannot show on {device}: {resolved.cannot_show[i]}"
                          for i in unshown))
    if todo:
        _measure(root, ladder, resolved, todo, {e.name for e in existing}, Path(out))
        existing = experiments.finished(root, (paths.TRAIN_SUMMARY,))
    runs = [[] if resolved.cannot_show[i] else r[:resolved.profile.repeats]
            for i, r in enumerate(measured(resolved, existing))]
    curves = {e.name: experiments.val_curve(root, e.rev) for group in runs for e in group}
    rows = analyse(ladder, resolved, runs, curves)
    changes = decide(rows, resolved, time_budget_s, str(Path(out) / "ladder.md"))
    data = write_report(Path(out), rows, resolved, runs, changes, as_json)
    if resolved.sections[0]["train"]["mlflow"]:
        log_to_mlflow(rows, resolved, runs, Path(out), started)
    failed = [row.rung for row in rows if row.runs < resolved.profile.repeats and not resolved.cannot_show[row.index]]
    if as_json:
        print(json.dumps(data, indent=2), flush=True)
    if failed:
        raise UserError(f"ladder: rung(s) {', '.join(failed)} did not finish every run; see {out}/dvc.log; "
                        "the report marks them" + ("; nothing applied" if apply else ""))
    if apply:
        from gpt2.measure.apply import apply as write

        logger.info(f"ladder: {write(changes, params_path)}")
    return rows


def resolve_device(device: str) -> str:
    """``--device`` as a device type; a CPU needs no check (nor torch's import: seconds of a ladder that only
    reads its experiments back)."""
    if device == "cpu":
        return device
    from gpt2.run.device import pick_device

    return pick_device(device, "--device").type


def _measure(root: Path, ladder: Ladder, resolved: Resolved, todo: list[tuple[int, int]], taken: set[str],
             out: Path) -> None:
    """Run ``todo`` one experiment at a time, in its order (the repeats' alternation is the point)."""
    planned = []
    for i, r in todo:
        n = 1
        while f"{EXP_PREFIX}{i:02d}-{ladder.rungs[i].slug}-{n}" in taken:
            n += 1
        name = f"{EXP_PREFIX}{i:02d}-{ladder.rungs[i].slug}-{n}"
        taken.add(name)
        planned.append(experiments.Planned(name, resolved.sets[i], f"rung {i} {ladder.rungs[i].name!r}, repeat "
                                           f"{r + 1}/{resolved.profile.repeats}",
                                           f"ladder · {i:02d} {ladder.rungs[i].name} · run {r + 1}"))
    experiments.run_in_turn(root, planned, "train", out / "dvc.log", "ladder",
                            " and reused by the next `gpt2 ladder`")
