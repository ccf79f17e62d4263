"""The training curves as one PNG (loss, step time, tokens/s, memory), readable without a browser.

DVC's own plots render to HTML that loads Vega from a CDN: blank offline. matplotlib is optional
here (GPU boxes may lack it): without it the PNG is skipped with a note, the TSVs remain.
"""

from __future__ import annotations

import io
from typing import Any

from gpt2.core import log


def render_curves(train: list[dict[str, Any]], val: list[dict[str, Any]], title: str) -> bytes | None:
    try:
        import matplotlib
    except ImportError:
        log.get("train").info("train: matplotlib is not installed; skipping plots/curves.png (the .tsv files are written)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    step_ms.plot(*series(train, "perf/step_ms"), linewidth=1)
    step_ms.set(ylabel="ms", title="Step time (warm-up steps left out)")
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
    for ax in (step_ms, tps, mem):
        ax.set_ylim(bottom=0)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle(title)
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.08, top=0.9, wspace=0.25, hspace=0.25)  # tight_layout: 2× slower
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()
