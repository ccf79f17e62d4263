"""DVC experiments driven from Python: run one now, read them back (procedure.py runs a comparison's in turn).

Through DVC's own command line, not its Python internals: the CLI and ``dvc exp show
--json`` are what DVC keeps stable, and every experiment made here is one a user can
list, compare, apply or remove with the usual ``dvc exp`` commands.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpt2.core import paths
from gpt2.core.errors import UserError
from gpt2.run.names import COMPARISON_RUN_ENV, RUN_NAME_ENV


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
    return changes_since("HEAD", committed, path, root, full=True) or ""


def stage_code(root: Path) -> list[str]:
    """The code the pipeline's stages run, as dvc.yaml lists it: every stage's deps that no stage writes (the
    stages' scripts, the library's folders), params files aside, and dvc.yaml itself. Tests, benchmarks, docs
    and the comparison's own code are not in it: editing them changes no run."""
    if (stages := _stages(root)) is None:
        return [paths.PIPELINE, "gpt2", "stages"]
    written = {str(next(iter(out))) if isinstance(out, dict) else str(out)
               for stage in stages.values() for out in stage.get("outs") or []}
    deps = {str(dep) for stage in stages.values() for dep in stage.get("deps") or []}
    return sorted(deps - written - {paths.PARAMS}) + [paths.PIPELINE]


def _stages(root: Path) -> dict[str, Any] | None:
    """dvc.yaml's stages, or None where it cannot be read (DVC then says what is wrong with it)."""
    import yaml

    try:
        stages = (yaml.safe_load((root / paths.PIPELINE).read_text()) or {}).get("stages") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return stages if isinstance(stages, dict) else None


def _is_code(name: str, code: list[str]) -> bool:
    return any(name == part or name.startswith(part.rstrip("/") + "/") for part in code)


def _git_names(root: Path, *args: str) -> list[str]:
    """File names a git command lists, NUL-separated (a name git would quote stays as it is)."""
    out = subprocess.run(["git", *args], cwd=root, capture_output=True)
    return [name for name in out.stdout.decode(errors="surrogateescape").split("\0") if name]


def code_changes(root: Path, *commits: str, code: list[str] | None = None) -> list[str]:
    """The files of the stages' code (``code``, else :func:`stage_code`) that differ between ``commits`` (one: it
    and the workspace's tracked files), relative to ``root``."""
    code = code or stage_code(root)
    return [name for name in _git_names(root, "diff", "--name-only", "--relative", "-z", *commits, "--", ".")
            if _is_code(name, code)]


def uncommitted_code(root: Path) -> list[str]:
    """The stages' code the workspace holds and HEAD does not: tracked files changed since it, and untracked
    Python files git does not ignore. Every experiment runs it, whatever commit its records name."""
    code = stage_code(root)
    untracked = _git_names(root, "ls-files", "--others", "--exclude-standard", "-z", "--", "*.py")
    return code_changes(root, "HEAD", code=code) + [name for name in untracked if _is_code(name, code)]


def code_digest(root: Path) -> str:
    """What :func:`uncommitted_code` holds, as one digest ("" where the workspace's code is HEAD's)."""
    import hashlib

    if not (changed := uncommitted_code(root)):
        return ""
    digest = hashlib.sha256()
    for name in sorted(changed):
        path = root / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"(deleted)") + b"\0")
    return digest.hexdigest()


def named(files: list[str], most: int = 3) -> str:
    """``a.py, b.py ...``: the first few of ``files``."""
    return ", ".join(files[:most]) + (" ..." if len(files) > most else "")


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


def check_target(root: Path, target: str) -> None:
    """A ``--target`` that names no stage of dvc.yaml fails every run, each after DVC's start: refused first. A
    path or ``file:stage`` is left to DVC."""
    import difflib

    if ":" in target or "@" in target or (root / target).exists() or (stages := _stages(root)) is None:
        return
    if target not in stages:
        close = difflib.get_close_matches(target, list(stages), 1)
        raise UserError(f"--target {target!r} is no stage of {paths.PIPELINE} ({', '.join(stages)})"
                        + (f"; did you mean {close[0]!r}?" if close else ""))


def pending(root: Path, states: tuple[str, ...]) -> list[str]:
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
                                   env={**_env(), COMPARISON_RUN_ENV: name,
                                        **({RUN_NAME_ENV: run_name} if run_name else {})},
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


def head_commit(root: Path) -> str:
    """The commit checked out in ``root`` (empty outside a git repository)."""
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()


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
