"""The OpenAI chat-completions shapes the gateway reads and writes (the subset harnesses send), its error shape, and
the policy family's tool calls parsed out of a completion (Qwen3: ``<tool_call>{json}</tool_call>``).

Requests are decoded leniently where harnesses differ (content as a string or a list of parts, ``max_tokens`` or
``max_completion_tokens``, unknown keys ignored) and strictly where a wrong value would change the sample
(``n`` > 1 is refused: one episode, one completion per turn).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal

import msgspec


class ChatMessageIn(msgspec.Struct, kw_only=True):
    """One message of a request: content as a string, a list of parts, or null (an assistant's tool calls)."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(p.get("text", "")) for p in self.content if p.get("type", "text") == "text")
        return self.content or ""


class ChatCompletionRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/chat/completions``."""

    model: str
    messages: list[ChatMessageIn]
    tools: list[dict[str, Any]] | None = None
    stream: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    n: int = 1
    seed: int | None = None


def template_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as a Hugging Face chat template takes them (tool-call arguments as objects)."""
    out: list[dict[str, Any]] = []
    for m in request.messages:
        item: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            calls = []
            for call in m.tool_calls:
                function = dict(call.get("function") or {})
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        function["arguments"] = json.loads(arguments)
                    except ValueError:
                        pass  # the template renders the string as it is
                calls.append({**call, "function": function})
            item["tool_calls"] = calls
        if m.tool_call_id:
            item["tool_call_id"] = m.tool_call_id
        if m.name:
            item["name"] = m.name
        out.append(item)
    return out


# ------------------------------------------------------------------------------------------------- tool calls

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Qwen3's tool calls in a completion: the text outside them, and each call in the OpenAI shape (``id``, type
    ``function``, ``function.name``, ``function.arguments`` as a JSON string). A block that is not a JSON object with
    a name stays in the text."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        arguments = body.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": body["name"],
                                   "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
    kept.append(text[last:])
    return ("".join(kept).strip() if calls else text), calls


# ------------------------------------------------------------------------------------------------- answers

FinishReason = Literal["stop", "length", "tool_calls"]


def completion_body(*, model: str, content: str, tool_calls: list[dict[str, Any]], finish_reason: FinishReason,
                    prompt_tokens: int, completion_tokens: int, request_id: str) -> dict[str, Any]:
    """A non-streaming ``chat.completion``."""
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if tool_calls else "")}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def completion_chunks(body: dict[str, Any]) -> list[bytes]:
    """The same answer as server-sent events of ``chat.completion.chunk``s: the role, the content, each tool call,
    the finish reason with the usage, then ``[DONE]``."""
    head = {k: body[k] for k in ("id", "created", "model")}
    choice = body["choices"][0]
    message = choice["message"]

    def event(delta: dict[str, Any], finish: str | None = None, usage: dict[str, int] | None = None) -> bytes:
        chunk: dict[str, Any] = {**head, "object": "chat.completion.chunk",
                                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        if usage is not None:
            chunk["usage"] = usage
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    events = [event({"role": "assistant", "content": ""})]
    if message.get("content"):
        events.append(event({"content": message["content"]}))
    for i, call in enumerate(message.get("tool_calls") or []):
        events.append(event({"tool_calls": [{"index": i, **call}]}))
    events.append(event({}, choice["finish_reason"], body["usage"]))
    events.append(b"data: [DONE]\n\n")
    return events


def error_body(message: str, kind: str, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def models_body(names: list[str]) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "swectl"}
                                       for n in names]}
