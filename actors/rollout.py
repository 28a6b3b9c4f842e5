"""The Rollout actor: runs agent episodes with bounded concurrency over EnvPool leases, grades the
submitted patches with the Grader, and writes each episode's artifacts.

Nothing that is not idempotent is retried: an episode whose engine or sandbox failed is reported ABORTED
with its reason (and not graded); a grading infrastructure error leaves the episode ungraded (``grade`` is
an error with ``infra=True``), never "unresolved".

Artifacts per episode, in ``<out>/<instance_id>__<n>/``: ``traj.json`` (messages, token ids, loss mask,
logprobs, weight versions, steps and timings, exit status, format version, config), ``patch.diff`` and
``meta.json`` (status, grade, timings).

Consumes: tasks (``collect(tasks)``, or ``episode(task, n)`` one at a time). Waits for: one of
``concurrency`` episode slots, then (with ``engine_ready``) a healthy engine, so that an engine outage holds episodes
back instead of leasing sandboxes for episodes that would abort at their first turn (bounded; counted in
``engine_waits`` / ``engine_wait_s``), then an EnvPool lease, the engine and the Grader. Unblocked by: episodes
finishing, cancellation. Produces: ``EpisodeResult``s in completion order, per-episode artifacts,
``statistics()`` (a ``RolloutStatistics``). A plain object (it starts no task of its own: ``collect`` runs its
episodes in a task group it owns for the call). The engine of each episode is chosen by its type: an ``Engine``
(token-in, token-out: training data) or a ``ChatEngine`` (messages only: evaluation).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import anyio.abc
import msgspec

from swectl.actors.env_pool import EnvPool
from swectl.actors.grader import Grader, GradeResult, prepare_task
from swectl.actors.harnesses import Harness
from swectl.actors.judge import Judge
from swectl.agent.loop import ChatEngine, Engine, Episode, EpisodeConfig, OnStep, run_chat_episode, run_episode
from swectl.agent.trajectory import ChatTokenizer
from swectl.errors import InfraError
from swectl.images.names import ImageResolver
from swectl.rl.prm import StepJudgement, StepView
from swectl.schema import RolloutStatistics
from swectl.tasks.harbor import harbor_meta, is_harbor, sandbox_limits
from swectl.tasks.record import Task


class EpisodeResult(msgspec.Struct, kw_only=True):
    """One finished (and maybe graded) episode: how it ended, its grade and where its artifacts are."""
    instance_id: str
    sample: int
    exit_status: str
    outcome: str
    reason: str = ""
    resolved: bool = False
    grade: GradeResult | None = None
    turns: int = 0
    tool_calls: int = 0
    total_time_s: float = 0.0
    model_time_s: float = 0.0
    env_time_s: float = 0.0
    eval_time_s: float = 0.0
    artifacts: str = ""
    step_judgements: list[StepJudgement] = []  # [reward.prm]: the judge's verdict per agent step, in step order


class RolloutConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The rollout's section: concurrency, samples per task, grading and the episode settings."""
    concurrency: int = 4
    samples_per_task: int = 1
    grade: bool = True
    episode: EpisodeConfig = EpisodeConfig()


EngineFor = Callable[[Task, int], "Engine | ChatEngine | Harness"]
# Waits until an engine can take requests (Engines.wait_routable); returns the seconds waited, raises InfraError
EngineReady = Callable[[], Awaitable[float]]


def episode_config_for(task: Task, config: EpisodeConfig) -> EpisodeConfig:
    """The episode settings for ``task``: a Harbor task's ``[agent] timeout_sec`` bounds its wall time (the shorter
    of it and ``rollout.episode``'s)."""
    timeout = harbor_meta(task).agent_timeout_s if is_harbor(task) else None
    if not timeout or timeout >= config.limits.wall_time_s:
        return config
    return msgspec.structs.replace(config, limits=msgspec.structs.replace(config.limits, wall_time_s=float(timeout)))


def _write_artifacts(out_dir: Path, ep: Episode, cfg: RolloutConfig, result: EpisodeResult) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    traj = {"format_version": ep.format_version, "episode": msgspec.to_builtins(ep),
            "config": msgspec.to_builtins(cfg.episode)}
    if result.step_judgements:
        traj["step_judgements"] = msgspec.to_builtins(result.step_judgements)
    (out_dir / "traj.json").write_bytes(msgspec.json.encode(traj))
    (out_dir / "patch.diff").write_text(ep.patch, errors="surrogateescape")
    (out_dir / "meta.json").write_bytes(msgspec.json.format(msgspec.json.encode(result)))


class Rollout:
    """``await rollout.collect(tasks)`` (or ``episode(task, n)``). ``tokenizer`` is needed only for token-in/token-out
    engines."""

    def __init__(self, config: RolloutConfig, pool: EnvPool, grader: Grader, engine_for: EngineFor,
                 tokenizer: ChatTokenizer | None, out_dir: Path, *, resolver: ImageResolver | None = None,
                 limiter: anyio.CapacityLimiter | None = None, judge: Judge | None = None,
                 engine_ready: EngineReady | None = None) -> None:
        self._pool = pool
        self._grader = grader
        self._engine_for = engine_for
        self._tok = tokenizer
        self._cfg = config
        self._out = out_dir
        self._resolver = resolver or ImageResolver()
        # episodes at once; a limiter passed in is shared with other Rollouts (the async loop's one per group)
        self._limit = limiter or anyio.CapacityLimiter(config.concurrency)
        self._judge = judge  # [reward.prm]: judges each step while the episode goes on
        self._engine_ready = engine_ready
        self._counts = dict.fromkeys(("finished", "COMPLETED", "TRUNCATED", "ABORTED", "resolved", "engine_waits"), 0)
        self._engine_wait_s = 0.0

    def statistics(self) -> RolloutStatistics:
        c = self._counts
        return RolloutStatistics(
            running=self._limit.borrowed_tokens, waiting=self._limit.statistics().tasks_waiting,
            finished=c["finished"], completed=c["COMPLETED"], truncated=c["TRUNCATED"], aborted=c["ABORTED"],
            resolved=c["resolved"], engine_waits=c["engine_waits"], engine_wait_s=round(self._engine_wait_s, 3),
        )

    async def episode(self, task: Task, sample: int) -> EpisodeResult:
        """Run, grade and record one episode of ``task``."""
        result, _ = await self.episode_with_trajectory(task, sample)
        return result

    async def episode_with_trajectory(self, task: Task, sample: int) -> tuple[EpisodeResult, Episode]:
        """``episode``, with the finished Episode itself (its token stream, in memory, for training)."""
        judged: list[StepJudgement] = []
        async with anyio.create_task_group() as judges:  # the step judgements finish while the episode is graded
            on_step = self._judging(judges, task, sample, judged) if self._judge is not None else None
            async with self._limit:
                ep = await self._run(task, sample, on_step)
            result = EpisodeResult(
                instance_id=task.instance_id, sample=sample, exit_status=ep.exit_status, outcome=ep.outcome,
                reason=ep.reason, turns=ep.turns, tool_calls=sum(1 for s in ep.steps if s.action),
                total_time_s=ep.total_time_s, model_time_s=ep.model_time_s, env_time_s=ep.env_time_s,
            )
            if self._cfg.grade and ep.outcome != "ABORTED":
                t0 = time.monotonic()
                result.grade = await self._grader.grade(task, ep.patch, label=f"rollout{sample}")
                result.eval_time_s = time.monotonic() - t0
                result.resolved = result.grade.resolved
        result.step_judgements = sorted(judged, key=lambda j: j.step)
        out = self._out / f"{task.instance_id}__{sample}"
        result.artifacts = str(out)
        _write_artifacts(out, ep, self._cfg, result)
        self._counts["finished"] += 1
        self._counts[result.outcome] += 1
        self._counts["resolved"] += result.resolved
        return result, ep

    def _judging(self, tg: anyio.abc.TaskGroup, task: Task, sample: int, judged: list[StepJudgement]) -> OnStep:
        """The episode's on_step hook: each finished step goes to the judge at once, with the steps before it."""
        judge = self._judge
        assert judge is not None
        history: list[StepView] = []
        key = f"{task.instance_id}#{sample}"

        async def one(view: StepView, earlier: list[StepView]) -> None:
            judged.append(await judge.judge(key, task.problem_statement, earlier, view))

        def on_step(view: StepView) -> None:
            tg.start_soon(one, view, list(history), name=f"judge {key} step {view.step}")
            history.append(view)

        return on_step

    async def _run(self, task: Task, sample: int, on_step: OnStep | None = None) -> Episode:
        try:
            if self._engine_ready is not None:  # an engine outage holds episodes back before they take a sandbox
                waited = await self._engine_ready()
                if waited > 0:
                    self._counts["engine_waits"] += 1
                    self._engine_wait_s += waited
            async with self._pool.lease(self._resolver.resolve(task), **sandbox_limits(task)) as lease:
                if not await prepare_task(lease, task):
                    raise InfraError("the task's setup patch did not apply in a fresh sandbox")
                match self._engine_for(task, sample):
                    case Engine() as engine:
                        assert self._tok is not None, "a token-in/token-out engine needs the tokenizer"
                        return await run_episode(task, lease, engine, self._tok,
                                                 episode_config_for(task, self._cfg.episode),
                                                 key=f"{task.instance_id}#{sample}", on_step=on_step)
                    case Harness() as harness:  # an external harness, unmodified, through the gateway
                        return await harness.run_episode(task, lease, f"{task.instance_id}#{sample}")
                    case ChatEngine() as chat:  # an OpenAI-compatible chat endpoint: messages only
                        return await run_chat_episode(task, lease, chat, episode_config_for(task, self._cfg.episode))
                    case other:
                        raise TypeError(f"engine_for returned {type(other).__name__}, not an Engine or ChatEngine")
        except InfraError as exc:
            return Episode(instance_id=task.instance_id, exit_status="Aborted", outcome="ABORTED",
                           reason=f"{type(exc).__name__}: {exc}")

    async def collect(self, tasks: list[Task],
                      on_result: Callable[[EpisodeResult], Awaitable[None] | None] | None = None,
                      skip: set[tuple[str, int]] = frozenset()) -> list[EpisodeResult]:
        """Every (task, sample) not in ``skip``; results in completion order."""
        results: list[EpisodeResult] = []

        async def one(task: Task, sample: int) -> None:
            r = await self.episode(task, sample)
            results.append(r)
            if on_result is not None:
                maybe = on_result(r)
                if maybe is not None:
                    await maybe

        async with anyio.create_task_group() as tg:
            for task in tasks:
                for n in range(self._cfg.samples_per_task):
                    if (task.instance_id, n) not in skip:
                        tg.start_soon(one, task, n, name=f"episode {task.instance_id}#{n}")
        return results
