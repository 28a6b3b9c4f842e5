"""At-most-once execution for requests that carry an ``Idempotency-Key`` header.

The first request with a key runs; every retry with the same key (and the same endpoint and body) gets the
first one's answer, waiting for it while it runs. A retry with a different body is refused (422): a client
bug, not a retry. A first request that was interrupted (the service stopping) answers its retries with a 503
that says its effect is unknown: never a second execution. Keys are kept ``ttl_s`` after their answer, about
``max_keys`` of them (the oldest are forgotten first).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio

from swectl.serve.wire import ApiError

Answer = tuple[int, dict[str, object]]  # HTTP status, JSON body


@dataclass(eq=False)
class _Entry:
    fingerprint: str
    done: anyio.Event = field(default_factory=anyio.Event)
    answer: Answer | None = None
    answered_at: float = 0.0


class IdempotencyCache:
    """Answers by (endpoint, Idempotency-Key): the first request runs, its retries get its answer."""

    def __init__(self, *, ttl_s: float = 3600.0, max_keys: int = 100_000) -> None:
        self._ttl_s = ttl_s
        self._max_keys = max_keys
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.replays = 0

    async def once(self, scope: str, key: str, body: bytes, call: Callable[[], Awaitable[Answer]],
                   *, wait_s: float) -> Answer:
        """The answer of ``call`` for this (scope, key): run now, or the first run's answer (waited for up to
        ``wait_s``)."""
        self._forget_old()
        name = f"{scope}\0{key}"
        fingerprint = hashlib.sha256(body).hexdigest()
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = _Entry(fingerprint)
            try:
                entry.answer = await call()
            except BaseException:
                entry.answer = (503, ApiError(503, f"the first request with Idempotency-Key {key!r} was interrupted; "
                                              "whether it took effect is unknown", infra=True).body())
                raise
            finally:
                entry.answered_at = anyio.current_time()
                entry.done.set()
            return entry.answer
        if entry.fingerprint != fingerprint:
            raise ApiError(422, f"Idempotency-Key {key!r} was already used for a different {scope} request")
        self.replays += 1
        with anyio.move_on_after(wait_s):
            await entry.done.wait()
        if entry.answer is None:
            raise ApiError(409, f"the first request with Idempotency-Key {key!r} is still running after {wait_s:g} s; "
                           "retry later")
        return entry.answer

    def _forget_old(self) -> None:
        """Drop answered keys from the oldest on, while they are past the TTL or over the cap (amortised O(1):
        a key still running stops the walk; the keys behind it wait for it)."""
        now = anyio.current_time()
        while self._entries:
            entry = next(iter(self._entries.values()))
            if entry.answer is None:
                return
            if now - entry.answered_at <= self._ttl_s and len(self._entries) <= self._max_keys:
                return
            self._entries.popitem(last=False)
