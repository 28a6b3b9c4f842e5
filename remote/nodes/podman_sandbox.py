"""Podman sandboxes on one node (local or over SSH): the first SandboxBackend.

A sandbox is a container idling under catatonit (``--init``, so orphaned processes are reaped and count
against the pids limit only while alive). Commands go through the exec agent (remote/programs/exec_agent.py),
started once per sandbox by one long-lived ``podman exec -i``: one command then costs about the price
of spawning bash instead of a podman process. Images without python3 fall back to one
``podman exec ... timeout -k`` per command. Timeouts always kill inside the sandbox; the controller's
own wait is ``timeout + exec_grace_s`` and, when it expires, the sandbox is declared lost.

Covered: filesystem, pids, memory and CPU limits, no network by default (``--network none``).
Not covered: what the container runtime does not isolate (kernel, devices podman exposes by default).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import anyio

from swectl.config import SandboxConfig
from swectl.errors import InfraError, NodeLostError, SandboxError, SandboxLostError
from swectl.remote.nodes.agent_client import AgentClient, agent_command
from swectl.remote.nodes.node import Node
from swectl.remote.nodes.podman import PodmanCli
from swectl.remote.programs.exec_agent import HeadTail
from swectl.sandbox import DIFF_FILE, diff_command, format_output
from swectl.schema import (
    ErrorReply,
    ExecReply,
    ExecRequest,
    ExecResult,
    PingRequest,
    PongReply,
    ReadReply,
    ReadRequest,
    SandboxInfo,
    SandboxSpec,
    WriteReply,
    WriteRequest,
)

CHUNK = 8 * 1024 * 1024
# podman's own failures (125-127), a container killed under a command (137), a stopped container (255)
PODMAN_FAILURE_CODES = (125, 126, 127, 137, 255)
# The no-python path: `timeout` leads its own process group; once it returns, whatever the command left
# running in that group (background jobs, a fork bomb) is killed too, as the exec agent does.
PLAIN_EXEC_SCRIPT = """exec 2>&1
if [ -x /bin/bash ]; then shell=/bin/bash; else shell=/bin/sh; fi
timeout -k 2 "$1s" "$shell" -c "$2" </dev/null &
pid=$!
wait "$pid" 2>/dev/null; rc=$?
for _ in 1 2 3 4 5; do kill -9 "-$pid" 2>/dev/null || break; done
exit "$rc"
"""
DIFF_TIMEOUT_S = 300.0
REMOVE_CONCURRENCY = 2  # `podman rm` processes at once per node (each removes a batch)


@dataclass(eq=False)
class _RemovalBatch:
    """Container ids waiting to be removed by one `podman rm`; ``done`` is set when it has run."""
    ids: list[str] = field(default_factory=list)
    done: anyio.Event = field(default_factory=anyio.Event)
    error: InfraError | None = None


class PodmanBackend:
    """Creates, lists and removes swectl's containers on one node.

    Sandboxes destroyed together are removed together: ``remove_one`` joins the open batch, and at most
    REMOVE_CONCURRENCY `podman rm` processes run at once, each for every id that joined while it waited. A burst
    of releases (a service closing 256 leases) costs a few podman processes instead of one each, which had
    starved the node's health probe and left killed containers behind when their removals timed out.
    """

    def __init__(self, node: Node, config: SandboxConfig, containers_conf: str = "bundled") -> None:
        self.name = node.name
        self.node = node
        self.podman = PodmanCli(node, containers_conf)
        self.config = config
        self._removing = anyio.CapacityLimiter(REMOVE_CONCURRENCY)
        self._open_removal: _RemovalBatch | None = None

    @property
    def prepared(self) -> bool:
        return self.podman.ready

    @property
    def alive(self) -> bool:
        return self.node.alive

    async def prepare(self) -> None:
        await self.node.connect()
        await self.podman.prepare()

    async def probe(self) -> str:
        await self.node.connect()
        return await self.podman.version()

    async def create(self, spec: SandboxSpec) -> PodmanSandbox:
        name = f"swectl-{secrets.token_hex(6)}"
        try:
            with _translate(self.node, f"creating a sandbox from {spec.image}"):
                cid = await self.podman.create(spec, name)
        except BaseException:
            # Cancelled or failed mid-`podman run`: the container may exist without our knowing its id.
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.config.destroy_timeout_s):
                try:
                    await self.podman.remove([name])
                except InfraError:
                    pass
            raise
        sandbox = PodmanSandbox(self, cid, name, spec)
        try:
            with _translate(self.node, f"starting the exec agent in {name}"):
                await sandbox.start()
        except BaseException:
            await sandbox.destroy()
            raise
        return sandbox

    async def list(self, labels: dict[str, str]) -> list[SandboxInfo]:
        with _translate(self.node, "listing containers"):
            return await self.podman.list_containers(labels)

    async def remove(self, ids: list[str]) -> None:
        with _translate(self.node, "removing containers"):
            await self.podman.remove(ids)

    async def remove_one(self, cid: str) -> None:
        """Remove one container in the next batch (see the class docstring); raises the batch's InfraError."""
        batch = self._open_removal
        leader = batch is None
        if batch is None:
            batch = self._open_removal = _RemovalBatch()
        batch.ids.append(cid)
        if leader:
            try:
                async with self._removing:  # while this waits, more ids join the batch
                    if self._open_removal is batch:
                        self._open_removal = None
                    try:
                        await self.remove(batch.ids)
                    except InfraError as exc:
                        batch.error = exc
            except BaseException:
                if self._open_removal is batch:
                    self._open_removal = None
                if batch.error is None:
                    batch.error = SandboxError(f"removing {len(batch.ids)} container(s) on {self.name} was cancelled")
                raise
            finally:
                batch.done.set()
        else:
            await batch.done.wait()
        if batch.error is not None:
            raise batch.error

    async def aclose(self) -> None:
        await self.node.aclose()


class PodmanSandbox:
    """A podman container as a Sandbox, driven through the exec agent (or `podman exec`)."""

    def __init__(self, backend: PodmanBackend, cid: str, name: str, spec: SandboxSpec) -> None:
        self.id = cid
        self.name = name
        self.node = backend.name
        self.spec = spec
        self._backend = backend
        self._config = backend.config
        self._agent: AgentClient | None = None
        self._destroyed = False

    @property
    def uses_agent(self) -> bool:
        return self._agent is not None

    async def start(self) -> None:
        podman = self._backend.podman
        process = await self._backend.node.spawn(podman.argv("exec", "-i", self.id, *agent_command()))
        client = AgentClient(process, f"sandbox {self.name} on {self.node}")
        try:
            with anyio.fail_after(self._config.start_timeout_s):
                has_python = await client.start()
        except BaseException:
            await client.aclose()
            raise
        if has_python:
            self._agent = client
        else:
            await client.aclose()

    async def exec(
        self, command: str, timeout: float, *, cwd: str | None = None, env: dict[str, str] | None = None
    ) -> ExecResult:
        self._check_alive()
        head, tail = self._config.output_head_bytes, self._config.output_tail_bytes
        with self._guard(timeout, "exec"):
            if self._agent is None:
                return await self._plain_exec(command, timeout, cwd, env)
            request = ExecRequest(
                id=self._agent.new_id(), command=command, timeout=timeout,
                cwd=cwd or self.spec.workdir, env=env, head=head, tail=tail,
            )
            reply = await self._agent.call(request)
        if not isinstance(reply, ExecReply):
            raise self._unexpected(reply)
        return ExecResult(
            output=format_output(reply.output, reply.elided, head),
            exit_code=reply.exit_code,
            timed_out=reply.timed_out,
            elided_bytes=reply.elided,
            duration_s=reply.duration_s,
        )

    async def write_file(self, path: str, data: bytes, *, mode: int | None = None) -> None:
        self._check_alive()
        with self._guard(60 + len(data) / 5e6, "write_file"):
            if self._agent is None:
                await self._plain_write(path, data, mode)
                return
            for offset in range(0, max(len(data), 1), CHUNK):
                request = WriteRequest(
                    id=self._agent.new_id(), path=path, data=data[offset : offset + CHUNK],
                    append=offset > 0, mode=mode,
                )
                reply = await self._agent.call(request)
                if not isinstance(reply, WriteReply):
                    raise self._unexpected(reply)

    async def read_file(self, path: str) -> bytes:
        self._check_alive()
        with self._guard(600, "read_file"):
            if self._agent is None:
                return await self._plain_read(path)
            parts: list[bytes] = []
            offset = 0
            while True:
                request = ReadRequest(id=self._agent.new_id(), path=path, offset=offset, length=CHUNK)
                reply = await self._agent.call(request)
                if not isinstance(reply, ReadReply):
                    raise self._unexpected(reply)
                parts.append(reply.data)
                offset += len(reply.data)
                if offset >= reply.size or not reply.data:
                    return b"".join(parts)

    async def diff(self, repo: str | None = None) -> bytes:
        result = await self.exec(diff_command(repo or self.spec.workdir), DIFF_TIMEOUT_S)
        if result.exit_code != 0 or result.timed_out:
            raise SandboxError(f"sandbox {self.name}: git diff failed ({result.exit_code}): {result.output}")
        return await self.read_file(DIFF_FILE)

    async def ping(self) -> None:
        self._check_alive()
        with self._guard(5, "ping"):
            if self._agent is None:
                result = await self._plain_exec("true", 5, None, None)
                if result.exit_code != 0:
                    await self._raise_if_gone("ping failed")
                    raise SandboxError(f"sandbox {self.name}: ping failed: {result.output[-500:]}")
                return
            reply = await self._agent.call(PingRequest(id=self._agent.new_id()))
        if not isinstance(reply, PongReply):
            raise self._unexpected(reply)

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        with anyio.CancelScope(shield=True), anyio.move_on_after(self._config.destroy_timeout_s):
            if self._agent is not None:
                await self._agent.aclose()
            try:
                await self._backend.remove_one(self.id)
            except InfraError:
                pass  # node gone: the orphan reaper removes it when the node comes back

    async def break_transport(self) -> None:
        """Close the exec agent's pipe: any call blocked on it wakes up (the no-python path holds none)."""
        if self._agent is not None:
            await self._agent.aclose()

    # ------------------------------------------------------------------ internals

    def _check_alive(self) -> None:
        if self._destroyed:
            raise SandboxLostError(f"sandbox {self.name} was destroyed")

    @contextmanager
    def _guard(self, seconds: float, what: str) -> Iterator[None]:
        try:
            with _translate(self._backend.node, f"{what} in sandbox {self.name}"):
                with anyio.fail_after(seconds + self._config.exec_grace_s):
                    yield
        except TimeoutError as exc:
            raise SandboxLostError(
                f"sandbox {self.name} on {self.node}: {what} got no answer within "
                f"{seconds + self._config.exec_grace_s:.0f}s (agent hung or node unreachable)"
            ) from exc

    def _unexpected(self, reply: object) -> SandboxError:
        if isinstance(reply, ErrorReply):
            return SandboxError(f"sandbox {self.name}: exec agent error: {reply.error}")
        return SandboxError(f"sandbox {self.name}: unexpected reply {type(reply).__name__}")

    async def _plain_exec(
        self, command: str, timeout: float, cwd: str | None, env: dict[str, str] | None
    ) -> ExecResult:
        args = ["exec", "-w", cwd or self.spec.workdir]
        for key, value in sorted((env or {}).items()):
            args += ["-e", f"{key}={value}"]
        args += [self.id, "sh", "-c", PLAIN_EXEC_SCRIPT, "sh", f"{timeout}", command]
        head, tail = self._config.output_head_bytes, self._config.output_tail_bytes
        buffer = HeadTail(head, tail)
        started = anyio.current_time()
        process = await self._backend.node.spawn(self._backend.podman.argv(*args))
        try:
            await process.close_input()
            while chunk := await process.receive():
                buffer.feed(chunk)
            code = await process.wait()
        finally:
            await process.aclose()
        elapsed = anyio.current_time() - started
        timed_out = code in (124, 137) and elapsed >= timeout
        if not timed_out and code in PODMAN_FAILURE_CODES:
            await self._raise_if_gone(f"podman exec exited {code}")
        return ExecResult(
            output=format_output(buffer.output(), buffer.elided, head),
            exit_code=137 if timed_out else code,
            timed_out=timed_out,
            elided_bytes=buffer.elided,
            duration_s=elapsed,
        )

    async def _plain_write(self, path: str, data: bytes, mode: int | None) -> None:
        script = 'mkdir -p "$(dirname "$1")" && cat > "$1"' + (f' && chmod {mode:o} "$1"' if mode is not None else "")
        out = await self._backend.podman.run(
            "exec", "-i", self.id, "sh", "-c", script, "sh", path, input=data, check=False
        )
        if out.exit_code != 0:
            await self._raise_if_gone(f"writing {path} failed")
            raise SandboxError(f"sandbox {self.name}: writing {path} failed: {out.stderr.decode(errors='replace')}")

    async def _plain_read(self, path: str) -> bytes:
        out = await self._backend.podman.run("exec", self.id, "cat", path, check=False)
        if out.exit_code != 0:
            await self._raise_if_gone(f"reading {path} failed")
            raise SandboxError(f"sandbox {self.name}: reading {path} failed: {out.stderr.decode(errors='replace')}")
        return out.stdout

    async def _raise_if_gone(self, what: str) -> None:
        """On the plain path podman's exit code cannot tell a dead container from a failing command."""
        out = await self._backend.podman.run(
            "container", "inspect", "--format", "{{.State.Running}}", self.id, check=False
        )
        if out.stdout.strip() != b"true":
            raise SandboxLostError(f"sandbox {self.name}: container is gone ({what})")


@contextmanager
def _translate(node: Node, what: str) -> Iterator[None]:
    """A broken sandbox on a node whose connection dropped is a lost node, not a lost sandbox."""
    try:
        yield
    except SandboxLostError as exc:
        if not node.alive:
            raise NodeLostError(node.name, f"connection lost while {what}") from exc
        raise
