"""One agent episode (DESIGN 4, points 1 to 3): render the prompt once, then turn by turn send input_ids to
the engine, keep its tokens exactly, run the one bash command of each reply in the sandbox, append the
observation as template tokens, until the agent submits or a limit ends the episode.

Exit statuses: Submitted (COMPLETED); LimitsExceeded, TimeExceeded, ContextExceeded, FormatError
(TRUNCATED); Aborted (the engine or the sandbox failed: infrastructure, never a reward). A command's
timeout is an observation, not an error.
"""

from __future__ import annotations

import time
from typing import Literal, Protocol

import msgspec

from swectl.agent.context import StepSample, fit_context
from swectl.agent.protocol import (
    AgentLimits,
    AgentTemplates,
    ExitStatus,
    FormatError,
    Renderer,
    parse_action,
    submission,
)
from swectl.agent.trajectory import ChatTokenizer, Message, Trajectory, TrajectoryBuilder
from swectl.engine.wire import ChatMessage, ChatResult, GenerateRequest, GenerateResult, SamplingParams
from swectl.errors import InfraError
from swectl.schema import ExecResult
from swectl.tasks.record import TESTBED, Task

FORMAT_VERSION = 1
Outcome = Literal["COMPLETED", "TRUNCATED", "ABORTED"]
OUTCOME: dict[str, Outcome] = {
    "Submitted": "COMPLETED", "LimitsExceeded": "TRUNCATED", "TimeExceeded": "TRUNCATED",
    "ContextExceeded": "TRUNCATED", "FormatError": "TRUNCATED", "Aborted": "ABORTED",
}


class Engine(Protocol):
    async def generate(self, request: GenerateRequest) -> GenerateResult: ...


class Workspace(Protocol):
    """What the loop needs of a sandbox lease."""

    async def exec(self, command: str, timeout: float, *, cwd: str | None = None,
                   env: dict[str, str] | None = None) -> ExecResult: ...
    async def diff(self, repo: str | None = None) -> bytes: ...


class EpisodeConfig(msgspec.Struct, frozen=True, kw_only=True):
    limits: AgentLimits = AgentLimits()
    templates: AgentTemplates = AgentTemplates()
    sampling: SamplingParams = SamplingParams(max_new_tokens=1024, temperature=1.0)
    workdir: str = TESTBED
    # Head+tail context management: when the conversation outgrows the budget (max_context_tokens minus
    # room for one reply), show the model system + problem, the earliest and the latest turns. The single
    # token stream is then no longer what the model saw, so every step is also recorded as a StepSample.
    manage_context: bool = False
    per_step_samples: bool = False


class Step(msgspec.Struct, kw_only=True):
    step: int
    action: str = ""
    format_error: bool = False
    returncode: int | None = None
    timed_out: bool = False
    output_chars: int = 0
    output_tokens: int = 0
    model_time_s: float = 0.0
    env_time_s: float = 0.0
    wall_s: float = 0.0  # the whole step; wall - model - env is the controller's own overhead


class Episode(msgspec.Struct, kw_only=True):
    format_version: int = FORMAT_VERSION
    instance_id: str
    exit_status: ExitStatus
    outcome: Outcome
    reason: str = ""  # why it was aborted or truncated
    patch: str = ""  # the sandbox's diff at the end (binary-safe), what gets graded
    submitted: str = ""  # what the submit command printed after the sentinel
    steps: list[Step] = []
    trajectory: Trajectory = msgspec.field(default_factory=Trajectory)
    samples: list[StepSample] = []  # per-step samples (manage_context / per_step_samples)
    total_time_s: float = 0.0
    model_time_s: float = 0.0
    env_time_s: float = 0.0

    @property
    def turns(self) -> int:
        return len(self.steps)


def _managed_prompt(builder: TrajectoryBuilder, tokenizer: ChatTokenizer, budget: int) -> tuple[list[int], int]:
    """The head+tail view of the conversation, rendered with the generation prompt, and turns omitted."""

    def count(messages: list[Message]) -> int:
        return sum(len(tokenizer.encode(m.content, add_special_tokens=False)) + 5 for m in messages)

    messages, omitted = fit_context(builder.traj.messages, count, budget)
    conv = [{"role": m.role, "content": m.content} for m in messages]
    rendered = tokenizer.apply_chat_template(conv, tokenize=True, add_generation_prompt=True)
    ids = rendered if isinstance(rendered, list) else rendered["input_ids"]
    return [int(t) for t in ids], omitted


class _TokenPolicy:
    """Token-in/token-out against an SGLang-API engine: the trajectory holds exactly what the engine saw."""

    def __init__(self, engine: Engine, tokenizer: ChatTokenizer, cfg: EpisodeConfig, key: str, ep: Episode) -> None:
        self._engine, self._tok, self._cfg, self._key, self._ep = engine, tokenizer, cfg, key, ep
        self._builder = TrajectoryBuilder(tokenizer)
        ep.trajectory = self._builder.traj
        self._ids: list[int] = []
        self._prompt: list[int] = []
        self._omitted = 0

    def start(self, system: str, user: str) -> None:
        self._ids = self._builder.start(system, user)

    def room(self) -> tuple[int, str]:
        """Tokens left for the reply (<= 0: the context is full) and the reason when full."""
        cfg, limits = self._cfg, self._cfg.limits
        self._prompt, self._omitted = self._ids, 0
        if cfg.manage_context and len(self._ids) + cfg.sampling.max_new_tokens > limits.max_context_tokens:
            self._prompt, self._omitted = _managed_prompt(self._builder, self._tok,
                                                          limits.max_context_tokens - cfg.sampling.max_new_tokens)
        return limits.max_context_tokens - len(self._prompt), f"context reached {len(self._ids)} tokens"

    async def reply(self, n: int, room: int, step: Step) -> str:
        cfg = self._cfg
        sampling = msgspec.structs.replace(cfg.sampling, max_new_tokens=min(cfg.sampling.max_new_tokens, room))
        result = await self._engine.generate(GenerateRequest(input_ids=self._prompt, sampling_params=sampling,
                                                             rid=f"{self._key}/{n}"))
        if result.finish_reason == "abort":
            raise InfraError(f"the engine aborted the request: {result.finish_message or ''}")
        step.output_tokens = len(result.output_ids)
        if cfg.per_step_samples or cfg.manage_context:
            self._ep.samples.append(StepSample(
                step=n, prompt_ids=list(self._prompt), output_ids=list(result.output_ids),
                output_logprobs=list(result.output_logprobs), weight_version=result.weight_version,
                omitted_turns=self._omitted))
        return self._builder.add_output(result.output_ids, result.output_logprobs, result.weight_version)

    def observe(self, text: str) -> None:
        self._ids = self._builder.add_observation(text)


class ChatEngine(Protocol):
    async def chat(self, messages: list[ChatMessage], *, max_tokens: int, temperature: float = 0.0) -> ChatResult: ...


class _ChatPolicy:
    """Messages in, text out (OpenAI-compatible endpoints, hosted models): for evaluation only, no tokens."""

    def __init__(self, engine: ChatEngine, cfg: EpisodeConfig, ep: Episode) -> None:
        self._engine, self._cfg, self._ep = engine, cfg, ep
        self._used = 0  # prompt + completion tokens of the last call, as the endpoint reports them

    def start(self, system: str, user: str) -> None:
        self._ep.trajectory.messages = [Message("system", system), Message("user", user)]

    def room(self) -> tuple[int, str]:
        left = self._cfg.limits.max_context_tokens - self._used
        return left, f"the endpoint reported {self._used} tokens in context"

    async def reply(self, n: int, room: int, step: Step) -> str:
        msgs = [ChatMessage(m.role, m.content) for m in self._ep.trajectory.messages]
        result = await self._engine.chat(msgs, max_tokens=min(self._cfg.sampling.max_new_tokens, room),
                                         temperature=self._cfg.sampling.temperature)
        step.output_tokens = result.completion_tokens or 0
        self._used = (result.prompt_tokens or 0) + (result.completion_tokens or 0)
        self._ep.trajectory.messages.append(Message("assistant", result.content))
        return result.content

    def observe(self, text: str) -> None:
        self._ep.trajectory.messages.append(Message("user", text))


async def run_episode(task: Task, workspace: Workspace, engine: Engine, tokenizer: ChatTokenizer,
                      cfg: EpisodeConfig, *, key: str = "") -> Episode:
    """Run one token-in/token-out episode in a prepared sandbox (the task's setup already committed). Requests
    carry ``rid = <key>/<step>`` (key defaults to ``<instance_id>#0``), unique per request as SGLang expects."""
    ep = _new_episode(task, cfg)
    return await _drive(task, workspace, _TokenPolicy(engine, tokenizer, cfg, key or f"{task.instance_id}#0", ep),
                        cfg, ep)


async def run_chat_episode(task: Task, workspace: Workspace, engine: ChatEngine, cfg: EpisodeConfig) -> Episode:
    """The same protocol against an OpenAI-compatible chat endpoint (messages only: no training data)."""
    ep = _new_episode(task, cfg)
    return await _drive(task, workspace, _ChatPolicy(engine, cfg, ep), cfg, ep)


def _new_episode(task: Task, cfg: EpisodeConfig) -> Episode:
    return Episode(instance_id=task.instance_id, exit_status="LimitsExceeded", outcome="TRUNCATED",
                   reason=f"step limit {cfg.limits.step_limit} reached")


async def _drive(task: Task, workspace: Workspace, policy: _TokenPolicy | _ChatPolicy, cfg: EpisodeConfig,
                 ep: Episode) -> Episode:
    limits = cfg.limits
    renderer = Renderer(cfg.templates, limits)
    started = time.monotonic()
    format_errors = 0
    step_started = started
    try:
        policy.start(renderer.system(), renderer.instance(task.problem_statement, cfg.workdir))
        for n in range(limits.step_limit):
            if time.monotonic() - started > limits.wall_time_s:
                ep.exit_status, ep.reason = "TimeExceeded", f"episode ran past {limits.wall_time_s:g} s"
                break
            room, why = policy.room()
            if room <= 0:
                ep.exit_status, ep.reason = "ContextExceeded", why
                break
            step = Step(step=n)
            ep.steps.append(step)
            t0 = time.monotonic()
            if n:
                ep.steps[n - 1].wall_s = t0 - step_started
            step_started = t0
            reply = await policy.reply(n, room, step)
            step.model_time_s = time.monotonic() - t0
            try:
                step.action = parse_action(reply, cfg.templates)
            except FormatError as exc:
                step.format_error = True
                format_errors += 1
                if format_errors >= limits.max_format_errors:
                    ep.exit_status, ep.reason = "FormatError", f"{format_errors} malformed replies in a row"
                    break
                policy.observe(renderer.format_error(exc.actions))
                continue
            format_errors = 0
            t1 = time.monotonic()
            run = await workspace.exec(step.action, limits.command_timeout_s, cwd=cfg.workdir)
            step.env_time_s = time.monotonic() - t1
            step.returncode, step.timed_out, step.output_chars = run.exit_code, run.timed_out, len(run.output)
            if run.timed_out:
                policy.observe(renderer.timeout(step.action, run.output, limits.command_timeout_s))
                continue
            submitted = submission(run.output)
            if submitted is not None:
                ep.exit_status, ep.reason, ep.submitted = "Submitted", "", submitted
                break
            policy.observe(renderer.observation(run.output, run.exit_code))
        if ep.steps:
            ep.steps[-1].wall_s = time.monotonic() - step_started
        ep.patch = (await workspace.diff(cfg.workdir)).decode("utf-8", errors="surrogateescape")
    except InfraError as exc:  # engine or sandbox: ABORTED with the reason, never scored
        ep.exit_status, ep.reason = "Aborted", f"{type(exc).__name__}: {exc}"
    ep.outcome = OUTCOME[ep.exit_status]
    ep.total_time_s = time.monotonic() - started
    ep.model_time_s = sum(s.model_time_s for s in ep.steps)
    ep.env_time_s = sum(s.env_time_s for s in ep.steps)
    return ep
