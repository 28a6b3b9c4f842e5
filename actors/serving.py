"""The shape shared by actors that serve calls from other actors (Grader, Rollout, Judge): alive while their
``run()`` is in a task group, refusing calls before it starts and after it stops.

Consumes: nothing of its own. Produces: ``run()`` for ``await tg.start(actor.run)`` and ``_check_running()`` for
each served call (a caller that is being cancelled gets the cancellation, not the error).
"""

from __future__ import annotations

import anyio
import anyio.abc
import anyio.lowlevel


class ServingActor:
    """Base of an actor whose methods other actors call: ``run()`` marks it alive until its task group cancels it."""

    def __init__(self) -> None:
        self._running = False

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve calls until cancelled."""
        self._running = True
        try:
            task_status.started()
            await anyio.sleep_forever()
        finally:
            self._running = False

    async def _check_running(self) -> None:
        """Raise RuntimeError unless ``run()`` is alive (after a checkpoint: a cancelled caller sees its cancel)."""
        if not self._running:
            await anyio.lowlevel.checkpoint()
            name = type(self).__name__
            raise RuntimeError(f"the {name} is not running: start it with `await tg.start({name.lower()}.run)`")
