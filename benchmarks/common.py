"""Helpers shared by the `just bench` suites: timing statistics, goals, the result table, JSON output.

Standard library only (a suite must not need numpy to say how fast something is). Every suite prints a
table (metric, value, goal, met?) and writes ``benchmarks/results/<suite>.json`` as
``{"suite": ..., "metrics": {...}, "meta": {...}}``; ``meta`` carries a format version, the host, the
sample counts and the goals with whether each was met.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

FORMAT_VERSION = 1
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ---------------------------------------------------------------- timing statistics


def percentile(ordered: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of already sorted samples, interpolating linearly between ranks."""
    if not ordered:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(samples: Iterable[float], digits: int = 3) -> dict[str, float]:
    """n, mean, min, p50, p90, p99, max of the samples (rounded), for a suite's meta section."""
    ordered = sorted(samples)
    if not ordered:
        return {"n": 0}
    stats = {
        "mean": sum(ordered) / len(ordered),
        "min": ordered[0],
        **{f"p{q}": percentile(ordered, q) for q in (50, 90, 99)},
        "max": ordered[-1],
    }
    return {"n": len(ordered), **{key: round(value, digits) for key, value in stats.items()}}


def ms_since(start_ns: int) -> float:
    """Milliseconds since ``start_ns`` (a ``time.perf_counter_ns()`` reading)."""
    return (time.perf_counter_ns() - start_ns) / 1e6


# ---------------------------------------------------------------- goals


@dataclass(frozen=True)
class Goal:
    """A number to reach (docs/architecture.md 13.2): ``metric op target``, e.g. exec_p50_ms <= 2."""

    metric: str
    op: str  # "<=" or ">="
    target: float
    text: str = ""  # how the goal reads when the target is derived, e.g. "<= ssh_rtt_ms + 2"
    not_applicable: str = ""  # set when this run cannot test the goal (the reason); met is then None

    def __post_init__(self) -> None:
        if self.op not in ("<=", ">="):
            raise ValueError(f"Goal.op must be '<=' or '>=', not {self.op!r}")

    @property
    def label(self) -> str:
        return self.text or f"{self.op} {self.target:g}"

    def met(self, value: float | None) -> bool | None:
        """None when this run cannot test the goal; a goal whose metric was not measured is not met."""
        if self.not_applicable:
            return None
        if value is None:
            return False
        return value <= self.target if self.op == "<=" else value >= self.target

    def record(self, metrics: dict[str, Any]) -> dict[str, Any]:
        value = metrics.get(self.metric)
        out: dict[str, Any] = {
            "metric": self.metric, "goal": self.label, "target": self.target, "value": value,
            "met": self.met(value),
        }
        if self.not_applicable:
            out["not_applicable"] = self.not_applicable
        return out


# ---------------------------------------------------------------- output


def format_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.1f}"
    return str(value)


def result_table(metrics: dict[str, Any], goals: Sequence[Goal]) -> str:
    """One row per metric: metric, value, goal, met? (metrics without a goal show '-')."""
    by_metric = {goal.metric: goal for goal in goals}
    rows = []
    for name, value in metrics.items():
        goal = by_metric.get(name)
        if goal is None:
            rows.append((name, format_value(value), "-", "-"))
            continue
        if goal.not_applicable:
            verdict = f"n/a ({goal.not_applicable})"
        else:
            verdict = format_value(goal.met(value)) + (" (not measured)" if value is None else "")
        rows.append((name, format_value(value), goal.label, verdict))
    return format_table(("metric", "value", "goal", "met?"), rows)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        # Text columns left-aligned, the value column (the second) right-aligned so decimals line up.
        return "  ".join(
            str(c).rjust(w) if i == 1 else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def write_results(suite: str, metrics: dict[str, Any], meta: dict[str, Any], path: Path | None = None) -> Path:
    """Write ``{"suite", "metrics", "meta"}`` to results/<suite>.json (atomically); returns the path."""
    path = path or RESULTS_DIR / f"{suite}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"suite": suite, "metrics": metrics, "meta": {"format_version": FORMAT_VERSION, **meta}}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(document, indent=2) + "\n")
    tmp.replace(path)
    return path


def report(suite: str, metrics: dict[str, Any], meta: dict[str, Any], goals: Sequence[Goal]) -> Path:
    """Record the goals in ``meta``, write the suite's JSON, print the result table and where it went. A ``--quick``
    run (``meta["quick"]``) goes to results/<suite>.quick.json: it never replaces the recorded full run."""
    meta["goals"] = [g.record(metrics) for g in goals]
    path = write_results(suite, metrics, meta, RESULTS_DIR / f"{suite}.quick.json" if meta.get("quick") else None)
    print(result_table(metrics, goals))
    print(f"\nwrote {path}")
    return path


class Progress:
    """One line per phase on stderr, prefixed with the time since the suite started."""

    def __init__(self, suite: str) -> None:
        self.suite = suite
        self.started = time.monotonic()

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def __call__(self, message: str) -> None:
        print(f"[{self.suite} +{self.elapsed_s():6.1f}s] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- host facts


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return []


def mem_used_mib() -> float:
    """Host memory in use (MemTotal - MemAvailable, so reclaimable page cache does not count)."""
    fields: dict[str, int] = {}
    for row in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = row.partition(":")
        fields[key] = int(rest.split()[0])  # kB
    return (fields["MemTotal"] - fields["MemAvailable"]) / 1024


def host_meta() -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_start": loadavg(),
    }


async def run_each(fn: Callable[[Any], Awaitable[None]], items: Iterable[Any], at_once: float = math.inf) -> float:
    """fn(item) for all items at once, at most ``at_once`` at a time; returns the seconds it took."""
    limiter = anyio.CapacityLimiter(at_once)

    async def one(item: Any) -> None:
        async with limiter:
            await fn(item)

    start = time.perf_counter_ns()
    async with anyio.create_task_group() as tg:
        for item in items:
            tg.start_soon(one, item)
    return ms_since(start) / 1000
