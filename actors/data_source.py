"""The DataSource actor: hands out training tasks in epochs, each epoch a seeded shuffle, and keeps a cursor so
that a resumed run neither repeats nor skips a task (docs/architecture.md 8.7).

The order depends only on (seed, epoch) and the task ids, so the cursor (epoch, index) is all a checkpoint
needs; the ids handed out are also kept (``consumed``) so a run's records can be checked against it.

A task can be marked to be passed over (``pass_over``, by GRPO when its group's rewards were all equal, with
``train.sampling.pass_over_uninformative``): the next time the order reaches it, it is not handed out (once; the
mark goes), and the task after it is. The marks are part of the cursor, so a resumed run passes over the same tasks.

Consumes: ``next(n)`` calls. Produces: tasks, ``cursor`` (a DataCursor to checkpoint), ``statistics()``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import msgspec

from swectl.errors import ConfigError
from swectl.schema import DataSourceStatistics
from swectl.tasks.record import Task


class DataCursor(msgspec.Struct, kw_only=True):
    """Where the data source stands: the epoch, the position in that epoch's order and the ids handed out.
    ``pending``: ids handed out whose groups were not trained yet when the cursor was saved (the async loop's
    groups in flight or buffered); a resumed source hands them out again first, without counting them twice."""

    epoch: int = 0
    index: int = 0
    consumed: list[str] = []
    pending: list[str] = []
    pass_over: list[str] = []  # ids not handed out the next time the order reaches them (once)


def split_tasks(tasks: Sequence[Task], test_fraction: float, seed: int) -> tuple[list[Task], list[Task]]:
    """A seeded train/test split by instance id (stable when the task file is reordered)."""
    ordered = sorted(tasks, key=lambda t: t.instance_id)
    random.Random(f"split:{seed}").shuffle(ordered)
    n_test = round(len(ordered) * test_fraction)
    if test_fraction > 0 and len(ordered) > 1:
        n_test = min(max(n_test, 1), len(ordered) - 1)
    return ordered[n_test:], ordered[:n_test]


class DataSource:
    """Tasks in seeded-shuffled epochs, from a cursor."""

    def __init__(self, tasks: Sequence[Task], *, seed: int, cursor: DataCursor | None = None) -> None:
        if not tasks:
            raise ConfigError("the training split has no tasks; lower train.data.test_fraction or give more tasks")
        self._tasks = sorted(tasks, key=lambda t: t.instance_id)
        self._seed = seed
        self.cursor = cursor or DataCursor()
        self._order = self._epoch_order(self.cursor.epoch)

    def _epoch_order(self, epoch: int) -> list[Task]:
        order = list(self._tasks)
        random.Random(f"epoch:{self._seed}:{epoch}").shuffle(order)
        return order

    def next(self, n: int) -> list[Task]:
        """The next ``n`` tasks: first the pending ones of a resumed cursor, then in order (crossing into the next
        epoch as needed)."""
        out: list[Task] = []
        by_id = {t.instance_id: t for t in self._tasks} if self.cursor.pending else {}
        while len(out) < n and self.cursor.pending:
            instance = self.cursor.pending.pop(0)
            if instance not in by_id:
                raise ConfigError(f"the checkpoint's pending task {instance!r} is not in the training split; was the "
                                  "task file, train.data.test_fraction or train.data.split_seed changed since?")
            out.append(by_id[instance])
        while len(out) < n:
            if self.cursor.index >= len(self._order):
                self.cursor.epoch += 1
                self.cursor.index = 0
                self._order = self._epoch_order(self.cursor.epoch)
            task = self._order[self.cursor.index]
            self.cursor.index += 1
            if task.instance_id in self.cursor.pass_over:
                self.cursor.pass_over.remove(task.instance_id)
                continue
            self.cursor.consumed.append(task.instance_id)
            out.append(task)
        return out

    def pass_over(self, instance_id: str) -> None:
        """Do not hand out ``instance_id`` the next time the order reaches it (see the module docstring)."""
        if instance_id not in self.cursor.pass_over:
            self.cursor.pass_over.append(instance_id)

    def statistics(self) -> DataSourceStatistics:
        return DataSourceStatistics(tasks=len(self._tasks), epoch=self.cursor.epoch, index=self.cursor.index,
                                    consumed=len(self.cursor.consumed))
