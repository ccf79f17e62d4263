"""Compute-budget plan: parameters, FLOPs, memory, the largest micro-batch that fits, time and cost.

The memory model is gpt2/core/memory.py's (training sizes its micro-batch with it too).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpt2.core import paths
from gpt2.core.config import TrainConfig
from gpt2.core.errors import UserError
from gpt2.core.memory_model import GPU_CHUNK_ROWS, HEADROOM, largest_micro_batch, memory, shape
from gpt2.core.sizes import SIZES
from gpt2.run.cost import ASSUMED_PRICE_PER_HOUR
from gpt2.run.flops import PEAK_TFLOPS, device_key, flops_per_token


@dataclass(frozen=True)
class Device:
    name: str  # as in the PEAK_TFLOPS table (a substring of torch's device name)
    memory_gb: float
    price_per_hour: float  # assumed on-demand USD per GPU-hour; --price-per-hour sets yours


def _device(name: str, memory_gb: float, price: float | None = None) -> Device:
    return Device(name, memory_gb, ASSUMED_PRICE_PER_HOUR[name] if price is None else price)


GPT2_BATCH_TOKENS = 524_288  # GPT-2's 0.5 M tokens per step
GPU_MICRO_BATCH = 16  # the plan's micro-batch on a GPU unless --micro-batch says otherwise

DEVICES: dict[str, Device] = {
    "h100": _device("H100", 80),
    "h100-pcie": _device("H100 PCIe", 80),
    "h100-nvl": _device("H100 NVL", 94),
    "h200": _device("H200", 141),
    "h200-nvl": _device("H200 NVL", 141),
    "b200": _device("B200", 180),
    "l40s": _device("L40S", 48),
    "a100": _device("A100", 80),
    "a100-40gb": _device("A100", 40, 1.20),
    "l4": _device("L4", 24),
    "v100": _device("V100", 32),
    "cpu": Device("cpu", 0, 0.0),  # memory: this machine's RAM; peak FLOP/s: --peak-tflops
}


def measured_mfu(device: Device, size: str, root: Path, dtype: str = "bf16") -> tuple[float, str] | None:
    """MFU measured on ``device`` at model ``size``, against the peak the plan divides by (``dtype``'s): this
    project's ladder report first, then MLflow's training runs, then the GPU check's figures committed with the
    code. A ladder's MFU is against the bf16 yardstick (where the device has one): used for bf16 plans only."""
    ladder = root / paths.LADDER_REPORTS / "ladder.json"
    data = json.loads(ladder.read_text()) if ladder.is_file() and dtype == "bf16" else {}
    if data.get("model") == size:  # a ladder.json of before 2026-12-02 does not say its model: not used
        rows = [r for r in data.get("rows", []) if r.get("mfu")]
        rows = [r for r in rows if _same_device((r.get("runtime") or {}).get("device_name", ""), device,
                                                (r.get("runtime") or {}).get("device", ""))]
        if rows:
            last = rows[-1]
            rung = last.get("label", last.get("rung"))  # "rung": a ladder.json written before the rows were arms
            return last["mfu"], f"measured: {ladder} (rung {rung!r}, {last['runtime']['device_name']})"
    return _mlflow_mfu(device, size, root, dtype) or (_gpu_check_mfu(device, size, root) if dtype == "bf16" else None)


# The GPU check's row nearest to a real GPT-2 run: GPT-2's batch, docs/gpu.md's switches, evals and checkpoints
GPU_CHECK_RESULTS, GPU_CHECK_RUN = "benchmarks/results", ", GPT-2 batch, evals and checkpoints"


def _gpu_check_mfu(device: Device, size: str, root: Path) -> tuple[float, str] | None:
    """The committed GPU check's MFU for GPT-2 124M on this card (benchmarks/results): its row of 100 steps at
    GPT-2's batch, the nearest it has to the run being planned. Other sizes and cards: None."""
    if size != "gpt2":
        return None
    for path in sorted((root / GPU_CHECK_RESULTS).glob("gpu_check*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not _same_device(str(data.get("device", "")), device):
            continue
        for row in data.get("rows", []):
            if GPU_CHECK_RUN in str(row.get("name", "")) and row.get("mfu") and "failed" not in row:
                return row["mfu"], (f"measured by the GPU check on an {data['device']}, {data.get('date', '')}: "
                                    f"{row['name']} ({GPU_CHECK_RESULTS}/{path.name})")
    return None


def _same_device(name: str, device: Device, kind: str = "") -> bool:
    """A run on device ``name`` (torch's name for it) of kind ``kind`` (``cpu``, ``cuda:0``) ran on ``device``: a
    GPU whose peak table key is ``device.name``, or, for ``cpu``, this machine's CPU."""
    if device.name == "cpu":
        return kind == "cpu"
    return device_key(name) == device.name


MFU_METRICS = ("MFU", "summary/perf.mfu")  # a finished run's MFU in MLflow, and its name before 2026-11-28
OWN_DTYPE_MFU = "perf/mfu_dtype"  # the MFU against the run's own dtype's peak, where it is not the bf16 yardstick
STEP_MFU = "perf/mfu"  # a logged step's MFU against the yardstick: MLflow's last value, as of OWN_DTYPE_MFU


def _own_dtype_mfu(mfu: float | None, own_last: float | None, mfu_last: float | None) -> float | None:
    """A finished run's MFU against its own dtype's peak: its median MFU (against the yardstick) times the two
    peaks' ratio, which any logged step shows (``own_last / mfu_last``). MLflow's search gives a step figure's last
    value, one step's, not the median. That last value where the ratio cannot be read; ``mfu`` where the run logged
    none (its dtype's peak is the yardstick)."""
    if own_last is None or math.isnan(own_last):
        return mfu
    if mfu and not math.isnan(mfu) and mfu_last and not math.isnan(mfu_last):
        return mfu * own_last / mfu_last
    return own_last


def _mlflow_mfu(device: Device, size: str, root: Path, dtype: str = "bf16") -> tuple[float, str] | None:
    db = root / paths.MLFLOW_DB
    keys = [key for key in MFU_METRICS if db.is_file() and _has_metric(db, key)]
    if not keys:
        return None  # no MFU was ever logged there: no need to import mlflow (seconds)
    try:
        import mlflow

        from gpt2.run.mlflow_store import older_store
    except ImportError:
        return None
    if older_store(db):
        return None  # opening it would upgrade a store an older MLflow made: a plan only reads
    mlflow.set_tracking_uri(f"sqlite:///{db}")
    try:
        runs = mlflow.search_runs(search_all_experiments=True, filter_string="attributes.status = 'FINISHED'",
                                  order_by=["attributes.start_time DESC"], max_results=500)
    except Exception:  # an unreadable or foreign store: no measurement, not a failure of the plan
        return None
    if runs.empty or not any(f"metrics.{key}" in runs for key in keys):
        return None
    for _, run in runs.iterrows():
        mfu = next((value for key in keys if (value := run.get(f"metrics.{key}")) and not math.isnan(value)), None)
        own = run.get(f"metrics.{OWN_DTYPE_MFU}")  # where the yardstick (bf16) is not the run's dtype's peak
        if dtype != "bf16":  # the plan divides by its dtype's peak: the MFU a run of that dtype measured against it
            if run.get("tags.dtype") != dtype or (device.name != "cpu" and run.get("params.train.tf32") == "False"):
                continue  # another dtype's, or an fp32 GPU run against the fp32 peak where the plan divides by TF32's
            mfu = _own_dtype_mfu(mfu, own, run.get(f"metrics.{STEP_MFU}"))
        name, kind = str(run.get("tags.device_name") or ""), str(run.get("tags.device") or "")
        if mfu and not math.isnan(mfu) and run.get("params.model.size") == size and _same_device(name, device, kind):
            ran = f" {run.get('tags.dtype')}" if isinstance(run.get("tags.dtype"), str) else ""
            return float(mfu), f"measured: MLflow run {run['run_id']} ({size}{ran} on {name})"
    return None


def _has_metric(db: Path, key: str) -> bool:
    """A cheap look into MLflow's SQLite store; True when unsure, so MLflow itself decides."""
    import sqlite3

    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as connection:
            return connection.execute("SELECT 1 FROM metrics WHERE key = ? LIMIT 1", (key,)).fetchone() is not None
    except sqlite3.Error:
        return True


def plan(size: str, tokens: float, device: str, micro_batch: int | None = None, seq_len: int | None = None,
         gpus: int = 1, dtype: str | None = None, attention: str = "flash", mfu: float | None = None,
         price_per_hour: float | None = None, memory_gb: float | None = None, peak_tflops: float | None = None,
         root: Path = Path("."), loss_chunk: int | None = None, optimizer: str = "adamw",
         distributed: str = "ddp", batch_tokens: int = GPT2_BATCH_TOKENS, fp8_head: bool = False) -> dict[str, Any]:
    """Everything ``gpt2 plan`` prints, as a dict; memory per GPU (``distributed`` fsdp: sharded over ``gpus``).

    Left out, the micro-batch and the loss's chunk are training's defaults on that device: 16 sequences and
    8192 positions on a GPU; on a CPU the default micro-batch (8) and ``loss_chunk: auto`` as this CPU resolves it."""
    if device not in DEVICES:
        raise UserError(f"unknown device {device!r}; one of {', '.join(DEVICES)}")
    dev, cpu = DEVICES[device], device == "cpu"
    dtype = dtype or ("fp32" if cpu else "bf16")
    s = shape(size)
    micro_batch = micro_batch or (TrainConfig.micro_batch_size if cpu else GPU_MICRO_BATCH)
    loss_chunk = (_cpu_chunk(s.padded_vocab) if cpu else GPU_CHUNK_ROWS) if loss_chunk is None else loss_chunk
    seq = seq_len or SIZES[size]["block_size"]
    if seq > SIZES[size]["block_size"]:
        raise UserError(f"--seq-len {seq} exceeds {size}'s context {SIZES[size]['block_size']}")
    dense, attn = flops_per_token(s.params_without_wpe, s.n_layer, s.n_embd, seq)
    total_flops = (dense + attn) * tokens
    mem_gb = memory_gb or dev.memory_gb or _ram_gb()
    shards = gpus if distributed == "fsdp" else 1
    variants = {f"{'amp' if a else 'fp32'} {'flash' if f else 'manual'}":
                memory(s, micro_batch, seq, a, f, loss_chunk, optimizer, shards, fp8_head)
                for a in (False, True) for f in (False, True)}
    fits = {name: largest_micro_batch(s, seq, "amp" in name, "flash" in name, mem_gb, loss_chunk, optimizer, shards,
                                      fp8_head) for name in variants}
    peak, peak_source = _peak(dev, dtype, peak_tflops)
    chosen = f"{'fp32' if dtype == 'fp32' else 'amp'} {attention}"
    step = _step(batch_tokens, seq, gpus, TrainConfig.micro_batch_size if cpu else fits[chosen])
    used_mfu, source = ((mfu, "given (--mfu)") if mfu is not None else measured_mfu(dev, size, root, dtype)
                        or (0.40, "assumed: no measurement on this device found; --mfu sets it"))
    seconds = total_flops / (peak * used_mfu * gpus) if peak else None
    price = price_per_hour if price_per_hour is not None else dev.price_per_hour
    return {
        "model": size, "params": s.params, "params_without_wpe": s.params_without_wpe, "seq_len": seq,
        "tokens": tokens, "flops_per_token": {"dense_6N": dense, "attention": attn, "total": dense + attn},
        "total_flops": total_flops, "device": dev.name, "cpu": cpu, "gpus": gpus, "memory_gb": mem_gb, "dtype": dtype,
        "attention": attention, "micro_batch": micro_batch, "loss_chunk": loss_chunk, "optimizer": optimizer,
        "fp8_head": fp8_head,
        "distributed": distributed if gpus > 1 or distributed == "fsdp" else "off",
        "memory": {name: {**asdict(m), "total": m.total} for name, m in variants.items()},
        "largest_micro_batch": fits, "chosen": chosen, "fits": variants[chosen].total <= HEADROOM * mem_gb * 1e9,
        "usable_gb": HEADROOM * mem_gb, "batch_tokens": batch_tokens, "step": step,
        "peak_tflops": peak / 1e12, "peak_source": peak_source, "mfu": used_mfu, "mfu_source": source,
        "hours": seconds / 3600 if seconds else None, "price_per_hour": price,
        "price_source": "given (--price-per-hour)" if price_per_hour is not None else "assumed on-demand price",
        "cost": seconds / 3600 * gpus * price if seconds else None,
    }


def _step(batch_tokens: int, seq: int, gpus: int, largest: int) -> dict[str, Any]:
    """The micro-batch × accumulation that ``train.micro_batch_size: auto`` picks for ``batch_tokens``: the
    largest divisor of the sequences per GPU up to ``largest`` (on a GPU what fits; on a CPU, with no free memory
    to size against, the default micro-batch, whatever the RAM holds; gpt2/train/batch.py)."""
    per_gpu, rest = divmod(batch_tokens, seq * gpus)
    if rest or per_gpu == 0:
        return {"sequences_per_gpu": None, "unit": seq * gpus}
    micro = next((d for d in range(min(per_gpu, largest), 0, -1) if per_gpu % d == 0), 0)
    return {"sequences_per_gpu": per_gpu, "micro_batch": micro, "grad_accum_steps": per_gpu // micro if micro else None}


def _peak(dev: Device, dtype: str, given_tflops: float | None) -> tuple[float, str]:
    """The device's peak FLOP/s for ``dtype`` and where the figure comes from: given, the card's datasheet, or
    this CPU's measured peak."""
    if given_tflops:
        return given_tflops * 1e12, "given (--peak-tflops)"
    if dev.name == "cpu":
        return _cpu_peak(dtype)
    return PEAK_TFLOPS.get(dev.name, {}).get("tf32" if dtype == "fp32" else dtype, 0.0) * 1e12, "the card's datasheet"


def _cpu_chunk(vocab: int) -> int:
    """``train.loss_chunk: auto`` on this CPU (it depends on the vendor)."""
    from gpt2.model.loss import chunk_rows

    return chunk_rows("auto", "cpu", vocab)


def _cpu_peak(dtype: str) -> tuple[float, str]:
    """This CPU's matmul peak as training measures it (kept by ``gpt2 peak``; measured now if none is kept)."""
    from gpt2.run.peak import cache_path, cpu_peaks

    peaks, measured_now = cpu_peaks()
    flops = (peaks or {}).get("bf16" if dtype == "bf16" else "fp32")
    if not flops:
        return 0.0, f"no {dtype} peak: this CPU has no native {dtype} matmul"
    return float(flops), "measured here now" if measured_now else f"measured here before ({cache_path()})"


def _ram_gb() -> float:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def render(p: dict[str, Any]) -> str:
    gb = 1e9
    chosen = p["chosen"]
    f = p["flops_per_token"]
    unit, overhead = ("process", "the OS and other programs") if p["cpu"] else ("GPU", "the CUDA context")
    peak = (f"{p['peak_tflops']:.3g} TFLOP/s {p['dtype']} peak, {p['peak_source']}" if p["peak_tflops"]
            else f"{p['dtype']}, peak unknown")
    lines = [
        f"Plan: {p['model']} on {p['gpus']} × {p['device']} ({p['memory_gb']:.0f} GB{' RAM' if p['cpu'] else ''}, "
        f"{peak}), {p['tokens']:.3g} tokens at T={p['seq_len']}",
        "",
        f"parameters        {p['params']:,} ({p['params_without_wpe']:,} without position embeddings)",
        f"FLOPs per token   6·N = {f['dense_6N'] / 1e6:,.0f}M + attention 12·L·h·T = {f['attention'] / 1e6:,.0f}M "
        f"= {f['total'] / 1e6:,.0f}M (forward + backward)",
        f"total FLOPs       {p['total_flops']:.3e}",
        "",
        f"memory per {unit} (GB), micro-batch {p['micro_batch']} × {p['seq_len']}, {p['optimizer']}, "
        + (f"fsdp over {p['gpus']}, " if p["distributed"] == "fsdp" else "")
        + ("FP8 head, " if p["fp8_head"] else "")
        + (f"loss in chunks of {p['loss_chunk']} positions:" if p["loss_chunk"] else "plain loss (whole logits):"),
        "                  " + "".join(f"{name:>14}" for name in p["memory"]),
    ]
    parts = ["weights", "gradients", "optimizer", "weight_casts", "activations", "logits", "total"]
    if p["distributed"] == "fsdp":
        parts.insert(4, "unsharded")
    for part in parts:
        lines.append(f"  {part:<16}" + "".join(f"{m[part] / gb:>14.2f}" for m in p["memory"].values()))
    lines.append(f"  {'largest batch':<16}" + "".join(f"{p['largest_micro_batch'][k]:>14}" for k in p["memory"]))
    lines += [
        "  (eager estimate, see gpt2/core/memory_model.py; compiled GPT-2 runs peaked 17% under it at micro-batch 64 "
        f"and 4% over at 256; 10% of memory left for {overhead})",
        "",
        f"largest micro-batch that fits ({chosen}): {p['largest_micro_batch'][chosen]}",
    ]
    if not p["fits"]:
        total = p["memory"][chosen]["total"] / gb
        lines.append(f"micro-batch {p['micro_batch']} does NOT fit ({chosen}): {total:.1f} GB of the "
                     f"{p['usable_gb']:.1f} GB usable per {unit}")
    step = p["step"]
    if step["sequences_per_gpu"] is None:
        lines.append(f"a step of {p['batch_tokens']:,} tokens is not whole sequences on every {unit}: "
                     f"--batch-tokens must be a multiple of {step['unit']:,}")
    elif step["micro_batch"]:
        lines.append(f"a step of {p['batch_tokens']:,} tokens ({step['sequences_per_gpu']} sequences per {unit}): "
                     f"train.micro_batch_size {step['micro_batch']} × train.grad_accum_steps "
                     f"{step['grad_accum_steps']} (what micro_batch_size: auto picks: " + (
                         f"on a CPU, with no free memory to size against, {TrainConfig.micro_batch_size} or its "
                         "largest divisor)" if p["cpu"] else "the largest divisor that fits)"))
    else:
        lines.append(f"a step of {p['batch_tokens']:,} tokens: not even one sequence fits per {unit}; shard the "
                     "model (--distributed fsdp over more --gpus), use bf16 or a shorter --seq-len")
    lines.append(f"MFU               {100 * p['mfu']:.1f}% ({p['mfu_source']})")
    if p["hours"] is not None:
        lines.append(f"time              {p['hours']:,.1f} h on {p['gpus']} × {p['device']} "
                     f"({p['hours'] / 24:,.2f} days)")
        if p["price_per_hour"]:
            lines.append(f"cost              ${p['cost']:,.0f} at ${p['price_per_hour']:.2f}/GPU-hour "
                         f"({p['price_source']})")
    else:
        lines.append("time              unknown: no peak FLOP/s for this device and dtype; pass --peak-tflops")
    return "\n".join(lines) + "\n"


FITS_CARDS = (("l4", 24), ("a100-40gb", 40), ("h100", 80))
FITS_MODELS = (("gpt2", "124M"), ("gpt2-medium", "350M"), ("gpt2-large", "774M"), ("gpt2-xl", "1.5B"))


def fits_table(shards: int = 4) -> str:
    """What fits on common cards: the README's table (markdown), one GPU and FSDP over ``shards`` GPUs.

    Each cell is the largest micro-batch at the model's context in bf16 (flash attention, loss in
    chunks of 8192, AdamW); the state columns are weights, gradients, AdamW and bf16 copies per GPU
    (under FSDP, the gathered layers too)."""
    head = ["model", "state per GPU, replica", *(f"{gb} GB" for _, gb in FITS_CARDS),
            f"state per GPU, fsdp × {shards}", *(f"{gb} GB × {shards}" for _, gb in FITS_CARDS)]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for size, label in FITS_MODELS:
        cells = [f"{size} ({label})"]
        for n in (1, shards):
            m = memory(shape(size), 0, SIZES[size]["block_size"], amp=True, flash=True, loss_chunk=8192, shards=n)
            cells.append(f"{m.total / 1e9:.1f} GB")
            cells += [str(largest_micro_batch(shape(size), SIZES[size]["block_size"], True, True, gb, 8192,
                                              shards=n)) for _, gb in FITS_CARDS]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(fits_table())
