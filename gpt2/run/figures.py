"""A run's figures as they are compared and tracked: which go to metrics.json, which MLflow keeps as metrics,
and what MLflow gets of an eval. The train stage logs them as it runs; the evaluate stage and ``gpt2 replay``
send them again from a checkpoint's history (gpt2/run/catch_up.py), so they are written once, here."""

from __future__ import annotations

import math
from typing import Any

from gpt2.run.names import flatten

FEW_TIMED_STEPS = 10  # a speed read from fewer steps past the warm-up is no measurement (a run and a grid say so)
FEW_EVALS = 3  # a run evaluated fewer times cannot tell when it reached a val loss (a comparison's equal-loss figures)

# What metrics.json (DVC metrics: `dvc exp show`, `dvc metrics show`) keeps: the figures people compare.
# Everything else about the run (steps, tokens, world size, what really ran) goes to summary.json.
COMPARED = {"train": ("loss",), "val": ("loss", "loss_se", "ppl", "bpb"),
            "perf": ("step_ms", "step_ms_iqr", "tokens_per_s", "tokens_per_s_iqr", "tokens_per_s_steady",
                     "tokens_per_s_wall", "mfu"),
            "mem": ("peak_gb",), "machine": ("others_busy", "steal"),
            "target": ("reached", "time_s", "tokens", "steps", "train_s"), "cost": ("device_hours", "usd"),
            "wall_s": None, "train_s": None}


# The compared figures MLflow keeps as metrics, under names a runs list can tell apart where it cuts its headers
# (about 14 characters): what the runs list and the compare page show side by side, and the run's logged model
# carries. Every other figure of the summary is a tag (``summary.train.loss``), so a run's charts are its curves,
# not a page of one-point charts.
TRACKED = {"val.loss": "val loss final", "val.loss_se": "val loss se", "val.bpb": "val bpb",
           "perf.tokens_per_s": "tokens/s",
           "perf.tokens_per_s_iqr": "tokens/s IQR", "perf.step_ms": "ms/step", "perf.mfu": "MFU",
           "mem.peak_gb": "peak GB", "target.time_s": "s to target", "target.tokens": "tokens to target",
           "cost.device_hours": "device-hours", "cost.usd": "USD"}


def shown(value: float) -> float:
    """``value`` as MLflow shows it, digits a reader uses (a loss 5.5645, not 5.56445968…; tokens/s 1054.4; a
    learning rate 0.0006; counts whole); the reports and the checkpoint's history keep every digit."""
    if not math.isfinite(value) or float(value).is_integer():
        return value
    return round(value, 1) if abs(value) >= 1000 else round(value, 4) if abs(value) >= 1 else float(f"{value:.4g}")


def tracked_summary(summary: dict[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    """A finished run's figures for MLflow: the compared ones as metrics (the runs list's columns), the rest as
    tags (no one-point charts)."""
    figures = {k: v for k, v in flatten(compared_figures(summary)).items()
               if isinstance(v, int | float) and not isinstance(v, bool)}
    return ({TRACKED[k]: v for k, v in figures.items() if k in TRACKED},
            {f"summary.{k}": v for k, v in figures.items() if k not in TRACKED})


def compared_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """The compared figures, rounded to what is worth reading (4 decimals of loss, 2 of perplexity). A
    finished run's summary written by an older version (its reports rebuilt from the checkpoint) keeps
    the figures it has."""
    figures = {key: summary[key] if keys is None else {k: summary[key][k] for k in keys if k in summary[key]}
               for key, keys in COMPARED.items() if key in summary}  # a summary from an older version lacks some
    return {key: {k: rounded(v, 2 if k == "ppl" else 4) for k, v in value.items()} if isinstance(value, dict) else value
            for key, value in figures.items()}


def rounded(value: Any, digits: int) -> Any:
    return round(value, digits) if isinstance(value, float) else value


def val_metrics(record: dict[str, Any], best: dict[str, Any]) -> dict[str, float]:
    """What MLflow gets of an eval's record (``History.val``), with the best so far beside it (the runs table shows
    each metric's last value), and the training time and tokens at it (a chart's x-axis "metric" draws the val loss
    against either). The evaluator logs it; a resumed run's catch-up replays it."""
    loss = record["val/loss"]
    out = {"val/loss": loss, "val/loss_se": record["val/loss_se"], "val/ppl": math.exp(min(loss, 50)),
           "val/best_loss": best["val/loss"], "val/best_step": best["step"]}
    out.update({f"val/{k}": record[k] for k in ("train_s", "tokens") if record.get(k) is not None})
    out.update({k: record[k] for k in ("val/bpb", "val/holdout_loss", "val/holdout_loss_se") if k in record})
    return out
