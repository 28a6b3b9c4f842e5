"""The fleet behind `swectl serve`: the pool-server API's operations over EnvPool leases and the Grader.

Consumes: decoded requests from ``swectl.serve.app``. Produces: response objects (``{"ok": true, ...}``) or
``ApiError``s. Owns: the table of served leases (lease id -> EnvPool lease, its image and task) and the ids of
leases that ended (closed, expired, lost), kept so a late call on one gets the reason instead of "unknown".

Leases outlive careless clients: the EnvPool expires a lease nobody used or heartbeated for
``env_pool.lease_ttl_s`` and destroys its sandbox; ``run`` sweeps such leases out of the table every second.
A lease's commands run one at a time (a lock per lease), each killed inside the sandbox at its timeout. A
sandbox that dies ends its lease with a 503 that says so (``infra: true``: the client's sample is aborted,
never scored), as does any failure of the infrastructure while grading.
"""

from __future__ import annotations

import logging
import shlex
import uuid
from collections import Counter, OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
import msgspec

from swectl.actors.env_pool import EnvPool, Lease
from swectl.actors.grader import Grader, GradeResult, prepare_task
from swectl.errors import (
    InfraError,
    LeaseError,
    LeaseExpiredError,
    NodeError,
    PoolClosedError,
    SandboxLostError,
    SwectlError,
)
from swectl.images.names import ImageResolver
from swectl.serve.wire import AllocateRequest, ApiError, DiffRequest, EvaluateRequest, ExecRequest, LeaseRequest
from swectl.tasks.record import Task

_log = logging.getLogger(__name__)
OUTPUT_TAIL = 2000  # characters of the eval log in /evaluate's output (what the swe-rl client expects)
ENDED_KEPT = 10_000  # ended lease ids remembered for their reason
SWEEP_INTERVAL_S = 1.0


@dataclass(eq=False)
class ServedLease:
    """One client's lease: the EnvPool lease, what it was allocated for, and the lock that orders its commands."""
    id: str
    lease: Lease
    image: str
    instance_id: str
    task: Task | None
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    evaluations: int = 0


class Fleet:
    """The served leases. Start with ``await tg.start(fleet.run)`` (the sweep of expired and lost leases)."""

    def __init__(
        self, pool: EnvPool, grader: Grader, tasks: dict[str, Task], resolver: ImageResolver, *,
        url: str, allocate_timeout_s: float = 600.0,
    ) -> None:
        self._pool = pool
        self._grader = grader
        self._tasks = tasks
        self._resolver = resolver
        self.url = url
        self._allocate_timeout_s = allocate_timeout_s
        self._leases: dict[str, ServedLease] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._counts: Counter[str] = Counter()
        self._tg: anyio.abc.TaskGroup | None = None

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            while True:
                await anyio.sleep(SWEEP_INTERVAL_S)
                for served in [s for s in self._leases.values() if s.lease.failure is not None]:
                    self._end(served, served.lease.failure)

    # ------------------------------------------------------------------ the API

    def status(self, **extra: object) -> dict[str, object]:
        """``/status``: the pool's statistics, the served leases' counters, the grader's, and ``extra``."""
        pool = msgspec.to_builtins(self._pool.statistics())
        return {"ok": True, "pool": {**pool, "served_leases": len(self._leases), **dict(sorted(self._counts.items())),
                                     "grader": msgspec.to_builtins(self._grader.statistics()), **extra}}

    async def allocate(self, req: AllocateRequest) -> dict[str, object]:
        task = self._tasks.get(req.instance_id) if req.instance_id else None
        image = self._image_for(req, task)
        try:
            with anyio.fail_after(self._allocate_timeout_s):
                lease = await self._pool.acquire(image)
        except TimeoutError:
            raise ApiError(503, f"no sandbox slot came free within {self._allocate_timeout_s:g} s "
                           f"({self._pool.statistics().leased} leased); close leases or raise the nodes' "
                           "max_running", infra=True) from None
        except PoolClosedError as exc:
            raise ApiError(503, f"the service is shutting down: {exc}", infra=True) from exc
        except InfraError as exc:
            raise ApiError(503, f"could not start a sandbox of {image}: {exc}", infra=True) from exc
        served = ServedLease(id=f"lease-{uuid.uuid4().hex}", lease=lease, image=image,
                             instance_id=req.instance_id, task=task)
        try:
            if task is not None and not await prepare_task(lease, task):
                raise ApiError(500, f"task {task.instance_id}: its setup patch does not apply to {image} (broken "
                               "task data or image)", infra=True)
        except InfraError as exc:
            await self._pool.release(lease)
            raise ApiError(503, f"the new sandbox failed while the task was set up: {exc}", infra=True) from exc
        except BaseException:
            await self._pool.release(lease)
            raise
        self._leases[served.id] = served
        self._counts["allocated"] += 1
        return {"ok": True, "lease_id": served.id, "container_id": lease.sandbox.id, "node_url": self.url,
                "node": lease.node, "image": image, "task_known": task is not None}

    async def heartbeat(self, req: LeaseRequest) -> dict[str, object]:
        served = self._get(req.lease_id)
        served.lease.heartbeat()
        return {"ok": True}

    async def exec(self, req: ExecRequest) -> dict[str, object]:
        served = self._get(req.lease_id)
        async with served.lock:  # one command at a time per lease, in arrival order
            with self._failures_of(served):
                # A cwd that does not exist fails the command (as `docker exec -w` does), not the sandbox.
                command = f"cd -- {shlex.quote(req.cwd)} || exit 1\n{req.command}"
                result = await served.lease.exec(command, req.timeout, cwd="/", env=req.env or None)
        self._counts["execs"] += 1
        if result.timed_out:
            self._counts["exec_timeouts"] += 1
            return {"ok": True, "returncode": -1, "output": f"Command timed out after {req.timeout:g}s"}
        return {"ok": True, "returncode": result.exit_code, "output": result.output}

    async def diff(self, req: DiffRequest) -> dict[str, object]:
        served = self._get(req.lease_id)
        async with served.lock:
            with self._failures_of(served):
                patch = await served.lease.diff(req.cwd)
        return {"ok": True, "patch": patch.decode("utf-8", errors="replace"), "returncode": 0}

    async def evaluate(self, req: EvaluateRequest) -> dict[str, object]:
        served = self._get(req.lease_id)
        if served.task is None and not req.eval_script.strip():
            raise ApiError(400, f"eval_script is required: the lease's instance {served.instance_id or '(none)'} "
                           "is not a task of the served set (see --tasks), so its exit code is the verdict")
        served.evaluations += 1
        suffix = f"{served.id[-8:]}.{served.evaluations}"  # eval logs: <instance>.<lease>.<n>.log
        with self._failures_of(served):
            async with served.lease.in_use():  # the lease must not expire while its patch is graded elsewhere
                if served.task is not None:
                    result = await self._grader.grade(served.task, req.patch, timeout_s=req.timeout, label=suffix)
                else:
                    label = _safe_name(f"{served.instance_id or 'script'}.{suffix}")
                    result = await self._grader.grade_by_exit_code(served.image, req.patch, req.eval_script,
                                                                   cwd=req.cwd, timeout_s=req.timeout, label=label)
        self._counts["evaluations"] += 1
        if result.infra:
            self._counts["evaluation_infra_errors"] += 1
            raise ApiError(503, f"grading failed in the infrastructure ({result.reason}): {result.detail}",
                           infra=True)
        self._counts["resolved"] += result.resolved
        return {"ok": True, "resolved": result.resolved,
                "returncode": -1 if result.test_exit_code is None else result.test_exit_code,
                "output": _output_of(result), "status": result.status, "reason": result.reason,
                "graded_by": "tests" if served.task is not None else "exit_code",
                "f2p_failed": result.f2p_failed, "p2p_failed": result.p2p_failed,
                "duration_s": result.duration_s}

    async def close(self, req: LeaseRequest) -> dict[str, object]:
        served = self._leases.get(req.lease_id)
        if served is None:
            self._get(req.lease_id)  # unknown: 404; ended (closed, expired, lost): the reason, 410
        assert served is not None
        self._leases.pop(served.id, None)
        self._remember(served.id, "it was closed")
        self._counts["closed"] += 1
        await self._pool.release(served.lease)
        return {"ok": True}

    # ------------------------------------------------------------------ helpers

    def _image_for(self, req: AllocateRequest, task: Task | None) -> str:
        mapped = self._resolver.mapping.get(req.instance_id) if req.instance_id else None
        if mapped:
            return mapped
        if task is not None:
            try:
                return self._resolver.resolve(task)
            except SwectlError as exc:
                raise ApiError(400, f"instance {req.instance_id}: no image: {exc}") from exc
        if req.image.strip():
            return req.image.strip()
        if req.instance_id:
            raise ApiError(400, f"instance_id {req.instance_id!r} is not a task of the served set (see --tasks) and "
                           "no image was given: send the image to allocate")
        raise ApiError(400, "allocate needs an image, or an instance_id of the served task set")

    def _get(self, lease_id: str) -> ServedLease:
        served = self._leases.get(lease_id)
        if served is not None:
            if served.lease.failure is None:
                return served
            self._end(served, served.lease.failure)
        reason = self._ended.get(lease_id)
        if reason is not None:
            raise ApiError(410, f"lease {lease_id} has ended: {reason}")
        raise ApiError(404, f"unknown lease {lease_id!r}")

    @contextmanager
    def _failures_of(self, served: ServedLease) -> Iterator[None]:
        """A lost sandbox or node ends the lease (its slot goes back to the pool) with a 410 (expired) or a 503
        that says what broke; an error the sandbox answered with is a 502 and the lease stays."""
        try:
            yield
        except LeaseExpiredError as exc:
            self._end(served, exc)
            raise ApiError(410, f"lease {served.id} has ended: {_ended_reason(exc)}") from exc
        except (SandboxLostError, NodeError, LeaseError) as exc:
            self._end(served, exc)
            raise ApiError(503, f"lease {served.id} has ended: {_ended_reason(exc)}", infra=True) from exc
        except InfraError as exc:  # the sandbox answered with an error: the lease stays
            raise ApiError(502, f"lease {served.id}: the sandbox could not do it: {exc}", infra=True) from exc
        except PoolClosedError as exc:
            raise ApiError(503, f"the service is shutting down: {exc}", infra=True) from exc

    def _end(self, served: ServedLease, failure: BaseException) -> None:
        """The lease failed (expired, its sandbox or node lost): out of the table, its sandbox released."""
        if self._leases.pop(served.id, None) is None:
            return
        reason = _ended_reason(failure)
        self._remember(served.id, reason)
        self._counts["expired" if isinstance(failure, LeaseExpiredError) else "lost"] += 1
        _log.info("lease %s (%s) ended: %s", served.id, served.instance_id or served.image, reason)
        if self._tg is not None:
            self._tg.start_soon(self._pool.release, served.lease, name=f"release {served.id}")

    def _remember(self, lease_id: str, reason: str) -> None:
        self._ended[lease_id] = reason
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)


def _ended_reason(failure: BaseException) -> str:
    if isinstance(failure, LeaseExpiredError):
        return f"it expired (no call and no heartbeat within the lease TTL): {failure}"
    return f"its sandbox failed: {failure}"


def _output_of(result: GradeResult) -> str:
    if result.log_path:
        try:
            return Path(result.log_path).read_text(errors="replace")[-OUTPUT_TAIL:]
        except OSError:
            pass
    return result.detail[-OUTPUT_TAIL:]


def _safe_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)
