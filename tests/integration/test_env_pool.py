"""EnvPool on the local node, against real podman containers.

Covers the lease round trip and its counters, the warm pool, the per-node cap, lease expiry and heartbeats,
orphan reaping at start, cleanup at exit and a sandbox killed from outside. Every pool gets a fresh run id;
a finalizer force-removes whatever carries that run id, so a failing test leaves nothing behind.
"""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from swectl.actors.env_pool import EnvPool
from swectl.config import DEFAULT_IMAGE, ClusterConfig, decode_config, load_config
from swectl.errors import InfraError, LeaseExpiredError, PoolClosedError, SandboxLostError
from swectl.remote.nodes.podman import bundled_containers_conf
from swectl.sandbox import LABEL_CONTROLLER, LABEL_MANAGED, LABEL_NODE, LABEL_RUN

from .conftest import CPU_QUOTA
from .pools import running_pool

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

REPO_ROOT = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = bundled_containers_conf()
CREATE_TIMEOUT_S = 60.0  # one cold sandbox start, with room for a busy machine


# ---------------------------------------------------------------------------------------------- helpers


def podman(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    return subprocess.run(["podman", *args], capture_output=True, text=True, env=env, timeout=timeout, check=False)


async def apodman(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    with anyio.fail_after(timeout):
        return await anyio.run_process(["podman", *args], env=env, check=False)


async def containers(**labels: str) -> list[str]:
    """Ids of all containers (any state) carrying every one of ``labels``."""
    args = ["ps", "-a", "-q", "--no-trunc"]
    for key, value in labels.items():
        args += ["--filter", f"label={key}={value}"]
    out = await apodman(*args)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    return out.stdout.decode().split()


async def exists(container_id: str) -> bool:
    out = await apodman("container", "exists", container_id)
    return out.returncode == 0


def run_labels(run_id: str) -> dict[str, str]:
    return {LABEL_RUN: run_id}


@pytest.fixture
def run_id() -> Iterator[str]:
    """A fresh run id; whatever still carries it after the test is force-removed."""
    rid = "t" + uuid.uuid4().hex[:16]
    yield rid
    ids = podman("ps", "-a", "-q", "--no-trunc", "--filter", f"label={LABEL_RUN}={rid}").stdout.split()
    if ids:
        podman("rm", "--force", "--ignore", "--time", "0", *ids)


def config(*overrides: str) -> ClusterConfig:
    """The embedded default (one local node) on Podman (these tests look at the containers; the pool on
    namespace sandboxes: test_namespace_sandbox.py), with ``--set`` style overrides."""
    return load_config(None, ["sandbox.backend='podman'", *overrides])


async def acquire(pool: EnvPool, timeout: float = CREATE_TIMEOUT_S):
    with anyio.fail_after(timeout):
        return await pool.acquire()


async def release(pool: EnvPool, lease) -> None:
    with anyio.fail_after(60):
        await pool.release(lease)


async def wait_until(predicate, timeout: float, what: str, interval: float = 0.1) -> None:
    try:
        with anyio.fail_after(timeout):
            while True:
                if await predicate():
                    return
                await anyio.sleep(interval)
    except TimeoutError:
        pytest.fail(f"{what}: not within {timeout}s")


# ---------------------------------------------------------------------------------------------- tests


async def test_lease_round_trip_and_counters(run_id: str) -> None:
    async with running_pool(config("env_pool.warm=0"), run_id) as pool:
        lease = await acquire(pool)
        assert lease.node == "local"
        assert lease.failure is None
        with anyio.fail_after(30):
            result = await lease.exec("echo hello from $(hostname)", 20)
            await lease.write_file("/tmp/round-trip.txt", b"payload\x00\xff")
            assert await lease.read_file("/tmp/round-trip.txt") == b"payload\x00\xff"
            await lease.ping()
        assert result.exit_code == 0
        assert not result.timed_out
        assert result.output.startswith("hello from ")
        assert await containers(**run_labels(run_id)) == [lease.sandbox.id]

        stats = pool.statistics()
        assert (stats.leases_granted, stats.cold_starts, stats.warm_hits) == (1, 1, 0)
        assert stats.leased == 1
        assert stats.nodes[0].leased == 1
        assert stats.nodes[0].healthy

        await release(pool, lease)
        assert not await exists(lease.sandbox.id)
        with pytest.raises(InfraError):  # a released lease is no longer usable
            with anyio.fail_after(10):
                await lease.exec("true", 5)

        with anyio.fail_after(CREATE_TIMEOUT_S + 30):
            async with pool.lease() as second:
                assert (await second.exec("exit 3", 10)).exit_code == 3
        assert not await exists(second.sandbox.id)

        stats = pool.statistics()
        assert (stats.leases_granted, stats.cold_starts, stats.warm_hits) == (2, 2, 0)
        assert stats.leased == 0
        assert stats.warm == 0
        assert (stats.leases_expired, stats.leases_failed, stats.start_failures) == (0, 0, 0)


async def test_warm_pool_hit_and_refill(run_id: str) -> None:
    async with running_pool(config("env_pool.warm=2"), run_id) as pool:
        with anyio.fail_after(2 * CREATE_TIMEOUT_S):
            await pool.wait_warm(2)
        assert pool.statistics().warm == 2
        warm_ids = set(await containers(**run_labels(run_id)))
        assert len(warm_ids) == 2

        lease = await acquire(pool, timeout=10)  # a warm hit costs a ping, not a container start
        assert lease.sandbox.id in warm_ids
        stats = pool.statistics()
        assert (stats.leases_granted, stats.warm_hits, stats.cold_starts) == (1, 1, 0)

        with anyio.fail_after(2 * CREATE_TIMEOUT_S):
            await pool.wait_warm(2)  # refilled behind the lease
        stats = pool.statistics()
        assert stats.warm == 2
        assert stats.leased == 1
        assert len(await containers(**run_labels(run_id))) == 3
        with anyio.fail_after(20):
            assert (await lease.exec("echo warm", 10)).output == "warm\n"
        await release(pool, lease)


async def test_grading_leases_take_grading_cpus_and_skip_warm_sandboxes(run_id: str) -> None:
    """sandbox.grading_cpus = 0: a grading's sandbox has no CPU limit (as the official harness runs tests), the
    agent's keeps sandbox.cpus; a warm sandbox (made with sandbox.cpus) is never handed to a grading."""
    async with running_pool(config("env_pool.warm=1", "sandbox.cpus=0.5", "sandbox.grading_cpus=0"), run_id) as pool:
        with anyio.fail_after(2 * CREATE_TIMEOUT_S):
            await pool.wait_warm(1)
        warm_ids = set(await containers(**run_labels(run_id)))
        assert (pool.cpus_for(grading=True), pool.cpus_for(grading=False)) == (0, 0.5)
        with anyio.fail_after(CREATE_TIMEOUT_S + 30):
            async with pool.lease(grading=True) as grading:
                assert grading.sandbox.id not in warm_ids
                limit = (await grading.exec(CPU_QUOTA, 10)).output.split()
                assert limit[0] in ("max", "-1"), limit  # cgroup v2 / v1: no quota
            async with pool.lease() as agent:
                assert agent.sandbox.id in warm_ids
                limit = (await agent.exec(CPU_QUOTA, 10)).output.split()
                assert limit[0] == "50000", limit  # 0.5 of a 100000 µs period
        assert pool.statistics().warm_hits == 1


def test_set_override_of_embedded_default_node() -> None:
    """``--set nodes.0.max_running=N`` is the CLI's own documented example; it must work on the default."""
    cfg = config("nodes.0.max_running=2", "nodes.0.max_starting=2")
    assert cfg.nodes[0].max_running == 2


async def test_per_node_cap_blocks_then_unblocks(run_id: str) -> None:
    # Written as a document: the `nodes.0.max_running=2` override fails on the embedded default (see
    # test_set_override_of_embedded_default_node). max_starting must not exceed max_running.
    cfg = decode_config(
        {
            "nodes": [{"kind": "local", "name": "local", "max_running": 2, "max_starting": 2}],
            "env_pool": {"warm": 0},
            "sandbox": {"backend": "podman"},
        }
    )
    async with running_pool(cfg, run_id) as pool:
        first = await acquire(pool)
        second = await acquire(pool)
        assert pool.statistics().leased == 2

        got: list = []
        done = anyio.Event()

        async def third() -> None:
            got.append(await pool.acquire())
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(third)
            with anyio.move_on_after(1.5):
                await done.wait()
            assert not done.is_set(), "a third acquire() went past max_running=2"
            assert pool.statistics().leased == 2
            assert len(await containers(**run_labels(run_id))) == 2

            await release(pool, first)
            with anyio.fail_after(CREATE_TIMEOUT_S):
                await done.wait()
        (lease,) = got
        with anyio.fail_after(20):
            assert (await lease.exec("echo third", 10)).exit_code == 0
        stats = pool.statistics()
        assert stats.leased == 2
        assert stats.leases_granted == 3
        await release(pool, second)
        await release(pool, lease)


async def test_lease_ttl_expires_idle_lease_but_not_heartbeated_one(run_id: str) -> None:
    # lease_ttl_s=1: the expiry loop looks every min(ttl/4, 5) = 0.25 s.
    async with running_pool(config("env_pool.warm=0", "env_pool.lease_ttl_s=1"), run_id) as pool:
        idle = await acquire(pool)
        kept = await acquire(pool)
        with anyio.fail_after(10):
            for _ in range(10):  # 2.5 s: idle is unused, kept only heartbeats (never uses the sandbox)
                kept.heartbeat()
                await anyio.sleep(0.25)

        with pytest.raises(LeaseExpiredError):
            with anyio.fail_after(10):
                await idle.exec("true", 5)
        assert isinstance(idle.failure, LeaseExpiredError)
        await wait_until(lambda: _gone(idle.sandbox.id), 30, "the expired lease's container removed")

        with anyio.fail_after(20):
            assert (await kept.exec("echo alive", 10)).output == "alive\n"
        assert kept.failure is None
        stats = pool.statistics()
        assert stats.leases_expired == 1
        assert stats.leased == 1
        await release(pool, idle)  # releasing an expired lease is harmless
        await release(pool, kept)


async def test_lease_busy_in_a_long_exec_does_not_expire(run_id: str) -> None:
    """A holder blocked in exec is using its sandbox: a command longer than the TTL must not expire it."""
    async with running_pool(config("env_pool.warm=0", "env_pool.lease_ttl_s=1"), run_id) as pool:
        lease = await acquire(pool)
        with anyio.fail_after(30):
            result = await lease.exec("sleep 3; echo done", 10)
        assert (result.exit_code, result.output) == (0, "done\n")
        assert pool.statistics().leases_expired == 0
        await release(pool, lease)


def unused_pid() -> int:
    pid = 999999  # above any default pid_max
    while Path(f"/proc/{pid}").exists():
        pid += 1
    return pid


async def _gone(container_id: str) -> bool:
    return not await exists(container_id)


async def test_orphans_reaped_at_start(run_id: str) -> None:
    host = socket.gethostname()
    other_run = "t" + uuid.uuid4().hex[:16]
    live = f"{host}:{os.getpid()}"
    dead_pid = unused_pid()
    plan = {
        # this run's stray, made by a (live) controller: reaped because of the run id
        "same_run": {LABEL_RUN: run_id, LABEL_CONTROLLER: live},
        # another run of a dead controller on this host: reaped at start
        "dead_controller": {LABEL_RUN: other_run, LABEL_CONTROLLER: f"{host}:{dead_pid}"},
        # another run of a live controller on this host: left alone
        "live_controller": {LABEL_RUN: other_run, LABEL_CONTROLLER: live},
    }
    made: dict[str, str] = {}
    try:
        for what, labels in plan.items():
            args = ["run", "-d", "--init", "--network", "none"]
            for key, value in {LABEL_MANAGED: "1", LABEL_NODE: "local", **labels}.items():
                args += ["--label", f"{key}={value}"]
            out = await apodman(*args, "--entrypoint", "sleep", DEFAULT_IMAGE, "infinity")
            assert out.returncode == 0, out.stderr.decode(errors="replace")
            made[what] = out.stdout.decode().strip()

        async with running_pool(config("env_pool.warm=0"), run_id) as pool:
            assert not await exists(made["same_run"])
            assert not await exists(made["dead_controller"])
            assert await exists(made["live_controller"])
            # >= 1, not 2: a pool of a concurrent test session may reap the dead controller's one first.
            assert pool.statistics().orphans_reaped >= 1
    finally:
        if made:
            await apodman("rm", "--force", "--ignore", "--time", "0", *made.values())


async def test_exit_removes_leased_and_warm_sandboxes(run_id: str) -> None:
    async with running_pool(config("env_pool.warm=2"), run_id) as pool:
        held = [await acquire(pool), await acquire(pool)]
        with anyio.fail_after(2 * CREATE_TIMEOUT_S):
            await pool.wait_warm(2)
        stats = pool.statistics()
        assert stats.leased == 2
        assert stats.warm == 2
        assert len(await containers(**run_labels(run_id))) >= 4
    assert await containers(**run_labels(run_id)) == []
    for lease in held:  # still held by the caller, but the pool is gone
        with pytest.raises(PoolClosedError):
            with anyio.fail_after(10):
                await lease.exec("true", 5)


async def test_container_killed_from_outside(run_id: str) -> None:
    async with running_pool(config("env_pool.warm=0"), run_id) as pool:
        lease = await acquire(pool)
        with anyio.fail_after(20):
            assert (await lease.exec("true", 10)).exit_code == 0
        out = await apodman("kill", lease.sandbox.id)
        assert out.returncode == 0, out.stderr.decode(errors="replace")

        started = anyio.current_time()
        with pytest.raises(SandboxLostError):
            with anyio.fail_after(10):  # far below the exec guard (timeout + exec_grace_s = 40 s)
                await lease.exec("echo never", 30)
        assert anyio.current_time() - started < 10
        await release(pool, lease)

        fresh = await acquire(pool)
        with anyio.fail_after(20):
            assert (await fresh.exec("echo fine", 10)).output == "fine\n"
        assert pool.statistics().nodes[0].healthy
        await release(pool, fresh)
