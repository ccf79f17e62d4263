"""`gpt2 ladder`, `gpt2 plan` and `gpt2 peak`: what optimizations buy, what a run will cost, a CPU's peak."""

from __future__ import annotations

import click

from gpt2.core import paths
from gpt2.core.cli import STARTING_PARAMS, user_errors


class Finite(click.FloatRange):
    """A number in a range, and a real one: ``nan`` and ``inf`` pass click's range checks (every comparison
    with nan is false) and would reach the JSON and the arithmetic."""

    name = "finite float range"

    def convert(self, value, param, ctx):  # type: ignore[no-untyped-def]
        import math

        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):  # said as such, before the range's own message
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(number, param, ctx)


ALPHA_OPTION = click.option(
    "--alpha", default=0.01, show_default=True, type=Finite(0, 0.5, min_open=True),
    help="the significance level of every verdict: a val loss or time-to-loss difference counts where the paired "
         "t-test over the seeds gives p below it, a speed ratio where the t-test on its pairs does (0.01: "
         "modded-nanogpt's for a record)")


@click.command()
@STARTING_PARAMS
@paths.option("--ladder", "ladder_path", default=paths.LADDER, type=click.Path(dir_okay=False),
              help="the rungs and per-device profiles")
@paths.option("--out", default=paths.LADDER_REPORTS, help="report folder (ladder.md, .png, .json)")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda", "mps"]),
              help="where to train; picks the ladder's profile (cuda: gpt2 124M, T=1024; else tiny)")
@click.option("--model", default=None, type=click.Choice(["tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]),
              help="model.size instead of the profile's")
@click.option("--steps", default=None, type=click.IntRange(min=2), help="steps per run instead of the profile's")
@click.option("--repeats", default=None, type=click.IntRange(min=1), help="runs per rung instead of the profile's")
@click.option("--mlflow/--no-mlflow", default=None, help="log to MLflow (default: params.yaml train.mlflow)")
@click.option("--target", default=None, type=Finite(min=0, min_open=True),
              help="val loss: every run trains to it (steps is the cap); the table adds time and tokens to target")
@click.option("--time-budget", "time_budget_s", default=None, type=Finite(min=0, min_open=True), metavar="SECONDS",
              help="every run trains this long (train.time_budget_s) instead of --steps: val losses at equal time")
@click.option("--apply", is_flag=True, help="write the winning rungs' changes into params.yaml (a committed one only)")
@ALPHA_OPTION
@click.option("--json", "as_json", is_flag=True, help="print the comparison as JSON on stdout (logs stay on stderr)")
@user_errors
def ladder(params_path: str, ladder_path: str, out: str, device: str, model: str | None, steps: int | None,
           repeats: int | None, mlflow: bool | None, target: float | None, time_budget_s: float | None,
           apply: bool, alpha: float, as_json: bool) -> None:
    """Measure what each optimization buys: every rung of ladder.yaml as DVC experiments, then a table and plot."""
    from gpt2.measure.ladder import run_ladder

    run_ladder(ladder_path, params_path, out, device, model, steps, repeats, mlflow, target, time_budget_s,
               apply, as_json, alpha)


@click.command()
@STARTING_PARAMS
@click.option("-S", "--set", "sets", multiple=True,
              help="section.key=value[,value...]: one experiment per combination of the values (repeatable)")
@click.option("--rev", "revs", default=None, metavar="A,B[,...]",
              help="git revisions to compare, the first the baseline: each runs its own code in a checkout of its "
                   "own, on the workspace's data and params (with -S: every combination)")
@click.option("--name", default=None, help="the grid's name in the report and MLflow (default: grid MM-DD HH:MM:SS)")
@click.option("--target", default="train", show_default=True,
              help="the dvc.yaml stage each experiment runs to: train (judged on training's final val loss), or "
                   "evaluate (also the evaluate stage: its val loss on more text, its samples; about 30 s more a run "
                   "of the tiny model on a 2-core CPU)")
@paths.option("--out", default=paths.GRID_REPORTS,
              help="report folder (<slug>.md, .json, .png and DVC's log <slug>.dvc.log: the name, spaces as -)")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(1, 1000),
              help="runs per setting, in alternating order, repeat r training one seed (train.seed + 1 + r) in every "
                   "setting: 2 or more give each speed ratio an interval and each val loss a t-test over the seeds "
                   "(2 decide only a difference far outside the seeds' spread; more decide smaller ones, and the "
                   "report says how many a difference would need)")
@click.option("--mlflow/--no-mlflow", default=None, help="a parent MLflow run (default: params.yaml train.mlflow)")
@click.option("--time-budget", "time_budget_s", default=None, type=Finite(min=0, min_open=True), metavar="SECONDS",
              help="every run trains this long (train.time_budget_s): val losses compare at equal time")
@click.option("--apply", is_flag=True, help="write the winning setting into params.yaml (a committed one only)")
@ALPHA_OPTION
@click.option("--json", "as_json", is_flag=True, help="print the comparison as JSON on stdout (logs stay on stderr)")
@user_errors
def grid(params_path: str, sets: tuple[str, ...], revs: str | None, name: str | None, target: str, out: str,
         repeats: int, mlflow: bool | None, time_budget_s: float | None, apply: bool, alpha: float,
         as_json: bool) -> None:
    """Run a grid of DVC experiments (-S key=a,b ...) or code revisions (--rev A,B) one at a time, each setting
    against the first, with its noise."""
    from gpt2.measure.grid import run_grid

    run_grid(sets, name, target, out, mlflow, params_path, repeats, time_budget_s, apply, as_json, alpha, revs)


@click.command()
@click.option("--model", default="gpt2", show_default=True,
              type=click.Choice(["tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]))
@click.option("--tokens", required=True, type=Finite(min=0, max=1e16, min_open=True),
              help="training tokens, e.g. 10e9 (at most 1e16)")
@click.option("--device", default="h100", show_default=True,
              type=click.Choice(["h100", "h100-pcie", "h100-nvl", "h200", "h200-nvl", "b200", "a100", "a100-40gb",
                                 "l40s", "l4", "v100", "cpu"]))
@click.option("--gpus", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--micro-batch", default=None, type=click.IntRange(min=1),
              help="sequences per GPU (default: 16 on a GPU; on a CPU training's default, 8)")
@click.option("--seq-len", default=None, type=click.IntRange(min=1), help="default: the model's context")
@click.option("--dtype", default=None, type=click.Choice(["fp32", "bf16", "fp16"]),
              help="default: bf16 on a GPU, fp32 on a CPU (where bf16 is emulated and slow)")
@click.option("--attention", default="flash", show_default=True, type=click.Choice(["flash", "manual"]))
@click.option("--mfu", default=None, type=Finite(0, 1, min_open=True),
              help="model FLOPs utilization (default: measured here on that device, else 40%)")
@click.option("--price-per-hour", default=None, type=Finite(min=0, max=1e4), help="USD per GPU-hour")
@click.option("--memory-gb", default=None, type=Finite(min=0.1, max=1e5), help="memory per device (0.1 to 1e5 GB)")
@click.option("--peak-tflops", default=None, type=Finite(min=0.01, max=1e5),
              help="peak per device (0.01 to 1e5 TFLOP/s)")
@click.option("--root", default=".", show_default=True, type=click.Path(exists=True, file_okay=False),
              help="project whose reports/ladder and mlflow.db hold measured MFU")
@click.option("--loss-chunk", default=None, type=click.IntRange(min=0),
              help="train.loss_chunk: positions whose logits exist at once; 0 = plain loss (default: auto's, 8192 on "
                   "a GPU, on a CPU as this one resolves it)")
@click.option("--optimizer", default="adamw", show_default=True, type=click.Choice(["adamw", "muon"]),
              help="train.optimizer: its state is part of the memory")
@click.option("--distributed", default="ddp", show_default=True, type=click.Choice(["ddp", "fsdp"]),
              help="ddp: a full replica per GPU; fsdp: weights, gradients and optimizer state split over --gpus")
@click.option("--batch-tokens", default=524_288, show_default=True, type=click.IntRange(min=1, max=10**12),
              help="tokens per optimizer step (train.batch_tokens; GPT-2's 0.5 M): the micro-batch × accumulation "
                   "that micro_batch_size auto picks for it")
@click.option("--fp8-head", is_flag=True,
              help="train.fp8_head: the loss's FP8 gradients hold 2 bytes more per token and vocabulary column")
@click.option("--json", "as_json", is_flag=True, help="print the plan as JSON")
@user_errors
def plan(model: str, tokens: float, device: str, gpus: int, micro_batch: int | None, seq_len: int | None,
         dtype: str | None, attention: str, mfu: float | None, price_per_hour: float | None, memory_gb: float | None,
         peak_tflops: float | None, root: str, loss_chunk: int | None, optimizer: str, distributed: str,
         batch_tokens: int, fp8_head: bool, as_json: bool) -> None:
    """Compute budget: parameters, FLOPs, memory, largest micro-batch, time and cost for TOKENS."""
    import json
    from pathlib import Path

    from gpt2.measure.plan import plan as make
    from gpt2.measure.plan import render

    result = make(model, tokens, device, micro_batch, seq_len, gpus, dtype, attention, mfu, price_per_hour,
                  memory_gb, peak_tflops, Path(root), loss_chunk, optimizer, distributed, batch_tokens, fp8_head)
    click.echo(json.dumps(result, indent=2) if as_json else render(result), nl=as_json)


@click.command()
@click.option("--threads", default=0, show_default=True, type=click.IntRange(min=0),
              help="intra-op threads, as train.threads (0: PyTorch's default)")
@click.option("--fresh", is_flag=True,
              help="forget the kept figures (the machine changed) instead of keeping the higher")
@user_errors
def peak(threads: int, fresh: bool) -> None:
    """Measure this CPU's matmul peak (fp32, and bf16 where native) and keep it: MFU on a CPU divides by it.

    Training measures it once by itself, and again while the kept one was taken under load. A measurement
    only raises the kept figure (one taken beside other work reads low), as does a run that goes faster."""
    import torch

    from gpt2.run.peak import cache_path, keep, kept_on_disk, machine_key, measure

    if threads:
        torch.set_num_threads(threads)
    measured = measure()
    kept = keep(measured, fresh)
    click.echo(f"{machine_key(torch.get_num_threads())}")
    for kind in ("fp32", "bf16"):
        value, now = kept.get(kind), measured.get(kind)
        shown = f"{value / 1e12:.3f} TFLOP/s" if value else "not native here (emulated: not measured)"
        if value and now and value > now:
            shown += f" (kept: an earlier measurement was higher; this one {now / 1e12:.3f})"
        click.echo(f"  {kind}: {shown}")
    if measured.get("under_load"):
        click.echo(f"measured under load: {100 * measured['load']:.0f}% of the cores were busy with other work, so it "
                   "may read low; training measures it again on a quiet machine (or run `gpt2 peak` then)")
    if kept_on_disk(kept):
        click.echo(f"kept in {cache_path()}")
    else:
        click.echo(f"not kept: {cache_path()} cannot be written (a read-only or full home?); set GPT2_PEAK_CACHE to a "
                   "writable file to keep it (training measures it again meanwhile)")
