"""A training's figures that its MLflow run lacks, sent from the checkpoint's history.

A store that stops answering for longer than a run (a server down overnight, a locked or moved DB)
leaves the run without the figures the tracker kept for it. The checkpoint holds them all. A resumed
run, the evaluate stage and ``gpt2 replay`` send what the run lacks, step by step, and nothing twice.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gpt2.core import log
from gpt2.run.figures import TRACKED, shown, tracked_summary, val_metrics
from gpt2.run.tracking import MlflowTracker

logger = log.get("train")

BATCH = 1000  # MLflow takes at most 1000 metrics per call


def replay_hint(ckpt_path: str | Path) -> str:
    return (f"`gpt2 replay {ckpt_path}` sends them once the store answers (a resumed run or the evaluate stage "
            "does too)")


def missing(client: Any, run_id: str, history: dict[str, Any], summary: dict[str, Any] | None
            ) -> tuple[list[tuple[dict[str, float], int]], dict[str, Any]]:
    """(metrics by step, tags) that ``history`` and ``summary`` hold and run ``run_id`` does not."""
    have_train = {m.step for m in client.get_metric_history(run_id, "train/loss")}
    have_val = {m.step for m in client.get_metric_history(run_id, "val/loss")}
    present = client.get_run(run_id).data.metrics
    figures = [({k: v for k, v in r.items() if k != "step" and v is not None}, r["step"])
               for r in history.get("train", []) if r["step"] not in have_train]
    best: dict[str, Any] | None = None
    for r in history.get("val", []):  # as the evaluator logged them: with the best so far
        best = r if best is None or r["val/loss"] < best["val/loss"] else best
        if r["step"] not in have_val:
            figures.append((val_metrics(r, best), r["step"]))
    target = history.get("target")
    if target and "target/time_s" not in present:
        figures.append(({f"target/{k}": v for k, v in target.items()}, target.get("steps", 0)))
    tags: dict[str, Any] = {}
    if summary is not None and not any(k in present for k in (*TRACKED.values(), "summary/perf.tokens_per_s")):
        metrics, tags = tracked_summary(summary)
        figures.append((metrics, summary["steps"]))
    return figures, tags


def catch_up(tracker: MlflowTracker, history: dict[str, Any], summary: dict[str, Any] | None = None) -> None:
    """Send what the tracker's run lacks of ``history`` (and of a finished run's ``summary``)."""
    def send() -> None:
        from mlflow.entities import Metric

        client = tracker.mlflow.MlflowClient()
        figures, tags = missing(client, tracker.run_id, history, summary)
        now = int(time.time() * 1000)
        metrics = [Metric(k, shown(float(v)), now, step) for values, step in figures for k, v in values.items()]
        for start in range(0, len(metrics), BATCH):
            client.log_batch(tracker.run_id, metrics=metrics[start:start + BATCH])
        if tags:
            client.log_batch(tracker.run_id, tags=tracker.run_tags(tags))
        if figures:
            logger.info(f"mlflow: sent {len(metrics)} figures of {len(figures)} steps that run {tracker.run_id} "
                        "lacked, from the checkpoint's history")

    tracker.call("send the figures the run lacks", send)
