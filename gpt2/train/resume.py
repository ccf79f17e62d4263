"""Which checkpoint a run continues from (``start``), and the rules that keep a resumed run the same run.

- No checkpoint, or ``train.resume: never``: a fresh start.
- A finished run of exactly these params and data, trained by this code: nothing trains; its reports are
  rebuilt from it.
- A finished run of other params, data or code, or no checkpoint: the interrupted run of these params kept
  in ``.dvc/tmp/gpt2-interrupted/`` continues if there is one (``dvc exp run`` puts its baseline's
  checkpoint back before it runs); else a finished run that only gets longer (``train.max_steps`` or
  ``max_tokens``) goes on from its last step; else a fresh start (said so). A checkpoint a new run would
  overwrite is kept first (``keep_replaced``), unless DVC's cache holds it.
- An unfinished run: it continues, unless the model, the data or the optimizer changed, which is
  refused (the weights would not fit, would go on learning other text, or the optimizer's state
  would belong to another algorithm). Changed code is allowed and said (a fix resumes a long run).
  Other changed train settings are allowed, listed, and apply
  from the resumed step: the optimizer keeps its state (moments, step counts) and takes the
  configured hyperparameters (learning rates, weight decay, betas, Muon's momentum, fused or not).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpt2.core import log, paths
from gpt2.core.config import REUSABLE_TRAIN_FIELDS, ModelParams, TrainConfig, to_dict
from gpt2.core.digest import file_md5
from gpt2.core.errors import UserError
from gpt2.core.provenance import dvc_cache_file, training_code_digest
from gpt2.run import checkpoint
from gpt2.run.names import COMPARISON_RUN_ENV
from gpt2.train import run_state
from gpt2.train.build import Setup
from gpt2.train.history import History
from gpt2.train.interrupted import interrupted_dir, is_own, kept_interrupted, tidy_interrupted
from gpt2.train.optim import lr_at
from gpt2.train.reports import write_reports

logger = log.get("train")

CODE_CHANGED = "trained by other code (the training code in gpt2/ changed since)"

# Model fields that do not change the weights' shapes or meaning: a checkpoint may resume across them.
RESUMABLE_MODEL_FIELDS = {"attention", "dropout"}


@dataclass
class Start:
    """Where a session of a run begins: step 0 of a fresh run, a resumed run's step, or a finished run."""

    step: int = 0
    history: History = field(default_factory=History)
    run_id: str | None = None  # the MLflow run a resumed run goes on logging to
    changes: dict[str, tuple[Any, Any]] | None = None  # train settings changed since the checkpoint; None: fresh
    kept_from: Path | None = None  # the kept interrupted copy this session resumes (train/interrupted.py)
    finished: dict[str, Any] | None = None  # a finished run of these params and data: its summary


def start(path: Path, s: Setup) -> Start:
    """Resume the checkpoint at ``path``, reuse it (finished), or start afresh, as the rules above say; the
    weights, optimizer, data stream and RNGs of a resumed run are in place on return."""
    if s.dist.main:
        tidy_interrupted(s)
    state = load_for_resume(path, s)
    if state is None:
        return Start()
    if state.get("metrics") is not None:
        return Start(state["step"], History(**state["history"]), finished=state["metrics"])
    kept_from = Path(state["kept_from"]) if "kept_from" in state else None
    step, history, run_id = restore(s, state)
    cfg = s.params.train
    logger.info(f"train: resuming at step {step}/{s.total_steps}" if s.total_steps else
                f"train: resuming at step {step}, {history.train_s:.1f} s of the {cfg.time_budget_s:g} s budget spent")
    return Start(step, history, run_id, changed_settings(state, s), kept_from)


def reuse(start: Start, path: Path, report_dir: Path | None, main: bool) -> dict[str, Any]:
    """A finished run of these params and data: its reports are rebuilt from the checkpoint; nothing trains."""
    assert start.finished is not None
    if main and report_dir is not None:
        write_reports(report_dir, start.finished, start.history)
    logger.info(f"train: {path} is a finished run of these params and data ({start.step} steps); "
                f"rebuilt {report_dir} from it instead of training again (train.resume: never retrains)")
    return start.finished


def load_for_resume(path: Path, s: Setup) -> dict[str, Any] | None:
    """The checkpoint to continue from, None for a fresh start, or a refusal (UserError)."""
    if s.params.train.resume == "never":
        if path.exists() and s.dist.main:
            say_replaced(path, "held a run", "train.resume: never starts afresh")
        return None
    state = checkpoint.load(path) if path.exists() else None
    if state is None or state.get("metrics") is not None or state["step"] >= (state["total_steps"] or math.inf):
        if state is not None and state.get("metrics") is not None and other_run(state, s) is None:
            return state  # finished with these params and data by this code: its reports are rebuilt, nothing retrains
        found = instead_of_finished(path, state, s)
        if found is None:
            return None
        state, path = found
    bad = checkpoint.non_finite(checkpoint.clean_state_dict(state["model"]))
    if bad:  # its first step would diverge at once, whatever the learning rate
        raise UserError(f"{path} holds NaN or inf weights ({len(bad)} tensors, {bad[0]} first): its run diverged or "
                        "the file is damaged, so it cannot be resumed; restore a good copy, or set train.resume: "
                        "never to start over (the file is then kept, not overwritten)")
    old, new = state["model_config"], dataclasses.asdict(s.model_cfg)
    diffs = [f"{k} {old.get(k)} → {v}" for k, v in new.items() if k not in RESUMABLE_MODEL_FIELDS and old.get(k) != v]
    if state["data"] != s.data_identity:
        diffs.append("training data (data/tokens changed)")
    if diffs:
        raise UserError(f"{path} holds an unfinished run (step {state['step']}/{state['total_steps']}) of another "
                        f"model or data: {', '.join(diffs)}; restore those params to resume it, or set "
                        f"train.resume: never (or delete {path}) to start over")
    was = state["params"]["train"].get("optimizer", "adamw")
    if was != s.params.train.optimizer:
        raise UserError(f"{path} holds an unfinished run (step {state['step']}/{state['total_steps']}) trained "
                        f"with train.optimizer {was}; {s.params.train.optimizer}'s state cannot continue it; set "
                        f"train.optimizer: {was} to resume it, or train.resume: never (or delete {path}) to start over")
    if s.total_steps is not None and state["step"] > s.total_steps:
        raise UserError(f"{path} holds an unfinished run at step {state['step']}, past this run's {s.total_steps} "
                        f"steps (train.max_steps or max_tokens); set train.max_steps {state['step']} or more to "
                        f"finish it, or train.resume: never to start over (the file is then kept, not overwritten)")
    for key, (old, new) in changed_settings(state, s).items():
        logger.info(f"train: resuming with train.{key} changed: {old} → {new} (applies from step {state['step']})")
    if state.get("code") != training_code_digest():
        logger.info(f"train: resuming a run begun by other code (the training code in gpt2/ changed since): the "
                    f"steps from {state['step']} on run this code")
    return state


def instead_of_finished(path: Path, state: dict[str, Any] | None, s: Setup) -> tuple[dict[str, Any], Path] | None:
    """No checkpoint at ``path``, or a finished run other than this one: the state and path this run goes on
    from (the interrupted run of these params kept in ``.dvc/tmp/gpt2-interrupted/``, else the finished run made
    longer), or None for a fresh start. A finished model this run will overwrite is kept first."""
    kept = kept_interrupted(s)  # `dvc exp run` put its baseline's checkpoint back in place of the interrupted one
    kept_state = checkpoint.load(kept) if kept is not None else None
    if kept_state is not None and not is_own(kept, s) and kept_state["step"] > (s.total_steps or math.inf):
        logger.info(f"train: the interrupted run kept in {kept} (other train settings) is at step "
                    f"{kept_state['step']}, past this run's {s.total_steps} steps: this run starts anew and "
                    "leaves it kept for its own settings")
        kept = kept_state = None
    longer = state is not None and lengthens(state, s)
    if kept is None and longer and (refused := why_not_longer(state, s)) is None:
        if s.dist.main:  # a copy: the file stays in place until this run's first save replaces it
            say_replaced(path, f"was a finished run of {state['step']} steps", (
                f"going on from step {state['step']} to {s.total_steps}: only its length changed "
                f"({', '.join(said(param_changes(state, s)))}); {schedule_from(state, s)}; a fresh run of "
                f"{s.total_steps} steps differs (train.resume: never trains one)"), copy=True)
        state["metrics"] = None
        state["history"]["lengthened_at"] = [*state["history"].get("lengthened_at", []), state["step"]]
        return state, path
    resuming = f"resuming the interrupted run of these params and data kept in {kept}"
    if state is not None and s.dist.main:  # this run's first save would overwrite it
        why = other_run(state, s)
        if kept is None and longer:
            why = f"{why}, and it does not go on from there: {refused}"
        hint = ("; a change that trains the same (a refactor, a comment) keeps the model if "
                "`dvc commit train -f` runs before `dvc repro` (to get it back now, stop this run: "
                "docs/training.md, \"Checkpoints and resume\", says how)" if why == CODE_CHANGED else "")
        say_replaced(path, f"was a finished run ({state['step']} steps) "
                           f"{why or 'written before checkpoints kept their summary'}",
                     resuming if kept is not None else f"starting a new run{hint}")
    if kept is None:
        return None
    if state is None:
        logger.info(f"train: {resuming} ({path} is missing)")
    kept_state["kept_from"] = str(kept)  # removed once the run finishes, or is kept again under its new settings
    return kept_state, kept


def say_replaced(path: Path, what: str, then: str, copy: bool = False) -> None:
    """Keep the checkpoint a new run is about to overwrite (``keep_replaced``) and say, in one line, what it
    held, where it is kept and what this run does instead."""
    kept, where = keep_replaced(path, copy)
    (logger.info if kept is None else logger.warning)(f"train: {path} {what}; {where}; {then}")


def keep_replaced(path: Path, copy: bool = False) -> tuple[Path | None, str]:
    """A new run is about to overwrite the checkpoint at ``path``: keep it, unless DVC's cache holds it already
    (``dvc exp apply`` or ``dvc checkout`` brings it back). In a DVC project (a stage, or ``gpt2 train`` run in
    one) it moves to the project's ``.dvc/tmp/gpt2-kept/``, not beside itself in the train stage's output folder,
    whose hash and cache it would grow; outside one, beside itself. Named by its MD5. ``copy``: copied, not moved
    (a run that goes on from it reads it). Returns where it was kept (None where DVC's cache has it) and a phrase
    that says where it is."""
    md5 = file_md5(path)
    project = _dvc_project(path)
    if project is not None:
        cached = dvc_cache_file(md5, project)
        if cached.is_file():
            return None, f"DVC's cache keeps it ({cached}: `dvc checkout` brings back the one dvc.lock records)"
        target = project / ".dvc" / "tmp" / "gpt2-kept" / f"{path.stem}.{md5[:12]}{path.suffix}"
    else:
        target = path.with_name(f"{path.stem}.{md5[:12]}{path.suffix}")
    target.parent.mkdir(parents=True, exist_ok=True)
    (shutil.copy2 if copy else shutil.move)(path, target)
    return target, (f"kept as {target} ({target.stat().st_size / 1e6:,.0f} MB), not overwritten: delete it once "
                    "you no longer need it")


def _dvc_project(checkpoint: Path) -> Path | None:
    """The DVC project a checkpoint belongs to: ``DVC_ROOT`` under DVC, else the nearest folder at or above the
    checkpoint's that holds ``.dvc/``; None outside any."""
    if interrupted_dir() is not None:
        return Path(os.environ["DVC_ROOT"])
    return paths.enclosing(checkpoint.parent, ".dvc")


def changed_settings(state: dict[str, Any], s: Setup) -> dict[str, tuple[Any, Any]]:
    """The train settings that differ from the checkpoint's: {key: (checkpoint's value, this run's)}."""
    now = to_dict(s.params.train)
    return {key: (was, now[key]) for key, was in state["params"]["train"].items()
            if key in now and _normal(was) != _normal(now[key])}


def other_run(state: dict[str, Any], s: Setup) -> str | None:
    """How a checkpoint's run differs from this one (None: the same run): other model or train params (named),
    other data, or other training code (a checkpoint from before checkpoints recorded their code counts as other
    code)."""
    changed = said(param_changes(state, s))
    if state["data"] != s.data_identity:
        changed.append("other training data (data/tokens changed)")
    if changed:
        return f"of other params or data ({', '.join(changed)})"
    if state.get("code") != training_code_digest():
        return CODE_CHANGED
    return None


def param_changes(state: dict[str, Any], s: Setup) -> dict[str, tuple[Any, Any]]:
    """The model and train params that differ from a checkpoint's: {``train.lr``: (checkpoint's, this run's)};
    tracking switches (REUSABLE_TRAIN_FIELDS) do not count. A key that a checkpoint's params lack is a switch
    added since, and it trained as that switch's default does; one that this run's lack was removed since."""
    changed = {}
    for section, defaults, params in (("model", ModelParams(), s.params.model), ("train", TrainConfig(),
                                                                                  s.params.train)):
        was, now = {**to_dict(defaults), **state["params"][section]}, to_dict(params)
        changed |= {f"{section}.{key}": (was.get(key), now.get(key, "(no longer a param)")) for key in {**was, **now}
                    if key not in REUSABLE_TRAIN_FIELDS
                    and (key not in now or _normal(was.get(key)) != _normal(now[key]))}
    return changed


def said(changes: dict[str, tuple[Any, Any]]) -> list[str]:
    return [f"{key} {was} → {now}" for key, (was, now) in changes.items()]


LENGTH_KEYS = {"train.max_steps", "train.max_tokens"}  # what a longer run of a finished one may change


def lengthens(state: dict[str, Any], s: Setup) -> bool:
    """This run differs from a finished one only in its length (``train.max_steps`` or ``max_tokens``), which is
    longer than the steps that run trained."""
    changed = param_changes(state, s)
    return bool(changed) and set(changed) <= LENGTH_KEYS and (s.total_steps or 0) > state["step"]


def why_not_longer(state: dict[str, Any], s: Setup) -> str | None:
    """Why a finished run that this run lengthens does not go on from its last step (None: it does)."""
    if os.environ.get(COMPARISON_RUN_ENV):
        return "a grid's or ladder's run trains anew, so that a longer arm never continues a shorter one's weights"
    if state["total_steps"] is None or state["step"] != state["total_steps"]:
        return (f"it ended at step {state['step']}, before its {state['total_steps'] or '?'} "
                "(train.target_val_loss or a time budget stopped it)")
    if state["data"] != s.data_identity:
        return "its training data changed"
    if state.get("code") != training_code_digest():
        return ("it was trained by other code (the training code in gpt2/ changed since; after a change that "
                "trains the same, `dvc commit train -f` before the run lets it go on)")
    return None


def schedule_from(state: dict[str, Any], s: Setup) -> str:
    """What the learning rate does where a finished run goes on: the schedule is this run's, over its new length,
    so a cosine that had decayed to min_lr rises to where the longer one stands at that step."""
    cfg, step = s.params.train, state["step"]
    if cfg.lr_schedule == "constant":
        return f"the learning rate stays {cfg.lr:.2e}"
    was, now = cfg.lr * lr_at(step - 1, cfg, state["total_steps"]), cfg.lr * lr_at(step, cfg, s.total_steps)
    return (f"the learning rate follows the {s.total_steps}-step cosine from there: {was:.2e} at step {step}, "
            f"{now:.2e} at step {step + 1}")


def _normal(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def restore(s: Setup, state: dict[str, Any]) -> tuple[int, History, str | None]:
    """Put the checkpoint's restored parts in place (train/run_state.py: weights, optimizers, scaler, data stream,
    RNGs); return (step, history, MLflow run id)."""
    run_state.load(s, state)
    return state["step"], History(**state["history"]), state["mlflow_run_id"]
