"""One agent episode (docs/architecture.md 6): render the prompt once, then turn by turn send input_ids to
the engine, keep its tokens exactly, run the one bash command of each reply in the sandbox, append the
observation as template tokens, until the agent submits or a limit ends the episode.

Exit statuses: Submitted (COMPLETED); LimitsExceeded, TimeExceeded, ContextExceeded, FormatError
(TRUNCATED); Aborted (the engine or the sandbox failed: infrastructure, never a reward). A command's
timeout is an observation, not an error.

As in mini-swe-agent, every way an episode ends is an exception (``EpisodeEnd`` and its subclasses, each
carrying its exit status), raised by the check that finds it and caught in one place, ``_Run.episode``,
which records the exit status. The policies (token or chat) own their transcript and return what each
turn produced; only the loop writes the Episode.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import ClassVar, Literal, Protocol, runtime_checkable

import msgspec

from swectl.agent.context import StepSample, fit_context
from swectl.agent.protocol import (
    AgentLimits,
    AgentTemplates,
    ExitStatus,
    FormatError,
    Renderer,
    agent_templates,
    parse_action,
    submission,
)
from swectl.agent.trajectory import ChatTokenizer, Message, Trajectory, TrajectoryBuilder, rendered_ids
from swectl.config import RolloutOptions
from swectl.engine.wire import ChatMessage, ChatResult, GenerateRequest, GenerateResult, SamplingParams
from swectl.errors import InfraError, SwectlError
from swectl.rl.prm import StepView
from swectl.schema import ExecResult
from swectl.tasks.record import TESTBED, Task

FORMAT_VERSION = 1
Outcome = Literal["COMPLETED", "TRUNCATED", "ABORTED"]
OUTCOME: dict[str, Outcome] = {
    "Submitted": "COMPLETED", "LimitsExceeded": "TRUNCATED", "TimeExceeded": "TRUNCATED",
    "ContextExceeded": "TRUNCATED", "FormatError": "TRUNCATED", "Aborted": "ABORTED",
}


@runtime_checkable
class Engine(Protocol):
    """Token-in/token-out (SGLang's /generate)."""

    async def generate(self, request: GenerateRequest) -> GenerateResult: ...


@runtime_checkable
class ChatEngine(Protocol):
    """Messages in, text out (an OpenAI-compatible endpoint)."""

    async def chat(self, messages: list[ChatMessage], *, max_tokens: int, temperature: float = 0.0) -> ChatResult: ...


class Workspace(Protocol):
    """What the loop needs of a sandbox lease."""

    async def exec(self, command: str, timeout: float, *, cwd: str | None = None,
                   env: dict[str, str] | None = None) -> ExecResult: ...
    async def diff(self, repo: str | None = None) -> bytes: ...


class EpisodeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How one episode runs: limits, templates, sampling, workdir and context management."""
    limits: AgentLimits = AgentLimits()
    templates: AgentTemplates = AgentTemplates()
    sampling: SamplingParams = SamplingParams(max_new_tokens=1024, temperature=1.0)
    workdir: str = TESTBED
    # Head+tail context management: when the conversation outgrows the budget (max_context_tokens minus
    # room for one reply), show the model system + problem, the earliest and the latest turns. The single
    # token stream is then no longer what the model saw, so every step is also recorded as a StepSample.
    manage_context: bool = False
    per_step_samples: bool = False
    # Seeded sampling: when set, every request carries ``sampling_seed = request_seed(seed, key, turn)``, so the
    # same weights and the same sandbox outputs give the same episode (the CPU engine honours it; SGLang with
    # --enable-deterministic-inference). None: the engine draws fresh randomness. Token engines only.
    seed: str | None = None


def episode_config(options: RolloutOptions, *, temperature: float, seed: str | None = None,
                   per_step_samples: bool = False, templates: AgentTemplates | None = None) -> EpisodeConfig:
    """The one builder of an EpisodeConfig from the ``[rollout]`` section, for training and evaluation alike:
    ``temperature`` (training's is train.sampling.temperature), ``seed`` (a namespace that seeds every request's
    sampling), ``per_step_samples`` (training with train.sampling.sample_mode = "step"), ``templates`` (the
    prompts of ``rollout.agent_config`` read once by a caller that builds many; default: read them now)."""
    return EpisodeConfig(
        seed=seed, manage_context=options.manage_context, per_step_samples=per_step_samples,
        templates=templates if templates is not None else agent_templates(options.agent_config),
        limits=AgentLimits(step_limit=options.step_limit, max_context_tokens=options.context,
                           max_format_errors=options.max_format_errors),
        sampling=SamplingParams(max_new_tokens=options.max_tokens, temperature=temperature))


class Step(msgspec.Struct, kw_only=True):
    """One turn of an episode: the action, its observation and timings."""
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
    """A finished episode as saved in traj.json: how it ended, its steps, trajectory and patch."""
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
    # an external harness's episode (actors/harness.py): the gateway session's other branches, each its own sample
    # (``trajectory`` is the first; swectl/gateway/ledger.py)
    branches: list[Trajectory] = []
    total_time_s: float = 0.0
    model_time_s: float = 0.0
    env_time_s: float = 0.0

    @property
    def turns(self) -> int:
        return len(self.steps)


# ---------------------------------------------------------------- how an episode ends


class EpisodeEnd(SwectlError):
    """The episode is over: raised by the check that finds it, caught once by the loop."""

    exit_status: ClassVar[ExitStatus]

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason)
        self.reason = reason


class Submitted(EpisodeEnd):
    """The agent submitted (its final command printed the submit marker); ``submitted`` is what it printed."""

    exit_status = "Submitted"

    def __init__(self, submitted: str) -> None:
        super().__init__("")
        self.submitted = submitted


class LimitsExceeded(EpisodeEnd):
    """The step limit is reached."""

    exit_status = "LimitsExceeded"


class TimeExceeded(EpisodeEnd):
    """The episode's wall-clock limit is reached."""

    exit_status = "TimeExceeded"


class ContextExceeded(EpisodeEnd):
    """The next prompt cannot fit the context window."""

    exit_status = "ContextExceeded"


class FormatErrorsExceeded(EpisodeEnd):
    """Too many replies in a row without exactly one bash block."""

    exit_status = "FormatError"


class Aborted(EpisodeEnd):
    """Infrastructure failed under the episode (an InfraError): never a reward."""

    exit_status = "Aborted"


# ---------------------------------------------------------------- policies


def request_seed(seed: str, key: str, turn: int) -> int:
    """The sampling seed of turn ``turn`` of episode ``key`` (``<instance_id>#<sample>``) under the run's ``seed``:
    63 bits of sha256, the same in every process and Python version."""
    digest = hashlib.sha256(f"{seed}\x00{key}\x00{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class Reply(msgspec.Struct, frozen=True, kw_only=True):
    """What one model turn produced."""

    text: str
    output_tokens: int
    sample: StepSample | None = None  # the exact prompt and output (manage_context / per_step_samples)


class _Policy(Protocol):
    """One way to talk to a model. It owns its transcript (``trajectory``); the loop owns the Episode."""

    trajectory: Trajectory

    def start(self, system: str, user: str) -> None: ...
    def room(self) -> tuple[int, str]: ...
    async def reply(self, n: int, room: int) -> Reply: ...
    def observe(self, text: str) -> None: ...


def _managed_prompt(builder: TrajectoryBuilder, tokenizer: ChatTokenizer, budget: int) -> tuple[list[int], int]:
    """The head+tail view of the conversation, rendered with the generation prompt, and turns omitted."""

    def count(messages: list[Message]) -> int:
        return sum(len(tokenizer.encode(m.content, add_special_tokens=False)) + 5 for m in messages)

    messages, omitted = fit_context(builder.traj.messages, count, budget)
    conv = [{"role": m.role, "content": m.content} for m in messages]
    rendered = tokenizer.apply_chat_template(conv, tokenize=True, add_generation_prompt=True)
    return rendered_ids(rendered), omitted


class _TokenPolicy:
    """Token-in/token-out against an SGLang-API engine: the trajectory holds exactly what the engine saw."""

    def __init__(self, engine: Engine, tokenizer: ChatTokenizer, cfg: EpisodeConfig, key: str) -> None:
        self._engine, self._tok, self._cfg, self._key = engine, tokenizer, cfg, key
        self._builder = TrajectoryBuilder(tokenizer)
        self.trajectory = self._builder.traj
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

    async def reply(self, n: int, room: int) -> Reply:
        cfg = self._cfg
        sampling = msgspec.structs.replace(cfg.sampling, max_new_tokens=min(cfg.sampling.max_new_tokens, room))
        if cfg.seed is not None:
            sampling = msgspec.structs.replace(sampling, sampling_seed=request_seed(cfg.seed, self._key, n))
        result = await self._engine.generate(GenerateRequest(input_ids=self._prompt, sampling_params=sampling,
                                                             rid=f"{self._key}/{n}"))
        if result.finish_reason == "abort":
            raise InfraError(f"the engine aborted the request: {result.finish_message or ''}")
        sample = None
        if cfg.per_step_samples or cfg.manage_context:
            sample = StepSample(
                step=n, prompt_ids=list(self._prompt), output_ids=list(result.output_ids),
                output_logprobs=list(result.output_logprobs), weight_version=result.weight_version,
                omitted_turns=self._omitted)
        text = self._builder.add_output(result.output_ids, result.output_logprobs, result.weight_version)
        return Reply(text=text, output_tokens=len(result.output_ids), sample=sample)

    def observe(self, text: str) -> None:
        self._ids = self._builder.add_observation(text)


class _ChatPolicy:
    """Messages in, text out (OpenAI-compatible endpoints, hosted models): for evaluation only, no tokens."""

    def __init__(self, engine: ChatEngine, cfg: EpisodeConfig) -> None:
        self._engine, self._cfg = engine, cfg
        self.trajectory = Trajectory()
        self._used = 0  # prompt + completion tokens of the last call, as the endpoint reports them

    def start(self, system: str, user: str) -> None:
        self.trajectory.messages = [Message("system", system), Message("user", user)]

    def room(self) -> tuple[int, str]:
        left = self._cfg.limits.max_context_tokens - self._used
        return left, f"the endpoint reported {self._used} tokens in context"

    async def reply(self, n: int, room: int) -> Reply:
        msgs = [ChatMessage(m.role, m.content) for m in self.trajectory.messages]
        result = await self._engine.chat(msgs, max_tokens=min(self._cfg.sampling.max_new_tokens, room),
                                         temperature=self._cfg.sampling.temperature)
        self._used = (result.prompt_tokens or 0) + (result.completion_tokens or 0)
        self.trajectory.messages.append(Message("assistant", result.content))
        return Reply(text=result.content, output_tokens=result.completion_tokens or 0)

    def observe(self, text: str) -> None:
        self.trajectory.messages.append(Message("user", text))


# ---------------------------------------------------------------- the loop


OnStep = Callable[[StepView], None]


async def run_episode(task: Task, workspace: Workspace, engine: Engine, tokenizer: ChatTokenizer,
                      cfg: EpisodeConfig, *, key: str = "", on_step: OnStep | None = None) -> Episode:
    """Run one token-in/token-out episode in a prepared sandbox (the task's setup already committed). Requests
    carry ``rid = <key>/<step>`` (key defaults to ``<instance_id>#0``), unique per request as SGLang expects.
    ``on_step`` sees each finished step (the reply and the observation it got back) as it happens: it must not
    block (the process-reward judge starts its work from it and returns)."""
    policy = _TokenPolicy(engine, tokenizer, cfg, key or f"{task.instance_id}#0")
    return await _Run(task, workspace, policy, cfg, on_step).episode()


async def run_chat_episode(task: Task, workspace: Workspace, engine: ChatEngine, cfg: EpisodeConfig) -> Episode:
    """The same protocol against an OpenAI-compatible chat endpoint (messages only: no training data)."""
    return await _Run(task, workspace, _ChatPolicy(engine, cfg), cfg).episode()


class _Run:
    """One episode while it runs: ``episode()`` is the loop, ``_step()`` one turn and its checks."""

    def __init__(self, task: Task, workspace: Workspace, policy: _Policy, cfg: EpisodeConfig,
                 on_step: OnStep | None = None) -> None:
        self._task, self._workspace, self._policy, self._cfg = task, workspace, policy, cfg
        self._on_step = on_step
        self._renderer = Renderer(cfg.templates, cfg.limits)
        self._steps: list[Step] = []
        self._samples: list[StepSample] = []
        self._format_errors = 0  # in a row
        self._started = time.monotonic()
        self._step_started = self._started

    async def episode(self) -> Episode:
        cfg, limits = self._cfg, self._cfg.limits
        submitted = patch = ""
        try:
            try:
                self._policy.start(self._renderer.system(),
                                   self._renderer.instance(self._task.problem_statement, cfg.workdir))
                for n in range(limits.step_limit):
                    await self._step(n)
                raise LimitsExceeded(f"step limit {limits.step_limit} reached")
            except EpisodeEnd as exc:
                end = exc
            if isinstance(end, Submitted):
                submitted = end.submitted
            if self._steps:
                self._steps[-1].wall_s = time.monotonic() - self._step_started
            patch = (await self._workspace.diff(cfg.workdir)).decode("utf-8", errors="surrogateescape")
        except InfraError as exc:  # engine or sandbox: ABORTED with the reason, never scored
            end = Aborted(f"{type(exc).__name__}: {exc}")
        return Episode(
            instance_id=self._task.instance_id, exit_status=end.exit_status, outcome=OUTCOME[end.exit_status],
            reason=end.reason, patch=patch, submitted=submitted, steps=self._steps,
            trajectory=self._policy.trajectory, samples=self._samples,
            total_time_s=time.monotonic() - self._started,
            model_time_s=sum(s.model_time_s for s in self._steps), env_time_s=sum(s.env_time_s for s in self._steps),
        )

    async def _step(self, n: int) -> None:
        """One turn: checks, the model's reply, the command, the observation. Ends by raising EpisodeEnd."""
        cfg, limits, renderer, policy = self._cfg, self._cfg.limits, self._renderer, self._policy
        if time.monotonic() - self._started > limits.wall_time_s:
            raise TimeExceeded(f"episode ran past {limits.wall_time_s:g} s")
        room, why = policy.room()
        if room <= 0:
            raise ContextExceeded(why)
        step = Step(step=n)
        self._steps.append(step)
        t0 = time.monotonic()
        if n:
            self._steps[n - 1].wall_s = t0 - self._step_started
        self._step_started = t0
        reply = await policy.reply(n, room)
        step.model_time_s = time.monotonic() - t0
        step.output_tokens = reply.output_tokens
        if reply.sample is not None:
            self._samples.append(reply.sample)
        try:
            step.action = parse_action(reply.text, cfg.templates)
        except FormatError as exc:
            step.format_error = True
            self._format_errors += 1
            message = renderer.format_error(exc.actions)
            self._seen(n, reply.text, message)
            if self._format_errors >= limits.max_format_errors:
                raise FormatErrorsExceeded(f"{self._format_errors} malformed replies in a row") from None
            policy.observe(message)
            return
        self._format_errors = 0
        t1 = time.monotonic()
        run = await self._workspace.exec(step.action, limits.command_timeout_s, cwd=cfg.workdir)
        step.env_time_s = time.monotonic() - t1
        step.returncode, step.timed_out, step.output_chars = run.exit_code, run.timed_out, len(run.output)
        if run.timed_out:
            message = renderer.timeout(step.action, run.output, limits.command_timeout_s)
            self._seen(n, reply.text, message)
            policy.observe(message)
            return
        submitted = submission(run.output)
        if submitted is not None:
            self._seen(n, reply.text, run.output)
            raise Submitted(submitted)
        message = renderer.observation(run.output, run.exit_code)
        self._seen(n, reply.text, message)
        policy.observe(message)

    def _seen(self, n: int, reply: str, observation: str) -> None:
        if self._on_step is not None:
            self._on_step(StepView(step=n, reply=reply, observation=observation))
