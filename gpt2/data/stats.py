"""Dataset statistics of the token files: DVC metrics, DVC plot data and PNGs.

Everything is computed from the .bin files read in fixed-size chunks (bounded
memory, also for 10 B tokens): documents are the runs between EOT tokens, so no side file is needed.
The PNGs are rendered with matplotlib because ``dvc plots show`` needs a CDN.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from gpt2.core import log, paths
from gpt2.core.atomic import json_text, write_files
from gpt2.core.plots import png, pyplot
from gpt2.core.config import StatsConfig
from gpt2.core.errors import UserError
from gpt2.core.tokens import SPLITS, read_chunks, read_meta, split_label, split_shards

logger = log.get("stats")
# bincount first copies its input to int64: slices whose copy stays in cache count a chunk twice as fast
COUNT_SLICE = 1 << 18


def scan_split(pieces: Iterable[tuple[int, np.ndarray]], length: int, vocab_size: int, eot_id: int, name: str,
               eot: str = "after") -> tuple[np.ndarray, np.ndarray]:
    """Token counts (length ``vocab_size``) and document lengths (tokens, EOT excluded).

    ``eot`` says where the separator sits: ``after`` each document (this project's files, nanoGPT's),
    so the split must end with one, or ``before`` each (llm.c's shards), so the last document runs
    to the end."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    lengths: list[np.ndarray] = []
    start = 0  # index where the current document began
    for lo, chunk in pieces:
        top = int(chunk.max())
        if top >= vocab_size:
            raise UserError(f"{name} holds token id {top} >= vocab size {vocab_size}: it was written with "
                            "another dtype or tokenizer; run the tokenize stage again")
        for at in range(0, len(chunk), COUNT_SLICE):
            counts += np.bincount(chunk[at:at + COUNT_SLICE], minlength=vocab_size)
        ends = np.flatnonzero(chunk == eot_id) + lo
        if len(ends):
            bounds = np.concatenate(([start], ends + 1))
            lengths.append(np.diff(bounds) - 1)
            start = int(ends[-1]) + 1
    if eot == "before":
        tail = np.array([length - start]) if length > start else np.zeros(0, dtype=np.int64)
        found = np.concatenate(lengths + [tail]) if lengths else tail
        if lengths and found[0] == 0:
            found = found[1:]  # the run before the first separator: empty in a well-formed shard
        return counts, found
    if length and start != length:
        raise UserError(f"{name} does not end with the EOT token: the file is truncated; "
                        "run the tokenize stage again")
    return counts, np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)


def compute(cfg: StatsConfig, tokens_dir: str | Path) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """Metrics dict, document lengths and per-id counts over both splits."""
    meta = read_meta(tokens_dir)
    vocab, eot = meta["vocab_size"], meta["eot_id"]
    counts = np.zeros(vocab, dtype=np.int64)
    all_lengths = []
    docs, toks, nbytes = {}, {}, {}
    for split in SPLITS:
        split_counts, lengths = scan_split(read_chunks(tokens_dir, split_shards(meta, split)),
                                           meta["splits"][split]["tokens"], vocab, eot, split_label(meta, split),
                                           meta["split"].get("eot", "after"))
        counts += split_counts
        all_lengths.append(lengths)
        docs[split], toks[split] = len(lengths), int(split_counts.sum())
        nbytes[split] = meta["splits"][split]["bytes"]
    lengths = np.concatenate(all_lengths)
    within = meta["split"]["mode"] == "within-document"
    if within:
        lengths = np.array([lengths.sum()])  # one document, cut in two for the val split
    if lengths.size == 0:
        raise UserError(f"{tokens_dir} holds no documents; run download and tokenize on a non-empty corpus")
    text_tokens = counts.copy()
    text_tokens[eot] = 0
    unique = int(np.count_nonzero(text_tokens))
    order = np.argsort(-text_tokens, kind="stable")[: cfg.top_tokens]
    known_bytes = None not in nbytes.values()  # shards an older version imported: their bytes uncounted
    metrics = {
        "documents": {**docs, "total": 1 if within else sum(docs.values())},
        "bytes": {**nbytes, "total": sum(nbytes.values()) if known_bytes else None},
        "tokens": {**toks, "total": sum(toks.values())},
        "bytes_per_token": round(sum(nbytes.values()) / max(1, int(text_tokens.sum())), 4) if known_bytes else None,
        "unique_tokens": unique,
        "vocab_coverage": round(unique / vocab, 4),
        "doc_tokens": {f"p{q}": float(np.percentile(lengths, q)) for q in (50, 90, 99)} | {
            "max": int(lengths.max()), "mean": round(float(lengths.mean()), 1)},
        "top_tokens": [{"rank": r + 1, "id": int(i), "token": decode_token(int(i)), "count": int(text_tokens[i]),
                        "share": round(int(text_tokens[i]) / max(1, int(text_tokens.sum())), 4)}
                       for r, i in enumerate(order) if text_tokens[i] > 0],
    }
    return metrics, lengths, text_tokens


def compared_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """What DVC's metrics file keeps (``dvc metrics show``): the dataset in five numbers. Per-split
    counts, bytes, document-length percentiles and the top tokens stay in summary.json."""
    return {"documents": summary["documents"]["total"], "tokens": summary["tokens"]["total"],
            **{k: summary[k] for k in ("bytes_per_token", "unique_tokens", "vocab_coverage")}}


def decode_token(token_id: int) -> str:
    from gpt2.data.tokenizer import gpt2_encoding

    return gpt2_encoding().decode_single_token_bytes(token_id).decode("utf-8", errors="replace")


def length_histogram(lengths: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Log-spaced bins when lengths span more than two decades (typical web corpora), else linear."""
    low, high = max(1, int(lengths.min())), max(2, int(lengths.max()))
    edges = (np.unique(np.geomspace(low, high + 1, bins + 1).astype(np.int64)) if high / low > 100
             else np.linspace(low, high + 1, bins + 1))
    hist, edges = np.histogram(lengths, bins=edges)
    return hist, edges


def rank_frequency(counts: np.ndarray, points: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """(rank, count) at about ``points`` log-spaced ranks: enough to draw Zipf's line, small to diff."""
    sorted_counts = np.sort(counts[counts > 0])[::-1]
    ranks = np.unique(np.geomspace(1, len(sorted_counts), points).astype(np.int64))
    return ranks, sorted_counts[ranks - 1]


def dataset_stats(cfg: StatsConfig, tokens_dir: str | Path = paths.TOKENS, out_dir: str | Path = paths.STATS,
                  context: int | None = None) -> dict[str, Any]:
    """Compute the statistics, then write every report file (all of them or none). ``context``: the training
    sequence length, marked on the length plot with the share of documents longer than it."""
    metrics, lengths, counts = compute(cfg, tokens_dir)
    if context is not None:
        metrics["context"] = {"tokens": context, "documents_longer": round(float(np.mean(lengths > context)), 4)}
    hist, edges = length_histogram(lengths, cfg.length_bins)
    ranks, rank_counts = rank_frequency(counts)
    hist_tsv = "doc_tokens\tdocuments\n" + "".join(f"{int(e)}\t{int(h)}\n" for e, h in zip(edges[:-1], hist))
    rank_tsv = "rank\tcount\tlog10_rank\tlog10_count\n" + "".join(
        f"{r}\t{c}\t{np.log10(r):.4f}\t{np.log10(c):.4f}\n" for r, c in zip(ranks, rank_counts))
    pngs = render_pngs(edges, hist, ranks, rank_counts, metrics.get("context"))
    out = Path(out_dir)
    write_files(out, {"doc_lengths.tsv": hist_tsv, "rank_frequency.tsv": rank_tsv, **pngs,  # all of them or none
                      "summary.json": json_text(metrics), "metrics.json": json_text(compared_figures(metrics))})
    top = ", ".join(f"{t['token']!r} {t['share']:.1%}" for t in metrics["top_tokens"][:3])
    logger.info(f"stats: {metrics['documents']['total']} documents, {metrics['tokens']['total']:,} tokens, "
                f"{metrics['bytes_per_token']} bytes/token, {metrics['unique_tokens']:,} unique tokens "
                f"({metrics['vocab_coverage']:.1%} of the vocab); most frequent: {top} → {out}/")
    return metrics


def render_pngs(edges: np.ndarray, hist: np.ndarray, ranks: np.ndarray, counts: np.ndarray,
                context: dict[str, Any] | None = None) -> dict[str, bytes]:
    import matplotlib.ticker

    plt = pyplot()

    out = {}
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.stairs(hist, edges, fill=True, alpha=0.8)
    if edges[-1] / max(edges[0], 1) > 100:
        ax.set_xscale("log")
    if context:
        ax.axvline(context["tokens"], color="C3", linestyle="--",
                   label=f"training context, {context['tokens']:,} tokens: "
                         f"{context['documents_longer']:.0%} of documents are longer")
        ax.legend(loc="upper right", fontsize="small")
    ax.set(xlabel="document length (tokens)", ylabel="documents", title="Document lengths")
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    out["doc_lengths.png"] = png(fig)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.loglog(ranks, counts, marker=".", linestyle="-")
    ax.set(xlabel="rank", ylabel="count", title="Token rank-frequency (Zipf)")
    ax.grid(True, which="major", alpha=0.3)
    out["rank_frequency.png"] = png(fig)
    return out

