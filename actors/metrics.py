"""The Metrics actor: owns a run's metric outputs, and the live step line users watch in the terminal.

Consumes: ``log(step, values)`` calls (one per training step, one per evaluation). Produces, in the run folder:
``metrics.jsonl`` (one JSON object a line: ``{"step": N, "time": unix seconds, **values}``, appended and flushed
as it is logged; a non-finite number is written as null) and ``tensorboard/`` (event files: every numeric value
as a scalar, non-finite ones left out); ``statistics()`` (MetricsStatistics).

On resume (``resume_step=K``, the step of the checkpoint the run goes on from) the lines of later steps are
dropped from metrics.jsonl (rewritten atomically: a temporary file, then ``os.replace``), so a step logged but
never checkpointed is not shown twice; TensorBoard is told the same with a SessionLog START event at step K+1,
which makes it discard the older events of steps above K.

StepProgress is the one line per step on stderr (rewritten in place on a terminal, a line per step otherwise).
``read_metrics`` reads a metrics.jsonl back (``swectl plot``), reporting malformed lines by file:line.
Everything is synchronous and small (one short line per step); nothing here is global.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, TextIO

from swectl import logs
from swectl.schema import EngineStatistics, HarnessStatistics, MetricsStatistics, PoolStatistics

if TYPE_CHECKING:
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
RESERVED_KEYS = frozenset({"step", "time"})  # the fields every record has; values may not use them

_log = logging.getLogger(__name__)


def _scan(path: Path) -> Iterator[tuple[int, str, dict[str, Any] | None, str]]:
    """(line number, line, record or None, why it is not one) for each non-blank line of a metrics.jsonl."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            text = line.strip()
            if not text:
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                yield number, text, None, f"not JSON ({exc.msg} at column {exc.colno})"
                continue
            if not isinstance(record, dict):
                yield number, text, None, f"a JSON {type(record).__name__}, not an object"
            elif not isinstance(record.get("step"), int) or isinstance(record.get("step"), bool):
                yield number, text, None, f"no integer \"step\" (got {record.get('step')!r})"
            else:
                yield number, text, record, ""


def read_metrics(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The records of a metrics.jsonl in file order, and one ``file:line: why`` for each malformed line skipped.

    Raises OSError when the file cannot be read."""
    path = Path(path)
    records: list[dict[str, Any]] = []
    problems: list[str] = []
    for number, _, record, why in _scan(path):
        if record is None:
            problems.append(f"{path}:{number}: {why}")
        else:
            records.append(record)
    return records, problems


def _ends_cut_short(path: Path) -> bool:
    """Whether a non-empty file's last line has no newline (a write cut short by a kill)."""
    with path.open("rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def _entry(value: Any) -> tuple[Any, float | None]:
    """A value as it goes into JSON, and as a TensorBoard scalar (None: not one)."""
    if value is None or isinstance(value, str):
        return value, None
    if isinstance(value, bool):
        return value, float(value)
    if isinstance(value, numbers.Integral):
        return int(value), float(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return (number, number) if math.isfinite(number) else (None, None)
    return str(value), None


class Metrics:
    """The run's metric outputs: metrics.jsonl and TensorBoard event files in ``out_dir``.

    ``resume_step``: the step the run goes on from (its checkpoint's); lines of later steps are dropped first.
    None: append to whatever is there. Use it as a context manager (or call ``close()``) to close the
    TensorBoard writer; every ``log`` is flushed, so nothing is lost without it."""

    def __init__(self, out_dir: str | Path, *, resume_step: int | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / METRICS_FILE
        self._steps: set[int] = set()
        self._last_step: int | None = None
        self._prepare(resume_step)
        # imported here: `swectl plot` (and every command's --help, which imports all of them) reads
        # metrics.jsonl through this module and needs no TensorBoard
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2, summary_pb2
        self._writer: EventFileWriter | None = EventFileWriter(str(self.out_dir / TENSORBOARD_DIR))
        if resume_step is not None:
            restart = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=resume_step + 1, session_log=restart))
            self._writer.flush()

    def _prepare(self, resume_step: int | None) -> None:
        """Drop the lines after ``resume_step`` (and malformed ones) when resuming; learn the steps already there."""
        if not self.path.exists():
            return
        kept: list[str] = []
        dropped = malformed = 0
        for number, text, record, why in _scan(self.path):
            if record is None:
                if resume_step is not None:
                    malformed += 1
                    _log.warning("%s:%d: dropped a malformed line (%s)", self.path, number, why)
                    continue
                kept.append(text)
                continue
            if resume_step is not None and record["step"] > resume_step:
                dropped += 1
                continue
            kept.append(text)
            self._note(record["step"])
        cut_short = _ends_cut_short(self.path)
        if dropped or malformed or (resume_step is not None and cut_short):
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            with tmp.open("w", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in kept))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            if dropped:
                _log.info("%s: dropped %d line(s) of steps after %d (resuming from it)", self.path, dropped,
                          resume_step)
        elif cut_short:  # a line cut short: the next record starts on a line of its own
            with self.path.open("a", encoding="utf-8") as f:
                f.write("\n")

    def _note(self, step: int) -> None:
        self._steps.add(step)
        if self._last_step is None or step > self._last_step:
            self._last_step = step

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        """Append ``{"step": step, "time": now, **values}`` to metrics.jsonl and each number to TensorBoard.

        Non-finite numbers become null (and no scalar); strings and None go to the JSON line only."""
        clash = RESERVED_KEYS & values.keys()
        if clash:
            raise ValueError(f"metric names {sorted(clash)} are reserved (every record has step and time)")
        now = time.time()
        record: dict[str, Any] = {"step": int(step), "time": now}
        scalars = []
        for key, value in values.items():
            record[key], scalar = _entry(value)
            if scalar is not None:
                scalars.append(self._summary.Summary.Value(tag=key, simple_value=scalar))
        line = json.dumps(record, allow_nan=False)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
        self._note(int(step))
        if self._writer is not None and scalars:
            summary = self._summary.Summary(value=scalars)
            self._writer.add_event(self._event.Event(wall_time=now, step=int(step), summary=summary))
            self._writer.flush()

    def statistics(self) -> MetricsStatistics:
        return MetricsStatistics(steps_logged=len(self._steps), last_step=self._last_step)

    def close(self) -> None:
        """Flush and close the TensorBoard writer (metrics.jsonl needs nothing); later logs go to the JSONL only."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> Metrics:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
                 ) -> None:
        self.close()


# ---------------------------------------------------------------- the env pool's part of a step


class _StepReadings:
    """What some counters of a statistics snapshot (``statistics()``) moved since the last step was logged: each
    metric of ``COUNTERS`` is its counter now less its counter at the last call."""

    COUNTERS: ClassVar[dict[str, Callable[[Any], float]]] = {}

    def __init__(self, statistics: Callable[[], Any]) -> None:
        self._statistics = statistics
        self._last = statistics()

    def step_values(self) -> dict[str, float]:
        now, last = self._statistics(), self._last
        self._last = now
        return {name: counter(now) - counter(last) for name, counter in self.COUNTERS.items()}


class EnvReadings(_StepReadings):
    """A step's ``env/`` metrics from the env pool's PoolStatistics. ``env/image_waits``: leases that waited for a pull
    of their image onto their node; ``env/image_wait_s``: those waits' seconds, summed; ``env/image_pulls``,
    ``env/image_pull_failures``, ``env/images_evicted``: pulls and removals under the nodes' disk budgets."""

    COUNTERS: ClassVar[dict[str, Callable[[PoolStatistics], float]]] = {
        "env/image_waits": lambda s: float(s.image_waits),
        "env/image_wait_s": lambda s: s.image_wait_s,
        "env/image_pulls": lambda s: float(s.image_pulls),
        "env/image_pull_failures": lambda s: float(s.image_pull_failures),
        "env/images_evicted": lambda s: float(s.images_evicted),
    }


class EngineReadings(_StepReadings):
    """A step's ``engine/`` metrics from the Engines' EngineStatistics: what an engine outage cost.
    ``engine/outage_waits``: episodes held back because no server was healthy; ``engine/outage_wait_s``: their
    waits' seconds, summed; ``engine/restarts``: server restarts."""

    COUNTERS: ClassVar[dict[str, Callable[[EngineStatistics], float]]] = {
        "engine/outage_waits": lambda s: float(s.outage_waits),
        "engine/outage_wait_s": lambda s: s.outage_wait_s,
        "engine/restarts": lambda s: float(sum(server.restarts for server in s.servers)),
    }


class HarnessReadings(_StepReadings):
    """A step's ``gateway/`` metrics from an external harness's HarnessStatistics ([agent] harness): its episodes'
    ``gateway/turns``, ``gateway/branches`` (branches beyond the first: a history the harness did not send back as
    it was sampled) and ``gateway/drift_tokens`` (the sampled tokens past those forks), and the gateway's
    ``gateway/replayed`` (retries answered from the record), ``gateway/rejected`` (4xx) and
    ``gateway/engine_failures`` (5xx)."""

    COUNTERS: ClassVar[dict[str, Callable[[HarnessStatistics], float]]] = {
        "gateway/turns": lambda s: float(s.turns),
        "gateway/branches": lambda s: float(s.branches),
        "gateway/drift_tokens": lambda s: float(s.drift_tokens),
        "gateway/replayed": lambda s: float(s.gateway.replayed),
        "gateway/rejected": lambda s: float(s.gateway.rejected),
        "gateway/engine_failures": lambda s: float(s.gateway.engine_failures),
    }


# ---------------------------------------------------------------- the terminal line


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = max(seconds, 0.0)
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours}h{rest // 60:02d}m"


def _rate(per_s: float) -> str:
    if not math.isfinite(per_s):
        return "?"
    if per_s >= 1e6:
        return f"{per_s / 1e6:.1f}M"
    if per_s >= 1e3:
        return f"{per_s / 1e3:.1f}k"
    return f"{per_s:.0f}"


def _number(values: Mapping[str, Any], *keys: str) -> float | None:
    """The first of ``keys`` that is a number in ``values`` (None, strings and bools are not)."""
    for key in keys:
        value = values.get(key)
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
    return None


class StepProgress:
    """The live line per training step on stderr: reward, resolve rate, loss, throughput, weight version, ETA.

    On a terminal one line is rewritten in place (``\\r``); otherwise (a log file, CI) a line per step.
    ``start_step``: the steps done before this process (the rate and ETA count only this run's)."""

    def __init__(self, total_steps: int, start_step: int = 0, *, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total_steps = total_steps
        self.start_step = start_step
        self._stream = stream if stream is not None else logs.err()
        self._tty = self._stream.isatty()
        self._clock = clock
        self._started = clock()
        self._open = False  # a TTY line is drawn without its newline

    def line(self, step: int, values: Mapping[str, Any]) -> str:
        """The text for ``step``: only what ``values`` has, e.g.
        ``step 7/50  reward 0.42  resolved 38%  loss 0.0123  1.2k tok/s  v7  ETA 12m``."""
        parts = [f"step {step}/{self.total_steps}"]
        if (reward := _number(values, "reward_mean")) is not None:
            parts.append(f"reward {reward:.2f}")
        if (resolved := _number(values, "resolve_rate")) is not None:
            parts.append(f"resolved {resolved:.0%}" if math.isfinite(resolved) else "resolved ?")
        if (loss := _number(values, "loss")) is not None:
            parts.append(f"loss {loss:.4g}")
        if (tokens := _number(values, "tokens_per_s", "train_tokens_per_s")) is not None:
            parts.append(f"{_rate(tokens)} tok/s")
        if (version := _number(values, "weight_version")) is not None and math.isfinite(version):
            parts.append(f"v{version:.0f}")
        if _number(values, "skipped"):
            parts.append("skipped")
        elapsed = self._clock() - self._started
        done = step - self.start_step
        if step >= self.total_steps:
            parts.append(f"took {_duration(elapsed)}")
        elif done > 0:
            parts.append(f"ETA {_duration(elapsed / done * (self.total_steps - step))}")
        return "  ".join(parts)

    def update(self, step: int, values: Mapping[str, Any]) -> None:
        """Show ``step``'s line (rewriting the previous one on a terminal)."""
        text = self.line(step, values)
        if self._tty:
            self._stream.write("\r\033[K" + text)
            self._open = True
        else:
            self._stream.write(text + "\n")
        self._stream.flush()

    def close(self) -> None:
        """End the terminal line, so what is printed next starts on a line of its own."""
        if self._open:
            self._stream.write("\n")
            self._stream.flush()
            self._open = False
