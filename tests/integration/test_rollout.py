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
from swectl.actors.judge import Judge
from swectl.actors.rollout import Rollout, RolloutConfig
from swectl.agent.loop import EpisodeConfig
from swectl.agent.metrics import agent_metrics
from swectl.agent.protocol import AgentLimits
from swectl.config import PrmConfig, load_config
from swectl.engine.client import SglangClient
from swectl.engine.wire import GenerateRequest, GenerateResult
from swectl.images.project import BUNDLED_TASKS
from swectl.schema import JudgeStatistics
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
            ro = Rollout(RolloutConfig(concurrency=4, episode=EpisodeConfig(**episode)), pool, grader,
                         lambda t, n: ReplayEngine(replies_for(t), tokenizer), tokenizer, out)
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
            from swectl.errors import EngineUnavailableError

            raise EngineUnavailableError("http://127.0.0.1:1", "connection refused (engine died)")
        return await super().generate(request)


def test_engine_dying_mid_episode_is_aborted_not_failed(tokenizer, tmp_path: Path) -> None:
    task = load_tasks(BUNDLED_TASKS).tasks[0]

    async def main() -> list:
        config = load_config(None, ["env_pool.warm=0"])
        async with running_pool(config, "r" + uuid.uuid4().hex[:12]) as pool, anyio.create_task_group() as tg:
            grader = Grader(GraderConfig(), pool)
            ro = Rollout(RolloutConfig(), pool, grader,
                         lambda t, n: DyingEngine(["THOUGHT: a\n```bash\nls\n```"] * 3, tokenizer), tokenizer, tmp_path)
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


class VotingJudge:
    """A judge engine that answers request ``rid = judge-<key>.<step>/<i>`` with ``answers[i]`` after ``delay_s``."""

    def __init__(self, answers: list[str], tokenizer, delay_s: float) -> None:
        self.answers, self.tok, self.delay_s = answers, tokenizer, delay_s
        self.rids: list[str] = []
        self.prompts: dict[str, list[int]] = {}  # rid -> the prompt's token ids

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.rids.append(request.rid or "")
        self.prompts[request.rid or ""] = list(request.input_ids)
        await anyio.sleep(self.delay_s)
        ids = [*self.tok.encode(self.answers[int((request.rid or "").rpartition("/")[2])], add_special_tokens=False),
               self.tok.convert_tokens_to_ids("<|im_end|>")]
        return GenerateResult(output_ids=ids, output_logprobs=[0.0] * len(ids), finish_reason="stop",
                              prompt_tokens=len(request.input_ids), completion_tokens=len(ids), weight_version="j",
                              e2e_latency_s=self.delay_s, client_latency_s=self.delay_s)


def judged_rollout(task: Task, engine_for, tokenizer, out: Path, samples: int) -> tuple[list, Judge]:
    async def main() -> tuple[list, Judge]:
        config = load_config(None, ["env_pool.warm=0"])
        async with running_pool(config, "r" + uuid.uuid4().hex[:12]) as pool, anyio.create_task_group() as tg:
            grader = Grader(GraderConfig(), pool)
            judge = Judge(PrmConfig(enabled=True, model="x", samples=samples, timeout_s=5.0), engine_for, tokenizer)
            ro = Rollout(RolloutConfig(concurrency=2), pool, grader,
                         lambda t, n: ReplayEngine(gold_replies(t.patch), tokenizer), tokenizer, out, judge=judge)
            results = await ro.collect([task])
            tg.cancel_scope.cancel()
        return results, judge

    return anyio.run(main)


def test_the_judge_scores_every_step_while_the_episode_goes_on(tokenizer, tmp_path: Path) -> None:
    """[reward.prm]: each step gets its votes (+1, -1, and one answer without a box: unparseable), the judge's
    slowness never lengthens the episode, and the judgements land in traj.json and the result."""
    task = load_tasks(BUNDLED_TASKS).tasks[0]
    judge_engine = VotingJudge(["fine. \\boxed{1}", "no: \\boxed{-1} wait, \\boxed{1}", "hmm"], tokenizer, 2.0)
    (r,), judge = judged_rollout(task, lambda key: judge_engine, tokenizer, tmp_path, samples=3)
    assert r.resolved and r.exit_status == "Submitted" and r.turns == 2
    assert r.total_time_s < 2.0  # the episode did not wait for its judge (2 s per answer)
    assert [(j.step, j.votes, j.unparseable, j.failures, j.score) for j in r.step_judgements] == [
        (0, [1, 1], 1, 0, 1.0), (1, [1, 1], 1, 0, 1.0)]
    assert sorted(judge_engine.rids) == sorted(f"judge-{task.instance_id}#0.{s}/{i}" for s in (0, 1) for i in range(3))
    assert judge.statistics() == JudgeStatistics(steps=2, scored=2, votes=4, unparseable=2, failures=0)
    saved = json.loads((tmp_path / f"{task.instance_id}__0" / "traj.json").read_text())["step_judgements"]
    assert [j["score"] for j in saved] == [1.0, 1.0]


def test_judge_data_rebuilds_the_prompts_the_judge_was_sent(tokenizer, tmp_path: Path) -> None:
    """`swectl data judge` trains a judge on exactly what [reward.prm] asks it: the prompts rebuilt from the
    recorded episode (swectl/data/judge.py) are token for token the ones the judge engine got, the submission's
    output included; the resolved episode's steps are labelled good."""
    from swectl.data.judge import judge_examples

    task = load_tasks(BUNDLED_TASKS).tasks[1]
    judge_engine = VotingJudge(["\\boxed{1}"], tokenizer, 0.0)
    (r,), _ = judged_rollout(task, lambda key: judge_engine, tokenizer, tmp_path, samples=1)
    assert r.resolved and r.turns == 2
    examples, summary = judge_examples([tmp_path], {task.instance_id: task.problem_statement})
    assert (summary.episodes, summary.good, summary.bad, summary.unlabelled) == (1, 2, 0, 0)
    for example in examples:
        rebuilt = tokenizer.apply_chat_template(example.messages, tokenize=True, add_generation_prompt=True)
        rebuilt = rebuilt if isinstance(rebuilt, list) else rebuilt["input_ids"]
        assert [int(t) for t in rebuilt] == judge_engine.prompts[f"judge-{task.instance_id}#0.{example.step}/0"]


def test_a_judge_that_is_down_is_counted_and_never_a_score(tokenizer, tmp_path: Path) -> None:
    task = load_tasks(BUNDLED_TASKS).tasks[0]
    client = SglangClient("http://127.0.0.1:9", timeout_s=5.0)  # nothing listens on the discard port
    (r,), judge = judged_rollout(task, lambda key: client, tokenizer, tmp_path, samples=2)
    assert r.resolved and r.outcome == "COMPLETED"  # the outcome stands
    assert [(j.votes, j.failures, j.score) for j in r.step_judgements] == [([], 2, None), ([], 2, None)]
    assert judge.statistics().failures == 4 and judge.statistics().scored == 0
