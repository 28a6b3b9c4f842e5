"""EnvPool: hands out sandbox leases over many nodes.

Consumes: ``acquire()`` calls from rollout and grading. Produces: ``Lease``s, each holding one fresh
sandbox, placed on a healthy node under its caps (``max_starting`` containers being started, ``max_running``
alive in all), preferring nodes that hold the lease's image (swectl/images/placement.py has the rule). Keeps
``env_pool.warm`` sandboxes of ``sandbox.image`` started ahead of demand, so a lease usually costs a ping.
Waits for: a free slot under the caps (callers bound that wait with their own cancel scope). Unblocked by:
releases, expiries, nodes rejoining, pulls ending.

Images (nodes whose images live in a Podman store: the podman and namespace backends): each node's images are
listed when it joins or rejoins and kept up to date as pulls and removals end (swectl/images/presence.py). A lease
placed on a node that lacks its image waits for the one pull of that image there (from ``env_pool.registry``, or
under the image's own name; ``env_pool.image_pull_timeout_s``); every other lease for it joins that pull, and a
failed pull is not tried again there for PULL_RETRY_AFTER_S. A lease that waited for a pull carries
``image_wait_s`` (statistics: ``image_waits``, ``image_wait_s``; metrics: ``env/image_wait_s``). A node's pulls count
in its load. With ``nodes.N.image_disk_gb`` set, after each pull (and at join) images least recently leased are
removed while the node's images take more than that, never one a live sandbox or a pending lease uses, nor
``sandbox.image`` (one pass at a time per node, bounded by EVICT_TIMEOUT_S).

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
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import anyio.abc

from swectl.config import ClusterConfig, EnvPoolConfig, NodeConfig, SandboxConfig
from swectl.errors import InfraError, LeaseExpiredError, NodeLostError, PoolClosedError, SandboxError
from swectl.images.placement import NodeView, choose_node
from swectl.images.presence import NodeImages, Transfer, image_key
from swectl.images.registry import parse_registry
from swectl.images.store import ImagePullError, ImageStore, store_for
from swectl.remote.nodes.backends import close_backends, make_backends
from swectl.sandbox import (
    LABEL_CONTROLLER,
    LABEL_MANAGED,
    LABEL_NODE,
    LABEL_RUN,
    ForgetsImages,
    Sandbox,
    SandboxBackend,
)
from swectl.schema import ExecResult, Mount, NodeStatistics, PoolStatistics, SandboxSpec

_log = logging.getLogger(__name__)
SHUTDOWN_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 60.0  # running_pool: closing the backends' connections after the pool stopped
PULL_RETRY_AFTER_S = 30.0  # a pull that failed on a node is not tried there again for this long (leases fail at once)
EVICT_TIMEOUT_S = 600.0  # one pass of removing images over a node's disk budget

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
    store: ImageStore | None = None  # the node's image store; None: images are left to the backend
    images: NodeImages | None = None  # what the pool knows of its images (with a store)
    waiting: int = 0  # leases and warm sandboxes waiting for a pull on this node
    evicting: anyio.Lock = field(default_factory=anyio.Lock)  # one pass over the disk budget at a time

    @property
    def used(self) -> int:
        """Slots in use: sandboxes starting, leases and warm sandboxes waiting for a pull, leased, warm."""
        return self.starting + self.waiting + len(self.leases) + len(self.warm)

    def can_start(self) -> bool:
        return (
            self.healthy
            and self.starting < self.config.max_starting
            and self.used < self.config.max_running
        )

    def view(self, image: str, anywhere: bool) -> NodeView:
        """The node as the placement sees it for ``image`` (``anywhere``: every node has it)."""
        images = self.images
        holds = True if images is None or anywhere else images.holds(image)
        transfer = images.transfer(image) if images is not None else None
        return NodeView(
            healthy=self.healthy, holds=holds, pulling=transfer is not None and transfer.kind == "pull",
            starting=self.starting, max_starting=self.config.max_starting, used=self.used,
            max_running=self.config.max_running, pulls=images.pulls() if images is not None else 0,
        )


class Lease:
    """One sandbox held by one episode or grading job. Use it through its Sandbox-like methods."""

    def __init__(self, pool: EnvPool, slot: _NodeSlot, sandbox: Sandbox, image: str = "") -> None:
        self.id = sandbox.name
        self.node = slot.config.name
        self.sandbox = sandbox
        self.image = image  # as the node lists it (image_key)
        self.image_wait_s = 0.0  # how long the lease waited for a pull of its image onto the node (0: none)
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

    @asynccontextmanager
    async def forward_port(self, port: int, connect: Callable[[], Awaitable[anyio.abc.ByteStream]]
                           ) -> AsyncIterator[None]:
        """``Sandbox.forward_port``; the lease is in use (it cannot expire) while the block runs."""
        async with self.in_use(), self.sandbox.forward_port(port, connect):
            yield


class EnvPool:
    """The env pool actor: keeps warm sandboxes on healthy nodes and leases them to episodes and graders."""

    def __init__(
        self,
        config: EnvPoolConfig,
        sandbox: SandboxConfig,
        nodes: Backends,
        *,
        run_id: str,
        image_stores: Mapping[str, ImageStore | None] | None = None,
        mounts: Sequence[Mount] = (),
    ) -> None:
        """``image_stores``: each node's image store by node name (tests); by default the backend's Podman store.
        ``mounts``: folders of the nodes bound read-only into every sandbox that is not a grading's (a CLI agent's
        tools)."""
        self._mounts = list(mounts)
        if not nodes:
            raise ValueError("EnvPool needs at least one node")
        self._config = config
        self._sandbox = sandbox
        registry = parse_registry(config.registry, "env_pool.registry") if config.registry else None
        self._slots = [_NodeSlot(cfg, backend) for cfg, backend in nodes]
        for slot in self._slots:
            slot.store = (image_stores.get(slot.config.name) if image_stores is not None
                          else store_for(slot.backend, registry))
            slot.images = NodeImages() if slot.store is not None else None
        # images every node has without a store (the namespace backend's rootfs tarballs)
        self._anywhere = set.intersection(*({image_key(i) for i in slot.backend.preloaded_images()}
                                            for slot in self._slots))
        self._pool_image = image_key(sandbox.image)
        self._wanted: Counter[str] = Counter()  # images of the acquires in progress (never evicted)
        self._image_wait_s = 0.0
        self.run_id = run_id
        self._controller = controller_id()
        self._changed = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None
        self._closed = False
        self._warming = 0
        self._counts = dict.fromkeys(
            ("granted", "warm_hits", "cold_starts", "expired", "failed", "start_failures", "reaped", "image_pulls",
             "image_pull_failures", "image_waits", "images_evicted"), 0
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

    async def acquire(self, image: str | None = None, *, grading: bool = False, cpus: float | None = None,
                      memory: str | None = None) -> Lease:
        """A lease on a fresh sandbox. Waits for capacity; bound the wait with a cancel scope. ``grading``: a
        sandbox for a grading, with ``sandbox.grading_cpus`` (where set) instead of ``sandbox.cpus``. ``cpus`` and
        ``memory`` are a task's own limits (a Harbor task's ``[environment]``), in place of the section's."""
        image = image or self._sandbox.image
        key = image_key(image)
        self._wanted[key] += 1  # a pending lease's image is never evicted
        try:
            return await self._acquire(image, cpus if cpus is not None else self.cpus_for(grading), memory,
                                       [] if grading else self._mounts)
        finally:
            self._wanted[key] -= 1
            if not self._wanted[key]:
                del self._wanted[key]

    async def _acquire(self, image: str, cpus: float, memory: str | None = None, mounts: list[Mount] | None = None
                       ) -> Lease:
        attempts = 0
        waited = 0.0  # seconds this lease waited for pulls of its image
        while True:
            if self._closed:
                raise PoolClosedError("the env pool is shut down")
            warm_fits = (image == self._sandbox.image and cpus == self._sandbox.cpus and not mounts
                         and memory in (None, self._sandbox.memory))
            if warm_fits and (lease := await self._take_warm()):
                self._counts["warm_hits"] += 1
                return lease
            slot = self._place(image)
            if slot is None:
                changed = self._changed
                await changed.wait()
                continue
            try:
                if not self._has_image(slot, image):
                    waited += await self._wait_for_image(slot, image)
                    continue  # placed again: the node holds the image now, and the start caps apply
                sandbox = await self._create(slot, image, cpus, memory, mounts)
            except InfraError as exc:
                attempts += 1
                if attempts > self._config.start_retries:
                    raise
                _log.info("sandbox start on node %s failed (retry %d of %d): %s", slot.config.name, attempts,
                          self._config.start_retries, exc)
                continue
            self._counts["cold_starts"] += 1
            lease = self._grant(slot, sandbox, image)
            if waited:
                lease.image_wait_s = waited
                self._counts["image_waits"] += 1
                self._image_wait_s += waited
            return lease

    async def release(self, lease: Lease) -> None:
        """Give the sandbox back; it is destroyed (never reused by another episode)."""
        if lease in lease._slot.leases:
            lease._slot.leases.discard(lease)
            if lease._slot.images is not None:
                lease._slot.images.touch(lease.image, anyio.current_time())
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
    async def lease(self, image: str | None = None, *, grading: bool = False, cpus: float | None = None,
                    memory: str | None = None) -> AsyncIterator[Lease]:
        held = await self.acquire(image, grading=grading, cpus=cpus, memory=memory)
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
                images=len(s.images.present) if s.images is not None and s.images.known else None,
                pulls=s.images.pulls() if s.images is not None else 0, waiting=s.waiting,
                image_disk_gb=(round(s.images.disk_bytes / 1e9, 3)
                               if s.images is not None and s.images.disk_bytes is not None else None),
                image_disk_budget_gb=s.config.image_disk_gb,
            )
            for s in self._slots
        ]
        c = self._counts
        return PoolStatistics(
            nodes=nodes, leased=sum(n.leased for n in nodes), warm=sum(n.warm for n in nodes),
            starting=sum(n.starting for n in nodes), leases_granted=c["granted"], warm_hits=c["warm_hits"],
            cold_starts=c["cold_starts"], leases_expired=c["expired"], leases_failed=c["failed"],
            start_failures=c["start_failures"], orphans_reaped=c["reaped"], image_pulls=c["image_pulls"],
            image_pull_failures=c["image_pull_failures"], image_waits=c["image_waits"],
            image_wait_s=self._image_wait_s, images_evicted=c["images_evicted"],
        )

    # ------------------------------------------------------------------ placement and creation

    def _place(self, image: str) -> _NodeSlot | None:
        anywhere = image_key(image) in self._anywhere
        chosen = choose_node([slot.view(image, anywhere) for slot in self._slots])
        return None if chosen is None else self._slots[chosen]

    def _spec(self, slot: _NodeSlot, image: str, cpus: float, memory: str | None = None,
              mounts: list[Mount] | None = None) -> SandboxSpec:
        cfg = self._sandbox
        return SandboxSpec(
            image=image, workdir=cfg.workdir, network=cfg.network, memory=memory or cfg.memory,
            pids_limit=cfg.pids_limit, cpus=cpus, mounts=list(mounts or ()),
            labels={
                LABEL_MANAGED: "1", LABEL_RUN: self.run_id, LABEL_NODE: slot.config.name,
                LABEL_CONTROLLER: self._controller,
            },
        )

    async def _create(self, slot: _NodeSlot, image: str, cpus: float, memory: str | None = None,
                      mounts: list[Mount] | None = None) -> Sandbox:
        slot.starting += 1
        try:
            return await slot.backend.create(self._spec(slot, image, cpus, memory, mounts))
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

    def _grant(self, slot: _NodeSlot, sandbox: Sandbox, image: str) -> Lease:
        lease = Lease(self, slot, sandbox, image_key(image))
        if slot.images is not None:
            slot.images.touch(image, anyio.current_time())
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
            return self._grant(slot, sandbox, self._sandbox.image)

    async def _warm_loop(self) -> None:
        while True:
            total = sum(len(s.warm) for s in self._slots) + self._warming
            while total < self._config.warm and (slot := self._place(self._sandbox.image)):
                self._warming += 1
                total += 1
                assert self._tg is not None
                self._tg.start_soon(self._make_warm, slot, name=f"warm sandbox on {slot.config.name}")
            changed = self._changed
            with anyio.move_on_after(1):
                await changed.wait()

    async def _make_warm(self, slot: _NodeSlot) -> None:
        image = self._sandbox.image
        try:
            if not self._has_image(slot, image):
                await self._wait_for_image(slot, image)
                if not slot.can_start():
                    return  # the warm loop places it again
            sandbox = await self._create(slot, image, self._sandbox.cpus)
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

    # ------------------------------------------------------------------ images on the nodes

    def _has_image(self, slot: _NodeSlot, image: str) -> bool:
        """Whether a sandbox of ``image`` may start on the node now (False: wait for its pull there first)."""
        return slot.images is None or image_key(image) in self._anywhere or slot.images.holds(image) is True

    async def _wait_for_image(self, slot: _NodeSlot, image: str) -> float:
        """Wait until the node's one transfer of ``image`` ends, starting its pull if none is in flight; the seconds
        waited when that transfer pulled the image (0 when it found it there, or was a removal). ImagePullError when
        the pull failed (or failed there less than PULL_RETRY_AFTER_S ago) or the wait ran out."""
        images = slot.images
        assert images is not None and self._tg is not None
        name = slot.config.name
        failed = images.recent_failure(image, anyio.current_time(), PULL_RETRY_AFTER_S)
        if failed is not None:
            raise ImagePullError(f"{failed} (it failed less than {PULL_RETRY_AFTER_S:g}s ago)")
        transfer = images.transfer(image)
        if transfer is None:
            transfer = images.begin(image, "pull")
            self._tg.start_soon(self._pull, slot, transfer, name=f"pull {transfer.image} on {name}")
        limit = self._config.image_pull_timeout_s + 10.0  # the pull's own bound ends it first
        slot.waiting += 1
        self._notify()
        start = anyio.current_time()
        try:
            with anyio.fail_after(limit):
                await transfer.done.wait()
        except TimeoutError:
            raise ImagePullError(f"node {name!r}: waited {limit:g}s for the {transfer.kind} of {transfer.image}") \
                from None
        finally:
            slot.waiting -= 1
            self._notify()
        if transfer.error is not None:
            raise ImagePullError(str(transfer.error))
        return anyio.current_time() - start if transfer.pulled else 0.0

    async def _pull(self, slot: _NodeSlot, transfer: Transfer) -> None:
        """The one pull of ``transfer.image`` on the node: nothing when the node has it after all (it was not
        listed), else a pull bounded by ``env_pool.image_pull_timeout_s``; then the disk budget's pass."""
        assert slot.store is not None and slot.images is not None
        name, timeout = slot.config.name, self._config.image_pull_timeout_s
        present = False
        start = anyio.current_time()
        try:
            with anyio.fail_after(timeout):
                if await slot.store.exists(transfer.requested):
                    present = True
                else:
                    _log.info("node %s: pulling %s (a lease needs it there)", name, transfer.requested)
                    await slot.store.pull(transfer.requested)
                    transfer.pulled = present = True
        except TimeoutError:
            transfer.error = ImagePullError(f"node {name!r}: the pull of {transfer.image} took more than {timeout:g}s")
        except InfraError as exc:
            transfer.error = exc
        finally:
            if not present and transfer.error is None:
                transfer.error = ImagePullError(f"node {name!r}: the pull of {transfer.image} was interrupted")
            slot.images.end(transfer, anyio.current_time(), present=present)
            self._notify()
        if transfer.error is not None:
            self._counts["image_pull_failures"] += 1
            _log.warning("node %s: %s", name, transfer.error)
        elif transfer.pulled:
            self._counts["image_pulls"] += 1
            _log.info("node %s: pulled %s in %.1fs", name, transfer.image, anyio.current_time() - start)
            await self._enforce_budget(slot)

    async def _list_images(self, slot: _NodeSlot) -> None:
        """Learn the node's images (at join and rejoin); on failure each image is looked for before its first
        sandbox there."""
        if slot.store is None or slot.images is None:
            return
        try:
            with anyio.fail_after(self._config.health_timeout_s):
                names = await slot.store.names()
        except (InfraError, TimeoutError) as exc:
            slot.images.known = False
            _log.warning("node %s: could not list its images (each is looked for before its first sandbox "
                         "there): %s", slot.config.name, exc or "timed out")
            return
        slot.images.reset(names)
        if slot.config.image_disk_gb:
            assert self._tg is not None
            self._tg.start_soon(self._enforce_budget, slot, name=f"image disk budget of {slot.config.name}")

    def _protected(self, slot: _NodeSlot) -> set[str]:
        """Images that must stay on the node: its live sandboxes', the pending leases', sandbox.image."""
        return {lease.image for lease in slot.leases} | set(self._wanted) | {self._pool_image}

    async def _enforce_budget(self, slot: _NodeSlot) -> None:
        """One pass (at a time per node) removing images over ``nodes.N.image_disk_gb``; bounded, never raises."""
        if not slot.config.image_disk_gb or slot.store is None or slot.images is None:
            return
        name = slot.config.name
        async with slot.evicting:
            with anyio.move_on_after(EVICT_TIMEOUT_S) as scope:
                try:
                    await self._evict(slot, slot.store, slot.images)
                except InfraError as exc:
                    _log.warning("node %s: keeping its images within their disk budget failed: %s", name, exc)
            if scope.cancelled_caught:
                _log.warning("node %s: removing images over the disk budget took more than %gs; the next pull tries "
                             "again", name, EVICT_TIMEOUT_S)

    async def _evict(self, slot: _NodeSlot, store: ImageStore, images: NodeImages) -> None:
        budget_gb = slot.config.image_disk_gb
        used = images.disk_bytes = await store.disk_bytes()
        kept: set[str] = set()  # images a container outside the pool's knowledge still uses
        while used > budget_gb * 1e9:
            order = images.eviction_order(self._protected(slot) | kept)
            if not order:
                if not images.over_budget_said:
                    images.over_budget_said = True
                    _log.warning("node %s: its images take %.3f GB, over its budget of %g GB, and every image left is "
                                 "in use (nodes.N.image_disk_gb)", slot.config.name, used / 1e9, budget_gb)
                return
            victim = order[0]
            transfer = images.begin(victim, "remove")
            why = "the removal did not finish"
            try:
                why = await store.remove(victim)
            finally:
                images.end(transfer, anyio.current_time(), present=bool(why))
                self._notify()
            if why:
                kept.add(victim)
                _log.info("node %s: image %s stays: %s", slot.config.name, victim, why)
                continue
            self._counts["images_evicted"] += 1
            _log.info("node %s: removed image %s, the least recently leased (its images took %.3f GB, budget %g GB)",
                      slot.config.name, victim, used / 1e9, budget_gb)
            if isinstance(slot.backend, ForgetsImages):
                slot.backend.forget_image(victim)
            used = images.disk_bytes = await store.disk_bytes()
        images.over_budget_said = False

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
            if initial:
                await self._list_images(slot)  # placement knows the images from the first lease on
            slot.healthy = True
            slot.last_problem = ""
            if not initial:
                _log.info("node %s rejoined the pool", slot.config.name)
                assert self._tg is not None  # listed meanwhile: a rejoin is not held up by it
                self._tg.start_soon(self._list_images, slot, name=f"images of {slot.config.name}")
            self._notify()

    async def _fail_node(self, slot: _NodeSlot, reason: str) -> None:
        if not slot.healthy:
            return
        slot.healthy = False
        if slot.images is not None:
            slot.images.known = False  # listed again when it rejoins
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
    mounts: Sequence[Mount] = (),
) -> AsyncIterator[EnvPool]:
    """An EnvPool started on every sandbox node; on exit (or Ctrl-C) every container of the run is removed and
    the backends (``make_backends(config)`` unless given) are closed. A failure inside the block is re-raised
    as itself (not inside the task group's ExceptionGroup) once the pool has stopped.

    Commands leave the bounds unset: the start is bounded by the pool's health timeout, and closing gives up
    quietly after CLOSE_TIMEOUT_S. Tests set them: TimeoutError when the pool has not started within
    ``start_timeout_s`` or the backends have not closed within ``close_timeout_s``.
    """
    backends = make_backends(config) if backends is None else backends
    pool = EnvPool(config.env_pool, config.sandbox, backends, run_id=run_id or config.run_id or new_run_id(),
                   mounts=mounts)
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
