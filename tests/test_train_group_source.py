"""Synchronous GRPO's step collection (swectl/train/sources.py GroupSource) with the real DataSource and group
scoring; each group is played by a scripted coroutine (its task's outcome and duration, in real time scaled down)
in place of the rollouts' sandboxes and engine. Dynamic sampling redraws per slot: an uninformative group's slot
starts its next task while the other slots' groups still run, and the step draws, keeps and orders exactly the
groups that whole-step rounds did."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from swectl.actors.data_source import DataSource
from swectl.config import ExperimentConfig, LossConfig, SamplingConfig
from swectl.rl.groups import GradedEpisode, Group, score_group
from swectl.tasks.record import Task
from swectl.train.rollouts import fresh_folder
from swectl.train.sources import GroupSource

TASKS = [Task(instance_id=f"t{i:02d}", repo="r/r", problem_statement="fix", FAIL_TO_PASS=["x"]) for i in range(12)]


class _Idle:
    """A grader or rollout actor: started, then idle until the step's task group is cancelled."""

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await anyio.sleep_forever()


class ScriptedRollouts:
    """TrainRollouts' interface for GroupSource: ``plan`` says per task its rewards (None: the group aborts) and
    how long its group runs; ``log`` records (event, task, monotonic time)."""

    def __init__(self, run_dir: Path, plan: dict[str, tuple[list[float] | None, float]]) -> None:
        self.run_dir = run_dir
        self.plan = plan
        self.log: list[tuple[str, str, float]] = []
        self.score_keys: list[str] = []

    def fresh(self, out: Path) -> Path:
        return fresh_folder(self.run_dir, out)

    def grader(self, out: Path) -> _Idle:
        return _Idle()

    def rollout(self, grader: Any, tag: str, out: Path) -> _Idle:
        return _Idle()

    async def group(self, rollout: Any, task: Task, results: list) -> Group | None:  # type: ignore[type-arg]
        rewards, seconds = self.plan[task.instance_id]
        self.log.append(("start", task.instance_id, time.monotonic()))
        await anyio.sleep(seconds)
        self.log.append(("end", task.instance_id, time.monotonic()))
        if rewards is None:
            return None
        episodes = [GradedEpisode(instance_id=task.instance_id, sample=k, outcome="COMPLETED", resolved=r > 0,
                                  token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0])
                    for k, r in enumerate(rewards)]
        return Group(instance_id=task.instance_id, episodes=episodes)

    def score(self, group: Group, key: str, out: Path) -> None:
        score_group(group)
        self.score_keys.append(key)


def _source(tmp_path: Path, plan: dict, **sampling: Any) -> tuple[GroupSource, ScriptedRollouts, DataSource]:  # type: ignore[type-arg]
    rollouts = ScriptedRollouts(tmp_path, plan)
    tasks = DataSource(TASKS, seed=0)
    source = GroupSource(rollouts, tasks, SamplingConfig(**sampling), ExperimentConfig(),  # type: ignore[arg-type]
                         LossConfig())
    return source, rollouts, tasks


def _rounds_reference(order: list[str], plan: dict, tasks_per_step: int,  # type: ignore[type-arg]
                      max_rounds: int) -> tuple[list[str], list[str]]:
    """What whole-step rounds draw and keep: round r draws one task per slot not yet filled, after round r-1."""
    drawn: list[str] = []
    kept: list[str] = []
    for _ in range(max_rounds):
        want = tasks_per_step - len(kept)
        if want == 0:
            break
        batch = order[len(drawn):len(drawn) + want]
        drawn += batch
        kept += [t for t in batch if plan[t][0] is not None and len(set(plan[t][0])) > 1]
    return drawn, kept


def test_an_uninformative_slot_draws_again_while_the_others_still_run(tmp_path: Path) -> None:
    order = [t.instance_id for t in DataSource(TASKS, seed=0).next(6)]
    plan = {t.instance_id: ([1.0, 0.0], 0.05) for t in TASKS}
    plan[order[0]] = ([0.0, 0.0], 0.01)  # slot 0: all fail at once -> draws order[4]
    plan[order[1]] = ([1.0, 0.0], 0.4)  # slot 1: the slow group of the step
    source, rollouts, _ = _source(tmp_path, plan, tasks_per_step=4, n_samples=2, max_sampling_rounds=2)
    step = anyio.run(source.next, 1)
    when = {(event, task): t for event, task, t in rollouts.log}
    assert when[("start", order[4])] < when[("end", order[1])]  # the redraw did not wait for the round's tail
    assert step.record.tasks == order[:5]
    assert step.record.groups == [order[1], order[2], order[3], order[4]]  # in draw order, not finish order
    assert step.values["sampling_rounds"] == 2.0
    assert step.values["groups_dropped_uninformative"] == 1.0
    assert len(step.samples) == 8


@pytest.mark.parametrize("seed", range(6))
def test_slots_draw_and_keep_what_rounds_did(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    order = [t.instance_id for t in DataSource(TASKS, seed=0).next(12)]
    plan: dict = {}  # type: ignore[type-arg]
    for name in order:
        kind = rng.choice(["mixed", "mixed", "all0", "all1", "aborted"])
        rewards = {"mixed": [1.0, 0.0, 0.0], "all0": [0.0] * 3, "all1": [1.0] * 3, "aborted": None}[kind]
        plan[name] = (rewards, rng.uniform(0.0, 0.03))
    source, rollouts, _ = _source(tmp_path, plan, tasks_per_step=3, n_samples=3, max_sampling_rounds=3)
    step = anyio.run(source.next, 7)
    drawn, kept = _rounds_reference(order, plan, 3, 3)
    assert sorted(step.record.tasks) == sorted(drawn)
    assert step.record.groups == [t for t in order if t in kept]
    assert step.values["groups"] == float(len(kept))
    aborted = sum(plan[t][0] is None for t in drawn)
    assert step.values["groups_dropped_aborted"] == float(aborted)
    assert step.values["groups_dropped_uninformative"] == float(len(drawn) - len(kept) - aborted)
    # a group's shuffle key names its draw index, whichever group finished first
    assert sorted(rollouts.score_keys) == sorted(f"7:{t}:{drawn.index(t)}" for t in drawn if plan[t][0] is not None)


def test_without_dynamic_sampling_every_completed_group_is_kept_once(tmp_path: Path) -> None:
    order = [t.instance_id for t in DataSource(TASKS, seed=0).next(4)]
    plan = {t.instance_id: ([0.0, 0.0], 0.01) for t in TASKS}
    plan[order[2]] = (None, 0.01)
    source, _, _ = _source(tmp_path, plan, tasks_per_step=4, n_samples=2, dynamic_sampling=False,
                           max_sampling_rounds=3)
    step = anyio.run(source.next, 1)
    assert step.record.tasks == order
    assert step.record.groups == [order[0], order[1], order[3]]
    assert step.values["sampling_rounds"] == 1.0
    assert step.values["groups_dropped_aborted"] == 1.0


def test_a_task_without_signal_is_passed_over_at_its_next_turn_when_asked(tmp_path: Path) -> None:
    order = [t.instance_id for t in DataSource(TASKS, seed=0).next(24)]  # two epochs of 12
    plan = {t.instance_id: ([1.0, 0.0], 0.01) for t in TASKS}
    solved = order[1]
    plan[solved] = ([1.0, 1.0], 0.01)
    for passing in (False, True):
        source, _, tasks = _source(tmp_path, plan, tasks_per_step=4, n_samples=2, max_sampling_rounds=2,
                                   pass_over_uninformative=passing)
        drawn = [t for step in range(1, 7) for t in anyio.run(source.next, step).record.tasks]
        assert drawn.count(solved) == (1 if passing else 2), drawn  # epoch 2 passes it over
        assert tasks.cursor.pass_over == []
