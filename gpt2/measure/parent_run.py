"""A comparison's MLflow run: one parent run per grid or ladder, lasting from its first run to its report, with
each arm's figures; every experiment's run nested under it with its arm's verdict, and a shared view of the
runs grouped by arm."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from gpt2.core import paths
from gpt2.measure import experiments
from gpt2.measure.apply import Change
from gpt2.measure.compare import Arm, Judged
from gpt2.run.figures import rounded
from gpt2.run.mlflow_ui import differing, view
from gpt2.run.names import json_value
from gpt2.run.tracking import MlflowTracker


def log_parent(kind: str, name: str, judged: Judged, files: list[Path], described: str, experiment: str,
               started: float, params: dict[str, Any], tags: dict[str, str], children: dict[str, dict[str, str]],
               arm_tag: str, run_names: dict[str, str] | None = None, changes: list[Change] = ()) -> None:
    """One MLflow run for the comparison, lasting from its first run to its report: each arm's figures as metrics
    (the arm's index is the step), the dataset, the report; every experiment's run becomes its child, carrying
    its arm's verdict as metrics so the runs list and the compare page show them, and a shared view groups the
    children by ``arm_tag`` (the tag of ``children`` that names each one's arm). It ends FAILED where a run
    failed."""
    tracker = MlflowTracker(experiment, run_name=name, kept_in=str(files[0].parent), started_at=started)
    applies = ", ".join(f"{c.key}={json_value(c.value)}" for c in changes)
    headline = (f"**`--apply` writes {applies}**: {changes[0].why}" if changes else
                f"**Nothing for `--apply` to write**: no {'rung' if kind == 'ladder' else 'setting'} wins outside "
                "noise without losing elsewhere.")
    try:
        tracker.set_tags({"kind": kind, **tags, "apply": applies or "nothing",
                          **({"failed_runs": ", ".join(judged.failed)} if judged.failed else {})})
        tracker.log_params(params)
        names = metric_names([arm.label for arm in judged.arms])
        for i, arm in enumerate(judged.arms):  # each figure named after its arm: no value reads as the whole's
            if arm.done:
                tracker.log_metrics({f"{PARENT_FIGURES[k]}: {names[i]}": v
                                     for k, v in arm_metrics(i, arm).items() if k in PARENT_FIGURES}, step=0)
        if dataset := experiments.workspace_dataset(paths.root()):
            tracker.log_dataset(dataset, context="training")
        for path in files:
            tracker.log_artifact(path)
        tracker.describe(f"{headline}\n\n{described}", files[0].name)  # the page's first lines: what it decided
        verdicts = {run.name: {VERDICT_NAMES[k]: rounded(v, 4) for k, v in arm_metrics(i, arm).items()
                               if k in VERDICT_NAMES}
                    for i, arm in enumerate(judged.arms) for run in arm.runs if run.ok}
        adopt(tracker, list(children), children, verdicts, since=started, run_names=run_names)
        if tracker.run_id:
            tracker.share_view(f"gpt2-{kind}-{tracker.run_id}",
                               comparison_view(tracker.run_id, arm_tag, children_params(tracker)),
                               f"this {kind}'s runs, grouped by {arm_tag.split('.')[1]}")
    except BaseException:
        tracker.end("FAILED")
        raise
    tracker.end("FAILED" if judged.failed else "FINISHED")


# A run's verdict against its reference, as metrics of its MLflow run: names a runs list can tell apart where it
# cuts its headers (about 14 characters)
VERDICT_NAMES = {"speedup": "speed vs ref", "speed_inside_noise": "speed in noise", "val_loss_delta": "loss vs ref",
                 "val_loss_p": "loss p vs ref", "speedup_at_equal_loss": "sooner vs ref",
                 "speedup_vs_baseline": "speed vs base"}
# The parent run's figures, one per arm, named after it ("speed vs base: train.lr 0.03")
PARENT_FIGURES = {**VERDICT_NAMES, "val_loss": "val loss", "tokens_per_s": "tokens/s", "cost_usd": "USD"}


def metric_names(labels: list[str]) -> list[str]:
    """The arms' labels in the characters an MLflow metric name may hold (``train.lr=0.03`` → ``train.lr 0.03``),
    one name each. A slash goes too: MLflow refuses a name with ``//`` or a leading ``/``."""
    names: list[str] = []
    for label in labels:
        name = " ".join(re.sub(r"[^\w.\- :]+", " ", label).split()) or "arm"
        names.append(name if name not in names else f"{name} {len(names)}")
    return names


def arm_metrics(index: int, arm: Arm) -> dict[str, float | None]:
    """An arm's figures as MLflow metrics: its own, and against its reference (1 and 0 for the baseline)."""
    versus = arm.versus
    base = index == 0

    def flag(value: bool | None) -> float | None:
        return None if value is None else float(value)

    return {"tokens_per_s": arm.tokens_per_s.median if arm.tokens_per_s else None,
            "step_ms": arm.step_ms.median if arm.step_ms else None, "peak_mem_gb": arm.peak_mem_gb, "mfu": arm.mfu,
            "val_loss": arm.val_loss.median if arm.val_loss else None,
            "speedup": 1.0 if base else versus.speed.median if versus else None,
            "speed_inside_noise": flag(versus.speed.inside_noise) if versus else None,
            "speedup_vs_baseline": arm.vs_baseline.median,
            "val_loss_delta": 0.0 if base else versus.loss.delta if versus and versus.loss else None,
            "val_loss_p": versus.loss.test.p if versus and versus.loss and versus.loss.test else None,
            "time_to_baseline_loss_s": (arm.at_quality.time_s.median if arm.at_quality and arm.at_quality.time_s
                                        else None),
            "speedup_at_equal_loss": versus.sooner.median if versus else 1.0 if base and arm.at_quality else None,
            "time_to_target_s": arm.target.time_s.median if arm.target and arm.target.time_s else None,
            "cost_usd": arm.cost_usd}


def children_params(parent: MlflowTracker) -> list[dict[str, str]]:
    """The params of the runs nested under ``parent`` (none where the store does not answer)."""
    found: list[dict[str, str]] = []

    def read() -> None:
        found.extend(r.data.params for r in parent.mlflow.MlflowClient().search_runs(
            [parent.experiment_id], f"tags.mlflow.parentRunId = '{parent.run_id}'"))

    parent.call("read its runs' params", read)
    return found


def comparison_view(parent_run_id: str, arm_tag: str, params: list[dict[str, str]] = ()) -> dict[str, Any]:
    """The runs of one grid or ladder (the children of ``parent_run_id``), grouped by their arm (the tag
    ``arm_tag``: its setting or rung): a row per arm with its runs under it, the charts drawing each arm's mean
    over its seeds with their min–max band; its param columns those that differ among the runs' ``params``."""
    return {**view(differing(list(params))), "searchFilter": f"tags.mlflow.parentRunId = '{parent_run_id}'",
            "groupBy": {"aggregateFunction": "average", "groupByKeys": [{"mode": "tag", "groupByData": arm_tag}]},
            "useGroupedValuesInCharts": True}


def adopt(parent: MlflowTracker, names: list[str], tags: dict[str, dict[str, str]] | None = None,
          metrics: dict[str, dict[str, float | None]] | None = None, since: float = 0.0,
          run_names: dict[str, str] | None = None) -> int:
    """Make the MLflow runs of a comparison's runs (their tag ``comparison_run``: a grid or a ladder names each run
    it starts, ``GPT2_COMPARISON_RUN``) children of ``parent``: the UI nests them under it.

    ``tags`` and ``metrics``: more of them per run name (a comparison's verdict on the run). ``since``: the
    comparison's start (epoch seconds; a stopped one's where it went on): an earlier comparison's run of the same
    name is not this one's.
    ``run_names``: each run's MLflow name, to find it by where its training code sets no such tag (an older
    revision's).
    Returns how many runs were found (0 when tracking failed)."""
    found: list[str] = []

    def nest() -> None:
        client = parent.mlflow.tracking.MlflowClient()
        found.clear()
        for name in names:
            after = f"attributes.start_time >= {int(since * 1000)}"
            runs = client.search_runs([parent.experiment_id], f"tags.comparison_run = '{name}' and {after}")
            titled = (run_names or {}).get(name, "")
            if not runs and titled and "'" not in titled:
                runs = client.search_runs([parent.experiment_id], f"attributes.run_name = '{titled}' and {after}")
            if not runs:
                continue
            # a stopped comparison's killed try of a run, made again when it went on: nested too, the verdict is
            # the newest's
            *tries, run = sorted(runs, key=lambda r: r.info.start_time)
            for earlier in tries:
                client.set_tag(earlier.info.run_id, "mlflow.parentRunId", parent.run_id)
            for key, value in {"mlflow.parentRunId": parent.run_id, **(tags or {}).get(name, {})}.items():
                client.set_tag(run.info.run_id, key, value)
            for key, value in (metrics or {}).get(name, {}).items():
                if value is not None:
                    client.log_metric(run.info.run_id, key, value)
            found.append(run.info.run_id)

    if parent.run_id is not None:
        parent.call("nest the experiments' runs under it", nest)
    return 0 if parent.failed else len(found)
