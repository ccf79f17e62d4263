"""The ladder file (``ladder.yaml``), resolved on a device: each rung's full params there."""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpt2.core.config import MOVED, ModelParams, ParamError, TrainConfig, build, read_yaml, to_dict
from gpt2.core.schema import param
from gpt2.core.errors import UserError

EXP_PREFIX = "ladder-"


DEVICES = ("cpu", "cuda", "mps")


@dataclass(frozen=True)
class Rung:
    name: str
    changes: dict[str, Any]  # train keys (and model.* keys) this rung sets; the baseline's are all of its settings
    carry: tuple[str, ...] = DEVICES  # where the rungs below take its change; elsewhere it is measured beside them

    def carries(self, device: str) -> bool:
        return device in self.carry

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")


@dataclass(frozen=True)
class Runs:
    """How long and how often a profile's runs go: checked by the engine that checks params.yaml."""

    steps: int = param(20, "training steps per run (the cap, with a target)", ge=1, le=10**9)
    repeats: int = param(2, "runs per rung, in alternating order", ge=1, le=1000)
    target_batch_tokens: int = param(0, "the batch the grad accumulation rung accumulates to", ge=0)
    target: float | None = param(None, "a val loss every run trains to; the table gains time to target", gt=0)


@dataclass(frozen=True)
class Profile(Runs):
    """What the ladder trains on one kind of device: its runs, and the model and train keys it sets."""

    model: dict[str, Any] = dataclasses.field(default_factory=dict)
    train: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class Ladder:
    rungs: tuple[Rung, ...]  # rungs[0] is the baseline
    profiles: dict[str, Profile]
    source: str = "ladder.yaml"  # the file it was read from, which its report names


@dataclass(frozen=True)
class Resolved:
    """The rungs' full params for this device and the overrides that make each experiment."""

    device: str  # cpu | cuda | mps
    profile: Profile
    sections: list[dict[str, dict[str, Any]]]  # per rung: normalized {"model": ..., "train": ...}
    sets: list[dict[str, Any]]  # per rung: dotted key -> value, for dvc exp run -S
    cannot_show: list[str | None] = dataclasses.field(default_factory=list)  # per rung: why it cannot act here


def load_ladder(path: str | Path) -> Ladder:
    data = read_yaml(path, "ladder", "--ladder")
    where = str(path)
    _keys(data, {"baseline", "rungs", "profiles"}, where)
    baseline = _changes(data.get("baseline"), f"{where}: baseline")
    rungs = [Rung("baseline", baseline)]
    for i, item in enumerate(data.get("rungs") or []):
        _keys(item, {"name", "set", "carry"}, f"{where}: rungs[{i}]")
        name = item.get("name")
        if not isinstance(name, str) or not name.strip():
            raise UserError(f"{where}: rungs[{i}] needs a name")
        changes = _changes(item.get("set"), f"{where}: rung {name!r}")
        if not changes:
            raise UserError(f"{where}: rung {name!r} changes nothing; give it a `set` of train (or model.*) keys")
        rungs.append(Rung(name, changes, _carry(item.get("carry", True), f"{where}: rung {name!r}")))
    slugs = [r.slug for r in rungs]
    if len(set(slugs)) != len(slugs):
        raise UserError(f"{where}: two rungs have the same name: {', '.join(slugs)}")
    profiles = {}
    for device, raw in (data.get("profiles") or {}).items():
        at = f"profiles.{device}"
        if not isinstance(raw, dict):
            raise UserError(f"{where}: {at} must be a mapping, got {raw!r}")
        try:
            runs = build(Runs, {k: v for k, v in raw.items() if k not in ("model", "train")}, at)
        except ParamError as exc:
            raise UserError(f"{where}: {str(exc).removeprefix('params: ')}") from None
        profiles[str(device)] = Profile(model=raw.get("model") or {}, train=raw.get("train") or {},
                                        **dataclasses.asdict(runs))
    if "cpu" not in profiles:
        raise UserError(f"{where}: needs at least a `profiles.cpu` entry (also used for mps)")
    return Ladder(tuple(rungs), profiles, str(path))


def _keys(data: Any, allowed: set[str], where: str) -> None:
    if not isinstance(data, dict):
        raise UserError(f"{where} must be a mapping, got {data!r}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}")


def _carry(value: Any, where: str) -> tuple[str, ...]:
    """A rung's ``carry``: true (the default: every device), false (measured beside the ladder everywhere), or
    the devices whose rungs below take its change."""
    if isinstance(value, bool):
        return DEVICES if value else ()
    if isinstance(value, list) and all(device in DEVICES for device in value):
        return tuple(value)
    raise UserError(f"{where}: carry must be true, false or a list of devices ({', '.join(DEVICES)}), got {value!r}")


def _changes(data: Any, where: str) -> dict[str, Any]:
    """A rung's changes: params.yaml train keys as they are, model keys with their section (``model.attention``)."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{where} must be a mapping of train keys, got {data!r}")
    fields = ({f.name for f in dataclasses.fields(TrainConfig)}
              | {f"model.{f.name}" for f in dataclasses.fields(ModelParams)})
    for key in data:
        if key not in fields:
            moved = MOVED.get(f"train.{key}")
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; train.{key} {moved}" if moved else f"; did you mean {close[0]!r}?" if close else ""
            raise UserError(f"{where}: {key!r} is not a params.yaml train key{hint}")
    return dict(data)


def flat(sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A rung's params keyed as its changes are: train keys bare, model keys as ``model.<key>``."""
    return {**{f"model.{k}": v for k, v in sections["model"].items()}, **sections["train"]}


def resolve(ladder: Ladder, raw_params: dict[str, Any], device: str, model: str | None = None,
            steps: int | None = None, repeats: int | None = None, mlflow: bool | None = None,
            target: float | None = None, time_budget_s: float | None = None) -> Resolved:
    """Each rung's complete model and train params on ``device`` (cpu, cuda or mps), validated.

    Every run measures its val loss every ``steps // 6`` steps and at its end, a curve to read at the baseline's final
    val loss. With a target val loss, ``steps`` is the cap, the val loss is measured 20 times over it
    (over params.yaml's ``eval_windows``, not the profile's), and a run stops at the first measurement
    at or below the target. With a time budget every run trains that long instead of ``steps`` (which
    then only spaces the evals)."""
    profile = ladder.profiles.get(device) or ladder.profiles["cpu"]
    profile = dataclasses.replace(profile, steps=steps or profile.steps, repeats=repeats or profile.repeats,
                                  target=target or profile.target)
    model_set = {**profile.model, **({"size": model} if model else {})}
    fixed = {**profile.train, "device": device, "max_steps": None if time_budget_s else profile.steps,
             "max_tokens": None, "time_budget_s": time_budget_s,
             "batch_tokens": None,  # the rungs set the batch as micro-batch × accumulation (its own rung)
             "eval_interval": max(1, profile.steps // (20 if profile.target else 6)),
             "checkpoint_interval": profile.steps, "save_checkpoint": False, "resume": "never",
             "log_interval": max(1, profile.steps // 5), "target_val_loss": profile.target, "stop_at_target": True}
    if profile.target:  # the val figure at the size whose noise was measured (params.yaml), not the profile's glance
        fixed["eval_windows"] = (raw_params.get("train") or {}).get("eval_windows", TrainConfig.eval_windows)
    if mlflow is not None:
        fixed["mlflow"] = mlflow
    sections, sets, unshown, carried, base = [], [], [], {}, None
    for i, rung in enumerate(ladder.rungs):
        changes = {**carried, **rung.changes}
        train_set = {**fixed, **{k: v for k, v in changes.items() if not k.startswith("model.")}}
        rung_model = {**model_set,
                      **{k.removeprefix("model."): v for k, v in changes.items() if k.startswith("model.")}}
        if train_set.get("grad_accum_steps") == "target":
            train_set["grad_accum_steps"] = _accumulation(raw_params, rung_model, train_set, profile)
        where = f"ladder rung {rung.name!r}"
        try:
            model_cfg = build(ModelParams, {**(raw_params.get("model") or {}), **rung_model}, "model")
            train_cfg = build(TrainConfig, {**(raw_params.get("train") or {}), **train_set}, "train")
        except ParamError as exc:
            raise UserError(f"{where}: {str(exc).removeprefix('params: ')}") from None
        section = {"model": to_dict(model_cfg), "train": to_dict(train_cfg)}
        # the rung this one builds on: the last above it that runs here and carries. A rung this device cannot
        # show is not run, so its change (a CUDA-only kernel, say) must not reach the rungs below it either;
        # nor does the change of a rung measured beside the ladder (`carry`: a lever tried alone)
        unshown.append(cannot_show(rung, flat(sections[base]), flat(section), device) if base is not None else None)
        if rung.carries(device) and not unshown[-1]:
            carried, base = changes, i
        sections.append(section)
        sets.append({**{f"model.{k}": v for k, v in rung_model.items()},
                     **{f"train.{k}": v for k, v in train_set.items()}})
    return Resolved(device=device, profile=profile, sections=sections, sets=sets, cannot_show=unshown)


def cannot_show(rung: Rung, before: dict[str, Any], after: dict[str, Any], device: str) -> str | None:
    """Why ``rung`` cannot act on ``device``, known before it runs: every change it makes resolves to
    what the rung above already ran there. None when it can act (or when that is only known by running it)."""
    reasons = []
    for key in rung.changes:
        if before[key] == after[key]:
            continue
        if key == "tf32" and device != "cuda":
            reasons.append("TF32 is a CUDA (Ampere+) matmul mode")
        elif (key == "dtype" and device != "cuda"
              and {_dtype_on_cpu(before[key]), _dtype_on_cpu(after[key])} == {"fp32"}):
            reasons.append("AMP's dtype auto is fp32 off CUDA (bf16 is emulated on most CPUs)")
        elif key == "compile" and device == "cpu" and after[key] and not _cxx_compiler():
            reasons.append("torch.compile needs a C++ compiler on a CPU and none is installed")
        elif key == "sdpa_backend" and device != "cuda" and after[key] in ("cudnn", "efficient"):
            reasons.append(f"{after[key]} attention is a CUDA kernel")
        elif key == "residual_stream" and (device != "cuda" and _dtype_on_cpu(after["dtype"]) != "bf16"
                                           or after["dtype"] == "fp32"):
            reasons.append("the residual stream is bf16 only under bf16 autocast, and this run computes in fp32")
        elif key == "fp8" and device != "cuda":
            reasons.append("FP8 tensor cores are CUDA's (a CPU emulates FP8: its numerics, slower)")
        elif key == "fp8" and after[key] in ("tensorwise", "rowwise") and not _installed("torchao"):
            reasons.append("torchao is not installed (pip install torchao)")
        elif key == "fp8_head" and device != "cuda":
            reasons.append("FP8 tensor cores are CUDA's (a CPU runs FP8 matmuls through oneDNN: their numerics, "
                           "slower)")
        elif key == "cpu_gemm" and device != "cpu":
            reasons.append("train.cpu_gemm picks a CPU's matmul library")
        elif key == "loss_kernel" and device != "cuda":
            reasons.append("Liger's fused loss is Triton kernels, CUDA only")
        elif key == "loss_kernel" and not _installed("liger_kernel"):
            reasons.append("liger-kernel is not installed (pip install liger-kernel)")
        elif key in ("compile_mode", "compile_tuning") and not after["compile"]:
            reasons.append("train.compile is off")
        elif key == "compile_tuning" and device != "cuda":
            reasons.append("coordinate-descent tuning tunes Inductor's Triton kernels, CUDA's")
        elif key == "compile_mode" and device != "cuda" and after[key] in ("max-autotune", "reduce-overhead"):
            reasons.append("CUDA graphs exist on CUDA only")
        else:
            return None
    return "; ".join(reasons) or "it changes nothing from the rung above"


def _installed(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def _dtype_on_cpu(dtype: str) -> str:
    return "fp32" if dtype == "auto" else dtype


def _cxx_compiler() -> str | None:
    import os
    import shutil

    compilers = (os.environ.get("CXX", ""), "g++", "clang++", "c++")
    return next(filter(None, (shutil.which(c) for c in compilers if c)), None)


def _accumulation(raw: dict[str, Any], model_set: dict[str, Any], train_set: dict[str, Any], profile: Profile) -> int:
    """``grad_accum_steps: target``: the micro-batches nearest the profile's target_batch_tokens (at least 2,
    so the rung always accumulates, also when ``--model`` makes one micro-batch larger than the target)."""
    from gpt2.core.sizes import sequence_length

    model = {**(raw.get("model") or {}), **model_set}
    train = {**(raw.get("train") or {}), **train_set}
    seq = sequence_length(model.get("size", "tiny"), model.get("block_size"), train.get("block_size"))
    micro = train.get("micro_batch_size", TrainConfig.micro_batch_size) * seq
    return max(2, round(profile.target_batch_tokens / micro))
