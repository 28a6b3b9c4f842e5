"""The asynchronous loop's supply of groups (``train.sampling.max_staleness > 0``, docs/architecture.md 8.5).

Groups start whenever the admission rule (swectl/rl/admission.py) has room, are sampled and graded while the
trainer trains, and wait scored in a buffer; each step takes the ones the rule picks (oldest first, waiting for a
running group only when it would otherwise be trained too stale). Weight updates land between engine requests
while episodes run, so an episode may span versions; its tokens keep the version that sampled them, and the
trainer's truncated importance sampling against the rollout logprobs corrects for the difference.

Groups that turn out to carry nothing to train (every episode ABORTED, or dynamic sampling's equal rewards) give
their room back at once. When ``drop_cap`` of them have been dropped since the last step, the step trains on what
is buffered rather than wait on (the synchronous loop's ``max_sampling_rounds`` cap).

Checkpoints save ``pending_ids()``, the tasks drawn but not yet trained (running or buffered), in the data cursor;
a resumed run hands them out again first: in-flight episodes are rerun, and each task is counted once.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc
import msgspec

from swectl.actors.data_source import DataSource
from swectl.actors.rollout import EpisodeResult
from swectl.rl.admission import Admission, Ticket
from swectl.rl.groups import Group, group_outcomes
from swectl.tasks.record import Task

# (task, its draw number) -> its scored group (None: not enough episodes finished) and every episode it ran
RunGroup = Callable[[Task, int], Awaitable[tuple[Group | None, list[EpisodeResult]]]]


class FeedBatch(msgspec.Struct, kw_only=True):
    """One step's groups, with what happened to the groups that finished since the last step."""
    groups: list[Group]
    results: list[EpisodeResult]  # every episode of the groups taken and of those dropped since the last step
    tasks: list[str]  # tasks finished since the last step: the taken groups' and the dropped ones'
    staleness: list[int]  # per taken group: the version it is trained at minus the version it started at
    info: dict[str, float]


class _Done(msgspec.Struct, kw_only=True):
    ticket: Ticket
    instance_id: str
    group: Group | None
    results: list[EpisodeResult]


class GroupFeed:
    """Start with ``await tg.start(feed.run)``; then ``await feed.next()`` once per step."""

    def __init__(self, admission: Admission, source: DataSource, run_group: RunGroup, *, group_size: int,
                 dynamic_sampling: bool, drop_cap: int, draws: int = 0) -> None:
        self._admission = admission
        self._source = source
        self._run_group = run_group
        self._n = group_size
        self._dynamic = dynamic_sampling
        self._drop_cap = drop_cap
        self._draws = draws  # groups drawn so far in this run (names their folders, engine routes and seeds)
        self._changed = anyio.Event()
        self._running: dict[int, str] = {}  # ticket id -> instance id
        self._buffered: dict[int, _Done] = {}
        self._dropped: list[_Done] = []
        self._aborted_since = 0
        self._idle_since: float | None = time.monotonic()  # no group running since then
        self._idle_s = 0.0

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start groups while the admission rule has room, until cancelled (the groups running are cancelled too)."""
        async with anyio.create_task_group() as tg:
            task_status.started()
            while True:
                while not self._admission.can_start(self._n) or self._forced_step_due():
                    await self._changed.wait()
                (task,) = self._source.next(1)
                ticket = self._admission.start(self._n)
                self._running[ticket.id] = task.instance_id
                if self._idle_since is not None:
                    self._idle_s += time.monotonic() - self._idle_since
                    self._idle_since = None
                tg.start_soon(self._one, task, ticket, self._draws, name=f"group {task.instance_id}")
                self._draws += 1

    async def _one(self, task: Task, ticket: Ticket, draw: int) -> None:
        group, results = await self._run_group(task, draw)
        trainable = group is not None and (group.informative or not self._dynamic)
        self._admission.finish(ticket, trainable=trainable)
        del self._running[ticket.id]
        if not self._running:
            self._idle_since = time.monotonic()
        done = _Done(ticket=ticket, instance_id=task.instance_id, group=group, results=results)
        if trainable:
            self._buffered[ticket.id] = done
        else:
            self._dropped.append(done)
        self._notify()

    def _forced_step_due(self) -> bool:
        """A step with less than a batch is due (drop_cap groups dropped) but waits for running groups: no new group
        starts until it is taken. Without this the feed kept the pipeline full of groups at the old version, each
        dropped in turn, and with a weak policy the step never came (docs/results.md, "The SSH-node chaos soak")."""
        return len(self._dropped) >= self._drop_cap and bool(self._buffered) and bool(self._admission.blocking())

    def _may_step(self) -> bool:
        if self._admission.ready():
            return True
        # drop_cap groups dropped since the last step: train on what there is, or, with nothing buffered, make a
        # step with no update (the policy's version stays, so no group grows staler)
        if len(self._dropped) < self._drop_cap:
            return False
        return not self._buffered or not self._admission.blocking()

    async def next(self) -> FeedBatch:
        """The next step's groups: waits while the admission rule says so (each wait ends when a group finishes;
        episodes are bounded by their own limits and timeouts)."""
        t0 = time.monotonic()
        while not self._may_step():
            await self._changed.wait()
        waited = time.monotonic() - t0
        version = self._admission.version
        taken = [self._buffered.pop(t.id) for t in self._admission.take()] if self._buffered else []
        dropped, self._dropped = self._dropped, []
        self._notify()  # room for new groups
        idle = self._idle_s + (time.monotonic() - self._idle_since if self._idle_since is not None else 0.0)
        self._idle_s = 0.0
        if self._idle_since is not None:
            self._idle_since = time.monotonic()
        staleness = [version - d.ticket.version for d in taken]
        episodes = [e for d in taken if d.group is not None for e in d.group.episodes]
        info = {
            "groups": float(len(taken)),
            "groups_dropped_uninformative": float(sum(d.group is not None for d in dropped)),
            "groups_dropped_aborted": float(sum(d.group is None for d in dropped)),
            "trainer_wait_s": waited,
            "rollout_idle_s": idle,
            "staleness_mean": sum(staleness) / max(len(staleness), 1),
            "staleness_max": float(max(staleness, default=0)),
            "groups_running": float(len(self._running)),
            "groups_buffered": float(len(self._buffered)),
            "episodes_mixed_versions_frac": (sum(e.mixed_versions for e in episodes) / max(len(episodes), 1)),
        }
        for k in range(self._admission.max_staleness + 1):
            info[f"staleness/{k}_frac"] = sum(s == k for s in staleness) / max(len(staleness), 1)
        info.update(group_outcomes([d.group for d in (*taken, *dropped) if d.group is not None]))
        return FeedBatch(groups=[d.group for d in taken if d.group is not None],
                         results=[r for d in (*taken, *dropped) for r in d.results],
                         tasks=[d.instance_id for d in (*taken, *dropped)], staleness=staleness, info=info)

    def pending_ids(self) -> list[str]:
        """Tasks drawn but not trained yet (running or buffered), oldest first: what a checkpoint must redo."""
        ids = sorted([(tid, instance) for tid, instance in self._running.items()]
                     + [(tid, d.instance_id) for tid, d in self._buffered.items()]
                     + [(d.ticket.id, d.instance_id) for d in self._dropped])
        return [instance for _, instance in ids]

    @property
    def draws(self) -> int:
        return self._draws
