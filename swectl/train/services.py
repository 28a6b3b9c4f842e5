"""What a GRPO run needs beside the trainer, as one bundle built once per trainer start: the env pool and the engine
servers, the policy's tokenizer, the process-reward judge ([reward.prm]), the gateway and the external harness
([agent] harness), the run's rollouts, and the per-step
readings of the pool and the engines. An SFT run has no bundle: the controller holds None, and its one question
"is this an RL run?" is whether it has one.

    services = RlServices(config, run_dir, say=say, tokenizer=load)
    async with services.opened(run_id, weights):      # the pool and the engine hosts
        await services.start(tg)                       # the engines and the tokenizer (beside the trainer's start)
        await services.ready(tg)                       # the judge, the harness and the rollouts
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec

from swectl.actors.engines import EngineHost, Engines, engine_hosts
from swectl.actors.env_pool import EnvPool, running_pool
from swectl.actors.harnesses import harness_mounts, start_harness
from swectl.actors.judge import Judge
from swectl.actors.metrics import EngineReadings, EnvReadings, HarnessReadings
from swectl.agent.protocol import agent_templates
from swectl.config import ClusterConfig
from swectl.engine.client import SglangClient
from swectl.model.tokenizer import load_tokenizer
from swectl.train.rollouts import TrainRollouts

Say = Callable[[str], None]


class RlServices:
    """The GRPO run's pool, engines, tokenizer, judge and rollouts (see the module docstring for the order of use)."""

    def __init__(self, config: ClusterConfig, run_dir: Path, *, say: Say, tokenizer: Callable[[], Any]) -> None:
        self.config = config
        self.run_dir = run_dir
        self.say = say
        self._tokenizer = tokenizer
        self._pool: EnvPool | None = None
        self._hosts: list[EngineHost] = []
        self._engines: Engines | None = None
        self._rollouts: TrainRollouts | None = None
        self._env: EnvReadings | None = None
        self._engine_readings: EngineReadings | None = None
        self._harness_readings: HarnessReadings | None = None
        self._closing: contextlib.AsyncExitStack | None = None  # what opened() closes at its end (a judge client)

    @property
    def engines(self) -> Engines:
        assert self._engines is not None, "RlServices.opened() first"
        return self._engines

    @property
    def rollouts(self) -> TrainRollouts:
        assert self._rollouts is not None, "RlServices.ready() first"
        return self._rollouts

    @contextlib.asynccontextmanager
    async def opened(self, run_id: str, weights: str) -> AsyncIterator[RlServices]:
        """The env pool and the engine hosts, open for the block; the engines (not started) serve ``weights``."""
        cfg = self.config
        async with (running_pool(cfg, run_id, mounts=harness_mounts(cfg.agent)) as pool,
                    engine_hosts(cfg.engine_nodes()) as hosts, contextlib.AsyncExitStack() as closing):
            self._pool, self._hosts, self._closing = pool, hosts, closing
            self._engines = Engines(cfg.engine, model=weights, hosts=hosts, log_dir=self.run_dir / "engine-logs")
            try:
                yield self
            finally:
                self._pool = self._engines = self._rollouts = self._closing = None

    def describe(self) -> str:
        return f"{len(self._hosts) * self.config.engine.replicas} {self.config.engine.kind} engine server(s)"

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        """The engines (owned by ``tg`` once every server answers) and the tokenizer, at the same time."""
        async with anyio.create_task_group() as starting:
            starting.start_soon(partial(tg.start, self.engines.run, name="engines"))
            starting.start_soon(anyio.to_thread.run_sync, self._tokenizer)

    async def ready(self, tg: anyio.abc.TaskGroup) -> None:
        """The judge (its engines or client owned by ``tg``), the gateway and harness, the rollouts and the
        readings."""
        assert self._pool is not None
        cfg = self.config
        tokenizer = self._tokenizer()
        judge = await self._start_judge(tg) if cfg.reward.prm.enabled else None
        harness = None
        if cfg.agent.harness:  # an external harness, unmodified: its turns through the gateway
            harness = await start_harness(tg, cfg.agent, cfg.rollout, self.engines.route, tokenizer,
                                          self.run_dir / "harness", temperature=cfg.train.sampling.temperature,
                                          seed=f"train:{cfg.train.seed}",
                                          templates=agent_templates(cfg.rollout.agent_config),
                                          wait_routable=self.engines.wait_routable)
            where = ("inside each sandbox" if harness_mounts(cfg.agent)
                     else f"({cfg.agent.harness_config})")
            self.say(f"agent: {cfg.agent.harness} {where} through the gateway at {harness.gateway.url}")
        self._rollouts = TrainRollouts(cfg, self.run_dir, self._pool, self.engines, tokenizer, judge,
                                       harness=harness)
        self._env = EnvReadings(self._pool.statistics)
        self._engine_readings = EngineReadings(self.engines.statistics)
        self._harness_readings = HarnessReadings(harness.statistics) if harness is not None else None

    def step_values(self) -> dict[str, float]:
        """The env pool's, the engines' and the harness's part of a step's metrics (what moved since the last
        step)."""
        values: dict[str, float] = {}
        for readings in (self._env, self._engine_readings, self._harness_readings):
            if readings is not None:
                values.update(readings.step_values())
        return values

    async def _start_judge(self, tg: anyio.abc.TaskGroup) -> Judge:
        """The process-reward judge: its own engine group from a model folder (on the first engine node, never
        updated), or a running server."""
        prm = self.config.reward.prm
        if prm.endpoint:
            assert self._closing is not None, "RlServices.opened() first"
            client = await self._closing.enter_async_context(SglangClient(prm.endpoint, timeout_s=prm.timeout_s))
            judge = Judge(prm, lambda key: client, load_tokenizer(prm.tokenizer, "reward.prm.tokenizer"))
            where = prm.endpoint
        else:
            engines = Engines(msgspec.structs.replace(self.config.engine, replicas=1, port=0), model=prm.model,
                              hosts=self._hosts[:1], log_dir=self.run_dir / "judge-logs")
            await tg.start(engines.run, name="judge engines")
            judge = Judge(prm, engines.route, load_tokenizer(prm.model, "reward.prm.model"))
            where = prm.model
        self.say(f"process rewards: judge {where}, {prm.samples} answers per step, step_coef {prm.step_coef}")
        return judge

