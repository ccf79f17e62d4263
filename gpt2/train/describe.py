"""What a run says about itself: its start lines and warnings, its MLflow run (name, params, tags, the
dataset), and at its end the figures, the model and the reports.

``what_runs`` is the run as resolved on this device (not as asked): the start line logs it, MLflow
tags it, the summary keeps it, and the ladder reads it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import torch

from gpt2.core import log
from gpt2.core.progress import clock
from gpt2.core.config import Params, TrainConfig, to_dict
from gpt2.core.provenance import checkpoint_hashes, describe_tokens, model_tags, training_code_digest
from gpt2.model import onednn
from gpt2.run.catch_up import catch_up, replay_hint
from gpt2.run.device import sdpa_backend
from gpt2.run.figures import FEW_TIMED_STEPS, tracked_summary
from gpt2.run.names import COMPARISON_RUN_ENV, experiment_run_name, flatten, git_commit
from gpt2.run.tracking import MlflowTracker, Tracker
from gpt2.train.build import Setup
from gpt2.train.history import History
from gpt2.train.muon import FP32Muon
from gpt2.train.reports import write_reports
from gpt2.train.resume import Start

logger = log.get("train")


def announce(s: Setup) -> dict[str, Any]:
    """Log what runs, how the batch splits, and every switch that is inert here; return what runs."""
    info = what_runs(s)
    logger.info("train: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    if s.params.train.batch_tokens is not None:
        logger.info(f"train: batch of {s.tokens_per_step:,} tokens = micro-batch {s.batch.micro} × {s.seq_len} tokens "
                    f"× accumulation {s.batch.accum} × {s.dist.world} rank(s); micro-batch {s.batch.why}")
    if notes := inert_defaults(s):
        logger.info(f"train: inert on {s.runtime.device.type}, at their defaults: " + "; ".join(notes))
    for warning in inert_switch_warnings(s):
        logger.warning(warning)
    return info


def open_tracker(s: Setup, start: Start, ckpt_path: Path, report_dir: Path | None,
                 info: dict[str, Any]) -> tuple[Tracker, dict[str, Any]]:
    """The run's MLflow run (rank 0, ``train.mlflow``; else a tracker that keeps nothing), with its params, tags
    and dataset; a resumed run first sends what its earlier sessions could not. Returns it and the dataset."""
    params, cfg = s.params, s.params.train
    kept_in = f"{report_dir or 'the returned summary'} and the checkpoint's history"
    # MLflow never changes a run's params: a session that resumes with other settings records them in a run of
    # its own, which holds the whole history and links back; the earlier run says where it went on
    earlier = start.run_id if start.changes else None
    tracker: Tracker = (MlflowTracker(cfg.experiment, None if earlier else start.run_id,
                                      experiment_run_name() or run_name(s), kept_in,
                                      catch_up_hint=replay_hint(ckpt_path), run_uid=start.history.run_uid,
                                      continues=earlier, params=tracked_params(params))
                        if cfg.mlflow and s.dist.main else Tracker())
    if start.run_id is not None and isinstance(tracker, MlflowTracker):  # figures an earlier session could not send
        catch_up(tracker, dataclasses.asdict(start.history))
    tracker.log_params(tracked_params(params))
    if s.dist.nodes > 1:  # MLflow samples the machine of the process that logs
        tracker.set_tags({"system_metrics": f"node 0's only, of {s.dist.nodes}: MLflow samples the machine of rank 0, "
                                            "which logs the run"})
    tracker.set_tags({"git_commit": git_commit(), "training_code_md5": training_code_digest(),
                      "dvc_exp_name": os.environ.get("DVC_EXP_NAME"), "torch_version": torch.__version__,
                      "comparison_run": os.environ.get(COMPARISON_RUN_ENV), **info})
    if start.changes is not None:  # each resume records what it changed
        changed = "; ".join(f"train.{k}: {old} → {new}" for k, (old, new) in start.changes.items())
        tracker.set_tags({f"resume.step_{start.step}": changed or "no params changed"})
        if earlier and isinstance(tracker, MlflowTracker):
            tracker.set_tags({"resumed_from_run": earlier})
            tracker.hand_over(earlier, f"continued from step {start.step} with {changed}")
    dataset = describe_tokens(s.tokens_dir, s.meta) if tracker.run_id else {}  # no dvc.lock reading untracked
    if dataset:
        tracker.log_dataset(dataset, context="training")
    return tracker, dataset


def record_end(s: Setup, tracker: Tracker, summary: dict[str, Any], history: History, ckpt_path: Path,
               report_dir: Path | None, dataset: dict[str, Any]) -> None:
    """The finished run: compile's figures, the checkpoint as an MLflow model, the reports, the summary's figures."""
    params, cfg = s.params, s.params.train
    if complaint := s.compile_watch.complaint():
        logger.warning(complaint)
    tracker.set_tags(s.compile_watch.figures())
    if tracker.run_id and cfg.save_checkpoint and ckpt_path.is_file():  # DVC's hash: dvc exp apply finds it
        hashes = checkpoint_hashes(ckpt_path)
        tracker.set_tags(hashes)  # and an MLflow model: the summary's metrics below are its too
        tracker.log_model(f"gpt2-{params.model.size}", model_tags(ckpt_path, hashes, dataset, git_commit(),
                                                                 os.environ.get("DVC_EXP_NAME")),
                          tracked_params(params))
    if s.dist.main and report_dir is not None:
        write_reports(report_dir, summary, history)
        tracker.log_artifact(report_dir / "summary.json")
    metrics, tags = tracked_summary(summary)
    tracker.log_metrics(metrics, step=summary["steps"])
    tracker.set_tags(tags)


def closing_line(summary: dict[str, Any], first_step: int, ckpt_path: Path | None, report_dir: Path | None) -> str:
    """What the run leaves and where, in the last line it logs; a resumed run's time is this session's."""
    steps, wall = summary["steps"], clock(summary["wall_s"])
    when = (f"in {wall}" if first_step == 0 else
            f"(steps {first_step + 1} to {steps} in this session's {wall})")
    val = summary.get("val") or {}
    bpb = f" ({val['bpb']:.3f} bits per byte)" if val.get("bpb") is not None else ""  # token folders of old: none
    loss = f", val loss {val['loss']:.4f}{bpb}" if val.get("loss") is not None else ""
    model = f"the model in {ckpt_path}" if ckpt_path is not None else "no checkpoint (train.save_checkpoint: false)"
    reports = f", the reports in {report_dir}/ (metrics.json, summary.json, plots/)" if report_dir is not None else ""
    return f"train: finished {steps} steps {when}{loss}; {model}{reports}"


def tracked_params(params: Params) -> dict[str, Any]:
    """The model and train sections as MLflow params (``model.size`` …): the run's and its logged model's."""
    return flatten({"model": to_dict(params.model), "train": to_dict(params.train)})


def what_runs(s: Setup) -> dict[str, Any]:
    """What really runs, as resolved on this device: logged at start, tagged in MLflow, kept in the summary."""
    cfg = s.params.train
    backend = sdpa_backend(s.runtime, s.model_cfg.n_head, s.model_cfg.n_embd // s.model_cfg.n_head, s.seq_len)
    return {
        "device": str(s.runtime.device), "device_name": s.runtime.device_name, "dtype": s.runtime.dtype,
        "tf32": s.runtime.tf32, "compile": cfg.compile, "attention": s.model_cfg.attention,
        "residual_stream": "bf16" if s.model.residual_dtype == torch.bfloat16 else "fp32",
        "sdpa_backend": backend if s.model_cfg.attention == "flash" else "manual (no SDPA)",
        "keep_host_memory": s.runtime.keep_host_memory, "mfu_against": s.throughput.mfu_against,
        "threads": torch.get_num_threads(),
        "deterministic": cfg.deterministic, "world_size": s.dist.world, "nodes": s.dist.nodes,
        "micro_batch_size": s.batch.micro, "grad_accum_steps": s.batch.accum, "loss_chunk": s.model.head.chunk,
        "loss_kernel": cfg.loss_kernel, "cpu_gemm": cpu_gemm_ran(s),
        "fp8": f"{cfg.fp8} ({len(s.fp8_layers)} layers)" if s.fp8_layers else "off", "fp8_head": s.model.head.fp8,
        **({"distributed": s.params.train.distributed} if s.dist.grouped else {}),
        "params": s.model.num_params(), "torch": str(torch.__version__), **s.init,
        **({"muon_ns_dtype": "fp32" if isinstance(s.optimizers[0], FP32Muon) else "bf16"}
           if cfg.optimizer == "muon" else {}),
    }


def run_name(s: Setup) -> str:
    """What a run outside ``dvc exp`` is called in MLflow: what it trained, how, and when."""
    cfg = s.params.train
    switches = [s.runtime.dtype, s.model_cfg.attention] + ["compile"] * cfg.compile
    switches += [f"fp8 {cfg.fp8}"] * bool(s.fp8_layers) + ["fp8 head"] * s.model.head.fp8
    switches += ["liger loss"] * (cfg.loss_kernel == "liger")
    if s.dist.world > 1:
        switches.append(f"{cfg.distributed}×{s.dist.world}" + (f" on {s.dist.nodes} nodes" if s.dist.nodes > 1 else ""))
    length = f"{s.total_steps} steps" if s.total_steps else f"{cfg.time_budget_s:g} s"
    return f"{s.params.model.size} {length} {' '.join(switches)} {time.strftime('%m-%d %H:%M')}"


def cpu_gemm_ran(s: Setup) -> str:
    return onednn.what_ran(s.model.head.gemm, s.runtime.device.type, s.params.train.compile, s.runtime.dtype)


CPU_MICRO_BATCHES_WARNING = 64  # micro-batches per step that make a CPU step last minutes


def inert_defaults(s: Setup) -> list[str]:
    """The defaults chosen for a GPU that do nothing on this device. They are said once, not warned: a warning
    in every default run teaches a user to skip warnings."""
    cfg, device = s.params.train, s.runtime.device.type
    notes = ["train.tf32 (TF32 is a CUDA matmul mode)"] * (cfg.tf32 and device != "cuda")
    notes += ["the pinned memory and non_blocking copies of train.batching vectorized (CUDA's)"] * (
        cfg.batching == "vectorized" and device != "cuda")
    return notes


def inert_switch_warnings(s: Setup) -> list[str]:
    """A warning for each switch set that does nothing here, and for settings that make a run other than it looks."""
    cfg, device = s.params.train, s.runtime.device.type
    warnings = list(s.runtime.warnings)
    if s.model_cfg.attention == "manual" and cfg.sdpa_backend != "auto":
        warnings.append(f"train.sdpa_backend {cfg.sdpa_backend} is inert: model.attention is manual (no SDPA)")
    if cfg.lr_schedule == "constant" and cfg.min_lr != TrainConfig.min_lr:
        warnings.append(f"train.min_lr {cfg.min_lr} is inert: train.lr_schedule is constant (no decay)")
    if cfg.residual_stream == "bf16" and s.runtime.dtype != "bf16":
        warnings.append(f"train.residual_stream bf16 is inert: the run computes in {s.runtime.dtype}, not bf16")
    if s.fp8_layers and device != "cuda":
        warnings.append(f"train.fp8 {cfg.fp8} is emulated on {device}: FP8's numerics at a loss of speed (FP8 tensor "
                        "cores are CUDA's)")
    if s.model.head.fp8 and device != "cuda":
        warnings.append(f"train.fp8_head runs on {device} through oneDNN's FP8 matmul: FP8's numerics at a loss of "
                        "speed (FP8 tensor cores are CUDA's)")
    if not cfg.compile and cfg.compile_mode != "default":
        warnings.append(f"train.compile_mode {cfg.compile_mode} is inert: train.compile is false")
    if cfg.compile_tuning and not (cfg.compile and device == "cuda"):
        warnings.append("train.compile_tuning is inert: it tunes the compiled Triton kernels of a CUDA run"
                        + ("" if cfg.compile else ", and train.compile is false"))
    elif cfg.compile_tuning and cfg.compile_mode.startswith("max-autotune"):
        warnings.append(f"train.compile_tuning is inert: train.compile_mode {cfg.compile_mode} tunes already")
    if cfg.compile and device != "cuda" and cfg.compile_mode in ("reduce-overhead",):
        warnings.append("train.compile_mode reduce-overhead uses CUDA graphs: inert on this device")
    if cfg.cpu_gemm == "onednn" and cpu_gemm_ran(s) != "onednn":
        why = (f"it picks a CPU's matmul library, and this run is on {device}" if device != "cpu"
               else "the compiled step runs Inductor's matmuls" if cfg.compile
               else f"under {s.runtime.dtype} autocast PyTorch picks the matmul kernels")
        warnings.append(f"train.cpu_gemm onednn is inert: {why} (oneDNN's path is for eager fp32 code on a CPU)")
    micro_batches = s.batch.accum * s.dist.world
    if device != "cuda" and micro_batches >= CPU_MICRO_BATCHES_WARNING:
        warnings.append(f"one step is {micro_batches} micro-batches of {s.batch.micro} × {s.seq_len} tokens "
                        f"({s.tokens_per_step:,} tokens) on {device}: each step takes {micro_batches} times a "
                        "micro-batch's time (minutes for GPT-2's 0.5M batch on a laptop), and Ctrl-C waits for the "
                        "step to end; that batch is meant for GPUs: lower train.batch_tokens here")
    if s.total_steps is not None and s.total_steps < cfg.warmup_steps:  # equal: its last step trains at train.lr
        warnings.append(f"the run is {s.total_steps} steps and train.warmup_steps is {cfg.warmup_steps}: the "
                        "learning rate is still warming up when the run ends (it never reaches train.lr); lower "
                        f"train.warmup_steps (e.g. {max(1, s.total_steps // 10)}) or train longer")
    timed = None if s.total_steps is None else s.total_steps - cfg.timing_warmup_steps
    if timed is not None and 0 < s.total_steps and timed < FEW_TIMED_STEPS:
        warnings.append(f"the run is {s.total_steps} steps and its first {cfg.timing_warmup_steps} "
                        "(train.timing_warmup_steps: compilation, autotuning) are left out of its speed: "
                        + (f"its medians rest on {timed} step(s)" if timed > 0 else
                           "no step is timed, so its speed figures include that warm-up")
                        + f"; time at least {FEW_TIMED_STEPS} steps (train longer) before comparing its speed")
    if s.throughput.peak_flops is None:
        warnings.append(f"no peak FLOP/s known for {s.runtime.device_name!r}: MFU is not reported; set "
                        "train.peak_tflops (its dense bf16 peak) to get it")
    return warnings
