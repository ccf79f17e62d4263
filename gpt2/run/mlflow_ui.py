"""What a user opens in MLflow's UI: the runs list as a comparison opens it (a shared view of MLflow's own kind,
with the compared figures as its columns) and the addresses of a run's page and of a view."""

from __future__ import annotations


# The runs list as a comparison opens it: a view of MLflow's own "Share" kind, kept as an experiment tag
# (mlflow.sharedViewState.<key>) that the runs page loads from ``?viewStateShareKey=<key>``. Its columns are
# the compared figures with their noise, the verdicts of a grid or a ladder, and the params people vary;
# the run names say what each experiment changed. MLflow's own default shows no metric or param at all.
COMPARE_VIEW_KEY = "gpt2-compare"
COMPARE_VIEW = {
    "selectedColumns": [
        *(f"metrics.`{m}`" for m in ("val/loss", "val/loss_se", "eval/val_loss", "eval/val_loss_se",
                                     "summary/perf.tokens_per_s", "summary/perf.tokens_per_s_iqr",
                                     "summary/perf.step_ms",
                                     "vs_reference/speedup", "vs_reference/speed_inside_noise",
                                     "vs_reference/val_loss_delta", "vs_reference/val_loss_p",
                                     "vs_reference/speedup_vs_baseline", "summary/perf.mfu", "summary/mem.peak_gb",
                                     "summary/target.time_s")),
        *(f"params.`{p}`" for p in ("model.size", "train.max_steps", "train.lr", "train.optimizer", "train.dtype",
                                    "train.compile", "model.attention", "train.micro_batch_size")),
        *(f"tags.`{t}`" for t in ("dvc_exp_name", "git_commit", "host")),
    ],
    "orderByKey": "attributes.start_time",
    "orderByAsc": False,
    "runsHiddenMode": "SHOW_ALL",  # every run in the charts, not MLflow's first 10
}
COMPARE_VIEW["columnOrder"] = COMPARE_VIEW["selectedColumns"]  # as listed: the loss first, not alphabetical


def view_page(experiment_id: str, key: str) -> str:
    """The runs page opened on the shared view ``key``, as a URL fragment."""
    return f"#/experiments/{experiment_id}/runs?viewStateShareKey={key}&workflowType=machine_learning"


def served(uri: str) -> bool:
    """A tracking server, which serves the UI at its own address (a local store needs `mlflow ui`)."""
    return uri.startswith(("http://", "https://"))


def page_url(uri: str, page: str) -> str:
    """A UI page's address: a tracking server serves it at its own address, a local store at `mlflow ui`'s."""
    return f"{uri.rstrip('/') if served(uri) else 'http://127.0.0.1:5000'}/{page}"


def where_to_see(uri: str, experiment_id: str, run_id: str) -> str:
    """How to open a run, and the runs compared: a tracking server serves them at its own address; a local
    store needs `mlflow ui`."""
    import shlex

    page = page_url(uri, f"#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning")
    compared = page_url(uri, view_page(experiment_id, COMPARE_VIEW_KEY))
    if served(uri):
        return f"open {page} (every run compared: {compared})"
    return (f"see it with `mlflow ui --backend-store-uri {shlex.quote(uri)}`, then open {page} "
            f"(every run compared: {compared})")
