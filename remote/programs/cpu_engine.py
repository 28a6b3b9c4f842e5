"""A CPU inference server that speaks the subset of SGLang's HTTP API swectl uses (docs/architecture.md 5.4).

    python -m swectl.remote.programs.cpu_engine --model DIR [--host 127.0.0.1] [--port 30000] [--max-batch 8]
        [--device cpu] [--batch-wait-ms 5] [--threads 1] [--batching continuous] [--kv-cache in-place] [--decode lean]
        [--weight-version default] [--api-key KEY]

Loads any local Hugging Face causal-LM folder with transformers (torch, CPU, float32) and serves
``/health``, ``/health_generate``, ``/generate``, ``/flush_cache``, ``/update_weights_from_disk``,
``/init_weights_update_group``, ``/update_weights_from_distributed``, ``/destroy_weights_update_group`` (the
weight group over gloo: remote/programs/weight_group.py), ``/get_weights_by_name``, ``/get_model_info``,
``/get_weight_version``, ``/get_server_info`` (with batching counters in
``internal_states``), ``/pause_generation``, ``/continue_generation``, ``/v1/models`` and
``/v1/chat/completions``, with SGLang's request and response shapes (see swectl/engine/wire.py).
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
logprobs. Ignored: sampling parameters beyond swectl.engine.wire.SamplingParams (penalties, grammars).

This module is the entry point (arguments, serving, main); the engine itself lies in three siblings:
remote/programs/engine_batch.py (the model and the batch math: prefill, join, sampling, decode steps),
remote/programs/engine_scheduler.py (the scheduler: batching, weight updates, pause/continue) and
remote/programs/engine_api.py (the HTTP API: request bodies, errors, API key, endpoints, the Starlette app).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import torch
import transformers
import uvicorn

from swectl.remote.programs.engine_api import Api, build_app
from swectl.remote.programs.engine_batch import Model
from swectl.remote.programs.engine_scheduler import Scheduler

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
    parser.add_argument("--decode", default="lean", choices=["lean", "transformers"],
                        help="lean: decode steps through remote/programs/lean_decode.py where it fits the model "
                        "(Qwen3; else transformers'); transformers: always transformers' forward")
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
                  kv_cache=args.kv_cache, prefix_cache_bytes=int(args.prefix_cache_mb * 2**20), decode=args.decode,
                  log=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"loaded {args.model} in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    sock = socket.create_server((args.host, args.port))
    # Accepted connections inherit it: without it a keep-alive client waits on every response for the delayed ACK
    # of the response's first segment (Nagle), as uvicorn writes headers and body apart (docs/results.md, "Figures
    # the code relies on").
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    anyio.run(serve, args, model, sock, backend="asyncio")


if __name__ == "__main__":
    main()
