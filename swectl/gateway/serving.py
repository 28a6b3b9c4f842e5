"""Serving a Starlette app on the controller's event loop, bounded (``swectl serve`` and the gateway share it)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import anyio
import anyio.abc
import uvicorn
from starlette.applications import Starlette

GRACEFUL_SHUTDOWN_S = 5.0  # requests still running when the service stops get this long, then are cancelled
START_TIMEOUT_S = 30.0
KEEP_ALIVE_S = 120  # an idle client connection is kept this long (a rollout's model turn can take a minute)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: swectl's (cli/main.py) cancel the service, which stops this."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_http(app: Starlette, sock: socket.socket, *,
                     task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` on ``sock`` until cancelled; then stop accepting, give running requests
    GRACEFUL_SHUTDOWN_S, and return (the listening socket is closed). A TCP socket gets TCP_NODELAY, which its
    connections inherit: without it a response written in two parts waited for the client's delayed ACK on every
    request (docs/results.md, "Figures the code relies on")."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    server = _Server(uvicorn.Config(app, lifespan="off", access_log=False, log_level="warning",
                                    timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, backlog=4096,
                                    timeout_keep_alive=KEEP_ALIVE_S))

    async def run_server() -> None:
        with anyio.CancelScope(shield=True):  # stopped by should_exit, bounded by the graceful shutdown
            await server.serve(sockets=[sock])

    async with anyio.create_task_group() as tg:
        tg.start_soon(run_server, name="http server")
        try:
            with anyio.fail_after(START_TIMEOUT_S):
                while not server.started:  # noqa: ASYNC110  (uvicorn offers a flag, no event)
                    await anyio.sleep(0.01)
            task_status.started()
            await anyio.sleep_forever()
        finally:
            server.should_exit = True
