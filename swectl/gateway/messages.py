"""Anthropic's Messages API as the gateway reads and writes it (``POST /v1/messages``, what Claude Code sends, and
``POST /v1/messages/count_tokens``). Pure: no I/O.

A request becomes a ``TurnRequest`` (swectl/gateway/wire.py):

- ``system`` (a string or a list of text blocks) is the first message, less Claude Code's attribution block
  (``x-anthropic-billing-header: cc_version=...``, billing metadata whose suffix changes with the conversation);
- a ``system`` message inside ``messages`` (Claude Code sends one, beta ``mid-conversation-system-2026-04-07``) is a
  system message where it stands;
- a user message's ``tool_result`` blocks become ``tool`` messages with their ``tool_call_id``, its text blocks user
  messages, in the order they came;
- an assistant message's ``tool_use`` blocks become its ``tool_calls`` (``input`` as the arguments object);
- ``thinking`` and ``redacted_thinking`` blocks render as nothing (the gateway never answers with them: the
  policy's text, its reasoning included, comes back as one text block);
- text blocks of one message are joined with a blank line; fields a block has beyond those read here
  (``cache_control``, ``citations``) are ignored;
- a block the policy cannot read (``image``, ``document``) or does not know is a 400, as the real API refuses it;
- ``tools`` ([{name, description, input_schema}]) become OpenAI functions for the chat template; server tools
  (those with a ``type`` other than ``custom``) are left out.

``max_tokens`` is required, as in the real API. ``tool_choice``, ``thinking``, ``metadata`` and ``top_k`` are
accepted and not used.

The answer is a ``message``: one text block (left out when the reply is only tool calls), then a ``tool_use``
block per call (``toolu_`` ids). Streamed, it is the same content as ``message_start``, ``ping``, one
``content_block_start`` / ``content_block_delta`` (``text_delta`` or ``input_json_delta``) /
``content_block_stop`` per block, ``message_delta`` (stop reason, usage) and ``message_stop``. Errors are
``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec

from swectl.gateway.wire import TurnRequest, TurnResult, function_tool, sse, template_call

Block = dict[str, Any]
_JOIN = "\n\n"  # Claude Code sends separate documents (system reminders, the prompt) as separate text blocks
_IGNORED = {"thinking", "redacted_thinking"}
_BILLING = "x-anthropic-billing-header:"
_UNREADABLE = {"image", "document", "search_result"}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 529: "overloaded_error"}


class MessageIn(msgspec.Struct, kw_only=True):
    """One message: ``user`` or ``assistant``, its content a string or a list of blocks."""

    role: str
    content: str | list[Block]


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/messages/count_tokens``: the prompt part of a Messages request."""

    model: str
    messages: list[MessageIn]
    system: str | list[Block] | None = None
    tools: list[Block] | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """``POST /v1/messages``."""

    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    temperature: float | None = None
    top_p: float | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False


def _text(blocks: str | list[Block], where: str) -> str:
    """The text of a string or of text blocks (thinking blocks are nothing); ValueError for anything else."""
    if isinstance(blocks, str):
        return blocks
    texts = []
    for i, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind not in _IGNORED:
            raise _unknown(kind, f"{where}[{i}]")
    return _JOIN.join(texts)


def _unknown(kind: Any, where: str) -> ValueError:
    if kind in _UNREADABLE:
        return ValueError(f"{where}: {kind} blocks are not supported: the policy reads text")
    return ValueError(f"{where}: unknown content block type {kind!r}")


def _without_billing(system: str | list[Block]) -> str | list[Block]:
    """The system blocks less Claude Code's attribution block (``x-anthropic-billing-header: cc_version=...``): it is
    billing metadata sent in the prompt, not text for the policy, and its suffix is a fingerprint that changes with the
    conversation (``cc_version=2.1.197.beb`` for one first prompt, ``.8a5`` for another)."""
    if isinstance(system, str):
        return system
    return [b for b in system if not (b.get("type") == "text" and str(b.get("text", "")).startswith(_BILLING))]


def template_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    """The request's system prompt and messages as a Hugging Face chat template takes them."""
    out: list[dict[str, Any]] = []
    if request.system:
        system = _text(_without_billing(request.system), "system")
        if system:
            out.append({"role": "system", "content": system})
    for i, message in enumerate(request.messages):
        where = f"messages[{i}].content"
        if message.role == "assistant":
            out.append(_assistant(message.content, where))
        elif message.role == "user":
            out.extend(_user(message.content, where))
        elif message.role == "system":  # Claude Code's mid-conversation system messages (its beta
            # mid-conversation-system-2026-04-07): a system message in its place, as Qwen3's template renders one
            out.append({"role": "system", "content": _text(message.content, where)})
        else:
            raise ValueError(f"messages[{i}].role must be user, assistant or system, not {message.role!r}")
    return out


def _assistant(content: str | list[Block], where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, calls = [], []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            calls.append(template_call(str(block.get("id", "")), str(block.get("name", "")), block.get("input", {})))
        elif kind not in _IGNORED:
            raise _unknown(kind, f"{where}[{j}]")
    item: dict[str, Any] = {"role": "assistant", "content": _JOIN.join(texts)}
    if calls:
        item["tool_calls"] = calls
    return item


def _user(content: str | list[Block], where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": _JOIN.join(texts)})
            texts.clear()

    for j, block in enumerate(content):
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_result":
            flush()
            result = block.get("content") or ""
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                        "content": _text(result if isinstance(result, str | list) else str(result),
                                         f"{where}[{j}].content")})
        elif kind not in _IGNORED:
            raise _unknown(kind, f"{where}[{j}]")
    flush()
    return out


def template_tools(request: CountTokensRequest) -> list[dict[str, Any]] | None:
    """The request's client tools as OpenAI functions (server tools left out); None when there are none."""
    tools = [function_tool(str(t.get("name", "")), t.get("description"), t.get("input_schema"))
             for t in request.tools or [] if t.get("type", "custom") == "custom"]
    return tools or None


def count_turn(request: CountTokensRequest) -> TurnRequest:
    """What a count_tokens request renders: the prompt of the turn it describes, nothing to sample."""
    if not request.messages:
        raise ValueError("messages: at least one message is required")
    return TurnRequest(model=request.model, messages=template_messages(request), tools=template_tools(request))


def messages_turn(request: MessagesRequest) -> TurnRequest:
    """The turn a Messages request asks for."""
    prompt = count_turn(request)
    return TurnRequest(model=prompt.model, messages=prompt.messages, tools=prompt.tools,
                       max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
                       stop=request.stop_sequences or None)


# ------------------------------------------------------------------------------------------------- answers

def message_body(request: MessagesRequest, result: TurnResult, model: str) -> dict[str, Any]:
    """A turn answered as a ``message``."""
    content: list[Block] = []
    if result.content or not result.tool_calls:
        content.append({"type": "text", "text": result.content})
    content += [{"type": "tool_use", "id": f"toolu_{c.id}", "name": c.name, "input": c.input()}
                for c in result.tool_calls]
    stop_reason = "stop_sequence" if result.stop_sequence is not None else _STOP_REASONS[result.finish]
    return {"id": f"msg_{result.id}", "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": result.stop_sequence,
            "usage": {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


def message_events(body: dict[str, Any]) -> list[bytes]:
    """The same answer as Anthropic's server-sent events."""
    usage = body["usage"]
    start = {**body, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**usage, "output_tokens": 0}}
    events = [sse("message_start", {"type": "message_start", "message": start}),
              sse("ping", {"type": "ping"})]
    for index, block in enumerate(body["content"]):
        if block["type"] == "text":
            opened: Block = {"type": "text", "text": ""}
            delta: Block = {"type": "text_delta", "text": block["text"]}
        else:
            opened = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events.append(sse("content_block_start", {"type": "content_block_start", "index": index,
                                                  "content_block": opened}))
        events.append(sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))
        events.append(sse("content_block_stop", {"type": "content_block_stop", "index": index}))
    events.append(sse("message_delta", {"type": "message_delta",
                                        "delta": {"stop_reason": body["stop_reason"],
                                                  "stop_sequence": body["stop_sequence"]},
                                        "usage": {"input_tokens": usage["input_tokens"],
                                                  "output_tokens": usage["output_tokens"]}}))
    events.append(sse("message_stop", {"type": "message_stop"}))
    return events


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape; its ``type`` follows the status as the real API's does (5xx: ``api_error``)."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}
