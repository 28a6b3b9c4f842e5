"""What the gateway's three APIs share, and the OpenAI chat-completions shapes.

Every API's request becomes one ``TurnRequest`` (the messages and tools as a Hugging Face chat template takes them,
and the sampling settings); the gateway renders it, samples it and records it the same way whatever the API, and
answers with one ``TurnResult`` (the decoded text, the policy family's tool calls parsed out of it, why it ended,
the token counts), which each API formats in its own shape: chat completions here, Anthropic's Messages API in
``messages.py``, OpenAI's Responses API in ``responses.py``. All of it is pure: no I/O.

Chat requests are decoded leniently where harnesses differ (content as a string or a list of parts, ``max_tokens``
or ``max_completion_tokens``, unknown keys ignored) and strictly where a wrong value would change the sample
(``n`` > 1 is refused: one episode, one completion per turn).

Tool calls are Qwen3's: ``<tool_call>{json}</tool_call>`` in the completion. A request a decoder cannot take is a
ValueError whose message begins with the field at fault (the gateway answers it 400).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal

import msgspec

# ------------------------------------------------------------------------------------------------- one turn

class TurnRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One turn, whatever API asked for it: ``messages`` and ``tools`` as the chat template takes them (tools in
    the OpenAI function shape, tool-call arguments as objects); None where the request left a setting to the
    gateway."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] | None = None
    seed: int | None = None


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """One tool call parsed out of a completion: ``id`` (hex, each API adds its prefix), the function's name and its
    arguments as a JSON string (as the model wrote them when they were a string)."""

    id: str
    name: str
    arguments: str

    def input(self) -> dict[str, Any]:
        """The arguments as an object (Anthropic's ``input``); arguments that are not a JSON object are kept whole
        under ``arguments``."""
        try:
            value = json.loads(self.arguments)
        except ValueError:
            value = None
        return value if isinstance(value, dict) else {"arguments": self.arguments}


Finish = Literal["stop", "length", "tool_calls"]


class TurnResult(msgspec.Struct, frozen=True, kw_only=True):
    """A sampled turn, before any API's shape: ``id`` (hex, each API adds its prefix), the decoded text with the tool
    calls taken out, the calls, why it ended (``stop_sequence``: the request's stop string that ended it) and the
    token counts. A retry is answered from it, so everything an answer shows is fixed here."""

    id: str
    created: int
    content: str
    tool_calls: list[ToolCall]
    finish: Finish
    stop_sequence: str | None = None
    prompt_tokens: int
    completion_tokens: int


def new_id() -> str:
    return uuid.uuid4().hex


def now() -> int:
    return int(time.time())


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with its name (Anthropic's and the Responses API's streams name each event)."""
    return b"event: " + event.encode() + b"\ndata: " + json.dumps(data).encode() + b"\n\n"


def function_tool(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool in the OpenAI function shape, which chat templates take."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def template_arguments(arguments: Any) -> Any:
    """Tool-call arguments as the chat template takes them: an object when they are JSON (Qwen3's template writes an
    object with ``tojson``, so the rendering matches what the model sampled), else the string as it is."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            pass
    return arguments


def template_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    """An assistant's tool call as the chat template takes it."""
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": template_arguments(arguments)}}


# ------------------------------------------------------------------------------------------------- chat requests

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
                if "arguments" in function:
                    function["arguments"] = template_arguments(function["arguments"])
                calls.append({**call, "function": function})
            item["tool_calls"] = calls
        if m.tool_call_id:
            item["tool_call_id"] = m.tool_call_id
        if m.name:
            item["name"] = m.name
        out.append(item)
    return out


def chat_turn(request: ChatCompletionRequest) -> TurnRequest:
    """The turn a chat completion request asks for (ValueError for ``n`` > 1 or no messages)."""
    if request.n != 1:
        raise ValueError("n must be 1: an episode samples one completion per turn")
    if not request.messages:
        raise ValueError("messages is empty")
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    return TurnRequest(model=request.model, messages=template_messages(request), tools=request.tools or None,
                       max_tokens=request.max_completion_tokens or request.max_tokens,
                       temperature=request.temperature, top_p=request.top_p, stop=stop or None, seed=request.seed)


# ------------------------------------------------------------------------------------------------- tool calls

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Qwen3's tool calls in a completion: the text outside them (stripped when there were calls) and each call. A
    block that is not a JSON object with a name stays in the text."""
    calls: list[ToolCall] = []
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
        calls.append(ToolCall(id=new_id()[:24], name=body["name"],
                              arguments=arguments if isinstance(arguments, str) else json.dumps(arguments)))
    kept.append(text[last:])
    return ("".join(kept).strip() if calls else text), calls


def chat_tool_call(call: ToolCall) -> dict[str, Any]:
    """A tool call in the chat-completions shape."""
    return {"id": f"call_{call.id}", "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """``split_tool_calls`` with each call in the chat-completions shape (``id``, type ``function``,
    ``function.name``, ``function.arguments`` as a JSON string)."""
    content, calls = split_tool_calls(text)
    return content, [chat_tool_call(c) for c in calls]


# ------------------------------------------------------------------------------------------------- chat answers

FinishReason = Literal["stop", "length", "tool_calls"]


def completion_body(*, model: str, content: str, tool_calls: list[dict[str, Any]], finish_reason: FinishReason,
                    prompt_tokens: int, completion_tokens: int, request_id: str,
                    created: int | None = None) -> dict[str, Any]:
    """A non-streaming ``chat.completion``."""
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if tool_calls else "")}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": request_id, "object": "chat.completion", "created": now() if created is None else created,
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def chat_answer(request: ChatCompletionRequest, result: TurnResult, model: str) -> dict[str, Any]:
    """A turn answered as a ``chat.completion``."""
    return completion_body(model=model, content=result.content, tool_calls=[chat_tool_call(c)
                                                                             for c in result.tool_calls],
                           finish_reason=result.finish, prompt_tokens=result.prompt_tokens,
                           completion_tokens=result.completion_tokens, request_id=f"chatcmpl-{result.id}",
                           created=result.created)


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


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape (chat completions and the Responses API)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def models_body(names: list[str]) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "swectl"}
                                       for n in names]}
