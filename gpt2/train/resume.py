"""Which checkpoint a run continues from, and the rules that keep a resumed run the same run.

- No checkpoint, or ``train.resume: never``: a fresh start.
- A finished run of exactly these params and data: nothing trains; its reports are rebuilt from it.
- A finished run of other params or data: a fresh start (said so).
- An unfinished run: it continues, unless the model or the data changed, which is refused (the
  weights would not fit, or would go on learning other text). Changed train settings are
  allowed and listed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from gpt2.core import log
from gpt2.core.config import to_dict
from gpt2.core.errors import UserError
from gpt2.train import checkpoint, sharded
from gpt2.train.reports import History
from gpt2.train.setup import Setup

logger = log.get("train")

# Model fields that do not change the weights' shapes or meaning: a checkpoint may resume across them.
RESUMABLE_MODEL_FIELDS = {"attention", "dropout"}

# Train fields that change neither the weights nor the measured figures: a finished run is reused across them.
REUSABLE_TRAIN_FIELDS = {"mlflow", "experiment", "resume", "dist_timeout_s", "dist_first_step_timeout_s",
                         "async_checkpoint"}


def load_for_resume(path: Path, s: Setup) -> dict[str, Any] | None:
    """The checkpoint to continue from, None for a fresh start, or a refusal (UserError)."""
    if s.params.train.resume == "never" or not path.exists():
        return None
    state = checkpoint.load(path)
    if state["step"] >= state["total_steps"] or state.get("metrics") is not None:  # or it stopped at its target
        if not same_run(state, s):
            why = "of other params or data"
        elif state.get("metrics") is None:
            why = "written before checkpoints kept their summary"
        else:
            return state  # finished with these params and data: its reports are rebuilt, nothing retrains
        logger.info(f"train: {path} is a finished run ({state['step']} steps) {why}; starting a new run")
        return None
    old, new = state["model_config"], dataclasses.asdict(s.model_cfg)
    diffs = [f"{k} {old.get(k)} → {v}" for k, v in new.items() if k not in RESUMABLE_MODEL_FIELDS and old.get(k) != v]
    if state["data"] != s.data_identity:
        diffs.append("training data (data/tokens changed)")
    if diffs:
        raise UserError(f"{path} holds an unfinished run (step {state['step']}/{state['total_steps']}) of another "
                        f"model or data: {', '.join(diffs)}; restore those params to resume it, or set "
                        f"train.resume: never (or delete {path}) to start over")
    now = {k: _normal(v) for k, v in to_dict(s.params.train).items()}
    for key, was in state["params"]["train"].items():
        if key in now and _normal(was) != now[key]:
            logger.info(f"train: resuming with train.{key} changed: {was} → {getattr(s.params.train, key)}")
    return state


def same_run(state: dict[str, Any], s: Setup) -> bool:
    """Whether a checkpoint was trained with exactly these model and train params, on this data."""
    train = {k: _normal(v) for k, v in to_dict(s.params.train).items() if k not in REUSABLE_TRAIN_FIELDS}
    saved = {k: _normal(v) for k, v in state["params"]["train"].items() if k not in REUSABLE_TRAIN_FIELDS}
    return state["params"]["model"] == to_dict(s.params.model) and saved == train and state["data"] == s.data_identity


def _normal(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def restore(s: Setup, state: dict[str, Any]) -> tuple[int, History, str | None]:
    """Put the checkpoint's weights, optimizer, scaler, data stream and RNGs in place; return
    (step, history, MLflow run id)."""
    if s.dist.sharded:  # each rank keeps its shard of the full state
        sharded.load_model_state(s.model, state["model"])
        for optimizer, optimizer_state in zip(s.optimizers, state["optimizer"], strict=True):
            sharded.load_optimizer_state(s.model, optimizer, optimizer_state)
    else:
        s.model.load_state_dict(state["model"])
        for optimizer, optimizer_state in zip(s.optimizers, state["optimizer"], strict=True):
            optimizer.load_state_dict(optimizer_state)
    s.scaler.load_state_dict(state["scaler"])
    s.sampler.load_state(state["sampler"])  # the global-batch stream: the same on every rank
    if state["world_size"] == s.dist.world:
        checkpoint.restore_rng_states(state["rng_per_rank"][s.dist.rank])
    else:
        logger.info(f"train: the checkpoint was written by {state['world_size']} process(es), this run has "
                    f"{s.dist.world}: weights, optimizer, step and data stream continue; dropout RNG starts afresh")
    return state["step"], History(**state["history"]), state["mlflow_run_id"]
