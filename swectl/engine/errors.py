"""Errors of the inference-engine clients (swectl.engine.client), under InfraError.

    InfraError
    +-- EngineError                  an inference engine (SGLang, the CPU engine, an OpenAI endpoint) failed
        +-- EngineUnavailableError   unreachable, refused, reset mid-request, 5xx, 429: the engine may come back
        |   +-- EngineConnectError   nothing accepted the connection (refused, unknown host, unreachable)
        |   +-- EngineTimeoutError   no complete answer within the call's time bound
        +-- EngineResponseError      an answer that is not the protocol (bad JSON, missing or mistyped fields)
        +-- EngineRejectedError      the engine refused the request (4xx, or ``success: false``)

Every message names the engine's URL and the endpoint; response errors quote the first 300 characters
of the body. None of these is ever a reward: an episode that meets one is ABORTED (DESIGN 4.5).
"""

from __future__ import annotations

from swectl.errors import InfraError

BODY_QUOTE_CHARS = 300


def quote_body(body: bytes | str) -> str:
    """The first BODY_QUOTE_CHARS characters of a response body, for error messages."""
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    shown = text[:BODY_QUOTE_CHARS]
    return repr(shown) + (f" (+{len(text) - BODY_QUOTE_CHARS} chars)" if len(text) > BODY_QUOTE_CHARS else "")


class EngineError(InfraError):
    """An inference engine failed; ``url`` is the engine's."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"engine {url}: {message}")
        self.url = url


class EngineUnavailableError(EngineError):
    """The engine could not be reached or failed on its side; trying again later may work."""


class EngineConnectError(EngineUnavailableError):
    """Nothing accepted the connection: refused (no server on that port), unknown host, network unreachable."""


class EngineTimeoutError(EngineUnavailableError):
    """No complete answer within the call's time bound (``timeout_s``)."""

    def __init__(self, url: str, message: str, timeout_s: float) -> None:
        super().__init__(url, message)
        self.timeout_s = timeout_s


class EngineResponseError(EngineError):
    """The engine answered, but not in the protocol; carries the start of the body."""

    def __init__(self, url: str, message: str, body: bytes | str) -> None:
        super().__init__(url, f"{message}; body: {quote_body(body)}")
        self.body_head = (body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body)[
            :BODY_QUOTE_CHARS
        ]


class EngineRejectedError(EngineError):
    """The engine refused the request (bad input, auth, a weight update that failed on its side)."""

    def __init__(self, url: str, message: str, status: int, detail: str) -> None:
        super().__init__(url, f"{message} (HTTP {status}): {detail}")
        self.status = status
        self.detail = detail
