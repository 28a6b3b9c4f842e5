"""A one-line live progress bar for long runs (counts by outcome, rate, ETA); plain lines when not a TTY."""

from __future__ import annotations

import time
from typing import TextIO

from swectl import logs


class Progress:
    """A one-line progress counter for long eval runs."""

    def __init__(self, total: int, label: str, *, stream: TextIO | None = None) -> None:
        self.total = total
        self.label = label
        self.done = 0
        self.counts: dict[str, int] = {}
        self._stream = stream or logs.err()
        self._tty = self._stream.isatty()
        self._started = time.monotonic()
        self._last_plain = 0.0
        self._resumed = 0  # done before this run (rate and ETA count only this run's work)

    def resume(self, outcome: str) -> None:
        """Count an item finished by an earlier run."""
        self.done += 1
        self._resumed += 1
        self.counts[outcome] = self.counts.get(outcome, 0) + 1

    def advance(self, outcome: str) -> None:
        self.done += 1
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        self._draw()

    def line(self) -> str:
        elapsed = time.monotonic() - self._started
        width = 24
        filled = int(width * self.done / self.total) if self.total else width
        fresh = self.done - self._resumed
        rate = fresh / elapsed * 60 if elapsed > 0 else 0.0
        eta = (self.total - self.done) / (fresh / elapsed) if fresh and elapsed > 0 else 0.0
        counts = " ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
        return (f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {counts} "
                f"| {rate:.1f}/min, {elapsed:.0f}s elapsed, eta {eta:.0f}s")

    def _draw(self) -> None:
        if self._tty:
            self._stream.write("\r\033[K" + self.line())
            if self.done == self.total:
                self._stream.write("\n")
        elif self.done == self.total or time.monotonic() - self._last_plain > 5:
            self._last_plain = time.monotonic()
            self._stream.write(self.line() + "\n")
        self._stream.flush()
