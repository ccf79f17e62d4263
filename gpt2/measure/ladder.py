"""The optimization ladder: what each training optimization buys, measured here, as DVC experiments.

``ladder.yaml`` declares a baseline (everything off) and rungs, each the rung above plus one
change to params.yaml's ``train`` section. Every rung is queued as a real ``dvc exp`` of the
``train`` stage, repeated in alternating order (forward, then backward) so that a machine
warming up or slowing down does not pass for a speedup, and the queue runs one experiment at a
time. The table compares tokens/s (not step time: gradient accumulation changes the tokens per
step) and keeps the val loss after N steps in view, so a "speedup" that breaks training shows.
A rung whose switch resolves to what already ran (TF32 or AMP on a CPU) is reported as having no
effect on this device, from what the trainer recorded, not from a rule of thumb.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpt2.core import log
from gpt2.core.atomic import atomic_dir
from gpt2.core.config import ModelParams, ParamError, TrainConfig, build, read_yaml, to_dict
from gpt2.core.errors import UserError
from gpt2.core.progress import clock
from gpt2.measure import experiments

logger = log.get("ladder")

TRAIN_METRICS = "reports/train/metrics.json"
TRAIN_RUN = "reports/train/summary.json"  # the rest of a run's summary: what really ran ("runtime")
EXP_PREFIX = "ladder-"
# A rung's change that the trainer resolves on the device: the key of what really ran in summary.json's "runtime".
RESOLVED = {"dtype": "dtype", "tf32": "tf32", "keep_host_memory": "keep_host_memory", "attention": "sdpa_backend"}


@dataclass(frozen=True)
class Rung:
    name: str
    changes: dict[str, Any]  # train keys this rung sets; the baseline's are all of its settings

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")


@dataclass(frozen=True)
class Profile:
    """What the ladder trains on one kind of device."""

    model: dict[str, Any]
    train: dict[str, Any]
    steps: int
    repeats: int
    target_batch_tokens: int
    target: float | None = None  # val loss: every run trains to it (or to `steps`), the table gains time to target


@dataclass(frozen=True)
class Ladder:
    rungs: tuple[Rung, ...]  # rungs[0] is the baseline
    profiles: dict[str, Profile]


@dataclass(frozen=True)
class Plan:
    """The rungs' full params for this device and the overrides that make each experiment."""

    device: str  # cpu | cuda | mps
    profile: Profile
    sections: list[dict[str, dict[str, Any]]]  # per rung: normalized {"model": ..., "train": ...}
    sets: list[dict[str, Any]]  # per rung: dotted key -> value, for dvc exp run -S


# --------------------------------------------------------------------------- the ladder file


def load_ladder(path: str | Path) -> Ladder:
    data = read_yaml(path, "ladder", "--ladder")
    where = str(path)
    _keys(data, {"baseline", "rungs", "profiles"}, where)
    baseline = _train_changes(data.get("baseline"), f"{where}: baseline")
    rungs = [Rung("baseline", baseline)]
    for i, item in enumerate(data.get("rungs") or []):
        _keys(item, {"name", "set"}, f"{where}: rungs[{i}]")
        name = item.get("name")
        if not isinstance(name, str) or not name.strip():
            raise UserError(f"{where}: rungs[{i}] needs a name")
        changes = _train_changes(item.get("set"), f"{where}: rung {name!r}")
        if not changes:
            raise UserError(f"{where}: rung {name!r} changes nothing; give it a `set` of train keys")
        rungs.append(Rung(name, changes))
    slugs = [r.slug for r in rungs]
    if len(set(slugs)) != len(slugs):
        raise UserError(f"{where}: two rungs have the same name: {', '.join(slugs)}")
    profiles = {}
    for device, raw in (data.get("profiles") or {}).items():
        _keys(raw, {"model", "train", "steps", "repeats", "target_batch_tokens", "target"}, f"{where}: profiles.{device}")
        profile = Profile(model=raw.get("model") or {}, train=raw.get("train") or {}, steps=raw.get("steps", 20),
                          repeats=raw.get("repeats", 2), target_batch_tokens=raw.get("target_batch_tokens", 0),
                          target=raw.get("target"))
        if profile.target is not None and (isinstance(profile.target, bool) or not isinstance(profile.target, int | float)
                                           or profile.target <= 0):
            raise UserError(f"{where}: profiles.{device}.target = {profile.target!r}; expected a val loss > 0 or null")
        for name in ("steps", "repeats", "target_batch_tokens"):
            value = getattr(profile, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "target_batch_tokens"
                                                                                else 1):
                raise UserError(f"{where}: profiles.{device}.{name} = {value!r}; expected a positive integer")
        profiles[str(device)] = profile
    if "cpu" not in profiles:
        raise UserError(f"{where}: needs at least a `profiles.cpu` entry (also used for mps)")
    return Ladder(tuple(rungs), profiles)


def _keys(data: Any, allowed: set[str], where: str) -> None:
    if not isinstance(data, dict):
        raise UserError(f"{where} must be a mapping, got {data!r}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}")


def _train_changes(data: Any, where: str) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{where} must be a mapping of train keys, got {data!r}")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for key in data:
        if key not in fields:
            raise UserError(f"{where}: {key!r} is not a params.yaml train key")
    return dict(data)


# --------------------------------------------------------------------------- planning


def plan(ladder: Ladder, raw_params: dict[str, Any], device: str, model: str | None = None,
         steps: int | None = None, repeats: int | None = None, mlflow: bool | None = None,
         target: float | None = None) -> Plan:
    """Each rung's complete model and train params on ``device`` (cpu, cuda or mps), validated.

    With a target val loss, ``steps`` is the cap, the val loss is measured 20 times over it (over
    params.yaml's ``eval_iters`` batches, not the profile's), and a run stops at the first
    measurement at or below the target."""
    profile = ladder.profiles.get(device) or ladder.profiles["cpu"]
    profile = dataclasses.replace(profile, steps=steps or profile.steps, repeats=repeats or profile.repeats,
                                  target=target or profile.target)
    model_set = {**profile.model, **({"size": model} if model else {})}
    fixed = {**profile.train, "device": device, "max_steps": profile.steps, "max_tokens": None,
             "eval_interval": max(1, profile.steps // 20) if profile.target else profile.steps,
             "checkpoint_interval": profile.steps, "save_checkpoint": False, "resume": "never",
             "log_interval": max(1, profile.steps // 5), "target_val_loss": profile.target, "stop_at_target": True}
    if profile.target:  # the val figure at the size whose noise was measured (params.yaml), not the profile's glance
        fixed["eval_iters"] = (raw_params.get("train") or {}).get("eval_iters", TrainConfig.eval_iters)
    if mlflow is not None:
        fixed["mlflow"] = mlflow
    sections, sets, changes = [], [], {}
    for rung in ladder.rungs:
        changes = {**changes, **rung.changes}
        train_set = {**fixed, **changes}
        if train_set.get("grad_accum_steps") == "target":
            train_set["grad_accum_steps"] = _accumulation(raw_params, model_set, train_set, profile)
        where = f"ladder rung {rung.name!r}"
        try:
            model_cfg = build(ModelParams, {**(raw_params.get("model") or {}), **model_set}, "model")
            train_cfg = build(TrainConfig, {**(raw_params.get("train") or {}), **train_set}, "train")
        except ParamError as exc:
            raise UserError(f"{where}: {str(exc).removeprefix('params: ')}") from None
        sections.append({"model": to_dict(model_cfg), "train": to_dict(train_cfg)})
        sets.append({**{f"model.{k}": v for k, v in model_set.items()},
                     **{f"train.{k}": v for k, v in train_set.items()}})
    return Plan(device=device, profile=profile, sections=sections, sets=sets)


def _accumulation(raw: dict[str, Any], model_set: dict[str, Any], train_set: dict[str, Any], profile: Profile) -> int:
    """``grad_accum_steps: target``: the micro-batches nearest the profile's target_batch_tokens (at least 2,
    so the rung always accumulates, also when ``--model`` makes one micro-batch larger than the target)."""
    from gpt2.model.sizes import SIZES

    model = {**(raw.get("model") or {}), **model_set}
    train = {**(raw.get("train") or {}), **train_set}
    seq = train.get("block_size") or model.get("block_size") or SIZES[model.get("size", "tiny")]["block_size"]
    micro = train.get("micro_batch_size", TrainConfig.micro_batch_size) * seq
    return max(2, round(profile.target_batch_tokens / micro))


def normalized(params: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """An experiment's model and train params as the trainer sees them (defaults filled), or None if invalid."""
    try:
        return {"model": to_dict(build(ModelParams, params.get("model") or {}, "model")),
                "train": to_dict(build(TrainConfig, params.get("train") or {}, "train"))}
    except UserError:
        return None


def measured(plan_: Plan, exps: list[experiments.Experiment]) -> list[list[experiments.Experiment]]:
    """Per rung: the finished ``ladder-`` experiments with exactly its params, newest first."""
    found: list[list[experiments.Experiment]] = [[] for _ in plan_.sections]
    for exp in exps:
        if not exp.name.startswith(EXP_PREFIX) or TRAIN_METRICS not in exp.metrics:
            continue
        sections = normalized(exp.params)
        for i, wanted in enumerate(plan_.sections):
            if sections == wanted:
                found[i].append(exp)
    return [sorted(runs, key=lambda e: e.timestamp, reverse=True) for runs in found]


def schedule(repeats: int, have: list[int]) -> list[tuple[int, int]]:
    """(rung, repeat) pairs still to run: repeat r goes forward when r is even, backward when odd."""
    order = []
    for r in range(repeats):
        rungs = range(len(have)) if r % 2 == 0 else reversed(range(len(have)))
        order += [(i, r) for i in rungs if r >= have[i]]
    return order


# --------------------------------------------------------------------------- running


def run_ladder(ladder_path: str | Path = "ladder.yaml", params_path: str | Path = "params.yaml",
               out: str | Path = "reports/ladder", device: str = "auto", model: str | None = None,
               steps: int | None = None, repeats: int | None = None, fresh: bool = False,
               mlflow: bool | None = None, target: float | None = None) -> list[dict[str, Any]]:
    """Measure every rung as DVC experiments (reusing ones already measured), then write the report."""
    root = Path.cwd()
    ladder = load_ladder(ladder_path)
    raw = read_yaml(params_path, "params", "--params")  # raw: the rungs override it key by key
    if not isinstance(raw, dict):
        raise UserError(f"params file {str(params_path)!r} must be a mapping of sections")
    device = resolve_device(device)
    plan_ = plan(ladder, raw, device, model, steps, repeats, mlflow, target)
    experiments.check_repo(root)
    waiting = experiments.pending(root)
    if waiting:
        raise UserError(f"{len(waiting)} DVC experiment(s) already queued or running ({', '.join(waiting[:5])}); "
                        "the ladder times one experiment at a time: run them (dvc exp run --run-all) or remove "
                        "them (dvc queue remove --queued) first")
    existing = experiments.finished(root, (TRAIN_RUN,))
    have = [0] * len(plan_.sections) if fresh else [len(runs) for runs in measured(plan_, existing)]
    todo = schedule(plan_.profile.repeats, have)
    reused = sum(min(h, plan_.profile.repeats) for h in have)
    logger.info(f"ladder: {len(ladder.rungs)} rungs × {plan_.profile.repeats} repeats on {device} "
                f"(model {plan_.sections[0]['model']['size']}, {plan_.profile.steps} steps per run): "
                f"{len(todo)} to run, {reused} reused")
    if todo:
        _measure(root, ladder, plan_, todo, {e.name for e in existing}, Path(out))
        existing = experiments.finished(root, (TRAIN_RUN,))
    runs = [r[:plan_.profile.repeats] for r in measured(plan_, existing)]
    rows = analyse(ladder, plan_, runs)
    write_report(Path(out), rows, plan_, runs)
    if plan_.sections[0]["train"]["mlflow"]:
        log_to_mlflow(rows, plan_, runs, Path(out))
    failed = [row["rung"] for row in rows if row["runs"] < plan_.profile.repeats]
    if failed:
        raise UserError(f"ladder: rung(s) {', '.join(failed)} did not finish every run; see {out}/dvc.log and "
                        "`dvc queue logs NAME`; the report marks them")
    return rows


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


def _measure(root: Path, ladder: Ladder, plan_: Plan, todo: list[tuple[int, int]], taken: set[str],
             out: Path) -> None:
    names: dict[str, tuple[int, int]] = {}
    for i, r in todo:
        n = 1
        while f"{EXP_PREFIX}{i:02d}-{ladder.rungs[i].slug}-{n}" in taken:
            n += 1
        name = f"{EXP_PREFIX}{i:02d}-{ladder.rungs[i].slug}-{n}"
        taken.add(name)
        names[name] = (i, r)
        experiments.queue(root, name, plan_.sets[i], "train")
    started: dict[str, float] = {}
    durations: list[float] = []

    def on_start(name: str) -> None:
        now = time.perf_counter()
        if started:
            durations.append(now - max(started.values()))
        started[name] = now
        done = len(started) - 1
        eta = f", ETA {clock(statistics.median(durations) * (len(todo) - done))}" if durations else ""
        i, r = names.get(name, (-1, 0))
        rung = ladder.rungs[i].name if i >= 0 else name
        logger.info(f"ladder: [{done + 1}/{len(todo)}] rung {i} {rung!r}, repeat {r + 1}/{plan_.profile.repeats} "
                    f"({name}){eta}")

    try:
        code = experiments.run_queue(root, on_start, out / "dvc.log")
    except KeyboardInterrupt:
        experiments.cancel(root)
        error = UserError("ladder interrupted: the queued runs were removed and the running one killed; finished "
                          "runs are kept (dvc exp show) and reused by the next `gpt2 ladder`")
        error.exit_code = 130
        raise error from None
    if code != 0:
        logger.info(f"ladder: dvc exp run --run-all exited {code}; see {out}/dvc.log")


# --------------------------------------------------------------------------- analysis


def analyse(ladder: Ladder, plan_: Plan, runs: list[list[experiments.Experiment]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    base: dict[str, Any] | None = None
    previous: dict[str, Any] | None = None
    for i, (rung, group) in enumerate(zip(ladder.rungs, runs)):
        metrics = [e.metrics[TRAIN_METRICS] for e in group]
        row: dict[str, Any] = {"index": i, "rung": rung.name, "changes": rung.changes if i else {},
                               "runs": len(metrics), "experiments": [e.name for e in group]}
        if metrics:
            step_ms = [m["perf"]["step_ms"] for m in metrics]
            tps = [m["perf"]["tokens_per_s"] for m in metrics]
            walls = [m["perf"].get("tokens_per_s_wall") for m in metrics if m["perf"].get("tokens_per_s_wall")]
            mfus = [m["perf"].get("mfu") for m in metrics if m["perf"].get("mfu") is not None]
            losses = [m["val"]["loss"] for m in metrics if m.get("val", {}).get("loss") is not None]
            runtime = (group[0].files.get(TRAIN_RUN) or {}).get("runtime") or {}
            row.update(step_ms=statistics.median(step_ms), step_ms_min=min(step_ms), step_ms_max=max(step_ms),
                       tokens_per_s=statistics.median(tps), tokens_per_s_min=min(tps), tokens_per_s_max=max(tps),
                       tokens_per_s_wall=statistics.median(walls) if walls else None,
                       peak_mem_gb=max(m["mem"]["peak_gb"] for m in metrics),
                       mfu=statistics.median(mfus) if mfus else None,
                       val_loss=statistics.median(losses) if losses else None, runtime=runtime,
                       ran=_what_ran(rung, plan_.sections[i]["train"], runtime))
            if plan_.profile.target is not None:
                row.update(_target_figures(metrics))
            base = base or (row if i == 0 else None)
            row["vs_previous"] = row["tokens_per_s"] / previous["tokens_per_s"] if previous else None
            row["cumulative"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
            if row.get("time_s"):
                row["time_speedup"] = base["time_s"] / row["time_s"] if base and base.get("time_s") else None
                row["time_vs_previous"] = (previous["time_s"] / row["time_s"] if previous and previous.get("time_s")
                                           else None)
            row["effect"] = _effect(rung, plan_.sections[i]["train"], runtime, previous) if i else "baseline"
            row["previous"] = previous["index"] if previous else None
            previous = row
        else:
            row["effect"] = "failed"
        rows.append(row)
    mark_noise(rows)
    return rows


def _target_figures(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Time (s), tokens and steps to the target over the runs that reached it; how many did."""
    reached = [m["target"] for m in metrics if (m.get("target") or {}).get("reached")]
    figures: dict[str, Any] = {"reached": len(reached)}
    if reached:
        times = [t["time_s"] for t in reached]
        figures.update(time_s=statistics.median(times), time_s_min=min(times), time_s_max=max(times),
                       tokens_to_target=statistics.median(t["tokens"] for t in reached),
                       steps_to_target=statistics.median(t["steps"] for t in reached))
    return figures


NO_EFFECT = "no effect on this device"


def mark_noise(rows: list[dict[str, Any]]) -> None:
    """Flag each rung's gain that its repeats cannot tell from noise, and measure the noise itself.

    A gain is "inside noise" when the rung's min–max interval over its repeats overlaps the rung
    above's, or when it is no larger than the largest move of a rung that changed nothing here
    (``no effect on this device``: its difference from the rung above is this machine's noise).
    The floor and the verdict go on every row (``noise``) for the report's header."""
    measured = {r["index"]: r for r in rows if r["runs"]}
    floor = max((abs(r["vs_previous"] - 1) for r in measured.values() if r["effect"] == NO_EFFECT
                 and r.get("vs_previous")), default=0.0)
    for row in measured.values():
        above = measured.get(row.get("previous"))
        row["inside_noise"] = {}
        if above is None or row["effect"] == NO_EFFECT:
            continue
        for key, ratio in (("tokens_per_s", "vs_previous"), ("time_s", "time_vs_previous")):
            if row.get(ratio) is None:
                continue
            overlap = row[f"{key}_min"] <= above[f"{key}_max"] and above[f"{key}_min"] <= row[f"{key}_max"]
            row["inside_noise"][key] = overlap or abs(row[ratio] - 1) <= floor
    for row in measured.values():
        row["noise_floor"] = floor


def noise_verdict(rows: list[dict[str, Any]], repeats: int) -> str:
    """The report's first words on noise: too noisy to read, or how noisy."""
    acting = [r for r in rows if r["runs"] and r["effect"] not in ("baseline", NO_EFFECT, "failed")]
    floor = max((r.get("noise_floor", 0.0) for r in rows if r["runs"]), default=0.0)
    noisy = [r for r in acting if r["inside_noise"].get("tokens_per_s")]
    advice = ("run it on an idle machine, with more steps per run (--steps) or more repeats (--repeats)")
    if repeats < 2:
        return f"**One run per rung: no interval, so no gain can be told from noise.** To read it, {advice}."
    if floor > 0.10 or (acting and len(noisy) > len(acting) / 2):
        return (f"**Too noisy to read:** a rung that changed nothing here moved tokens/s by {100 * floor:.0f}%, and "
                f"{len(noisy)} of {len(acting)} rungs' gains are inside the noise. To read it, {advice}.")
    shown = f"rungs that changed nothing here moved tokens/s by up to {100 * floor:.1f}%" if floor else \
        "no rung here was inert, so the noise floor is the repeats' intervals alone"
    return (f"Noise: {shown}; a gain whose min–max interval over the repeats overlaps the rung above's, or "
            f"that is no larger than that, is marked *inside noise* and not counted as a gain ({len(noisy)} of "
            f"{len(acting)} rungs).")


def _resolved(key: str, train: dict[str, Any], runtime: dict[str, Any]) -> Any:
    return runtime.get(RESOLVED[key], train[key]) if key in RESOLVED else train[key]


def _what_ran(rung: Rung, train: dict[str, Any], runtime: dict[str, Any]) -> str:
    parts = []
    for key in rung.changes:
        asked, ran = train[key], _resolved(key, train, runtime)
        parts.append(f"{key}={_fmt(asked)}" + (f" → {_fmt(ran)}" if key in RESOLVED and ran != asked else ""))
    return ", ".join(parts)


def _effect(rung: Rung, train: dict[str, Any], runtime: dict[str, Any], previous: dict[str, Any] | None) -> str:
    if previous is None:
        return "acts (rung above failed)"
    before = previous["runtime"]
    same = all(_resolved(k, train, runtime) == before.get(RESOLVED[k]) for k in rung.changes if k in RESOLVED)
    if same and all(k in RESOLVED for k in rung.changes):
        return "no effect on this device"
    return "acts"


def _fmt(value: Any) -> str:
    return json.dumps(value) if isinstance(value, bool) or value is None else str(value)


# --------------------------------------------------------------------------- reports


def table(rows: list[dict[str, Any]], steps: int, target: float | None = None) -> str:
    head = ["#", "rung", "what ran", "ms/step median (min–max)", "tokens/s median (min–max)", "wall tokens/s",
            "vs previous", "cumulative", "peak mem (GB)", "MFU",
            f"val loss after {steps} steps" if target is None else "val loss at the end", "note"]
    if target is not None:
        head[8:8] = [f"time to {target} (s)", "time speedup", "tokens to target"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        if not row["runs"]:
            cells = [str(row["index"]), row["rung"], "", "failed"] + [""] * (len(head) - 5) + ["see `dvc queue logs`"]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        noise = row.get("inside_noise") or {}
        cells = [str(row["index"]), row["rung"], row["ran"] or "baseline",
                 f"{row['step_ms']:.1f} ({row['step_ms_min']:.1f}–{row['step_ms_max']:.1f})",
                 f"{row['tokens_per_s']:,.0f} ({row['tokens_per_s_min']:,.0f}–{row['tokens_per_s_max']:,.0f})",
                 f"{row['tokens_per_s_wall']:,.0f}" if row.get("tokens_per_s_wall") else "",
                 _ratio(row.get("vs_previous"), noise.get("tokens_per_s")), _ratio(row.get("cumulative")),
                 f"{row['peak_mem_gb']:.2f}", f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "n/a",
                 f"{row['val_loss']:.3f}" if row["val_loss"] is not None else "",
                 "" if row["effect"] in ("acts", "baseline") else row["effect"]]
        if target is not None:
            reached = f"{row['time_s']:.1f} ({row['time_s_min']:.1f}–{row['time_s_max']:.1f})" if row.get("time_s") else ""
            if row["reached"] < row["runs"]:
                reached += f" reached {row['reached']}/{row['runs']}" if row["reached"] else "not reached"
            cells[8:8] = [reached.strip(), _ratio(row.get("time_speedup"), noise.get("time_s")),
                          f"{row['tokens_to_target']:,.0f}" if row.get("tokens_to_target") else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _ratio(value: float | None, inside_noise: bool = False) -> str:
    if value is None:
        return ""
    return f"{value:.2f}× (inside noise)" if inside_noise else f"{value:.2f}×"


def describe(plan_: Plan, rows: list[dict[str, Any]]) -> str:
    first = next((r for r in rows if r["runs"]), None)
    runtime = first["runtime"] if first else {}
    model, train = plan_.sections[0]["model"], plan_.sections[0]["train"]
    from gpt2.model.sizes import SIZES

    seq = train["block_size"] or model["block_size"] or SIZES[model["size"]]["block_size"]
    return (f"Device: {runtime.get('device_name', plan_.device)} ({plan_.device}), torch {runtime.get('torch', '?')}. "
            f"Model {model['size']}, micro-batch {train['micro_batch_size']} × {seq} tokens, "
            f"{plan_.profile.steps} steps per run (the first {train['timing_warmup_steps']} untimed), "
            f"{plan_.profile.repeats} run(s) per rung in alternating order; speedups compare tokens/s"
            + (f"; with a target val loss of {plan_.profile.target}, every run trains until its val loss (measured "
               f"every {train['eval_interval']} steps) reaches it, or {plan_.profile.steps} steps: time to target is "
               "wall clock from the start of the run, compile and evals included." if plan_.profile.target else "."))


def write_report(out: Path, rows: list[dict[str, Any]], plan_: Plan,
                 runs: list[list[experiments.Experiment]]) -> None:
    today = datetime.date.today().isoformat()
    text = (f"# Optimization ladder ({today})\n\n{noise_verdict(rows, plan_.profile.repeats)}\n\n{describe(plan_, rows)}"
            f"\n\n{table(rows, plan_.profile.steps, plan_.profile.target)}\n"
            "Each rung adds one change to the rung above (ladder.yaml). A rung marked \"no effect on this device\" "
            "ran the same configuration as the rung above: its difference from it is this machine's run-to-run "
            "noise, the floor under every other figure. Experiments: "
            + "; ".join(f"{row['rung']}: {', '.join(row['experiments']) or 'none'}" for row in rows)
            + ". Inspect them with `dvc exp show`.\n")
    log = out / "dvc.log"
    kept_log = log.read_bytes() if log.exists() else None
    with atomic_dir(out) as tmp:
        (tmp / "ladder.md").write_text(text)
        (tmp / "ladder.json").write_text(json.dumps({"date": today, "device": plan_.device, "rows": rows}, indent=2)
                                         + "\n")
        (tmp / "ladder.png").write_bytes(render_png(rows, describe(plan_, rows)))
        if kept_log is not None:
            (tmp / "dvc.log").write_bytes(kept_log)
    print(text, file=sys.stdout)


def render_png(rows: list[dict[str, Any]], subtitle: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r["runs"]]
    labels = [f"{r['index']} {r['rung']}" for r in done][::-1]
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 0.45 * len(done) + 1.8), dpi=100, sharey=True)
    colors = ["tab:gray" if r["effect"] == NO_EFFECT or r["inside_noise"].get("tokens_per_s") else "tab:blue"
              for r in done][::-1]  # gray: no gain that the repeats can tell from noise
    speed.barh(labels, [r["cumulative"] or 0 for r in done][::-1], color=colors)
    speed.axvline(1.0, color="black", linewidth=0.8)
    speed.set(xlabel="cumulative speedup (tokens/s vs baseline)", title="Speed")
    for y, r in enumerate(done[::-1]):
        speed.annotate(f"{r['cumulative']:.2f}×", (r["cumulative"] or 0, y), xytext=(3, 0),
                       textcoords="offset points", va="center", fontsize=8)
    memory.barh(labels, [r["peak_mem_gb"] for r in done][::-1], color="tab:orange")
    memory.set(xlabel="peak memory (GB)", title="Memory")
    fig.suptitle(subtitle, fontsize=8, wrap=True)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def log_to_mlflow(rows: list[dict[str, Any]], plan_: Plan, runs: list[list[experiments.Experiment]],
                  out: Path) -> None:
    """Tag every rung's training run with its rung; log the ladder itself as one more run."""
    from gpt2.train.tracking import MlflowTracker

    tracker = MlflowTracker(plan_.sections[0]["train"]["experiment"], run_name=f"ladder {plan_.device}")
    client = tracker.mlflow.tracking.MlflowClient()
    try:
        experiment_ids = [tracker.run.info.experiment_id]
        for row, group in zip(rows, runs):
            for exp in group:
                for found in client.search_runs(experiment_ids, f"tags.dvc_exp_name = '{exp.name}'"):
                    client.set_tag(found.info.run_id, "ladder.rung", row["rung"])
                    client.set_tag(found.info.run_id, "ladder.index", str(row["index"]))
                    client.set_tag(found.info.run_id, "ladder.run_id", tracker.run_id)
        tracker.set_tags({"kind": "ladder", "device": rows[0].get("runtime", {}).get("device_name", plan_.device)})
        tracker.log_params({"ladder.steps": plan_.profile.steps, "ladder.repeats": plan_.profile.repeats,
                            "ladder.model": plan_.sections[0]["model"]["size"], "ladder.device": plan_.device})
        for row in rows:
            if row["runs"]:
                tracker.log_metrics({"ladder/step_ms": row["step_ms"], "ladder/tokens_per_s": row["tokens_per_s"],
                                     "ladder/tokens_per_s_wall": row.get("tokens_per_s_wall"),
                                     "ladder/cumulative_speedup": row["cumulative"], "ladder/peak_mem_gb":
                                     row["peak_mem_gb"], "ladder/mfu": row["mfu"], "ladder/val_loss": row["val_loss"],
                                     "ladder/time_to_target_s": row.get("time_s"),
                                     "ladder/tokens_to_target": row.get("tokens_to_target")},
                                    step=row["index"])
        for name in ("ladder.md", "ladder.png", "ladder.json"):
            tracker.log_artifact(out / name)
        tracker.end("FINISHED")
    except BaseException:
        tracker.end("FAILED")
        raise
