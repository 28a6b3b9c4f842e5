"""The Gateway actor: a model endpoint for agent harnesses that run unmodified, token-exact.

A harness is given a base URL and, per episode, a random secret as its API key (``open_session``): that key is the
session. It speaks one of three APIs, and every turn takes the same path whichever it is:

- ``POST /v1/chat/completions``: OpenAI chat completions (mini-swe-agent, SWE-agent, OpenHands through LiteLLM);
- ``POST /v1/messages``: Anthropic's Messages API (Claude Code); ``POST /v1/messages/count_tokens`` renders a
  prompt the same way and counts it, nothing sampled;
- ``POST /v1/responses``: OpenAI's Responses API (Codex CLI);
- ``GET`` / ``HEAD /``: 200 with no key (Claude Code checks its base URL so before its first turn).

Each API's module (swectl/gateway/wire.py, messages.py, responses.py) only decodes its request into a
``TurnRequest`` and formats a ``TurnResult`` in its own shape. The turn itself is here: the messages are rendered
with the policy's own chat template (its tools included), the reply's max tokens are clamped to what is left of the
context, the engines sample token ids with logprobs (``engine_for(name)``, by the session's name: every turn of a
session goes to one server, so its prefix stays cached), the turn is recorded in the session's ledger
(swectl/gateway/ledger.py: appended when the rendering extends what was recorded, a branch when it does not), and
the completion is decoded with the policy family's tool calls parsed out. ``end_session`` closes the session and
hands back its ledger. Answers go back whole or as server-sent events.

Errors are in each API's shape: 401 for a missing or unknown key (no key never lands in a shared session), 409 for
a session already ended, 400 for a malformed body, ``n`` > 1, or a prompt that leaves no room in the context, 404
for another model name, 503 when the engine failed (an infrastructure failure: the episode is aborted, never
scored). A request that arrives while the engines take new weights waits for them (their generation is paused in
place), bounded by ``request_timeout_s``. With ``wait_routable`` (the engines' outage wait), a turn whose engine
server failed is asked again of a routable one, within the same bound, before it becomes a 503: an engine restart
costs the harness a slow turn, not a retry of its own (harnesses retry a 503 after seconds of backoff, or not at
all). Nothing of a failed try reaches the ledger.

A retry (the same turn asked again through the same API in one session: the same messages, tools and sampling
settings, whatever else the body carries or in what key order) gets the recorded answer, or waits for the first
request's answer while it runs: a retry never forks the episode. The SDKs mark theirs (``x-stainless-retry-count``
> 0); Claude Code's own retries send the same bytes with the count at 0, and Codex's reconnects the same turn with
``client_metadata`` in another key order. A client
that disconnects while its turn runs cancels it: nothing of it reaches the ledger.

A session opened with a workspace (the episode's sandbox lease) also runs the harness's commands there:
``POST /swectl/v1/exec`` ``{command, cwd, env, timeout}`` with the session's key answers ``{output, returncode,
exception_info}`` (a timeout is a result: returncode -1; a lost sandbox is a 503, an infrastructure failure). That
is how an unmodified harness drives swectl's sandboxes: its environment class (swectl/gateway/harness/) posts there.

Consumes: HTTP requests from harnesses. Waits for: the engines. Produces: completions, session ledgers,
``statistics()`` (a ``GatewayStatistics``). Starts with ``await tg.start(gateway.run)`` (listening once started).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

import anyio
import anyio.abc
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from swectl.agent.loop import Engine, request_seed
from swectl.agent.trajectory import ChatTokenizer, rendered_ids
from swectl.engine.wire import GenerateRequest, GenerateResult, SamplingParams
from swectl.errors import EngineError, InfraError
from swectl.gateway import messages, responses
from swectl.gateway.ledger import Ledger, LedgerStats
from swectl.gateway.serving import serve_http
from swectl.gateway.wire import (
    ChatCompletionRequest,
    TurnRequest,
    TurnResult,
    chat_answer,
    chat_turn,
    completion_chunks,
    error_body,
    models_body,
    new_id,
    now,
    split_tool_calls,
)
from swectl.schema import ExecResult, GatewayStatistics

_log = logging.getLogger(__name__)
_JSON = msgspec.json.Encoder()
DISCONNECT_POLL_S = 0.1  # how often the watcher looks whether the running turns' clients are still there


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The gateway's settings."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port (``url`` says which)
    model: str = "swectl-policy"  # the model name harnesses ask for (any other is 404)
    context_tokens: int = 8192  # prompt + completion of one turn at most
    max_tokens: int = 1024  # a turn's completion when the request gives no max_tokens
    temperature: float = 1.0  # when the request gives none
    # seeded sampling when the request gives no seed: each turn's seed from (seed, the session's name, its turn), so
    # a rerun draws the same episodes (the CPU engine; SGLang with deterministic inference). None: fresh randomness
    seed: str | None = None
    # the bearer token of the session routes (POST /swectl/v1/sessions, /swectl/v1/sessions/end: `swectl gateway`
    # for a harness the user runs); "": no such routes (sessions are opened in-process, by the rollout)
    admin_token: str = ""
    request_timeout_s: float = 600.0  # one turn at most, a wait for a weight update included
    # the first pause before a failed turn is asked again of a routable server (it doubles, up to 8 s)
    engine_retry_pause_s: Annotated[float, msgspec.Meta(ge=0)] = 0.5
    exec_timeout_s: float = 600.0  # one harness command at most, whatever it asks for
    max_body_bytes: int = 16 * 1024 * 1024
    # a streamed turn opens its stream once the request is checked and rendered, and sends an SSE comment this often
    # while the turn is sampled: Claude Code and Codex drop a stream idle for 300 s, which one long CPU turn passes
    stream_keepalive_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0


def _mark(session: _Session | None, exc: _HttpError) -> None:
    """What a refused or failed turn says about its episode: it reached a limit, or the infrastructure failed."""
    if session is None:
        return
    if exc.code in ("context_length_exceeded", "turn_limit_reached"):
        session.limited = True
    elif exc.status >= 500:
        session.failed = True


def _own_fault(exc: Exception) -> _HttpError:
    """A fault of the gateway's own, as the 500 it answers."""
    return _HttpError(500, f"the gateway failed: {type(exc).__name__}: {exc}", "server_error")


class _KeptAliveStream(StreamingResponse):
    """A server-sent-event stream opened before its turn is answered: ``: keepalive`` comments every
    ``keepalive_s`` (every SSE reader skips them) until ``answer`` gives the events, then those. A client that
    disconnects cancels the turn (nothing of it is recorded) and ``on_disconnect`` counts it."""

    def __init__(self, answer: Callable[[], Awaitable[list[bytes]]], keepalive_s: float,
                 on_disconnect: Callable[[], None]) -> None:
        super().__init__(iter(()), media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self._answer, self._keepalive_s, self._on_disconnect = answer, keepalive_s, on_disconnect

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        chunks: list[bytes] = []
        gone = False
        async with anyio.create_task_group() as tg:
            async def produce() -> None:
                chunks.extend(await self._answer())
                tg.cancel_scope.cancel()

            async def watch() -> None:
                nonlocal gone
                while (await receive())["type"] != "http.disconnect":
                    pass
                gone = True
                self._on_disconnect()
                tg.cancel_scope.cancel()

            tg.start_soon(produce)
            tg.start_soon(watch)
            while True:
                await anyio.sleep(self._keepalive_s)
                await send({"type": "http.response.body", "body": b": keepalive\n\n", "more_body": True})
        if gone:
            return
        for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param


def _openai_error(exc: _HttpError) -> dict[str, Any]:
    return error_body(str(exc), exc.kind, exc.code, exc.param)


def _anthropic_error(exc: _HttpError) -> dict[str, Any]:
    return messages.error_body(exc.status, str(exc))


@dataclass(frozen=True)
class _Api:
    """One API the gateway speaks: its request type, how a request becomes a turn, how a turn is answered (whole and
    as server-sent events), and its error shape."""

    name: str
    request: type[Any]
    turn: Callable[[Any], TurnRequest]
    answer: Callable[[Any, TurnResult, str], dict[str, Any]]
    events: Callable[[dict[str, Any]], list[bytes]]
    error: Callable[[_HttpError], dict[str, Any]]


CHAT = _Api("chat completion", ChatCompletionRequest, chat_turn, chat_answer, completion_chunks, _openai_error)
MESSAGES = _Api("messages", messages.MessagesRequest, messages.messages_turn, messages.message_body,
                messages.message_events, _anthropic_error)
RESPONSES = _Api("responses", responses.ResponsesRequest, responses.responses_turn, responses.response_body,
                 responses.response_events, _openai_error)


class Workspace(Protocol):
    """Where a session's commands run (an EnvPool Lease)."""

    async def exec(self, command: str, timeout: float, *, cwd: str | None = None, env: dict[str, str] | None = None,
                   output_limit: int | None = None) -> ExecResult: ...


class ExecBody(msgspec.Struct, kw_only=True):
    """``POST /swectl/v1/exec``."""

    command: str
    cwd: str = ""
    env: dict[str, str] = {}
    timeout: float = 60.0


class SessionBody(msgspec.Struct, kw_only=True):
    """``POST /swectl/v1/sessions`` (a name) and ``/swectl/v1/sessions/end`` (a key)."""

    name: str = ""
    key: str = ""


@dataclass
class _Session:
    key: str
    name: str
    workspace: Workspace | None = None
    commands: int = 0
    max_turns: int = 0  # the episode's turns at most (0: no limit); one more is refused with a 400
    limited: bool = False  # a turn was refused for a limit: the turns' (max_turns) or the context's
    failed: bool = False  # a turn failed on the infrastructure's side (the engine, the sandbox: a 5xx)
    last_finish: str = ""  # why the last sampled turn ended ("stop", "length", "tool_calls")
    ledger: Ledger = field(default_factory=Ledger)
    ended: bool = False
    answers: dict[str, TurnResult] = field(default_factory=dict)  # API and body hash -> the recorded turn
    running: dict[str, anyio.Event] = field(default_factory=dict)  # body hash -> set when answered
    lock: anyio.Lock = field(default_factory=anyio.Lock)  # one turn at a time: the ledger is a sequence


@dataclass(frozen=True)
class SessionRecord:
    """An ended session: its name, its ledger and the ledger's counts."""

    name: str
    ledger: Ledger
    stats: LedgerStats
    limited: bool = False  # a turn was refused for a limit (the session's max_turns, or the context)
    failed: bool = False  # a turn failed on the infrastructure's side (a 5xx: the engine or the sandbox)
    last_finish: str = ""  # why its last sampled turn ended ("stop", "length", "tool_calls"; "": none sampled)


class Gateway:
    """``await tg.start(gateway.run)``; then ``open_session(name)`` for each episode, ``end_session(key)`` after."""

    def __init__(self, config: GatewayConfig, engine_for: Callable[[str], Engine], tokenizer: ChatTokenizer, *,
                 on_end: Callable[[SessionRecord], None] | None = None,
                 wait_routable: Callable[[float], Awaitable[float]] | None = None) -> None:
        self.config = config
        self._on_end = on_end  # called with each session ended through the session routes
        self._engine_for = engine_for
        # the engines' outage wait (Engines.wait_routable: seconds to wait at most -> seconds waited); None: a failed
        # engine call is a 503 at once
        self._wait_routable = wait_routable
        self._tok = tokenizer
        self._sessions: dict[str, _Session] = {}
        self._ended: set[str] = set()
        self._watched: dict[anyio.CancelScope, Request] = {}  # the running turns the watcher looks at
        self._counts = {"requests": 0, "replayed": 0, "rejected": 0, "engine_failures": 0, "disconnected": 0,
                        "engine_retries": 0}
        self.url = ""

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen on config.host:port until cancelled (``url`` is set once started)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.port))
        sock.listen(4096)
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}/v1"
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_disconnects, name="gateway disconnect watcher")
            await serve_http(self.app(), sock, task_status=task_status)
            tg.cancel_scope.cancel()

    def open_session(self, name: str, workspace: Workspace | None = None, *, max_turns: int = 0) -> str:
        """A new session for one episode (``workspace``: where its commands run; ``max_turns``: its turns at most,
        a turn past them refused with a 400 ``turn_limit_reached``, which ends a CLI agent's run); its key (the
        harness's API key)."""
        key = "sk-swectl-" + secrets.token_urlsafe(24)
        self._sessions[key] = _Session(key=key, name=name, workspace=workspace, max_turns=max_turns)
        return key

    def end_session(self, key: str) -> SessionRecord:
        """Close the session (later requests with its key get 409) and hand back its ledger."""
        session = self._sessions.pop(key)
        session.ended = True
        self._ended.add(key)
        return SessionRecord(name=session.name, ledger=session.ledger, stats=session.ledger.stats(),
                             limited=session.limited, failed=session.failed, last_finish=session.last_finish)

    def statistics(self) -> GatewayStatistics:
        return GatewayStatistics(sessions_open=len(self._sessions), sessions_ended=len(self._ended), **self._counts)

    # ------------------------------------------------------------------ HTTP

    def app(self) -> Starlette:
        chat, anthropic, openai_responses = self._endpoint(CHAT), self._endpoint(MESSAGES), self._endpoint(RESPONSES)
        return Starlette(routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/chat/completions", chat, methods=["POST"]),
            Route("/v1/messages", anthropic, methods=["POST"]),
            Route("/v1/messages/count_tokens", self._count_tokens, methods=["POST"]),
            Route("/v1/responses", openai_responses, methods=["POST"]),
            Route("/responses", openai_responses, methods=["POST"]),
            # Claude Code checks that its base URL answers (HEAD /) before its first turn
            Route("/", self._root, methods=["GET", "HEAD"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/models", self._models, methods=["GET"]),
            Route("/swectl/v1/exec", self._exec, methods=["POST"]),
            Route("/swectl/v1/sessions", self._open, methods=["POST"]),
            Route("/swectl/v1/sessions/end", self._end, methods=["POST"]),
        ])

    def _admin(self, request: Request) -> None:
        token = self.config.admin_token
        auth = request.headers.get("authorization", "")
        if not token:
            raise _HttpError(404, "this gateway opens its sessions itself (no admin token)", "invalid_request_error")
        if not (auth.lower().startswith("bearer ") and hmac.compare_digest(auth[7:].strip(), token)):
            raise _HttpError(401, "the session routes need the gateway's admin token", "authentication_error",
                             "invalid_api_key")

    async def _open(self, request: Request) -> Response:
        """``POST /swectl/v1/sessions`` ``{"name": ...}`` (admin token): a new session; ``{"key", "name"}``."""
        try:
            self._admin(request)
            body = self._decode(await request.body() or b"{}", SessionBody, "session")
            name = body.name or f"session-{len(self._sessions) + len(self._ended)}"
        except _HttpError as exc:
            return self._error(CHAT, exc)
        return _json(200, {"key": self.open_session(name), "name": name})

    async def _end(self, request: Request) -> Response:
        """``POST /swectl/v1/sessions/end`` ``{"key": ...}`` (admin token): the session ended, its ledger handed to
        ``on_end``; its counts."""
        try:
            self._admin(request)
            body = self._decode(await request.body(), SessionBody, "session")
            if body.key not in self._sessions:
                raise _HttpError(409 if body.key in self._ended else 404, "no open session has this key",
                                 "invalid_request_error", "session_ended" if body.key in self._ended else None)
        except _HttpError as exc:
            return self._error(CHAT, exc)
        record = self.end_session(body.key)
        if self._on_end is not None:
            self._on_end(record)
        return _json(200, {"name": record.name, **msgspec.structs.asdict(record.stats)})

    async def _exec(self, request: Request) -> Response:
        try:
            session = self._session_of(request)
            if session.workspace is None:
                raise _HttpError(409, "this session has no workspace to run commands in", "invalid_request_error",
                                 "no_workspace")
            body = self._decode(await request.body(), ExecBody, "exec")
            timeout = min(max(body.timeout, 1.0), self.config.exec_timeout_s)
            session.commands += 1
            try:
                with anyio.fail_after(timeout + 120):  # the sandbox bounds the command; this bounds the transport
                    result = await session.workspace.exec(body.command, timeout, cwd=body.cwd or None,
                                                          env=body.env or None)
            except (InfraError, TimeoutError) as exc:
                raise _HttpError(503, f"the sandbox failed: {exc}", "server_error", "sandbox_unavailable") from exc
        except _HttpError as exc:
            return self._error(CHAT, exc)
        return _json(200, {"output": result.output, "returncode": -1 if result.timed_out else result.exit_code,
                           "exception_info": f"the command timed out after {timeout:g} s" if result.timed_out
                           else ""})

    async def _root(self, request: Request) -> Response:
        """``GET /`` and ``HEAD /``: the gateway is there (no key needed; it says nothing but its name)."""
        return _json(200, {"service": "swectl gateway"})

    async def _models(self, request: Request) -> Response:
        try:
            self._session_of(request)
        except _HttpError as exc:
            return self._error(CHAT, exc)
        return _json(200, models_body([self.config.model]))

    def _endpoint(self, api: _Api) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await self._serve(api, request)

        return endpoint

    async def _serve(self, api: _Api, request: Request) -> Response:
        """One turn asked for through ``api``: the session by key, the body decoded into a turn, the turn answered
        once (a retry of the same body gets the recorded turn), then formatted in the API's shape."""
        self._counts["requests"] += 1
        session: _Session | None = None
        try:
            session = self._session_of(request)
            raw = await self._body(request)
            body = self._decode(raw, api.request, api.name)
            turn = self._turn_of(api.turn, body)
            # a retry is the same turn again, not the same bytes: Codex 0.171's reconnects re-serialise
            # client_metadata (a map) in another key order, and that field is not part of the turn
            digest = hashlib.sha256(api.name.encode() + b"\n" + _JSON.encode(turn)).hexdigest()
            self._check_turn_limit(session, digest)
            if body.stream:  # checked and rendered before the 200, so a request the turn cannot take stays a 4xx
                prompt = self._checked_prompt(turn)
                return _KeptAliveStream(lambda: self._streamed(api, body, session, digest, turn, prompt),
                                        self.config.stream_keepalive_s, self._disconnected)
            result = await self._unless_disconnected(request, self._answer_once(session, digest, turn))
            if result is None:  # the client went away: its generation was cancelled, nothing recorded
                return Response(status_code=499)
            answer = api.answer(body, result, self.config.model)
        except _HttpError as exc:
            _mark(session, exc)
            return self._error(api, exc)
        except Exception as exc:  # a fault of the gateway's own: said in the API's shape, and logged whole
            _log.exception("gateway: %s %s failed", request.method, request.url.path)
            return self._error(api, _own_fault(exc))
        return _json(200, answer)

    async def _streamed(self, api: _Api, body: Any, session: _Session, digest: str, turn: TurnRequest,
                        prompt: list[int]) -> list[bytes]:
        """A streamed turn's events, once it is answered; a failure after the stream opened is an ``error`` event
        carrying the API's error body (each SDK raises it as the error it would have raised for the status)."""
        try:
            result = await self._answer_once(session, digest, turn, prompt)
            return api.events(api.answer(body, result, self.config.model))
        except _HttpError as exc:
            failed = exc
        except Exception as exc:
            _log.exception("gateway: a streamed %s turn failed", api.name)
            failed = _own_fault(exc)
        _mark(session, failed)
        self._count_refusal(failed)
        return [b"event: error\ndata: " + _JSON.encode(api.error(failed)) + b"\n\n"]

    def _disconnected(self) -> None:
        self._counts["disconnected"] += 1

    async def _count_tokens(self, request: Request) -> Response:
        """``POST /v1/messages/count_tokens``: the prompt rendered as a turn would render it, counted; nothing is
        sampled or recorded."""
        try:
            self._session_of(request)
            body = self._decode(await self._body(request), messages.CountTokensRequest, "count_tokens")
            turn = self._turn_of(messages.count_turn, body)
            self._check_model(turn)
            prompt = self._render(turn)
        except _HttpError as exc:
            return self._error(MESSAGES, exc)
        return _json(200, {"input_tokens": len(prompt)})

    async def _body(self, request: Request) -> bytes:
        raw = await request.body()
        if len(raw) > self.config.max_body_bytes:
            raise _HttpError(413, f"the body is over {self.config.max_body_bytes} bytes", "invalid_request_error")
        return raw

    @staticmethod
    def _decode(raw: bytes, kind: type[Any], name: str) -> Any:
        try:
            return msgspec.json.decode(raw, type=kind)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _HttpError(400, f"malformed {name} request: {exc}", "invalid_request_error") from exc

    @staticmethod
    def _turn_of(decode: Callable[[Any], TurnRequest], body: Any) -> TurnRequest:
        try:
            return decode(body)
        except ValueError as exc:  # the decoders' word for a request they cannot take
            raise _HttpError(400, str(exc), "invalid_request_error") from exc

    async def _unless_disconnected(self, request: Request, turn: Awaitable[TurnResult]) -> TurnResult | None:
        """The turn's answer, or None when the client disconnects first: the disconnect watcher (``run``) then
        cancels it, which closes its generation's request to the engine, and the ledger records nothing of it. The
        turn runs in the request's own task (a task of its own per turn cost ~0.08 ms a request)."""
        scope = anyio.CancelScope()
        self._watched[scope] = request
        try:
            with scope:
                return await turn
        finally:
            self._watched.pop(scope, None)
        return None  # the watcher cancelled the turn: the client went away

    async def _watch_disconnects(self) -> None:
        """Every DISCONNECT_POLL_S, each running (non-streamed) turn whose client has gone is cancelled."""
        while True:
            await anyio.sleep(DISCONNECT_POLL_S)
            for scope, request in list(self._watched.items()):
                try:
                    gone = not scope.cancel_called and await request.is_disconnected()
                except Exception:  # a request the server has already closed: it is not a client gone away
                    _log.debug("gateway: the disconnect check of %s failed", request.url.path, exc_info=True)
                    continue
                if gone:
                    self._counts["disconnected"] += 1
                    scope.cancel()

    def _session_of(self, request: Request) -> _Session:
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not key:
            raise _HttpError(401, "no API key: each episode's key is its session", "authentication_error",
                             "invalid_api_key")
        if key in self._ended:
            raise _HttpError(409, "this episode has ended", "invalid_request_error", "session_ended")
        for known, session in self._sessions.items():
            if hmac.compare_digest(known, key):
                return session
        raise _HttpError(401, "unknown API key", "authentication_error", "invalid_api_key")

    def _error(self, api: _Api, exc: _HttpError) -> Response:
        self._count_refusal(exc)
        return _json(exc.status, api.error(exc))

    def _count_refusal(self, exc: _HttpError) -> None:
        self._counts["engine_failures" if exc.status >= 500 else "rejected"] += 1

    # ------------------------------------------------------------------ one turn

    async def _answer_once(self, session: _Session, digest: str, turn: TurnRequest,
                           prompt: list[int] | None = None) -> TurnResult:
        """The turn ``digest`` asks for: recorded (a retry), awaited (a retry of a request in flight), or made now."""
        if digest in session.answers:
            self._counts["replayed"] += 1
            return session.answers[digest]
        if digest in session.running:
            with anyio.fail_after(self.config.request_timeout_s):
                await session.running[digest].wait()
            if digest in session.answers:
                self._counts["replayed"] += 1
                return session.answers[digest]
        done = session.running[digest] = anyio.Event()
        try:
            async with session.lock:
                if session.ended:
                    raise _HttpError(409, "this episode has ended", "invalid_request_error", "session_ended")
                result = await self._turn(session, turn, prompt)
            session.answers[digest] = result
            return result
        finally:
            session.running.pop(digest, None)
            done.set()

    @staticmethod
    def _check_turn_limit(session: _Session, digest: str) -> None:
        """A new turn past the session's ``max_turns`` is refused (a retry of a recorded one is not)."""
        if not session.max_turns or digest in session.answers or digest in session.running:
            return
        if session.ledger.turns >= session.max_turns:
            session.limited = True
            raise _HttpError(400, f"this episode's turn limit ({session.max_turns}) is reached",
                             "invalid_request_error", "turn_limit_reached")

    def _seed(self, session: _Session, turn: TurnRequest) -> int | None:
        """The request's own seed; else, with ``config.seed``, one per (session name, turn) as swectl's agent loop
        seeds its turns (the same episodes run after run); else None (fresh randomness)."""
        if turn.seed is not None or self.config.seed is None:
            return turn.seed
        return request_seed(self.config.seed, session.name, session.ledger.turns)

    def _checked_prompt(self, turn: TurnRequest) -> list[int]:
        """The turn's model checked and its prompt rendered, with room in the context for a reply."""
        cfg = self.config
        self._check_model(turn)
        prompt = self._render(turn)
        if len(prompt) >= cfg.context_tokens:
            raise _HttpError(400, f"prompt is too long: {len(prompt)} tokens > {cfg.context_tokens - 1} maximum "
                             f"(the context holds {cfg.context_tokens} tokens, prompt and reply)",
                             "invalid_request_error", "context_length_exceeded")
        return prompt

    async def _turn(self, session: _Session, turn: TurnRequest, prompt: list[int] | None = None) -> TurnResult:
        """Render, clamp, sample, record, decode: the one turn path of every API (``prompt``: already checked and
        rendered, by a streamed turn)."""
        cfg = self.config
        if prompt is None:
            prompt = self._checked_prompt(turn)
        room = cfg.context_tokens - len(prompt)
        sampling = SamplingParams(max_new_tokens=min(turn.max_tokens or cfg.max_tokens, room),
                                  temperature=cfg.temperature if turn.temperature is None else turn.temperature,
                                  top_p=1.0 if turn.top_p is None else turn.top_p, stop=turn.stop,
                                  sampling_seed=self._seed(session, turn))
        turn_id = new_id()
        try:
            with anyio.fail_after(cfg.request_timeout_s):
                result = await self._sample(session, GenerateRequest(input_ids=prompt, sampling_params=sampling,
                                                                     rid=f"gateway-{turn_id}"))
        except (EngineError, InfraError, TimeoutError) as exc:
            raise _HttpError(503, f"the engine failed: {exc}", "server_error", "engine_unavailable") from exc
        if result.finish_reason == "abort":
            raise _HttpError(503, f"the engine aborted the request: {result.finish_message or ''}", "server_error",
                             "engine_aborted")
        # placed in the ledger only once sampled: a failed or cancelled turn leaves no trace in it
        branch = session.ledger.prompt(prompt)
        session.ledger.completion(branch, list(result.output_ids), list(result.output_logprobs),
                                  result.weight_version)
        text = self._tok.decode(list(result.output_ids), skip_special_tokens=True)
        content, calls = split_tool_calls(text) if turn.tools else (text, [])
        finish = "tool_calls" if calls else ("length" if result.finish_reason == "length" else "stop")
        session.last_finish = finish
        matched = result.matched_stop
        stop_sequence = matched if isinstance(matched, str) and turn.stop and matched in turn.stop else None
        return TurnResult(id=turn_id, created=now(), content=content, tool_calls=calls, finish=finish,
                          stop_sequence=stop_sequence if finish == "stop" else None,
                          prompt_tokens=len(prompt), completion_tokens=len(result.output_ids))

    async def _sample(self, session: _Session, request: GenerateRequest) -> GenerateResult:
        """The engine's answer to ``request``; with ``wait_routable``, a failed server's request is asked again of
        a routable one (after a pause that grows from ``engine_retry_pause_s`` to 8 s, so that a failure the engines
        have not noticed yet is not asked again at once), until the caller's deadline. A failed try recorded nothing."""
        pause = self.config.engine_retry_pause_s
        while True:
            try:
                return await self._engine_for(session.name).generate(request)
            except (EngineError, InfraError) as exc:
                if self._wait_routable is None:
                    raise
                _log.warning("gateway: the engine failed a turn of %s (%s): asking a routable server again",
                             session.name, exc)
            self._counts["engine_retries"] += 1
            await anyio.sleep(pause)
            pause = min(2 * pause, 8.0)
            await self._wait_routable(self.config.request_timeout_s)  # the turn's deadline bounds it too

    def _check_model(self, turn: TurnRequest) -> None:
        if turn.model != self.config.model:
            raise _HttpError(404, f"model {turn.model!r} is not served here (this gateway serves "
                             f"{self.config.model!r})", "invalid_request_error", "model_not_found")

    def _render(self, turn: TurnRequest) -> list[int]:
        kwargs: dict[str, Any] = {"tokenize": True, "add_generation_prompt": True}
        if turn.tools:
            kwargs["tools"] = turn.tools
        try:
            rendered = self._tok.apply_chat_template(turn.messages, **kwargs)
        except Exception as exc:  # a template error is the request's: say what it was
            raise _HttpError(400, f"the chat template cannot render these messages: {exc}",
                             "invalid_request_error") from exc
        return rendered_ids(rendered)


def _json(status: int, body: dict[str, Any]) -> Response:
    return Response(_JSON.encode(body), status_code=status, media_type="application/json")
