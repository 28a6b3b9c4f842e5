"""The gateway (actors/gateway.py) in front of the real CPU engine and a real tokenizer and model (tiny), spoken to
over HTTP the way harnesses do (mini-swe-agent's shape of request: a system and a user message, then the whole
history each turn): sessions by API key, the token record of each turn, retries, streaming, errors in OpenAI's
shape. mini-swe-agent's own process against it: test_gateway_harness.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import pytest

from swectl.actors.engines import Engines
from swectl.actors.gateway import Gateway, GatewayConfig
from swectl.agent.trajectory import rendered_ids
from swectl.config import EngineConfig
from swectl.model.tokenizer import load_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.anyio]
SYSTEM = {"role": "system", "content": "You are a helpful assistant that can interact with a computer."}
USER = {"role": "user", "content": "Please solve this issue: print hello\n\n```bash\necho hello\n```"}


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


async def test_a_client_that_disconnects_cancels_its_turn_and_records_nothing(model: Path) -> None:
    """The harness gives up on a turn (its timeout) and closes the connection: the gateway cancels the turn within
    DISCONNECT_POLL_S, the engine request is cancelled, and the ledger has nothing of it; the harness's retry is
    then answered as a fresh turn."""
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
        body = {"model": "swectl-policy", "messages": [SYSTEM, USER]}
        with pytest.raises(httpx.ReadTimeout):
            async with httpx.AsyncClient(base_url=gateway.url, headers={"Authorization": f"Bearer {key}"},
                                         timeout=0.5) as client:
                await client.post("/chat/completions", json=body)
        with anyio.fail_after(5):
            while not cancelled:  # noqa: ASYNC110 (the gateway notices at its next poll)
                await anyio.sleep(0.05)
        assert gateway.statistics().disconnected == 1
        slow["on"] = False
        async with _client(gateway, key) as client:  # the retry: a fresh turn, sampled once
            again = await client.post("/chat/completions", json=body)
        assert again.status_code == 200, again.text
        record = gateway.end_session(key)
        assert record.stats.turns == 1 and script.calls == 1
        tg.cancel_scope.cancel()
