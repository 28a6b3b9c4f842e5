"""A CPU inference server that speaks the subset of SGLang's HTTP API swectl uses (DESIGN 4.12).

    python -m swectl.remote.programs.cpu_engine --model DIR [--host 127.0.0.1] [--port 30000] [--max-batch 8]
        [--device cpu] [--batch-wait-ms 5] [--threads 1] [--batching continuous] [--kv-cache in-place]
        [--weight-version default] [--api-key KEY]

Loads any local Hugging Face causal-LM folder with transformers (torch, CPU, float32) and serves
``/health``, ``/health_generate``, ``/generate``, ``/flush_cache``, ``/update_weights_from_disk``,
``/init_weights_update_group``, ``/update_weights_from_distributed``, ``/destroy_weights_update_group`` (the
weight group over gloo: remote/programs/weight_group.py), ``/get_weights_by_name``, ``/get_model_info``,
``/get_weight_version``, ``/get_server_info`` (with batching counters in
``internal_states``), ``/pause_generation``, ``/continue_generation``, ``/v1/models`` and
``/v1/chat/completions``, with SGLang's request and response shapes (see swectl/schema_engine.py).
Prints ``ready on http://HOST:PORT`` once it listens (``--port 0`` picks a free port).

Batching: requests that arrive within ``--batch-wait-ms`` of the first (up to ``--max-batch``) are decoded
together, one token per step, left-padded with an attention mask, explicit position ids and a shared KV cache
(remote/programs/kv_cache.py: it grows in place); a finished sequence leaves the batch at once. Requests
arriving meanwhile join the running batch between two steps while it has room (continuous batching: their
prompts are prefilled apart, then their cache rows are left-padded to the batch's width), except while a
weight update waits, which runs once the batch has drained. Prefix store (``--prefix-cache-mb``): the KV of
finished requests is kept, and a request that begins the same way (an agent's next turn sends the whole
conversation again; the samples of one task share their first prompt) reuses the longest common beginning and
reads only the rest; a weight update or ``/flush_cache`` empties it. The per-token logprobs are those a single-sequence
forward pass gives, within float rounding, and follow SGLang's convention: ``log_softmax(logits)`` when greedy
(temperature 0), else ``log_softmax(logits / temperature)`` before top-k/top-p/min-p truncation. Sampling uses
one torch.Generator per request, seeded by ``sampling_params.sampling_seed`` when given, so a seeded request
gives the same tokens whatever it is batched with. Generation stops on EOS (unless ``ignore_eos``), on
``stop_token_ids``, on ``stop`` strings or at ``max_new_tokens``; the finishing token is part of
``output_ids`` as in SGLang, and ``length`` is checked first, as in SGLang.

Everything that touches the model runs in one scheduler task (forwards in a worker thread, one at a
time), so weight updates need no locks: they run between batches, or at once while generation is paused
(pause in_place/retract, update, continue: held requests go on with the new weights; retract recomputes
their KV cache first). ``update_weights_from_disk`` sets ``weight_version`` to the one given, or, unlike
SGLang (which keeps the old one), bumps a counter so a forgotten version still shows the change.
Rejected with HTTP 400: streaming, batched (list) inputs, prompt logprobs (``logprob_start_len >= 0``), top
logprobs. Ignored: sampling parameters beyond swectl.schema_engine.SamplingParams (penalties, grammars).
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from http import HTTPStatus
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec
import torch
import transformers
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from swectl.engine.wire import (
    ChatMessage,
    DestroyWeightsUpdateGroupRequest,
    GetWeightsByNameRequest,
    InitWeightsUpdateGroupRequest,
    PauseGenerationRequest,
    PauseMode,
    SamplingParams,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
)
from swectl.errors import SwectlError
from swectl.remote.programs.kv_cache import PrefixStore, SpareRoomLayer, decode_cache

T = TypeVar("T")

HEALTH_GENERATE_TIMEOUT_S = 20.0
CONTROL_TIMEOUT_S = 600.0
WEIGHT_GROUP_TIMEOUT_S = 300.0  # joining the trainer's weight group, and each collective in it
PAUSE_ACK_TIMEOUT_S = 60.0
LOGPROB_FLOOR = -1e30  # JSON has no -inf; SGLang clamps to the dtype's minimum likewise

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


# ---------------------------------------------------------------- the model


def _eos_ids(model: Any, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    found: set[int] = set()
    for value in (
        getattr(model.generation_config, "eos_token_id", None),
        model.config.eos_token_id,
        tokenizer.eos_token_id,
    ):
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, list):
            found.update(v for v in value if isinstance(v, int))
    return frozenset(found)


def _load_causal_lm(path: Path, attn_implementation: str, device: torch.device) -> Any:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)
    return model.to(device).eval()


class Model:
    """The model and its tokenizer. Used by the scheduler's worker thread only, one call at a time."""

    def __init__(self, path: Path, *, attn_implementation: str, device: str = "cpu", kv_cache: str = "in-place",
                 prefix_cache_bytes: int = 0) -> None:
        self.path = path
        self.attn_implementation = attn_implementation
        self.kv_cache = kv_cache  # in-place (remote/programs/kv_cache.py) | concat (transformers' DynamicCache)
        self.prefixes = PrefixStore(prefix_cache_bytes)  # finished sequences' KV, for requests that begin the same way
        self.device = torch.device(device)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(path)
        self.net = _load_causal_lm(path, attn_implementation, self.device)
        self.eos_ids = _eos_ids(self.net, self.tokenizer)
        self.vocab_size: int = self.net.get_input_embeddings().num_embeddings
        self.context_length: int = int(getattr(self.net.config, "max_position_embeddings", 0) or 1 << 30)

    def new_cache(self) -> DynamicCache:
        if self.kv_cache == "concat":
            return DynamicCache(config=self.net.config)
        return decode_cache(self.net.config)

    def load_weights(self, path: Path) -> None:
        """Copy the weights of another folder of the same architecture in (SGLang's update_weights_from_disk)."""
        fresh = _load_causal_lm(path, self.attn_implementation, torch.device("cpu"))
        if type(fresh) is not type(self.net):
            raise ValueError(f"{path} holds a {type(fresh).__name__}, the engine serves a {type(self.net).__name__}")
        self.prefixes.clear()
        self.net.load_state_dict(fresh.state_dict(), strict=True)
        self.path = path

    def load_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy received tensors into the parameters of those names (update_weights_from_distributed); checks every
        name and shape before changing anything."""
        state = self.net.state_dict()
        unknown = [name for name, _ in named if name not in state]
        if unknown:
            raise ValueError(f"the model has no parameters named {', '.join(unknown[:5])}")
        wrong = [f"{name} {list(t.shape)} (the model's: {list(state[name].shape)})" for name, t in named
                 if t.shape != state[name].shape]
        if wrong:
            raise ValueError(f"shapes differ: {'; '.join(wrong[:5])}")
        self.prefixes.clear()
        with torch.no_grad():
            for name, tensor in named:
                state[name].copy_(tensor)


# ---------------------------------------------------------------- one request, one batch


@dataclass(eq=False)
class Seq:
    """One request being decoded: its prompt, sampling parameters and output so far."""
    rid: str
    prompt: list[int]
    params: SamplingParams
    return_logprob: bool
    max_new: int
    stop_ids: frozenset[int]
    stop_strs: tuple[str, ...]
    generator: torch.Generator
    created: float = field(default_factory=time.perf_counter)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    abort_message: str | None = None  # set by abort_all while the sequence runs; honoured at the next step
    finished_at: float = 0.0
    weight_version: str = ""
    done: anyio.Event = field(default_factory=anyio.Event)


@dataclass(eq=False)
class Batch:
    """The sequences decoded together, with their shared KV cache and padding mask."""
    seqs: list[Seq]  # live rows, in row order
    cache: DynamicCache
    mask: torch.Tensor  # [rows, positions]: 1 for real tokens, 0 for left padding
    next_pos: torch.Tensor  # [rows]: position id of each row's next token
    logits: torch.Tensor  # [rows, vocab]: logits of each row's next token


def prefill(model: Model, seqs: Sequence[Seq]) -> Batch:
    """The batch of ``seqs`` (prompt + output so far) with its KV cache: a sequence that begins the way a
    finished one did reuses that one's KV and computes the rest alone (``extend``); the others run through the
    model together, left-padded (``prefill_rows``); the parts are then merged."""
    fresh: list[Seq] = []
    parts: list[Batch] = []
    for seq in seqs:
        found = model.prefixes.longest(seq.prompt + seq.output) if model.prefixes.enabled else None
        if found is None:
            fresh.append(seq)
        else:
            parts.append(extend(model, seq, *found))
    if fresh:
        parts.insert(0, prefill_rows(model, fresh))
    return parts[0] if len(parts) == 1 else merge(model, parts)


def prefill_rows(model: Model, seqs: Sequence[Seq]) -> Batch:
    """Left-pad the sequences (prompt + output so far) and run them through the model in one forward."""
    contexts = [s.prompt + s.output for s in seqs]
    width = max(len(c) for c in contexts)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, context in enumerate(contexts):
        ids[row, width - len(context) :] = torch.tensor(context, dtype=torch.long)
        mask[row, width - len(context) :] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    cache = model.new_cache()
    out = model.net(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    lengths = torch.tensor([len(c) for c in contexts], dtype=torch.long, device=model.device)
    # Sampling runs on the CPU (per-request CPU generators), so logits come back to it.
    return Batch(list(seqs), out.past_key_values, mask, lengths, out.logits[:, -1, :].float().cpu())


def extend(model: Model, seq: Seq, reused: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Batch:
    """One row whose first ``reused`` positions come from a stored KV (``kv``, per layer); the model reads only
    the rest of the sequence."""
    context = seq.prompt + seq.output
    cache = model.new_cache()
    for layer, (keys, values) in zip(cache.layers, kv, strict=True):
        layer.update(keys[..., :reused, :], values[..., :reused, :])
    mask = torch.ones((1, len(context)), dtype=torch.long, device=model.device)
    out = model.net(
        input_ids=torch.tensor([context[reused:]], dtype=torch.long, device=model.device),
        attention_mask=mask,
        position_ids=torch.arange(reused, len(context), device=model.device)[None],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    lengths = torch.tensor([len(context)], dtype=torch.long, device=model.device)
    return Batch([seq], out.past_key_values, mask, lengths, out.logits[:, -1, :].float().cpu())


def keep_prefix(model: Model, batch: Batch, row: int) -> None:
    """Store a finished row's KV (the positions the model has read: all its tokens but the last) for later
    requests that begin the same way."""
    seq = batch.seqs[row]
    length = int(batch.mask[row].sum())
    width = batch.mask.shape[1]
    kv = [(layer.keys[row : row + 1, :, width - length :, :].clone(),
           layer.values[row : row + 1, :, width - length :, :].clone()) for layer in batch.cache.layers]
    model.prefixes.put((seq.prompt + seq.output)[:length], kv)


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``t`` with zeros before its entries along ``dim`` up to ``width``."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def trim_padding(batch: Batch) -> None:
    """Drop the leading positions that are padding in every row (left behind by rows that left the batch), so a
    batch that keeps taking newcomers does not keep growing wider."""
    used = batch.mask.any(dim=0).nonzero()
    first = int(used[0]) if len(used) else 0
    if first == 0:
        return
    for layer in batch.cache.layers:
        if isinstance(layer, SpareRoomLayer):
            layer.drop_front(first)
        else:
            layer.keys, layer.values = layer.keys[..., first:, :], layer.values[..., first:, :]
    batch.mask = batch.mask[:, first:]


def can_join(batch: Batch) -> bool:
    """Whether new rows can be merged into this batch's cache (full-attention layers only)."""
    return all(type(layer) in (DynamicLayer, SpareRoomLayer) for layer in batch.cache.layers)


def join(model: Model, batch: Batch, seqs: Sequence[Seq]) -> Batch:
    """Prefill ``seqs`` and merge them into the running ``batch``."""
    return merge(model, [batch, prefill(model, seqs)])


def merge(model: Model, parts: Sequence[Batch]) -> Batch:
    """One batch of the rows of ``parts``: their caches and masks left-padded to the widest one's positions (the
    padding is masked out; keys keep their rotary positions) and stacked row-wise."""
    width = max(part.mask.shape[1] for part in parts)
    cache = model.new_cache()
    for index, merged in enumerate(cache.layers):
        layers = [part.cache.layers[index] for part in parts]
        merged.update(torch.cat([_left_pad(layer.keys, width, -2) for layer in layers]),
                      torch.cat([_left_pad(layer.values, width, -2) for layer in layers]))
    return Batch([seq for part in parts for seq in part.seqs], cache,
                 torch.cat([_left_pad(part.mask, width, 1) for part in parts]),
                 torch.cat([part.next_pos for part in parts]), torch.cat([part.logits for part in parts]))


def _truncate(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Top-k, then top-p, then min-p, on one row of probabilities (unnormalised afterwards)."""
    if 0 < params.top_k < probs.numel():
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if params.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        before = torch.cumsum(ordered, dim=0) - ordered
        ordered = torch.where(before > params.top_p * ordered.sum(), 0.0, ordered)
        probs = torch.zeros_like(probs).scatter(0, order, ordered)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    return probs


def choose_tokens(logits: torch.Tensor, seqs: Sequence[Seq]) -> tuple[list[int], list[float]]:
    """Next token of every row, and its logprob under SGLang's convention (see the module docstring)."""
    temperatures = torch.tensor([s.params.temperature if s.params.temperature > 0 else 1.0 for s in seqs])
    logp = torch.log_softmax(logits / temperatures[:, None], dim=-1)
    tokens = torch.argmax(logp, dim=-1).tolist()
    for row, seq in enumerate(seqs):
        if seq.params.temperature > 0:
            probs = _truncate(logp[row].exp(), seq.params)
            tokens[row] = int(torch.multinomial(probs, 1, generator=seq.generator))
    picked = logp[torch.arange(len(seqs)), torch.tensor(tokens)].tolist()
    return tokens, [max(lp, LOGPROB_FLOOR) for lp in picked]


def _finish_reason(seq: Seq, token: int, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any] | None:
    if len(seq.output) >= seq.max_new:
        return {"type": "length", "length": seq.max_new}
    if token in seq.stop_ids:
        return {"type": "stop", "matched": token}
    if seq.stop_strs:
        window = max(len(s) for s in seq.stop_strs) + 8
        tail = tokenizer.decode(seq.output[-window:], skip_special_tokens=seq.params.skip_special_tokens)
        for stop in seq.stop_strs:
            if stop in tail:
                return {"type": "stop", "matched": stop}
    return None


def step(model: Model, batch: Batch) -> list[Seq]:
    """Pick every row's next token, retire finished rows, and run the others one position further."""
    tokens, logprobs = choose_tokens(batch.logits, batch.seqs)
    keep: list[int] = []
    finished: list[Seq] = []
    for row, (seq, token, logprob) in enumerate(zip(batch.seqs, tokens, logprobs, strict=True)):
        seq.output.append(token)
        seq.logprobs.append(logprob)
        seq.finish = _finish_reason(seq, token, model.tokenizer)
        if seq.finish is None:
            keep.append(row)
        else:
            finished.append(seq)
            if model.prefixes.enabled and can_join(batch):
                keep_prefix(model, batch, row)
    if len(keep) < len(batch.seqs):
        index = torch.tensor(keep, dtype=torch.long, device=model.device)
        batch.seqs = [batch.seqs[row] for row in keep]
        if not keep:
            return finished
        batch.cache.batch_select_indices(index)
        batch.mask = batch.mask[index]
        batch.next_pos = batch.next_pos[index]
        trim_padding(batch)
    batch.mask = torch.cat([batch.mask, torch.ones((len(keep), 1), dtype=torch.long, device=model.device)], dim=1)
    out = model.net(
        input_ids=torch.tensor([[tokens[row]] for row in keep], dtype=torch.long, device=model.device),
        attention_mask=batch.mask,
        position_ids=batch.next_pos[:, None],
        past_key_values=batch.cache,
        use_cache=True,
        logits_to_keep=1,
    )
    batch.cache = out.past_key_values
    batch.logits = out.logits[:, -1, :].float().cpu()
    batch.next_pos = batch.next_pos + 1
    return finished


# ---------------------------------------------------------------- the scheduler: the only user of the model


@dataclass(eq=False)
class WeightUpdate:
    """A weight reload waiting for the scheduler; ``done`` is set when it has happened. From a folder (``path``),
    or received tensors (``tensors``: one bucket of a distributed sync, whose version changes only when given)."""
    path: Path | None
    version: str | None
    tensors: list[tuple[str, torch.Tensor]] | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    error: str | None = None
    cancelled: bool = False


class Scheduler:
    """Owns the model: batches requests, runs weight updates at safe points, honours pause/continue."""

    def __init__(self, model: Model, *, max_batch: int, batch_wait_s: float, threads: int, weight_version: str,
                 continuous: bool = True):
        self.model = model
        self.max_batch = max_batch
        self.continuous = continuous  # False: static batching (requests wait for the running batch to end)
        self.batch_wait_s = batch_wait_s
        self.threads = threads
        self.weight_version = weight_version
        self.updates = 0
        self.batches = 0
        self.largest_batch = 0
        self.joined = 0  # requests that joined a batch already decoding
        self.decode_steps = 0
        self.decoded_rows = 0  # rows over all decode steps: decoded_rows / decode_steps is the mean batch
        self.seconds_in: dict[str, float] = {}  # model time by kind of call (prefill, join, step, weight loads)
        self.paused: PauseMode | None = None
        self._waiting: deque[Seq] = deque()
        self._running: list[Seq] = []
        self._controls: deque[WeightUpdate] = deque()
        self._wakeup = anyio.Event()
        self._pause_seen = anyio.Event()
        self._limiter = anyio.CapacityLimiter(1)

    # ---- called by request handlers (event loop)

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def held(self) -> int:
        """Requests held mid-generation by a pause."""
        return len(self._running) if self.paused is not None else 0

    def submit(self, seq: Seq) -> None:
        if seq.max_new == 0:
            self._finish(seq, {"type": "length", "length": 0})
            return
        self._waiting.append(seq)
        self._wakeup.set()

    async def update_weights(self, path: Path | None, version: str | None, *, abort_all: bool,
                             tensors: list[tuple[str, torch.Tensor]] | None = None) -> WeightUpdate:
        update = WeightUpdate(path, version, tensors)
        if abort_all:
            self.abort_all("aborted for a weight update")
        self._controls.append(update)
        self._wakeup.set()
        with anyio.move_on_after(CONTROL_TIMEOUT_S):
            await update.done.wait()
        if not update.done.is_set():
            update.cancelled = True  # the scheduler skips it if it has not started it yet
        return update

    def abort_all(self, message: str) -> None:
        """End every request now waiting or running (running ones at their next step)."""
        while self._waiting:
            self._finish(self._waiting.popleft(), {"type": "abort", "message": message})
        for seq in self._running:
            seq.abort_message = message
        self._wakeup.set()

    async def pause(self, mode: PauseMode) -> None:
        self.paused = mode
        self._pause_seen = anyio.Event()
        if mode == "abort":
            self.abort_all("generation paused (mode abort)")
        self._wakeup.set()
        with anyio.fail_after(PAUSE_ACK_TIMEOUT_S):
            await self._pause_seen.wait()

    def resume(self) -> None:
        self.paused = None
        self._wakeup.set()

    # ---- the scheduler task

    async def run(self) -> None:
        while True:
            await self._safe_point()
            if self.paused is not None or not self._waiting:
                await self._sleep(None)
                continue
            await self._collect()
            if self.paused is None and self._waiting:  # a pause or an abort may have come while collecting
                await self._run_batch([self._waiting.popleft() for _ in range(min(self.max_batch, len(self._waiting)))])

    async def _sleep(self, timeout_s: float | None) -> None:
        with anyio.move_on_after(timeout_s):
            await self._wakeup.wait()
        if self._wakeup.is_set():
            self._wakeup = anyio.Event()

    async def _collect(self) -> None:
        deadline = anyio.current_time() + self.batch_wait_s
        while len(self._waiting) < self.max_batch and self.paused is None:
            left = deadline - anyio.current_time()
            if left <= 0:
                return
            await self._sleep(left)

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(partial(self._call, fn, *args), limiter=self._limiter)

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if torch.get_num_threads() != self.threads:  # the setting is per OS thread
            torch.set_num_threads(self.threads)
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                return fn(*args)
        finally:
            name = getattr(fn, "__name__", "other")
            self.seconds_in[name] = self.seconds_in.get(name, 0.0) + time.perf_counter() - started

    async def _safe_point(self) -> None:
        """No forward in flight: run queued weight updates, acknowledge a pause."""
        while self._controls:
            update = self._controls.popleft()
            if not update.cancelled:
                await self._apply(update)
        if self.paused is not None:
            self._pause_seen.set()

    async def _apply(self, update: WeightUpdate) -> None:
        try:
            if update.tensors is not None:
                await self._in_thread(self.model.load_tensors, update.tensors)
            else:
                assert update.path is not None
                await self._in_thread(self.model.load_weights, update.path)
        except Exception as exc:  # the engine keeps serving the old weights, as SGLang does
            update.error = f"{type(exc).__name__}: {exc}"
        else:
            self.updates += 1
            if update.version is not None:
                self.weight_version = update.version
            elif update.tensors is None:
                self.weight_version = str(self.updates)
        update.done.set()

    async def _run_batch(self, seqs: list[Seq]) -> None:
        self._running = list(seqs)
        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(seqs))
        try:
            batch = await self._in_thread(prefill, self.model, seqs)
            while batch.seqs:
                if self._may_join(batch):
                    newcomers = [self._waiting.popleft()
                                 for _ in range(min(self.max_batch - len(batch.seqs), len(self._waiting)))]
                    self._running += newcomers
                    self.joined += len(newcomers)
                    batch = await self._in_thread(join, self.model, batch, newcomers)
                    self.largest_batch = max(self.largest_batch, len(batch.seqs))
                if any(seq.abort_message is not None for seq in batch.seqs):
                    batch = await self._abort_marked(batch)
                    continue
                if self.paused is not None:
                    mode = self.paused
                    await self._hold()
                    if mode == "retract" and batch.seqs:  # recompute the KV cache (new weights, if any)
                        batch = await self._in_thread(prefill, self.model, batch.seqs)
                    continue
                self.decode_steps += 1
                self.decoded_rows += len(batch.seqs)
                for seq in await self._in_thread(step, self.model, batch):
                    self._finish(seq, seq.finish or {"type": "abort", "message": "no finish reason"})
                self._running = [seq for seq in self._running if not seq.done.is_set()]
        except Exception as exc:  # a failed forward ends this batch's requests, not the server
            for seq in self._running:
                if not seq.done.is_set():
                    self._finish(seq, {"type": "abort", "message": f"engine error: {type(exc).__name__}: {exc}"})
        finally:
            self._running = []

    def _may_join(self, batch: Batch) -> bool:
        """Waiting requests join between steps while the batch has room, nothing is paused or aborting, and no
        weight update waits (it runs when the batch drains: joining could starve it)."""
        return (self.continuous and bool(self._waiting) and len(batch.seqs) < self.max_batch and self.paused is None
                and not self._controls and can_join(batch)
                and all(seq.abort_message is None for seq in batch.seqs))

    async def _abort_marked(self, batch: Batch) -> Batch:
        rest = [seq for seq in batch.seqs if seq.abort_message is None]
        for seq in batch.seqs:
            if seq.abort_message is not None:
                self._finish(seq, {"type": "abort", "message": seq.abort_message})
        if not rest:
            batch.seqs = []
            return batch
        return await self._in_thread(prefill, self.model, rest)  # rare: rebuild the cache without them

    async def _hold(self) -> None:
        """Paused mid-batch (in_place/retract): the rows wait; weight updates may run meanwhile."""

        def aborting() -> bool:
            return any(seq.abort_message is not None for seq in self._running)

        while self.paused is not None and not aborting():
            await self._safe_point()
            if self.paused is None or aborting():
                return
            await self._sleep(None)

    def _finish(self, seq: Seq, reason: dict[str, Any]) -> None:
        seq.finish = reason
        seq.finished_at = time.perf_counter()
        seq.weight_version = self.weight_version
        seq.done.set()


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


# ---------------------------------------------------------------- process


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m swectl.remote.programs.cpu_engine",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, type=Path, help="a local Hugging Face causal-LM folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed when ready)")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--batch-wait-ms", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--batching", default="continuous", choices=["continuous", "static"],
                        help="continuous: requests join a running batch between steps; static: they wait for it to "
                        "end (the older scheduler, kept as just bench engine's baseline)")
    parser.add_argument("--prefix-cache-mb", type=float, default=512.0,
                        help="KV of finished requests kept for requests that begin the same way (an agent's next "
                        "turn, the samples of one task); 0 turns it off")
    parser.add_argument("--kv-cache", default="in-place", choices=["in-place", "concat"],
                        help="in-place: decode steps write into a cache with spare room; concat: transformers' "
                        "DynamicCache, which copies the cache on every token (just bench engine's baseline)")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--api-key", default=os.environ.get("SWECTL_ENGINE_API_KEY") or None,
                        help="require Authorization: Bearer KEY (default: $SWECTL_ENGINE_API_KEY, which keeps "
                        "the key out of the process list)")
    parser.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--device", default="cpu",
                        help="torch device for the model, e.g. cuda:0 (float32; sampling stays on the CPU)")
    args = parser.parse_args(argv)
    if args.max_batch < 1 or args.batch_wait_ms < 0 or args.threads < 1:
        parser.error("--max-batch and --threads must be >= 1, --batch-wait-ms >= 0")
    return args


def build_app(api: Api, *, api_key: str | None) -> Starlette:
    middleware = [Middleware(ApiKeyMiddleware, api_key=api_key)] if api_key else []
    return Starlette(routes=api.routes(), middleware=middleware)


async def _announce(server: uvicorn.Server, url: str) -> None:
    with anyio.fail_after(60):
        while not server.started:  # noqa: ASYNC110  (uvicorn offers a flag, no event)
            await anyio.sleep(0.01)
    print(f"ready on {url}", flush=True)


async def serve(args: argparse.Namespace, model: Model, sock: socket.socket) -> None:
    scheduler = Scheduler(
        model,
        max_batch=args.max_batch,
        batch_wait_s=args.batch_wait_ms / 1000,
        threads=args.threads,
        weight_version=args.weight_version,
        continuous=args.batching == "continuous",
    )
    api = Api(scheduler, served_model_name=args.served_model_name or str(args.model))
    config = uvicorn.Config(
        build_app(api, api_key=args.api_key), log_level=args.log_level, access_log=False, lifespan="off"
    )
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        tg.start_soon(_announce, server, f"http://{host}:{port}")
        await server.serve(sockets=[sock])
        tg.cancel_scope.cancel()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()  # weight updates would print a progress bar each
    transformers.logging.disable_progress_bar()
    started = time.perf_counter()
    model = Model(args.model, attn_implementation=args.attn_implementation, device=args.device,
                  kv_cache=args.kv_cache, prefix_cache_bytes=int(args.prefix_cache_mb * 2**20))
    print(f"loaded {args.model} in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    sock = socket.create_server((args.host, args.port))
    # Accepted connections inherit it: without it a keep-alive client waits ~40 ms per response for the
    # delayed ACK of the response's first segment (Nagle), as uvicorn writes headers and body apart.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    anyio.run(serve, args, model, sock, backend="asyncio")


if __name__ == "__main__":
    main()
