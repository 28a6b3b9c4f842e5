"""Where a step's training samples come from: one small interface, one implementation per algorithm.

    SampleSource.next(step) -> StepSamples     the samples, the step's metrics and its steps.jsonl record
    SampleSource.save(state)                   its position into the run state (checkpointed, resumed)

- ``SftSource``: the SFT samples in seeded-shuffled epochs (``train.algorithm = "sft"``, and the first
  ``train.data.sft_steps`` steps of a grpo run).
- ``GroupSource``: synchronous GRPO: each step samples ``tasks_per_step`` groups with a learning signal
  (dynamic sampling: up to ``max_sampling_rounds`` rounds of drawing more tasks) on the current weights.
- ``FeedSource``: asynchronous GRPO (``train.sampling.max_staleness > 0``): groups keep running while the trainer
  trains (feed.py); each step takes the finished groups the admission rule picks.
"""

from __future__ import annotations

import random
from typing import Protocol

import msgspec

from swectl.actors.data_source import DataCursor, DataSource
from swectl.actors.rollout import EpisodeResult
from swectl.agent.metrics import agent_metrics
from swectl.config import ExperimentConfig, LossConfig, SamplingConfig
from swectl.errors import ConfigError
from swectl.rl.advantages import advantage_stats
from swectl.rl.batch import TrainSample
from swectl.rl.groups import Group, group_outcomes, group_samples
from swectl.tasks.record import Task
from swectl.train.checkpoint import RunState, step_name
from swectl.train.feed import GroupFeed
from swectl.train.rollouts import TrainRollouts, gather


class StepRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One line of steps.jsonl: what a step trained on (an SFT step its samples' uids; a GRPO step the tasks drawn,
    the groups kept and each group's rewards, by sample)."""

    step: int = 0
    samples: list[str] = []
    tasks: list[str] = []
    groups: list[str] = []
    rewards: dict[str, list[float]] = {}


class StepSamples(msgspec.Struct, kw_only=True):
    """One step's training samples, its metrics and what steps.jsonl records of it."""

    algorithm: str  # the loss they train with: "sft" or "grpo"
    samples: list[TrainSample]
    values: dict[str, float] = {}
    record: StepRecord = StepRecord()


class SampleSource(Protocol):
    """Where a step's samples come from: ``next(step)`` gives them, ``save(state)`` records the position."""

    async def next(self, step: int) -> StepSamples: ...

    def save(self, state: RunState) -> None: ...


class SftSource:
    """``batch_size`` samples per step in seeded-shuffled epochs, from the run state's SFT cursor."""

    def __init__(self, samples: list[TrainSample], *, batch_size: int, seed: int, cursor: DataCursor) -> None:
        if not samples:
            raise ConfigError('train.algorithm = "sft" needs train.data.sft_data (traj.json runs or messages JSONL)')
        self._samples = samples
        self._batch_size = batch_size
        self._seed = seed
        self._cursor = DataCursor(epoch=cursor.epoch, index=cursor.index)

    async def next(self, step: int) -> StepSamples:
        cur, samples = self._cursor, self._samples
        out: list[TrainSample] = []
        while len(out) < min(self._batch_size, len(samples)):
            order = list(range(len(samples)))
            random.Random(f"sft:{self._seed}:{cur.epoch}").shuffle(order)
            if cur.index >= len(order):
                cur.epoch, cur.index = cur.epoch + 1, 0
                continue
            out.append(samples[order[cur.index]])
            cur.index += 1
        return StepSamples(algorithm="sft", samples=out, record=StepRecord(samples=[s.uid for s in out]))

    def save(self, state: RunState) -> None:
        state.sft_cursor = DataCursor(epoch=self._cursor.epoch, index=self._cursor.index)


class GroupSource:
    """Synchronous GRPO: each step's groups are sampled on the weights of the step before."""

    def __init__(self, rollouts: TrainRollouts, tasks: DataSource, sampling: SamplingConfig,
                 experiment: ExperimentConfig, loss: LossConfig) -> None:
        self._rollouts = rollouts
        self._tasks = tasks
        self._sampling = sampling
        self._experiment = experiment
        self._loss = loss

    async def next(self, step: int) -> StepSamples:
        groups, results, info, tasks_seen = await self._collect(step)
        return _grpo_samples(groups, results, info, tasks_seen, self._sampling, self._experiment, self._loss)

    async def _collect(self, step: int) -> tuple[list[Group], list[EpisodeResult], dict[str, float], list[str]]:
        """``tasks_per_step`` groups with a signal; a group that cannot be completed is dropped.

        Dynamic sampling per slot: each of the step's ``tasks_per_step`` slots runs a group and, while its group is
        uninformative (or aborted) and it has had fewer than ``max_sampling_rounds`` tries, draws the next task at
        once, while the other slots' groups still run. Rounds over the whole step drew the same tasks (one more per
        unfilled slot), but only after the slowest group of the round: the engine idled through its tail. A group's
        episodes are seeded by its task, not by when it runs, so the groups are the same; they are kept, scored and
        trained in the order they were drawn."""
        s = self._sampling
        tries = s.max_sampling_rounds if s.dynamic_sampling else 1
        scored: dict[int, Group] = {}  # draw index -> scored group
        results: list[EpisodeResult] = []
        tasks_seen: list[str] = []
        dropped = {"uninformative": 0, "aborted": 0}
        rounds = 0
        out = self._rollouts.fresh(self._rollouts.run_dir / "episodes" / step_name(step))
        grader = self._rollouts.grader(out)
        rollout = self._rollouts.rollout(grader, str(step), out)

        def draw() -> tuple[int, Task]:
            (task,) = self._tasks.next(1)
            tasks_seen.append(task.instance_id)
            return len(tasks_seen) - 1, task

        async def slot(index: int, task: Task) -> None:
            nonlocal rounds
            for attempt in range(1, tries + 1):
                rounds = max(rounds, attempt)
                g = await self._rollouts.group(rollout, task, results)
                if g is None:
                    dropped["aborted"] += 1
                else:
                    # keyed by the draw index: the shuffled-reward control does not depend on which group ends first
                    self._rollouts.score(g, f"{step}:{g.instance_id}:{index}", out)
                    scored[index] = g
                    if not g.informative and s.pass_over_uninformative:
                        self._tasks.pass_over(g.instance_id)
                    if not s.dynamic_sampling or g.informative:
                        return
                    dropped["uninformative"] += 1
                if attempt < tries:
                    index, task = draw()

        first = [draw() for _ in range(s.tasks_per_step)]
        await gather([lambda i=i, t=t: slot(i, t) for i, t in first])
        every = [scored[i] for i in sorted(scored)]
        kept = [g for g in every if not s.dynamic_sampling or g.informative]
        info = {"groups": float(len(kept)), "sampling_rounds": float(rounds),
                "groups_dropped_uninformative": float(dropped["uninformative"]),
                "groups_dropped_aborted": float(dropped["aborted"])}
        info.update(group_outcomes(every))  # over every scored group (what the policy does), not only the kept ones
        return kept, results, info, tasks_seen

    def save(self, state: RunState) -> None:
        state.cursor = _cursor(self._tasks, [])


class FeedSource:
    """Asynchronous GRPO: the group feed runs beside the trainer; each step takes what the admission rule picks."""

    def __init__(self, feed: GroupFeed, tasks: DataSource, sampling: SamplingConfig,
                 experiment: ExperimentConfig, loss: LossConfig) -> None:
        self._feed = feed
        self._tasks = tasks
        self._sampling = sampling
        self._experiment = experiment
        self._loss = loss

    async def next(self, step: int) -> StepSamples:
        fed = await self._feed.next()
        return _grpo_samples(fed.groups, fed.results, fed.info, fed.tasks, self._sampling, self._experiment,
                             self._loss)

    def save(self, state: RunState) -> None:
        # the tasks drawn and not trained yet are redone after a resume
        state.cursor = _cursor(self._tasks, self._feed.pending_ids())


def _cursor(tasks: DataSource, pending: list[str]) -> DataCursor:
    return msgspec.structs.replace(tasks.cursor, consumed=list(tasks.cursor.consumed),
                                   pending=[*pending, *tasks.cursor.pending], pass_over=list(tasks.cursor.pass_over))


def _grpo_samples(groups: list[Group], results: list[EpisodeResult], info: dict[str, float], tasks_seen: list[str],
                  sampling: SamplingConfig, experiment: ExperimentConfig, loss: LossConfig) -> StepSamples:
    samples = group_samples(groups, mode=sampling.sample_mode, experiment=experiment, loss=loss)
    values = {**info, **rollout_values(groups, results)}
    record = StepRecord(tasks=tasks_seen, groups=[g.instance_id for g in groups],
                        rewards={g.instance_id: list(g.rewards) for g in groups})
    return StepSamples(algorithm="grpo", samples=samples, values=values, record=record)


def rollout_values(groups: list[Group], results: list[EpisodeResult]) -> dict[str, float]:
    """A GRPO step's rollout metrics: advantages, episode outcomes, agent behaviour, the judge's scores."""
    values: dict[str, float] = {}
    advs = [a for g in groups for a in g.advantages]
    values.update({f"adv/{k}": v for k, v in advantage_stats(advs).items()})
    values["episodes"] = float(len(results))
    values["aborted"] = float(sum(r.outcome == "ABORTED" for r in results))
    values["truncated"] = float(sum(r.outcome == "TRUNCATED" for r in results))
    values.update(agent_metrics(results))
    judged = [j for r in results for j in r.step_judgements]
    if judged:  # [reward.prm]
        scores = [j.score for j in judged if j.score is not None]
        answers = sum(len(j.votes) + j.unparseable + j.failures for j in judged)
        values["prm/steps"] = float(len(judged))
        values["prm/scored_frac"] = len(scores) / len(judged)
        values["prm/score_mean"] = sum(scores) / len(scores) if scores else 0.0
        values["prm/unparseable_frac"] = sum(j.unparseable for j in judged) / max(answers, 1)
        values["prm/failures"] = float(sum(j.failures for j in judged))
    return values
