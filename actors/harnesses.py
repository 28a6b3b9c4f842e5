"""Which external harness runs the episodes (``[agent] harness``), started behind one gateway: the ``Harness`` every
kind is (actors/harness.py: mini-swe-agent on the controller, its commands in the sandbox; actors/cli_agents.py:
Codex CLI or Claude Code inside the sandbox), ``start_harness`` and the folders its sandboxes need
(``harness_mounts``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

import anyio.abc

from swectl.actors.cli_agents import CLI_KINDS, CliAgent, CliAgentConfig, tools_mounts
from swectl.actors.env_pool import Lease
from swectl.actors.gateway import Gateway, GatewayConfig, SessionRecord
from swectl.actors.harness import start_mini
from swectl.agent.loop import Engine, Episode
from swectl.agent.protocol import AgentTemplates
from swectl.agent.trajectory import ChatTokenizer
from swectl.config import AgentConfig, RolloutOptions
from swectl.schema import HarnessStatistics, Mount
from swectl.tasks.record import Task


@runtime_checkable
class Harness(Protocol):
    """An external harness, unmodified, run for one episode at a time through the gateway."""

    gateway: Gateway
    records: dict[str, SessionRecord]  # the ended sessions' ledgers by episode key

    def for_rollout(self, work_dir: Path, tag: str) -> Harness:
        """The same harness and gateway for another rollout: its folders under ``work_dir``, its sessions tagged."""
        ...

    def statistics(self) -> HarnessStatistics: ...

    async def run_episode(self, task: Task, lease: Lease, key: str) -> Episode:
        """One episode of ``task`` in ``lease`` (already prepared); the Episode to grade (its patch: the diff)."""
        ...


def harness_mounts(agent: AgentConfig) -> list[Mount]:
    """The folders of the node every agent sandbox needs for ``agent.harness`` (a CLI kind's tools), read-only."""
    return tools_mounts(agent.harness, agent.tools_dir)


async def start_harness(tg: anyio.abc.TaskGroup, agent: AgentConfig, rollout: RolloutOptions,
                        engine_for: Callable[[str], Engine], tokenizer: ChatTokenizer, work_dir: Path, *,
                        temperature: float, seed: str | None = None, templates: AgentTemplates | None = None,
                        wait_routable: Callable[[float], Awaitable[float]] | None = None) -> Harness:
    """The gateway (started in ``tg``, its turns sampled by ``engine_for(session name)`` within ``rollout``'s token
    limits at ``temperature``, seeded by ``seed`` and the session's name) and ``agent.harness`` running through it,
    its limits ``rollout``'s; ``wait_routable``: the engines' outage wait, for the gateway to ask a failed turn again
    (actors/gateway.py)."""
    gateway = Gateway(GatewayConfig(max_tokens=rollout.max_tokens, context_tokens=rollout.context,
                                    temperature=temperature, seed=seed), engine_for, tokenizer,
                      wait_routable=wait_routable)
    await tg.start(gateway.run, name="gateway")
    if agent.harness in CLI_KINDS:
        config = CliAgentConfig(kind=agent.harness, step_limit=rollout.step_limit,  # type: ignore[arg-type]
                                max_tokens=rollout.max_tokens, timeout_s=agent.timeout_s)
        await anyio.Path(work_dir).mkdir(parents=True, exist_ok=True)
        return CliAgent(config, gateway, work_dir)
    return await start_mini(tg, agent, rollout, gateway, work_dir, templates=templates)
