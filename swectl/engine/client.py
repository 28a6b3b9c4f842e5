"""Clients of the inference engines (docs/architecture.md 5.2): SGLang's native HTTP API and OpenAI-compatible chat.

``SglangClient`` speaks the subset of SGLang's HTTP API that swectl needs: ``/generate`` with token ids and
logprobs, ``/health``, ``/health_generate``, ``/flush_cache``, ``/update_weights_from_disk``,
``/get_model_info``, ``/get_weight_version``, ``/pause_generation`` and ``/continue_generation``. The CPU
engine (``python -m swectl.remote.programs.cpu_engine``) serves the same subset. ``OpenAIChatClient`` talks to any
OpenAI-compatible ``/v1/chat/completions`` (eval against external endpoints).

Both run on httpx.AsyncClient under anyio (asyncio or trio). Every call has one total time bound (the
client's ``timeout_s`` unless the call passes its own), enforced with ``anyio.fail_after`` around the whole
exchange, plus a short connect bound. Failures are translated (swectl.errors):

- refused / reset / closed mid-request, 5xx, 429          -> EngineUnavailableError
  (nothing accepted the connection at all                   -> EngineConnectError, an EngineUnavailableError)
- no complete answer within the bound                       -> EngineTimeoutError (an EngineUnavailableError)
- other 4xx, or a weight update answering ``success: false`` -> EngineRejectedError
- an answer that is not JSON or lacks fields we need        -> EngineResponseError (quotes 300 chars of body)

Only idempotent calls are retried (docs/architecture.md 12.2): the GETs and ``/flush_cache``, on connection failures and
5xx, within the same total bound. ``generate``, weight updates, pause/continue and chat are never retried.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Self, TypeVar

import anyio
import httpx
import msgspec

from swectl.engine.wire import (
    ChatMessage,
    ChatRequest,
    ChatResult,
    DestroyWeightsUpdateGroupRequest,
    EngineInfo,
    GenerateRequest,
    GenerateResult,
    GetWeightsByNameRequest,
    InitWeightsUpdateGroupRequest,
    PauseGenerationRequest,
    PauseMode,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsResult,
    decode_body,
    decode_chat_response,
    decode_generate_response,
)
from swectl.errors import (
    EngineConnectError,
    EngineRejectedError,
    EngineResponseError,
    EngineTimeoutError,
    EngineUnavailableError,
    quote_body,
)

T = TypeVar("T")

HEALTH_TIMEOUT_S = 10.0
IDEMPOTENT_RETRIES = 2
RETRY_BACKOFF_S = 0.2
_JSON = {"content-type": "application/json"}


class _ErrorBody(msgspec.Struct):
    """The error bodies engines send: SGLang/OpenAI ``{"error": {"message"}}`` or ``{"message"}`` or FastAPI's."""

    error: dict[str, object] | str | None = None
    message: str | None = None
    detail: object = None


class _WeightVersion(msgspec.Struct):
    weight_version: str | int | None = None


def _error_detail(body: bytes) -> str:
    try:
        parsed = msgspec.json.decode(body, type=_ErrorBody)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return quote_body(body)
    if isinstance(parsed.error, dict) and parsed.error.get("message"):
        return str(parsed.error["message"])
    if isinstance(parsed.error, str):
        return parsed.error
    if parsed.message:
        return parsed.message
    if parsed.detail is not None:
        return str(parsed.detail)
    return quote_body(body)


class _Http:
    """One httpx.AsyncClient, a total time bound per call, and the error translation shared by both clients."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        connect_timeout_s: float,
        api_key: str | None,
        max_connections: int,
        trust_env: bool,
    ) -> None:
        if not (timeout_s > 0 and connect_timeout_s > 0):
            raise ValueError("timeout_s and connect_timeout_s must be positive")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            # The total bound is fail_after's; httpx only bounds connecting, so a dead host fails fast.
            timeout=httpx.Timeout(None, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            trust_env=trust_env,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def call(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        timeout_s: float | None = None,
        retries: int = 0,
    ) -> httpx.Response:
        """One exchange, or up to ``retries`` more on connection failures / 5xx, all within one bound."""
        bound = self.timeout_s if timeout_s is None else timeout_s
        deadline = anyio.current_time() + bound
        for attempt in range(retries + 1):
            try:
                return await self._once(method, path, body, deadline - anyio.current_time(), bound)
            except EngineTimeoutError:
                raise
            except EngineUnavailableError:
                pause = RETRY_BACKOFF_S * 2**attempt
                if attempt == retries or anyio.current_time() + pause >= deadline:
                    raise
                await anyio.sleep(pause)
        raise AssertionError("unreachable")

    async def _once(self, method: str, path: str, body: bytes | None, left_s: float, bound: float) -> httpx.Response:
        where = f"{method} {path}"
        try:
            with anyio.fail_after(max(left_s, 0.0)):
                response = await self._client.request(method, path, content=body, headers=_JSON if body else None)
        except TimeoutError as exc:
            raise EngineTimeoutError(self.base_url, f"{where}: no answer within {bound:g} s", bound) from exc
        except httpx.TimeoutException as exc:  # the connect bound
            raise EngineTimeoutError(self.base_url, f"{where}: {type(exc).__name__} (connect bound)", bound) from exc
        except httpx.ConnectError as exc:
            raise EngineConnectError(self.base_url, f"{where}: {type(exc).__name__}: {exc}") from exc
        except httpx.TransportError as exc:
            raise EngineUnavailableError(self.base_url, f"{where}: {type(exc).__name__}: {exc}") from exc
        status = response.status_code
        if status >= 500 or status == 429:
            raise EngineUnavailableError(self.base_url, f"{where}: HTTP {status}: {quote_body(response.content)}")
        if status >= 400:
            raise EngineRejectedError(self.base_url, where, status, _error_detail(response.content))
        return response

    def decode(self, response: httpx.Response, kind: type[T], what: str) -> T:
        return decode_body(response.content, kind, url=self.base_url, what=what)


class _Client:
    """What both clients share: one HTTP connection pool, closed by ``aclose()`` or by leaving ``async with``."""

    _http: _Http

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    @property
    def base_url(self) -> str:
        return self._http.base_url

    async def aclose(self) -> None:
        await self._http.aclose()

    async def probe(self, path: str, *, timeout_s: float | None = None) -> None:
        """One ``GET path``, never retried; returns when the server answered below 500. Raises
        EngineConnectError when nothing accepts the connection, EngineUnavailableError when the server is
        not ready (5xx, 429, no answer, not HTTP) and EngineRejectedError for a 4xx."""
        await self._http.call("GET", path, timeout_s=timeout_s)

    async def _probe(self, path: str, timeout_s: float | None) -> bool:
        """``GET path`` (retried, within HEALTH_TIMEOUT_S unless given): True when the engine answers below 500; False
        when it is unreachable or not ready."""
        bound = min(self._http.timeout_s, HEALTH_TIMEOUT_S) if timeout_s is None else timeout_s
        try:
            await self._http.call("GET", path, timeout_s=bound, retries=IDEMPOTENT_RETRIES)
        except EngineUnavailableError:
            return False
        return True


class SglangClient(_Client):
    """SGLang's native HTTP API (and the CPU engine's copy of it). Use as ``async with`` or call aclose()."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        api_key: str | None = None,
        max_connections: int = 256,
    ) -> None:
        self._http = _Http(
            base_url,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            api_key=api_key,
            max_connections=max_connections,
            trust_env=False,
        )
        self._encoder = msgspec.json.Encoder()

    async def generate(self, request: GenerateRequest, *, timeout_s: float | None = None) -> GenerateResult:
        """``POST /generate`` with token ids; never retried (not idempotent: it costs a generation)."""
        started = time.perf_counter()
        response = await self._http.call("POST", "/generate", body=self._encoder.encode(request), timeout_s=timeout_s)
        return decode_generate_response(
            response.content,
            url=self.base_url,
            return_logprob=request.return_logprob,
            client_latency_s=time.perf_counter() - started,
        )

    async def health(self, *, timeout_s: float | None = None) -> bool:
        """``GET /health``: True when the engine answers 200; False when it is unreachable or not ready."""
        return await self._probe("/health", timeout_s)

    async def health_generate(self, *, timeout_s: float | None = None) -> bool:
        """``GET /health_generate``: like health, but the engine proves it by generating one token."""
        return await self._probe("/health_generate", timeout_s)

    async def flush_cache(self, *, timeout_s: float | None = None) -> bool:
        """``POST /flush_cache``. False when the engine declined (SGLang only flushes while idle: HTTP 400)."""
        try:
            await self._http.call("POST", "/flush_cache", timeout_s=timeout_s, retries=IDEMPOTENT_RETRIES)
        except EngineRejectedError as exc:
            if exc.status == 400:
                return False
            raise
        return True

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        """``POST /update_weights_from_disk``: load new weights from a folder on the engine's machine.

        SGLang waits for in-flight requests unless ``abort_all_requests`` (or a pause) says otherwise. Raises
        EngineRejectedError with the engine's message when the update failed (wrong path, other shapes)."""
        request = UpdateWeightsFromDiskRequest(
            model_path=model_path,
            load_format=load_format,
            abort_all_requests=abort_all_requests,
            weight_version=weight_version,
            flush_cache=flush_cache,
        )
        response = await self._http.call(
            "POST", "/update_weights_from_disk", body=self._encoder.encode(request), timeout_s=timeout_s
        )
        result = self._http.decode(response, UpdateWeightsResult, "/update_weights_from_disk")
        if not result.success:
            raise EngineRejectedError(
                self.base_url, "POST /update_weights_from_disk", response.status_code, result.message
            )

    async def init_weights_update_group(self, request: InitWeightsUpdateGroupRequest, *,
                                        timeout_s: float | None = None) -> None:
        """``POST /init_weights_update_group``: join the trainer's weight group; returns once the whole group has
        formed (the trainer joins meanwhile). Raises EngineRejectedError with the engine's message."""
        await self._weights_call("/init_weights_update_group", self._encoder.encode(request), timeout_s)

    async def update_weights_from_distributed(self, request: UpdateWeightsFromDistributedRequest, *,
                                              timeout_s: float | None = None) -> None:
        """``POST /update_weights_from_distributed``: receive one bucket of tensors from the weight group (the
        trainer broadcasts it meanwhile) and load it."""
        await self._weights_call("/update_weights_from_distributed", self._encoder.encode(request), timeout_s)

    async def destroy_weights_update_group(self, group_name: str, *, timeout_s: float | None = None) -> None:
        body = self._encoder.encode(DestroyWeightsUpdateGroupRequest(group_name=group_name))
        await self._weights_call("/destroy_weights_update_group", body, timeout_s)

    async def get_weights_by_name(self, name: str, truncate_size: int = 100, *,
                                  timeout_s: float | None = None) -> list:
        """``POST /get_weights_by_name``: the first values of a parameter, as nested lists (for checks)."""
        body = self._encoder.encode(GetWeightsByNameRequest(name=name, truncate_size=truncate_size))
        response = await self._http.call("POST", "/get_weights_by_name", body=body, timeout_s=timeout_s,
                                         retries=IDEMPOTENT_RETRIES)
        return self._http.decode(response, list, "/get_weights_by_name")

    async def _weights_call(self, path: str, body: bytes, timeout_s: float | None) -> None:
        response = await self._http.call("POST", path, body=body, timeout_s=timeout_s)
        result = self._http.decode(response, UpdateWeightsResult, path)
        if not result.success:
            raise EngineRejectedError(self.base_url, f"POST {path}", response.status_code, result.message)

    async def get_model_info(self, *, timeout_s: float | None = None) -> EngineInfo:
        response = await self._http.call("GET", "/get_model_info", timeout_s=timeout_s, retries=IDEMPOTENT_RETRIES)
        return self._http.decode(response, EngineInfo, "/get_model_info")

    async def get_weight_version(self, *, timeout_s: float | None = None) -> str:
        response = await self._http.call("GET", "/get_weight_version", timeout_s=timeout_s, retries=IDEMPOTENT_RETRIES)
        version = self._http.decode(response, _WeightVersion, "/get_weight_version").weight_version
        if version is None:
            raise EngineResponseError(self.base_url, "/get_weight_version: weight_version is null", response.content)
        return str(version)

    async def pause_generation(self, mode: PauseMode = "abort", *, timeout_s: float | None = None) -> None:
        """``POST /pause_generation``: "abort" ends in-flight requests (finish_reason "abort"); "in_place" and
        "retract" hold them until continue_generation (retract recomputes their KV cache on resume)."""
        body = self._encoder.encode(PauseGenerationRequest(mode=mode))
        await self._http.call("POST", "/pause_generation", body=body, timeout_s=timeout_s)

    async def continue_generation(self, *, timeout_s: float | None = None) -> None:
        await self._http.call("POST", "/continue_generation", body=b"{}", timeout_s=timeout_s)


def chat_path(base_url: str) -> str:
    """Where chat completions live under ``base_url``: given as ``http://host:port`` or ``.../v1``."""
    return "/chat/completions" if base_url.rstrip("/").endswith("/v1") else "/v1/chat/completions"


def models_path(base_url: str) -> str:
    """Where the model list lives under ``base_url`` (a cheap GET to see that the endpoint answers)."""
    return "/models" if base_url.rstrip("/").endswith("/v1") else "/v1/models"


class OpenAIChatClient(_Client):
    """Any OpenAI-compatible endpoint (OpenAI, SGLang, vLLM, the CPU engine); the environment's proxies apply."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_connections: int = 256,
    ) -> None:
        self.model = model
        self._http = _Http(
            base_url,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            api_key=api_key,
            max_connections=max_connections,
            trust_env=True,
        )
        self._path = chat_path(base_url)
        self._encoder = msgspec.json.Encoder()

    async def chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
        timeout_s: float | None = None,
    ) -> ChatResult:
        """One chat completion (never retried: a 429 or 5xx surfaces as EngineUnavailableError)."""
        if max_tokens < 1 or not math.isfinite(temperature) or temperature < 0:
            raise ValueError("max_tokens must be >= 1 and temperature a finite number >= 0")
        request = ChatRequest(
            model=self.model,
            messages=list(messages),
            max_tokens=max_tokens,
            temperature=temperature,
            stop=list(stop) if stop else None,
            seed=seed,
        )
        started = time.perf_counter()
        response = await self._http.call("POST", self._path, body=self._encoder.encode(request), timeout_s=timeout_s)
        return decode_chat_response(
            response.content, url=self._http.base_url, model=self.model, latency_s=time.perf_counter() - started
        )
