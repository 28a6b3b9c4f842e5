"""The HTTP side of `swectl serve`: the pool-server routes (Starlette), the API key, body limits, decoding,
idempotency keys, one JSON error shape, and the server's bounded lifetime (uvicorn on the controller's loop).

Every answer is JSON with ``ok``; a failure is ``{"ok": false, "error": "..."}`` with a 4xx (the request:
malformed, unknown or ended lease, wrong key, too large) or a 5xx (``infra: true`` when the infrastructure
failed: the client aborts the sample instead of scoring it).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import anyio.abc
import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from swectl.serve.fleet import Fleet
from swectl.serve.idempotency import Answer, IdempotencyCache
from swectl.serve.wire import AllocateRequest, ApiError, DiffRequest, EvaluateRequest, ExecRequest, LeaseRequest

_log = logging.getLogger(__name__)
DEFAULT_MAX_BODY = 32 * 1024 * 1024
GRACEFUL_SHUTDOWN_S = 5.0  # requests still running when the service stops get this long, then are cancelled
START_TIMEOUT_S = 30.0
KEEP_ALIVE_S = 120  # an idle client connection is kept this long (a rollout's model turn can take a minute)
REPLAY_WAIT_S = 4 * 3600.0  # a retry waits for its first request at most this long (bounded by its timeouts)


def json_response(status: int, body: dict[str, object]) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


class Api:
    """The routes over one Fleet. ``api_key``: required as ``Authorization: Bearer KEY`` on every route but
    ``/healthz`` (None: no key, for loopback only; the CLI enforces that)."""

    def __init__(self, fleet: Fleet, *, api_key: str | None, max_body: int = DEFAULT_MAX_BODY,
                 cache: IdempotencyCache | None = None) -> None:
        self._fleet = fleet
        self._api_key = api_key
        self._max_body = max_body
        self._cache = cache or IdempotencyCache()

    def app(self) -> Starlette:
        f = self._fleet
        routes = [
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/status", self.status, methods=["GET"]),
            Route("/allocate", self._endpoint(f.allocate, AllocateRequest, once=True), methods=["POST"]),
            Route("/heartbeat", self._endpoint(f.heartbeat, LeaseRequest), methods=["POST"]),
            Route("/exec", self._endpoint(f.exec, ExecRequest, once=True), methods=["POST"]),
            Route("/diff", self._endpoint(f.diff, DiffRequest), methods=["POST"]),
            Route("/evaluate", self._endpoint(f.evaluate, EvaluateRequest), methods=["POST"]),
            Route("/close", self._endpoint(f.close, LeaseRequest, once=True), methods=["POST"]),
        ]
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})

    async def healthz(self, request: Request) -> Response:
        return json_response(200, {"ok": True})

    async def status(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except ApiError as exc:
            return json_response(exc.status, exc.body())
        return json_response(200, self._fleet.status(idempotent_replays=self._cache.replays))

    def _endpoint(self, call: Callable[[Any], Awaitable[dict[str, object]]], request_type: type, *,
                  once: bool = False) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            try:
                self._authorize(request)
                body = await self._body(request)
                decoded = _decode(body, request_type, request.url.path)
                key = request.headers.get("idempotency-key", "").strip()
                if once and key:
                    status, answer = await self._cache.once(request.url.path, key, body,
                                                            lambda: _answer(call, decoded), wait_s=REPLAY_WAIT_S)
                else:
                    status, answer = await _answer(call, decoded)
            except ApiError as exc:
                status, answer = exc.status, exc.body()
            return json_response(status, answer)

        return handle

    def _authorize(self, request: Request) -> None:
        if self._api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (the key swectl serve "
                           "was started with, $SWECTL_SERVE_API_KEY)")

    async def _body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._max_body:
            raise ApiError(413, f"request body of {int(declared)} bytes is over the limit of {self._max_body} bytes "
                           "(swectl serve --max-body-mb)")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self._max_body:
                raise ApiError(413, f"request body is over the limit of {self._max_body} bytes "
                               "(swectl serve --max-body-mb)")
            chunks.append(chunk)
        return b"".join(chunks)


def _decode(body: bytes, request_type: type, path: str) -> Any:
    if not body.strip():
        raise ApiError(400, f"{path}: empty body; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"{path}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"{path}: the body is not valid JSON: {exc}") from exc


async def _answer(call: Callable[[Any], Awaitable[dict[str, object]]], request: Any) -> Answer:
    """The call's answer, or its ApiError as an answer; anything else is a 500 that says what failed."""
    try:
        return 200, await call(request)
    except ApiError as exc:
        return exc.status, exc.body()
    except Exception as exc:
        _log.exception("internal error in %s", getattr(call, "__name__", call))
        return 500, {"ok": False, "error": f"internal error: {type(exc).__name__}: {exc}"}


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return json_response(exc.status_code, {"ok": False, "error": f"{request.method} {request.url.path}: {exc.detail}"})


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: swectl's (cli/main.py) cancel the service, which stops this."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_http(app: Starlette, sock: socket.socket, *,
                     task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` on ``sock`` until cancelled; then stop accepting, give running requests
    GRACEFUL_SHUTDOWN_S, and return (the listening socket is closed)."""
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
