"""The integration tests' bounds on swectl.actors.env_pool.running_pool: the pool must start within
START_TIMEOUT_S and its backends close within CLOSE_TIMEOUT_S, or the test fails (commands clean up
best-effort instead)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager

from swectl.actors import env_pool
from swectl.actors.env_pool import Backends, EnvPool
from swectl.config import ClusterConfig
from swectl.schema import Mount

START_TIMEOUT_S = 60.0  # pool start: connect, prepare, reap
CLOSE_TIMEOUT_S = 30.0


def running_pool(
    cfg: ClusterConfig, run_id: str, *, backends: Backends | None = None, mounts: Sequence[Mount] = ()
) -> AbstractAsyncContextManager[EnvPool]:
    """A started pool (on ``backends`` when given, for tests that look at them; ``mounts`` in its agent sandboxes);
    leaving the block removes every container of the run."""
    return env_pool.running_pool(
        cfg, run_id, backends=backends, start_timeout_s=START_TIMEOUT_S, close_timeout_s=CLOSE_TIMEOUT_S,
        mounts=mounts,
    )
