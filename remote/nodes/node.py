"""How the controller runs programs on a node: the Node protocol and the local implementation.

A node runs short commands (``run``: collect exit code, stdout, stderr) and long-lived processes
(``spawn``: a byte pipe to stdin/stdout, used for in-sandbox exec agents), and connects to a unix socket of the
node (``open_unix``: the same byte pipe, with no process in between), and serves one (``serve_unix``: each
connection to a unix socket it creates on the node handed to a handler on the controller). The SSH implementation lives
in remote/nodes/ssh.py. Callers bound every wait with their own cancel scope; cancelling ``run`` kills
the command.

Errors: connection problems raise NodeConnectError / NodeLostError. A spawned process whose pipe broke
raises BrokenPipeError from ``send``; ``receive`` returns b"" at end of stream.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Protocol

import anyio
import anyio.abc

from swectl.schema import CommandOutput


class NodeProcess(Protocol):
    """A process started on a node: bytes in, bytes out, its exit code."""

    async def send(self, data: bytes) -> None: ...
    async def receive(self, max_bytes: int = 65536) -> bytes: ...
    async def close_input(self) -> None: ...
    async def wait(self) -> int: ...
    async def aclose(self) -> None: ...


class Node(Protocol):
    """A machine that runs commands and processes (this one, or one reached over ssh)."""
    name: str

    @property
    def alive(self) -> bool:
        """False once the node's transport is known to be gone (an SSH connection dropped)."""
        ...

    async def connect(self) -> None: ...
    async def run(self, argv: Sequence[str], *, input: bytes | None = None) -> CommandOutput: ...
    async def spawn(self, argv: Sequence[str]) -> NodeProcess: ...
    async def open_unix(self, path: str) -> NodeProcess:
        """A connection to the unix socket ``path`` of the node; ConnectionError (an OSError) when nothing
        listens there (yet)."""
        ...
    def serve_unix(self, path: str, handler: Callable[[anyio.abc.ByteStream], Awaitable[None]]
                   ) -> AbstractAsyncContextManager[None]:
        """While the block runs, a unix socket at ``path`` on the node (made when the block starts, removed when it
        ends) whose every connection is handed to ``handler`` on the controller, each in its own task."""
        ...
    async def aclose(self) -> None: ...


class LocalProcess:
    """A child process of the controller with piped stdin/stdout (stderr discarded)."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self._process = process

    async def send(self, data: bytes) -> None:
        assert self._process.stdin is not None
        try:
            await self._process.stdin.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise BrokenPipeError("process input is closed") from exc

    async def receive(self, max_bytes: int = 65536) -> bytes:
        assert self._process.stdout is not None
        try:
            return await self._process.stdout.receive(max_bytes)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            return b""

    async def close_input(self) -> None:
        if self._process.stdin is not None:
            await self._process.stdin.aclose()

    async def wait(self) -> int:
        return await self._process.wait()

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            if self._process.returncode is None:
                self._process.kill()
            with anyio.move_on_after(5):
                await self._process.aclose()


class SocketChannel:
    """A socket connection as a NodeProcess (a sandbox's socket pair, a unix socket of the node); ``wait`` has no
    exit code to give: 0."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self._stream = stream

    async def send(self, data: bytes) -> None:
        try:
            await self._stream.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise BrokenPipeError("sandbox channel is closed") from exc

    async def receive(self, max_bytes: int = 65536) -> bytes:
        try:
            return await self._stream.receive(max_bytes)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return b""

    async def close_input(self) -> None:
        try:
            await self._stream.send_eof()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass

    async def wait(self) -> int:
        return 0

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._stream.aclose()


class LocalNode:
    """This machine. Commands run as child processes of the controller."""

    def __init__(self, name: str = "local") -> None:
        self.name = name

    @property
    def alive(self) -> bool:
        return True

    async def connect(self) -> None:
        return None

    async def run(self, argv: Sequence[str], *, input: bytes | None = None) -> CommandOutput:
        try:
            done = await anyio.run_process(list(argv), input=input, check=False)
        except FileNotFoundError as exc:
            return CommandOutput(exit_code=127, stdout=b"", stderr=f"{argv[0]}: not found ({exc})".encode())
        return CommandOutput(exit_code=done.returncode, stdout=done.stdout, stderr=done.stderr)

    async def spawn(self, argv: Sequence[str]) -> NodeProcess:
        process = await anyio.open_process(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        return LocalProcess(process)

    async def open_unix(self, path: str) -> SocketChannel:
        try:
            return SocketChannel(await anyio.connect_unix(path))
        except FileNotFoundError as exc:
            raise ConnectionRefusedError(f"no socket at {path}") from exc

    def serve_unix(self, path: str, handler: Callable[[anyio.abc.ByteStream], Awaitable[None]]
                   ) -> AbstractAsyncContextManager[None]:
        return serve_local_unix(path, handler)

    async def aclose(self) -> None:
        return None


@asynccontextmanager
async def serve_local_unix(path: str, handler: Callable[[anyio.abc.ByteStream], Awaitable[None]]
                           ) -> AsyncIterator[None]:
    """``Node.serve_unix`` on this machine."""
    listener = await anyio.create_unix_listener(path)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, handler, tg)
            try:
                yield
            finally:
                tg.cancel_scope.cancel("the socket is closed")
    finally:
        with anyio.CancelScope(shield=True):
            await listener.aclose()
        with contextlib.suppress(OSError):
            await anyio.Path(path).unlink()
