"""`swectl serve`'s lifetime: the env pool, the grader, the fleet and the HTTP server, started in that order
and stopped in the reverse one (the server stops taking requests, then every sandbox of the run is removed)."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.abc
import msgspec

from swectl.actors.env_pool import running_pool
from swectl.actors.grader import Grader, GraderConfig
from swectl.config import ClusterConfig
from swectl.gateway.serving import serve_http
from swectl.images.names import ImageResolver
from swectl.serve.app import DEFAULT_MAX_BODY, Api
from swectl.serve.fleet import Fleet
from swectl.serve.wire import DEFAULT_MAX_OUTPUT_BYTES
from swectl.tasks.record import Task


class ServeOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What `swectl serve` was asked for, beside the cluster config."""
    api_key: str | None = None
    allow_from: tuple[str, ...] = ()  # CIDRs whose clients need no key
    max_body: int = DEFAULT_MAX_BODY
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES  # a command's output returned whole up to this
    allocate_timeout_s: float = 600.0
    grade_concurrency: int = 8
    log_dir: str = ""  # eval logs of /evaluate ("" = not kept)


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


async def run_service(
    config: ClusterConfig, tasks: list[Task], resolver: ImageResolver, sock: socket.socket, options: ServeOptions,
    *, ready: Callable[[str], None] | None = None,
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the pool-server API on ``sock`` until cancelled; ``ready(url)`` once requests are taken."""
    url = url_of(sock)
    async with running_pool(config) as pool, anyio.create_task_group() as tg:
        grader = Grader(GraderConfig(concurrency=options.grade_concurrency), pool, resolver=resolver,
                        log_dir=Path(options.log_dir) if options.log_dir else None)
        fleet = Fleet(pool, grader, {t.instance_id: t for t in tasks}, resolver, url=url,
                      allocate_timeout_s=options.allocate_timeout_s, max_output_bytes=options.max_output_bytes)
        await tg.start(fleet.run, name="fleet")
        api = Api(fleet, api_key=options.api_key, max_body=options.max_body,
                  allow_from=tuple(ipaddress.ip_network(cidr, strict=False) for cidr in options.allow_from))
        await tg.start(serve_http, api.app(), sock, name="http")
        if ready is not None:
            ready(url)
        task_status.started(url)
        try:
            await anyio.sleep_forever()
        finally:
            tg.cancel_scope.cancel("service stopped")
