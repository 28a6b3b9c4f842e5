"""The gateway's Anthropic Messages and OpenAI Responses shapes (swectl/gateway/messages.py, responses.py) and the
turn they share with chat completions (wire.py), without a server or an engine: requests decoded into the chat
template's messages and tools, turns answered and streamed in each API's shape, errors in each API's shape."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from swectl.gateway import messages, responses
from swectl.gateway.wire import (
    ChatCompletionRequest,
    ToolCall,
    TurnResult,
    chat_answer,
    chat_turn,
    split_tool_calls,
)

CALL = ToolCall(id="abc123", name="bash", arguments='{"command": "ls"}')


def _result(content: str = "hi", calls: list[ToolCall] | None = None, finish: str = "stop",
            stop_sequence: str | None = None) -> TurnResult:
    return TurnResult(id="f00d", created=1_700_000_000, content=content, tool_calls=calls or [], finish=finish,
                      stop_sequence=stop_sequence, prompt_tokens=7, completion_tokens=3)


def _events(stream: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for raw in stream:
        head, data = raw.decode().removesuffix("\n\n").split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        out.append((head[len("event: "):], json.loads(data[len("data: "):])))
    return out


# ------------------------------------------------------------------------------------------------- the shared turn

def test_a_chat_request_becomes_the_same_turn_it_always_was() -> None:
    body = msgspec.json.decode(json.dumps({
        "model": "m", "max_tokens": 9, "stop": "END", "temperature": 0.5,
        "messages": [{"role": "user", "content": "hi"}]}), type=ChatCompletionRequest)
    turn = chat_turn(body)
    assert turn.messages == [{"role": "user", "content": "hi"}]
    assert (turn.max_tokens, turn.stop, turn.temperature, turn.tools) == (9, ["END"], 0.5, None)
    with pytest.raises(ValueError, match="n must be 1"):
        chat_turn(msgspec.convert({"model": "m", "n": 2, "messages": [{"role": "user"}]}, ChatCompletionRequest))
    answer = chat_answer(body, _result(calls=[CALL], finish="tool_calls"), "m")
    assert answer["id"] == "chatcmpl-f00d" and answer["created"] == 1_700_000_000
    assert answer["choices"][0]["message"]["tool_calls"] == [
        {"id": "call_abc123", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]


def test_tool_calls_split_out_and_their_input_is_an_object() -> None:
    content, [call] = split_tool_calls('ok\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n'
                                       '</tool_call>')
    assert content == "ok" and call.name == "bash" and call.input() == {"command": "ls"}
    assert ToolCall(id="1", name="f", arguments="not json").input() == {"arguments": "not json"}


# ------------------------------------------------------------------------------------------------- Messages

def _messages_request(**fields: Any) -> messages.MessagesRequest:
    body = {"model": "m", "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.json.decode(json.dumps(body), type=messages.MessagesRequest)


def test_a_messages_request_maps_system_tool_use_and_tool_results_in_order() -> None:
    request = _messages_request(
        system=[{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Be brief."}],
        tools=[{"name": "Bash", "description": "run", "input_schema": {"type": "object"}},
               {"type": "web_search_20250305", "name": "web_search"}],
        stop_sequences=["STOP"], temperature=0.2, metadata={"user_id": "u"}, thinking={"type": "enabled"},
        tool_choice={"type": "auto"},
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "<reminder>"}, {"type": "text", "text": "fix"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
                {"type": "tool_use", "id": "toolu_2", "name": "Bash", "input": {"command": "pwd"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "/w"}]},
                {"type": "text", "text": "go on"}]}])
    turn = messages.messages_turn(request)
    assert turn.messages == [
        {"role": "system", "content": "You are Claude Code.\n\nBe brief."},
        {"role": "user", "content": "<reminder>\n\nfix"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "Bash", "arguments": {"command": "ls"}}},
            {"id": "toolu_2", "type": "function", "function": {"name": "Bash", "arguments": {"command": "pwd"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.py"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "/w"},
        {"role": "user", "content": "go on"}]
    assert turn.tools == [{"type": "function", "function": {"name": "Bash", "description": "run",
                                                            "parameters": {"type": "object"}}}]
    assert (turn.max_tokens, turn.stop, turn.temperature) == (32, ["STOP"], 0.2)
    assert messages.count_turn(request).messages == turn.messages


def test_a_messages_request_needs_max_tokens_and_readable_blocks() -> None:
    with pytest.raises(msgspec.ValidationError, match="max_tokens"):
        msgspec.json.decode(b'{"model": "m", "messages": []}', type=messages.MessagesRequest)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: image blocks are not supported"):
        messages.messages_turn(_messages_request(messages=[{"role": "user", "content": [image]}]))
    with pytest.raises(ValueError, match="unknown content block type 'mystery'"):
        messages.messages_turn(_messages_request(messages=[{"role": "user", "content": [{"type": "mystery"}]}]))
    with pytest.raises(ValueError, match="user, assistant or system"):
        messages.messages_turn(_messages_request(messages=[{"role": "tool", "content": "x"}]))
    with pytest.raises(ValueError, match="at least one message"):
        messages.count_turn(msgspec.convert({"model": "m", "messages": []}, messages.CountTokensRequest))


def test_a_system_message_inside_messages_renders_where_it_stands() -> None:
    """Claude Code 2.1.197 (beta mid-conversation-system-2026-04-07) sends its agent list as a system message after
    the first user message: it was a 400, and the CLI gave up on the turn."""
    turn = messages.messages_turn(_messages_request(system="Be brief.", messages=[
        {"role": "user", "content": [{"type": "text", "text": "<reminder>"}, {"type": "text", "text": "print hello"}]},
        {"role": "system", "content": "Available agent types: general-purpose."},
        {"role": "user", "content": [{"type": "text", "text": "go on"}]},
        {"role": "system", "content": [{"type": "text", "text": "A reminder."}]}]))
    assert turn.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "<reminder>\n\nprint hello"},
        {"role": "system", "content": "Available agent types: general-purpose."},
        {"role": "user", "content": "go on"},
        {"role": "system", "content": "A reminder."}]


def test_claude_codes_billing_block_is_not_part_of_the_system_prompt() -> None:
    """Claude Code's first system block is its attribution (``x-anthropic-billing-header: cc_version=V.FP;``),
    whose fingerprint FP changes with the conversation: it is metadata, not the prompt."""
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.beb; cc_entrypoint=sdk-cli;"},
              {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Be brief."}]
    turn = messages.messages_turn(_messages_request(system=system))
    assert turn.messages[0] == {"role": "system", "content": "You are a Claude agent.\n\nBe brief."}
    only = messages.messages_turn(_messages_request(system=system[:1]))
    assert only.messages == [{"role": "user", "content": "hi"}]
    # a string system prompt is the harness's own words, kept whole
    assert messages.messages_turn(_messages_request(system=system[0]["text"])).messages[0]["content"] == \
        system[0]["text"]


def test_a_message_answer_has_text_then_tool_use_blocks_and_anthropic_stop_reasons() -> None:
    request = _messages_request()
    body = messages.message_body(request, _result("Let me look.", [CALL], "tool_calls"), "m")
    assert body["id"] == "msg_f00d" and body["type"] == "message" and body["role"] == "assistant"
    assert body["content"] == [{"type": "text", "text": "Let me look."},
                               {"type": "tool_use", "id": "toolu_abc123", "name": "bash", "input": {"command": "ls"}}]
    assert body["stop_reason"] == "tool_use" and body["stop_sequence"] is None
    assert body["usage"]["input_tokens"] == 7 and body["usage"]["output_tokens"] == 3
    only_call = messages.message_body(request, _result("", [CALL], "tool_calls"), "m")
    assert [b["type"] for b in only_call["content"]] == ["tool_use"]
    assert messages.message_body(request, _result(finish="length"), "m")["stop_reason"] == "max_tokens"
    assert messages.message_body(request, _result(), "m")["stop_reason"] == "end_turn"
    stopped = messages.message_body(request, _result(stop_sequence="STOP"), "m")
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "STOP")


def test_a_streamed_message_is_anthropics_event_sequence_carrying_the_same_content() -> None:
    body = messages.message_body(_messages_request(), _result("Let me look.", [CALL], "tool_calls"), "m")
    events = _events(messages.message_events(body))
    assert [name for name, _ in events] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] == 7
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert events[3][1]["delta"] == {"type": "text_delta", "text": "Let me look."}
    assert events[5][1]["content_block"] == {"type": "tool_use", "id": "toolu_abc123", "name": "bash", "input": {}}
    assert events[6][1] == {"type": "content_block_delta", "index": 1,
                            "delta": {"type": "input_json_delta", "partial_json": '{"command": "ls"}'}}
    assert events[8][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[8][1]["usage"]["output_tokens"] == 3


def test_anthropic_errors_name_their_type_by_status() -> None:
    assert messages.error_body(401, "no key") == {"type": "error", "error": {"type": "authentication_error",
                                                                             "message": "no key"}}
    assert [messages.error_body(s, "")["error"]["type"] for s in (400, 404, 409, 413, 500, 503)] == [
        "invalid_request_error", "not_found_error", "invalid_request_error", "request_too_large", "api_error",
        "api_error"]


# ------------------------------------------------------------------------------------------------- Responses

def _responses_request(**fields: Any) -> responses.ResponsesRequest:
    return msgspec.json.decode(json.dumps({"model": "m", "input": "hi", **fields}), type=responses.ResponsesRequest)


def test_a_responses_request_maps_items_and_joins_function_calls_to_their_message() -> None:
    request = _responses_request(
        instructions="You are Codex.", max_output_tokens=20, store=False, include=["reasoning.encrypted_content"],
        reasoning={"effort": "low"},
        tools=[{"type": "function", "name": "shell", "description": "run", "parameters": {"type": "object"},
                "strict": False}, {"type": "web_search"}],
        input=[
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
            {"role": "user", "content": [{"type": "input_text", "text": "<env>"}, {"type": "input_text",
                                                                                   "text": "fix it"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell",
             "arguments": '{"command": ["ls"]}', "status": "completed"},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.py"},
            {"type": "function_call", "call_id": "call_2", "name": "shell", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_2",
             "output": [{"type": "input_text", "text": "b.py"}]}])
    turn = responses.responses_turn(request)
    assert turn.messages == [
        {"role": "system", "content": "You are Codex."},
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "<env>\n\nfix it"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": {"command": ["ls"]}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.py"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_2", "type": "function", "function": {"name": "shell", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "b.py"}]
    assert turn.tools == [{"type": "function", "function": {"name": "shell", "description": "run",
                                                            "parameters": {"type": "object"}}}]
    assert turn.max_tokens == 20
    assert responses.responses_turn(_responses_request()).messages == [{"role": "user", "content": "hi"}]


def test_a_responses_request_refuses_server_state_and_what_the_policy_cannot_read() -> None:
    with pytest.raises(ValueError, match="previous_response_id is not supported"):
        responses.responses_turn(_responses_request(previous_response_id="resp_1"))
    with pytest.raises(ValueError, match=r"input\[0\].content\[0\]: 'input_image' parts"):
        responses.responses_turn(_responses_request(input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:"}]}]))
    with pytest.raises(ValueError, match="'item_reference' are not supported"):
        responses.responses_turn(_responses_request(input=[{"type": "item_reference", "id": "msg_1"}]))
    with pytest.raises(ValueError, match="input is empty"):
        responses.responses_turn(_responses_request(input=[]))


def test_a_response_answer_has_a_message_then_function_calls_and_its_status() -> None:
    request = _responses_request(tools=[{"type": "function", "name": "shell", "parameters": {}}])
    body = responses.response_body(request, _result("Looking.", [CALL], "tool_calls"), "m")
    assert body["id"] == "resp_f00d" and body["object"] == "response" and body["created_at"] == 1_700_000_000
    assert body["status"] == "completed" and body["incomplete_details"] is None and body["error"] is None
    assert body["output"] == [
        {"type": "message", "id": "msg_f00d", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Looking.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "id": "fc_abc123", "call_id": "call_abc123", "name": "bash",
         "arguments": '{"command": "ls"}', "status": "completed"}]
    assert body["usage"]["input_tokens"] == 7 and body["usage"]["output_tokens"] == 3
    assert body["usage"]["total_tokens"] == 10
    cut = responses.response_body(request, _result(finish="length"), "m")
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["type"] for i in responses.response_body(request, _result("", [CALL], "tool_calls"), "m")
            ["output"]] == ["function_call"]


def test_a_streamed_response_is_the_responses_event_sequence_numbered_from_zero() -> None:
    body = responses.response_body(_responses_request(), _result("Looking.", [CALL], "tool_calls"), "m")
    events = _events(responses.response_events(body))
    assert [name for name, _ in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(data["type"] == name for name, data in events)
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    assert events[4][1] == {"type": "response.output_text.delta", "sequence_number": 4, "item_id": "msg_f00d",
                            "output_index": 0, "content_index": 0, "delta": "Looking.", "logprobs": []}
    assert events[8][1]["item"]["arguments"] == "" and events[8][1]["item"]["status"] == "in_progress"
    assert events[10][1]["arguments"] == '{"command": "ls"}' and events[10][1]["name"] == "bash"
    assert events[-1][1]["response"] == body
    cut = responses.response_body(_responses_request(), _result(finish="length"), "m")
    assert _events(responses.response_events(cut))[-1][0] == "response.incomplete"


# ------------------------------------------------------------------------------------------------- the server's root

class _CountingEngine:
    """Answers every turn with the same two tokens, and counts the turns it was asked for."""

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, request: Any) -> Any:
        from swectl.engine.wire import GenerateResult

        self.calls += 1
        return GenerateResult(output_ids=[5, 6], output_logprobs=[-0.1, -0.2], finish_reason="stop",
                              prompt_tokens=len(request.input_ids), completion_tokens=2, weight_version="w0",
                              e2e_latency_s=0.0, client_latency_s=0.0)


class _WordTokenizer:
    """One id per character of the messages' text: enough for the gateway to render, record and decode."""

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        return [ord(c) % 97 for m in messages for c in m["role"] + str(m.get("content", ""))]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "ok"


def _gateway_client(engine: _CountingEngine) -> tuple[Any, Any]:
    from starlette.testclient import TestClient

    from swectl.actors.gateway import Gateway, GatewayConfig

    gateway = Gateway(GatewayConfig(), lambda name: engine, _WordTokenizer())  # type: ignore[arg-type]
    return gateway, TestClient(gateway.app())


def test_the_root_answers_head_and_get_without_a_key() -> None:
    """Claude Code 2.1.197 sends ``HEAD /`` to its base URL before its first turn (it answered 404)."""
    engine = _CountingEngine()
    _, client = _gateway_client(engine)
    assert client.head("/").status_code == 200
    assert client.get("/").json() == {"service": "swectl gateway"}
    assert client.get("/v1/models").status_code == 401  # the rest still needs a session's key
    assert engine.calls == 0


def test_a_retry_is_the_same_turn_whatever_order_its_metadata_keys_come_in() -> None:
    """Codex 0.171 reconnects with the same input but ``client_metadata`` serialised in another key order: it is
    the same turn, answered from the record, not sampled again (which would fork the episode)."""
    engine = _CountingEngine()
    gateway, client = _gateway_client(engine)
    key = gateway.open_session("codex")
    body = {"model": "swectl-policy", "input": [{"type": "message", "role": "user",
                                                 "content": [{"type": "input_text", "text": "print hello"}]}],
            "store": False, "stream": False, "client_metadata": {"turn_id": "t1", "x-codex-turn-metadata": "{}"}}
    again = {**body, "client_metadata": {"x-codex-turn-metadata": "{}", "turn_id": "t1"}}
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    first = client.post("/v1/responses", content=json.dumps(body), headers=headers).json()
    second = client.post("/v1/responses", content=json.dumps(again), headers=headers).json()
    assert first["id"] == second["id"] and engine.calls == 1 and gateway.statistics().replayed == 1
    other = {**body, "input": "print bye"}  # another turn is sampled
    assert client.post("/v1/responses", content=json.dumps(other), headers=headers).json()["id"] != first["id"]
    assert engine.calls == 2 and gateway.end_session(key).stats.turns == 2


# ------------------------------------------------------------------------------------------------- streamed turns

class _SlowEngine(_CountingEngine):
    """Takes ``delay_s`` a turn; with ``fail`` set it fails after that, as a dead engine does."""

    def __init__(self, delay_s: float, fail: bool = False) -> None:
        super().__init__()
        self.delay_s, self.fail = delay_s, fail

    async def generate(self, request: Any) -> Any:
        import anyio

        from swectl.errors import EngineUnavailableError

        await anyio.sleep(self.delay_s)
        if self.fail:
            raise EngineUnavailableError("http://engine", "the engine server went away")
        return await super().generate(request)


def _slow_client(engine: _CountingEngine, **config: Any) -> tuple[Any, Any]:
    from starlette.testclient import TestClient

    from swectl.actors.gateway import Gateway, GatewayConfig

    gateway = Gateway(GatewayConfig(stream_keepalive_s=0.05, **config), lambda name: engine,  # type: ignore[arg-type]
                      _WordTokenizer())
    return gateway, TestClient(gateway.app())


def test_a_streamed_turn_opens_at_once_and_keeps_alive_until_its_events() -> None:
    """Claude Code and Codex drop a stream idle for 300 s, and one CPU turn can take longer: the stream opens
    before sampling and carries SSE comments until the turn's events, which the real SDKs read through."""
    import anthropic
    import openai

    engine = _SlowEngine(0.3)
    gateway, client = _slow_client(engine)
    key = gateway.open_session("s")
    headers = {"authorization": f"Bearer {key}"}
    body = {"model": "swectl-policy", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as streamed:
        assert streamed.status_code == 200
        raw = b"".join(streamed.iter_bytes())
    assert raw.startswith(b": keepalive\n\n") and raw.count(b": keepalive") >= 2 and raw.endswith(b"data: [DONE]\n\n")
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=client, max_retries=0)
    chunks = list(sdk.chat.completions.create(model="swectl-policy", messages=[{"role": "user", "content": "yo"}],
                                              stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "ok"
    claude = anthropic.Anthropic(base_url="http://testserver", api_key=key, http_client=client, max_retries=0)
    with claude.messages.stream(model="swectl-policy", max_tokens=8,
                                messages=[{"role": "user", "content": "hey"}]) as stream:
        assert stream.get_final_message().content[0].text == "ok"
    assert engine.calls == 3 and gateway.end_session(key).stats.turns == 3


def test_a_streamed_turn_that_fails_after_the_stream_opened_is_an_error_event_each_sdk_raises() -> None:
    import anthropic
    import openai

    gateway, client = _slow_client(_SlowEngine(0.1, fail=True))
    key = gateway.open_session("s")
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=client, max_retries=0)
    with pytest.raises(openai.APIError, match="the engine failed"):
        list(sdk.chat.completions.create(model="swectl-policy", messages=[{"role": "user", "content": "hi"}],
                                         stream=True))
    claude = anthropic.Anthropic(base_url="http://testserver", api_key=key, http_client=client, max_retries=0)
    with pytest.raises(anthropic.APIError, match="the engine failed"):
        with claude.messages.stream(model="swectl-policy", max_tokens=8,
                                    messages=[{"role": "user", "content": "hey"}]) as stream:
            stream.get_final_message()
    assert gateway.statistics().engine_failures == 2 and gateway.end_session(key).stats.turns == 0


def test_a_streamed_request_the_turn_cannot_take_is_still_refused_with_its_status() -> None:
    engine = _SlowEngine(0.0)
    gateway, client = _slow_client(engine, context_tokens=8)
    key = gateway.open_session("s")
    body = {"model": "swectl-policy", "stream": True, "messages": [{"role": "user", "content": "a long prompt"}]}
    answer = client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded"
    other = client.post("/v1/chat/completions", json={**body, "model": "gpt-5"},
                        headers={"authorization": f"Bearer {key}"})
    assert other.status_code == 404 and engine.calls == 0


def test_a_turn_past_the_sessions_limit_is_refused_and_marks_the_session() -> None:
    """``open_session(max_turns=N)`` (a CLI agent's step limit): turn N+1 is a 400 ``turn_limit_reached`` (either CLI
    stops on it), a retry of a recorded turn is still answered from the record, and the ended session says it hit a
    limit; an engine failure marks the session failed instead (an infrastructure failure: Aborted)."""
    engine = _CountingEngine()
    gateway, client = _gateway_client(engine)
    key = gateway.open_session("claude#0", max_turns=1)
    headers = {"x-api-key": key, "content-type": "application/json"}
    body = {"model": "swectl-policy", "max_tokens": 8, "messages": [{"role": "user", "content": "print hello"}]}
    assert client.post("/v1/messages", content=json.dumps(body), headers=headers).status_code == 200
    assert client.post("/v1/messages", content=json.dumps(body), headers=headers).status_code == 200  # a retry
    more = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "hi"},
                                 {"role": "user", "content": "go on"}]}
    refused = client.post("/v1/messages", content=json.dumps(more), headers=headers)
    assert refused.status_code == 400 and "turn limit (1)" in refused.json()["error"]["message"], refused.text
    record = gateway.end_session(key)
    assert record.stats.turns == 1 and record.limited and not record.failed and record.last_finish in ("stop", "length")
    assert engine.calls == 1

    broken = _SlowEngine(0.0, fail=True)
    gateway, client = _slow_client(broken)
    key = gateway.open_session("codex#0")
    body = {"model": "swectl-policy", "input": "print hello", "store": False, "stream": False}
    failed = client.post("/v1/responses", content=json.dumps(body),
                         headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
    assert failed.status_code == 503
    record = gateway.end_session(key)
    assert record.failed and not record.limited and record.stats.turns == 0


class _FailingFirst(_CountingEngine):
    """Fails its first ``failures`` calls as a dead server does, then answers."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def generate(self, request: Any) -> Any:
        from swectl.errors import EngineUnavailableError

        if self.failures:
            self.failures -= 1
            raise EngineUnavailableError("http://engine", "the engine server went away")
        return await super().generate(request)


def _outage_client(engine: _CountingEngine, wait: Any) -> tuple[Any, Any]:
    from starlette.testclient import TestClient

    from swectl.actors.gateway import Gateway, GatewayConfig

    gateway = Gateway(GatewayConfig(engine_retry_pause_s=0.01), lambda name: engine,  # type: ignore[arg-type]
                      _WordTokenizer(), wait_routable=wait)
    return gateway, TestClient(gateway.app())


def test_a_turn_whose_server_failed_is_asked_again_of_a_routable_one_not_answered_503() -> None:
    """An engine restart mid-episode: the gateway waits for a routable server (the engines' outage wait) and asks
    again, so the harness sees one slow turn and no 503 to back off from; the failed tries recorded nothing."""
    engine = _FailingFirst(2)
    waits: list[float] = []

    async def wait(bound: float) -> float:
        waits.append(bound)
        return 0.0

    gateway, client = _outage_client(engine, wait)
    key = gateway.open_session("s")
    answer = client.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                         json={"model": "swectl-policy", "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 200, answer.text
    stats = gateway.statistics()
    assert (stats.engine_retries, stats.engine_failures, stats.requests) == (2, 0, 1)
    assert len(waits) == 2 and engine.calls == 1
    record = gateway.end_session(key)
    assert record.stats.turns == 1 and not record.failed


def test_an_outage_that_outlasts_the_wait_is_a_503_and_marks_the_episode_failed() -> None:
    from swectl.errors import EngineUnavailableError

    async def wait(bound: float) -> float:
        raise EngineUnavailableError("", "no engine server became routable")

    gateway, client = _outage_client(_FailingFirst(5), wait)
    key = gateway.open_session("s")
    answer = client.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                         json={"model": "swectl-policy", "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_unavailable"
    stats = gateway.statistics()
    assert (stats.engine_retries, stats.engine_failures) == (1, 1)
    record = gateway.end_session(key)
    assert record.failed and record.stats.turns == 0
