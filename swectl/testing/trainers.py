"""The Trainer actor for the length of one body: tests and benchmarks that talk to real torchrun workers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from swectl.rl.wire import Ready

T = TypeVar("T")


async def with_trainer(trainer: Any, body: Callable[[Any, Ready], Awaitable[T]]) -> T:
    """Start ``trainer`` (a swectl.actors.trainer.Trainer: its workers up and connected), return
    ``await body(trainer, ready)``, then stop it (its ranks with it), also when the body fails. (Typed loosely:
    swectl.testing sits below the actors and does not import them.)"""
    async with anyio.create_task_group() as tg:
        ready = await tg.start(trainer.run)
        try:
            return await body(trainer, ready)
        finally:
            tg.cancel_scope.cancel()
    raise AssertionError("unreachable")  # the task group only ends through the return or an exception
