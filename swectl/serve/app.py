"""The HTTP side of `swectl serve`: the pool-server routes (Starlette), the API key, body limits, decoding,
idempotency keys, one JSON error shape, and the server's bounded lifetime (uvicorn on the controller's loop).

Every answer is JSON with ``ok``; a failure is ``{"ok": false, "error": "..."}`` with a 4xx (the request:
malformed, unknown or ended lease, wrong key, too large) or a 5xx (``infra: true`` when the infrastructure
failed: the client aborts the sample instead of scoring it).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
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
REPLAY_WAIT_S = 4 * 3600.0  # a retry waits for its first request at most this long (bounded by its timeouts)


def json_response(status: int, body: dict[str, object]) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class Api:
    """The routes over one Fleet. Access, on every route but ``/healthz``: with neither an ``api_key`` nor
    ``allow_from``, anyone who reaches the socket (loopback only; the CLI enforces that); otherwise a request
    with ``Authorization: Bearer KEY``, or without it from an address in ``allow_from`` (OpenClaw-RL's client
    sends no header). Others get 401 (a key was sent and is wrong, or only a key is accepted) or 403."""

    def __init__(self, fleet: Fleet, *, api_key: str | None, max_body: int = DEFAULT_MAX_BODY,
                 cache: IdempotencyCache | None = None, allow_from: tuple[Network, ...] = ()) -> None:
        self._fleet = fleet
        self._api_key = api_key
        self._allow_from = allow_from
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
        if self._api_key is None and not self._allow_from:
            return
        given = request.headers.get("authorization", "")
        if given and self._api_key is not None:
            scheme, _, token = given.partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._api_key.encode()):
                return
            raise ApiError(401, "wrong API key: send 'Authorization: Bearer <key>' (the key swectl serve was started "
                           "with, $SWECTL_SERVE_API_KEY)")
        peer = _peer_address(request)
        if peer is not None and any(peer in network for network in self._allow_from):
            return
        if not self._allow_from:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>' (the key swectl serve was "
                           "started with, $SWECTL_SERVE_API_KEY)")
        raise ApiError(403, f"requests from {peer or 'this client'} are not allowed without an API key: the "
                       f"service accepts unauthenticated clients only from {', '.join(map(str, self._allow_from))} "
                       "(swectl serve --allow-from CIDR)" + (" or with 'Authorization: Bearer <key>'"
                                                             if self._api_key is not None else ""))

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


def _peer_address(request: Request) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The client's address (an IPv4-mapped IPv6 address as IPv4); None when the transport gives none."""
    if request.client is None:
        return None
    try:
        address = ipaddress.ip_address(request.client.host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


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
