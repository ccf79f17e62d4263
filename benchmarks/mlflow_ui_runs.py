"""Fill an MLflow DB with what a user's first runs leave there, to look at the UI as they will.

Two 40-step `tiny` trainings on data/tokens (one named as a DVC experiment would name it, with
torch.compile; one plain run, named after what it trained), each followed by `evaluate`, into
ROOT/mlflow.db. Then screenshot the UI (docs/benchmarks.md, "MLflow UI check"):

    python benchmarks/mlflow_ui_runs.py /tmp/mlf data/tokens
    ../shared/tools/mlflow-screenshot /tmp/mlf/mlflow.db /tmp/mlf/shots
"""

from __future__ import annotations

import os

import click


@click.command()
@click.argument("root", type=click.Path(file_okay=False))
@click.argument("tokens", type=click.Path(exists=True, file_okay=False))
def main(root: str, tokens: str) -> None:
    """Two trainings and their evaluations on TOKENS, logged to ROOT/mlflow.db."""
    from gpt2.core.config import EvalConfig, Params, build
    from gpt2.eval.evaluate import evaluate
    from gpt2.train.trainer import train

    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{os.path.abspath(root)}/mlflow.db"
    for name, switches in (("compile-on", {"compile": True}), (None, {})):
        if name:
            os.environ["DVC_EXP_NAME"] = name
        else:
            os.environ.pop("DVC_EXP_NAME", None)
        params = build(Params, {"train": {"max_steps": 40, "eval_interval": 10, "log_interval": 2, **switches}}, "")
        out = os.path.join(root, name or "plain")
        train(params, tokens, f"{out}/ckpt.pt", f"{out}/reports")
        evaluate(build(EvalConfig, {"num_samples": 1, "max_new_tokens": 20}, "eval"), f"{out}/ckpt.pt", tokens,
                 f"{out}/eval")


if __name__ == "__main__":
    main()
