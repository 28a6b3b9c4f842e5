"""The fleet behind `swectl serve`: the pool-server API's operations over EnvPool leases and the Grader.

Consumes: decoded requests from ``swectl.serve.app``. Produces: response objects (``{"ok": true, ...}``) or
``ApiError``s. Owns: the table of served leases (lease id -> EnvPool lease, its image and task) and the ids of
leases that ended (closed, expired, lost), kept so a late call on one gets the reason instead of "unknown".

Leases outlive careless clients: the EnvPool expires a lease nobody used or heartbeated for
``env_pool.lease_ttl_s`` and destroys its sandbox; ``run`` sweeps such leases out of the table every second.
A lease's commands run one at a time (a lock per lease), each killed inside the sandbox at its timeout, with a
login shell's environment (``bash -lc``, as the original exec server runs them; ``login_shell``), its whole output
returned up to ``max_output_bytes`` (cut in the middle past that, and said so in ``truncated`` and in the text).

Instances: an ``instance_id`` that names a task of the served set, directly or as ``<task id>__<suffix>`` (the
swe-rl client allocates its grading sandbox as ``<id>__eval``), gets the task's own image with its setup patch,
and its ``/evaluate`` is graded by the task's tests whatever ``eval_script`` the client sent. Only an instance no
task set knows is graded by its eval script's exit code (``graded_by: "exit_code"``, with a warning in the log).

Ended leases (closed, expired, lost): ``/close`` and a ``/heartbeat`` after the client's own close answer 200
with ``ok: true`` and the ``state``, so a retrying client is not punished; any other call, and a heartbeat of a
lease that expired or whose sandbox was lost, answers 200 with ``ok: false``, ``infra: true`` and the reason
(the swe-rl client then aborts the sample at once instead of retrying for 9 s; see ``ApiError``). A failure of
the infrastructure while grading is a 503 (``infra: true``): the client retries it in a fresh sandbox.
"""

from __future__ import annotations

import logging
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
from swectl.serve.login_shell import CAPTURE, LOGIN_ENV, CaptureError, command_script, login_script
from swectl.serve.wire import (
    CUT_MARK,
    DEFAULT_MAX_OUTPUT_BYTES,
    AllocateRequest,
    ApiError,
    DiffRequest,
    EvaluateRequest,
    ExecRequest,
    LeaseRequest,
)
from swectl.tasks.harbor import sandbox_limits
from swectl.tasks.record import Task

_log = logging.getLogger(__name__)
OUTPUT_TAIL = 2000  # characters of the eval log in /evaluate's output (what the swe-rl client expects)
ENDED_KEPT = 10_000  # ended lease ids remembered for their reason
SWEEP_INTERVAL_S = 1.0
CAPTURE_TIMEOUT_S = 60.0
CAPTURE_OUTPUT_BYTES = 4 * 1024 * 1024


SUFFIX_SEPARATOR = "__"  # <task id>__<suffix>: the task's own instance (swe-rl's grading lease is <id>__eval)


def task_of(instance_id: str, tasks: dict[str, Task]) -> tuple[Task | None, str]:
    """The task ``instance_id`` names and the suffix it carries: the id itself, else the longest known prefix
    before a ``__`` (task ids contain ``__`` themselves: ``django__django-11099__eval``); (None, "") if none."""
    if not instance_id:
        return None, ""
    if instance_id in tasks:
        return tasks[instance_id], ""
    end = instance_id.rfind(SUFFIX_SEPARATOR)
    while end > 0:
        task = tasks.get(instance_id[:end])
        if task is not None:
            return task, instance_id[end + len(SUFFIX_SEPARATOR):]
        end = instance_id.rfind(SUFFIX_SEPARATOR, 0, end)
    return None, ""


@dataclass(eq=False)
class ServedLease:
    """One client's lease: the EnvPool lease, what it was allocated for, and the lock that orders its commands."""
    id: str
    lease: Lease
    image: str
    instance_id: str
    task: Task | None
    suffix: str = ""  # what followed the task's id in instance_id ("eval" for swe-rl's grading lease)
    login_captured: bool = False  # the login environment was captured into the sandbox (or that failed)
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    evaluations: int = 0


@dataclass(frozen=True)
class Ended:
    """A lease that is gone: how (closed by its client, expired, lost with its sandbox or node) and why."""
    state: str
    reason: str


class Fleet:
    """The served leases. Start with ``await tg.start(fleet.run)`` (the sweep of expired and lost leases)."""

    def __init__(
        self, pool: EnvPool, grader: Grader, tasks: dict[str, Task], resolver: ImageResolver, *,
        url: str, allocate_timeout_s: float = 600.0, max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    ) -> None:
        self._pool = pool
        self._grader = grader
        self._tasks = tasks
        self._resolver = resolver
        self.url = url
        self._allocate_timeout_s = allocate_timeout_s
        self._max_output_bytes = max_output_bytes
        self._leases: dict[str, ServedLease] = {}
        self._ended: OrderedDict[str, Ended] = OrderedDict()
        self._warned: set[str] = set()  # what was logged once (an image the client asked for; an unknown instance)
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
        task, suffix = task_of(req.instance_id, self._tasks)
        image = self._image_for(req, task)
        try:
            with anyio.fail_after(self._allocate_timeout_s):
                lease = await self._pool.acquire(image, **(sandbox_limits(task) if task is not None else {}))
        except TimeoutError:
            raise ApiError(503, f"no sandbox slot came free within {self._allocate_timeout_s:g} s "
                           f"({self._pool.statistics().leased} leased); close leases or raise the nodes' "
                           "max_running", infra=True) from None
        except PoolClosedError as exc:
            raise ApiError(503, f"the service is shutting down: {exc}", infra=True) from exc
        except InfraError as exc:
            raise ApiError(503, f"could not start a sandbox of {image}: {exc}", infra=True) from exc
        served = ServedLease(id=f"lease-{uuid.uuid4().hex}", lease=lease, image=image,
                             instance_id=req.instance_id, task=task, suffix=suffix)
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
        if self._tg is not None:  # while the client's model thinks; its first /exec waits for it (the lease lock)
            self._tg.start_soon(self._capture_early, served, name=f"login env {served.id}")
        return {"ok": True, "lease_id": served.id, "container_id": lease.sandbox.id, "node_url": self.url,
                "node": lease.node, "image": image, "task_known": task is not None,
                "task": task.instance_id if task is not None else "", "suffix": suffix}

    async def heartbeat(self, req: LeaseRequest) -> dict[str, object]:
        served = self._leases.get(req.lease_id)
        if served is not None and served.lease.failure is None:
            served.lease.heartbeat()
            return {"ok": True, "state": "live"}
        ended = self._ended_of(req.lease_id)
        if ended.state == "closed":  # the client's own close (a late or retried heartbeat): nothing is lost
            return {"ok": True, "state": ended.state, "reason": ended.reason}
        raise _gone(req.lease_id, ended)  # expired or lost: the client's episode cannot go on (abort, not score)

    async def exec(self, req: ExecRequest) -> dict[str, object]:
        served = self._get(req.lease_id)
        limit = req.max_output_bytes or self._max_output_bytes
        async with served.lock:  # one command at a time per lease, in arrival order
            with self._failures_of(served):
                # A login shell's environment, as the original exec server runs commands (`docker exec -w CWD ...
                # bash -lc`): PATH and environments set up by profile scripts hold (see login_shell).
                if not served.login_captured:
                    await self._capture_login_env(served)
                result = await served.lease.exec(command_script(req.command, req.cwd), req.timeout, cwd="/",
                                                 env=req.env or None, output_limit=limit)
        self._counts["execs"] += 1
        if result.timed_out:
            self._counts["exec_timeouts"] += 1
            return {"ok": True, "returncode": -1, "output": f"Command timed out after {req.timeout:g}s"}
        if not result.elided_bytes:
            return {"ok": True, "returncode": result.exit_code, "output": result.output, "truncated": False}
        self._counts["exec_outputs_cut"] += 1
        total = limit + result.elided_bytes
        _log.warning("lease %s: a command's output of %d bytes was cut to %d (max_output_bytes)", served.id, total,
                     limit)
        notice = (f"{CUT_MARK} {result.elided_bytes} of the {total} bytes of this output were cut from its middle "
                  f"(limit: {limit} bytes per command; max_output_bytes in the request, or swectl serve "
                  "--max-output-mb). A patch read from it is incomplete.\n")
        return {"ok": True, "returncode": result.exit_code, "output": notice + result.output, "truncated": True,
                "output_bytes": total, "elided_bytes": result.elided_bytes}

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
        if CUT_MARK in req.patch:
            self._counts["evaluations_of_cut_output"] += 1
            raise ApiError(200, "the patch was read from a command output that swectl serve cut (it holds "
                           f"{CUT_MARK!r}): it is incomplete and is not graded; raise max_output_bytes "
                           "(swectl serve --max-output-mb)", infra=True)
        if served.task is not None and not req.patch.strip():
            self._counts["evaluations"] += 1
            return {"ok": True, "resolved": False, "returncode": -1, "status": "error",
                    "reason": "patch_apply_failed", "output": "the patch is empty: nothing to apply",
                    "graded_by": "none", **self._instance_fields(served)}
        served.evaluations += 1
        suffix = f"{served.id[-8:]}.{served.evaluations}"  # eval logs: <instance>.<lease>.<n>.log
        with self._failures_of(served):
            async with served.lease.in_use():  # the lease must not expire while its patch is graded elsewhere
                if served.task is not None:
                    result = await self._grader.grade(served.task, req.patch, timeout_s=req.timeout, label=suffix)
                else:
                    _log.warning("lease %s: instance %r is not a task of the served set: graded by its eval "
                                 "script's EXIT CODE (graded_by: exit_code), not by the tests' F2P/P2P rules",
                                 served.id, served.instance_id or served.image)
                    label = _safe_name(f"{served.instance_id or 'script'}.{suffix}")
                    result = await self._grader.grade_by_exit_code(served.image, req.patch, req.eval_script,
                                                                   cwd=req.cwd, timeout_s=req.timeout, label=label)
        self._counts["evaluations"] += 1
        if result.infra:
            self._counts["evaluation_infra_errors"] += 1
            raise ApiError(503, f"grading failed in the infrastructure ({result.reason}): {result.detail}",
                           infra=True)
        self._counts["resolved"] += result.resolved
        self._counts["tampered"] += result.tampered
        return {"ok": True, "resolved": result.resolved, "tampered": result.tampered,
                "returncode": -1 if result.test_exit_code is None else result.test_exit_code,
                "output": _output_of(result), "status": result.status, "reason": result.reason,
                "graded_by": "tests" if served.task is not None else "exit_code",
                "f2p_failed": result.f2p_failed, "p2p_failed": result.p2p_failed,
                "duration_s": result.duration_s, **self._instance_fields(served)}

    async def close(self, req: LeaseRequest) -> dict[str, object]:
        """Idempotent, as the original server's: a lease already ended (or never known) answers ``ok: true``
        with its ``state``, so a client that retries a close (or closes in a ``finally``) is never punished."""
        served = self._leases.pop(req.lease_id, None)
        if served is None:
            ended = self._ended.get(req.lease_id)
            if ended is None:
                return {"ok": True, "state": "unknown", "reason": f"no lease {req.lease_id!r} is known"}
            return {"ok": True, "state": ended.state, "reason": ended.reason}
        self._remember(served.id, Ended("closed", "it was closed by its client"))
        self._counts["closed"] += 1
        await self._pool.release(served.lease)
        return {"ok": True, "state": "closed"}

    # ------------------------------------------------------------------ helpers

    async def _capture_early(self, served: ServedLease) -> None:
        async with served.lock:
            if served.login_captured or served.id not in self._leases:
                return
            try:
                await self._capture_login_env(served)
            except SwectlError as exc:  # the lease's sandbox failed: its next call says so
                _log.info("lease %s: capturing the login environment failed: %s", served.id, exc)

    async def _capture_login_env(self, served: ServedLease) -> None:
        """Once per lease: the login shell's environment into the sandbox (LOGIN_ENV). On failure the lease's
        commands run as real login shells (slower, same answers)."""
        served.login_captured = True
        result = await served.lease.exec(CAPTURE, CAPTURE_TIMEOUT_S, cwd="/", output_limit=CAPTURE_OUTPUT_BYTES)
        try:
            if result.exit_code != 0 or result.timed_out or result.elided_bytes:
                raise CaptureError(f"exit {result.exit_code}: {result.output[-300:]!r}")
            await served.lease.write_file(LOGIN_ENV, login_script(result.output).encode())
        except CaptureError as exc:
            if self._once(f"capture:{served.image}"):
                _log.warning("image %s: could not capture the login environment (%s); its commands read the profile "
                             "files each time", served.image, exc)

    def _instance_fields(self, served: ServedLease) -> dict[str, object]:
        return {"instance_id": served.instance_id, "task": served.task.instance_id if served.task else "",
                "suffix": served.suffix}

    def _image_for(self, req: AllocateRequest, task: Task | None) -> str:
        mapping = self._resolver.mapping
        mapped = mapping.get(req.instance_id) if req.instance_id else None
        if task is not None:
            mapped = mapped or mapping.get(task.instance_id)
            if not mapped:
                try:
                    mapped = self._resolver.resolve(task)
                except SwectlError as exc:
                    raise ApiError(400, f"instance {req.instance_id}: no image: {exc}") from exc
            asked = req.image.strip()
            if asked and asked != mapped and self._once(f"image:{task.instance_id}"):
                _log.warning("task %s: the client asked for image %s; serving the task's own image %s (the task's "
                             "image wins; said once per task)", task.instance_id, asked, mapped)
            return mapped
        if mapped:
            return mapped
        if req.image.strip():
            if req.instance_id and self._once(f"unknown:{req.instance_id}"):
                _log.warning("instance %r is not a task of the served set (--tasks): its /evaluate will be graded "
                             "by the client's eval script's exit code, not by the tests", req.instance_id)
            return req.image.strip()
        if req.instance_id:
            raise ApiError(400, f"instance_id {req.instance_id!r} is not a task of the served set (see --tasks) and "
                           "no image was given: send the image to allocate")
        raise ApiError(400, "allocate needs an image, or an instance_id of the served task set")

    def _once(self, what: str) -> bool:
        if what in self._warned:
            return False
        self._warned.add(what)
        return True

    def _get(self, lease_id: str) -> ServedLease:
        """The live lease, else a 200 ``ok: false`` answer saying how it ended (no retry can bring it back)."""
        served = self._leases.get(lease_id)
        if served is not None and served.lease.failure is None:
            return served
        raise _gone(lease_id, self._ended_of(lease_id))

    def _ended_of(self, lease_id: str) -> Ended:
        """How a lease that is not live ended; 404 for an id never handed out (or forgotten long ago)."""
        served = self._leases.get(lease_id)
        if served is not None and served.lease.failure is not None:
            self._end(served, served.lease.failure)
        ended = self._ended.get(lease_id)
        if ended is None:
            raise ApiError(404, f"unknown lease {lease_id!r}")
        return ended

    @contextmanager
    def _failures_of(self, served: ServedLease) -> Iterator[None]:
        """A lost sandbox or node ends the lease (its slot goes back to the pool) with a 410 (expired) or a 503
        that says what broke; an error the sandbox answered with is a 502 and the lease stays."""
        try:
            yield
        except (LeaseExpiredError, SandboxLostError, NodeError, LeaseError) as exc:
            self._end(served, exc)
            raise _gone(served.id, _ended_of(exc)) from exc
        except InfraError as exc:  # the sandbox answered with an error: the lease stays
            raise ApiError(502, f"lease {served.id}: the sandbox could not do it: {exc}", infra=True) from exc
        except PoolClosedError as exc:
            raise ApiError(503, f"the service is shutting down: {exc}", infra=True) from exc

    def _end(self, served: ServedLease, failure: BaseException) -> None:
        """The lease failed (expired, its sandbox or node lost): out of the table, its sandbox released."""
        if self._leases.pop(served.id, None) is None:
            return
        ended = _ended_of(failure)
        self._remember(served.id, ended)
        self._counts[ended.state] += 1
        _log.info("lease %s (%s) ended: %s", served.id, served.instance_id or served.image, ended.reason)
        if self._tg is not None:
            self._tg.start_soon(self._pool.release, served.lease, name=f"release {served.id}")

    def _remember(self, lease_id: str, ended: Ended) -> None:
        self._ended[lease_id] = ended
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)


def _ended_of(failure: BaseException) -> Ended:
    if isinstance(failure, LeaseExpiredError):
        return Ended("expired", f"it expired (no call and no heartbeat within the lease TTL): {failure}")
    return Ended("lost", f"its sandbox failed: {failure}")


def _gone(lease_id: str, ended: Ended) -> ApiError:
    """The answer to a call on a lease that has ended: 200, ``ok: false``, ``infra: true`` (the sample cannot go on
    and must not be scored), the ``state`` and the reason."""
    return ApiError(200, f"lease {lease_id} has ended: {ended.reason}", infra=True, state=ended.state)


def _output_of(result: GradeResult) -> str:
    """The eval log's tail (or the grader's detail). A tampered grade's answer is its reason alone, never the log:
    a client that grades the output again (OpenClaw-RL's trajectory mode runs swebench's get_eval_report on it)
    must not find the forged lines there (docs/grading.md)."""
    if result.tampered:
        return f"swectl: graded tampered ({result.reason}): {result.detail}"[:OUTPUT_TAIL]
    if result.log_path:
        try:
            return Path(result.log_path).read_text(errors="replace")[-OUTPUT_TAIL:]
        except OSError:
            pass
    return result.detail[-OUTPUT_TAIL:]


def _safe_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)
