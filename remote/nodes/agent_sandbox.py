"""What every sandbox backend shares once its exec agent runs: exec, files, diff and ping over the agent
protocol, each bounded by ``timeout + exec_grace_s``; destroy through a backend's batched removal.

A backend subclasses ``AgentSandbox`` and supplies ``_remove`` (how to delete the sandbox on its node);
the Podman backend adds its no-python fallback on top.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import anyio
import anyio.abc

from swectl.config import SandboxConfig
from swectl.errors import InfraError, NodeLostError, SandboxError, SandboxLostError
from swectl.remote.nodes.agent_client import AgentClient
from swectl.remote.nodes.node import Node
from swectl.sandbox import DIFF_FILE, diff_command, format_output, head_tail_limits
from swectl.schema import (
    ErrorReply,
    ExecReply,
    ExecRequest,
    ExecResult,
    ForwardReply,
    ForwardRequest,
    PingRequest,
    PongReply,
    ReadReply,
    ReadRequest,
    SandboxSpec,
    WriteReply,
    WriteRequest,
)

CHUNK = 8 * 1024 * 1024
DIFF_TIMEOUT_S = 300.0


class AgentSandbox:
    """A started sandbox driven through its exec agent (``self._agent``)."""

    def __init__(self, node: Node, config: SandboxConfig, sandbox_id: str, name: str, spec: SandboxSpec) -> None:
        self.id = sandbox_id
        self.name = name
        self.node = node.name
        self.spec = spec
        self._node = node
        self._config = config
        self._agent: AgentClient | None = None
        self._destroyed = False

    @property
    def uses_agent(self) -> bool:
        return self._agent is not None

    async def exec(
        self, command: str, timeout: float, *, cwd: str | None = None, env: dict[str, str] | None = None,
        output_limit: int | None = None,
    ) -> ExecResult:
        self._check_alive()
        agent = self._require_agent()
        head, tail = head_tail_limits(self._config, output_limit)
        with self._guard(timeout, "exec"):
            request = ExecRequest(
                id=agent.new_id(), command=command, timeout=timeout,
                cwd=cwd or self.spec.workdir, env=env, head=head, tail=tail,
            )
            reply = await agent.call(request)
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
        agent = self._require_agent()
        with self._guard(60 + len(data) / 5e6, "write_file"):
            for offset in range(0, max(len(data), 1), CHUNK):
                request = WriteRequest(
                    id=agent.new_id(), path=path, data=data[offset : offset + CHUNK],
                    append=offset > 0, mode=mode,
                )
                reply = await agent.call(request)
                if not isinstance(reply, WriteReply):
                    raise self._unexpected(reply)

    async def read_file(self, path: str) -> bytes:
        self._check_alive()
        agent = self._require_agent()
        with self._guard(600, "read_file"):
            parts: list[bytes] = []
            offset = 0
            while True:
                reply = await agent.call(ReadRequest(id=agent.new_id(), path=path, offset=offset, length=CHUNK))
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
        agent = self._require_agent()
        with self._guard(5, "ping"):
            reply = await agent.call(PingRequest(id=agent.new_id()))
        if not isinstance(reply, PongReply):
            raise self._unexpected(reply)

    @asynccontextmanager
    async def forward_port(self, port: int, connect: Callable[[], Awaitable[anyio.abc.ByteStream]]
                           ) -> AsyncIterator[None]:
        """While the block runs, a connection to 127.0.0.1:``port`` inside the sandbox reaches whatever ``connect``
        opens on the controller's side (the episode's way to the model gateway, and its only one): the exec agent
        relays it to a fresh unix socket in the sandbox's /tmp, which the node serves through the sandbox's root
        (``host_root``). On exit the relay in the sandbox is killed and the socket removed."""
        self._check_alive()
        agent = self._require_agent()
        inside = f"/tmp/.swectl-forward-{port}-{secrets.token_hex(6)}.sock"
        outside = f"{await self.host_root()}{inside}"

        async def join(client: anyio.abc.ByteStream) -> None:
            async with client:
                try:
                    upstream = await connect()
                except OSError:
                    return  # the other side is gone: the client sees its request refused
                async with upstream, anyio.create_task_group() as tg:
                    tg.start_soon(_copy, client, upstream)
                    tg.start_soon(_copy, upstream, client)

        async with self._node.serve_unix(outside, join):
            with self._guard(10, "forward"):
                reply = await agent.call(ForwardRequest(id=agent.new_id(), port=port, path=inside))
            if not isinstance(reply, ForwardReply):
                raise self._unexpected(reply)
            try:
                yield
            finally:
                with anyio.CancelScope(shield=True), anyio.move_on_after(10), contextlib.suppress(InfraError):
                    await self.exec(f"kill -9 -{reply.pid} 2>/dev/null; rm -f {inside}", 5)

    async def host_root(self) -> str:
        """The sandbox's root as its node sees it (``/proc/PID/root``)."""
        raise SandboxError(f"sandbox {self.name}: its backend does not say where its root is")

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        with anyio.CancelScope(shield=True), anyio.move_on_after(self._config.destroy_timeout_s):
            if self._agent is not None:
                await self._agent.aclose()
            try:
                await self._remove()
            except InfraError:
                pass  # node gone: the orphan reaper removes it when the node comes back

    async def break_transport(self) -> None:
        """Close the exec agent's channel: any call blocked on it wakes up."""
        if self._agent is not None:
            await self._agent.aclose()

    # ------------------------------------------------------------------ for subclasses

    async def _remove(self) -> None:
        raise NotImplementedError

    def _require_agent(self) -> AgentClient:
        if self._agent is None:
            raise SandboxError(f"sandbox {self.name}: no exec agent")
        return self._agent

    def _check_alive(self) -> None:
        if self._destroyed:
            raise SandboxLostError(f"sandbox {self.name} was destroyed")

    @contextmanager
    def _guard(self, seconds: float, what: str) -> Iterator[None]:
        try:
            with translate_lost(self._node, f"{what} in sandbox {self.name}"):
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


async def _copy(source: anyio.abc.ByteStream, sink: anyio.abc.ByteStream) -> None:
    """Bytes from ``source`` to ``sink`` until ``source`` ends; then ``sink`` ends too."""
    try:
        async for chunk in source:
            await sink.send(chunk)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        await sink.send_eof()


@contextmanager
def translate_lost(node: Node, what: str) -> Iterator[None]:
    """A broken sandbox on a node whose connection dropped is a lost node, not a lost sandbox."""
    try:
        yield
    except SandboxLostError as exc:
        if not node.alive:
            raise NodeLostError(node.name, f"connection lost while {what}") from exc
        raise


@dataclass(eq=False)
class _Batch:
    """Ids waiting to be removed by one call; ``done`` is set when it has run."""
    ids: list[str] = field(default_factory=list)
    done: anyio.Event = field(default_factory=anyio.Event)
    error: InfraError | None = None


class RemovalBatcher:
    """Sandboxes destroyed together are removed together: ``remove_one`` joins the open batch, and at most
    ``concurrency`` removal calls run at once, each for every id that joined while it waited. A burst of
    releases (a service closing 256 leases) costs a few node calls instead of one each, which had starved
    the node's health probe and left killed containers behind when their removals timed out."""

    def __init__(self, remove: Callable[[list[str]], Awaitable[None]], node_name: str, concurrency: int = 2) -> None:
        self._remove = remove
        self._node_name = node_name
        self._limiter = anyio.CapacityLimiter(concurrency)
        self._open: _Batch | None = None

    async def remove_one(self, sandbox_id: str) -> None:
        """Remove one sandbox in the next batch; raises the batch's InfraError."""
        batch = self._open
        leader = batch is None
        if batch is None:
            batch = self._open = _Batch()
        batch.ids.append(sandbox_id)
        if leader:
            try:
                async with self._limiter:  # while this waits, more ids join the batch
                    if self._open is batch:
                        self._open = None
                    try:
                        await self._remove(batch.ids)
                    except InfraError as exc:
                        batch.error = exc
            except BaseException:
                if self._open is batch:
                    self._open = None
                if batch.error is None:
                    batch.error = SandboxError(
                        f"removing {len(batch.ids)} sandbox(es) on {self._node_name} was cancelled"
                    )
                raise
            finally:
                batch.done.set()
        else:
            await batch.done.wait()
        if batch.error is not None:
            raise batch.error
