"""The pieces of `swectl serve` that need no sandbox: idempotency keys, the exposure check, the listening socket."""

from __future__ import annotations

import socket

import anyio
import pytest

from swectl.cli.serve import _check_exposure, _listen, _networks
from swectl.errors import ConfigError
from swectl.serve.idempotency import IdempotencyCache
from swectl.serve.wire import ApiError


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_the_first_request_runs_once_and_its_retries_get_its_answer() -> None:
    cache = IdempotencyCache()
    runs = 0
    release = anyio.Event()

    async def call() -> tuple[int, dict]:
        nonlocal runs
        runs += 1
        await release.wait()
        return 200, {"ok": True, "n": runs}

    answers = []

    async def request() -> None:
        answers.append(await cache.once("/exec", "k1", b"body", call, wait_s=5))

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(request)
        await anyio.sleep(0.05)  # the retries arrive while the first still runs
        release.set()
    assert runs == 1
    assert answers == [(200, {"ok": True, "n": 1})] * 3
    assert cache.replays == 2
    assert await cache.once("/close", "k1", b"body", call, wait_s=5) == (200, {"ok": True, "n": 2})  # other scope


@pytest.mark.anyio
async def test_a_reused_key_with_another_body_is_refused_and_an_interrupted_first_run_is_never_repeated() -> None:
    cache = IdempotencyCache()

    async def ok() -> tuple[int, dict]:
        return 200, {"ok": True}

    await cache.once("/exec", "k", b"a", ok, wait_s=1)
    with pytest.raises(ApiError) as info:
        await cache.once("/exec", "k", b"b", ok, wait_s=1)
    assert info.value.status == 422

    async def interrupted() -> tuple[int, dict]:
        raise anyio.get_cancelled_exc_class()

    with pytest.raises(anyio.get_cancelled_exc_class()):
        await cache.once("/exec", "i", b"x", interrupted, wait_s=1)
    status, body = await cache.once("/exec", "i", b"x", ok, wait_s=1)
    assert status == 503 and body["infra"] is True and "unknown" in body["error"]


@pytest.mark.anyio
async def test_old_and_surplus_keys_are_forgotten() -> None:
    cache = IdempotencyCache(ttl_s=1000, max_keys=3)

    async def ok() -> tuple[int, dict]:
        return 200, {"ok": True}

    for key in "abcde":
        await cache.once("/exec", key, b"", ok, wait_s=1)
    assert len(cache._entries) <= 4  # the cap, checked before each new key


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.2"])
def test_loopback_needs_no_key(host: str) -> None:
    _check_exposure(host, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "example.org", "::"])
def test_anything_else_needs_a_key(host: str) -> None:
    with pytest.raises(ConfigError, match="set an API key"):
        _check_exposure(host, None)
    _check_exposure(host, "key")
    _check_exposure(host, None, ["10.0.0.0/8"])  # an allow-list of client networks is enough


def test_allow_from_takes_networks_and_refuses_garbage() -> None:
    assert _networks(["10.1.2.3/8", "::1", "127.0.0.2"]) == ["10.0.0.0/8", "::1/128", "127.0.0.2/32"]
    with pytest.raises(ConfigError, match="--allow-from 'nope'"):
        _networks(["nope"])


def test_the_listening_socket_disables_nagle_for_its_connections() -> None:
    with _listen("127.0.0.1", 0) as sock:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        port = sock.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            conn, _ = sock.accept()
            with conn:
                assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1  # inherited
        with pytest.raises(ConfigError, match="cannot listen"):
            _listen("127.0.0.1", port)
