"""`gpt2 grid`: a queued grid of DVC experiments, run one at a time, read as one table and one MLflow parent run.

DVC expands ``-S key=a,b`` into one experiment per combination (``dvc exp run --queue``); this
runs them with a progress line per experiment, then writes the table of what each combination
gave, every figure with its noise, and groups the experiments' MLflow runs under one parent
run that holds the table. The experiments stay ordinary DVC experiments (``dvc exp show``,
``dvc exp apply``).
"""

from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

from gpt2.core import log
from gpt2.core.atomic import atomic_file, write_json
from gpt2.core.config import read_yaml
from gpt2.core.errors import UserError
from gpt2.core.progress import clock
from gpt2.measure import experiments

logger = log.get("grid")

_QUEUED = re.compile(r"Queued experiment '([^']+)'")
TRAIN, EVAL = "reports/train/metrics.json", "reports/eval/metrics.json"
COLUMNS = [  # (header, metrics file, section, figure, its noise)
    ("val loss", TRAIN, "val", "loss", "loss_se"),
    ("eval val loss", EVAL, "eval", "val_loss", "val_loss_se"),
    ("tokens/s", TRAIN, "perf", "tokens_per_s", "tokens_per_s_iqr"),
    ("ms/step", TRAIN, "perf", "step_ms", "step_ms_iqr"),
    ("peak mem (GB)", TRAIN, "mem", "peak_gb", None),
]


def parse_sets(sets: tuple[str, ...]) -> dict[str, list[Any]]:
    """``-S train.lr=1.0e-3,2.0e-3`` → ``{"train.lr": [0.001, 0.002]}``, checked as DVC would expand them."""
    import yaml

    grid: dict[str, list[Any]] = {}
    for item in sets:
        key, sep, values = item.partition("=")
        if not sep or "." not in key or not values:
            raise UserError(f"-S {item!r}: write section.key=value[,value...], e.g. -S train.lr=1.0e-3,2.0e-3")
        grid[key.strip()] = [yaml.safe_load(v) for v in values.split(",")]
    return grid


def run_grid(sets: tuple[str, ...], name: str | None = None, target: str = "evaluate", out: str | Path = "reports/grid",
             mlflow: bool | None = None, params_path: str | Path = "params.yaml") -> list[dict[str, Any]]:
    """Queue every combination, run them, write ``<out>/<name>.md`` and ``.json``, group them in MLflow."""
    root = Path.cwd()
    grid = parse_sets(sets)
    if not grid:
        raise UserError("gpt2 grid needs at least one -S section.key=value[,value...]")
    experiments.check_repo(root)
    if waiting := experiments.pending(root):
        raise UserError(f"{len(waiting)} DVC experiment(s) already queued or running ({', '.join(waiting[:5])}); "
                        "a grid times one experiment at a time: run them (dvc exp run --run-all) or remove them "
                        "(dvc queue remove --queued) first")
    name = name or "grid " + time.strftime("%m-%d %H:%M")
    args = [arg for item in sets for arg in ("-S", item)]
    said = experiments.dvc(root, "exp", "run", "--queue", *args, target)
    queued = _QUEUED.findall(said.stdout + said.stderr)
    logger.info(f"grid {name!r}: {len(queued)} experiments queued ({', '.join(grid)}), running them one at a time")
    out = Path(out)
    _run(root, queued, out)
    found = {e.name: e for e in experiments.finished(root) if e.name in queued}
    rows = [row(n, found.get(n), grid) for n in queued]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")
    write_json(out / f"{slug}.json", {"name": name, "grid": grid, "rows": rows})
    text = table(name, grid, rows)
    with atomic_file(out / f"{slug}.md") as tmp:
        tmp.write_text(text)
    logger.info(f"grid: {out / (slug + '.md')}\n{text}")
    raw = read_yaml(params_path, "params", "--params") or {}
    if (raw.get("train") or {}).get("mlflow", True) if mlflow is None else mlflow:
        log_parent(name, grid, rows, out / f"{slug}.md", (raw.get("train") or {}).get("experiment", "gpt2"))
    failed = [r["experiment"] for r in rows if not r["finished"]]
    if failed:
        raise UserError(f"grid: {', '.join(failed)} did not finish; see {out}/dvc.log and `dvc queue logs NAME`")
    return rows


def _run(root: Path, queued: list[str], out: Path) -> None:
    started: list[float] = []

    def on_start(exp: str) -> None:
        started.append(time.perf_counter())
        eta = ""
        if len(started) > 1:
            each = statistics.median(b - a for a, b in zip(started, started[1:]))
            eta = f", ETA {clock(each * (len(queued) - len(started) + 1))}"
        logger.info(f"grid: [{len(started)}/{len(queued)}] {exp}{eta}")

    code = experiments.run_queue_or_cancel(root, on_start, out / "dvc.log", "grid")
    if code != 0:
        logger.info(f"grid: dvc exp run --run-all exited {code}; see {out}/dvc.log")


def row(name: str, exp: experiments.Experiment | None, grid: dict[str, list[Any]]) -> dict[str, Any]:
    """One experiment's swept values and compared figures (None where it failed)."""
    if exp is None:
        return {"experiment": name, "finished": False, "set": {}, "figures": {}}
    setting = {key: _get(exp.params, key) for key in grid}
    figures = {header: (_get(exp.metrics.get(path, {}), f"{section}.{figure}"),
                        _get(exp.metrics.get(path, {}), f"{section}.{noise}") if noise else None)
               for header, path, section, figure, noise in COLUMNS}
    return {"experiment": name, "finished": True, "rev": exp.rev, "set": setting, "figures": figures}


def _get(tree: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def table(name: str, grid: dict[str, list[Any]], rows: list[dict[str, Any]]) -> str:
    shown = [c for c in COLUMNS if any(r["figures"].get(c[0], (None,))[0] is not None for r in rows)]
    lines = [f"# {name}", "", f"| experiment | {' | '.join(grid)} | {' | '.join(c[0] for c in shown)} |",
             "|---" * (1 + len(grid) + len(shown)) + "|"]
    for r in rows:
        if not r["finished"]:
            lines.append(f"| {r['experiment']} | " + " | ".join(["failed"] * (len(grid) + len(shown))) + " |")
            continue
        cells = [json.dumps(r["set"][k]) if not isinstance(r["set"][k], str) else r["set"][k] for k in grid]
        for header, *_ in shown:
            value, noise = r["figures"][header]
            cells.append("" if value is None else f"{value:,.4g}" + (f" ± {noise:.2g}" if noise else ""))
        lines.append(f"| {r['experiment']} | {' | '.join(cells)} |")
    lines += ["", "Val losses: mean ± standard error over the scored windows; speeds: median ± interquartile range "
                  "over the timed steps. Two losses differ beyond noise when they are more than 2 × √(se₁² + se₂²) "
                  "apart (README, \"Compare optimizations\")."]
    return "\n".join(lines) + "\n"


def log_parent(name: str, grid: dict[str, list[Any]], rows: list[dict[str, Any]], report: Path,
               experiment: str) -> None:
    """One MLflow run for the grid, holding its table; each experiment's training run becomes its child."""
    from gpt2.run.tracking import MlflowTracker, adopt

    with MlflowTracker(experiment, run_name=name, kept_in=str(report.parent)) as tracker:
        tracker.set_tags({"kind": "grid"})
        tracker.log_params({f"grid.{k}": ",".join(map(str, v)) for k, v in grid.items()})
        losses = [r["figures"]["val loss"][0] for r in rows if r["finished"] and r["figures"]["val loss"][0]]
        if losses:
            tracker.log_metrics({"grid/best_val_loss": min(losses), "grid/experiments": len(rows)}, step=0)
        tracker.log_artifact(report)
        tracker.log_artifact(report.with_suffix(".json"))
        adopt(tracker, [r["experiment"] for r in rows if r["finished"]])
