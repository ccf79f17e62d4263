"""Progress lines with rate and ETA, for terminals and for DVC/CI logs alike.

On a terminal the line is redrawn in place; in a log (not a TTY) a full line
is printed every few seconds, so long runs stay readable in CI output.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _si(value: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(value) < 1000:
            return f"{value:.1f}{unit}" if unit else f"{value:.0f}"
        value /= 1000
    return f"{value:.1f}P"


def clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Count work done; print ``desc: done/total (pct) rate ETA`` now and then."""

    def __init__(
        self,
        desc: str,
        total: float | None = None,
        unit: str = "B",
        stream: TextIO | None = None,
        interval_s: float | None = None,
    ) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.interval_s = interval_s if interval_s is not None else (0.2 if self.tty else 5.0)
        self.done = 0.0
        self.start = self.last = time.perf_counter()

    def update(self, amount: float) -> None:
        self.done += amount
        now = time.perf_counter()
        if now - self.last >= self.interval_s:
            self.last = now
            self._print(final=False)

    def close(self) -> None:
        self._print(final=True)

    def line(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        rate = self.done / elapsed
        text = f"{self.desc}: {_si(self.done)}{self.unit}"
        if self.total:
            text += f"/{_si(self.total)}{self.unit} ({100 * self.done / self.total:.0f}%)"
        text += f" {_si(rate)}{self.unit}/s"
        if self.total and rate > 0 and self.done < self.total:
            text += f" ETA {clock((self.total - self.done) / rate)}"
        else:
            text += f" in {clock(elapsed)}"
        return text

    def _print(self, final: bool) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + self.line() + ("\n" if final else ""))
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        elif self.tty:
            self.stream.write("\n")
