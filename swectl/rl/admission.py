"""Bounded staleness by admission control (docs/architecture.md 8.5): the two rules of the asynchronous RL loop,
as pure state.

A *group* is the unit the loop starts and trains: ``n`` samples of one task (GRPO needs them together). The
trainer's *version* counts its steps from 0; a sample's *staleness* is the version it is trained at minus the
version its group started at.

- **Start.** A new group of ``n`` samples starts only while ``outstanding + n <= (max_staleness + 1) * batch``,
  where ``outstanding`` counts the samples accepted into the buffer and not yet trained plus those still being
  sampled, and ``batch`` is the samples of one step. With every step training ``batch`` samples this is the rule
  of docs/architecture.md 8.5, ``accepted + running <= (max_staleness + version + 1) * batch`` (accepted counted
  since the run began);
  counted as outstanding it also holds when a step trains fewer (the sampling-round cap). ``max_staleness = 0``
  is synchronous on-policy RL: the next step's groups start once this step's are trained.
- **Train.** Every group has a deadline: the step at version ``start + max_staleness``. The step at version ``v``
  takes finished groups earliest deadline first, at most ``batch`` samples, and waits for running groups while
  taking the finished ones now would leave, for some deadline D, more samples due by D than the steps up to D
  can train (``(D - v) * batch``; ``Admission.blocking``). That includes every running group whose deadline is
  ``v`` itself, and groups younger ones would crowd out later. So no sample is ever staler than
  ``max_staleness`` and none is discarded for its age: a slow episode is waited for, at most ``max_staleness``
  steps late, which keeps slow, often failing, episodes in the batches in their true share (a drop-stale policy
  trains on the fast ones). The start rule keeps this schedule feasible: it never admits more than
  ``(max_staleness + 1) * batch`` samples that are due by any deadline.

Groups that finish with nothing to train (all ABORTED, or dropped by dynamic sampling) give their room back.
"""

from __future__ import annotations

import heapq
import itertools

import msgspec


class Ticket(msgspec.Struct, frozen=True, kw_only=True):
    """One admitted group: its id (admission order), its size and the trainer version it started at."""
    id: int
    samples: int
    version: int


class AdmissionStatistics(msgspec.Struct, kw_only=True):
    """What the admission holds now (for the progress line and metrics)."""
    version: int
    running_samples: int
    buffered_samples: int
    limit: int  # outstanding samples allowed: (max_staleness + 1) * batch


class Admission:
    """The start and train rules of one run. ``batch``: samples per trainer step; ``max_staleness``: k >= 0."""

    def __init__(self, max_staleness: int, batch: int, *, version: int = 0) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if batch < 1:
            raise ValueError(f"batch must be >= 1 sample, got {batch}")
        self.max_staleness = max_staleness
        self.batch = batch
        self.version = version
        self._ids = itertools.count()
        self._running: dict[int, Ticket] = {}
        self._buffered: list[tuple[int, int, Ticket]] = []  # heap of (start version, id, ticket): oldest first
        self._running_samples = 0
        self._buffered_samples = 0

    # ------------------------------------------------------------ start

    @property
    def limit(self) -> int:
        return (self.max_staleness + 1) * self.batch

    def room(self) -> int:
        """Samples that may still start now."""
        return self.limit - self._running_samples - self._buffered_samples

    def can_start(self, samples: int) -> bool:
        return 0 < samples <= self.room()

    def start(self, samples: int) -> Ticket:
        """Admit a group of ``samples``; ValueError when the rule forbids it (ask ``can_start`` first)."""
        if samples > self.batch:
            raise ValueError(f"a group of {samples} samples is larger than a batch ({self.batch}): it could never "
                             "be trained whole")
        if not self.can_start(samples):
            raise ValueError(f"admission: {samples} more samples would make {self.limit - self.room() + samples} "
                             f"outstanding, over the limit {self.limit} = (max_staleness {self.max_staleness} + 1) "
                             f"x batch {self.batch}")
        ticket = Ticket(id=next(self._ids), samples=samples, version=self.version)
        self._running[ticket.id] = ticket
        self._running_samples += samples
        return ticket

    def finish(self, ticket: Ticket, *, trainable: bool = True) -> None:
        """The group is sampled (and graded). ``trainable`` False: nothing of it will be trained (aborted,
        uninformative), so its room is given back at once."""
        if self._running.pop(ticket.id, None) is None:
            raise ValueError(f"group {ticket.id} is not running")
        self._running_samples -= ticket.samples
        if trainable:
            heapq.heappush(self._buffered, (ticket.version, ticket.id, ticket))
            self._buffered_samples += ticket.samples

    # ------------------------------------------------------------ train

    def _plan(self) -> list[Ticket]:
        """The next step's groups if it ran now: finished groups, oldest first, up to ``batch`` samples."""
        plan: list[Ticket] = []
        size = 0
        for _, _, ticket in sorted(self._buffered):
            if size + ticket.samples > self.batch:
                break
            plan.append(ticket)
            size += ticket.samples
        return plan

    def blocking(self) -> list[Ticket]:
        """Running groups the next step must wait for; empty when it may run (given a full batch).

        A group started at version s must be trained by the step at version s + max_staleness (its deadline).
        After the next step (version v) the steps v+1 .. D train at most (D - v) * batch samples, so for every
        deadline D the samples left untrained with a deadline <= D must fit in them. When taking the finished
        groups now would break that (they are younger than groups still running), the step waits for the
        running groups with the earliest deadlines."""
        taken = {t.id for t in self._plan()}
        left = sorted([(t.version, t) for t in self._running.values()]
                      + [(t.version, t) for _, _, t in self._buffered if t.id not in taken], key=lambda x: x[0])
        count = 0
        for i, (started, ticket) in enumerate(left):
            count += ticket.samples
            deadline = started + self.max_staleness
            if count > max(deadline - self.version, 0) * self.batch:
                return [t for s, t in left[: i + 1] if t.id in self._running]
        return []

    def ready(self) -> bool:
        """May the next step be taken now: a full batch is buffered and no running group must be waited for."""
        return self._buffered_samples >= self.batch and not self.blocking()

    def take(self) -> list[Ticket]:
        """The next step's groups, oldest first, up to ``batch`` samples; the version moves on by one. Call when
        ``ready()`` (a step may also be forced with less, at the end of a run, when nothing blocks it)."""
        waits = self.blocking()
        if waits:
            raise ValueError(f"step {self.version + 1} must wait for {len(waits)} running group(s), the oldest "
                             f"started at version {min(t.version for t in waits)}")
        taken = self._plan()
        ids = {t.id for t in taken}
        self._buffered = [entry for entry in self._buffered if entry[2].id not in ids]
        heapq.heapify(self._buffered)
        self._buffered_samples -= sum(t.samples for t in taken)
        self.version += 1
        return taken

    def statistics(self) -> AdmissionStatistics:
        return AdmissionStatistics(version=self.version, running_samples=self._running_samples,
                                   buffered_samples=self._buffered_samples, limit=self.limit)
