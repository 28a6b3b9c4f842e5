"""The gateway under load and across a weight update, with the real OpenAI SDK as the client (the client
mini-swe-agent's litellm and most harnesses use), the real CPU engine and the tiny model:

- 64 sessions at once, two turns each with the history sent back: every request answered, every session's ledger
  holds its own two turns and nothing of another's;
- a weight update while turns are in flight: no request fails or is told to retry (no 429), and every turn records
  the version that sampled it: the old one before the update, the new one after.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from swectl.actors.engines import Engines
from swectl.actors.gateway import Gateway, GatewayConfig
from swectl.config import EngineConfig
from swectl.model.tokenizer import load_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.anyio]
SESSIONS = 64


@pytest.fixture
async def served(model: Path, tmp_path: Path) -> AsyncIterator[tuple[Gateway, Engines]]:
    engines = Engines(EngineConfig(health_interval_s=1.0, start_timeout_s=120, max_batch=SESSIONS), model=str(model),
                      log_dir=tmp_path)
    gateway = Gateway(GatewayConfig(max_tokens=8, context_tokens=512), engines.route,
                      load_tokenizer(str(model), "model"))
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(120):
            await tg.start(engines.run)
            await tg.start(gateway.run)
        yield gateway, engines
        tg.cancel_scope.cancel()


def _messages(n: int) -> list[dict]:
    return [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"Task {n}: print hello"}]


async def test_64_sessions_at_once_each_keep_their_own_turns(served: tuple[Gateway, Engines], model: Path) -> None:
    from openai import AsyncOpenAI

    gateway, _ = served
    keys = [gateway.open_session(f"task{n}#0") for n in range(SESSIONS)]
    answered: dict[int, list[str]] = {}

    async def episode(n: int) -> None:
        async with AsyncOpenAI(base_url=gateway.url, api_key=keys[n], max_retries=0, timeout=300) as client:
            messages = _messages(n)
            first = await client.chat.completions.create(model="swectl-policy", messages=messages)
            messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                         {"role": "user", "content": f"<returncode>0</returncode> for task {n}"}]
            second = await client.chat.completions.create(model="swectl-policy", messages=messages)
            answered[n] = [first.id, second.id]

    with anyio.fail_after(300):
        async with anyio.create_task_group() as tg:
            for n in range(SESSIONS):
                tg.start_soon(episode, n)
    stats = gateway.statistics()
    assert len(answered) == SESSIONS and stats.requests == 2 * SESSIONS
    assert stats.rejected == stats.engine_failures == stats.replayed == 0
    records = [gateway.end_session(key) for key in keys]
    assert all(r.stats.turns == 2 for r in records)
    ids = {i for pair in answered.values() for i in pair}
    assert len(ids) == 2 * SESSIONS  # no answer was handed to two requests
    tokenizer = load_tokenizer(str(model), "model")
    for n, record in enumerate(records):  # each ledger starts with its own task's prompt, and no other's
        text = tokenizer.decode(record.ledger.branches[0].token_ids)
        assert f"Task {n}: print hello" in text and all(f"Task {m}:" not in text for m in (n - 1, n + 1))


async def test_turns_during_a_weight_update_wait_and_record_their_version(served: tuple[Gateway, Engines],
                                                                          model: Path) -> None:
    from openai import AsyncOpenAI

    gateway, engines = served
    keys = [gateway.open_session(f"update{n}#0") for n in range(8)]
    statuses: list[str] = []

    async def turn(n: int) -> None:
        async with AsyncOpenAI(base_url=gateway.url, api_key=keys[n], max_retries=0, timeout=300) as client:
            await client.chat.completions.create(model="swectl-policy", messages=_messages(n), max_tokens=64)
            statuses.append("ok")

    with anyio.fail_after(300):
        async with anyio.create_task_group() as tg:
            for n in range(4):  # in flight when the update starts
                tg.start_soon(turn, n)
            await anyio.sleep(0.05)
            tg.start_soon(engines.update_weights, str(model), "7")
            await anyio.sleep(0.01)
            for n in range(4, 8):  # arriving during the update: they wait for it
                tg.start_soon(turn, n)
        async with anyio.create_task_group() as tg:  # after it
            for n in range(8):
                keys.append(gateway.open_session(f"after{n}#0"))
                tg.start_soon(turn, len(keys) - 1)
    assert statuses == ["ok"] * 16
    assert gateway.statistics().rejected == gateway.statistics().engine_failures == 0
    versions = [v for key in keys for b in gateway.end_session(key).ledger.branches for v in b.weight_versions]
    assert len(versions) == 16 and set(versions) <= {"", "0", "7"}, versions
    assert versions[-8:] == ["7"] * 8  # every turn after the update is sampled by the new weights


async def test_a_seeded_gateway_draws_the_same_turns_for_the_same_session_name(model: Path, tmp_path: Path) -> None:
    """GatewayConfig.seed: each turn's sampling seed comes from (seed, session name, turn), so a rerun of an episode
    draws the same tokens at temperature 1, and another episode (another name) draws others."""
    from openai import AsyncOpenAI

    engines = Engines(EngineConfig(health_interval_s=1.0, start_timeout_s=120), model=str(model), log_dir=tmp_path)
    gateway = Gateway(GatewayConfig(max_tokens=24, context_tokens=512, temperature=1.0, seed="eval:3"),
                      engines.route, load_tokenizer(str(model), "model"))

    async def draw(name: str) -> list[int]:
        key = gateway.open_session(name)
        async with AsyncOpenAI(base_url=gateway.url, api_key=key, max_retries=0, timeout=120) as client:
            await client.chat.completions.create(model="swectl-policy", messages=_messages(0))
        branch = gateway.end_session(key).ledger.branches[0]
        return [t for t, m in zip(branch.token_ids, branch.loss_mask, strict=True) if m]

    async with anyio.create_task_group() as tg:
        with anyio.fail_after(120):
            await tg.start(engines.run)
            await tg.start(gateway.run)
            first, again, other = await draw("t#0"), await draw("t#0"), await draw("t#1")
        tg.cancel_scope.cancel()
    assert first == again and first != other


def test_swectl_gateway_serves_a_harness_the_user_runs(model: Path, tmp_path: Path) -> None:
    """`swectl gateway --model M`: engines and the gateway from the command line; a session key written at start
    and one opened over HTTP with the admin token, each used by a real SDK (OpenAI chat, Anthropic Messages); ending
    a session writes its token record; the session routes refuse a wrong token; Ctrl-C stops it."""
    import json
    import signal
    import subprocess
    import sys
    import time

    import httpx
    from anthropic import Anthropic
    from openai import OpenAI

    out = tmp_path / "gw"
    proc = subprocess.Popen([sys.executable, "-m", "swectl.cli.main", "gateway", "--model", str(model), "--port", "0",
                             "--sessions", "1", "--max-tokens", "8", "--context", "512", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "gateway.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        info = json.loads((out / "gateway.json").read_text())
        assert (out / "gateway.json").stat().st_mode & 0o777 == 0o600
        chat = OpenAI(base_url=info["url"], api_key=info["sessions"]["session-0"], max_retries=0)
        assert chat.chat.completions.create(model="swectl-policy", messages=_messages(0)).choices[0].message
        admin = {"Authorization": f"Bearer {info['admin_token']}"}
        assert httpx.post(f"{info['root']}/swectl/v1/sessions", json={"name": "x"},
                          headers={"Authorization": "Bearer wrong"}).status_code == 401
        opened = httpx.post(f"{info['root']}/swectl/v1/sessions", json={"name": "claude#0"}, headers=admin).json()
        messages = Anthropic(base_url=info["root"], api_key=opened["key"], max_retries=0)
        reply = messages.messages.create(model="swectl-policy", max_tokens=8,
                                         messages=[{"role": "user", "content": "print hello"}])
        assert reply.role == "assistant"
        for key in (info["sessions"]["session-0"], opened["key"]):
            ended = httpx.post(f"{info['root']}/swectl/v1/sessions/end", json={"key": key}, headers=admin)
            assert ended.status_code == 200 and ended.json()["turns"] == 1, ended.text
        for name in ("session-0", "claude#0"):
            record = json.loads((out / "sessions" / f"{name}.json").read_text())
            assert record["turns"] == 1 and sum(record["branches"][0]["loss_mask"]) > 0
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
