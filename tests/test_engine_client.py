"""The engine clients against the real CPU engine (a subprocess serving a tiny random Qwen3) and against
fake servers that misbehave on purpose.

The tiny model is made here around the session's `tiny_tokenizer` (tests/conftest.py: byte-level BPE, ChatML
chat template): Qwen3 weights initialised with different seeds (model B stands in for "the weights
after a training step"). References are computed in this process with plain full forward passes (no KV
cache, no padding, no batching), so they share nothing with the engine's batched, cached decoding.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from anyio.abc import SocketAttribute, SocketStream

from swectl.engine.client import OpenAIChatClient, SglangClient, chat_path
from swectl.engine.wire import ChatMessage, GenerateRequest, GenerateResult, SamplingParams, decode_generate_response
from swectl.errors import (
    EngineError,
    EngineRejectedError,
    EngineResponseError,
    EngineTimeoutError,
    EngineUnavailableError,
    InfraError,
)
from swectl.testing.cpu_engines import CpuEngineProcess, start_cpu_engine

torch = pytest.importorskip("torch", reason="the engine tests need torch (pip install torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="the engine tests need transformers")
pytest.importorskip("tokenizers", reason="the engine tests need tokenizers")
pytest.importorskip("starlette", reason="the CPU engine needs starlette")
pytest.importorskip("uvicorn", reason="the CPU engine needs uvicorn")

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[1]
VOCAB = 600  # the model's; the tiny tokenizer's ids are below it, its special tokens are ids 0, 1, 2
LOGPROB_TOL = 1e-4
START_TIMEOUT_S = 120.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# ---------------------------------------------------------------- the tiny model


def save_model(folder: Path, tokenizer: Any, *, seed: int, hidden_size: int = 64) -> Path:
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        initializer_range=0.2,  # peaked distributions: greedy choices are far from ties
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@dataclass(frozen=True)
class Models:
    a: Path
    b: Path
    narrow: Path  # other shapes: a weight update from it must fail
    tokenizer: Any


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Any) -> Models:
    root = tmp_path_factory.mktemp("tiny-qwen3")
    tokenizer = tiny_tokenizer
    assert len(tokenizer) <= VOCAB
    return Models(
        a=save_model(root / "a", tokenizer, seed=0),
        b=save_model(root / "b", tokenizer, seed=1),
        narrow=save_model(root / "narrow", tokenizer, seed=2, hidden_size=32),
        tokenizer=tokenizer,
    )


class Reference:
    """Single-sequence full forward passes: what the engine's answers must agree with."""

    def __init__(self, folder: Path, eos_id: int) -> None:
        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.eos_id = eos_id

    def logprobs(self, ids: Sequence[int], temperature: float = 1.0) -> Any:
        """[len(ids), vocab]: row i is the distribution of token i + 1."""
        with torch.inference_mode():
            logits = self.model(torch.tensor([list(ids)])).logits[0].float()
        return torch.log_softmax(logits / temperature, dim=-1)

    def greedy(
        self, prompt: Sequence[int], max_new: int, stop_ids: Sequence[int] = ()
    ) -> tuple[list[int], list[float]]:
        ids, out, lps = list(prompt), [], []
        for _ in range(max_new):
            row = self.logprobs(ids)[-1]
            token = int(torch.argmax(row))
            ids.append(token)
            out.append(token)
            lps.append(float(row[token]))
            if token == self.eos_id or token in stop_ids:
                break
        return out, lps

    def output_logprobs(self, prompt: Sequence[int], output: Sequence[int], temperature: float = 1.0) -> list[float]:
        table = self.logprobs([*prompt, *output], temperature)
        return [float(table[len(prompt) - 1 + i, token]) for i, token in enumerate(output)]


@pytest.fixture(scope="module")
def ref_a(models: Models) -> Reference:
    return Reference(models.a, models.tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def ref_b(models: Models) -> Reference:
    return Reference(models.b, models.tokenizer.eos_token_id)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 5, 8, 13, 21, 34, 55, 89]
    return [[rng.randrange(3, VOCAB) for _ in range(lengths[i % len(lengths)])] for i in range(count)]


def greedy_request(prompt: list[int], max_new: int, **params: Any) -> GenerateRequest:
    return GenerateRequest(
        input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0.0, **params)
    )


def assert_close(got: Sequence[float], want: Sequence[float]) -> None:
    assert len(got) == len(want)
    worst = max((abs(g - w) for g, w in zip(got, want, strict=True)), default=0.0)
    assert worst <= LOGPROB_TOL, f"logprobs differ by up to {worst}"


# ---------------------------------------------------------------- engine processes


def start_engine(model: Path, log: Path, *args: str) -> CpuEngineProcess:
    return start_cpu_engine(model, log, *args, cwd=REPO, timeout_s=START_TIMEOUT_S)


@pytest.fixture(scope="module")
def engine(models: Models, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Read-only tests share this one (model A, a wide batching window so concurrent requests meet)."""
    server = start_engine(models.a, tmp_path_factory.mktemp("engine") / "log", "--batch-wait-ms", "100")
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def mutable_engine(models: Models, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Weight updates and pauses; each test leaves model A loaded and generation running."""
    server = start_engine(models.a, tmp_path_factory.mktemp("mutable") / "log")
    yield server.url
    server.stop()


async def server_state(url: str, api_key: str | None = None) -> dict[str, Any]:
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=10, headers=headers) as http:
        return (await http.get(f"{url}/get_server_info")).json()["internal_states"][0]


async def wait_running(url: str, count: int = 1, api_key: str | None = None) -> None:
    with anyio.fail_after(30):
        while (await server_state(url, api_key))["running_requests"] < count:  # noqa: ASYNC110  (polling another process)
            await anyio.sleep(0.01)


# ---------------------------------------------------------------- against the CPU engine


async def test_health_info_and_flush(engine: str, models: Models) -> None:
    async with SglangClient(engine, timeout_s=30) as client:
        assert await client.health()
        assert await client.health_generate()
        info = await client.get_model_info()
        assert info.model_path == str(models.a)
        assert info.is_generation
        assert info.weight_version == "default" == await client.get_weight_version()
        assert await client.flush_cache()


async def test_greedy_matches_single_sequence_reference(engine: str, ref_a: Reference) -> None:
    async with SglangClient(engine, timeout_s=60) as client:
        for prompt in prompts(4, seed=1):
            result = await client.generate(greedy_request(prompt, 24))
            want_ids, want_lps = ref_a.greedy(prompt, 24)
            assert result.output_ids == want_ids
            assert_close(result.output_logprobs, want_lps)
            assert result.prompt_tokens == len(prompt)
            assert result.completion_tokens == len(result.output_ids)
            assert result.weight_version == "default"
            assert result.finish_reason == ("length" if len(want_ids) == 24 else "stop")
            assert 0 < result.client_latency_s
            assert 0 < result.e2e_latency_s


async def test_concurrent_requests_are_batched_and_give_the_sequential_results(engine: str, ref_a: Reference) -> None:
    requests = [greedy_request(p, n) for p, n in zip(prompts(8, seed=2), [16, 9, 24, 5, 30, 12, 20, 7], strict=True)]
    async with SglangClient(engine, timeout_s=120) as client:
        sequential = [await client.generate(r) for r in requests]
        before = (await server_state(engine))["batches"]
        concurrent: dict[int, GenerateResult] = {}

        async def one(index: int) -> None:
            concurrent[index] = await client.generate(requests[index])

        async with anyio.create_task_group() as tg:
            for index in range(len(requests)):
                tg.start_soon(one, index)
    state = await server_state(engine)
    assert state["largest_batch"] >= 4, state  # they really were decoded together...
    assert state["batches"] - before < len(requests), state
    for index, alone in enumerate(sequential):  # ...and batching changed nothing
        together = concurrent[index]
        assert together.output_ids == alone.output_ids
        assert_close(together.output_logprobs, alone.output_logprobs)
        assert together.finish_reason == alone.finish_reason
        want_ids, want_lps = ref_a.greedy(requests[index].input_ids, requests[index].sampling_params.max_new_tokens)
        assert together.output_ids == want_ids
        assert_close(together.output_logprobs, want_lps)


async def test_requests_arriving_mid_batch_join_it_and_give_the_sequential_results(
    engine: str, ref_a: Reference
) -> None:
    """Continuous batching: requests sent while a batch decodes join it between two steps instead of waiting for
    it to end, and get what they get alone; the running row's cache survives the merges and the trimming of the
    padding that a finished wide row leaves behind."""
    long = greedy_request(prompts(1, seed=5)[0], 300, ignore_eos=True)
    candidates = prompts(8, seed=6)  # 3 to 89 tokens: the widest row (89) leaves first, its padding is trimmed
    late = [greedy_request(candidates[i], n) for i, n in ((7, 7), (2, 20), (4, 12))]
    async with SglangClient(engine, timeout_s=120) as client:
        alone = {key: await client.generate(r) for key, r in [("long", long), *enumerate(late)]}
        before = await server_state(engine)
        together: dict[object, GenerateResult] = {}

        async def one(key: object, request: GenerateRequest) -> None:
            together[key] = await client.generate(request)

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "long", long)
            with anyio.fail_after(30):  # the long request is decoding: its batch window has closed
                while (await server_state(engine))["decode_steps"] < before["decode_steps"] + 5:  # noqa: ASYNC110
                    await anyio.sleep(0.005)
            for index, request in enumerate(late):
                tg.start_soon(one, index, request)
    state = await server_state(engine)
    assert state["joined_requests"] > before["joined_requests"], state
    assert state["batches"] - before["batches"] < 1 + len(late), state
    assert 1 < state["mean_decode_batch"] <= state["largest_batch"], state
    for key, result in alone.items():
        assert together[key].output_ids == result.output_ids, key
        assert_close(together[key].output_logprobs, result.output_logprobs)
    for index, request in enumerate(late):
        want_ids, want_lps = ref_a.greedy(request.input_ids, request.sampling_params.max_new_tokens)
        assert together[index].output_ids == want_ids
        assert_close(together[index].output_logprobs, want_lps)
    assert len(together["long"].output_ids) == 300
    assert_close(together["long"].output_logprobs, ref_a.output_logprobs(long.input_ids, together["long"].output_ids))


async def test_max_new_tokens_gives_length(engine: str) -> None:
    prompt = prompts(1, seed=3)[0]
    async with SglangClient(engine, timeout_s=30) as client:
        result = await client.generate(greedy_request(prompt, 5, ignore_eos=True))
        empty = await client.generate(greedy_request(prompt, 0))
    assert len(result.output_ids) == len(result.output_logprobs) == result.completion_tokens == 5
    assert result.finish_reason == "length"
    assert empty.output_ids == []
    assert empty.finish_reason == "length"


async def test_stop_token_ids_give_stop(engine: str) -> None:
    prompt = prompts(1, seed=4)[0]
    async with SglangClient(engine, timeout_s=30) as client:
        free = await client.generate(greedy_request(prompt, 20, ignore_eos=True))
        first_new = next(i for i in range(1, len(free.output_ids)) if free.output_ids[i] not in free.output_ids[:i])
        stop_id = free.output_ids[first_new]
        stopped = await client.generate(greedy_request(prompt, 20, ignore_eos=True, stop_token_ids=[stop_id]))
    assert stopped.finish_reason == "stop"
    assert stopped.matched_stop == stop_id
    assert stopped.output_ids == free.output_ids[: first_new + 1]  # the stop token is part of the output
    assert_close(stopped.output_logprobs, free.output_logprobs[: first_new + 1])


async def test_seeded_sampling_is_reproducible_and_logprobs_are_temperature_scaled(
    engine: str, ref_a: Reference
) -> None:
    prompt = prompts(1, seed=5)[0]
    params = SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.9, sampling_seed=1234, ignore_eos=True)
    request = GenerateRequest(input_ids=prompt, sampling_params=params)
    async with SglangClient(engine, timeout_s=30) as client:
        first, second = await client.generate(request), await client.generate(request)
        other = await client.generate(
            GenerateRequest(input_ids=prompt, sampling_params=msgspec.structs.replace(params, sampling_seed=99))
        )
    assert first.output_ids == second.output_ids
    assert other.output_ids != first.output_ids
    # SGLang's convention: log_softmax(logits / temperature), before top-p truncation.
    assert_close(first.output_logprobs, ref_a.output_logprobs(prompt, first.output_ids, temperature=0.7))
    unscaled = ref_a.output_logprobs(prompt, first.output_ids)
    assert max(abs(a - b) for a, b in zip(first.output_logprobs, unscaled, strict=True)) > 1e-2


async def test_chat_completions(engine: str, models: Models) -> None:
    messages = [ChatMessage("system", "You fix bugs."), ChatMessage("user", "def add(a, b):")]
    prompt_text = models.tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = models.tokenizer(prompt_text, add_special_tokens=False).input_ids
    async with OpenAIChatClient(engine, "tiny", timeout_s=30) as chat, SglangClient(engine, timeout_s=30) as native:
        answer = await chat.chat(messages, max_tokens=12, temperature=0.0)
        same = await native.generate(greedy_request(prompt_ids, 12))
    async with OpenAIChatClient(f"{engine}/v1/", "tiny", timeout_s=30) as chat_v1:
        again = await chat_v1.chat(messages, max_tokens=12)
    assert answer.prompt_tokens == len(prompt_ids)
    assert answer.completion_tokens == len(same.output_ids)
    assert answer.content == models.tokenizer.decode(same.output_ids, skip_special_tokens=True)
    assert answer.finish_reason == same.finish_reason
    assert answer.model == "tiny"
    assert again.content == answer.content


# ---------------------------------------------------------------- weight updates and pauses


async def test_update_weights_from_disk(
    mutable_engine: str, models: Models, ref_a: Reference, ref_b: Reference
) -> None:
    prompt = prompts(1, seed=6)[0]
    request = greedy_request(prompt, 16, ignore_eos=True)
    async with SglangClient(mutable_engine, timeout_s=60) as client:
        before = await client.generate(request)
        await client.update_weights_from_disk(str(models.b), weight_version="step-1")
        after = await client.generate(request)
        info = await client.get_model_info()
        with pytest.raises(EngineRejectedError, match="not a folder") as missing:
            await client.update_weights_from_disk(str(models.a / "missing"))
        with pytest.raises(EngineRejectedError, match="size mismatch"):
            await client.update_weights_from_disk(str(models.narrow), weight_version="never")
        assert await client.get_weight_version() == "step-1"  # failed updates change nothing
        still_b = await client.generate(request)
        await client.update_weights_from_disk(str(models.a))  # no version given: the CPU engine bumps a counter
        bumped = await client.get_weight_version()
        back = await client.generate(request)
    assert missing.value.status == 400
    assert before.output_ids == ref_a.greedy(prompt, 16)[0]
    assert after.output_ids == ref_b.greedy(prompt, 16)[0] != before.output_ids
    assert_close(after.output_logprobs, ref_b.greedy(prompt, 16)[1])
    assert (after.weight_version, info.weight_version, info.model_path) == ("step-1", "step-1", str(models.b))
    assert still_b.output_ids == after.output_ids
    assert bumped not in ("step-1", "default")
    assert back.weight_version == bumped
    assert back.output_ids == before.output_ids


async def test_a_next_turn_reuses_the_finished_turns_kv_until_a_flush_or_a_weight_update(
    mutable_engine: str, models: Models, ref_a: Reference, ref_b: Reference
) -> None:
    """The prefix store: a request that continues a finished one (an agent's next turn: its prompt is the last
    prompt, the last output and an observation) reads only its new tokens and gets the answer of a fresh full
    forward; after a flush or a weight update nothing old is reused (the KV was the old weights')."""
    first_prompt = prompts(7, seed=7)[6]  # 55 tokens
    async with SglangClient(mutable_engine, timeout_s=60) as client:
        first = await client.generate(greedy_request(first_prompt, 12, ignore_eos=True))
        turn = [*first_prompt, *first.output_ids, *prompts(3, seed=8)[2]]
        before = (await server_state(mutable_engine))["prefix_cache"]
        second = await client.generate(greedy_request(turn, 10, ignore_eos=True))
        after = (await server_state(mutable_engine))["prefix_cache"]
        assert await client.flush_cache()
        flushed = (await server_state(mutable_engine))["prefix_cache"]
        again = await client.generate(greedy_request(turn, 10, ignore_eos=True))
        await client.update_weights_from_disk(str(models.b), weight_version="b")
        updated = (await server_state(mutable_engine))["prefix_cache"]
        third = await client.generate(greedy_request(turn, 10, ignore_eos=True))
        final = (await server_state(mutable_engine))["prefix_cache"]
        await client.update_weights_from_disk(str(models.a), weight_version="default")  # leave model A loaded
    assert after["hits"] == before["hits"] + 1
    assert after["tokens_reused"] - before["tokens_reused"] == len(first_prompt) + len(first.output_ids) - 1
    want_ids, _ = ref_a.greedy(turn, 10)
    assert second.output_ids[: len(want_ids)] == want_ids
    assert_close(second.output_logprobs, ref_a.output_logprobs(turn, second.output_ids))
    assert flushed["entries"] == 0 and flushed["bytes"] == 0
    assert again.output_ids == second.output_ids  # computed afresh: the same answer
    assert_close(again.output_logprobs, second.output_logprobs)
    assert updated["entries"] == 0
    assert final["hits"] == updated["hits"]  # the old weights' KV is gone
    assert_close(third.output_logprobs, ref_b.output_logprobs(turn, third.output_ids))


def split_point(got: Sequence[float], want: Sequence[float]) -> int:
    """How many leading logprobs agree."""
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        if abs(g - w) > LOGPROB_TOL:
            return index
    return len(got)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pause_update_continue(
    mutable_engine: str, models: Models, ref_a: Reference, ref_b: Reference, mode: str
) -> None:
    """The RL weight push: pause, update, continue. Held requests finish with the new weights."""
    prompt = prompts(1, seed=7)[0]
    request = greedy_request(prompt, 1500, ignore_eos=True)
    results: list[GenerateResult] = []
    async with SglangClient(mutable_engine, timeout_s=120) as client:
        async with anyio.create_task_group() as tg:

            async def held() -> None:
                results.append(await client.generate(request))

            tg.start_soon(held)
            await wait_running(mutable_engine)
            await client.pause_generation(mode)  # type: ignore[arg-type]
            assert (await server_state(mutable_engine))["paused"] == mode
            await anyio.sleep(0.5)  # the window in which a paused engine must not finish it
            assert not results, "a paused engine finished a request"
            await client.update_weights_from_disk(str(models.b), weight_version=f"pushed-{mode}")
            await client.continue_generation()
        await client.update_weights_from_disk(str(models.a), weight_version="default")
    (result,) = results
    assert result.finish_reason == "length"
    assert len(result.output_ids) == 1500
    assert result.weight_version == f"pushed-{mode}"
    with_a = ref_a.output_logprobs(prompt, result.output_ids)
    switch = split_point(result.output_logprobs, with_a)
    assert 0 < switch < 1500, "the update did not land mid-generation"
    if mode == "retract":  # the KV cache was recomputed: from the switch on, exactly model B
        tail = ref_b.output_logprobs(prompt, result.output_ids)[switch:]
        assert_close(result.output_logprobs[switch:], tail)


async def test_pause_abort_ends_requests_and_holds_new_ones(mutable_engine: str) -> None:
    prompt = prompts(1, seed=8)[0]
    results: dict[str, GenerateResult] = {}
    doomed_done = anyio.Event()
    async with SglangClient(mutable_engine, timeout_s=120) as client:
        async with anyio.create_task_group() as tg:

            async def run(name: str, max_new: int) -> None:
                results[name] = await client.generate(greedy_request(prompt, max_new, ignore_eos=True))
                if name == "doomed":
                    doomed_done.set()

            tg.start_soon(run, "doomed", 3000)
            await wait_running(mutable_engine)
            await client.pause_generation("abort")
            with anyio.fail_after(10):
                await doomed_done.wait()
            tg.start_soon(run, "later", 4)
            await anyio.sleep(0.5)  # the window in which a paused engine must not run it
            assert "later" not in results, "a request ran while generation was paused"
            await client.continue_generation()
    doomed, later = results["doomed"], results["later"]
    assert doomed.finish_reason == "abort"
    assert doomed.finish_message
    assert len(doomed.output_ids) == len(doomed.output_logprobs) < 3000
    assert later.finish_reason == "length"
    assert len(later.output_ids) == 4


async def test_api_key_and_engine_killed_mid_request(models: Models, tmp_path: Path) -> None:
    server = await anyio.to_thread.run_sync(start_engine, models.a, tmp_path / "log", "--api-key", "sekret")
    try:
        async with SglangClient(server.url, timeout_s=10) as anonymous:
            with pytest.raises(EngineRejectedError) as denied:
                await anonymous.get_model_info()
        assert denied.value.status == 401
        errors: list[BaseException] = []
        async with SglangClient(server.url, timeout_s=60, api_key="sekret") as client:
            assert await client.health()

            async def doomed() -> None:
                try:
                    await client.generate(greedy_request(prompts(1)[0], 3000, ignore_eos=True))
                except EngineError as exc:
                    errors.append(exc)

            started = time.monotonic()
            async with anyio.create_task_group() as tg:
                tg.start_soon(doomed)
                await wait_running(server.url, api_key="sekret")
                os.kill(server.proc.pid, signal.SIGKILL)
            assert time.monotonic() - started < 30
            assert not await client.health(timeout_s=3)
        (error,) = errors
        assert isinstance(error, EngineUnavailableError), error
        assert not isinstance(error, EngineTimeoutError), error
    finally:
        await anyio.to_thread.run_sync(server.stop)


# ---------------------------------------------------------------- against servers that misbehave

Respond = Callable[[str, str, bytes], Awaitable[bytes | None]]


def http_answer(status: int, body: bytes | str, content_type: str = "application/json") -> bytes:
    data = body.encode() if isinstance(body, str) else body
    head = f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {len(data)}\r\n"
    head += "connection: close\r\n\r\n"
    return head.encode() + data


async def read_request(stream: SocketStream) -> tuple[str, str, bytes]:
    data = b""
    with anyio.fail_after(10):
        while b"\r\n\r\n" not in data:
            data += await stream.receive()
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        length = next(
            (int(v) for k, v in (line.split(":", 1) for line in lines[1:]) if k.lower() == "content-length"), 0
        )
        while len(body) < length:
            body += await stream.receive()
    return method, path, body


@asynccontextmanager
async def fake_engine(respond: Respond) -> AsyncIterator[str]:
    """A raw HTTP/1.1 server on loopback; ``respond`` returns the bytes to send, None to hang up, or hangs."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(SocketAttribute.local_port)

    async def handle(stream: SocketStream) -> None:
        async with stream:
            answer = await respond(*await read_request(stream))
            if answer is not None:
                await stream.send(answer)

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            tg.cancel_scope.cancel()


SGLANG_ANSWER = {
    "text": " world",
    "output_ids": [11, 12],
    "meta_info": {
        "id": "abc",
        "finish_reason": {"type": "stop", "matched": 12},
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "cached_tokens": 1,
        "weight_version": "7",
        "e2e_latency": 0.25,
        "num_retractions": 0,
        "output_token_logprobs": [[-0.5, 11, " wor"], [-1.25, 12, "ld"]],
    },
}


def sglang_answer(**meta: Any) -> bytes:
    return msgspec.json.encode({**SGLANG_ANSWER, "meta_info": {**SGLANG_ANSWER["meta_info"], **meta}})


def test_decode_sglang_answer() -> None:
    result = decode_generate_response(sglang_answer(), url="u", return_logprob=True, client_latency_s=0.5)
    assert result.output_ids == [11, 12]
    assert result.output_logprobs == [-0.5, -1.25]
    assert (result.finish_reason, result.matched_stop, result.weight_version) == ("stop", 12, "7")
    assert (result.prompt_tokens, result.completion_tokens, result.cached_tokens) == (3, 2, 1)
    assert (result.e2e_latency_s, result.client_latency_s, result.rid, result.text) == (0.25, 0.5, "abc", " world")
    no_ids = msgspec.json.encode({"meta_info": msgspec.json.decode(sglang_answer())["meta_info"]})
    assert decode_generate_response(no_ids, url="u", return_logprob=True, client_latency_s=0).output_ids == [11, 12]
    plain = sglang_answer(output_token_logprobs=None, finish_reason={"type": "length", "length": 2}, e2e_latency=None)
    result = decode_generate_response(plain, url="u", return_logprob=False, client_latency_s=0.5)
    assert (result.output_logprobs, result.finish_reason, result.e2e_latency_s) == ([], "length", 0.5)
    assert issubclass(EngineTimeoutError, EngineUnavailableError)
    assert issubclass(EngineError, InfraError)


MALFORMED = {
    "not json": (b"<html>oops</html>", "not JSON"),
    "no meta_info": (b'{"text": "x", "output_ids": [1]}', "meta_info"),
    "wrong type": (sglang_answer(prompt_tokens="three"), "prompt_tokens"),
    "unfinished": (sglang_answer(finish_reason=None), "finish_reason is null"),
    "unknown finish": (sglang_answer(finish_reason={"type": "exploded"}), "exploded"),
    "misaligned": (sglang_answer(output_token_logprobs=[[-0.5, 11, None], [-1.0, 99, None]]), "token 99"),
    "short logprobs": (sglang_answer(output_token_logprobs=[[-0.5, 11, None]]), "1 output_token_logprobs for 2"),
    "no logprobs": (sglang_answer(output_token_logprobs=None), "no output_token_logprobs"),
}


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_malformed_answers_raise_response_errors(case: str) -> None:
    body, expected = MALFORMED[case]

    async def respond(method: str, path: str, request: bytes) -> bytes:
        return http_answer(200, body)

    async with fake_engine(respond) as url, SglangClient(url, timeout_s=5) as client:
        with pytest.raises(EngineResponseError, match=re.escape(expected)) as caught:
            await client.generate(greedy_request([1, 2, 3], 2))
    assert caught.value.body_head == body.decode()[:300]
    assert url in str(caught.value)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_http_failures_map_to_engine_errors(anyio_backend: str) -> None:
    counts: dict[str, int] = {}

    async def respond(method: str, path: str, body: bytes) -> bytes | None:
        counts[path] = counts.get(path, 0) + 1
        if path == "/health":  # unhealthy once, then fine: health is retried
            return http_answer(503 if counts[path] == 1 else 200, b"")
        if path == "/generate":
            request = msgspec.json.decode(body)
            if request["input_ids"] == [500]:
                return http_answer(500, b"Internal Server Error", "text/plain")
            if request["input_ids"] == [400]:
                return http_answer(400, b'{"object": "error", "message": "input too long", "code": 400}')
            if request["input_ids"] == [0]:
                return None  # hang up without an answer
            await anyio.sleep_forever()
        if path == "/update_weights_from_disk":
            return http_answer(400, b'{"success": false, "message": "Failed to get weights iterator: nope"}')
        if path == "/flush_cache":
            return http_answer(400, b"Cache not flushed.", "text/plain")
        return http_answer(404, b'{"detail": "Not Found"}')

    async with fake_engine(respond) as url, SglangClient(url, timeout_s=0.5) as client:
        assert await client.health()
        assert counts["/health"] == 2
        with pytest.raises(EngineUnavailableError, match="HTTP 500") as failed:
            await client.generate(greedy_request([500], 2))
        assert not isinstance(failed.value, EngineTimeoutError)
        assert counts["/generate"] == 1  # generate is never retried
        with pytest.raises(EngineRejectedError, match="input too long") as rejected:
            await client.generate(greedy_request([400], 2))
        assert rejected.value.status == 400
        with pytest.raises(EngineUnavailableError, match="RemoteProtocolError"):
            await client.generate(greedy_request([0], 2))
        started = time.monotonic()
        with pytest.raises(EngineTimeoutError, match=re.escape("no answer within 0.5 s")):
            await client.generate(greedy_request([7], 2))
        assert 0.45 < time.monotonic() - started < 2.0
        with pytest.raises(EngineRejectedError, match="nope"):
            await client.update_weights_from_disk("/nope")
        assert not await client.flush_cache()
        with pytest.raises(EngineRejectedError, match="Not Found"):
            await client.get_model_info()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_unreachable_engine(anyio_backend: str) -> None:
    async def respond(method: str, path: str, body: bytes) -> bytes:
        return http_answer(200, b"{}")

    async with fake_engine(respond) as url:
        pass  # the port is closed again: nothing listens there now
    async with SglangClient(url, timeout_s=5, connect_timeout_s=1) as client:
        assert not await client.health(timeout_s=2)
        with pytest.raises(EngineUnavailableError, match="ConnectError"):
            await client.generate(greedy_request([1], 1))
    async with OpenAIChatClient(url, "m", timeout_s=5) as chat:
        with pytest.raises(EngineUnavailableError):
            await chat.chat([ChatMessage("user", "hi")], max_tokens=1)


async def test_chat_client_against_openai_shapes() -> None:
    seen: list[dict[str, Any]] = []

    async def respond(method: str, path: str, body: bytes) -> bytes:
        seen.append({"path": path, **msgspec.json.decode(body)})
        if len(seen) == 1:
            answer = {
                "id": "x",
                "object": "chat.completion",
                "model": "gpt-test",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
            }
            return http_answer(200, msgspec.json.encode(answer))
        if len(seen) == 2:
            return http_answer(429, b'{"error": {"message": "rate limited"}}')
        return http_answer(200, b'{"choices": []}')

    async with fake_engine(respond) as url, OpenAIChatClient(f"{url}/v1", "gpt-test", api_key="k", timeout_s=5) as chat:
        result = await chat.chat([ChatMessage("user", "hi")], max_tokens=3, temperature=0.5, stop=["\n"])
        with pytest.raises(EngineUnavailableError, match="429"):
            await chat.chat([ChatMessage("user", "hi")], max_tokens=3)
        with pytest.raises(EngineResponseError, match="no choices"):
            await chat.chat([ChatMessage("user", "hi")], max_tokens=3)
    assert (result.content, result.finish_reason, result.prompt_tokens, result.completion_tokens) == (
        "hello",
        "stop",
        5,
        1,
    )
    assert seen[0] == {
        "path": "/v1/chat/completions",
        "model": "gpt-test",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "temperature": 0.5,
        "stop": ["\n"],
    }
    assert chat_path("http://h:1") == "/v1/chat/completions"
    assert chat_path("https://api.x.com/v1/") == "/chat/completions"
