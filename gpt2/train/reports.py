"""What a run reports: its summary, and the files DVC and people read.

Every measure has one name, ``section/name`` (``train/loss``, ``perf/step_ms``, ``val/loss``):
MLflow logs it so, the history keeps it so, and the summary nests it as ``{"perf": {"step_ms": …}}``.
The plot files (``plots/train.tsv``, ``plots/val.tsv``) are DVC outputs whose column names are
part of ``dvc plots``' contract: ``PLOT_COLUMNS`` maps each column to the measure it shows.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from gpt2.core import log
from gpt2.core.atomic import json_text, write_files
from gpt2.core.plots import png, pyplot
from gpt2.run import machine_load
from gpt2.run.cost import cost_figures, price_per_hour
from gpt2.run.device import memory_gb
from gpt2.run.figures import compared_figures, rounded
from gpt2.run.flops import Throughput
from gpt2.run.mfu import raised
from gpt2.train.build import Setup
from gpt2.train.history import History


# Each plot file's columns, and the measure each column shows (memory: RSS on CPU, allocated on CUDA).
PLOT_COLUMNS = {
    "train.tsv": {"step": ("step",), "loss": ("train/loss",), "lr": ("train/lr",), "grad_norm": ("train/grad_norm",),
                  "step_ms": ("perf/step_ms",), "tokens_per_s": ("perf/tokens_per_s",), "mfu": ("perf/mfu",),
                  "mem_gb": ("mem/allocated_gb", "mem/rss_gb")},
    "val.tsv": {"step": ("step",), "val_loss": ("val/loss",), "val_loss_se": ("val/loss_se",),
                "val_bpb": ("val/bpb",), "train_s": ("train_s",), "tokens": ("tokens",)},
}

def warmup_s(history: History, steps: int) -> float:
    """Seconds spent in the untimed first steps of every session: compilation and autotuning, mostly."""
    return round(sum(t for t, warm in zip(history.step_s, history.warm(steps)) if warm), 3)


NOISY_STEP_IQR = 0.10  # a run whose step times' IQR passes 10% of their median: one run cannot give its speed


def iqr(values: list[float]) -> float:
    """The interquartile range (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1


def summarize(history: History, step: int, wall_s: float, first_step: int, *, throughput: Throughput,
              timing_warmup_steps: int, target_val_loss: float | None, num_params: int,
              memory: dict[str, float], run_wall_s: float | None = None,
              price: tuple[float | None, str] = (None, "")) -> dict[str, Any]:
    """The run's figures. ``tokens_per_s`` is the median step's. ``tokens_per_s_steady`` divides the
    steps after the warm-up by their wall time (evals and checkpoints included), the figure to hold
    against the median; ``tokens_per_s_wall`` divides the tokens of this session (steps
    ``first_step``..``step``) by its whole wall time: model build and compilation included too.
    ``mfu`` divides by the bf16 yardstick, ``mfu_dtype`` (where it differs) by the run's own dtype's
    peak. ``step_ms_iqr`` and ``tokens_per_s_iqr`` are the
    interquartile ranges over the timed steps: how much single steps vary. ``train_s``: the training time,
    every session's steps (what a time budget counts). ``machine``: how busy other work kept the cores while the
    steady state was timed (gpt2/run/machine_load.py). ``cost``: the device-hours of the run's wall time over its
    sessions (``run_wall_s``), and their price (gpt2/run/cost.py)."""
    timed = history.timed_s(timing_warmup_steps)
    step_s = statistics.median(timed)
    tokens_per_step, world = throughput.tokens_per_step, throughput.world
    tokens_per_s = throughput.tokens_per_s(step_s)
    last = history.val[-1] if history.val else {}
    last_val = last.get("val/loss")
    best = min(history.val, key=lambda r: r["val/loss"]) if history.val else {}
    utilization = {"mfu": rounded(throughput.mfu(tokens_per_s), 5)}
    if throughput.dtype_peak_flops:
        utilization["mfu_dtype"] = rounded(throughput.mfu_dtype(tokens_per_s), 5)
    return {
        "train": {"loss": history.train[-1].get("train/loss") if history.train else None},
        "val": {"loss": last_val, "loss_se": last.get("val/loss_se"), "ppl": math.exp(last_val) if last else None,
                **({"bpb": last["val/bpb"]} if "val/bpb" in last else {}),
                "best_loss": best.get("val/loss"), "best_step": best.get("step"),
                **({"holdout_loss": last["val/holdout_loss"], "holdout_loss_se": last["val/holdout_loss_se"]}
                   if "val/holdout_loss" in last else {})},
        "perf": {
            "step_ms": round(1000 * step_s, 3),
            "tokens_per_s": round(tokens_per_s, 1),
            "step_ms_iqr": round(1000 * iqr(timed), 3),
            "tokens_per_s_iqr": round(iqr([tokens_per_step / s for s in timed]), 1),
            "tokens_per_s_steady": (round(history.steady_steps * tokens_per_step / history.steady_s, 1)
                                    if history.steady_s > 0 else None),
            "tokens_per_s_wall": round((step - first_step) * tokens_per_step / wall_s, 1) if wall_s > 0 else None,
            "tokens_per_s_per_device": round(tokens_per_s / world, 1),
            **utilization,
            "timed_steps": len(timed),
            "warmup_s": warmup_s(history, timing_warmup_steps),
            "eval_warmup_s": round(history.eval_warmup_s, 3),
            "world_size": world,
        },
        "mem": memory_figures(memory),
        **({"machine": {**load, "cores": machine_load.cores_here()}}
           if (load := machine_load.figures(history.load)) else {}),
        **({"target": target_figures(target_val_loss, history.target)} if target_val_loss is not None else {}),
        "steps": step,
        "tokens": step * tokens_per_step,
        "params": num_params,
        "fp16_skipped_steps": history.fp16_skipped,
        "wall_s": round(wall_s, 2),
        "train_s": round(history.train_s, 3),
        "cost": {**cost_figures(wall_s if run_wall_s is None else run_wall_s, world, price[0]),
                 "price_per_hour": price[0], "price_source": price[1]},
        "run_uid": history.run_uid,
        **({"lengthened_at": history.lengthened_at} if history.lengthened_at else {}),
    }


def run_summary(s: Setup, throughput: Throughput, history: History, last_step: int, first_step: int, wall_s: float,
                run_wall_s: float, info: dict[str, Any]) -> dict[str, Any]:
    """A session's summary at its last step: ``summarize``'s figures of this device and what really ran.
    ``throughput``: the step log's, whose peak a run faster than it has raised."""
    cfg = s.params.train
    if history.step_s and (faster := raised(throughput, throughput.tokens_per_s(
            statistics.median(history.timed_s(cfg.timing_warmup_steps))), s.runtime.dtype)):
        throughput, warning = faster
        log.get("train").warning(warning)  # the median step can be faster than every logged one
    summary = summarize(history, last_step, wall_s, first_step, throughput=throughput,
                        timing_warmup_steps=cfg.timing_warmup_steps, target_val_loss=cfg.target_val_loss,
                        num_params=s.model.num_params(), memory=memory_gb(s.runtime), run_wall_s=run_wall_s,
                        price=price_per_hour(cfg.price_per_hour, s.runtime.device.type, s.runtime.device_name))
    if history.step_s and not any(not warm for warm in history.warm(cfg.timing_warmup_steps)):
        longer = ("a larger train.time_budget_s" if cfg.time_budget_s is not None else "a larger train.max_tokens"
                  if cfg.max_tokens is not None else f"train.max_steps above {cfg.timing_warmup_steps}")
        log.get("train").warning(f"every step of this run was in its warm-up (the first {cfg.timing_warmup_steps} "
                                 "of a session, train.timing_warmup_steps): its speed figures include compilation "
                                 f"and autotuning; train longer ({longer}) to time its steps")
    if warning := machine_load.warning(summary.get("machine")):
        log.get("train").warning(warning)
    runtime = {k: v for k, v in info.items() if k != "params"}  # what really ran (the ladder reads it)
    return {**summary, "runtime": {**runtime, **s.compile_watch.figures()}}


def memory_figures(memory: dict[str, float]) -> dict[str, float]:
    """``peak_gb``, the compared figure: the peak allocated on CUDA, the peak resident set on CPU; then every
    reading by its own name (``peak_reserved_gb``; ``rss_gb``, the resident set at the end)."""
    peak = memory.get("mem/peak_allocated_gb", memory.get("mem/peak_rss_gb", 0.0))
    return {"peak_gb": round(peak, 4), **{k.removeprefix("mem/"): round(v, 4) for k, v in memory.items()}}


def target_figures(target: float, reached: dict[str, float] | None) -> dict[str, Any]:
    """Time, tokens and steps to the target val loss; a target never reached has no numbers, only ``reached: false``."""
    figures = reached or {"time_s": None, "tokens": None, "steps": None, "train_s": None}
    return {"val_loss": target, "reached": reached is not None, **figures}


def write_reports(report_dir: Path, summary: dict[str, Any], history: History) -> None:
    """metrics.json (compared figures), summary.json (the whole summary), plots/*.tsv and plots/curves.png."""
    files: dict[str, str | bytes] = {f"plots/{name}": plot_table(PLOT_COLUMNS[name], rows)
                                     for name, rows in (("train.tsv", history.train), ("val.tsv", history.val))}
    png = render_curves(history.train, history.val, f"{summary['params']:,} parameters, {summary['steps']} steps",
                        summary.get("perf"))
    if png is not None:
        files["plots/curves.png"] = png
    files["summary.json"] = json_text(summary)
    files["metrics.json"] = json_text(compared_figures(summary))
    write_files(report_dir, files)  # all of them or none


def withdraw_other_evaluation(eval_dir: Path, summary_path: Path) -> bool:
    """Withdraw an evaluation that scored another run's checkpoint than the one ``summary_path`` reports.

    The checkpoint it scored has just been replaced, so its figures would pass for this run's: in
    ``dvc exp show`` for an experiment that ran the train stage alone, and in a grid. Its metrics.json
    keeps its keys with null figures (``-`` in ``dvc exp show``; a missing file reads as ``!``, an
    error), its summary and samples go. An evaluation of this very run (a finished run whose reports
    were rebuilt) stays. Returns whether one was withdrawn."""
    try:
        run_uid = json.loads(summary_path.read_text()).get("run_uid")
    except (OSError, ValueError, AttributeError):
        return False  # no run reported (a measurement run): nothing to compare with
    metrics = eval_dir / "metrics.json"
    try:
        scored = json.loads((eval_dir / "summary.json").read_text()).get("checkpoint_run_uid")
    except (OSError, ValueError, AttributeError):
        scored = None  # an older or broken evaluation: it cannot show that it scored this run
    if run_uid is not None and scored == run_uid or not metrics.is_file():
        return False
    try:
        figures = json.loads(metrics.read_text())
        withdrawn = {section: {key: None for key in values} for section, values in figures.items()}
    except (ValueError, AttributeError):
        withdrawn = {}
    write_files(eval_dir, {"metrics.json": json_text(withdrawn or {"eval": {"val_loss": None}})})
    for name in ("summary.json", "samples.md"):
        (eval_dir / name).unlink(missing_ok=True)
    return True


def plot_table(columns: dict[str, tuple[str, ...]], rows: list[dict[str, Any]]) -> str:
    """Tab-separated rows with a header; a measure a row lacks (a warm-up step's speed) is an empty cell."""
    def cell(row: dict[str, Any], keys: tuple[str, ...]) -> str:
        value = next((row[k] for k in keys if row.get(k) is not None), None)
        if value is None:
            return ""
        return str(value) if isinstance(value, int) else f"{value:.6g}"

    lines = ["\t".join(columns)] + ["\t".join(cell(row, keys) for keys in columns.values()) for row in rows]
    return "\n".join(lines) + "\n"


def render_curves(train: list[dict[str, Any]], val: list[dict[str, Any]], title: str,
                  perf: dict[str, Any] | None = None) -> bytes | None:
    """The training curves as one PNG (loss, step time, tokens/s, memory), readable without a browser. The step
    time's title gives ``perf``'s median and IQR over every timed step, the figures metrics.json holds (the curve
    shows the logged steps only), or the logged steps' where there is no ``perf``.

    DVC's own plots render to HTML that loads Vega from a CDN: blank offline. matplotlib is optional
    here (GPU boxes may lack it): without it the PNG is skipped with a note, the TSVs remain."""
    try:
        plt = pyplot()
    except ImportError:
        log.get("train").info("train: matplotlib is not installed; skipping plots/curves.png "
                              "(the .tsv files are written)")
        return None

    def series(rows: list[dict[str, Any]], *keys: str) -> tuple[list[float], list[float]]:
        points = [(r["step"], next(r[k] for k in keys if r.get(k) is not None)) for r in rows
                  if any(r.get(k) is not None for k in keys)]
        return [p[0] for p in points], [p[1] for p in points]

    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), dpi=100, sharex=True)
    loss, step_ms, tps, mem = axes.flat
    loss.plot(*series(train, "train/loss"), label="train", linewidth=1)
    steps, values = series(val, "val/loss")
    errors = [r.get("val/loss_se") for r in val if r.get("val/loss") is not None]
    known = all(e is not None and e == e for e in errors)  # not NaN (one window) nor missing (older runs)
    loss.errorbar(steps, values, yerr=errors if known else None, label="val (± standard error)" if known else "val",
                  marker="o", markersize=3, capsize=2)
    loss.set(ylabel="loss (nats/token)", title="Loss")
    loss.legend()
    steps_ms = series(train, "perf/step_ms")
    step_ms.plot(*steps_ms, linewidth=1)
    step_ms.set(ylabel="ms (warm-up steps left out)", title="Step time")
    timed = (perf or {}).get("step_ms"), (perf or {}).get("step_ms_iqr")
    if timed[0] or len(steps_ms[1]) >= 2:  # noisy: one run cannot give its speed
        median, spread = timed if timed[0] and timed[1] is not None else (statistics.median(steps_ms[1]),
                                                                          iqr(steps_ms[1]))
        noisy = spread > NOISY_STEP_IQR * median
        step_ms.axhline(median, color="C3" if noisy else "C2", linestyle=":", linewidth=1)
        step_ms.set_title(f"Step time: median {median:,.3g} ms, IQR {100 * spread / median:.0f}%"
                          + (" (noisy)" if noisy else ""), color="C3" if noisy else "black")
    tps.plot(*series(train, "perf/tokens_per_s"), linewidth=1)
    tps.set(ylabel="tokens/s", title="Throughput")
    mem.plot(*series(train, "mem/allocated_gb", "mem/rss_gb"), linewidth=1, label="now")
    peaks = series(train, "mem/peak_allocated_gb", "mem/peak_rss_gb")  # runs logged before peaks were: none
    if peaks[0]:
        mem.plot(*peaks, linewidth=1, linestyle="--", label="peak so far")
        mem.legend()
    mem.set(ylabel="GB", title="Memory (CPU: resident set; CUDA: allocated)")
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
    for ax in (step_ms, tps, mem):  # from 0, with room above the highest point: a flat line is not the frame
        top = max((max(line.get_ydata(), default=0) for line in ax.lines), default=0)
        ax.set_ylim(0, 1.15 * top if top > 0 else 1)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle(title)
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.08, top=0.9, wspace=0.25, hspace=0.25)  # tight_layout: 2× slower
    return png(fig, tight=False)
