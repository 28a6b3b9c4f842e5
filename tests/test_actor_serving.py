"""ServingActor (actors/serving.py): the Grader's, Rollout's and Judge's shape: calls are served only while
``run()`` is alive in a task group."""

from __future__ import annotations

import anyio
import pytest

from swectl.actors.serving import ServingActor


class Echo(ServingActor):
    """A served call that answers once the actor runs."""

    async def echo(self, value: int) -> int:
        await self._check_running()
        return value


def test_calls_are_served_only_while_running() -> None:
    async def main() -> None:
        echo = Echo()
        with pytest.raises(RuntimeError, match=r"the Echo is not running: start it with `await tg.start\(echo.run\)`"):
            await echo.echo(1)
        async with anyio.create_task_group() as tg:
            await tg.start(echo.run)
            assert await echo.echo(2) == 2
            tg.cancel_scope.cancel()
        with pytest.raises(RuntimeError, match="not running"):  # stopped with its task group
            await echo.echo(3)

    anyio.run(main)


def test_a_cancelled_caller_gets_its_cancellation_not_the_error() -> None:
    async def main() -> None:
        echo = Echo()
        with anyio.CancelScope() as scope:
            scope.cancel()
            await echo.echo(1)  # the checkpoint before the error delivers the cancel
        assert scope.cancelled_caught

    anyio.run(main)
