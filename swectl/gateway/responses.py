"""OpenAI's Responses API as the gateway reads and writes it (``POST /v1/responses``, what Codex CLI sends). Pure:
no I/O.

A request becomes a ``TurnRequest`` (swectl/gateway/wire.py):

- ``instructions`` is the first (system) message; ``input`` as a string is one user message;
- ``message`` items (``type`` may be left out) keep their role, ``developer`` becoming ``system``; their content
  is a string or ``input_text`` / ``output_text`` parts (a ``refusal`` part's text too), joined with a blank line;
- a ``function_call`` item joins the assistant message just before it as one of its ``tool_calls`` (an assistant
  message with no text when there is none), with the arguments as an object; a ``function_call_output`` item is a
  ``tool`` message with its ``tool_call_id``;
- ``reasoning`` items render as nothing (the gateway never answers with them: the policy's text, its reasoning
  included, comes back as one ``output_text``);
- another item type, an image or file part, or ``previous_response_id`` is a 400: the gateway keeps no response
  state (the harness sends the whole conversation, as Codex does with ``store: false``);
- ``tools`` of type ``function`` go to the chat template; other tool types (``web_search``, ``local_shell``,
  ``custom``) are left out.

``max_output_tokens`` bounds the reply. ``store``, ``include``, ``reasoning``, ``text``, ``tool_choice`` and
``parallel_tool_calls`` are accepted and not used (the last two are echoed back).

The answer is a ``response``: a ``message`` item with one ``output_text`` (left out when the reply is only tool
calls), then a ``function_call`` item per call (``fc_`` id, ``call_`` call_id). ``status`` is ``incomplete``
(``incomplete_details.reason``: ``max_output_tokens``) when the reply hit its token limit, else ``completed``.
Streamed, it is ``response.created``, ``response.in_progress``, per item ``response.output_item.added``, its
content (``response.content_part.added``, ``response.output_text.delta``, ``response.output_text.done``,
``response.content_part.done``; or ``response.function_call_arguments.delta`` / ``.done``) and
``response.output_item.done``, then ``response.completed`` (``response.incomplete`` for an incomplete response, as
the real API ends it). Every event's data has its ``type`` and a ``sequence_number``. Errors are OpenAI's shape
(wire.error_body).
"""

from __future__ import annotations

from typing import Any

import msgspec

from swectl.gateway.wire import TurnRequest, TurnResult, function_tool, sse, template_call

Item = dict[str, Any]
_JOIN = "\n\n"  # Codex sends separate documents (instructions, environment context) as separate parts
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/responses``."""

    model: str
    input: str | list[Item]
    instructions: str | None = None
    tools: list[Item] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    previous_response_id: str | None = None
    tool_choice: str | Item = "auto"
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of parts")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise ValueError(f"{where}[{i}]: {kind!r} parts are not supported: the policy reads text")
        texts.append(str(part.get(_TEXT_PARTS[kind], "")))
    return _JOIN.join(texts)


def template_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's instructions and input items as a Hugging Face chat template takes them."""
    out: list[dict[str, Any]] = []
    if request.instructions:
        out.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        out.append({"role": "user", "content": request.input})
        return out
    for i, item in enumerate(request.input):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        match kind:
            case "message":
                role = _ROLES.get(str(item.get("role")))
                if role is None:
                    raise ValueError(f"{where}.role must be one of {', '.join(_ROLES)}")
                out.append({"role": role, "content": _text(item.get("content", ""), f"{where}.content")})
            case "function_call":
                call = template_call(str(item.get("call_id", "")), str(item.get("name", "")),
                                     item.get("arguments", "{}"))
                if not out or out[-1]["role"] != "assistant":
                    out.append({"role": "assistant", "content": ""})
                out[-1].setdefault("tool_calls", []).append(call)
            case "function_call_output":
                out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                            "content": _text(item.get("output", ""), f"{where}.output")})
            case "reasoning":
                pass
            case _:
                raise ValueError(f"{where}: input items of type {kind!r} are not supported here")
    return out


def template_tools(request: ResponsesRequest) -> list[dict[str, Any]] | None:
    """The request's function tools in the chat template's shape (other tool types left out); None when none."""
    tools = [function_tool(str(t.get("name", "")), t.get("description"), t.get("parameters"))
             for t in request.tools or [] if t.get("type") == "function"]
    return tools or None


def responses_turn(request: ResponsesRequest) -> TurnRequest:
    """The turn a Responses request asks for (ValueError for ``previous_response_id`` or an empty input)."""
    if request.previous_response_id:
        raise ValueError("previous_response_id is not supported: this gateway keeps no responses; send the whole "
                         "conversation as input")
    if not request.input:
        raise ValueError("input is empty")
    return TurnRequest(model=request.model, messages=template_messages(request), tools=template_tools(request),
                       max_tokens=request.max_output_tokens, temperature=request.temperature, top_p=request.top_p)


# ------------------------------------------------------------------------------------------------- answers

def response_body(request: ResponsesRequest, result: TurnResult, model: str) -> dict[str, Any]:
    """A turn answered as a ``response``."""
    incomplete = result.finish == "length"
    status = "incomplete" if incomplete else "completed"
    output: list[Item] = []
    if result.content or not result.tool_calls:
        output.append({"type": "message", "id": f"msg_{result.id}", "status": status, "role": "assistant",
                       "content": [{"type": "output_text", "text": result.content, "annotations": [],
                                    "logprobs": []}]})
    output += [{"type": "function_call", "id": f"fc_{c.id}", "call_id": f"call_{c.id}", "name": c.name,
                "arguments": c.arguments, "status": "completed"} for c in result.tool_calls]
    return {"id": f"resp_{result.id}", "object": "response", "created_at": result.created, "status": status,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {}, "model": model, "output": output,
            "parallel_tool_calls": request.parallel_tool_calls, "previous_response_id": None,
            "temperature": request.temperature, "top_p": request.top_p, "tool_choice": request.tool_choice,
            "tools": [t for t in request.tools or [] if t.get("type") == "function"], "truncation": "disabled",
            "usage": {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens,
                      "total_tokens": result.prompt_tokens + result.completion_tokens,
                      "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}


def response_events(body: dict[str, Any]) -> list[bytes]:
    """The same answer as the Responses API's server-sent events, numbered from 0."""
    events: list[bytes] = []

    def emit(kind: str, **data: Any) -> None:
        events.append(sse(kind, {"type": kind, "sequence_number": len(events), **data}))

    started = {**body, "status": "in_progress", "incomplete_details": None, "output": [], "usage": None}
    emit("response.created", response=started)
    emit("response.in_progress", response=started)
    for index, item in enumerate(body["output"]):
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            emit("response.output_item.added", output_index=index,
                 item={**item, "status": "in_progress", "content": []})
            for part_index, part in enumerate(item["content"]):
                at = {**where, "content_index": part_index}
                emit("response.content_part.added", **at, part={**part, "text": ""})
                if part["text"]:
                    emit("response.output_text.delta", **at, delta=part["text"], logprobs=[])
                emit("response.output_text.done", **at, text=part["text"], logprobs=[])
                emit("response.content_part.done", **at, part=part)
        else:
            emit("response.output_item.added", output_index=index,
                 item={**item, "status": "in_progress", "arguments": ""})
            emit("response.function_call_arguments.delta", **where, delta=item["arguments"])
            emit("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"])
        emit("response.output_item.done", output_index=index, item=item)
    emit("response.incomplete" if body["status"] == "incomplete" else "response.completed", response=body)
    return events
