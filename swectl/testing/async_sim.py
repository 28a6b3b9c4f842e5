"""The RL loop's scheduling in simulated time: episodes with long-tailed durations on a fixed number of rollout
slots, a trainer with a fixed step cost, and the real admission rules (swectl/rl/admission.py) deciding what
starts and what is trained. For `just bench async` and the admission tests; no sandboxes, engines or clocks.

Policies:
- ``bounded`` (k = ``max_staleness``): swectl's rule. k = 0 is the synchronous loop: a step's groups start
  together, the trainer waits for the slowest, the slots wait for the trainer.
- ``drop_stale`` (k): the common alternative: groups start whenever a slot is free, the trainer trains whatever
  finished first, and a sample staler than k when its turn comes is thrown away. Its batches lean toward fast
  episodes; the simulation shows how much, against the population's mean reward.

Each task has a solve probability drawn from Beta(alpha, beta) (its samples share it, as a GRPO group's do);
a sample resolves with that probability and takes ``exp(N(mu, sigma))`` seconds, times ``failure_slowdown``
when it fails (failed agents tend to run into the step limit). Rewards are 1 / 0.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import Counter
from typing import Literal

import msgspec

from swectl.rl.admission import Admission, Ticket


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    """One simulated run: the loop's shape, the episodes' distribution and the trainer's cost."""
    policy: Literal["bounded", "drop_stale"] = "bounded"
    max_staleness: int = 0
    steps: int = 200  # trainer steps to take (equal samples trained across policies)
    groups_per_step: int = 4
    group_size: int = 4
    slots: int = 8  # episodes sampled at once (rollout concurrency)
    mu: float = 2.5  # log-seconds of an episode (median e^mu)
    sigma: float = 1.0
    failure_slowdown: float = 1.5
    alpha: float = 2.0  # task solve probability ~ Beta(alpha, beta)
    beta: float = 2.0
    train_s: float = 6.0  # one trainer step, weight sync included
    seed: int = 0


class SimResult(msgspec.Struct, kw_only=True):
    """What a simulated run measured."""
    policy: str
    max_staleness: int
    steps: int
    wall_s: float
    trainer_busy_s: float
    trainer_idle_frac: float
    slot_idle_frac: float
    samples_trained: int
    samples_dropped: int
    trained_reward_mean: float
    population_reward_mean: float  # the mean reward of every sample the run drew (started or not, trained or not)
    expected_reward_mean: float  # a sample's expected reward: alpha / (alpha + beta)
    reward_bias: float  # (trained - population) / population
    staleness: dict[int, int]  # staleness -> samples trained


class _Group(msgspec.Struct, kw_only=True):
    ticket: Ticket | None
    version: int
    rewards: list[float]
    left: int


def simulate(cfg: SimConfig) -> SimResult:
    """Run ``cfg.steps`` trainer steps in simulated time; every number is a function of ``cfg`` (seeded)."""
    rng = random.Random(cfg.seed)
    batch = cfg.groups_per_step * cfg.group_size
    bounded = cfg.policy == "bounded"
    admission = Admission(cfg.max_staleness, batch) if bounded else None
    events: list[tuple[float, int, _Group]] = []  # (finish time, tie-break, group or _TRAINER)
    order = itertools.count()
    queue: list[_Group] = []  # groups with samples still waiting for a slot
    waiting: list[int] = []  # samples of each queued group not yet on a slot
    finished: list[_Group] = []  # drop_stale: finished groups in finish order
    now = 0.0
    free = cfg.slots
    placed: list[tuple[float, float]] = []  # (start, duration) of every sample put on a slot
    trainer_free_at = 0.0
    trainer_busy = 0.0
    version = 0
    trained: list[float] = []
    drawn: list[float] = []
    dropped = 0
    staleness: Counter[int] = Counter()

    def new_group() -> _Group:
        p = rng.betavariate(cfg.alpha, cfg.beta)
        rewards = [1.0 if rng.random() < p else 0.0 for _ in range(cfg.group_size)]
        drawn.extend(rewards)
        return _Group(ticket=None, version=version, rewards=rewards, left=cfg.group_size)

    def place() -> None:
        """Put waiting samples on free slots, oldest group first."""
        nonlocal free
        while free and queue:
            group = queue[0]
            k = cfg.group_size - waiting[0]
            waiting[0] -= 1
            if waiting[0] == 0:
                queue.pop(0)
                waiting.pop(0)
            reward = group.rewards[k]
            duration = math.exp(rng.gauss(cfg.mu, cfg.sigma)) * (1.0 if reward else cfg.failure_slowdown)
            heapq.heappush(events, (now + duration, next(order), group))
            free -= 1
            placed.append((now, duration))

    def admit() -> None:
        """Start groups while the policy allows: the synchronous loop a whole step's at once, once the trainer is
        done; the asynchronous ones while a free slot would take them."""
        if bounded:
            assert admission is not None
            if cfg.max_staleness == 0:
                if admission.room() < admission.limit or now < trainer_free_at:
                    return
                while admission.can_start(cfg.group_size):
                    start(admission.start(cfg.group_size))
                return
            while admission.can_start(cfg.group_size) and sum(waiting) < free:
                start(admission.start(cfg.group_size))
        else:
            while sum(waiting) < free:
                start(None)

    def start(ticket: Ticket | None) -> None:
        group = new_group()
        group.ticket = ticket
        queue.append(group)
        waiting.append(cfg.group_size)

    def train_step() -> bool:
        """Take a step if one may start now; True when it did."""
        nonlocal trainer_free_at, trainer_busy, version, dropped
        if now < trainer_free_at:
            return False
        if bounded:
            assert admission is not None
            if not admission.ready():
                return False
            taken = admission.take()
            groups = [g for t in taken for g in by_ticket.pop(t.id, [])]
        else:
            fresh = [g for g in finished if version - g.version <= cfg.max_staleness]
            dropped += sum(len(g.rewards) for g in finished) - sum(len(g.rewards) for g in fresh)
            finished[:] = fresh
            if len(finished) < cfg.groups_per_step:
                return False
            groups, finished[:] = finished[:cfg.groups_per_step], finished[cfg.groups_per_step:]
        for g in groups:
            trained.extend(g.rewards)
            staleness[version - g.version] += len(g.rewards)
        if not bounded:
            version += 1
        else:
            assert admission is not None
            version = admission.version
        trainer_free_at = now + cfg.train_s
        trainer_busy += cfg.train_s
        heapq.heappush(events, (trainer_free_at, next(order), _TRAINER))
        return True

    by_ticket: dict[int, list[_Group]] = {}
    steps_done = 0
    admit()
    place()
    while steps_done < cfg.steps:
        if not events:
            raise RuntimeError(f"simulation stalled at step {steps_done} (no event pending): a scheduling deadlock")
        now, _, group = heapq.heappop(events)
        if group is not _TRAINER:
            free += 1
            group.left -= 1
            if group.left == 0:
                if bounded:
                    assert admission is not None and group.ticket is not None
                    admission.finish(group.ticket)
                    by_ticket.setdefault(group.ticket.id, []).append(group)
                else:
                    finished.append(group)
        steps_done += train_step()
        admit()
        place()
    wall = max(now, trainer_free_at)
    population = sum(drawn) / len(drawn)
    mean = sum(trained) / len(trained)
    slot_busy = sum(min(start + d, wall) - start for start, d in placed)
    return SimResult(
        policy=cfg.policy, max_staleness=cfg.max_staleness, steps=steps_done, wall_s=round(wall, 3),
        trainer_busy_s=round(trainer_busy, 3), trainer_idle_frac=round(1 - trainer_busy / wall, 4),
        slot_idle_frac=round(1 - slot_busy / (cfg.slots * wall), 4),
        samples_trained=len(trained), samples_dropped=dropped, trained_reward_mean=round(mean, 4),
        population_reward_mean=round(population, 4),
        expected_reward_mean=round(cfg.alpha / (cfg.alpha + cfg.beta), 4),
        reward_bias=round((mean - population) / population, 4),
        staleness=dict(sorted(staleness.items())))


_TRAINER = _Group(ticket=None, version=-1, rewards=[], left=-1)  # the trainer's "step done" event
