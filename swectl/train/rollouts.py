"""The rollouts of a training run: groups of graded episodes for GRPO, and the held-out evaluations.

A group is ``train.sampling.n_samples`` finished episodes of one task; ABORTED ones (and those whose grading met
an infrastructure failure) are replaced, never scored (docs/architecture.md 12.1). Each episode reaches the
batcher in memory (its tokens, loss mask and logprobs as the agent loop recorded them); its traj.json is written
for people and tools, and is not read back here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec

from swectl.actors.engines import Engines
from swectl.actors.env_pool import EnvPool
from swectl.actors.grader import Grader, GraderConfig
from swectl.actors.harnesses import Harness
from swectl.actors.judge import Judge
from swectl.actors.metrics import Metrics
from swectl.actors.rollout import EngineFor, EpisodeResult, Rollout, RolloutConfig
from swectl.agent.loop import Episode, EpisodeConfig, episode_config
from swectl.agent.protocol import agent_templates
from swectl.config import ClusterConfig
from swectl.errors import TaskDataError
from swectl.rl.groups import REWARDS_FILE, EpisodeReward, GradedEpisode, Group, TokenStream, score_group
from swectl.tasks.record import Task
from swectl.train.checkpoint import step_name

_log = logging.getLogger(__name__)
T = TypeVar("T")
REFILL_TRIES = 2  # extra rounds to replace ABORTED episodes of a group before the group is dropped


def graded_episode(result: EpisodeResult, episode: Episode) -> GradedEpisode:
    """What the batcher needs of a finished, graded episode: its grade and its trajectory's tokens."""
    t = episode.trajectory
    steps = [(s.prompt_ids, s.output_ids, s.output_logprobs) for s in episode.samples]
    versions = [v for stream in (t, *episode.branches) for v in stream.weight_versions]
    branches = [TokenStream(token_ids=b.token_ids, loss_mask=b.loss_mask, logprobs=b.logprobs, turns=b.turns)
                for b in episode.branches]
    return GradedEpisode(instance_id=result.instance_id, sample=result.sample, outcome=result.outcome,
                         resolved=result.resolved, token_ids=t.token_ids, loss_mask=t.loss_mask, logprobs=t.logprobs,
                         turns=t.turns, branches=branches, weight_version=_weight_version(versions),
                         mixed_versions=len(set(versions)) > 1, steps=steps,
                         step_scores=[j.score for j in result.step_judgements],
                         format_errors=[s.format_error for s in episode.steps], exit_status=result.exit_status,
                         tampered=result.grade is not None and result.grade.tampered)


def read_graded_episode(result: EpisodeResult) -> GradedEpisode:
    """``graded_episode`` of an episode read back from its traj.json (for tools that look at a finished run)."""
    path = Path(result.artifacts) / "traj.json"
    try:
        episode = msgspec.json.decode(path.read_bytes(), type=_TrajFile).episode
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TaskDataError(f"{path}: cannot read the episode back: {exc}") from exc
    return graded_episode(result, episode)


class EvalStepSummary(msgspec.Struct, frozen=True, kw_only=True):
    """eval/step_N/summary.json: a held-out evaluation during training (its values are also in metrics.jsonl)."""

    step: int
    resolve_rate: float  # resolved / episodes, ABORTED ones left out
    episodes: int  # scored (not ABORTED)
    aborted: int
    time_s: float


class _TrajFile(msgspec.Struct):
    episode: Episode


def _weight_version(versions: list[str]) -> int:
    numbers = [int(v) for v in versions if v.isdigit()]
    return min(numbers) if numbers else 0


ABANDONED_DIR = "abandoned"  # episode folders of attempts a restart or resume gave up, kept for a look


def fresh_folder(run_dir: Path, out: Path) -> Path:
    """``out`` (under ``run_dir``), not there: what is there is moved to run_dir/abandoned/<parent>/<name>.<n>."""
    if not out.exists():
        return out
    aside = run_dir / ABANDONED_DIR / out.parent.name
    aside.mkdir(parents=True, exist_ok=True)
    n = 1
    while (aside / f"{out.name}.{n}").exists():
        n += 1
    out.rename(aside / f"{out.name}.{n}")
    return out


class TrainRollouts:
    """The run's rollouts on its env pool and engines: training groups (``group``), their scores (``score``) and
    the held-out evaluations (``evaluate``). ``tokenizer`` is the policy's; ``judge`` the process-reward judge."""

    def __init__(self, config: ClusterConfig, run_dir: Path, pool: EnvPool, engines: Engines, tokenizer: Any,
                 judge: Judge | None, *, harness: Harness | None = None) -> None:
        self._config = config
        self.run_dir = run_dir
        self._pool = pool
        self._engines = engines
        self._tokenizer = tokenizer
        self._judge = judge
        self._harness = harness  # [agent] harness: it runs the episodes, its turns through the gateway
        # rollout.agent_config read once: a YAML file edited during the run does not change its prompts halfway
        self._templates = agent_templates(config.rollout.agent_config)

    def fresh(self, out: Path) -> Path:
        """``out``, not there yet: a folder of that name was left by an attempt that a trainer restart or a resume
        abandoned (the redo draws its groups under the same names) and is moved to
        abandoned/<parent>/<name>.<n> first. Else the redo's episodes overwrite the abandoned attempt's in place and
        its rewards.jsonl keeps their rewards beside them: the chaos soak found rewards recorded for episodes that
        were ABORTED (the redo's, the trainer never saw them scored)."""
        return fresh_folder(self.run_dir, out)

    def grader(self, out: Path) -> Grader:
        """The Grader of one step's rollouts or an evaluation (its own verdicts to reuse, its logs under ``out``)."""
        return Grader(GraderConfig(concurrency=self._config.train.concurrency, reuse=self._config.rollout.reuse_grades,
                                   defences=self._config.experiment.reward_hacking.grader_defences),
                      self._pool, log_dir=out / "grade-logs")

    def rollout(self, grader: Grader, tag: str, out: Path, limiter: anyio.CapacityLimiter | None = None) -> Rollout:
        """A Rollout of training episodes: ``n_samples`` per task, sampling seeded and engine sessions keyed by
        ``tag`` (the step, or the async group's draw), artifacts under ``out``, the process-reward judge if any."""
        t = self._config.train
        config = RolloutConfig(concurrency=t.concurrency, samples_per_task=t.sampling.n_samples,
                               episode=self._episode_config(f"train:{t.seed}:{tag}"))
        return Rollout(config, self._pool, grader, self._engine_for(tag, out), self._tokenizer, out, limiter=limiter,
                       judge=self._judge, engine_ready=self._engines.wait_routable)

    def _engine_for(self, tag: str, out: Path) -> EngineFor:
        """Who runs an episode of a rollout tagged ``tag``: the engine server of its key (swectl's loop), or the
        harness, whose gateway session routes the same way."""
        if self._harness is not None:
            harness = self._harness.for_rollout(out / "harness", tag)
            return lambda task, n: harness
        engines = self._engines
        return lambda task, n: engines.route(f"{task.instance_id}#{tag}#{n}")

    def _episode_config(self, seed: str) -> EpisodeConfig:
        sampling = self._config.train.sampling
        return episode_config(self._config.rollout, temperature=sampling.temperature, seed=seed,
                              per_step_samples=sampling.sample_mode == "step", templates=self._templates)

    async def group(self, rollout: Rollout, task: Task, results: list[EpisodeResult]) -> Group | None:
        """``n_samples`` finished episodes of ``task`` (every result is appended to ``results``); ABORTED ones are
        replaced; None when the group cannot be completed in 1 + REFILL_TRIES rounds."""
        n = self._config.train.sampling.n_samples
        good: list[GradedEpisode] = []
        index = 0
        for _ in range(1 + REFILL_TRIES):
            want = n - len(good)
            batch = await gather([lambda k=k: rollout.episode_with_trajectory(task, k)
                                  for k in range(index, index + want)])
            index += want
            for result, episode in batch:
                results.append(result)
                if result.outcome == "ABORTED":
                    _log.warning("episode %s#%d aborted: %s", result.instance_id, result.sample, result.reason)
                    continue
                if result.grade is not None and result.grade.infra:  # the episode ended; grading it failed
                    _log.warning("episode %s#%d not graded (%s: %s); replaced", result.instance_id, result.sample,
                                 result.grade.reason, result.grade.detail or result.grade.status)
                    continue
                good.append(graded_episode(result, episode))
            if len(good) >= n:
                good.sort(key=lambda e: e.sample)
                return Group(instance_id=task.instance_id, episodes=good[:n])
        return None

    def score(self, group: Group, key: str, out: Path) -> None:
        """Rewards and advantages of a finished group (``key`` seeds the shuffled-reward control), recorded in
        ``out``'s rewards.jsonl beside the episode folders."""
        c = self._config
        score_group(group, c.train.advantage, c.reward, c.experiment, shuffle_key=f"{c.train.seed}:{key}")
        lines = b"".join(msgspec.json.encode(EpisodeReward(e.instance_id, e.sample, r, a)) + b"\n"
                         for e, r, a in zip(group.episodes, group.rewards, group.advantages, strict=True))
        out.mkdir(parents=True, exist_ok=True)
        with (out / REWARDS_FILE).open("ab") as f:
            f.write(lines)

    async def evaluate(self, tasks: list[Task], metrics: Metrics, step: int) -> float:
        """The held-out evaluation after ``step``: ``eval_samples`` episodes per task, logged and summarised in
        eval/step_N/summary.json; returns the resolve rate."""
        out = self.fresh(self.run_dir / "eval" / step_name(step))
        t = self._config.train
        grader = self.grader(out)
        rollout = Rollout(RolloutConfig(concurrency=t.concurrency, samples_per_task=t.eval_samples,
                                        episode=self._episode_config(f"eval:{t.seed}")),
                          self._pool, grader, self._engine_for(f"eval#{step}", out), self._tokenizer, out,
                          engine_ready=self._engines.wait_routable)
        t0 = time.monotonic()
        results = await rollout.collect(tasks)
        scored = [r for r in results if r.outcome != "ABORTED"]
        rate = sum(r.resolved for r in scored) / max(len(scored), 1)
        values = {"eval/resolve_rate": rate, "eval/episodes": float(len(scored)),
                  "eval/aborted": float(len(results) - len(scored)), "eval/time_s": time.monotonic() - t0}
        metrics.log(step, values)
        summary = EvalStepSummary(step=step, resolve_rate=rate, episodes=len(scored),
                                  aborted=len(results) - len(scored), time_s=values["eval/time_s"])
        (out / "summary.json").write_bytes(msgspec.json.format(msgspec.json.encode(summary), indent=1))
        return rate


async def gather(calls: list[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run the calls concurrently in one task group; results in call order."""
    out: list[T | None] = [None] * len(calls)

    async def one(i: int) -> None:
        out[i] = await calls[i]()

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
    return out  # type: ignore[return-value]
