"""What a user opens in MLflow's UI: the runs list as a comparison opens it (a shared view of MLflow's own kind,
with the compared figures as its columns) and the addresses of a run's page and of a view."""

from __future__ import annotations


# The runs list as a comparison opens it: a view of MLflow's own "Share" kind, kept as an experiment tag
# (mlflow.sharedViewState.<key>) that the runs page loads from ``?viewStateShareKey=<key>``. Its columns are
# the compared figures with their noise, the verdicts of a grid or a ladder, the data and model of each run, and
# the params that differ among the runs it lists (``view``); the run names say what each experiment changed.
# MLflow's own default shows no metric or param at all.
COMPARE_VIEW_KEY = "gpt2-compare"
FIGURES = ("val/loss", "val/loss_se", "val/bpb", "eval/val_loss", "eval/val_loss_se", "tokens/s", "tokens/s IQR",
           "ms/step",
           "speed vs ref", "speed in noise", "loss vs ref", "loss p vs ref", "speed vs base", "MFU", "peak GB",
           "s to target")
FIRST_PARAMS = ("model.size", "train.max_steps", "train.lr", "train.optimizer", "train.dtype", "train.compile",
                "model.attention", "train.micro_batch_size")  # where they differ, these lead; where none does, shown
MAX_PARAMS = 12  # past this, the figures leave the first screen


def view(params: list[str] | None = None) -> dict:
    """The compare view with ``params`` as its param columns (the params that differ among the runs it lists; none
    given or none differing: ``FIRST_PARAMS``)."""
    columns = [*(f"metrics.`{m}`" for m in FIGURES), "attributes.`Dataset`", "attributes.`Models`",
               *(f"params.`{p}`" for p in (params or FIRST_PARAMS)[:MAX_PARAMS]),
               *(f"tags.`{t}`" for t in ("dvc_exp_name", "git_commit", "host"))]
    return {"selectedColumns": columns, "columnOrder": columns,  # as listed: the loss first, not alphabetical
            "orderByKey": "attributes.start_time", "orderByAsc": False,
            "runsHiddenMode": "SHOW_ALL"}  # every run in the charts, not MLflow's first 10


def differing(runs_params: list[dict[str, str]]) -> list[str]:
    """The params whose values differ among runs (a param a run lacks counts as differing), ``FIRST_PARAMS``
    first, then by name. Only trainings count: a grid's or a ladder's parent run has params of its own kind."""
    runs_params = [params for params in runs_params if "model.size" in params]
    keys = {k for params in runs_params for k in params}
    varied = {k for k in keys if len({params.get(k) for params in runs_params}) > 1}
    return sorted(varied, key=lambda k: (FIRST_PARAMS.index(k) if k in FIRST_PARAMS else len(FIRST_PARAMS), k))



def view_page(experiment_id: str, key: str) -> str:
    """The runs page opened on the shared view ``key``, as a URL fragment."""
    return f"#/experiments/{experiment_id}/runs?viewStateShareKey={key}&workflowType=machine_learning"


def served(uri: str) -> bool:
    """A tracking server, which serves the UI at its own address (a local store needs `mlflow ui`)."""
    return uri.startswith(("http://", "https://"))


def page_url(uri: str, page: str) -> str:
    """A UI page's address: a tracking server serves it at its own address, a local store at `mlflow ui`'s."""
    return f"{uri.rstrip('/') if served(uri) else 'http://127.0.0.1:5000'}/{page}"


# the README's command: one server worker, and no runner for MLflow's GenAI jobs, which these runs never start
UI_COMMAND = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui --backend-store-uri {uri} --workers 1"


def where_to_see(uri: str, experiment_id: str, run_id: str) -> str:
    """How to open a run, and the runs compared: a tracking server serves them at its own address; a local
    store needs `mlflow ui`."""
    import shlex

    page = page_url(uri, f"#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning")
    compared = page_url(uri, view_page(experiment_id, COMPARE_VIEW_KEY))
    if served(uri):
        return f"open {page} (every run compared: {compared})"
    return (f"see it with `{UI_COMMAND.format(uri=shlex.quote(uri))}`, then open {page} "
            f"(every run compared: {compared})")
