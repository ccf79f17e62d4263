"""PNG figures with no display and no browser: matplotlib's Agg backend, rendered to bytes that the
caller writes with its other outputs (DVC's own plots render to HTML that loads Vega from a CDN)."""

from __future__ import annotations

import io
from types import ModuleType
from typing import Any


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend; ImportError where matplotlib is not installed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(fig: Any, tight: bool = True) -> bytes:
    """The figure as PNG bytes, laid out by ``tight_layout`` unless the caller placed its panels, then closed."""
    if tight:
        fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    pyplot().close(fig)
    return buffer.getvalue()
