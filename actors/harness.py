"""An external agent harness, run unmodified for one episode at a time: mini-swe-agent v2.

For an episode, the Rollout leases the task's sandbox as for its own agent loop and hands it to
``MiniSweAgent.run_episode``, which:

1. opens a gateway session with the lease (actors/gateway.py): the session's key is the harness's API key, and its
   commands run in the lease (swectl/gateway/harness/swectl_mini.py, loaded by dotted path);
2. runs mini's own `mini` command with the user's config (its SWE-bench config by default) on the task's problem
   statement, in /testbed, its model pointed at the gateway;
3. bounded by ``timeout_s``: a harness that hangs is killed, and the episode ends TimeExceeded;
4. takes the sandbox's diff as the patch to grade (what the repository holds, as for swectl's own loop, whatever
   the harness printed), and ends the session: its ledger holds the episode's tokens, which become the Episode's
   trajectory (the ledger's first trained branch) and ``branches`` (the others), each its own training sample.
   mini's own trajectory says which of its model calls were format errors (``Step.format_error``, one Step per
   call, in the ledger's turn order), so the loss masks that read them work as for swectl's loop.

``config = "swectl"`` is swectl's own prompt (swectl/agent/protocol.py) written as a mini-swe-agent config of its
text-based model (a ```bash block per reply, the same submit command): what the tiny model learns with, since its
chat template renders no tools. Any other value is mini's (a config name it knows, or a YAML file of its format).

mini's exit statuses map onto swectl's: Submitted (COMPLETED); LimitsExceeded, TimeExceeded, and
RepeatedFormatError as FormatError (TRUNCATED). A harness that crashed, or whose commands failed because the
sandbox or the engine did (the gateway answered 5xx), is Aborted: an infrastructure failure, never scored, and
nothing is trained from it as if it were a submission.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.abc
import msgspec

from swectl.actors.env_pool import Lease
from swectl.actors.gateway import Gateway, SessionRecord
from swectl.agent.loop import Episode, Step
from swectl.agent.protocol import SUBMIT_SENTINEL, AgentTemplates
from swectl.agent.trajectory import Message, Trajectory
from swectl.config import AgentConfig, RolloutOptions
from swectl.schema import HarnessStatistics
from swectl.tasks.record import TESTBED, Task

_log = logging.getLogger(__name__)
HARNESS_DIR = Path(__file__).resolve().parents[1] / "swectl" / "gateway" / "harness"
REPO = Path(__file__).resolve().parents[1]
# mini's exit statuses -> swectl's (anything else: the harness stopped on an error)
EXIT_STATUSES = {"Submitted": ("Submitted", "COMPLETED"), "LimitsExceeded": ("LimitsExceeded", "TRUNCATED"),
                 "TimeExceeded": ("TimeExceeded", "TRUNCATED"), "RepeatedFormatError": ("FormatError", "TRUNCATED")}
SWECTL_CONFIG = "swectl"  # swectl's own prompt as a mini config (``mini_config``)
# mini's exception_info (a timed-out command) before swectl's observation
_EXCEPTION = "{% if output.exception_info -%}\n<exception>{{ output.exception_info }}</exception>\n{% endif -%}\n"


def mini_config(templates: AgentTemplates, *, cwd: str = TESTBED) -> dict:
    """``templates`` (swectl's agent prompts) as a mini-swe-agent v2 config of its text-based litellm model: the same
    system, instance, observation and format-error texts, and the same action regex. swectl's own template variables
    are filled in (mini renders with StrictUndefined and knows none of them)."""
    fill = {"{{ sentinel }}": SUBMIT_SENTINEL, "{{ workdir }}": cwd,
            "max_output_chars": str(templates.max_output_chars)}

    def filled(text: str) -> str:
        for name, value in fill.items():
            text = text.replace(name, value)
        return text

    return {"agent": {"system_template": filled(templates.system_template),
                      "instance_template": filled(templates.instance_template), "cost_limit": 0.0},
            "environment": {"cwd": cwd, "timeout": 60},
            "model": {"model_class": "litellm_textbased", "action_regex": templates.action_regex,
                      "observation_template": _EXCEPTION + filled(templates.action_observation_template),
                      "format_error_template": filled(templates.format_error_template)}}


def default_mini() -> str:
    """mini-swe-agent's command in .venv-harness (scripts/setup_harnesses.sh), or $SWECTL_HARNESS_VENV's."""
    venv = Path(os.environ.get("SWECTL_HARNESS_VENV", REPO / ".venv-harness"))
    return str(venv / "bin" / "mini")


def mini_env(home: Path) -> dict[str, str]:
    """The environment mini runs in: swectl's environment class importable, nothing asked (its setup prompt), no
    network (litellm's local cost map), its global config in ``home``."""
    path = os.pathsep.join(p for p in (str(HARNESS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "MSWEA_CONFIGURED": "true",
            "MSWEA_GLOBAL_CONFIG_DIR": str(home), "MSWEA_SILENT_STARTUP": "1"}


ZYGOTE = HARNESS_DIR / "mini_zygote.py"
# mini's imports, once: slow, and far slower on a loaded machine (docs/results.md, "Figures the code relies on")
ZYGOTE_START_S = 600.0
KILL_WAIT_S = 30.0  # a killed episode's process group, reaped at most this long


class MiniZygote:
    """mini's ``mini`` command forked from one warm interpreter (swectl/gateway/harness/mini_zygote.py): ``await
    tg.start(zygote.run)``, then ``await zygote.call(argv, env, cwd, log)`` per episode: its exit status. A call
    that is cancelled (the episode's time limit) kills the child's process group and waits for it."""

    def __init__(self, python: str, home: Path) -> None:
        self._python = python
        self._home = home  # mini's global config folder (read at import: the zygote's)
        self._send: anyio.abc.ByteSendStream | None = None
        self._pids: dict[str, int] = {}
        self._exits: dict[str, int] = {}
        self._events: dict[str, anyio.Event] = {}
        self._ids = 0
        self.failed = ""

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await anyio.Path(self._home).mkdir(parents=True, exist_ok=True)
        log = await anyio.open_file(self._home / "zygote.log", "wb")
        try:
            async with await anyio.open_process([self._python, str(ZYGOTE)], env=mini_env(self._home),
                                                stderr=log.wrapped) as proc:  # type: ignore[arg-type]
                assert proc.stdin is not None and proc.stdout is not None
                self._send = proc.stdin
                lines = _lines(proc.stdout)
                with anyio.fail_after(ZYGOTE_START_S):
                    first = await anext(lines, b"")
                if not first.startswith(b'{"ready"'):
                    raise RuntimeError(f"mini's zygote did not start (log: {self._home / 'zygote.log'})")
                if missing := json.loads(first).get("not_prewarmed"):  # each episode imports these itself
                    _log.warning("mini's zygote could not import %s ahead of the episodes", ", ".join(missing))
                task_status.started()
                try:
                    async for line in lines:
                        message = json.loads(line)
                        if "pid" in message:
                            self._pids[message["id"]] = message["pid"]
                        elif "exit" in message:
                            self._exits[message["id"]] = message["exit"]
                            self._events[message["id"]].set()
                    self.failed = f"mini's zygote exited (log: {self._home / 'zygote.log'})"
                finally:
                    for event in self._events.values():  # callers see the failure, never hang
                        event.set()
                    with anyio.CancelScope(shield=True):
                        await proc.stdin.aclose()
        finally:
            with anyio.CancelScope(shield=True):
                await log.aclose()

    async def call(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> int:
        """Run mini with ``argv`` (without the command itself); its exit status."""
        if self._send is None or self.failed:
            raise RuntimeError(self.failed or "mini's zygote is not running")
        self._ids += 1
        rid = str(self._ids)
        done = self._events[rid] = anyio.Event()
        request = {"id": rid, "argv": argv, "env": env, "cwd": str(cwd), "log": str(log)}
        try:
            await self._send.send(json.dumps(request).encode() + b"\n")
            await done.wait()
            if rid not in self._exits:
                raise RuntimeError(self.failed)
            return self._exits[rid]
        finally:
            if rid not in self._exits and rid in self._pids:  # cancelled: the episode's process group goes
                with anyio.CancelScope(shield=True), anyio.move_on_after(KILL_WAIT_S):
                    with contextlib.suppress(OSError):
                        os.killpg(self._pids[rid], signal.SIGKILL)
                    await done.wait()
            for table in (self._events, self._pids, self._exits):
                table.pop(rid, None)


async def _lines(stream: anyio.abc.ByteReceiveStream) -> AsyncIterator[bytes]:
    buffer = b""
    async for chunk in stream:
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield line


class MiniSweAgentConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How mini-swe-agent is run for each episode."""

    executable: str = ""  # its `mini` command ("": .venv-harness/bin/mini)
    config: str = "swebench.yaml"  # its config (a name it knows, a YAML file of its format, or "swectl")
    step_limit: int = 0  # agent.step_limit (0: the config's)
    max_format_errors: int = 0  # agent.max_consecutive_format_errors (0: the config's)
    timeout_s: float = 1800.0  # the whole episode at most
    overrides: list[str] = []  # more `-c KEY=VALUE` for it
    # each episode's mini forked from one warm interpreter (MiniZygote) instead of started anew: its imports cost
    # seconds of CPU per episode otherwise (docs/results.md, "Figures the code relies on")
    prefork: bool = True


async def start_mini(tg: anyio.abc.TaskGroup, agent: AgentConfig, rollout: RolloutOptions, gateway: Gateway,
                     work_dir: Path, *, templates: AgentTemplates | None = None) -> MiniSweAgent:
    """mini-swe-agent through ``gateway`` (already started), its limits ``rollout``'s, its zygote started in
    ``tg``."""
    config = MiniSweAgentConfig(config=agent.harness_config, step_limit=rollout.step_limit,
                                max_format_errors=rollout.max_format_errors, timeout_s=agent.timeout_s)
    await anyio.Path(work_dir).mkdir(parents=True, exist_ok=True)
    zygote = None
    if config.prefork:
        zygote = MiniZygote(str(Path(config.executable or default_mini()).parent / "python"), work_dir / "mini-home")
        await tg.start(zygote.run, name="mini zygote")
    return MiniSweAgent(config, gateway, work_dir, templates=templates, zygote=zygote)


class MiniSweAgent:
    """Runs mini-swe-agent for one episode through ``gateway`` (``run_episode``); the ledgers of ended sessions are
    kept by episode key in ``records``."""

    def __init__(self, config: MiniSweAgentConfig, gateway: Gateway, work_dir: Path, *, tag: str = "",
                 templates: AgentTemplates | None = None, totals: dict[str, int] | None = None,
                 zygote: MiniZygote | None = None, config_file: str = "") -> None:
        self.config = config
        self._config_path = config_file  # mini's -c config once written ("": not yet)
        self._zygote = zygote
        self.gateway = gateway
        self._work = work_dir
        self._tag = tag  # the sessions' names are ``<episode key>@<tag>`` (the engine routing key)
        self._templates = templates or AgentTemplates()
        self.records: dict[str, SessionRecord] = {}
        # the ended sessions' counts, shared with every for_rollout copy (``statistics``)
        self._totals = totals if totals is not None else dict.fromkeys(
            ("episodes", "turns", "branches", "drift_tokens"), 0)

    def for_rollout(self, work_dir: Path, tag: str) -> MiniSweAgent:
        """The same harness and gateway for another rollout: its folders under ``work_dir``, its sessions tagged."""
        return MiniSweAgent(self.config, self.gateway, work_dir, tag=tag, templates=self._templates,
                            totals=self._totals, zygote=self._zygote, config_file=self._config_file())

    def statistics(self) -> HarnessStatistics:
        return HarnessStatistics(**self._totals, gateway=self.gateway.statistics())

    def _config_file(self) -> str:
        """mini's config: the configured one, or swectl's prompt written once (``SWECTL_CONFIG``) and shared with
        every for_rollout copy."""
        if self.config.config != SWECTL_CONFIG:
            return self.config.config
        if not self._config_path:
            import yaml

            path = self._work / "mini-swectl.yaml"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(yaml.safe_dump(mini_config(self._templates), sort_keys=False, width=1000))
            self._config_path = str(path)
        return self._config_path

    def argv(self, task: Task, key: str, traj: Path) -> list[str]:
        cfg, url = self.config, self.gateway.url
        argv = [cfg.executable or default_mini(), "-c", self._config_file(),
                "-c", "environment.environment_class=swectl_mini.SwectlEnvironment",
                "-c", f"environment.gateway_url={url}", "-c", f"environment.api_key={key}",
                "-c", f"environment.cwd={TESTBED}", "-c", f"model.model_kwargs.api_base={url}",
                "-c", f"model.model_kwargs.api_key={key}", "-c", "model.cost_tracking=ignore_errors"]
        if cfg.step_limit:
            argv += ["-c", f"agent.step_limit={cfg.step_limit}"]
        if cfg.max_format_errors:
            argv += ["-c", f"agent.max_consecutive_format_errors={cfg.max_format_errors}"]
        for override in cfg.overrides:
            argv += ["-c", override]
        return [*argv, "-m", f"openai/{self.gateway.config.model}", "-t", task.problem_statement, "-y",
                "--exit-immediately", "-o", str(traj)]

    async def run_episode(self, task: Task, lease: Lease, key: str) -> Episode:
        """One episode of ``task`` in ``lease`` (already prepared); the Episode to grade (its patch: the diff)."""
        folder = self._work / key.replace("/", "_")
        await anyio.Path(folder).mkdir(parents=True, exist_ok=True)
        traj = folder / "mini.traj.json"
        session = self.gateway.open_session(f"{key}@{self._tag}" if self._tag else key, lease)
        t0 = time.monotonic()
        returncode: int | None = None
        try:
            with anyio.move_on_after(self.config.timeout_s) as scope:  # a hung harness is killed
                argv = self.argv(task, session, traj)
                if self._zygote is not None:
                    returncode = await self._zygote.call(argv[1:], mini_env(folder / "home"), folder,
                                                         folder / "mini.log")
                else:
                    done = await anyio.run_process(argv, input=b"", env=mini_env(folder / "home"), cwd=folder,
                                                   check=False)
                    returncode = done.returncode
                    await anyio.Path(folder / "mini.log").write_bytes(done.stdout + done.stderr)
            timed_out = scope.cancelled_caught
            info = await _read_info(traj)
        finally:
            record = self.gateway.end_session(session)
            self.records[key] = record
            for name, value in (("episodes", 1), ("turns", record.stats.turns), ("branches", record.stats.branches),
                                ("drift_tokens", record.stats.drift_tokens)):
                self._totals[name] += value
        elapsed = time.monotonic() - t0
        status = "TimeExceeded" if timed_out else str(info.get("exit_status", ""))
        messages = [Message(m.get("role", ""), _text(m.get("content"))) for m in info.get("messages", [])]
        if status not in EXIT_STATUSES or (not timed_out and returncode != 0):
            reason = (f"mini-swe-agent ended with {status or 'no exit status'} (exit {returncode}; log: "
                      f"{folder / 'mini.log'})")
            return Episode(instance_id=task.instance_id, exit_status="Aborted", outcome="ABORTED", reason=reason,
                           total_time_s=elapsed, trajectory=Trajectory(messages=messages))
        exit_status, outcome = EXIT_STATUSES[status]
        patch = (await lease.diff(TESTBED)).decode("utf-8", errors="surrogateescape")
        streams = recorded_trajectories(record)
        streams[0].messages = messages
        return Episode(instance_id=task.instance_id, exit_status=exit_status, outcome=outcome,  # type: ignore[arg-type]
                       reason="" if outcome == "COMPLETED" else f"mini-swe-agent: {status}", patch=patch,
                       submitted=str(info.get("submission", "")), total_time_s=elapsed,
                       steps=mini_steps(info.get("messages", []), record.stats.turns),
                       trajectory=streams[0], branches=streams[1:])


def recorded_trajectories(record: SessionRecord) -> list[Trajectory]:
    """The session's trained branches as Trajectories (their spans numbered by turn), the first first; one empty
    Trajectory when the harness sampled nothing."""
    streams = [Trajectory(token_ids=list(b.token_ids), loss_mask=list(b.loss_mask), logprobs=list(b.logprobs),
                          weight_versions=list(b.weight_versions), turns=list(b.turn_numbers))
               for b in record.ledger.trained_branches()]
    return streams or [Trajectory()]


def mini_steps(messages: list[dict], turns: int) -> list[Step]:
    """One Step per model call of mini's run, in order: an assistant message (its command), or a format error (the
    user message mini adds for a reply it rejected, ``extra.interrupt_type`` FormatError). When they are not one per
    recorded turn (a call the gateway never answered), the steps are not trusted: every one is well-formed."""
    steps: list[Step] = []
    for m in messages:
        extra = m.get("extra") if isinstance(m.get("extra"), dict) else {}
        if m.get("role") == "assistant":
            actions = extra.get("actions") or []
            command = actions[0].get("command", "") if actions and isinstance(actions[0], dict) else ""
            steps.append(Step(step=len(steps), action=str(command)))
        elif m.get("role") == "user" and extra.get("interrupt_type") == "FormatError":
            steps.append(Step(step=len(steps), format_error=True))
    if len(steps) != turns:
        _log.warning("mini's trajectory has %d model calls but the gateway recorded %d turns: format errors not "
                     "marked", len(steps), turns)
        return [Step(step=n) for n in range(turns)]
    return steps


async def _read_info(traj: Path) -> dict:
    """mini's trajectory file: its ``info`` (exit status, submission) with its ``messages``; {} when missing."""
    try:
        data = json.loads(await anyio.Path(traj).read_bytes())
    except (OSError, ValueError):
        return {}
    info = dict(data.get("info") or {})
    info["messages"] = data.get("messages") or []
    return info


def _text(content: object) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)
