"""Wire types of the inference engines: SGLang's native HTTP API and OpenAI-compatible chat
(docs/architecture.md 6.2, 5.2).

Written from SGLang's documentation (docs.sglang.io: basic_usage/native_api, basic_usage/sampling_params) and
source (python/sglang/srt/entrypoints/http_server.py for the routes and response bodies,
managers/io_struct.py for GenerateReqInput / UpdateWeightFromDiskReqInput / PauseGenerationReqInput,
sampling/sampling_params.py for the parameter names, managers/tokenizer_manager.py for ``meta_info``,
managers/schedule_batch.py for the FINISH_* reasons, layers/sampler.py for what a logprob means).

A non-streamed ``POST /generate`` answers::

    {"text": "...", "output_ids": [...],
     "meta_info": {"id": rid, "finish_reason": {"type": "stop"|"length"|"abort", "matched"?: id|str,
                   "length"?: n, "message"?: str},
                   "prompt_tokens": n, "completion_tokens": n, "cached_tokens": n, "weight_version": "...",
                   "e2e_latency": s, "output_token_logprobs": [[logprob, token_id, text|null], ...]}}

Logprob convention (SGLang's Sampler): with ``temperature == 0`` (greedy; SGLang turns it into top_k=1 at
temperature 1) a token's logprob is ``log_softmax(logits)``, the model's own distribution. With
``temperature > 0`` it is ``log_softmax(logits / temperature)``: after temperature scaling, before top-k /
top-p / min-p truncation and renormalisation. (SGLang servers started with SGLANG_RETURN_ORIGINAL_LOGPROB=1
report the unscaled ``log_softmax(logits)`` instead.) The trainer must compute its logprobs the same way
(divide by the rollout temperature) for importance ratios to be 1 on-policy.

Unknown fields in answers are ignored (engines add fields over versions); a missing or mistyped field
that we need is an EngineResponseError quoting the body.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

import msgspec

from swectl.errors import EngineResponseError

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "retract", "in_place"]

# ---------------------------------------------------------------- requests (SGLang names)


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """SGLang's sampling parameters (the subset swectl uses). Defaults are SGLang's and are not sent."""

    max_new_tokens: Annotated[int, msgspec.Meta(ge=0)] = 128
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None  # per-request seed (SGLang's name; used with deterministic sampling)


class GenerateRequest(msgspec.Struct, frozen=True):
    """Body of ``POST /generate``: token ids in (docs/architecture.md 6.2), always a single request."""

    input_ids: list[int]
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    return_logprob: bool = True  # SGLang's default is false; swectl keeps rollout logprobs (docs/architecture.md 6.2)
    rid: str | None = None


class UpdateWeightsFromDiskRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """Body of ``POST /update_weights_from_disk`` (SGLang's UpdateWeightFromDiskReqInput)."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class InitWeightsUpdateGroupRequest(msgspec.Struct, frozen=True):
    """Body of ``POST /init_weights_update_group`` (SGLang's InitWeightsUpdateGroupReqInput): join the trainer's
    weight group at ``master_address:master_port`` as rank ``rank_offset`` (plus the server's TP rank)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """Body of ``POST /update_weights_from_distributed`` (SGLang's UpdateWeightsFromDistributedReqInput): receive
    these tensors, in this order, from rank 0 of the weight group and load them."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class DestroyWeightsUpdateGroupRequest(msgspec.Struct, frozen=True):
    """Body of ``POST /destroy_weights_update_group``."""

    group_name: str = "weight_update_group"


class GetWeightsByNameRequest(msgspec.Struct, frozen=True):
    """Body of ``POST /get_weights_by_name``: the first ``truncate_size`` values of a parameter (for checks)."""

    name: str
    truncate_size: int = 100


class PauseGenerationRequest(msgspec.Struct, frozen=True):
    """Body of ``POST /pause_generation``: abort in-flight requests, or hold them (in_place / retract)."""

    mode: PauseMode = "abort"


class ChatMessage(msgspec.Struct, frozen=True):
    """One message of an OpenAI-style chat request."""
    role: str
    content: str


class ChatRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """Body of ``POST /v1/chat/completions`` (OpenAI)."""

    model: str
    messages: list[ChatMessage]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] | None = None
    seed: int | None = None


# ---------------------------------------------------------------- results handed to swectl


class GenerateResult(msgspec.Struct, frozen=True):
    """One finished generation: the exact output ids with one logprob each (docs/architecture.md 6.2)."""

    output_ids: list[int]
    output_logprobs: list[float]  # one per output id; empty when logprobs were not requested
    finish_reason: FinishReason  # "abort": the engine ended it (pause, abort, engine error): an infra failure
    prompt_tokens: int
    completion_tokens: int
    weight_version: str  # "" when the engine does not report one
    e2e_latency_s: float  # the engine's own measure when it reports one, else the client's
    client_latency_s: float  # request sent to body decoded, measured by the client
    text: str | None = None
    matched_stop: int | str | None = None  # the token id or string that ended a "stop"
    finish_message: str | None = None  # why an "abort" happened
    rid: str | None = None
    cached_tokens: int = 0


class ChatResult(msgspec.Struct, frozen=True):
    """The answer of a chat completion: content, finish reason and token counts."""
    content: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    model: str
    latency_s: float
    reasoning_content: str | None = None


class EngineInfo(msgspec.Struct, frozen=True):
    """``GET /get_model_info``."""

    model_path: str
    tokenizer_path: str | None = None
    is_generation: bool = True
    weight_version: str = ""


class UpdateWeightsResult(msgspec.Struct, frozen=True):
    """SGLang's answer to a weight update."""
    success: bool
    message: str = ""
    num_paused_requests: int | None = 0


# ---------------------------------------------------------------- SGLang's answer, as it is on the wire


class SglFinishReason(msgspec.Struct, frozen=True):
    """SGLang's finish_reason object (type, matched stop, length, message)."""
    type: str
    matched: int | str | list[int] | None = None
    length: int | None = None
    message: str | None = None


class SglMetaInfo(msgspec.Struct, frozen=True):
    """SGLang's meta_info of a /generate answer: finish reason, token counts, logprobs, weight version."""
    finish_reason: SglFinishReason | None
    prompt_tokens: int
    completion_tokens: int
    id: str | None = None
    weight_version: str | int | None = None
    cached_tokens: int = 0
    e2e_latency: float | None = None
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None


class SglGenerateResponse(msgspec.Struct, frozen=True):
    """SGLang's /generate answer as it comes over the wire."""
    meta_info: SglMetaInfo
    output_ids: list[int] | None = None
    text: str | None = None


class OaiMessage(msgspec.Struct, frozen=True):
    """The message of an OpenAI chat-completion choice."""
    content: str | None = None
    role: str = "assistant"
    reasoning_content: str | None = None


class OaiChoice(msgspec.Struct, frozen=True):
    """One choice of an OpenAI chat-completion answer."""
    message: OaiMessage
    finish_reason: str | None = None
    index: int = 0


class OaiUsage(msgspec.Struct, frozen=True):
    """The token usage of an OpenAI chat-completion answer."""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class OaiChatResponse(msgspec.Struct, frozen=True):
    """An OpenAI chat-completion answer as it comes over the wire."""
    choices: list[OaiChoice]
    model: str | None = None
    usage: OaiUsage | None = None


# ---------------------------------------------------------------- decoding with errors that quote the body

T = TypeVar("T")
_FINISH_TYPES: frozenset[str] = frozenset({"stop", "length", "abort"})


def decode_body(body: bytes, kind: type[T], *, url: str, what: str) -> T:
    """Decode a JSON body into ``kind``; anything else is an EngineResponseError naming ``what``."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise EngineResponseError(url, f"{what}: unexpected answer: {exc}", body) from exc
    except msgspec.DecodeError as exc:
        raise EngineResponseError(url, f"{what}: answer is not JSON: {exc}", body) from exc


def _output_ids(wire: SglGenerateResponse, *, url: str, body: bytes) -> list[int]:
    if wire.output_ids is not None:
        return wire.output_ids
    if wire.meta_info.output_token_logprobs is not None:  # engines that only report ids inside the logprobs
        return [token for _, token, _ in wire.meta_info.output_token_logprobs]
    raise EngineResponseError(url, "/generate: answer has neither output_ids nor output_token_logprobs", body)


def _output_logprobs(wire: SglGenerateResponse, ids: list[int], *, url: str, body: bytes) -> list[float]:
    entries = wire.meta_info.output_token_logprobs
    if entries is None:
        raise EngineResponseError(
            url, "/generate: return_logprob was set but meta_info has no output_token_logprobs", body
        )
    if len(entries) != len(ids):
        raise EngineResponseError(
            url, f"/generate: {len(entries)} output_token_logprobs for {len(ids)} output_ids", body
        )
    for position, ((_, token, _), expected) in enumerate(zip(entries, ids, strict=True)):
        if token != expected:
            raise EngineResponseError(
                url,
                f"/generate: output_token_logprobs[{position}] is for token {token}, output_ids has {expected}",
                body,
            )
    return [logprob for logprob, _, _ in entries]


def _matched(reason: SglFinishReason) -> int | str | None:
    if isinstance(reason.matched, list):
        return reason.matched[0] if reason.matched else None
    return reason.matched


def decode_generate_response(body: bytes, *, url: str, return_logprob: bool, client_latency_s: float) -> GenerateResult:
    """SGLang's ``/generate`` answer -> GenerateResult, checking that ids and logprobs line up."""
    wire = decode_body(body, SglGenerateResponse, url=url, what="/generate")
    reason = wire.meta_info.finish_reason
    if reason is None:
        raise EngineResponseError(url, "/generate: finish_reason is null (the request did not finish)", body)
    if reason.type not in _FINISH_TYPES:
        raise EngineResponseError(url, f"/generate: unknown finish_reason type {reason.type!r}", body)
    ids = _output_ids(wire, url=url, body=body)
    logprobs = _output_logprobs(wire, ids, url=url, body=body) if return_logprob else []
    meta = wire.meta_info
    return GenerateResult(
        output_ids=ids,
        output_logprobs=logprobs,
        finish_reason=reason.type,  # type: ignore[arg-type]  # checked against _FINISH_TYPES above
        prompt_tokens=meta.prompt_tokens,
        completion_tokens=meta.completion_tokens,
        weight_version="" if meta.weight_version is None else str(meta.weight_version),
        e2e_latency_s=meta.e2e_latency if meta.e2e_latency is not None else client_latency_s,
        client_latency_s=client_latency_s,
        text=wire.text,
        matched_stop=_matched(reason),
        finish_message=reason.message,
        rid=meta.id,
        cached_tokens=meta.cached_tokens,
    )


def decode_chat_response(body: bytes, *, url: str, model: str, latency_s: float) -> ChatResult:
    wire = decode_body(body, OaiChatResponse, url=url, what="/v1/chat/completions")
    if not wire.choices:
        raise EngineResponseError(url, "/v1/chat/completions: answer has no choices", body)
    choice = wire.choices[0]
    usage = wire.usage or OaiUsage()
    return ChatResult(
        content=choice.message.content or "",
        finish_reason=choice.finish_reason,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        model=wire.model or model,
        latency_s=latency_s,
        reasoning_content=choice.message.reasoning_content,
    )
