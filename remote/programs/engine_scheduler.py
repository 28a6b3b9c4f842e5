"""The CPU engine's scheduler (remote/programs/cpu_engine.py starts it): the only user of the model.

One task batches the requests that arrive within ``batch_wait_s`` of the first (up to ``max_batch``) and decodes
them one token per step with the batch math of remote/programs/engine_batch.py, the forwards in a worker thread,
one at a time. Requests arriving meanwhile join the running batch between two steps while it has room
(continuous batching), except while a weight update waits, which runs once the batch has drained. Weight updates
(from a folder, or tensors received over the weight group) and pause/continue are honoured at safe points, when
no forward is in flight, so they need no locks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import anyio
import torch

from swectl.engine.wire import PauseMode
from swectl.remote.programs.engine_batch import Batch, Model, Seq, can_join, join, prefill, step

T = TypeVar("T")

CONTROL_TIMEOUT_S = 600.0
PAUSE_ACK_TIMEOUT_S = 60.0


# ---------------------------------------------------------------- the scheduler: the only user of the model


@dataclass(eq=False)
class WeightUpdate:
    """A weight reload waiting for the scheduler; ``done`` is set when it has happened. From a folder (``path``),
    or received tensors (``tensors``: one bucket of a distributed sync, whose version changes only when given)."""
    path: Path | None
    version: str | None
    tensors: list[tuple[str, torch.Tensor]] | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    error: str | None = None
    cancelled: bool = False


class Scheduler:
    """Owns the model: batches requests, runs weight updates at safe points, honours pause/continue."""

    def __init__(self, model: Model, *, max_batch: int, batch_wait_s: float, threads: int, weight_version: str,
                 continuous: bool = True):
        self.model = model
        self.max_batch = max_batch
        self.continuous = continuous  # False: static batching (requests wait for the running batch to end)
        self.batch_wait_s = batch_wait_s
        self.threads = threads
        self.weight_version = weight_version
        self.updates = 0
        self.batches = 0
        self.largest_batch = 0
        self.joined = 0  # requests that joined a batch already decoding
        self.decode_steps = 0
        self.decoded_rows = 0  # rows over all decode steps: decoded_rows / decode_steps is the mean batch
        self.seconds_in: dict[str, float] = {}  # model time by kind of call (prefill, join, step, weight loads)
        self.paused: PauseMode | None = None
        self._waiting: deque[Seq] = deque()
        self._running: list[Seq] = []
        self._controls: deque[WeightUpdate] = deque()
        self._wakeup = anyio.Event()
        self._pause_seen = anyio.Event()
        self._limiter = anyio.CapacityLimiter(1)

    # ---- called by request handlers (event loop)

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def held(self) -> int:
        """Requests held mid-generation by a pause."""
        return len(self._running) if self.paused is not None else 0

    def submit(self, seq: Seq) -> None:
        if seq.max_new == 0:
            self._finish(seq, {"type": "length", "length": 0})
            return
        self._waiting.append(seq)
        self._wakeup.set()

    async def update_weights(self, path: Path | None, version: str | None, *, abort_all: bool,
                             tensors: list[tuple[str, torch.Tensor]] | None = None) -> WeightUpdate:
        update = WeightUpdate(path, version, tensors)
        if abort_all:
            self.abort_all("aborted for a weight update")
        self._controls.append(update)
        self._wakeup.set()
        with anyio.move_on_after(CONTROL_TIMEOUT_S):
            await update.done.wait()
        if not update.done.is_set():
            update.cancelled = True  # the scheduler skips it if it has not started it yet
        return update

    def abort_all(self, message: str) -> None:
        """End every request now waiting or running (running ones at their next step)."""
        while self._waiting:
            self._finish(self._waiting.popleft(), {"type": "abort", "message": message})
        for seq in self._running:
            seq.abort_message = message
        self._wakeup.set()

    async def pause(self, mode: PauseMode) -> None:
        self.paused = mode
        self._pause_seen = anyio.Event()
        if mode == "abort":
            self.abort_all("generation paused (mode abort)")
        self._wakeup.set()
        with anyio.fail_after(PAUSE_ACK_TIMEOUT_S):
            await self._pause_seen.wait()

    def resume(self) -> None:
        self.paused = None
        self._wakeup.set()

    # ---- the scheduler task

    async def run(self) -> None:
        while True:
            await self._safe_point()
            if self.paused is not None or not self._waiting:
                await self._sleep(None)
                continue
            await self._collect()
            if self.paused is None and self._waiting:  # a pause or an abort may have come while collecting
                await self._run_batch([self._waiting.popleft() for _ in range(min(self.max_batch, len(self._waiting)))])

    async def _sleep(self, timeout_s: float | None) -> None:
        with anyio.move_on_after(timeout_s):
            await self._wakeup.wait()
        if self._wakeup.is_set():
            self._wakeup = anyio.Event()

    async def _collect(self) -> None:
        deadline = anyio.current_time() + self.batch_wait_s
        while len(self._waiting) < self.max_batch and self.paused is None:
            left = deadline - anyio.current_time()
            if left <= 0:
                return
            await self._sleep(left)

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(partial(self._call, fn, *args), limiter=self._limiter)

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if torch.get_num_threads() != self.threads:  # the setting is per OS thread
            torch.set_num_threads(self.threads)
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                return fn(*args)
        finally:
            name = getattr(fn, "__name__", "other")
            self.seconds_in[name] = self.seconds_in.get(name, 0.0) + time.perf_counter() - started

    async def _safe_point(self) -> None:
        """No forward in flight: run queued weight updates, acknowledge a pause."""
        while self._controls:
            update = self._controls.popleft()
            if not update.cancelled:
                await self._apply(update)
        if self.paused is not None:
            self._pause_seen.set()

    async def _apply(self, update: WeightUpdate) -> None:
        try:
            if update.tensors is not None:
                await self._in_thread(self.model.load_tensors, update.tensors)
            else:
                assert update.path is not None
                await self._in_thread(self.model.load_weights, update.path)
        except Exception as exc:  # the engine keeps serving the old weights, as SGLang does
            update.error = f"{type(exc).__name__}: {exc}"
        else:
            self.updates += 1
            if update.version is not None:
                self.weight_version = update.version
            elif update.tensors is None:
                self.weight_version = str(self.updates)
        update.done.set()

    async def _run_batch(self, seqs: list[Seq]) -> None:
        self._running = list(seqs)
        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(seqs))
        try:
            batch = await self._in_thread(prefill, self.model, seqs)
            while batch.seqs:
                if self._may_join(batch):
                    newcomers = [self._waiting.popleft()
                                 for _ in range(min(self.max_batch - len(batch.seqs), len(self._waiting)))]
                    self._running += newcomers
                    self.joined += len(newcomers)
                    batch = await self._in_thread(join, self.model, batch, newcomers)
                    self.largest_batch = max(self.largest_batch, len(batch.seqs))
                if any(seq.abort_message is not None for seq in batch.seqs):
                    batch = await self._abort_marked(batch)
                    continue
                if self.paused is not None:
                    mode = self.paused
                    await self._hold()
                    if mode == "retract" and batch.seqs:  # recompute the KV cache (new weights, if any)
                        batch = await self._in_thread(prefill, self.model, batch.seqs)
                    continue
                self.decode_steps += 1
                self.decoded_rows += len(batch.seqs)
                for seq in await self._in_thread(step, self.model, batch):
                    self._finish(seq, seq.finish or {"type": "abort", "message": "no finish reason"})
                self._running = [seq for seq in self._running if not seq.done.is_set()]
        except Exception as exc:  # a failed forward ends this batch's requests, not the server
            for seq in self._running:
                if not seq.done.is_set():
                    self._finish(seq, {"type": "abort", "message": f"engine error: {type(exc).__name__}: {exc}"})
        finally:
            self._running = []

    def _may_join(self, batch: Batch) -> bool:
        """Waiting requests join between steps while the batch has room, nothing is paused or aborting, and no
        weight update waits (it runs when the batch drains: joining could starve it)."""
        return (self.continuous and bool(self._waiting) and len(batch.seqs) < self.max_batch and self.paused is None
                and not self._controls and can_join(batch)
                and all(seq.abort_message is None for seq in batch.seqs))

    async def _abort_marked(self, batch: Batch) -> Batch:
        rest = [seq for seq in batch.seqs if seq.abort_message is None]
        for seq in batch.seqs:
            if seq.abort_message is not None:
                self._finish(seq, {"type": "abort", "message": seq.abort_message})
        if not rest:
            batch.seqs = []
            return batch
        return await self._in_thread(prefill, self.model, rest)  # rare: rebuild the cache without them

    async def _hold(self) -> None:
        """Paused mid-batch (in_place/retract): the rows wait; weight updates may run meanwhile."""

        def aborting() -> bool:
            return any(seq.abort_message is not None for seq in self._running)

        while self.paused is not None and not aborting():
            await self._safe_point()
            if self.paused is None or aborting():
                return
            await self._sleep(None)

    def _finish(self, seq: Seq, reason: dict[str, Any]) -> None:
        seq.finish = reason
        seq.finished_at = time.perf_counter()
        seq.weight_version = self.weight_version
        seq.done.set()
