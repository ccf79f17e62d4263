"""A comparison's procedure, `gpt2 grid`'s and `gpt2 ladder`'s alike, written once: the checks before an hour of
runs; the runs planned (a seed per repeat, alternating order, names, a stopped plan gone on from); made one at a
time, their cost said first (planned.py), as DVC experiments (experiments.py) or in a revision's checkout
(revisions.py); read back as each arm's runs; and the outcome said on stdout, with the exit status and
``--apply``. grid.py and ladder/ say what they compare and report; compare.py judges.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpt2.core import log, paths
from gpt2.core.errors import Terminated, UserError
from gpt2.measure import experiments
from gpt2.measure.compare import Run, read_run
from gpt2.measure.planned import Planned, expected_cost, json_file, keep_run_start, too_short


def check_before(what: str, root: Path, params_path: str | Path, apply: bool, target: str | None = "train") -> None:
    """What stops a comparison before its first run rather than after an hour of them: ``--apply`` on a params file
    with uncommitted changes, a folder DVC cannot run experiments in, a ``target`` that is no stage, queued
    experiments running (they would share the machine with the runs timed here; queued ones that wait are left
    alone). Params that differ from the last commit are said: every run starts from them."""
    if apply:
        from gpt2.measure.apply import refuse_uncommitted

        refuse_uncommitted(Path(params_path))
    experiments.check_repo(root)
    if target is not None:  # None: the revisions' own dvc.yaml decide (revisions.checked_out's caller checks them)
        experiments.check_target(root, target)
    if changed := experiments.uncommitted_params(root, params_path):
        log.get(what).warning(f"{what}: {params_path} differs from the last commit ({changed}), and every run starts "
                              "from it, as dvc exp run does; to compare from the committed params: git checkout "
                              f"HEAD -- {params_path} (an earlier dvc exp run -S leaves its setting there)")
    if running := experiments.pending(root, ("Running",)):
        raise UserError(f"{len(running)} queued DVC experiment(s) running ({', '.join(running[:5])}); a {what} "
                        "times one experiment at a time on an otherwise idle machine: wait for them or stop them "
                        "(dvc queue kill NAME) first")


def alternating(count: int, repeats: int) -> list[tuple[int, int]]:
    """(arm, repeat) in the order a comparison runs them: every arm forward, then backward, and so on, so each run
    has a neighbour in time in every other arm to be paired with."""
    return [(i, r) for r in range(repeats) for i in (range(count) if r % 2 == 0 else reversed(range(count)))]


def repeat_seeds(params: dict[str, Any], repeats: int) -> list[int]:
    """The train.seed each repeat of a comparison trains: params.yaml's plus 1, 2, 3 … Every arm trains the same
    seed in one repeat, so its runs stay paired; none trains the committed run's own seed, so no run's train
    stage is the one dvc.lock holds, which DVC would skip and report with the committed run's figures."""
    from gpt2.core.config import TrainConfig

    base = (params.get("train") or {}).get("seed", TrainConfig.seed)
    return [int(base) + 1 + r for r in range(repeats)]


def holdout_size(trains: list[dict[str, Any]]) -> int:
    """How many held-out windows every run of a comparison scores for ``--apply``: as many as the most val windows
    any of its runs reads (the train sections ``trains``' train.eval_windows), so the confirmation reads as much
    text as the verdict; at least what train.holdout_windows asks."""
    from gpt2.core.config import TrainConfig

    return max(max(int(train.get("eval_windows", TrainConfig.eval_windows)), int(train.get("holdout_windows") or 0))
               for train in trains)


def interrupted_file(root: Path, what: str, key: str) -> Path:
    """Where a stopped grid or ladder keeps its plan: the project's ``.dvc/tmp`` (neither git nor DVC track it),
    one file per plan, so that stopping another comparison loses nothing of this one."""
    return root / ".dvc" / "tmp" / f"gpt2-{what}-interrupted-{key[:12]}.json"


def plan_key(root: Path, params_path: str | Path, target: str, sets: list[dict[str, Any]], code: bool = True) -> str:
    """What makes a comparison the same one again: the commit and (``code``) the workspace's uncommitted code, which
    the runs it keeps trained, the params file it starts from, its target and every run's settings in the order it
    runs them."""
    import hashlib

    params = Path(params_path).read_bytes() if Path(params_path).is_file() else b""
    blob = json.dumps([experiments.head_commit(root), experiments.code_digest(root) if code else None,
                       hashlib.sha256(params).hexdigest(), target, sets], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def stopped_plan(root: Path, what: str, params_path: str | Path, target: str,
                 sets: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The plan to keep with this comparison's runs (its ``key``, and its ``command``: the key less the code) and
    the one a stopped run of it kept (:func:`interrupted`), or None. A plan stopped with other uncommitted code is
    not gone on from (its runs trained that code) and is said."""
    plan = {"key": plan_key(root, params_path, target, sets), "command": plan_key(root, params_path, target, sets,
                                                                                  code=False)}
    if (stopped := interrupted(root, what, plan["key"])) is None:
        for path in sorted((root / ".dvc" / "tmp").glob(f"gpt2-{what}-interrupted-*.json")):
            if (other := json_file(path)) and isinstance(other, dict) and other.get("command") == plan["command"]:
                kept = len(other.get("done") or [])
                log.get(what).warning(
                    f"{what}: the same {what} stopped before with other uncommitted code ({kept} finished runs, "
                    f"{os.path.relpath(path)}): its runs trained that code, so this one measures every run anew "
                    f"(put that code back to go on from them, or rm {os.path.relpath(path)} to hear no more of it)")
    return plan, stopped


def interrupted(root: Path, what: str, key: str) -> dict[str, Any] | None:
    """The plan a stopped comparison with this ``key`` kept, or None: its run names (``names``, a list per arm),
    those of its runs that finished (``done``), the one it stopped in (``stopped``), when it began
    (``started``) and, for a grid, its ``name``."""
    record = json_file(interrupted_file(root, what, key))
    if not (isinstance(record, dict) and record.get("key") == key and isinstance(record.get("names"), list)):
        return None
    return record


def going_on(record: dict[str, Any], taken: set[str], fresh: Callable[[str], str]) -> tuple[list[list[str]],
                                                                                           frozenset[str]]:
    """A stopped plan's run names and the runs of it to keep: those it finished that DVC still lists, the one it
    stopped in included where DVC saved it all the same (the stop came as it ended). A name of the plan that
    another comparison took since is replaced by ``fresh(name)`` (which adds what it returns to ``taken``, as
    the commands' ``_free`` does), never by another of the plan's own names: its run is made anew."""
    names = [list(group) for group in record["names"]]
    done = frozenset({*(record.get("done") or ()), record.get("stopped")} & taken)
    others = {name for group in names for name in group if name in taken and name not in done}
    taken.update(name for group in names for name in group)
    return [[fresh(name) if name in others else name for name in group] for group in names], done


def run_names(root: Path, stopped: dict[str, Any] | None, fresh: Callable[[set[str]], list[list[str]]],
              again: Callable[[str, set[str]], str]) -> tuple[list[list[str]], frozenset[str] | None]:
    """Each arm's run names and the runs already made: going on from ``stopped`` (:func:`going_on`, a name another
    comparison took since renamed by ``again(name, taken)``), else ``fresh(taken)``, new names none of DVC's
    experiments has. ``taken`` grows with each name given."""
    taken = {e.name for e in experiments.finished(root)}
    if stopped:
        return going_on(stopped, taken, lambda used: again(used, taken))
    return fresh(taken), None


def run_in_turn(root: Path, planned: list[Planned], target: str, dvc_log: Path, what: str,
                collected: dict[str, Any] | None = None, plan: dict[str, Any] | None = None,
                done: frozenset[str] | None = None) -> None:
    """Run ``planned`` one at a time, in its order, with a progress line and an ETA; DVC's output goes to
    ``dvc_log``. What it will cost in all is said first. A failed experiment is said and skipped (it is missing
    from :func:`experiments.finished`); Ctrl-C or SIGTERM stops the running one and ends with a UserError that
    says what is kept. ``what``: the command (``grid``). A run in a revision's checkout is read back into ``collected``
    (name → (Experiment, val curve)) as soon as it ends. ``plan`` (its ``key`` from :func:`plan_key`, its
    ``names``) is kept with the runs that finished where a stop finds it (:func:`interrupted`), and dropped once
    every run is made. ``done``: going on from a stopped run of this plan, the runs of ``planned`` it finished,
    kept, not made again (None: a comparison of its own)."""
    from gpt2.core.progress import clock
    from gpt2.measure import revisions

    logger = log.get(what)
    left_to_run = [run for run in planned if run.name not in (done or ())]
    if done is None:
        dvc_log.unlink(missing_ok=True)
    else:
        logger.info(f"{what}: going on from the {what} stopped before: {len(done)} of its {len(planned)} runs "
                    "finished then and are kept (timed then, not beside the runs made now); "
                    f"{len(left_to_run)} to run")
    if left_to_run:  # a stop DVC outran (the run saved as it ended) can leave none
        logger.info(expected_cost(root, left_to_run, what))
    for warning in too_short(root, left_to_run, what):
        logger.warning(warning)
    durations: list[float] = []
    succeeded: list[tuple[Planned, float]] = []
    for position, run in enumerate(planned):
        if run.name in (done or ()):
            continue
        left = statistics.median(durations) * (len(left_to_run) - len(durations)) if durations else 0.0
        eta = f", the last took {durations[-1]:.0f} s, ETA {clock(left)}" if durations else ""
        logger.info(f"{what}: [{position + 1}/{len(planned)}] {run.label} ({run.name}){eta}")
        started = time.perf_counter()
        try:
            code = (revisions.run(run.checkout, run.name, run.params, target, dvc_log, run.run_name) if run.checkout
                    else experiments.run_now(root, run.name, run.sets, target, dvc_log, run.run_name))
        except KeyboardInterrupt as interrupt:
            going_on_from = ""
            if plan is not None:
                from gpt2.core.atomic import write_json

                kept = interrupted_file(root, what, plan["key"])
                kept.parent.mkdir(parents=True, exist_ok=True)
                write_json(kept, {**plan, "done": sorted({*(done or ()), *(r.name for r, _ in succeeded)}),
                                  "stopped": run.name})
                going_on_from = (f"; the same command again goes on from them (to measure them all anew instead: "
                                 f"rm {os.path.relpath(kept)})")
            error = UserError(
                f"{what} interrupted: the running run was stopped; the revisions' checkouts end with the {what}, "
                "which keeps none of its runs: the same command again starts over" if run.checkout else
                f"{what} interrupted: the running experiment was stopped; finished runs are kept "
                f"(dvc exp show){going_on_from}")
            error.exit_code = 143 if isinstance(interrupt, Terminated) else 130
            raise error from None
        durations.append(time.perf_counter() - started)
        if code == 0 and not run.checkout:  # a revision's run starts no DVC experiment: seconds shorter
            succeeded.append((run, durations[-1]))
            keep_run_start(root, succeeded)  # the next comparison's estimate: this machine's
        if run.checkout and code == 0 and (found := revisions.collect(run.checkout, run.name)):
            collected[run.name] = found
        if code != 0:
            logger.info(f"{what}: {run.name} failed (dvc exit {code}); its output is in {dvc_log}")
    if plan is not None:
        interrupted_file(root, what, plan["key"]).unlink(missing_ok=True)


def read_back(root: Path, what: str, names: list[list[str]], seeds: list[int | None],
              collected: dict[str, Any] | None = None) -> list[list[Run]]:
    """Each arm's runs as compare.py reads them, repeat r with seed ``seeds[r]``: from DVC's experiments (those
    that trained here, :func:`experiments.trained_here`), or from ``collected`` where the runs were made in
    revisions' checkouts (:func:`run_in_turn`). A run that did not finish reads as failed."""
    if collected is not None:
        found = {name: exp for name, (exp, _) in collected.items()}
        curves = {name: curve for name, (_, curve) in collected.items()}
    else:
        found = experiments.trained_here(root, experiments.finished(root, (paths.TRAIN_SUMMARY,)),
                                         {name for group in names for name in group}, what)
        curves = {name: experiments.val_curve(root, exp.rev) for name, exp in found.items()}
    return [[read_run(name, r, seeds[r], found.get(name), curves.get(name)) for r, name in enumerate(group)]
            for group in names]


def conclude(what: str, report: Path, text: str, data: dict[str, Any], changes: list[Any],
             params_path: str | Path, apply: bool, as_json: bool, dvc_log: Path) -> None:
    """The outcome: the report's markdown on stdout, or with ``as_json`` its JSON (the comparison alone, for a
    script or an agent), also where a run failed; then the failure (its output in ``dvc_log``), with nothing
    applied, or ``--apply``'s writing of the winner into the params file."""
    log.get(what).info(f"{what}: {report}")
    print(json.dumps(data, indent=2) if as_json else text, flush=True)
    if failed := data["failed"]:
        raise UserError(f"{what}: {', '.join(failed)} did not finish; see {dvc_log}; the report marks "
                        "them" + ("; nothing applied" if apply else ""))
    if apply:
        from gpt2.measure.apply import apply as write

        log.get(what).info(f"{what}: {write(changes, params_path)}")
