"""A started EnvPool for the integration tests, with strict bounds: the pool must start within
START_TIMEOUT_S and its backends close within CLOSE_TIMEOUT_S, or the test fails (swectl.actors.env_pool's
running_pool, for commands, cleans up best-effort instead)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from swectl.actors.env_pool import EnvPool
from swectl.config import ClusterConfig, NodeConfig
from swectl.remote.nodes.backends import close_backends, make_backends
from swectl.remote.nodes.podman_sandbox import PodmanBackend

START_TIMEOUT_S = 60.0  # pool start: connect, prepare, reap
CLOSE_TIMEOUT_S = 30.0

Backends = list[tuple[NodeConfig, PodmanBackend]]


@asynccontextmanager
async def running_pool_and_backends(cfg: ClusterConfig, run_id: str) -> AsyncIterator[tuple[EnvPool, Backends]]:
    """A started pool and its backends; leaving the block cancels the pool (which removes every container of
    the run). A failure inside the block is re-raised as itself (not inside the task group's ExceptionGroup)
    once the pool has stopped."""
    backends = make_backends(cfg)
    pool = EnvPool(cfg.env_pool, cfg.sandbox, backends, run_id=run_id)
    failure: Exception | None = None
    try:
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(START_TIMEOUT_S):
                await tg.start(pool.run)
            try:
                yield pool, backends
            except Exception as exc:
                failure = exc
            tg.cancel_scope.cancel()
    finally:
        with anyio.fail_after(CLOSE_TIMEOUT_S):
            await close_backends(backends)
    if failure is not None:
        raise failure


@asynccontextmanager
async def running_pool(cfg: ClusterConfig, run_id: str) -> AsyncIterator[EnvPool]:
    async with running_pool_and_backends(cfg, run_id) as (pool, _):
        yield pool
