"""`gpt2 grid`: every combination of a few settings as DVC experiments, judged against the first with its noise.

``-S key=a,b`` gives one setting per combination of the values, in the order DVC would expand
them; the first combination is the baseline every other is compared with. Each setting runs
``repeats`` times, one experiment at a time (``dvc exp run --temp``), in alternating order (all
settings forward, then backward), so each run has a neighbour in time of the baseline to be
paired with and drift of the machine cancels (gpt2/measure/compare.py judges it as the ladder's
rungs are judged). The report says, per setting, its tokens/s ratio to the baseline and its val
loss difference, each marked when inside noise, under a verdict on the noise itself. The
experiments stay ordinary DVC experiments (``dvc exp show``, ``dvc exp apply``); in MLflow the
grid is a parent run holding the comparison, each experiment's run a child carrying its verdict.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpt2.core import log
from gpt2.core.atomic import write_files
from gpt2.core.config import read_yaml
from gpt2.core.errors import UserError
from gpt2.measure import experiments
from gpt2.measure.compare import (Spread, as_metric, loss_shown, losses_apart, noise_verdict, paired_ratios,
                                  ratio_inside_noise, ratio_shown, typical_disagreement)
from gpt2.run.tracking import json_value

logger = log.get("grid")

TRAIN, EVAL = "reports/train/metrics.json", "reports/eval/metrics.json"


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


def settings(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination, the last key varying fastest (DVC's order); the first is the baseline."""
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def schedule(count: int, repeats: int) -> list[tuple[int, int]]:
    """(setting, repeat) in the order they run: every setting forward, then backward, and so on."""
    return [(i, r) for r in range(repeats) for i in (range(count) if r % 2 == 0 else reversed(range(count)))]


@dataclass
class Row:
    """One setting: its runs' figures, and how it compares with the baseline (the first setting)."""

    setting: dict[str, Any]
    experiments: list[str]  # by repeat; a run that failed is missing from ``runs``
    runs: int = 0
    val_loss: float | None = None  # the median run's val loss, with its standard error over the windows
    val_loss_se: float | None = None
    eval_val_loss: float | None = None  # evaluate's, when the experiments ran it
    eval_val_loss_se: float | None = None
    tokens_per_s: Spread | None = None
    step_ms: Spread | None = None
    peak_mem_gb: float | None = None
    tokens_per_s_runs: list[float | None] = field(default_factory=list)  # by repeat: None where a run failed
    paired: list[float] = field(default_factory=list)  # tokens/s over the baseline's of the same repeat
    speedup: float | None = None  # the median paired ratio
    speed_inside_noise: bool | None = None
    loss_delta: float | None = None  # val loss minus the baseline's (evaluate's where every setting has it)
    loss_apart: bool | None = None  # beyond 2 × the standard error of the difference


def run_grid(sets: tuple[str, ...], name: str | None = None, target: str = "evaluate", out: str | Path = "reports/grid",
             mlflow: bool | None = None, params_path: str | Path = "params.yaml", repeats: int = 1) -> list[Row]:
    """Run every setting ``repeats`` times as DVC experiments, write ``<out>/<name>.md``, ``.json`` and ``.png``,
    and group the experiments under one MLflow run that holds the comparison."""
    root, started = Path.cwd(), time.time()
    grid = parse_sets(sets)
    if not grid:
        raise UserError("gpt2 grid needs at least one -S section.key=value[,value...]")
    experiments.check_repo(root)
    if waiting := experiments.pending(root):
        raise UserError(f"{len(waiting)} DVC experiment(s) already queued or running ({', '.join(waiting[:5])}); "
                        "a grid times one experiment at a time: run them (dvc exp run --run-all) or remove them "
                        "(dvc queue remove --queued) first")
    name = name or "grid " + time.strftime("%m-%d %H:%M")
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "grid"
    combos = settings(grid)
    order = schedule(len(combos), repeats)
    taken = {e.name for e in experiments.finished(root)}
    names = [[_free(f"{slug}-{i + 1}-{r + 1}", taken) for r in range(repeats)] for i in range(len(combos))]
    logger.info(f"grid {name!r}: {len(combos)} settings × {repeats} run(s) ({', '.join(grid)}), one at a time; "
                f"the first, {describe(combos[0])}, is the baseline")
    out = Path(out)
    experiments.run_in_turn(root, [experiments.Planned(
        names[i][r], combos[i], f"{describe(combos[i])}, run {r + 1}",
        f"{name} · {describe(combos[i])}" + (f" · run {r + 1}" if repeats > 1 else "")) for i, r in order],
        target, out / "dvc.log", "grid")
    found = {e.name: e for e in experiments.finished(root)}
    rows = judge(combos, names, found)
    report = write_report(out, slug, name, grid, rows, repeats, target)
    raw = read_yaml(params_path, "params", "--params") or {}
    if (raw.get("train") or {}).get("mlflow", True) if mlflow is None else mlflow:
        log_parent(name, grid, rows, out, slug, (raw.get("train") or {}).get("experiment", "gpt2"), started)
    logger.info(f"grid: {out / (slug + '.md')}\n{report}")
    failed = [n for row in rows for n in row.experiments if n not in found]
    if failed:
        raise UserError(f"grid: {', '.join(failed)} did not finish; see {out}/dvc.log")
    return rows


def describe(setting: dict[str, Any]) -> str:
    """``train.lr=0.002 · model.attention=manual``: a setting as people read it."""
    return " · ".join(f"{key}={json_value(value)}" for key, value in setting.items())


def _free(name: str, taken: set[str]) -> str:
    """``name``, or ``name-2``, ``name-3`` … where an earlier grid of the same name took it."""
    candidate, n = name, 1
    while candidate in taken:
        n += 1
        candidate = f"{name}-{n}"
    taken.add(candidate)
    return candidate


def judge(combos: list[dict[str, Any]], names: list[list[str]],
          found: dict[str, experiments.Experiment]) -> list[Row]:
    """Each setting's figures, and its comparison with the baseline, run paired with run of the same repeat."""
    rows = []
    for setting, exps in zip(combos, names):
        row = Row(setting=setting, experiments=exps)
        metrics = [found[n].metrics.get(TRAIN) or {} if n in found else None for n in exps]
        done = [m for m in metrics if m and (m.get("perf") or {}).get("tokens_per_s")]
        row.runs = len(done)
        row.tokens_per_s_runs = [(m.get("perf") or {}).get("tokens_per_s") if m else None for m in metrics]
        if done:
            row.tokens_per_s = Spread.of([m["perf"]["tokens_per_s"] for m in done])
            row.step_ms = Spread.of([m["perf"]["step_ms"] for m in done])
            row.peak_mem_gb = max((m.get("mem") or {}).get("peak_gb") or 0.0 for m in done)
            median = sorted(done, key=lambda m: (m.get("val") or {}).get("loss") or 0.0)[len(done) // 2]
            row.val_loss, row.val_loss_se = (median.get("val") or {}).get("loss"), (median.get("val") or {}).get("loss_se")
            scored = [(found[n].metrics.get(EVAL) or {}).get("eval") or {} for n in exps if n in found]
            scored = sorted((s for s in scored if s.get("val_loss") is not None), key=lambda s: s["val_loss"])
            if scored:
                row.eval_val_loss = scored[len(scored) // 2]["val_loss"]
                row.eval_val_loss_se = scored[len(scored) // 2].get("val_loss_se")
        rows.append(row)
    base, by_eval = rows[0], evaluated(rows)
    for row in rows[1:]:
        pairs = [(a, b) for a, b in zip(row.tokens_per_s_runs, base.tokens_per_s_runs) if a and b]
        row.paired = paired_ratios([a for a, _ in pairs], [b for _, b in pairs])
        row.speedup = statistics.median(row.paired) if row.paired else None
        mine, theirs = quality(row, by_eval), quality(base, by_eval)
        if mine[0] is not None and theirs[0] is not None:
            row.loss_delta = mine[0] - theirs[0]
            row.loss_apart = losses_apart(*mine, *theirs)
    floor = typical_disagreement([row.paired for row in rows[1:]])
    for row in rows[1:]:
        if row.speedup is not None:
            row.speed_inside_noise = ratio_inside_noise(row.paired, floor)
    return rows


def evaluated(rows: list[Row]) -> bool:
    """Whether every setting that ran has evaluate's val loss: then the settings are judged by it (more
    windows), else all by training's, never one against the other."""
    return all(r.eval_val_loss is not None for r in rows if r.runs)


def quality(row: Row, by_eval: bool) -> tuple[float | None, float | None]:
    """The val loss a setting is judged by, with its standard error over the scored windows."""
    return (row.eval_val_loss, row.eval_val_loss_se) if by_eval else (row.val_loss, row.val_loss_se)


def verdict(rows: list[Row], repeats: int) -> str:
    """The noise verdict, then what the grid decides: which settings are faster or better outside noise."""
    compared = [r for r in rows[1:] if r.speedup is not None]
    spread = typical_disagreement([r.paired for r in compared])
    noisy = [r for r in compared if r.speed_inside_noise]
    text = noise_verdict(spread, spread, len(noisy), len(compared), repeats, "setting", "the baseline's")
    faster = [r for r in compared if not r.speed_inside_noise and r.speedup > 1]
    slower = [r for r in compared if not r.speed_inside_noise and r.speedup < 1]
    better = [r for r in rows[1:] if r.loss_apart and r.loss_delta < 0]
    worse = [r for r in rows[1:] if r.loss_apart and r.loss_delta > 0]
    parts = [f"{label}: " + "; ".join(f"{describe(r.setting)} ({how(r)})" for r in group)
             for label, group, how in (("Faster outside noise", faster, lambda r: f"{r.speedup:.2f}×"),
                                       ("Slower outside noise", slower, lambda r: f"{r.speedup:.2f}×"),
                                       ("Lower val loss outside noise", better, lambda r: f"{r.loss_delta:+.3f}"),
                                       ("Higher val loss outside noise", worse, lambda r: f"{r.loss_delta:+.3f}"))
             if group]
    decided = ". ".join(parts) if parts else "No setting differs from the baseline outside noise, in speed or val loss"
    return f"{text}\n\n{decided}."


def table(grid: dict[str, list[Any]], rows: list[Row], repeats: int) -> str:
    evaluated = any(r.eval_val_loss is not None for r in rows)
    head = [*grid, "runs", "val loss (± s.e.)", *(["eval val loss (± s.e.)"] if evaluated else []),
            "loss vs baseline", "tokens/s median (min–max)", "speed vs baseline", "ms/step median (min–max)",
            "peak mem (GB)", "experiments"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, row in enumerate(rows):
        cells = [json_value(row.setting[k]) for k in grid] + [f"{row.runs}/{repeats}"]
        if not row.runs:
            cells += ["failed"] + [""] * (len(head) - len(cells) - 2) + [", ".join(row.experiments)]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        loss = ("baseline" if i == 0 else "" if row.loss_delta is None else f"{row.loss_delta:+.3f}"
                + (" (inside noise)" if not row.loss_apart else ""))
        speed = "baseline" if i == 0 else ratio_shown(row.speedup, bool(row.speed_inside_noise))
        cells += [loss_shown(row.val_loss, row.val_loss_se),
                  *([loss_shown(row.eval_val_loss, row.eval_val_loss_se)] if evaluated else []),
                  loss, row.tokens_per_s.shown(",.0f"), speed, row.step_ms.shown(".1f"),
                  f"{row.peak_mem_gb:.2f}", ", ".join(row.experiments)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(out: Path, slug: str, name: str, grid: dict[str, list[Any]], rows: list[Row], repeats: int,
                 target: str) -> str:
    """``<slug>.md`` (verdict and table), ``<slug>.json`` and ``<slug>.png``, written as one; returns the markdown."""
    text = (f"# {name}\n\n{verdict(rows, repeats)}\n\n"
            f"{len(rows)} settings × {repeats} run(s), one at a time, in alternating order, each the `{target}` stage "
            "as a DVC experiment; the first setting is the baseline. A speed ratio is the median of each run's "
            "tokens/s over the baseline's run of the same repeat. Val losses: the median run's, ± its standard error "
            "over the scored windows; two differ outside noise when more than 2 × √(se₁² + se₂²) apart (evaluate's "
            "where every setting has it; README, \"Compare optimizations\"). Speeds: median (min–max) over the runs.\n\n" + table(grid, rows, repeats))
    data = {"name": name, "grid": grid, "repeats": repeats, "target": target,
            "rows": [dataclasses.asdict(r) for r in rows]}
    write_files(out, {f"{slug}.md": text, f"{slug}.json": json.dumps(data, indent=2) + "\n",
                      f"{slug}.png": render_png(rows, name, verdict(rows, repeats))})
    return text


def render_png(rows: list[Row], title: str, said: str) -> bytes:
    """Speed ratio and val loss per setting, with their intervals; gray where inside noise, a note where failed."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown, by_eval = rows[::-1], evaluated(rows)
    labels = [textwrap.shorten(describe(r.setting), 48) for r in shown]
    head = textwrap.fill(said.replace("**", "").replace("\n\n", " "), 140)
    fig, (speed, loss) = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 2.0 + 0.17 * (head.count("\n") + 1)),
                                      dpi=100, sharey=True)
    for y, row in enumerate(shown):
        if not row.runs:
            speed.annotate("FAILED: see dvc.log", (0, y), xytext=(3, 0), textcoords="offset points", va="center",
                           color="tab:red", fontsize=8, style="italic")
            continue
        ratio = 1.0 if row is rows[0] else row.speedup
        if ratio is None:
            continue
        low, high = (min(row.paired), max(row.paired)) if row.paired else (ratio, ratio)
        gray = row is rows[0] or row.speed_inside_noise
        speed.barh(y, ratio, color="tab:gray" if gray else "tab:blue", xerr=[[ratio - low], [high - ratio]],
                   capsize=3)
        note = "baseline" if row is rows[0] else f"{ratio:.2f}×" + (" (inside noise)" if gray else "")
        speed.annotate(note, (high, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
        value, error = quality(row, by_eval)
        if value is not None:
            apart = row is not rows[0] and row.loss_apart
            loss.errorbar(value, y, xerr=2 * error if error else None, fmt="o", capsize=3,
                          color="tab:blue" if apart else "tab:gray")
    speed.axvline(1.0, color="black", linewidth=0.8)
    speed.set_yticks(range(len(shown)), labels)
    speed.set_ylim(-0.6, len(shown) - 0.4)
    speed.set_xlim(0, 1.3 * max([max(r.paired) for r in rows if r.paired] + [1.0]))
    speed.set(xlabel="tokens/s vs the baseline (median of paired runs, min–max)", title="Speed")
    loss.set(xlabel=f"{'evaluate' if by_eval else 'training'}'s val loss (± 2 standard errors; blue: apart from the "
                    "baseline)", title="Quality")
    fig.suptitle(f"{title}\n{head}", fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def log_parent(name: str, grid: dict[str, list[Any]], rows: list[Row], out: Path, slug: str, experiment: str,
               started: float) -> None:
    """One MLflow run for the grid, lasting from its first run to its report: the comparison as metrics (the
    setting's index is the step), the dataset, the report; each experiment's run becomes its child, carrying
    its setting's ratio and verdict as metrics so the runs list and the compare page show them."""
    from gpt2.run.tracking import MlflowTracker, adopt

    with MlflowTracker(experiment, run_name=name, kept_in=str(out), started_at=started) as tracker:
        tracker.set_tags({"kind": "grid", "grid.baseline": describe(rows[0].setting)})
        tracker.log_params({f"grid.{k}": ",".join(map(str, v)) for k, v in grid.items()})
        for i, row in enumerate(rows):
            tracker.log_metrics({"grid/tokens_per_s": round(row.tokens_per_s.median, 1) if row.tokens_per_s else None,
                                 "grid/speedup": 1.0 if i == 0 and row.runs else _round(row.speedup),
                                 "grid/speed_inside_noise": as_metric(row.speed_inside_noise),
                                 "grid/val_loss": _round(row.val_loss), "grid/val_loss_delta": _round(row.loss_delta),
                                 "grid/loss_apart": as_metric(row.loss_apart)}, step=i)
        if dataset := experiments.workspace_dataset(Path.cwd()):
            tracker.log_dataset(dataset, context="training")
        for suffix in (".md", ".json", ".png"):
            tracker.log_artifact(out / f"{slug}{suffix}")
        tracker.describe((out / f"{slug}.md").read_text())
        children = {n: {"grid.setting": describe(row.setting), "grid.run": str(r + 1)}
                    for row in rows for r, n in enumerate(row.experiments)}
        verdicts = {n: {"vs_baseline/speedup": 1.0 if i == 0 else _round(row.speedup),
                        "vs_baseline/speed_inside_noise": as_metric(row.speed_inside_noise),
                        "vs_baseline/val_loss_delta": 0.0 if i == 0 else _round(row.loss_delta)}
                    for i, row in enumerate(rows) for n in row.experiments}
        adopt(tracker, list(children), children, verdicts)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


