"""A relay from a unix socket of the controller to a TCP address, counting the bytes each way.

`swectl image sync` from the controller gives each node one: the node's forwarded port (its sshd) -> this socket ->
the controller's registry on 127.0.0.1. The socket lies in a private folder (mode 0700), so only the node's forward
reaches it; the count is what that node really received, headers and all, however much a pull resumed.

A connection the registry refuses is closed at once (the node's podman then says the registry is unreachable).
"""

from __future__ import annotations

import anyio
import anyio.abc
import msgspec

CONNECT_TIMEOUT_S = 10.0
CHUNK = 1 << 16


class RelayStatistics(msgspec.Struct, frozen=True):
    """What a relay carried: connections, bytes to the client (``sent``) and from it, connections refused upstream."""

    connections: int
    sent: int
    received: int
    refused: int


class ByteRelay:
    """Serve ``path`` (a unix socket) as a relay to ``host:port``; ``run`` until cancelled."""

    def __init__(self, path: str, host: str, port: int) -> None:
        self.path = path
        self.host = host
        self.port = port
        self._connections = 0
        self._sent = 0
        self._received = 0
        self._refused = 0

    def statistics(self) -> RelayStatistics:
        return RelayStatistics(connections=self._connections, sent=self._sent, received=self._received,
                               refused=self._refused)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_unix_listener(self.path)
        async with listener:
            task_status.started()
            await listener.serve(self._handle)

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        async with client:
            self._connections += 1
            try:
                with anyio.fail_after(CONNECT_TIMEOUT_S):
                    upstream = await anyio.connect_tcp(self.host, self.port)
            except (OSError, TimeoutError):
                self._refused += 1
                return
            async with upstream, anyio.create_task_group() as tg:
                tg.start_soon(self._pump, client, upstream, False, tg.cancel_scope, name="relay to upstream")
                tg.start_soon(self._pump, upstream, client, True, tg.cancel_scope, name="relay to client")

    async def _pump(self, source: anyio.abc.SocketStream, sink: anyio.abc.SocketStream, to_client: bool,
                    scope: anyio.CancelScope) -> None:
        """Copy until the source ends (then half-close the sink) or either side breaks (then end both ways)."""
        try:
            while True:
                try:
                    chunk = await source.receive(CHUNK)
                except anyio.EndOfStream:
                    await sink.send_eof()
                    return
                await sink.send(chunk)
                if to_client:
                    self._sent += len(chunk)
                else:
                    self._received += len(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            scope.cancel()
