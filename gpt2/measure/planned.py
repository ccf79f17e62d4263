"""A comparison's planned runs, before the first starts: what each is (``Planned``), what they will cost in all
(at the pace of the last training here, plus a run's start and save as the last comparison here measured it),
and which are too short to read. procedure.py makes them in turn.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpt2.core import paths


@dataclass(frozen=True)
class Planned:
    """One run to make: its name, its ``-S`` settings, how the progress line names it, its MLflow run; with a
    ``checkout`` (``revisions.Checkout``), that revision's stages on ``params`` instead of a DVC experiment."""

    name: str
    sets: dict[str, Any]
    label: str
    run_name: str
    checkout: Any = None
    params: dict[str, Any] | None = None


RUN_START_S = 30.0  # a run's cost beside its training and evals (DVC's temporary workspace, the stages' start,
# the saves): 25-30 s for the tiny model on a 2-core AVX2 CPU (docs/benchmarks.md), until a comparison here measures it
RUN_START_FILE = ".dvc/tmp/gpt2-run-start.json"  # what the last comparison here measured (neither git nor DVC track it)


def run_start_s(root: Path) -> tuple[float, str]:
    """A run's cost beside its training at the workspace's pace here, and where the figure comes from: what the last
    comparison in this workspace measured, else RUN_START_S."""
    measured = json_file(root / RUN_START_FILE) or {}
    if isinstance(measured.get("run_start_s"), (int, float)):
        return float(measured["run_start_s"]), f"the median of the last comparison's {measured.get('runs')} run(s) here"
    return RUN_START_S, "a 2-core CPU's"


def keep_run_start(root: Path, finished_runs: list[tuple[Planned, float]]) -> None:
    """What each finished run took beyond its training at the workspace's pace, its median kept for the next
    comparison's estimate (a faster CPU starts DVC and the stages in half the time of RUN_START_S)."""
    pace = json_file(root / paths.TRAIN_SUMMARY)
    base = _params(root).get("train") or {}
    rest = [took - seconds for run, took in finished_runs
            if (seconds := run_seconds(_train_of(run, base), pace)) is not None]
    if rest and (root / ".dvc").is_dir():
        path = root / RUN_START_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"run_start_s": round(max(0.0, statistics.median(rest)), 1), "runs": len(rest)}))


def run_seconds(train: dict[str, Any], pace: dict[str, Any] | None) -> float | None:
    """About how long a run with train section ``train`` trains, evals included: its time budget or its steps, at
    ``pace`` (the summary.json of a training on this machine: its seconds per step, the share its evals added);
    None where it cannot be told."""
    perf = (pace or {}).get("perf") or {}
    evals = pace["wall_s"] / pace["train_s"] if pace and pace.get("wall_s") and pace.get("train_s") else 1.0
    if train.get("time_budget_s"):
        return float(train["time_budget_s"]) * evals
    if train.get("max_steps") and perf.get("step_ms"):
        return int(train["max_steps"]) * perf["step_ms"] / 1000 * evals
    return None


def expected_cost(root: Path, planned: list[Planned], what: str) -> str:
    """What ``planned`` will cost in all, said before the first run: each run's training at the pace of the last
    training in the workspace (reports/train/summary.json), plus a run's start and save (``run_start_s``)."""
    from gpt2.core.progress import clock

    pace = json_file(root / paths.TRAIN_SUMMARY)
    base = _params(root).get("train") or {}
    seconds = [run_seconds(_train_of(run, base), pace) for run in planned]
    if any(s is None for s in seconds):
        return (f"{what}: {len(planned)} run(s); what they cost is measured once the first ends (a run has neither a "
                f"time budget nor steps that {paths.TRAIN_SUMMARY}, a training here, can pace)")
    start, source = run_start_s(root)
    total = sum(seconds) + start * len(planned)
    return (f"{what}: {len(planned)} run(s), about {clock(total)} in all: {statistics.median(seconds):.0f} s of "
            f"training and evals a run (at the pace of {paths.TRAIN_SUMMARY}), and about {start:.0f} s to "
            f"start and save it ({source}); the ETA after each run is measured")


def _params(root: Path) -> dict[str, Any]:
    from gpt2.core.schema import read_yaml

    return read_yaml(root / paths.PARAMS, "params", "--params") or {}


def _train_of(run: Planned, base: dict[str, Any]) -> dict[str, Any]:
    """The train section ``run`` trains with: its revision's params, else the workspace's with its settings."""
    if run.params:
        return run.params.get("train") or {}
    return train_with(base, run.sets)


def train_with(base: dict[str, Any], sets: dict[str, Any]) -> dict[str, Any]:
    """The train section ``base`` becomes with the ``train.*`` keys of ``sets`` (``-S`` settings) set in it."""
    return {**base, **{k.removeprefix("train."): v for k, v in sets.items() if k.startswith("train.")}}


def too_short(root: Path, planned: list[Planned], what: str) -> list[str]:
    """Before the first run: the runs whose speed will rest on a handful of steps, whose time budget ends inside
    the warm-up that a training here took (reports/train/summary.json's ``perf.warmup_s``), whose steps end
    inside the learning rate's warm-up (each run's log says it too, in dvc.log, where nobody reads it first), or
    that evaluate too few times to tell when they reach a val loss."""
    from gpt2.core.config import TrainConfig
    from gpt2.run.figures import FEW_EVALS, FEW_TIMED_STEPS

    pace = (json_file(root / paths.TRAIN_SUMMARY) or {}).get("perf") or {}
    base = _params(root).get("train") or {}
    short, inside, warming, few_evals = [], [], [], []
    for run in planned:
        train = _train_of(run, base)
        warmup = train.get("timing_warmup_steps", TrainConfig.timing_warmup_steps)
        steps = None if train.get("time_budget_s") or not train.get("max_steps") else int(train["max_steps"])
        if train.get("time_budget_s") and pace.get("warmup_s") and train["time_budget_s"] <= pace["warmup_s"]:
            inside.append((run.name, train["time_budget_s"]))
        elif steps is not None and steps - warmup < FEW_TIMED_STEPS:
            short.append((run.name, steps - warmup))
        if steps is not None and steps < (lr_warmup := train.get("warmup_steps", TrainConfig.warmup_steps)):
            warming.append((run.name, (steps, lr_warmup)))
        interval = train.get("eval_interval", TrainConfig.eval_interval)
        evals = None if steps is None else (steps - 1) // interval + bool(train.get("final_eval", True))  # evaluator
        if evals is not None and evals < FEW_EVALS:
            few_evals.append((run.name, (evals, interval)))
    said = []
    if warming:
        said.append(f"{what}: {_names(warming)}: their {_span([n for _, (n, _) in warming])} steps end before the "
                    f"learning rate's warm-up does (train.warmup_steps {_span([w for _, (_, w) in warming])}): they "
                    "never train at train.lr, so their speeds hold but their losses compare warm-ups; lower "
                    "train.warmup_steps or train longer")
    if inside:
        said.append(f"{what}: the time budget of {_names(inside)} ({inside[0][1]:g} s) ends inside the warm-up a "
                    f"training here took ({pace['warmup_s']:g} s of compilation and first steps, {paths.TRAIN_SUMMARY}"
                    "): no step of theirs would be timed; give them a larger train.time_budget_s")
    if few_evals:
        said.append(f"{what}: {_names(few_evals)}: {_span([n for _, (n, _) in few_evals])} eval(s) a run "
                    f"(train.eval_interval {_span([k for _, (_, k) in few_evals])}): too few to read when a run "
                    "reaches the baseline's val loss, so the figures at equal loss will be missing or rough; "
                    "evaluate more often (-S train.eval_interval=N, a few evals a run)")
    if short:
        said.append(f"{what}: {_names(short)}: only {min(n for _, n in short)} step(s) past "
                    f"train.timing_warmup_steps are timed, and a speed read from fewer than {FEW_TIMED_STEPS} is no "
                    "measurement; train longer (-S train.max_steps=N) before trusting a speed verdict")
    return said


def _span(values: list[int]) -> str:
    """``13`` or ``13–30``: the least and the most of ``values``."""
    low, high = min(values), max(values)
    return f"{low}" if low == high else f"{low}–{high}"


def _names(runs: list[tuple[str, Any]]) -> str:
    names = [name for name, _ in runs]
    return ", ".join(names) if len(names) <= 3 else f"{len(names)} runs ({names[0]} …)"


def json_file(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
