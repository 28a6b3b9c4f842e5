"""The gateway (actors/gateway.py) in front of the real CPU engine and a real tokenizer and model (tiny), spoken to
over HTTP the way harnesses do (mini-swe-agent's shape of request: a system and a user message, then the whole
history each turn): sessions by API key, the token record of each turn, retries, streaming, errors in each API's
shape. Its three APIs (chat completions, Anthropic's Messages, OpenAI's Responses) are spoken to by the vendors' own
Python SDKs as Claude Code and Codex would, and take the same turn path; tool calls come from a scripted policy.
mini-swe-agent's own process against it: test_gateway_harness.py."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import anyio
import httpx
import openai
import pytest

from swectl.actors.engines import Engines
from swectl.actors.gateway import Gateway, GatewayConfig
from swectl.agent.trajectory import rendered_ids
from swectl.config import EngineConfig
from swectl.model.tokenizer import load_tokenizer

from .templates import QWEN3_STYLE_TEMPLATE

pytestmark = [pytest.mark.integration, pytest.mark.anyio]
MODEL = "swectl-policy"
SYSTEM = {"role": "system", "content": "You are a helpful assistant that can interact with a computer."}
USER = {"role": "user", "content": "Please solve this issue: print hello\n\n```bash\necho hello\n```"}
# one turn's body in each API (the path is under the gateway's /v1 url)
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/chat/completions", {"model": MODEL, "messages": [SYSTEM, USER]}),
    "messages": ("/messages", {"model": MODEL, "max_tokens": 16, "system": SYSTEM["content"], "messages": [USER]}),
    "responses": ("/responses", {"model": MODEL, "instructions": SYSTEM["content"], "input": USER["content"]}),
}


@pytest.fixture
async def served(model: Path, tmp_path: Path) -> AsyncIterator[tuple[Gateway, object]]:
    engines = Engines(EngineConfig(health_interval_s=1.0, start_timeout_s=120), model=str(model), log_dir=tmp_path)
    tokenizer = load_tokenizer(str(model), "model")
    gateway = Gateway(GatewayConfig(max_tokens=16, context_tokens=512), engines.route, tokenizer)
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(120):
            await tg.start(engines.run)
            await tg.start(gateway.run)
        yield gateway, tokenizer
        tg.cancel_scope.cancel()


def _client(gateway: Gateway, key: str | None, **headers: str) -> httpx.AsyncClient:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(base_url=gateway.url, headers={**auth, **headers}, timeout=120)


async def test_each_turn_is_recorded_token_exact_and_retries_never_fork(served: tuple[Gateway, object]) -> None:
    gateway, tokenizer = served
    key = gateway.open_session("task#0")
    messages = [SYSTEM, USER]
    async with _client(gateway, key) as client:
        first = await client.post("/chat/completions", json={"model": "swectl-policy", "messages": messages})
        assert first.status_code == 200, first.text
        answer = first.json()
        assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["role"] == "assistant"
        # an SDK retry of the same body: the recorded answer, no second generation
        retry = await client.post("/chat/completions", json={"model": "swectl-policy", "messages": messages},
                                  headers={"x-stainless-retry-count": "1"})
        assert retry.json()["id"] == answer["id"]
        messages = [*messages, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "<returncode>0</returncode>\n<output>hello\n</output>"}]
        second = await client.post("/chat/completions", json={"model": "swectl-policy", "messages": messages})
        assert second.status_code == 200, second.text
    record = gateway.end_session(key)
    assert record.stats.turns == 2 and gateway.statistics().replayed == 1
    assert len(record.ledger.branches) == record.stats.branches + 1
    for branch in record.ledger.branches:  # what the engine sampled is the only thing trained on
        branch.check()
        assert all(lp < 0.0 for lp, m in zip(branch.logprobs, branch.loss_mask, strict=True) if m)
        assert all(lp == 0.0 for lp, m in zip(branch.logprobs, branch.loss_mask, strict=True) if not m)
    # the first turn's prompt is exactly the chat template's rendering of the first request
    prompt = rendered_ids(tokenizer.apply_chat_template([SYSTEM, USER], tokenize=True, add_generation_prompt=True))
    first_branch = record.ledger.branches[0]
    assert first_branch.token_ids[:len(prompt)] == list(prompt)
    assert sum(first_branch.loss_mask[len(prompt):len(prompt) + answer["usage"]["completion_tokens"]]) == \
        answer["usage"]["completion_tokens"]
    assert answer["usage"]["prompt_tokens"] == len(prompt)


async def test_a_streamed_turn_ends_with_done_and_the_same_usage(served: tuple[Gateway, object]) -> None:
    gateway, _ = served
    key = gateway.open_session("task#1")
    async with _client(gateway, key) as client:
        async with client.stream("POST", "/chat/completions", json={"model": "swectl-policy", "stream": True,
                                                                      "messages": [SYSTEM, USER]}) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    [branch] = gateway.end_session(key).ledger.branches
    assert chunks[-1]["usage"]["completion_tokens"] == sum(branch.loss_mask) > 0


async def test_keys_models_and_bad_bodies_get_openai_errors(served: tuple[Gateway, object]) -> None:
    gateway, _ = served
    body = {"model": "swectl-policy", "messages": [SYSTEM, USER]}
    async with _client(gateway, None) as client:
        missing = await client.post("/chat/completions", json=body)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    async with _client(gateway, "sk-not-a-session") as client:
        assert (await client.post("/chat/completions", json=body)).status_code == 401
    key = gateway.open_session("task#2")
    async with _client(gateway, None, **{"x-api-key": key}) as client:  # Anthropic-style header
        assert (await client.get("/models")).json()["data"][0]["id"] == "swectl-policy"
        other = await client.post("/chat/completions", json={**body, "model": "gpt-4o"})
        assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
        assert (await client.post("/chat/completions", content=b"{not json")).status_code == 400
        assert (await client.post("/chat/completions", json={**body, "n": 2})).status_code == 400
        huge = {"role": "user", "content": "word " * 2000}
        too_long = await client.post("/chat/completions", json={**body, "messages": [SYSTEM, huge]})
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
        record = gateway.end_session(key)
        assert record.stats.turns == 0  # nothing was sampled for a refused request
        ended = await client.post("/chat/completions", json=body)
        assert ended.status_code == 409 and ended.json()["error"]["code"] == "session_ended"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", list(BODIES))
async def test_a_client_that_disconnects_cancels_its_turn_and_records_nothing(model: Path, api: str,
                                                                            stream: bool) -> None:
    """The harness gives up on a turn (its timeout) and closes the connection: the gateway cancels the turn within
    DISCONNECT_POLL_S, the engine request is cancelled, and the ledger has nothing of it; the harness's retry is
    then answered as a fresh turn. The same through each API: they share the turn path; and streamed, where the
    stream was open (keepalives only) when the client went."""
    from swectl.agent.scripted import ScriptedEngine

    tokenizer = load_tokenizer(str(model), "model")
    script = ScriptedEngine(["a reply"] * 4, tokenizer)
    cancelled: list[bool] = []
    slow = {"on": True}

    class SlowEngine:  # the scripted policy, slow on demand (a long generation)
        async def generate(self, request):  # type: ignore[no-untyped-def]
            try:
                if slow["on"]:
                    await anyio.sleep(30)
                return await script.generate(request)
            except anyio.get_cancelled_exc_class():
                cancelled.append(True)
                raise

    gateway = Gateway(GatewayConfig(max_tokens=16), lambda name: SlowEngine(), tokenizer)
    async with anyio.create_task_group() as tg:
        await tg.start(gateway.run)
        key = gateway.open_session("task#gone")
        path, body = BODIES[api]
        body = {**body, "stream": stream}
        with pytest.raises(httpx.ReadTimeout):
            async with httpx.AsyncClient(base_url=gateway.url, headers={"Authorization": f"Bearer {key}"},
                                         timeout=0.5) as client:
                await client.post(path, json=body)
        with anyio.fail_after(5):
            while not cancelled:  # noqa: ASYNC110 (the gateway notices at its next poll)
                await anyio.sleep(0.05)
        assert gateway.statistics().disconnected == 1
        slow["on"] = False
        async with _client(gateway, key) as client:  # the retry: a fresh turn, sampled once
            again = await client.post(path, json=body)
        assert again.status_code == 200, again.text
        record = gateway.end_session(key)
        assert record.stats.turns == 1 and script.calls == 1
        tg.cancel_scope.cancel()


# ------------------------------------------------------------------------------------------------- Messages, Responses

class _Sdks:
    """The vendors' SDK clients a test makes (no retries), closed together on the test's event loop at its end."""

    def __init__(self, stack: contextlib.AsyncExitStack) -> None:
        self._stack = stack

    def anthropic(self, gateway: Gateway, key: str) -> anthropic.AsyncAnthropic:
        # Anthropic's base URL is the server's root: the SDK adds /v1/messages
        client = anthropic.AsyncAnthropic(api_key=key, base_url=gateway.url.removesuffix("/v1"), max_retries=0)
        self._stack.push_async_callback(client.close)
        return client

    def openai(self, gateway: Gateway, key: str) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(api_key=key, base_url=gateway.url, max_retries=0)
        self._stack.push_async_callback(client.close)
        return client


@pytest.fixture
async def sdks() -> AsyncIterator[_Sdks]:
    async with contextlib.AsyncExitStack() as stack:
        yield _Sdks(stack)


def _check_record(record: Any, prompt: list[int], first_output_tokens: int) -> None:
    """Every branch is well formed and holds only engine logprobs where sampled; the first turn's prompt is exactly
    ``prompt`` and its reply follows it, all sampled."""
    assert len(record.ledger.branches) == record.stats.branches + 1
    for branch in record.ledger.branches:
        branch.check()
        assert all(lp < 0.0 for lp, m in zip(branch.logprobs, branch.loss_mask, strict=True) if m)
    first = record.ledger.branches[0]
    assert first.token_ids[:len(prompt)] == prompt
    assert sum(first.loss_mask[len(prompt):len(prompt) + first_output_tokens]) == first_output_tokens


async def test_claude_code_and_codex_sdks_turns_are_recorded_token_exact(served: tuple[Gateway, Any],
                                                                         sdks: _Sdks) -> None:
    """The anthropic and openai SDKs, as Claude Code and Codex use them, against the real engine: a turn, then the
    history sent back with the answer as it came, streamed. Both render the same system and user message to
    exactly the chat template's tokens (count_tokens says so before anything is sampled), and record both turns."""
    gateway, tokenizer = served
    prompt = list(rendered_ids(tokenizer.apply_chat_template([SYSTEM, USER], tokenize=True,
                                                             add_generation_prompt=True)))
    system, user, observation = SYSTEM["content"], dict(USER), {"role": "user", "content": "<returncode>0</returncode>"}

    key = gateway.open_session("task#claude")
    claude = sdks.anthropic(gateway, key)
    assert (await claude.messages.count_tokens(model=MODEL, system=system, messages=[user])).input_tokens == \
        len(prompt)
    first = await claude.messages.create(model=MODEL, max_tokens=16, system=system, messages=[user])
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert [b.type for b in first.content] == ["text"] and first.stop_reason in ("end_turn", "max_tokens")
    assert first.usage.input_tokens == len(prompt) and first.usage.output_tokens > 0
    history = [user, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               observation]
    stream = await claude.messages.create(model=MODEL, max_tokens=16, system=system, messages=history, stream=True)
    events = [event async for event in stream]
    assert [e.type for e in events[:2]] == ["message_start", "content_block_start"]
    assert [e.type for e in events[-2:]] == ["message_delta", "message_stop"]
    assert events[-2].delta.stop_reason in ("end_turn", "max_tokens") and events[-2].usage.output_tokens > 0
    record = gateway.end_session(key)
    assert record.stats.turns == 2
    _check_record(record, prompt, first.usage.output_tokens)

    key = gateway.open_session("task#codex")
    codex = sdks.openai(gateway, key)
    answer = await codex.responses.create(model=MODEL, instructions=system, input=USER["content"],
                                          max_output_tokens=16, store=False)
    assert answer.object == "response" and answer.id.startswith("resp_") and answer.output[0].type == "message"
    assert answer.status == "completed" or answer.usage.output_tokens == 16  # incomplete: it hit max_output_tokens
    assert answer.usage.input_tokens == len(prompt)
    items = [user, *[item.model_dump(exclude_none=True) for item in answer.output], observation]
    stream = await codex.responses.create(model=MODEL, instructions=system, input=items, max_output_tokens=16,
                                          stream=True)
    events = [event async for event in stream]
    assert [e.type for e in events[:3]] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == deltas
    record = gateway.end_session(key)
    assert record.stats.turns == 2
    _check_record(record, prompt, answer.usage.output_tokens)


PARAMETERS = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
TOOL_CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
SCRIPT = ["I will look.", TOOL_CALL, "Done."]  # a reply, a tool call (after "go on"), a reply (after its result)
Call = tuple[str, str, dict[str, Any]]  # id, name, arguments
# one bash tool in each API's shape: all three become CHAT_TOOL for the chat template
CHAT_TOOL = {"type": "function",
             "function": {"name": "bash", "description": "Run a command.", "parameters": PARAMETERS}}
ANTHROPIC_TOOL = {"name": "bash", "description": "Run a command.", "input_schema": PARAMETERS}
RESPONSES_TOOL = {"type": "function", "name": "bash", "description": "Run a command.", "parameters": PARAMETERS,
                  "strict": False}


class _ChatHarness:
    """mini-swe-agent's way: chat completions, the assistant message sent back as the SDK gave it."""

    def __init__(self, sdks: _Sdks, gateway: Gateway, key: str) -> None:
        self.client = sdks.openai(gateway, key)
        self.history: list[dict[str, Any]] = [SYSTEM, USER]

    async def turn(self, stream: bool) -> tuple[str, list[Call]]:
        body = {"model": MODEL, "messages": self.history, "tools": [CHAT_TOOL], "max_tokens": 256}
        if stream:
            async with self.client.chat.completions.stream(**body) as events:
                message = (await events.get_final_completion()).choices[0].message
        else:
            message = (await self.client.chat.completions.create(**body)).choices[0].message
        self.history.append(message.model_dump(exclude_none=True, exclude={"parsed"}))
        calls = [(c.id, c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
        assert all(c[0].startswith("call_") for c in calls)
        return message.content or "", calls

    def tool_result(self, call_id: str, output: str) -> None:
        self.history.append({"role": "tool", "tool_call_id": call_id, "content": output})

    def user(self, text: str) -> None:
        self.history.append({"role": "user", "content": text})


class _ClaudeHarness:
    """Claude Code's way: Messages, the assistant's content blocks sent back as they came, tool results as blocks."""

    def __init__(self, sdks: _Sdks, gateway: Gateway, key: str) -> None:
        self.client = sdks.anthropic(gateway, key)
        self.history: list[dict[str, Any]] = [dict(USER)]

    async def turn(self, stream: bool) -> tuple[str, list[Call]]:
        body = {"model": MODEL, "max_tokens": 256, "system": SYSTEM["content"], "messages": self.history,
                "tools": [ANTHROPIC_TOOL]}
        if stream:  # the SDK's accumulator: it rebuilds the message from the events (tool input from its JSON deltas)
            async with self.client.messages.stream(**body) as events:
                message = await events.get_final_message()
        else:
            message = await self.client.messages.create(**body)
        self.history.append({"role": "assistant",
                             "content": [b.model_dump(exclude_none=True) for b in message.content]})
        calls = [(b.id, b.name, b.input) for b in message.content if b.type == "tool_use"]
        assert all(c[0].startswith("toolu_") for c in calls)
        assert message.stop_reason == ("tool_use" if calls else "end_turn")
        return "".join(b.text for b in message.content if b.type == "text"), calls

    def tool_result(self, call_id: str, output: str) -> None:
        self.history.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id,
                                                          "content": output}]})

    def user(self, text: str) -> None:
        self.history.append({"role": "user", "content": text})


class _CodexHarness:
    """Codex's way: Responses with the whole conversation as input items (store false), output items sent back."""

    def __init__(self, sdks: _Sdks, gateway: Gateway, key: str) -> None:
        self.client = sdks.openai(gateway, key)
        self.items: list[dict[str, Any]] = [dict(USER)]

    async def turn(self, stream: bool) -> tuple[str, list[Call]]:
        body = {"model": MODEL, "instructions": SYSTEM["content"], "input": self.items, "tools": [RESPONSES_TOOL],
                "max_output_tokens": 256, "store": False}
        if stream:  # the SDK's accumulator: it rebuilds the response from the events
            async with self.client.responses.stream(**body) as events:
                response = await events.get_final_response()
        else:
            response = await self.client.responses.create(**body)
        assert response.status == "completed"
        self.items += [item.model_dump(exclude_none=True, exclude={"parsed_arguments"}) for item in response.output]
        calls = [(o.call_id, o.name, json.loads(o.arguments)) for o in response.output if o.type == "function_call"]
        assert all(c[0].startswith("call_") for c in calls)
        return response.output_text, calls

    def tool_result(self, call_id: str, output: str) -> None:
        self.items.append({"type": "function_call_output", "call_id": call_id, "output": output})

    def user(self, text: str) -> None:
        self.items.append({"role": "user", "content": text})


HARNESSES = {"chat": _ChatHarness, "messages": _ClaudeHarness, "responses": _CodexHarness}


@pytest.fixture
async def scripted(model: Path) -> AsyncIterator[tuple[Gateway, Any, dict[str, Any]]]:
    """The gateway before scripted policies (one per session name, SCRIPT each), the real tiny tokenizer."""
    from swectl.agent.scripted import ScriptedEngine

    tokenizer = load_tokenizer(str(model), "model")
    scripts: dict[str, ScriptedEngine] = {}

    def engine_for(name: str) -> ScriptedEngine:
        return scripts.setdefault(name, ScriptedEngine(SCRIPT, tokenizer))

    gateway = Gateway(GatewayConfig(context_tokens=2048), engine_for, tokenizer)
    async with anyio.create_task_group() as tg:
        await tg.start(gateway.run)
        yield gateway, tokenizer, scripts
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("template", ["tiny", "qwen3-style"])
@pytest.mark.parametrize("api", list(HARNESSES))
async def test_tool_calls_come_back_in_each_apis_shape_and_the_history_extends_the_record(
        scripted: tuple[Gateway, Any, dict[str, Any]], sdks: _Sdks, api: str, template: str) -> None:
    """A scripted policy answers, calls bash, then answers again; the harness sends back each answer as its API gave
    it. Every API renders the same first prompt and records the same tokens. A text reply sent back extends the
    record. A tool call sent back extends it too when the template renders tool calls as the policy writes them
    (Qwen3's); the tiny model's template drops them, so that turn branches, with exactly the call's tokens as
    drift."""
    gateway, tokenizer, scripts = scripted
    if template == "qwen3-style":
        tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    key = gateway.open_session(f"task#{api}")
    harness = HARNESSES[api](sdks, gateway, key)
    assert await harness.turn(stream=False) == ("I will look.", [])
    harness.user("go on")
    text, [(call_id, name, arguments)] = await harness.turn(stream=True)
    assert (text, name, arguments) == ("", "bash", {"command": "ls"})
    harness.tool_result(call_id, "a.py")
    assert await harness.turn(stream=False) == ("Done.", [])
    record = gateway.end_session(key)
    script = scripts[f"task#{api}"]
    replies = [script.reply_ids(n) for n in range(3)]

    prompt = list(rendered_ids(tokenizer.apply_chat_template([SYSTEM, USER], tools=[CHAT_TOOL], tokenize=True,
                                                             add_generation_prompt=True)))
    first = record.ledger.branches[0]
    assert first.token_ids[:len(prompt)] == prompt  # the same rendering whichever API asked
    sampled = [t for t, m in zip(first.token_ids, first.loss_mask, strict=True) if m]
    assert record.stats.turns == 3
    if template == "qwen3-style":  # one sequence, each turn appended: every sampled token where it was sampled
        assert record.stats.branches == 0 and record.stats.drift_tokens == 0
        assert sampled == replies[0] + replies[1] + replies[2]
    else:
        assert record.stats.branches == 1 and record.stats.drift_tokens == len(replies[1])
        assert sampled == replies[0] + replies[1]
        last = record.ledger.branches[1]
        assert last.token_ids[-len(replies[2]):] == replies[2] and all(last.loss_mask[-len(replies[2]):])


async def test_a_retried_body_is_answered_once_in_each_api(scripted: tuple[Gateway, Any, dict[str, Any]]) -> None:
    gateway, _, scripts = scripted
    for api in ("messages", "responses"):
        key = gateway.open_session(f"task#retry-{api}")
        path, body = BODIES[api]
        async with _client(gateway, key) as client:
            first = await client.post(path, json=body)
            again = await client.post(path, json=body, headers={"x-stainless-retry-count": "1"})
        assert first.status_code == again.status_code == 200, first.text
        assert first.json() == again.json()
        assert gateway.end_session(key).stats.turns == 1 and scripts[f"task#retry-{api}"].calls == 1
    assert gateway.statistics().replayed == 2


async def test_errors_come_in_each_apis_shape(scripted: tuple[Gateway, Any, dict[str, Any]], sdks: _Sdks) -> None:
    gateway, _, _ = scripted
    turn = {"model": MODEL, "max_tokens": 16, "messages": [USER]}
    unknown = sdks.anthropic(gateway, "sk-not-a-session")
    with pytest.raises(anthropic.AuthenticationError) as refused:
        await unknown.messages.create(**turn)
    assert refused.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                             "message": "unknown API key"}}
    with pytest.raises(openai.AuthenticationError) as denied:
        await sdks.openai(gateway, "sk-not-a-session").responses.create(model=MODEL, input="hi")
    assert denied.value.code == "invalid_api_key" and denied.value.type == "authentication_error"
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as bare:  # no key at all
        missing = await bare.post("/messages", json=turn)
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"

    key = gateway.open_session("task#errors")
    claude, codex = sdks.anthropic(gateway, key), sdks.openai(gateway, key)
    with pytest.raises(anthropic.NotFoundError) as other:
        await claude.messages.create(**{**turn, "model": "claude-sonnet-4-5"})
    assert other.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        await claude.messages.count_tokens(model="claude-sonnet-4-5", messages=[USER])
    with pytest.raises(openai.NotFoundError) as other_model:
        await codex.responses.create(model="gpt-5-codex", input="hi")
    assert other_model.value.code == "model_not_found"
    huge = {"role": "user", "content": "word " * 4000}
    with pytest.raises(anthropic.BadRequestError) as too_long:
        await claude.messages.create(**{**turn, "messages": [huge]})
    assert too_long.value.body["error"]["type"] == "invalid_request_error"
    assert too_long.value.body["error"]["message"].startswith("prompt is too long")  # what Claude Code looks for
    with pytest.raises(openai.BadRequestError) as too_long_codex:
        await codex.responses.create(model=MODEL, input=huge["content"])
    assert too_long_codex.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as stateful:
        await codex.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")
    assert stateful.value.body["message"].startswith("previous_response_id is not supported")
    async with _client(gateway, key) as client:
        no_max = await client.post("/messages", json={"model": MODEL, "messages": [USER]})
        assert no_max.status_code == 400 and no_max.json()["type"] == "error"
        assert "max_tokens" in no_max.json()["error"]["message"]
    assert gateway.end_session(key).stats.turns == 0  # nothing was sampled for a refused request
    with pytest.raises(anthropic.ConflictError) as ended:
        await claude.messages.create(**turn)
    assert ended.value.body["error"] == {"type": "invalid_request_error", "message": "this episode has ended"}
    with pytest.raises(openai.ConflictError) as ended_codex:
        await codex.responses.create(model=MODEL, input="hi")
    assert ended_codex.value.code == "session_ended"
