"""Episodes end to end with the replay policy: the agent loop, real sandboxes and the grader. Replayed gold
trajectories resolve every bundled task; broken replies end in FormatError; a dead sandbox is ABORTED."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import anyio
import pytest

pytest.importorskip("transformers", reason="needs the cpu extra (pip install 'swectl[cpu]')")

from swectl.actors.env_pool import running_pool
from swectl.actors.grader import Grader, GraderConfig
from swectl.actors.rollout import Rollout, RolloutConfig
from swectl.agent.loop import EpisodeConfig
from swectl.agent.metrics import agent_metrics
from swectl.agent.protocol import AgentLimits
from swectl.config import load_config
from swectl.images.project import BUNDLED_TASKS
from swectl.tasks.record import Task
from swectl.tasks.sources import load_tasks
from swectl.testing.replay import ReplayEngine, gold_replies

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


def rollout(tasks: list[Task], replies_for, tokenizer, out: Path, **episode) -> list:
    async def main() -> list:
        config = load_config(None, ["env_pool.warm=0"])
        async with running_pool(config, "r" + uuid.uuid4().hex[:12]) as pool, anyio.create_task_group() as tg:
            grader = Grader(GraderConfig(), pool)
            await tg.start(grader.run)
            ro = Rollout(RolloutConfig(concurrency=4, episode=EpisodeConfig(**episode)), pool, grader,
                         lambda t, n: ReplayEngine(replies_for(t), tokenizer), tokenizer, out)
            await tg.start(ro.run)
            results = await ro.collect(tasks)
            assert ro.statistics().finished == len(results)
            assert grader.statistics().graded == sum(
                r.grade is not None for r in results)
            tg.cancel_scope.cancel()
        return results

    return anyio.run(main)


def test_replayed_gold_trajectories_resolve_every_bundled_task(tokenizer, tmp_path: Path) -> None:
    tasks = load_tasks(BUNDLED_TASKS, strict=True).tasks
    results = rollout(tasks, lambda t: gold_replies(t.patch), tokenizer, tmp_path)
    assert len(results) == len(tasks)
    bad = [(r.instance_id, r.exit_status, r.reason, r.grade and r.grade.status) for r in results if not r.resolved]
    assert not bad, bad
    assert [r.exit_status for r in results] == ["Submitted"] * len(results)
    assert [r.turns for r in results] == [2] * len(results)
    m = agent_metrics(results)
    assert m["agent/turns_mean"] == 2
    assert 0 < m["agent/env_time_ratio"] < 1
    one = tmp_path / f"{tasks[0].instance_id}__0"
    traj = json.loads((one / "traj.json").read_text())["episode"]["trajectory"]
    assert len(traj["token_ids"]) == len(traj["loss_mask"]) == len(traj["logprobs"])
    assert sum(traj["loss_mask"]) > 0
    diff = (one / "patch.diff").read_text()
    added = [ln for ln in tasks[0].patch.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    assert diff.startswith("diff --git")
    assert added
    assert all(ln in diff.splitlines() for ln in added)
    assert json.loads((one / "meta.json").read_text())["resolved"] is True


def test_format_errors_and_step_limit(tokenizer, tmp_path: Path) -> None:
    task = load_tasks(BUNDLED_TASKS).tasks[0]
    (r,) = rollout([task], lambda t: ["no code block here"] * 5, tokenizer, tmp_path / "a",
                   limits=AgentLimits(max_format_errors=3))
    assert (r.exit_status, r.outcome, r.turns) == ("FormatError", "TRUNCATED", 3)
    assert r.grade is not None
    assert r.grade.status == "unresolved"  # truncated episodes are still graded
    (r,) = rollout([task], lambda t: ["THOUGHT: look\n```bash\nls\n```"] * 9, tokenizer, tmp_path / "b",
                   limits=AgentLimits(step_limit=4))
    assert (r.exit_status, r.turns) == ("LimitsExceeded", 4)


def test_command_timeout_is_an_observation(tokenizer, tmp_path: Path) -> None:
    task = load_tasks(BUNDLED_TASKS).tasks[0]
    replies = ["THOUGHT: slow\n```bash\nsleep 30\n```", *gold_replies(task.patch)]
    (r,) = rollout([task], lambda t: replies, tokenizer, tmp_path, limits=AgentLimits(command_timeout_s=1))
    assert r.exit_status == "Submitted"
    assert r.resolved
    steps = json.loads((Path(r.artifacts) / "traj.json").read_text())["episode"]["steps"]
    assert steps[0]["timed_out"] is True


class DyingEngine(ReplayEngine):
    """Answers once, then the engine is gone."""

    async def generate(self, request):
        if self.calls >= 1:
            from swectl.engine.errors import EngineUnavailableError

            raise EngineUnavailableError("http://127.0.0.1:1", "connection refused (engine died)")
        return await super().generate(request)


def test_engine_dying_mid_episode_is_aborted_not_failed(tokenizer, tmp_path: Path) -> None:
    task = load_tasks(BUNDLED_TASKS).tasks[0]

    async def main() -> list:
        config = load_config(None, ["env_pool.warm=0"])
        async with running_pool(config, "r" + uuid.uuid4().hex[:12]) as pool, anyio.create_task_group() as tg:
            grader = Grader(GraderConfig(), pool)
            await tg.start(grader.run)
            ro = Rollout(RolloutConfig(), pool, grader,
                         lambda t, n: DyingEngine(["THOUGHT: a\n```bash\nls\n```"] * 3, tokenizer), tokenizer, tmp_path)
            await tg.start(ro.run)
            results = await ro.collect([task])
            assert ro.statistics().aborted == 1
            tg.cancel_scope.cancel()
        return results

    (r,) = anyio.run(main)
    assert (r.exit_status, r.outcome) == ("Aborted", "ABORTED")
    assert "engine died" in r.reason
    assert r.grade is None
    assert not r.resolved
    assert r.turns == 2
