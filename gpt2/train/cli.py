"""`gpt2 train`: the train stage's command (``python -m gpt2.train.cli`` is what torchrun runs on each rank)."""

from __future__ import annotations

import sys

import click

from gpt2.core import paths
from gpt2.core.cli import PARAMS, SETS, user_errors


@click.command()
@PARAMS
@SETS
@paths.option("--tokens", default=paths.TOKENS, help="token files folder")
@paths.option("--checkpoint", "ckpt", default=paths.CHECKPOINT, help="checkpoint file")
@paths.option("--out", default=paths.TRAIN_REPORTS, help="report folder (metrics.json, plots/)")
@click.option("--evaluation", default=None, metavar="DIR",
              help="the checkpoint's evaluation (the DVC stage: reports/eval): removed once this run has replaced "
                   "the checkpoint it scored, so no report shows another run's figures as this run's")
@user_errors
def train(params_path: str, sets: tuple[str, ...], tokens: str, ckpt: str, out: str, evaluation: str | None) -> None:
    """Train GPT-2 on data/tokens/ as params.yaml says; resume an interrupted run."""
    from gpt2.core.config import load_params
    from gpt2.train import processes

    params = load_params(params_path, sets)
    if processes.must_launch(params.train):  # train.distributed: ddp on N processes: torchrun runs this again
        overrides = [arg for item in sets for arg in ("-S", item)]
        code = processes.launch(params.train, ["--params", params_path, *overrides, "--tokens", tokens,
                                               "--checkpoint", ckpt, "--out", out])
        if code == 0 and evaluation:
            _withdraw(evaluation, out)
        sys.exit(code)
    from gpt2.train.trainer import train as run

    run(params, tokens, ckpt, out)
    if evaluation:
        _withdraw(evaluation, out)


def _withdraw(evaluation: str, out: str) -> None:
    import os
    from pathlib import Path

    if int(os.environ.get("RANK", "0")) != 0:  # started by a torchrun of the user's (several nodes): rank 0's to do
        return

    from gpt2.core import log
    from gpt2.train.reports import withdraw_other_evaluation

    if withdraw_other_evaluation(Path(evaluation), Path(out) / "summary.json"):
        log.get("train").info(f"train: withdrew the evaluation in {evaluation} (its figures now null, its samples "
                              "removed): it scored another run's checkpoint, not the one this run wrote; the "
                              "evaluate stage scores this one")


@click.command()
@click.argument("checkpoint", default=paths.CHECKPOINT, callback=paths.default_in_project)
@user_errors
def replay(checkpoint: str) -> None:
    """Send what a training's MLflow run lacks (after the store stopped answering), from its CHECKPOINT.

    Sends every logged step, eval and final figure the run does not have yet, nothing twice, and marks a
    finished training's run FINISHED. A run missing from the store (a new DB) is started again with them all."""
    from gpt2.core.errors import UserError
    from gpt2.run import checkpoint as checkpoints
    from gpt2.run.catch_up import catch_up
    from gpt2.run.names import flatten
    from gpt2.run.tracking import MlflowTracker

    state = checkpoints.load(checkpoint)
    if "history" not in state:
        raise UserError(f"{checkpoint} holds no training history (weights imported, not trained here): "
                        "nothing to send")
    params = state.get("params", {})
    name = f"gpt2-{params.get('model', {}).get('size', '?')}, step {state['step']} (replayed)"
    tracker = MlflowTracker(params.get("train", {}).get("experiment", "gpt2"), state.get("mlflow_run_id"), name,
                            kept_in=checkpoint, run_uid=state["history"].get("run_uid"))
    tracker.log_params(flatten({"model": params.get("model", {}), "train": params.get("train", {})}))  # the new
    catch_up(tracker, state["history"], state.get("metrics"))  # run's, where the store lost it; none logged twice
    tracker.end("FINISHED" if state.get("metrics") is not None else "KILLED")
    if tracker.failed:
        raise UserError(f"the MLflow store {tracker.uri} did not answer: nothing was sent; run this again when it "
                        "does (MLFLOW_TRACKING_URI picks another store)")


if __name__ == "__main__":
    from gpt2.core.entry import run

    run(train)
