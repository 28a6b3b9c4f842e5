"""A container node reached over SSH (asyncssh), with a cap on channels per connection.

sshd limits sessions per connection (MaxSessions, default 10) and every live sandbox holds one channel
(its exec agent's pipe), so the node keeps a small pool of connections and opens another when all are
full, up to ``max_connections``; beyond that, callers wait for a free channel (bounded by their own
cancel scope). Host keys are verified against ``known_hosts`` unless the config says
``insecure-accept-any``.

A dropped connection (sshd killed, network gone: keepalives notice it) marks the node not ``alive``;
channels on it see end of stream. ``connect()`` reconnects. asyncssh errors are translated here.

``forward_unix`` forwards a unix socket of the node (the Podman API service's) to a local one in a private
temporary folder; forwarded connections are channels outside the per-connection cap (not sshd sessions).
``forward_tcp`` forwards a port of the node's loopback to this machine's; ``forward_to_local_path`` the other way:
a port of the node's loopback to a unix socket of this machine.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import tempfile
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import anyio
import anyio.abc

with warnings.catch_warnings():
    # cryptography 48+ deprecates DSA and asyncssh's import names its DSA types: the warning would print on every
    # `swectl` command, although swectl never offers or accepts a DSA key
    warnings.filterwarnings("ignore", message="DSA is deprecated", module=r"asyncssh\.")
    import asyncssh

from swectl.config import SshNodeConfig
from swectl.errors import InfraError, NodeConnectError, NodeLostError
from swectl.remote.nodes.node import serve_local_unix
from swectl.schema import CommandOutput


class _Client(asyncssh.SSHClient):
    def __init__(self) -> None:
        self.lost = False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


class _Connection:
    def __init__(self, conn: asyncssh.SSHClientConnection, client: _Client) -> None:
        self.conn = conn
        self.client = client
        self.channels = 0

    @property
    def usable(self) -> bool:
        return not self.client.lost and not self.conn.is_closed()


class _SshStreams:
    """Bytes both ways over one SSH channel's streams, as a NodeProcess sends and receives them."""

    def __init__(self, node: SshNode, reader: asyncssh.SSHReader, writer: asyncssh.SSHWriter) -> None:
        self._node = node
        self._reader = reader
        self._writer = writer

    async def send(self, data: bytes) -> None:
        try:
            self._writer.write(data)
            await self._writer.drain()
        except (asyncssh.Error, OSError, BrokenPipeError) as exc:
            raise BrokenPipeError(f"ssh channel to {self._node.name} closed") from exc

    async def receive(self, max_bytes: int = 65536) -> bytes:
        try:
            return await self._reader.read(max_bytes)
        except (asyncssh.Error, OSError):
            return b""

    async def close_input(self) -> None:
        try:
            self._writer.write_eof()
        except (asyncssh.Error, OSError):
            pass


class SshProcess(_SshStreams):
    """A remote process on one channel; holds its channel slot until closed."""

    def __init__(self, node: SshNode, slot: _Connection, process: asyncssh.SSHClientProcess) -> None:
        super().__init__(node, process.stdout, process.stdin)
        self._slot = slot
        self._process = process
        self._closed = False

    async def wait(self) -> int:
        completed = await self._process.wait(check=False)
        return completed.exit_status if completed.exit_status is not None else -1

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            self._process.close()
            with anyio.move_on_after(2):
                await self._process.wait_closed()
            self._node._release(self._slot)


class SshStreamChannel(_SshStreams):
    """A connection to a unix socket of the node, forwarded over the SSH connection (a direct-streamlocal channel:
    not a session, so outside the per-connection cap); ``wait`` has no exit code to give: 0."""

    async def wait(self) -> int:
        return 0

    @asynccontextmanager
    async def serve_unix(self, path: str, handler: Callable[[anyio.abc.ByteStream], Awaitable[None]]
                         ) -> AsyncIterator[None]:
        """``Node.serve_unix`` over SSH: the node's sshd listens at ``path`` (remote unix forwarding, asyncssh's
        ``forward_remote_path``) and hands each connection to a socket of this machine's that ``handler`` serves.
        InfraError when the node's sshd refuses (``AllowStreamLocalForwarding no``)."""
        await self.connect()
        local_dir = tempfile.mkdtemp(prefix="swectl-serve-")  # mode 0700
        local = os.path.join(local_dir, "s.sock")
        try:
            async with serve_local_unix(local, handler):
                slot = next(c for c in self._connections if c.usable)
                try:
                    listener = await slot.conn.forward_remote_path(path, local)
                except asyncssh.ChannelListenError as exc:
                    raise InfraError(f"node {self.name!r}: its sshd refused to listen at {path} for the "
                                     f"controller (sshd_config AllowStreamLocalForwarding): {exc.reason}") from exc
                except (asyncssh.Error, OSError) as exc:
                    raise NodeLostError(self.name, f"cannot serve {path}: {exc}") from exc
                try:
                    yield
                finally:
                    listener.close()
                    with anyio.CancelScope(shield=True), anyio.move_on_after(5), contextlib.suppress(Exception):
                        await self.run(["rm", "-f", path])
        finally:
            shutil.rmtree(local_dir, ignore_errors=True)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            self._writer.close()
            with anyio.move_on_after(2):
                await self._writer.channel.wait_closed()


class SshNode:
    """A Node reached over one asyncssh connection, with keepalives and reconnection."""

    def __init__(self, config: SshNodeConfig) -> None:
        self.name = config.name
        self._config = config
        self._identity = os.path.expanduser(config.identity_file)
        self._connections: list[_Connection] = []
        self._opening = anyio.Lock()
        self._slot_freed = anyio.Event()
        # forward_unix: remote path -> (the connection carrying it, its listener, the local path)
        self._forwards: dict[str, tuple[_Connection, asyncssh.SSHListener, str]] = {}
        self._forward_dir: str | None = None
        self._forwarding = anyio.Lock()
        self._tcp_forwards: list[asyncssh.SSHListener] = []  # forward_tcp's listeners

    @property
    def alive(self) -> bool:
        return any(c.usable for c in self._connections)

    def statistics(self) -> dict[str, int]:
        return {
            "connections": sum(c.usable for c in self._connections),
            "channels": sum(c.channels for c in self._connections if c.usable),
        }

    async def connect(self) -> None:
        """Make sure at least one working connection exists (reconnects after a loss)."""
        self._connections = [c for c in self._connections if c.usable or c.channels]
        if not any(c.usable for c in self._connections):
            async with self._opening:
                if not any(c.usable for c in self._connections):
                    self._connections.append(await self._open())

    def _known_hosts(self) -> str | None:
        cfg = self._config
        if cfg.known_hosts == "insecure-accept-any":
            return None
        known_hosts = os.path.expanduser(cfg.known_hosts)
        if not os.path.exists(known_hosts):
            raise NodeConnectError(
                self.name,
                f"known_hosts file {known_hosts} does not exist -- hint: add the host key with "
                f"`ssh-keyscan -p {cfg.port} {cfg.host} >> {known_hosts}` after checking it, or set "
                f'nodes.known_hosts = "insecure-accept-any" (not recommended)',
            )
        return known_hosts

    async def _open(self) -> _Connection:
        cfg = self._config
        known_hosts = self._known_hosts()
        identity = self._identity
        client = _Client()
        try:
            with anyio.fail_after(cfg.connect_timeout_s):
                conn = await asyncssh.connect(
                    cfg.host,
                    port=cfg.port,
                    username=cfg.user,
                    client_keys=[identity],
                    known_hosts=known_hosts,
                    client_factory=lambda: client,
                    keepalive_interval=cfg.keepalive_interval_s,
                    keepalive_count_max=cfg.keepalive_count_max,
                    agent_path=None,
                    config=[],
                )
        except TimeoutError as exc:
            raise NodeConnectError(
                self.name, f"connecting to {cfg.host}:{cfg.port} timed out after {cfg.connect_timeout_s}s"
            ) from exc
        except asyncssh.HostKeyNotVerifiable as exc:
            raise NodeConnectError(
                self.name,
                f"host key of {cfg.host}:{cfg.port} is not in {known_hosts} ({exc.reason}) -- hint: "
                "verify the key and add it to known_hosts",
            ) from exc
        except asyncssh.PermissionDenied as exc:
            raise NodeConnectError(
                self.name, f"permission denied for {cfg.user}@{cfg.host} with key {identity}"
            ) from exc
        except (OSError, asyncssh.Error) as exc:
            raise NodeConnectError(self.name, f"cannot connect to {cfg.host}:{cfg.port}: {exc}") from exc
        return _Connection(conn, client)

    async def _acquire(self) -> _Connection:
        while True:
            self._connections = [c for c in self._connections if c.usable or c.channels]
            for c in self._connections:
                if c.usable and c.channels < self._config.max_channels_per_connection:
                    c.channels += 1
                    return c
            usable = [c for c in self._connections if c.usable]
            if len(usable) < self._config.max_connections:
                async with self._opening:
                    if len([c for c in self._connections if c.usable]) < self._config.max_connections:
                        self._connections.append(await self._open())
                continue
            freed = self._slot_freed
            await freed.wait()

    def _release(self, slot: _Connection) -> None:
        slot.channels -= 1
        self._slot_freed.set()
        self._slot_freed = anyio.Event()

    async def run(self, argv: Sequence[str], *, input: bytes | None = None) -> CommandOutput:
        slot = await self._acquire()
        try:
            done = await slot.conn.run(shlex.join(argv), input=input, encoding=None, check=False)
        except (asyncssh.Error, OSError) as exc:
            raise NodeLostError(self.name, f"connection failed during `{shlex.join(argv)[:200]}`: {exc}") from exc
        finally:
            self._release(slot)
        stdout = done.stdout if isinstance(done.stdout, bytes) else b""
        stderr = done.stderr if isinstance(done.stderr, bytes) else b""
        if done.exit_status is None:
            exit_code = 128 + (15 if done.exit_signal else 1)
        else:
            exit_code = done.exit_status
        return CommandOutput(exit_code=exit_code, stdout=stdout, stderr=stderr)

    async def spawn(self, argv: Sequence[str]) -> SshProcess:
        slot = await self._acquire()
        try:
            process = await slot.conn.create_process(
                shlex.join(argv), encoding=None, stderr=asyncssh.DEVNULL
            )
        except (asyncssh.Error, OSError) as exc:
            self._release(slot)
            raise NodeLostError(self.name, f"cannot open a channel: {exc}") from exc
        except BaseException:
            self._release(slot)
            raise
        return SshProcess(self, slot, process)

    async def open_unix(self, path: str) -> SshStreamChannel:
        await self.connect()
        usable = [c for c in self._connections if c.usable]
        if not usable:
            raise NodeLostError(self.name, "no usable connection")
        try:
            reader, writer = await min(usable, key=lambda c: c.channels).conn.open_unix_connection(path)
        except asyncssh.ChannelOpenError as exc:  # the node's sshd could not connect: nothing listens there (yet)
            raise ConnectionRefusedError(f"{path} on {self.name}: {exc.reason}") from exc
        except (asyncssh.Error, OSError) as exc:
            raise NodeLostError(self.name, f"cannot open a channel to {path}: {exc}") from exc
        return SshStreamChannel(self, reader, writer)

    async def forward_unix(self, remote_path: str) -> str:
        """A local unix socket whose connections reach ``remote_path`` on the node (asyncssh's
        ``forward_local_path``). Idempotent: the same local path for the same remote path, forwarded again over a
        live connection when the one carrying it dropped. Removed by ``aclose``."""
        current = self._forwards.get(remote_path)
        if current is not None and current[0].usable:
            return current[2]
        async with self._forwarding:
            await self.connect()
            current = self._forwards.get(remote_path)
            if current is not None and current[0].usable:
                return current[2]
            if self._forward_dir is None:
                self._forward_dir = tempfile.mkdtemp(prefix="swectl-ssh-")  # mode 0700: only we reach the node
            local = current[2] if current else os.path.join(self._forward_dir, f"{len(self._forwards)}.sock")
            if current is not None:
                current[1].close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(local)
            slot = next(c for c in self._connections if c.usable)
            try:
                listener = await slot.conn.forward_local_path(local, remote_path)
            except (asyncssh.Error, OSError) as exc:
                raise NodeLostError(self.name, f"cannot forward {remote_path}: {exc}") from exc
            self._forwards[remote_path] = (slot, listener, local)
            return local

    async def forward_tcp(self, remote_port: int) -> tuple[int, Callable[[], None]]:
        """A port on this machine's loopback whose connections reach ``127.0.0.1:remote_port`` on the node, over the
        SSH connection (asyncssh's ``forward_local_port``): for a server that must not listen on the node's network
        (vLLM's weight routes take no API key). Returns the local port and the call that stops forwarding; ``aclose``
        stops it too."""
        await self.connect()
        slot = next(c for c in self._connections if c.usable)
        try:
            listener = await slot.conn.forward_local_port("127.0.0.1", 0, "127.0.0.1", remote_port)
        except (asyncssh.Error, OSError) as exc:
            raise NodeLostError(self.name, f"cannot forward port {remote_port}: {exc}") from exc
        self._tcp_forwards.append(listener)
        return listener.get_port(), listener.close

    async def forward_to_local_path(self, local_path: str) -> tuple[int, Callable[[], None]]:
        """A port on the node's loopback (``127.0.0.1:PORT``, PORT chosen by its sshd) whose connections reach the
        unix socket ``local_path`` on this machine, over the SSH connection (asyncssh's
        ``forward_remote_port_to_path``): the node reaches a server of the controller that listens on no network
        (`swectl image sync` from the controller). Returns the node's port and the call that stops forwarding;
        ``aclose`` stops it too. InfraError when the node's sshd refuses (``AllowTcpForwarding no`` or ``local``)."""
        await self.connect()
        slot = next(c for c in self._connections if c.usable)
        try:
            listener = await slot.conn.forward_remote_port_to_path("127.0.0.1", 0, local_path)
        except asyncssh.ChannelListenError as exc:
            raise InfraError(f"node {self.name!r}: its sshd refused to listen on 127.0.0.1 for the controller "
                             f"(remote port forwarding; sshd_config AllowTcpForwarding must be yes or remote): "
                             f"{exc.reason}") from exc
        except (asyncssh.Error, OSError) as exc:
            raise NodeLostError(self.name, f"cannot forward a port to the controller: {exc}") from exc
        self._tcp_forwards.append(listener)
        return listener.get_port(), listener.close

    @asynccontextmanager
    async def serve_unix(self, path: str, handler: Callable[[anyio.abc.ByteStream], Awaitable[None]]
                         ) -> AsyncIterator[None]:
        """``Node.serve_unix`` over SSH: the node's sshd listens at ``path`` (remote unix forwarding, asyncssh's
        ``forward_remote_path``) and hands each connection to a socket of this machine's that ``handler`` serves.
        InfraError when the node's sshd refuses (``AllowStreamLocalForwarding no``)."""
        await self.connect()
        local_dir = tempfile.mkdtemp(prefix="swectl-serve-")  # mode 0700
        local = os.path.join(local_dir, "s.sock")
        try:
            async with serve_local_unix(local, handler):
                slot = next(c for c in self._connections if c.usable)
                try:
                    listener = await slot.conn.forward_remote_path(path, local)
                except asyncssh.ChannelListenError as exc:
                    raise InfraError(f"node {self.name!r}: its sshd refused to listen at {path} for the "
                                     f"controller (sshd_config AllowStreamLocalForwarding): {exc.reason}") from exc
                except (asyncssh.Error, OSError) as exc:
                    raise NodeLostError(self.name, f"cannot serve {path}: {exc}") from exc
                try:
                    yield
                finally:
                    listener.close()
                    with anyio.CancelScope(shield=True), anyio.move_on_after(5), contextlib.suppress(Exception):
                        await self.run(["rm", "-f", path])
        finally:
            shutil.rmtree(local_dir, ignore_errors=True)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            for listener in self._tcp_forwards:
                listener.close()
            self._tcp_forwards = []
            for _, listener, _ in self._forwards.values():
                listener.close()
            self._forwards = {}
            if self._forward_dir is not None:
                shutil.rmtree(self._forward_dir, ignore_errors=True)
                self._forward_dir = None
            for c in self._connections:
                c.conn.close()
            with anyio.move_on_after(5):
                for c in self._connections:
                    await c.conn.wait_closed()
            self._connections = []
