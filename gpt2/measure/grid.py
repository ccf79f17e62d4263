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
import itertools
import json
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpt2.core import log, paths
from gpt2.core.atomic import write_files
from gpt2.core.plots import png, pyplot
from gpt2.core.config import read_yaml
from gpt2.core.errors import UserError
from gpt2.measure import experiments
from gpt2.measure.apply import Change
from gpt2.measure.compare import (AtQuality, Curve, Spread, as_metric, at_baseline_quality, loss_shown, losses_apart,
                                  noise_verdict, paired_ratios, quality_shown, ratio_inside_noise, ratio_shown,
                                  median_known, typical_disagreement, usd_shown, win)
from gpt2.run.tracking import json_value

logger = log.get("grid")



def parse_sets(sets: tuple[str, ...]) -> dict[str, list[Any]]:
    """``-S train.lr=1.0e-3,2.0e-3`` → ``{"train.lr": [0.001, 0.002]}``, checked as DVC would expand them."""
    grid: dict[str, list[Any]] = {}
    for item in sets:
        key, sep, values = item.partition("=")
        if not sep or "." not in key or not values:
            raise UserError(f"-S {item!r}: write section.key=value[,value...], e.g. -S train.lr=1.0e-3,2.0e-3")
        grid[key.strip()] = [dvc_value(v) for v in values.split(",")]
    return grid


def dvc_value(text: str) -> Any:
    """A ``-S`` value as DVC reads it (YAML 1.2): only true and false are booleans, so ``train.fp8=off`` stays
    the word it is in params.yaml's docs, in the grid's labels and in the experiment's params."""
    import yaml

    value = yaml.safe_load(text)
    if isinstance(value, bool) and text.strip().lower() not in ("true", "false"):
        return text.strip()
    return value


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
    quality: AtQuality | None = None  # time and tokens to the val loss the baseline ends with
    cost_usd: float | None = None  # a run's cost, median over the runs (None without a price)
    device_hours: float | None = None  # a run's device-hours, median over the runs


MAX_NAME = 100  # a grid's name, in bytes: its report files and experiment names add a suffix to it


def run_grid(sets: tuple[str, ...], name: str | None = None, target: str = "evaluate",
             out: str | Path = paths.GRID_REPORTS,
             mlflow: bool | None = None, params_path: str | Path = paths.PARAMS, repeats: int = 1,
             time_budget_s: float | None = None, apply: bool = False, as_json: bool = False) -> dict[str, Any]:
    """Run every setting ``repeats`` times as DVC experiments, write ``<out>/<name>.md``, ``.json`` and ``.png``,
    and group the experiments under one MLflow run that holds the comparison. ``time_budget_s``: every run
    trains for that long (train.time_budget_s), so the settings compare at equal time. ``apply``: write the
    winner into params.yaml. Returns the comparison as the report's JSON holds it; ``as_json`` prints it on stdout
    (also when a run failed, before the error)."""
    root, started = paths.root(), time.time()
    if name is not None and len(name.encode()) > MAX_NAME:  # before an hour of runs, not at the report after them
        raise UserError(f"gpt2 grid --name is {len(name.encode())} bytes long; the report's files and the experiments "
                        f"are named after it, and a file name holds at most 255: give one of at most {MAX_NAME}")
    grid = parse_sets(sets)
    if not grid:
        raise UserError("gpt2 grid needs at least one -S section.key=value[,value...]")
    if apply:  # before an hour of runs, not after
        from gpt2.measure.apply import refuse_uncommitted

        refuse_uncommitted(Path(params_path))
    fixed = ({"train.time_budget_s": time_budget_s, "train.max_steps": None, "train.max_tokens": None}
             if time_budget_s else {})
    if clash := [k for k in grid if k in fixed]:
        raise UserError(f"-S {clash[0]} and --time-budget both set the run's length; give one")
    experiments.check_repo(root)
    if changed := experiments.uncommitted_params(root, params_path):
        logger.warning(f"grid: {params_path} differs from the last commit ({changed}), and every experiment starts "
                       "from it, as dvc exp run does; to compare from the committed params: git checkout "
                       f"{params_path} (an earlier dvc exp run -S leaves its setting there)")
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
        names[i][r], {**combos[i], **fixed}, f"{describe(combos[i])}, run {r + 1}",
        f"{name} · {describe(combos[i])}" + (f" · run {r + 1}" if repeats > 1 else "")) for i, r in order],
        target, out / "dvc.log", "grid")
    found = {e.name: e for e in experiments.finished(root, (paths.TRAIN_SUMMARY,))}
    mine = {n for exps in names for n in exps}
    curves = {n: experiments.val_curve(root, e.rev) for n, e in found.items() if n in mine}
    rows = judge(combos, names, found, curves)
    changes = decide(rows, time_budget_s, out / f"{slug}.md")
    report, data = write_report(out, slug, name, grid, rows, repeats, target, time_budget_s, changes)
    raw = read_yaml(params_path, "params", "--params") or {}
    if (raw.get("train") or {}).get("mlflow", True) if mlflow is None else mlflow:
        log_parent(name, grid, rows, out, slug, (raw.get("train") or {}).get("experiment", "gpt2"), started)
    logger.info(f"grid: {out / (slug + '.md')}\n{report}")
    if as_json:
        print(json.dumps(data, indent=2), flush=True)
    failed = data["failed"]
    if failed:
        raise UserError(f"grid: {', '.join(failed)} did not finish; see {out}/dvc.log"
                        + ("; nothing applied" if apply else ""))
    if apply:
        from gpt2.measure.apply import apply as write

        logger.info(f"grid: {write(changes, params_path)}")
    return data


def decide(rows: list[Row], time_budget_s: float | None, report: Path | str) -> list[Change]:
    """The settings to apply: those of the best setting that wins against the baseline outside noise and loses
    nowhere outside it (gpt2/measure/compare.py's ``win``). Nothing wins from one run: a val loss's standard
    error covers the scored text, not how many steps a run fitted into its time or how its seed fell, which
    only repeats show."""
    if rows[0].runs < 2:
        return []
    scored = [(won, row) for row in rows[1:] if row.runs >= 2 and (won := win(
        row.speedup, row.speed_inside_noise, row.quality.speedup if row.quality else None,
        row.quality.inside_noise if row.quality else None, row.loss_delta, row.loss_apart, bool(time_budget_s)))]
    if not scored:
        return []
    (_, why), best = max(scored, key=lambda pair: pair[0][0])
    when = f" (runs of {time_budget_s:g} s)" if time_budget_s else ""
    return [Change(key, value, f"{why}{when} ({report})") for key, value in best.setting.items()]


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


def judge(combos: list[dict[str, Any]], names: list[list[str]], found: dict[str, experiments.Experiment],
          curves: dict[str, Curve | None] | None = None) -> list[Row]:
    """Each setting's figures, and its comparison with the baseline, run paired with run of the same repeat;
    with the runs' val ``curves`` (by experiment name), also at the baseline's final val loss."""
    rows = []
    for setting, exps in zip(combos, names):
        row = Row(setting=setting, experiments=exps)
        metrics = [found[n].metrics.get(paths.TRAIN_METRICS) or {} if n in found else None for n in exps]
        done = [m for m in metrics if m and (m.get("perf") or {}).get("tokens_per_s")]
        row.runs = len(done)
        row.tokens_per_s_runs = [(m.get("perf") or {}).get("tokens_per_s") if m else None for m in metrics]
        if done:
            row.tokens_per_s = Spread.of([m["perf"]["tokens_per_s"] for m in done])
            row.step_ms = Spread.of([m["perf"]["step_ms"] for m in done])
            row.peak_mem_gb = max((m.get("mem") or {}).get("peak_gb") or 0.0 for m in done)
            row.cost_usd = median_known([(m.get("cost") or {}).get("usd") for m in done])
            row.device_hours = median_known([(m.get("cost") or {}).get("device_hours") for m in done])
            median = sorted(done, key=lambda m: (m.get("val") or {}).get("loss") or 0.0)[len(done) // 2]
            val = median.get("val") or {}
            row.val_loss, row.val_loss_se = val.get("loss"), val.get("loss_se")
            scored = [(found[n].metrics.get(paths.EVAL_METRICS) or {}).get("eval") or {} for n in exps if n in found]
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
    if curves is not None:
        runs = [[curves.get(n) if n in found else None for n in exps] for exps in names]
        prices = [[experiments.hourly_price(found.get(n), paths.TRAIN_SUMMARY) for n in exps] for exps in names]
        for row, figures in zip(rows, at_baseline_quality(runs, prices)):
            row.quality = figures
    return rows


def evaluated(rows: list[Row]) -> bool:
    """Whether every setting that ran has evaluate's val loss: then the settings are judged by it (more
    windows), else all by training's, never one against the other."""
    return all(r.eval_val_loss is not None for r in rows if r.runs)


def quality(row: Row, by_eval: bool) -> tuple[float | None, float | None]:
    """The val loss a setting is judged by, with its standard error over the scored windows."""
    return (row.eval_val_loss, row.eval_val_loss_se) if by_eval else (row.val_loss, row.val_loss_se)


def verdict(rows: list[Row], repeats: int, time_budget_s: float | None = None,
            changes: list[Change] | None = None) -> str:
    """The noise verdict, then what the grid decides: which settings are faster, sooner to the baseline's val loss
    or better outside noise, and what ``--apply`` writes."""
    compared = [r for r in rows[1:] if r.speedup is not None]
    spread = typical_disagreement([r.paired for r in compared])
    noisy = [r for r in compared if r.speed_inside_noise]
    text = noise_verdict(spread, spread, len(noisy), len(compared), repeats, "setting", "the baseline's")
    faster = [r for r in compared if not r.speed_inside_noise and r.speedup > 1]
    slower = [r for r in compared if not r.speed_inside_noise and r.speedup < 1]
    timed = [r for r in rows[1:] if r.quality and r.quality.speedup is not None and not r.quality.inside_noise]
    sooner, later = [r for r in timed if r.quality.speedup > 1], [r for r in timed if r.quality.speedup < 1]
    better = [r for r in rows[1:] if r.loss_apart and r.loss_delta < 0]
    worse = [r for r in rows[1:] if r.loss_apart and r.loss_delta > 0]
    when = f" at equal time ({time_budget_s:g} s)" if time_budget_s else ""
    parts = [f"{label}: " + "; ".join(f"{describe(r.setting)} ({how(r)})" for r in group)
             for label, group, how in (("Faster outside noise", faster, lambda r: f"{r.speedup:.2f}×"),
                                       ("Slower outside noise", slower, lambda r: f"{r.speedup:.2f}×"),
                                       ("Sooner to the baseline's val loss outside noise", sooner,
                                        lambda r: f"{r.quality.speedup:.2f}×"),
                                       ("Later to the baseline's val loss outside noise", later,
                                        lambda r: f"{r.quality.speedup:.2f}×"),
                                       (f"Lower val loss{when} outside noise", better,
                                        lambda r: f"{r.loss_delta:+.3f}"),
                                       (f"Higher val loss{when} outside noise", worse,
                                        lambda r: f"{r.loss_delta:+.3f}"))
             if group]
    decided = ". ".join(parts) if parts else "No setting differs from the baseline outside noise, in speed or val loss"
    applied = ("The winner, which `--apply` writes into params.yaml: " + ", ".join(
        f"{c.key}={json_value(c.value)}" for c in changes) + "." if changes else
               "Nothing for `--apply` to write: no setting wins outside noise without losing elsewhere.")
    return f"{text}\n\n{decided}.\n\n{applied}"


def table(grid: dict[str, list[Any]], rows: list[Row], repeats: int) -> str:
    evaluated = any(r.eval_val_loss is not None for r in rows)
    priced = any(r.cost_usd is not None or r.quality and r.quality.cost_usd is not None for r in rows)
    head = [*grid, "runs", "val loss (± s.e.)", *(["eval val loss (± s.e.)"] if evaluated else []),
            "loss vs baseline", "tokens/s median (min–max)", "speed vs baseline", "time to the baseline's loss (s)",
            "vs baseline at equal loss", "ms/step median (min–max)", "peak mem (GB)", "device-hours",
            *(["cost per run (USD)", "cost to the baseline's loss (USD)"] if priced else []), "experiments"]
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
        time_to, at_loss = quality_shown(row.quality)
        cost = [usd_shown(row.cost_usd), usd_shown(row.quality.cost_usd if row.quality else None)] if priced else []
        cells += [loss_shown(row.val_loss, row.val_loss_se),
                  *([loss_shown(row.eval_val_loss, row.eval_val_loss_se)] if evaluated else []),
                  loss, row.tokens_per_s.shown(",.0f"), speed, time_to, "baseline" if i == 0 and time_to else at_loss,
                  row.step_ms.shown(".1f"), f"{row.peak_mem_gb:.2f}",
                  f"{row.device_hours:.4f}" if row.device_hours is not None else "", *cost, ", ".join(row.experiments)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(out: Path, slug: str, name: str, grid: dict[str, list[Any]], rows: list[Row], repeats: int,
                 target: str, time_budget_s: float | None = None,
                 changes: list[Change] | None = None) -> tuple[str, dict[str, Any]]:
    """``<slug>.md`` (verdict and table), ``<slug>.json`` and ``<slug>.png``, written as one; returns the markdown
    and the JSON's content (what ``--json`` prints)."""
    said = verdict(rows, repeats, time_budget_s, changes)
    length = (f"each run trains for {time_budget_s:g} s of training steps (train.time_budget_s), so val losses "
              "compare at equal time" if time_budget_s else "each run trains the steps params.yaml sets")
    text = (f"# {name}\n\n{said}\n\n"
            f"{len(rows)} settings × {repeats} run(s), one at a time, in alternating order, each the `{target}` stage "
            f"as a DVC experiment; {length}; the first setting is the baseline. A speed ratio is the median of each "
            "run's tokens/s over the baseline's run of the same repeat. Val losses: the median run's, ± its standard "
            "error over the scored windows; two differ outside noise when more than 2 × √(se₁² + se₂²) apart "
            "(evaluate's where every setting has it; README, \"Compare optimizations\"). Time to the baseline's loss: "
            "the training time (compile included, evals not) at which a run's val curve first reaches the val loss "
            "its repeat's baseline run ends with, interpolated between evals; the ratio at equal loss is the "
            "baseline's time over the setting's to the higher of their two final val losses (a loss both reach), "
            "paired by repeat. Speeds and times: median (min–max) over the runs; costs at each run's "
            "price per device-hour (train.price_per_hour).\n\n" + table(grid, rows, repeats))
    data = {"name": name, "report": str(out / f"{slug}.md"), "grid": grid, "repeats": repeats, "target": target,
            "time_budget_s": time_budget_s, "verdict": said,
            "apply": {c.key: c.value for c in changes or []}, "apply_why": {c.key: c.why for c in changes or []},
            "failed": [n for row in rows for n, ran in zip(row.experiments, row.tokens_per_s_runs) if ran is None],
            "rows": [dataclasses.asdict(r) for r in rows]}
    write_files(out, {f"{slug}.md": text, f"{slug}.json": json.dumps(data, indent=2) + "\n",
                      f"{slug}.png": render_png(rows, name, said)})
    return text, data


def render_png(rows: list[Row], title: str, said: str) -> bytes:
    """Speed ratio, ratio at the baseline's val loss and val loss per setting, with their intervals; gray where
    inside noise, a note where failed."""
    import textwrap

    plt = pyplot()

    shown, by_eval = rows[::-1], evaluated(rows)
    labels = [textwrap.shorten(describe(r.setting), 48) for r in shown]
    head = textwrap.fill(said.replace("**", "").replace("\n\n", " "), 160)
    height = 0.45 * len(rows) + 2.0 + 0.17 * (head.count("\n") + 1)
    fig, (speed, sooner, loss) = plt.subplots(1, 3, figsize=(14, height), dpi=100, sharey=True)
    _ratio_bars(speed, rows, lambda r: (r.speedup, r.paired, r.speed_inside_noise))
    _ratio_bars(sooner, rows, lambda r: (r.quality.speedup, r.quality.paired, r.quality.inside_noise) if r.quality
                else (None, [], None))
    for y, row in enumerate(shown):
        value, error = quality(row, by_eval)
        if row.runs and value is not None:
            apart = row is not rows[0] and row.loss_apart
            loss.errorbar(value, y, xerr=2 * error if error else None, fmt="o", capsize=3,
                          color="tab:blue" if apart else "tab:gray")
    speed.set_yticks(range(len(shown)), labels)
    speed.set_ylim(-0.6, len(shown) - 0.4)
    speed.set(xlabel="tokens/s vs the baseline (median of paired runs, min–max)", title="Speed")
    sooner.set(xlabel="how much sooner at the baseline's val loss (paired runs)", title="At equal loss")
    loss.set(xlabel=f"{'evaluate' if by_eval else 'training'}'s val loss (± 2 s.e.; blue: apart from the baseline)",
             title="Quality")
    fig.suptitle(f"{title}\n{head}", fontsize=8)
    return png(fig)


def _ratio_bars(ax: Any, rows: list[Row], figures: Any) -> None:
    """One bar per setting: a ratio to the baseline (``figures(row)`` gives it, its paired ratios and whether it is
    inside noise), with the paired min–max; gray where inside noise, a note where failed or not measured."""
    ax.axvline(1.0, color="black", linewidth=0.8)
    highest = [1.0]
    for y, row in enumerate(rows[::-1]):
        if not row.runs:
            ax.annotate("FAILED: see dvc.log", (0, y), xytext=(3, 0), textcoords="offset points", va="center",
                        color="tab:red", fontsize=8, style="italic")
            continue
        ratio, paired, noisy = (1.0, [], True) if row is rows[0] else figures(row)
        if ratio is None:
            continue
        low, high = (min(paired), max(paired)) if paired else (ratio, ratio)
        highest.append(high)
        gray = row is rows[0] or noisy is not False
        ax.barh(y, ratio, color="tab:gray" if gray else "tab:blue", xerr=[[ratio - low], [high - ratio]], capsize=3)
        note = "baseline" if row is rows[0] else f"{ratio:.2f}×" + (" (inside noise)" if gray else "")
        ax.annotate(note, (high, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_xlim(0, 1.35 * max(highest))


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
                                 "grid/loss_apart": as_metric(row.loss_apart),
                                 "grid/time_to_baseline_loss_s": _round(
                                     row.quality.time_s.median if row.quality and row.quality.time_s else None),
                                 "grid/speedup_at_equal_loss": _round(row.quality.speedup if row.quality else None),
                                 "grid/cost_usd": _round(row.cost_usd)}, step=i)
        if dataset := experiments.workspace_dataset(paths.root()):
            tracker.log_dataset(dataset, context="training")
        for suffix in (".md", ".json", ".png"):
            tracker.log_artifact(out / f"{slug}{suffix}")
        tracker.describe((out / f"{slug}.md").read_text(), f"{slug}.md")
        children = {n: {"grid.setting": describe(row.setting), "grid.run": str(r + 1)}
                    for row in rows for r, n in enumerate(row.experiments)}
        verdicts = {n: {"vs_baseline/speedup": 1.0 if i == 0 else _round(row.speedup),
                        "vs_baseline/speed_inside_noise": as_metric(row.speed_inside_noise),
                        "vs_baseline/val_loss_delta": 0.0 if i == 0 else _round(row.loss_delta),
                        "vs_baseline/speedup_at_equal_loss": _round(row.quality.speedup if row.quality else None)}
                    for i, row in enumerate(rows) for n in row.experiments}
        adopt(tracker, list(children), children, verdicts)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


