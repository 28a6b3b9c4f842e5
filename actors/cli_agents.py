"""Terminal coding agents run inside the task's sandbox, unmodified: Codex CLI and Claude Code.

These CLIs run their tools (shell, file edits) where they run, so they run *in* the sandbox, in /testbed, and talk
to swectl's gateway (actors/gateway.py) as their model endpoint. Per episode, ``CliAgent.run_episode``:

1. opens a gateway session: its key is the CLI's API key, its turns at most ``rollout.step_limit`` (one more is a 400
   ``turn_limit_reached``, which ends either CLI's run);
2. opens the episode's way out of the sandbox (``Lease.forward_port``): 127.0.0.1:``GATEWAY_PORT`` inside the
   sandbox reaches the gateway through a unix socket the node serves in the sandbox's /tmp, relayed by the exec
   agent; a sandbox has no network, so nothing else is reachable;
3. runs the CLI from the tools folder every agent sandbox has read-only at ``TOOLS_TARGET`` (scripts/
   setup_cli_agents.sh installs both, pinned; no task image is rebuilt), non-interactive, with the configuration its
   documentation gives for a custom endpoint (docs/cli-agents.md), bounded by ``[agent] timeout_s`` (the exec agent
   kills its process group at the deadline);
4. takes the sandbox's diff against the task's commit as the patch to grade, and the session's ledger as the
   episode's samples (its first trained branch, and the others as ``branches``), as for mini-swe-agent.

Endings: exit 0 is Submitted (COMPLETED); the time limit TimeExceeded; a turn refused for a limit (turns, context),
or a CLI that stopped because the model's last reply ran out of tokens (both CLIs exit 1 then), LimitsExceeded
(TRUNCATED); a turn the infrastructure failed (a 5xx: engine, sandbox), or any other failure of the CLI, Aborted:
never scored.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import anyio
import anyio.abc
import msgspec

from swectl.actors.env_pool import Lease
from swectl.actors.gateway import Gateway, SessionRecord
from swectl.actors.harness import recorded_trajectories
from swectl.agent.loop import Episode, Step
from swectl.agent.trajectory import Trajectory
from swectl.schema import HarnessStatistics, Mount
from swectl.tasks.record import TESTBED, Task

CliKind = Literal["codex", "claude-code"]
CLI_KINDS: tuple[CliKind, ...] = ("codex", "claude-code")
REPO = Path(__file__).resolve().parents[1]
TOOLS_TARGET = "/opt/swectl-tools"  # the tools folder inside every agent sandbox (read-only)
GATEWAY_PORT = 47131  # 127.0.0.1:PORT inside the sandbox is the gateway, for the episode's life
SCRATCH = "/tmp/swectl-cli"  # the CLI's home and config inside the sandbox (outside /testbed: not in the diff)
OUTPUT_LIMIT = 256 * 1024  # the CLI's output kept (head and tail), in its log beside the episode
INSTRUCTION = ("{problem}\n\n"
               "The repository is checked out in {workdir}, your working directory. Resolve the issue above by "
               "editing the repository's source files; do not commit. Reply with a short summary when you are done.")


def default_tools_dir() -> str:
    """Where scripts/setup_cli_agents.sh installs the CLIs: $SWECTL_CLI_TOOLS, else .tools/cli-agents here."""
    return os.environ.get("SWECTL_CLI_TOOLS", str(REPO / ".tools" / "cli-agents"))


def tools_mounts(harness: str, tools_dir: str = "") -> list[Mount]:
    """The folders every agent sandbox needs for ``harness``: the CLI tools folder for a CLI kind, else none. The
    folder must be at that path on every sandbox node."""
    if harness not in CLI_KINDS:
        return []
    return [Mount(source=str(Path(tools_dir or default_tools_dir()).resolve()), target=TOOLS_TARGET)]


class CliAgentConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How a CLI agent is run for each episode."""

    kind: CliKind
    step_limit: int = 30  # model turns at most (the gateway refuses one more; Claude Code's --max-turns too)
    max_tokens: int = 512  # a reply's tokens at most (Claude Code's CLAUDE_CODE_MAX_OUTPUT_TOKENS; Codex asks for
    # none, so the gateway's max_tokens bounds its replies)
    timeout_s: float = 1800.0  # the whole episode at most
    model: str = "swectl-policy"  # the model name the gateway serves


def codex_config(model: str, base_url: str) -> str:
    """Codex's config.toml for a custom endpoint: a model provider speaking the Responses API (since February 2026
    the only wire Codex speaks), its key from $SWECTL_KEY."""
    return (f'model = "{model}"\nmodel_provider = "swectl"\n\n[model_providers.swectl]\nname = "swectl gateway"\n'
            f'base_url = "{base_url}/v1"\nenv_key = "SWECTL_KEY"\nwire_api = "responses"\n')


def cli_command(config: CliAgentConfig, key: str, prompt_file: str) -> str:
    """The shell command that runs the CLI once in /testbed, its environment set for the gateway at
    127.0.0.1:GATEWAY_PORT and nothing else (no updates, no telemetry)."""
    base = f"http://127.0.0.1:{GATEWAY_PORT}"
    env = {"HOME": f"{SCRATCH}/home", "NO_COLOR": "1", "TERM": "dumb"}
    if config.kind == "codex":
        env |= {"CODEX_HOME": f"{SCRATCH}/codex", "SWECTL_KEY": key}
        argv = [f"{TOOLS_TARGET}/bin/codex", "exec", "--dangerously-bypass-approvals-and-sandbox",
                "--skip-git-repo-check", "--color", "never"]
    else:
        env |= {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": key, "ANTHROPIC_MODEL": config.model,
                "ANTHROPIC_SMALL_FAST_MODEL": config.model, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
                "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(config.max_tokens)}
        argv = [f"{TOOLS_TARGET}/bin/claude", "-p", "--max-turns", str(config.step_limit),
                "--allowedTools", "Bash Edit Read Write Glob Grep", "--output-format", "json"]
    exports = " ".join(f"{name}={shlex.quote(value)}" for name, value in env.items())
    return (f"mkdir -p {SCRATCH}/home {SCRATCH}/codex && cd {TESTBED} && "
            f"exec env {exports} {shlex.join(argv)} \"$(cat {prompt_file})\" </dev/null")


class CliAgent:
    """Runs a CLI agent for one episode in the episode's own sandbox, through ``gateway`` (``run_episode``); the
    ledgers of ended sessions are kept by episode key in ``records``."""

    def __init__(self, config: CliAgentConfig, gateway: Gateway, work_dir: Path, *, tag: str = "",
                 totals: dict[str, int] | None = None) -> None:
        self.config = config
        self.gateway = gateway
        self._work = work_dir
        self._tag = tag  # the sessions' names are ``<episode key>@<tag>`` (the engine routing key)
        self.records: dict[str, SessionRecord] = {}
        self._totals = totals if totals is not None else dict.fromkeys(
            ("episodes", "turns", "branches", "drift_tokens"), 0)

    def for_rollout(self, work_dir: Path, tag: str) -> CliAgent:
        """The same CLI and gateway for another rollout: its logs under ``work_dir``, its sessions tagged."""
        return CliAgent(self.config, self.gateway, work_dir, tag=tag, totals=self._totals)

    def statistics(self) -> HarnessStatistics:
        return HarnessStatistics(**self._totals, gateway=self.gateway.statistics())

    async def _connect(self) -> anyio.abc.ByteStream:
        url = urlsplit(self.gateway.url)
        return await anyio.connect_tcp(url.hostname or "127.0.0.1", url.port or 80)

    async def run_episode(self, task: Task, lease: Lease, key: str) -> Episode:
        """One episode of ``task`` in ``lease`` (already prepared); the Episode to grade (its patch: the diff)."""
        cfg = self.config
        folder = self._work / key.replace("/", "_")
        await anyio.Path(folder).mkdir(parents=True, exist_ok=True)
        session = self.gateway.open_session(f"{key}@{self._tag}" if self._tag else key, lease,
                                            max_turns=cfg.step_limit)
        t0 = time.monotonic()
        try:
            prompt = INSTRUCTION.format(problem=task.problem_statement, workdir=TESTBED)
            await lease.write_file(f"{SCRATCH}/prompt.txt", prompt.encode())
            if cfg.kind == "codex":
                await lease.write_file(f"{SCRATCH}/codex/config.toml",
                                       codex_config(cfg.model, f"http://127.0.0.1:{GATEWAY_PORT}").encode())
            async with lease.forward_port(GATEWAY_PORT, self._connect):
                result = await lease.exec(cli_command(cfg, session, f"{SCRATCH}/prompt.txt"), cfg.timeout_s,
                                          cwd=TESTBED, output_limit=OUTPUT_LIMIT)
        finally:
            record = self.gateway.end_session(session)
            self.records[key] = record
            for name, value in (("episodes", 1), ("turns", record.stats.turns), ("branches", record.stats.branches),
                                ("drift_tokens", record.stats.drift_tokens)):
                self._totals[name] += value
        elapsed = time.monotonic() - t0
        log = folder / f"{cfg.kind}.log"
        await anyio.Path(log).write_text(result.output)
        exit_status, outcome = ending(cfg.kind, result.exit_code, result.timed_out, record, result.output)
        if outcome == "ABORTED":
            return Episode(instance_id=task.instance_id, exit_status="Aborted", outcome="ABORTED",
                           reason=f"{cfg.kind} failed (exit {result.exit_code}; log: {log})",
                           total_time_s=elapsed, trajectory=Trajectory())
        patch = (await lease.diff(TESTBED)).decode("utf-8", errors="surrogateescape")
        streams = recorded_trajectories(record)
        return Episode(instance_id=task.instance_id, exit_status=exit_status, outcome=outcome,  # type: ignore[arg-type]
                       reason="" if outcome == "COMPLETED" else f"{cfg.kind}: {exit_status} (log: {log})",
                       patch=patch, total_time_s=elapsed, steps=[Step(step=n) for n in range(record.stats.turns)],
                       trajectory=streams[0], branches=streams[1:])


def ending(kind: CliKind, exit_code: int, timed_out: bool, record: SessionRecord, output: str) -> tuple[str, str]:
    """(exit status, outcome) of a CLI's run: see the module's docstring."""
    if record.failed:
        return "Aborted", "ABORTED"
    if timed_out:
        return "TimeExceeded", "TRUNCATED"
    if record.limited or (kind == "claude-code" and _claude_subtype(output) == "error_max_turns"):
        return "LimitsExceeded", "TRUNCATED"
    if exit_code == 0:
        return "Submitted", "COMPLETED"
    if record.stats.turns and record.last_finish == "length":  # the model's reply ran out of tokens: the CLI stops
        return "LimitsExceeded", "TRUNCATED"
    return "Aborted", "ABORTED"


def _claude_subtype(output: str) -> str:
    """The ``subtype`` of Claude Code's ``--output-format json`` result (its last JSON line), or ""."""
    for line in reversed(output.strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and data.get("type") == "result":
            return str(data.get("subtype", ""))
    return ""
