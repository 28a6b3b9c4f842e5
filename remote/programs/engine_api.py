"""The CPU engine's HTTP API (remote/programs/cpu_engine.py serves it): SGLang's native endpoints and OpenAI's
chat completions as Starlette routes over the scheduler (remote/programs/engine_scheduler.py).

The request bodies, SGLang's error body (``BadRequest`` becomes an HTTP 400), the ``Authorization: Bearer KEY``
middleware, the handlers (generate, health, weight updates from disk and over the weight group of
remote/programs/weight_group.py, weights by name, model and server info, pause/continue, models, chat) and the
Starlette app built from them.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from functools import partial
from http import HTTPStatus
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec
import torch
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from swectl.engine.wire import (
    ChatMessage,
    DestroyWeightsUpdateGroupRequest,
    GetWeightsByNameRequest,
    InitWeightsUpdateGroupRequest,
    PauseGenerationRequest,
    SamplingParams,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
)
from swectl.errors import SwectlError
from swectl.remote.programs.engine_batch import Seq
from swectl.remote.programs.engine_scheduler import CONTROL_TIMEOUT_S, PAUSE_ACK_TIMEOUT_S, Scheduler

T = TypeVar("T")

HEALTH_GENERATE_TIMEOUT_S = 20.0
WEIGHT_GROUP_TIMEOUT_S = 300.0  # joining the trainer's weight group, and each collective in it

# ---------------------------------------------------------------- request bodies


class GenerateBody(msgspec.Struct, frozen=True):
    """SGLang's GenerateReqInput, single request only."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    return_logprob: bool | None = None
    rid: str | None = None
    stream: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool = False


class ChatBody(msgspec.Struct, frozen=True):
    """OpenAI's chat completion request (the fields the engine uses)."""

    messages: list[ChatMessage]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False


class BadRequest(SwectlError):
    """Becomes an HTTP 400 with SGLang's error body."""


# ---------------------------------------------------------------- HTTP


def _json(content: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(content), status_code=status, media_type="application/json")


def _error(status: int, message: str) -> Response:
    kind = HTTPStatus(status).phrase
    return _json({"object": "error", "message": message, "type": kind, "param": None, "code": status}, status)


async def _decode(request: Request, kind: type[T]) -> T:
    body = await request.body()
    try:
        return msgspec.json.decode(body or b"{}", type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise BadRequest(f"invalid request body: {exc}") from exc


def _handles_bad_requests(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except BadRequest as exc:
            return _error(400, str(exc))

    return wrapped


class ApiKeyMiddleware:
    """``Authorization: Bearer KEY`` on every route, as SGLang's --api-key."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != self.expected:
            await _error(401, "Unauthorized: missing or wrong API key")(scope, receive, send)
            return
        await self.app(scope, receive, send)


class Api:
    """The HTTP endpoints (SGLang's subset and OpenAI chat) over the scheduler."""

    def __init__(self, scheduler: Scheduler, *, served_model_name: str) -> None:
        self.scheduler = scheduler
        self.model = scheduler.model
        self.served_model_name = served_model_name
        self.weight_groups: dict[str, Any] = {}  # torch.distributed groups with the trainer, by name

    def routes(self) -> list[Route]:
        bad = _handles_bad_requests
        return [
            Route("/health", self.health, methods=["GET"]),
            Route("/health_generate", self.health_generate, methods=["GET"]),
            Route("/generate", bad(self.generate), methods=["POST", "PUT"]),
            Route("/flush_cache", self.flush_cache, methods=["GET", "POST"]),
            Route("/update_weights_from_disk", bad(self.update_weights_from_disk), methods=["POST"]),
            Route("/init_weights_update_group", bad(self.init_weights_update_group), methods=["POST"]),
            Route("/update_weights_from_distributed", bad(self.update_weights_from_distributed), methods=["POST"]),
            Route("/destroy_weights_update_group", bad(self.destroy_weights_update_group), methods=["POST"]),
            Route("/get_weights_by_name", bad(self.get_weights_by_name), methods=["GET", "POST"]),
            Route("/get_model_info", self.get_model_info, methods=["GET"]),
            Route("/get_weight_version", self.get_weight_version, methods=["GET"]),
            Route("/get_server_info", self.get_server_info, methods=["GET"]),
            Route("/pause_generation", bad(self.pause_generation), methods=["POST"]),
            Route("/continue_generation", self.continue_generation, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", bad(self.chat_completions), methods=["POST"]),
        ]

    # ---- building requests

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise BadRequest("the prompt is empty")
        bad = next((i for i in ids if not 0 <= i < self.model.vocab_size), None)
        if bad is not None:
            raise BadRequest(f"token id {bad} is outside the vocabulary (size {self.model.vocab_size})")
        if len(ids) >= self.model.context_length:
            raise BadRequest(
                f"The input ({len(ids)} tokens) is longer than the model's context length "
                f"({self.model.context_length} tokens)."
            )

    def _seq(self, ids: list[int], params: SamplingParams, *, rid: str | None, return_logprob: bool) -> Seq:
        self._check_prompt(ids)
        if params.top_k == 0 or params.top_k < -1:
            raise BadRequest(f"top_k must be -1 (disabled) or at least 1, got {params.top_k}")
        stops = (params.stop,) if isinstance(params.stop, str) else tuple(params.stop or ())
        stop_ids = frozenset(params.stop_token_ids or ()) | (frozenset() if params.ignore_eos else self.model.eos_ids)
        seed = params.sampling_seed if params.sampling_seed is not None else secrets.randbits(63)
        return Seq(
            rid=rid or uuid.uuid4().hex,
            prompt=ids,
            params=params,
            return_logprob=return_logprob,
            max_new=min(params.max_new_tokens, self.model.context_length - len(ids)),
            stop_ids=stop_ids,
            stop_strs=tuple(s for s in stops if s),
            generator=torch.Generator().manual_seed(seed),
        )

    def _text(self, seq: Seq) -> str:
        text = self.model.tokenizer.decode(seq.output, skip_special_tokens=seq.params.skip_special_tokens)
        matched = (seq.finish or {}).get("matched")
        if isinstance(matched, str) and not seq.params.no_stop_trim and matched in text:
            text = text[: text.index(matched)]
        return text

    async def _run(self, seq: Seq) -> Seq:
        self.scheduler.submit(seq)
        await seq.done.wait()  # bounded by the scheduler: every request finishes (stop, length or abort)
        return seq

    # ---- SGLang native API

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def health_generate(self, request: Request) -> Response:
        if self.scheduler.paused is not None:
            return Response(status_code=200)
        seq = self._seq([0], SamplingParams(max_new_tokens=1, temperature=0.0), rid=None, return_logprob=False)
        with anyio.move_on_after(HEALTH_GENERATE_TIMEOUT_S):
            await self._run(seq)
        ok = seq.done.is_set() and (seq.finish or {}).get("type") != "abort"
        return Response(status_code=200 if ok else 503)

    async def generate(self, request: Request) -> Response:
        body = await _decode(request, GenerateBody)
        if body.stream:
            raise BadRequest("streaming is not supported by the CPU engine")
        if body.logprob_start_len is not None and body.logprob_start_len >= 0:
            raise BadRequest("prompt logprobs (logprob_start_len >= 0) are not supported by the CPU engine")
        if body.top_logprobs_num:
            raise BadRequest("top logprobs are not supported by the CPU engine")
        if (body.text is None) == (body.input_ids is None):
            raise BadRequest("give exactly one of text and input_ids")
        ids = body.input_ids if body.input_ids is not None else self.model.tokenizer(body.text).input_ids
        seq = await self._run(
            self._seq(ids, body.sampling_params, rid=body.rid, return_logprob=bool(body.return_logprob))
        )
        return _json(self._generate_answer(seq, text_in_logprobs=body.return_text_in_logprobs))

    def _generate_answer(self, seq: Seq, *, text_in_logprobs: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": seq.rid,
            "finish_reason": seq.finish,
            "prompt_tokens": len(seq.prompt),
            "completion_tokens": len(seq.output),
            "cached_tokens": 0,
            "weight_version": seq.weight_version,
            "e2e_latency": seq.finished_at - seq.created,
        }
        if seq.return_logprob:
            decode = self.model.tokenizer.decode
            meta["output_token_logprobs"] = [
                [logprob, token, decode([token]) if text_in_logprobs else None]
                for logprob, token in zip(seq.logprobs, seq.output, strict=True)
            ]
        return {"text": self._text(seq), "output_ids": seq.output, "meta_info": meta}

    async def flush_cache(self, request: Request) -> Response:
        # As SGLang: declined while requests run (then no forward is in flight: the store is not in use)
        if self.scheduler.busy:
            return Response("Cache not flushed: requests are running or waiting.\n", status_code=400)
        self.model.prefixes.clear()
        return Response("Cache flushed.\n", status_code=200)

    async def update_weights_from_disk(self, request: Request) -> Response:
        body = await _decode(request, UpdateWeightsFromDiskRequest)
        path = Path(body.model_path)
        if not await anyio.Path(path).is_dir():
            return _json({"success": False, "message": f"Failed to update weights: {path} is not a folder"}, 400)
        held = self.scheduler.held
        update = await self.scheduler.update_weights(path, body.weight_version, abort_all=body.abort_all_requests)
        if update.cancelled:
            message = f"Failed to update weights: still waiting for in-flight requests after {CONTROL_TIMEOUT_S:g} s"
            return _json({"success": False, "message": message}, 503)
        if update.error is not None:
            return _json({"success": False, "message": f"Failed to update weights: {update.error}"}, 400)
        message = f"Succeeded to update model weights. Weight version is {self.scheduler.weight_version}."
        return _json({"success": True, "message": message, "num_paused_requests": held})

    # ---- the distributed weight sync (remote/programs/weight_group.py; gloo on CPU)

    async def init_weights_update_group(self, request: Request) -> Response:
        body = await _decode(request, InitWeightsUpdateGroupRequest)
        device = self.model.device
        if body.backend == "nccl" and device.type != "cuda":
            return _json({"success": False, "message": f"the CPU engine on {device} joins weight groups over gloo, "
                                                       "not nccl"}, 400)
        if body.group_name in self.weight_groups:
            return _json({"success": False, "message": f"already in weight group {body.group_name!r}"}, 400)
        from swectl.remote.programs import weight_group

        try:
            group = await anyio.to_thread.run_sync(
                partial(weight_group.join, body.master_address, body.master_port, body.rank_offset, body.world_size,
                        body.group_name, body.backend, WEIGHT_GROUP_TIMEOUT_S))
        except Exception as exc:
            return _json({"success": False, "message": f"Failed to init group: {type(exc).__name__}: {exc}"}, 400)
        self.weight_groups[body.group_name] = group
        return _json({"success": True, "message": f"Succeeded to init group {body.group_name}."})

    async def update_weights_from_distributed(self, request: Request) -> Response:
        body = await _decode(request, UpdateWeightsFromDistributedRequest)
        group = self.weight_groups.get(body.group_name)
        if group is None:
            return _json({"success": False, "message": f"no weight group {body.group_name!r}: "
                                                       "POST /init_weights_update_group first"}, 400)
        if not len(body.names) == len(body.dtypes) == len(body.shapes):
            return _json({"success": False, "message": "names, dtypes and shapes differ in length"}, 400)
        from swectl.remote.programs import weight_group
        from swectl.rl.weight_sync import DTYPE_BYTES, ParamSpec

        bad = sorted({d for d in body.dtypes if d not in DTYPE_BYTES})
        if bad:
            return _json({"success": False, "message": f"unknown dtypes {', '.join(bad)}"}, 400)
        specs = [ParamSpec(n, d, s) for n, d, s in zip(body.names, body.dtypes, body.shapes, strict=True)]
        # receive first, whatever the names: the trainer is already broadcasting and must not be left waiting
        received = await anyio.to_thread.run_sync(weight_group.receive, specs, group, self.model.device)
        dtype = next(self.model.net.parameters()).dtype
        named = [(spec.name, t.to(dtype) if t.is_floating_point() else t) for spec, t in zip(specs, received,
                                                                                               strict=True)]
        update = await self.scheduler.update_weights(None, body.weight_version, abort_all=body.abort_all_requests,
                                                     tensors=named)
        if update.cancelled:
            message = f"Failed to update weights: still waiting for in-flight requests after {CONTROL_TIMEOUT_S:g} s"
            return _json({"success": False, "message": message}, 503)
        if update.error is not None:
            return _json({"success": False, "message": f"Failed to update weights: {update.error}"}, 400)
        return _json({"success": True, "message": f"Succeeded to update {len(named)} parameters."})

    async def destroy_weights_update_group(self, request: Request) -> Response:
        body = await _decode(request, DestroyWeightsUpdateGroupRequest)
        group = self.weight_groups.pop(body.group_name, None)
        if group is None:
            return _json({"success": False, "message": f"no weight group {body.group_name!r}"}, 400)
        from swectl.remote.programs import weight_group

        await anyio.to_thread.run_sync(weight_group.leave, group)
        return _json({"success": True, "message": f"Succeeded to destroy group {body.group_name}."})

    async def get_weights_by_name(self, request: Request) -> Response:
        body = await _decode(request, GetWeightsByNameRequest)
        state = self.model.net.state_dict()
        if body.name not in state:
            raise BadRequest(f"the model has no parameter named {body.name!r}")
        flat = state[body.name].detach().float().cpu().reshape(-1)[: max(body.truncate_size, 0)]
        return _json(flat.tolist())

    async def get_model_info(self, request: Request) -> Response:
        return _json(
            {
                "model_path": str(self.model.path),
                "tokenizer_path": str(self.model.path),
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.scheduler.weight_version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
            }
        )

    async def get_server_info(self, request: Request) -> Response:
        scheduler = self.scheduler
        state = {
            "batches": scheduler.batches,
            "largest_batch": scheduler.largest_batch,
            "joined_requests": scheduler.joined,
            "decode_steps": scheduler.decode_steps,
            "prefix_cache": {"entries": len(self.model.prefixes), "bytes": self.model.prefixes.bytes,
                             "hits": self.model.prefixes.hits, "tokens_reused": self.model.prefixes.tokens_reused},
            "model_seconds": {name: round(value, 3) for name, value in scheduler.seconds_in.items()},
            "mean_decode_batch": round(scheduler.decoded_rows / scheduler.decode_steps, 3)
            if scheduler.decode_steps else 0.0,
            "running_requests": scheduler.running,
            "waiting_requests": scheduler.waiting,
            "paused": scheduler.paused,
        }
        return _json(
            {
                "model_path": str(self.model.path),
                "max_running_requests": scheduler.max_batch,
                "batch_wait_ms": scheduler.batch_wait_s * 1000,
                "threads": scheduler.threads,
                "context_length": self.model.context_length,
                "weight_version": scheduler.weight_version,
                "internal_states": [state],
                "version": "swectl-cpu-engine",
            }
        )

    async def get_weight_version(self, request: Request) -> Response:
        return _json({"weight_version": self.scheduler.weight_version})

    async def pause_generation(self, request: Request) -> Response:
        body = await _decode(request, PauseGenerationRequest)
        try:
            await self.scheduler.pause(body.mode)
        except TimeoutError:
            return _error(503, f"the scheduler did not reach a safe point within {PAUSE_ACK_TIMEOUT_S:g} s")
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: Request) -> Response:
        self.scheduler.resume()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    # ---- OpenAI-compatible

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.served_model_name,
            "object": "model",
            "owned_by": "swectl",
            "max_model_len": self.model.context_length,
        }
        return _json({"object": "list", "data": [card]})

    async def chat_completions(self, request: Request) -> Response:
        body = await _decode(request, ChatBody)
        if body.stream or body.n != 1:
            raise BadRequest("the CPU engine answers one non-streamed choice (stream=false, n=1)")
        tokenizer = self.model.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise BadRequest("the model's tokenizer has no chat template")
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt_text, add_special_tokens=False).input_ids
        limit = body.max_completion_tokens or body.max_tokens
        params = SamplingParams(
            max_new_tokens=max(self.model.context_length - len(ids), 0) if limit is None else limit,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            stop=body.stop,
            sampling_seed=body.seed,
        )
        seq = await self._run(self._seq(ids, params, rid=None, return_logprob=False))
        reason = seq.finish or {}
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": self._text(seq)},
            "logprobs": None,
            "finish_reason": reason.get("type"),
            "matched_stop": reason.get("matched"),
        }
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": len(seq.output),
            "total_tokens": len(ids) + len(seq.output),
        }
        return _json(
            {
                "id": f"chatcmpl-{seq.rid}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.model or self.served_model_name,
                "choices": [choice],
                "usage": usage,
            }
        )


def build_app(api: Api, *, api_key: str | None) -> Starlette:
    middleware = [Middleware(ApiKeyMiddleware, api_key=api_key)] if api_key else []
    return Starlette(routes=api.routes(), middleware=middleware)
