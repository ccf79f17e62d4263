"""DVC experiments driven from Python: run them one at a time, read the results back.

Through DVC's own command line, not its Python internals: the CLI and ``dvc exp show
--json`` are what DVC keeps stable, and every experiment made here is one a user can
list, compare, apply or remove with the usual ``dvc exp`` commands.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpt2.core import paths
from gpt2.core.errors import Terminated, UserError


@dataclass(frozen=True)
class Experiment:
    """One finished experiment on the current commit, as ``dvc exp show`` reports it."""

    name: str
    rev: str
    timestamp: str
    params: dict[str, Any]  # params.yaml's content
    metrics: dict[str, Any]  # metrics file path -> its content
    files: dict[str, Any] = field(default_factory=dict)  # other JSON outputs asked for (path -> content)


def dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    """Run ``dvc ARGS`` in ``root``; a failure is a :class:`UserError` with DVC's own message."""
    try:
        result = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, capture_output=True, text=True,
                                env=_env())
    except OSError as exc:
        raise UserError(f"cannot run dvc ({exc}); install the project: pip install -c constraints.txt -e .") from None
    if result.returncode != 0:
        output = (result.stderr.strip() or result.stdout.strip())[-1500:]
        raise UserError(f"`dvc {' '.join(args[:3])} ...` failed (exit {result.returncode}): {output}")
    return result


def _env() -> dict[str, str]:
    return {**os.environ, "DVC_NO_ANALYTICS": "1"}


def uncommitted_params(root: Path, params_path: str | Path) -> str:
    """The params the workspace's params.yaml changes from the last commit (``compile=True``), or "": every
    experiment starts from the workspace, so a setting an earlier ``dvc exp run -S`` left there is in all of them."""
    from gpt2.run.names import changes_since

    path = Path(params_path).resolve()
    try:
        committed = f"./{path.relative_to(root.resolve()).as_posix()}"
    except ValueError:  # a params file outside the project: no commit holds it
        return ""
    return changes_since("HEAD", committed, path, root) or ""


def check_repo(root: Path) -> None:
    """DVC experiments need a git repo with a commit, a DVC project and (to queue) a git identity."""
    if not (root / paths.PIPELINE).is_file():
        raise UserError(f"{root} has no dvc.yaml; run from the project root")
    head = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], cwd=root, capture_output=True, text=True)
    if head.returncode != 0:
        raise UserError(f"{root} is not a git repository with a commit; DVC experiments are based on one: "
                        "git init && git add -A && git commit -m init")
    ident = subprocess.run(["git", "var", "GIT_COMMITTER_IDENT"], cwd=root, capture_output=True, text=True)
    if ident.returncode != 0:
        raise UserError("queued DVC experiments need a git identity: git config user.name NAME && "
                        "git config user.email EMAIL")


def pending(root: Path, states: tuple[str, ...] = ("Queued", "Running")) -> list[str]:
    """Names of the queue's experiments in one of ``states`` (``dvc queue status``)."""
    out = dvc(root, "queue", "status").stdout
    names = []
    for line in out.splitlines():
        cells = line.split()
        if len(cells) >= 3 and cells[-1] in states:
            names.append(cells[1])
    return names


def run_now(root: Path, name: str, sets: dict[str, Any], target: str, log: Path, run_name: str | None = None) -> int:
    """``dvc exp run --temp -n NAME -S key=value ... TARGET``: one experiment, in a temporary workspace, now.

    The same experiment a queued one would be (``dvc exp show`` lists it) without the queue's
    worker, which costs seconds before and after every run. DVC's output is appended to ``log``.
    Returns DVC's exit status. DVC runs in a session of its own, so that a signal to this command's
    process group (a scheduler's SIGTERM, Ctrl-C in a terminal) reaches it only as this command forwards
    it: SIGINT to DVC's group, on which DVC stops the stage, removes its temporary workspace (over
    100 MB: a copy of the repo) and keeps the experiments that finished; a SIGTERM would kill it with
    the workspace left behind. ``run_name``: the experiment's MLflow run name (``GPT2_RUN_NAME``)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as sink:
        process = subprocess.Popen([sys.executable, "-m", "dvc", "exp", "run", "--temp", "-n", name,
                                    *_set_args(sets), target], cwd=root, stdout=sink, stderr=subprocess.STDOUT,
                                   env={**_env(), "GPT2_COMPARISON_RUN": name,
                                        **({"GPT2_RUN_NAME": run_name} if run_name else {})},
                                   start_new_session=True)
        return wait_or_stop(process)


def wait_or_stop(process: subprocess.Popen) -> int:
    """The exit status of ``process`` (started in a session of its own); on Ctrl-C or SIGTERM (Terminated) its
    group gets SIGINT, so DVC and a stage stop as on Ctrl-C (SIGKILL after 60 s), and the interrupt goes on."""
    try:
        return process.wait()
    except KeyboardInterrupt:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        raise


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
    measured = _json_file(root / RUN_START_FILE) or {}
    if isinstance(measured.get("run_start_s"), (int, float)):
        return float(measured["run_start_s"]), f"the median of the last comparison's {measured.get('runs')} run(s) here"
    return RUN_START_S, "a 2-core CPU's"


def keep_run_start(root: Path, finished_runs: list[tuple[Planned, float]]) -> None:
    """What each finished run took beyond its training at the workspace's pace, its median kept for the next
    comparison's estimate (a faster CPU starts DVC and the stages in half the time of RUN_START_S)."""
    pace = _json_file(root / paths.TRAIN_SUMMARY)
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

    pace = _json_file(root / paths.TRAIN_SUMMARY)
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
    return {**base, **{k.split(".", 1)[1]: v for k, v in run.sets.items() if k.startswith("train.")}}


def too_short(root: Path, planned: list[Planned], what: str) -> list[str]:
    """Before the first run: the runs whose speed will rest on a handful of steps, or whose time budget ends inside
    the warm-up that a training here took (reports/train/summary.json's ``perf.warmup_s``)."""
    from gpt2.run.figures import FEW_TIMED_STEPS

    pace = (_json_file(root / paths.TRAIN_SUMMARY) or {}).get("perf") or {}
    base = _params(root).get("train") or {}
    short, inside = [], []
    for run in planned:
        train = _train_of(run, base)
        warmup = train.get("timing_warmup_steps", 5)
        if train.get("time_budget_s") and pace.get("warmup_s") and train["time_budget_s"] <= pace["warmup_s"]:
            inside.append((run.name, train["time_budget_s"]))
        elif not train.get("time_budget_s") and train.get("max_steps") and \
                int(train["max_steps"]) - warmup < FEW_TIMED_STEPS:
            short.append((run.name, int(train["max_steps"]) - warmup))
    said = []
    if inside:
        said.append(f"{what}: the time budget of {_names(inside)} ({inside[0][1]:g} s) ends inside the warm-up a "
                    f"training here took ({pace['warmup_s']:g} s of compilation and first steps, {paths.TRAIN_SUMMARY}"
                    "): no step of theirs would be timed; give them a larger train.time_budget_s")
    if short:
        said.append(f"{what}: {_names(short)}: only {min(n for _, n in short)} step(s) past "
                    f"train.timing_warmup_steps are timed, and a speed read from fewer than {FEW_TIMED_STEPS} is no "
                    "measurement; train longer (-S train.max_steps=N) before trusting a speed verdict")
    return said


def _names(runs: list[tuple[str, Any]]) -> str:
    names = [name for name, _ in runs]
    return ", ".join(names) if len(names) <= 3 else f"{len(names)} runs ({names[0]} …)"


def _json_file(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def head_commit(root: Path) -> str:
    """The commit checked out in ``root`` (empty outside a git repository)."""
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()


def interrupted_file(root: Path, what: str, key: str) -> Path:
    """Where a stopped grid or ladder keeps its plan: the project's ``.dvc/tmp`` (neither git nor DVC track it),
    one file per plan, so that stopping another comparison loses nothing of this one."""
    return root / ".dvc" / "tmp" / f"gpt2-{what}-interrupted-{key[:12]}.json"


def plan_key(root: Path, params_path: str | Path, target: str, sets: list[dict[str, Any]]) -> str:
    """What makes a comparison the same one again: the commit, the params file it starts from, its target and
    every run's settings in the order it runs them."""
    import hashlib

    params = Path(params_path).read_bytes() if Path(params_path).is_file() else b""
    blob = json.dumps([head_commit(root), hashlib.sha256(params).hexdigest(), target, sets], sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def interrupted(root: Path, what: str, key: str) -> dict[str, Any] | None:
    """The plan a stopped comparison with this ``key`` kept, or None: its run names (``names``, a list per arm),
    those of its runs that finished (``done``), the one it stopped in (``stopped``), when it began
    (``started``) and, for a grid, its ``name``."""
    record = _json_file(interrupted_file(root, what, key))
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


def run_in_turn(root: Path, planned: list[Planned], target: str, log: Path, what: str,
                collected: dict[str, Any] | None = None, plan: dict[str, Any] | None = None,
                done: frozenset[str] | None = None) -> None:
    """Run ``planned`` one at a time, in its order, with a progress line and an ETA; DVC's output goes to ``log``.
    What it will cost in all is said first. A failed experiment is said and skipped (it is missing from
    :func:`finished`); Ctrl-C or SIGTERM stops the running one and ends with a UserError that says what is kept.
    ``what``: the command (``grid``). A run in a revision's checkout is read back into ``collected``
    (name → (Experiment, val curve)) as soon as it ends. ``plan`` (its ``key`` from :func:`plan_key`, its
    ``names``) is kept with the runs that finished where a stop finds it (:func:`interrupted`), and dropped once
    every run is made. ``done``: going on from a stopped run of this plan, the runs of ``planned`` it finished,
    kept, not made again (None: a comparison of its own)."""
    from gpt2.measure import revisions

    from gpt2.core import log as logs
    from gpt2.core.progress import clock

    logger = logs.get(what)
    left_to_run = [run for run in planned if run.name not in (done or ())]
    if done is None:
        log.unlink(missing_ok=True)
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
            code = (revisions.run(run.checkout, run.name, run.params, target, log, run.run_name) if run.checkout
                    else run_now(root, run.name, run.sets, target, log, run.run_name))
        except KeyboardInterrupt as interrupt:
            if plan is not None:
                from gpt2.core.atomic import write_json

                kept = interrupted_file(root, what, plan["key"])
                kept.parent.mkdir(parents=True, exist_ok=True)
                write_json(kept, {**plan, "done": sorted({*(done or ()), *(r.name for r, _ in succeeded)}),
                                  "stopped": run.name})
            error = UserError(f"{what} interrupted: the running experiment was stopped; finished runs are kept "
                              "(dvc exp show)" + ("; the same command again goes on from them" if plan else ""))
            error.exit_code = 143 if isinstance(interrupt, Terminated) else 130
            raise error from None
        durations.append(time.perf_counter() - started)
        if code == 0:
            succeeded.append((run, durations[-1]))
            keep_run_start(root, succeeded)  # the next comparison's estimate: this machine's
        if run.checkout and code == 0 and (found := revisions.collect(run.checkout, run.name)):
            collected[run.name] = found
        if code != 0:
            logger.info(f"{what}: {run.name} failed (dvc exit {code}); its output is in {log}")
    if plan is not None:
        interrupted_file(root, what, plan["key"]).unlink(missing_ok=True)


def _set_args(sets: dict[str, Any]) -> list[str]:
    """``-S key=value`` for each setting. Values are JSON, which DVC's override parser reads back as written (its
    text unescaped: ``é`` itself, not ``\\u00e9``; a backslash it would double is refused by gpt2/measure/grid.py)."""
    return [arg for key, value in sets.items() for arg in ("-S", f"{key}={json.dumps(value, ensure_ascii=False)}")]


def finished(root: Path, files: tuple[str, ...] = ()) -> list[Experiment]:
    """The successful experiments based on the current commit (``dvc exp show --json``), each with
    the JSON ``files`` (git-tracked outputs such as ``reports/train/summary.json``) read from its commit."""
    data = json.loads(dvc(root, "exp", "show", "--json").stdout or "[]")
    head = head_commit(root)
    exps = [exp for baseline in data if baseline.get("rev") == head for exp in _experiments(baseline)]
    return [replace(exp, files={path: _json_at(root, exp.rev, path) for path in files}) for exp in exps]


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


def holdout_size(params: dict[str, Any]) -> int:
    """How many held-out windows a comparison's runs score for ``--apply``: as many as the val windows (params.yaml's
    train.eval_windows), so the confirmation reads as much text as the verdict; at least params.yaml's own."""
    from gpt2.core.config import TrainConfig

    train = params.get("train") or {}
    return max(int(train.get("eval_windows", TrainConfig.eval_windows)), int(train.get("holdout_windows") or 0))


def trained_here(root: Path, exps: list[Experiment], names: set[str], what: str) -> dict[str, Experiment]:
    """``exps`` among ``names``, by name, without those whose training figures are the last commit's to the last
    digit: DVC found their train stage unchanged and kept the committed run's figures, measured some other time
    (a ``-S train.seed`` that equals the committed one): they did not run in this comparison, and are missing."""
    from gpt2.core import log as logs

    committed = _json_at(root, "HEAD", paths.TRAIN_METRICS)
    out = {}
    for exp in exps:
        if exp.name not in names:
            continue
        if committed is not None and exp.metrics.get(paths.TRAIN_METRICS) == committed:
            logs.get(what).warning(f"{what}: {exp.name} did not train: DVC found its train stage unchanged from the "
                                   "last commit and kept the committed run's figures; it counts as failed (its "
                                   "params equal the committed ones, train.seed included: vary the seed)")
            continue
        out[exp.name] = exp
    return out


def val_curve(root: Path, rev: str) -> list[tuple[float, float, float]] | None:
    """An experiment's val curve from its committed val.tsv (:func:`parse_val_curve`)."""
    out = subprocess.run(["git", "show", f"{rev}:{paths.VAL_CURVE}"], cwd=root, capture_output=True, text=True)
    return parse_val_curve(out.stdout) if out.returncode == 0 else None


def parse_val_curve(text: str) -> list[tuple[float, float, float]] | None:
    """(training seconds, tokens, val loss) per eval from a val.tsv; None where it has none (a run without evals,
    or from a version that did not record the training time)."""
    lines = text.splitlines()
    if not lines:
        return None
    head = lines[0].split("\t")
    if not {"train_s", "tokens", "val_loss"} <= set(head):
        return None
    try:
        rows = [dict(zip(head, line.split("\t"))) for line in lines[1:]]
        curve = [(float(r["train_s"]), float(r["tokens"]), float(r["val_loss"])) for r in rows]
    except (KeyError, ValueError):
        return None
    return curve or None


def _json_at(root: Path, rev: str, path: str) -> Any:
    """A JSON file as committed in ``rev`` (an experiment's commit), or None where it is missing or unreadable."""
    out = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, text=True)
    try:
        return json.loads(out.stdout) if out.returncode == 0 else None
    except json.JSONDecodeError:
        return None


def _experiments(baseline: dict[str, Any]) -> Iterator[Experiment]:
    for entry in baseline.get("experiments") or []:
        executor = entry.get("executor") or {}
        if executor.get("state") not in (None, "success"):
            continue  # queued, running or failed
        for rev in entry.get("revs") or []:
            data = rev.get("data") or {}
            if rev.get("error") or not data:
                continue
            params = ((data.get("params") or {}).get(paths.PARAMS) or {}).get("data") or {}
            metrics = {path: (content or {}).get("data") or {} for path, content in (data.get("metrics") or {}).items()}
            yield Experiment(name=rev.get("name") or entry.get("name") or rev["rev"][:7], rev=rev["rev"],
                             timestamp=str(data.get("timestamp") or ""), params=params, metrics=metrics)


def workspace_dataset(root: Path) -> dict[str, Any] | None:
    """The project's token folder as an MLflow dataset (what a grid's or a ladder's runs trained on), or None
    where it is missing."""
    from gpt2.core.provenance import describe_tokens
    from gpt2.core.tokens import read_meta

    tokens = root / "data" / "tokens"
    try:
        return describe_tokens(tokens, read_meta(tokens), root)
    except (UserError, OSError, KeyError, ValueError):
        return None
