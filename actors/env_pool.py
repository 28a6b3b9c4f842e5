"""EnvPool: hands out sandbox leases over many nodes.

Consumes: ``acquire()`` calls from rollout and grading. Produces: ``Lease``s, each holding one fresh
sandbox, placed on the least-loaded healthy node under its caps (``max_starting`` containers being
started, ``max_running`` alive in all). Keeps ``env_pool.warm`` sandboxes of ``sandbox.image`` started
ahead of demand, so a lease usually costs a ping. Waits for: a free slot under the caps (callers bound
that wait with their own cancel scope). Unblocked by: releases, expiries, nodes rejoining.

Leases expire when their holder neither uses the sandbox nor calls ``heartbeat()`` for ``lease_ttl_s``.
Every node is probed each ``health_interval_s``; a node that fails the probe (or whose connection drops)
fails its leases with NodeLostError (any call blocked on it wakes up), loses its warm sandboxes, and
gets no new leases until a probe succeeds again. Containers carry labels (run id, node, controller);
at start and on rejoin, containers of this run that nobody holds and containers of dead controllers on
this host are reaped; at exit everything of this run is removed. Only idempotent calls are retried
(creating a sandbox is: a failed create leaves nothing behind, or an orphan the reaper removes).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import anyio.abc

from swectl.config import ClusterConfig, EnvPoolConfig, NodeConfig, SandboxConfig
from swectl.errors import InfraError, LeaseExpiredError, NodeLostError, PoolClosedError, SandboxError
from swectl.remote.nodes.backends import close_backends, make_backends
from swectl.sandbox import LABEL_CONTROLLER, LABEL_MANAGED, LABEL_NODE, LABEL_RUN, Sandbox, SandboxBackend
from swectl.schema import ExecResult, NodeStatistics, PoolStatistics, SandboxSpec

_log = logging.getLogger(__name__)
SHUTDOWN_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 60.0  # running_pool: closing the backends' connections after the pool stopped

Backends = Sequence[tuple[NodeConfig, SandboxBackend]]


def controller_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass(eq=False)
class _NodeSlot:
    config: NodeConfig
    backend: SandboxBackend
    healthy: bool = False
    starting: int = 0
    leases: set[Lease] = field(default_factory=set)
    warm: list[Sandbox] = field(default_factory=list)
    failures: int = 0
    last_problem: str = ""
    granted: int = 0  # leases given out on this node, for the run's log

    @property
    def load(self) -> int:
        return self.starting + len(self.leases) + len(self.warm)

    def can_start(self) -> bool:
        return (
            self.healthy
            and self.starting < self.config.max_starting
            and self.load < self.config.max_running
        )


class Lease:
    """One sandbox held by one episode or grading job. Use it through its Sandbox-like methods."""

    def __init__(self, pool: EnvPool, slot: _NodeSlot, sandbox: Sandbox) -> None:
        self.id = sandbox.name
        self.node = slot.config.name
        self.sandbox = sandbox
        self._pool = pool
        self._slot = slot
        self.last_heartbeat = anyio.current_time()
        self.failure: InfraError | None = None
        self.busy = 0  # calls in flight: a lease running a long command is not idle

    @property
    def idle(self) -> bool:
        return self.busy == 0

    def heartbeat(self) -> None:
        self.last_heartbeat = anyio.current_time()

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure
        self.heartbeat()

    @asynccontextmanager
    async def in_use(self) -> AsyncIterator[None]:
        """The lease is in use while the block runs (it cannot expire); raises its failure if it has one.
        Every sandbox call goes through this; a holder doing long work elsewhere for the lease (grading its
        patch in another sandbox) wraps that work in it too."""
        self._check()
        self.busy += 1
        try:
            yield
        except InfraError as exc:
            if self.failure is not None and exc is not self.failure:
                raise self.failure from exc
            raise
        finally:
            self.busy -= 1
            self.heartbeat()

    async def exec(
        self, command: str, timeout: float, *, cwd: str | None = None, env: dict[str, str] | None = None,
        output_limit: int | None = None,
    ) -> ExecResult:
        async with self.in_use():
            return await self.sandbox.exec(command, timeout, cwd=cwd, env=env, output_limit=output_limit)

    async def write_file(self, path: str, data: bytes, *, mode: int | None = None) -> None:
        async with self.in_use():
            await self.sandbox.write_file(path, data, mode=mode)

    async def read_file(self, path: str) -> bytes:
        async with self.in_use():
            return await self.sandbox.read_file(path)

    async def diff(self, repo: str | None = None) -> bytes:
        async with self.in_use():
            return await self.sandbox.diff(repo)

    async def ping(self) -> None:
        async with self.in_use():
            await self.sandbox.ping()


class EnvPool:
    """The env pool actor: keeps warm sandboxes on healthy nodes and leases them to episodes and graders."""

    def __init__(
        self,
        config: EnvPoolConfig,
        sandbox: SandboxConfig,
        nodes: Backends,
        *,
        run_id: str,
    ) -> None:
        if not nodes:
            raise ValueError("EnvPool needs at least one node")
        self._config = config
        self._sandbox = sandbox
        self._slots = [_NodeSlot(cfg, backend) for cfg, backend in nodes]
        self.run_id = run_id
        self._controller = controller_id()
        self._changed = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None
        self._closed = False
        self._warming = 0
        self._counts = dict.fromkeys(
            ("granted", "warm_hits", "cold_starts", "expired", "failed", "start_failures", "reaped"), 0
        )

    # ------------------------------------------------------------------ public API

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Connect nodes, reap orphans, then keep the pool healthy and warm until cancelled."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            try:
                async with anyio.create_task_group() as probes:
                    for slot in self._slots:
                        probes.start_soon(self._probe, slot, True, name=f"probe {slot.config.name}")
                if not any(slot.healthy for slot in self._slots):
                    raise InfraError(
                        "no node is usable: "
                        + "; ".join(f"{s.config.name}: {s.last_problem}" for s in self._slots)
                    )
                _log.info("env pool %s: %s sandboxes on %d node(s): %s", self.run_id, self._sandbox.backend,
                          sum(slot.healthy for slot in self._slots),
                          ", ".join(s.config.name for s in self._slots if s.healthy))  # fmt: skip
                tg.start_soon(self._health_loop, name="env_pool health")
                tg.start_soon(self._expiry_loop, name="env_pool lease expiry")
                tg.start_soon(self._warm_loop, name="env_pool warm")
                task_status.started()
                await anyio.sleep_forever()
            finally:
                self._closed = True
                self._notify()
                if self._counts["granted"]:
                    _log.info("env pool %s: leases per node: %s", self.run_id,
                              ", ".join(f"{slot.config.name} {slot.granted}" for slot in self._slots))
                with anyio.CancelScope(shield=True), anyio.move_on_after(SHUTDOWN_TIMEOUT_S):
                    await self._shutdown()
                tg.cancel_scope.cancel("env pool stopped")

    async def acquire(self, image: str | None = None, *, grading: bool = False) -> Lease:
        """A lease on a fresh sandbox. Waits for capacity; bound the wait with a cancel scope. ``grading``: a
        sandbox for a grading, with ``sandbox.grading_cpus`` (where set) instead of ``sandbox.cpus``."""
        image = image or self._sandbox.image
        cpus = self.cpus_for(grading)
        attempts = 0
        while True:
            if self._closed:
                raise PoolClosedError("the env pool is shut down")
            warm_fits = image == self._sandbox.image and cpus == self._sandbox.cpus
            if warm_fits and (lease := await self._take_warm()):
                self._counts["warm_hits"] += 1
                return lease
            slot = self._place()
            if slot is None:
                changed = self._changed
                await changed.wait()
                continue
            try:
                sandbox = await self._create(slot, image, cpus)
            except InfraError as exc:
                attempts += 1
                if attempts > self._config.start_retries:
                    raise
                _log.info("sandbox start on node %s failed (retry %d of %d): %s", slot.config.name, attempts,
                          self._config.start_retries, exc)
                continue
            self._counts["cold_starts"] += 1
            return self._grant(slot, sandbox)

    async def release(self, lease: Lease) -> None:
        """Give the sandbox back; it is destroyed (never reused by another episode)."""
        if lease in lease._slot.leases:
            lease._slot.leases.discard(lease)
            self._notify()
        if lease.failure is None:
            lease.failure = SandboxError(f"lease {lease.id} was released")
        await lease.sandbox.destroy()

    def cpus_for(self, grading: bool) -> float:
        """The CPU limit of a new sandbox (0: none): ``sandbox.grading_cpus`` for a grading where it is set,
        else ``sandbox.cpus``."""
        if grading and self._sandbox.grading_cpus is not None:
            return self._sandbox.grading_cpus
        return self._sandbox.cpus

    @asynccontextmanager
    async def lease(self, image: str | None = None, *, grading: bool = False) -> AsyncIterator[Lease]:
        held = await self.acquire(image, grading=grading)
        try:
            yield held
        finally:
            await self.release(held)

    async def wait_warm(self, count: int) -> None:
        """Wait until at least ``count`` warm sandboxes are ready (bounded by the caller)."""
        while sum(len(s.warm) for s in self._slots) < count:
            changed = self._changed
            await changed.wait()

    def statistics(self) -> PoolStatistics:
        nodes = [
            NodeStatistics(
                name=s.config.name, healthy=s.healthy, leased=len(s.leases), warm=len(s.warm),
                starting=s.starting, max_running=s.config.max_running,
                max_starting=s.config.max_starting, failures=s.failures,
            )
            for s in self._slots
        ]
        c = self._counts
        return PoolStatistics(
            nodes=nodes, leased=sum(n.leased for n in nodes), warm=sum(n.warm for n in nodes),
            starting=sum(n.starting for n in nodes), leases_granted=c["granted"], warm_hits=c["warm_hits"],
            cold_starts=c["cold_starts"], leases_expired=c["expired"], leases_failed=c["failed"],
            start_failures=c["start_failures"], orphans_reaped=c["reaped"],
        )

    # ------------------------------------------------------------------ placement and creation

    def _place(self) -> _NodeSlot | None:
        candidates = [s for s in self._slots if s.can_start()]
        if not candidates:
            return None
        return min(candidates, key=lambda s: s.load / s.config.max_running)

    def _spec(self, slot: _NodeSlot, image: str, cpus: float) -> SandboxSpec:
        cfg = self._sandbox
        return SandboxSpec(
            image=image, workdir=cfg.workdir, network=cfg.network, memory=cfg.memory,
            pids_limit=cfg.pids_limit, cpus=cpus,
            labels={
                LABEL_MANAGED: "1", LABEL_RUN: self.run_id, LABEL_NODE: slot.config.name,
                LABEL_CONTROLLER: self._controller,
            },
        )

    async def _create(self, slot: _NodeSlot, image: str, cpus: float) -> Sandbox:
        slot.starting += 1
        try:
            return await slot.backend.create(self._spec(slot, image, cpus))
        except InfraError as exc:
            slot.failures += 1
            self._counts["start_failures"] += 1
            slot.last_problem = str(exc)
            if not slot.backend.alive or isinstance(exc, NodeLostError):
                await self._fail_node(slot, f"sandbox start failed: {exc}")
            raise
        finally:
            slot.starting -= 1
            self._notify()

    def _grant(self, slot: _NodeSlot, sandbox: Sandbox) -> Lease:
        lease = Lease(self, slot, sandbox)
        slot.leases.add(lease)
        self._counts["granted"] += 1
        slot.granted += 1
        return lease

    async def _take_warm(self) -> Lease | None:
        while True:
            ready = [s for s in self._slots if s.healthy and s.warm]
            if not ready:
                return None
            slot = min(ready, key=lambda s: len(s.leases) / s.config.max_running)
            sandbox = slot.warm.pop()
            self._notify()  # the warm loop refills
            try:
                with anyio.fail_after(5):
                    await sandbox.ping()
            except (InfraError, TimeoutError):
                await sandbox.destroy()
                continue
            except BaseException:
                await sandbox.destroy()  # caller cancelled: the popped sandbox must not leak
                raise
            return self._grant(slot, sandbox)

    async def _warm_loop(self) -> None:
        while True:
            total = sum(len(s.warm) for s in self._slots) + self._warming
            while total < self._config.warm and (slot := self._place()):
                self._warming += 1
                total += 1
                assert self._tg is not None
                self._tg.start_soon(self._make_warm, slot, name=f"warm sandbox on {slot.config.name}")
            changed = self._changed
            with anyio.move_on_after(1):
                await changed.wait()

    async def _make_warm(self, slot: _NodeSlot) -> None:
        try:
            sandbox = await self._create(slot, self._sandbox.image, self._sandbox.cpus)
        except InfraError:
            await anyio.sleep(1)  # back off; placement avoids the node if it was marked unhealthy
            return
        finally:
            self._warming -= 1
        if slot.healthy and not self._closed:
            slot.warm.append(sandbox)
            self._notify()
        else:
            await sandbox.destroy()

    # ------------------------------------------------------------------ health, expiry, orphans

    async def _health_loop(self) -> None:
        while True:
            await anyio.sleep(self._config.health_interval_s)
            async with anyio.create_task_group() as probes:
                for slot in self._slots:
                    probes.start_soon(self._probe, slot, False, name=f"probe {slot.config.name}")

    async def _probe(self, slot: _NodeSlot, initial: bool) -> None:
        problem = ""
        with anyio.move_on_after(self._config.health_timeout_s) as scope:
            try:
                if initial or not slot.healthy:
                    await slot.backend.prepare()  # (re)connect and (re)install the backend's settings
                await slot.backend.probe()
            except InfraError as exc:
                problem = str(exc)
        if scope.cancelled_caught:
            problem = f"health probe got no answer within {self._config.health_timeout_s}s"
        if problem:
            slot.last_problem = problem
            if slot.healthy:
                await self._fail_node(slot, problem)
            return
        if not slot.healthy:
            # Reap before taking the node back, so nothing started on it meanwhile can be mistaken
            # for an orphan.
            await self._reap(slot, initial=initial)
            slot.healthy = True
            slot.last_problem = ""
            if not initial:
                _log.info("node %s rejoined the pool", slot.config.name)
            self._notify()

    async def _fail_node(self, slot: _NodeSlot, reason: str) -> None:
        if not slot.healthy:
            return
        slot.healthy = False
        error = NodeLostError(slot.config.name, reason)
        doomed = [lease.sandbox for lease in slot.leases] + slot.warm
        _log.warning("node %s lost (%d leases failed, no new ones until it answers again): %s", slot.config.name,
                     len(slot.leases), reason)
        for lease in slot.leases:
            lease.failure = error
            self._counts["failed"] += 1
        slot.leases.clear()
        slot.warm.clear()
        self._notify()
        with anyio.CancelScope(shield=True), anyio.move_on_after(10):
            for sandbox in doomed:
                await sandbox.break_transport()

    async def _expiry_loop(self) -> None:
        ttl = self._config.lease_ttl_s
        while True:
            await anyio.sleep(min(ttl / 4, 5.0))
            now = anyio.current_time()
            for slot in self._slots:
                for lease in [x for x in slot.leases if x.idle and now - x.last_heartbeat > ttl]:
                    lease.failure = LeaseExpiredError(
                        f"lease {lease.id} on {lease.node} expired: no use or heartbeat for {ttl}s"
                    )
                    slot.leases.discard(lease)
                    self._counts["expired"] += 1
                    self._notify()
                    assert self._tg is not None
                    self._tg.start_soon(lease.sandbox.destroy, name=f"destroy expired {lease.id}")

    async def _reap(self, slot: _NodeSlot, *, initial: bool) -> None:
        """Remove containers nobody holds: this run's strays, and (at start) dead controllers' ones."""
        try:
            found = await slot.backend.list({LABEL_MANAGED: "1", LABEL_NODE: slot.config.name})
        except InfraError:
            return
        held = {lease.sandbox.id for lease in slot.leases} | {sb.id for sb in slot.warm}
        doomed = []
        for info in found:
            if info.id in held:
                continue
            if info.labels.get(LABEL_RUN) == self.run_id or (
                initial and _controller_is_dead(info.labels.get(LABEL_CONTROLLER, ""))
            ):
                doomed.append(info.id)
        if doomed:
            try:
                await slot.backend.remove(doomed)
                self._counts["reaped"] += len(doomed)
                _log.info("reaped %d orphan container(s) on node %s", len(doomed), slot.config.name)
            except InfraError as exc:
                _log.warning("could not reap %d orphan container(s) on node %s: %s", len(doomed), slot.config.name,
                             exc)

    async def _shutdown(self) -> None:
        async with anyio.create_task_group() as tg:
            for slot in self._slots:
                for sandbox in [lease.sandbox for lease in slot.leases] + slot.warm:
                    tg.start_soon(sandbox.destroy)
                for lease in slot.leases:
                    lease.failure = PoolClosedError("the env pool shut down")
                slot.leases.clear()
                slot.warm.clear()
        async with anyio.create_task_group() as tg:
            for slot in self._slots:
                tg.start_soon(self._remove_run, slot)  # unreachable nodes fail fast or time out

    async def _remove_run(self, slot: _NodeSlot) -> None:
        if not slot.backend.prepared:
            return  # never reached: nothing of ours can be there
        try:
            found = await slot.backend.list({LABEL_RUN: self.run_id, LABEL_NODE: slot.config.name})
            await slot.backend.remove([info.id for info in found])
        except InfraError as exc:
            _log.warning("could not remove the containers of run %s on node %s: %s", self.run_id, slot.config.name,
                         exc)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


def _controller_is_dead(controller: str) -> bool:
    host, _, pid = controller.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@asynccontextmanager
async def running_pool(
    config: ClusterConfig,
    run_id: str | None = None,
    *,
    backends: Backends | None = None,
    start_timeout_s: float | None = None,
    close_timeout_s: float | None = None,
) -> AsyncIterator[EnvPool]:
    """An EnvPool started on every sandbox node; on exit (or Ctrl-C) every container of the run is removed and
    the backends (``make_backends(config)`` unless given) are closed. A failure inside the block is re-raised
    as itself (not inside the task group's ExceptionGroup) once the pool has stopped.

    Commands leave the bounds unset: the start is bounded by the pool's health timeout, and closing gives up
    quietly after CLOSE_TIMEOUT_S. Tests set them: TimeoutError when the pool has not started within
    ``start_timeout_s`` or the backends have not closed within ``close_timeout_s``.
    """
    backends = make_backends(config) if backends is None else backends
    pool = EnvPool(config.env_pool, config.sandbox, backends, run_id=run_id or config.run_id or new_run_id())
    failure: Exception | None = None
    try:
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(start_timeout_s):
                await tg.start(pool.run, name="env_pool")
            try:
                yield pool
            except Exception as exc:  # re-raised as itself, not inside the task group's ExceptionGroup
                failure = exc
            tg.cancel_scope.cancel("block done")
    finally:
        limit = CLOSE_TIMEOUT_S if close_timeout_s is None else close_timeout_s
        with anyio.CancelScope(shield=True), anyio.move_on_after(limit) as closing:
            await close_backends(backends)
        if closing.cancelled_caught and close_timeout_s is not None:
            raise TimeoutError(f"the env pool's backends did not close within {close_timeout_s}s")
    if failure is not None:
        raise failure
