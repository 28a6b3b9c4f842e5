"""A replay engine behind SGLang's HTTP API, for tests and benchmarks of the whole path (engine client, agent
loop, sandbox, grader) with no model: ``python -m swectl.remote.programs.replay_server --replies FILE --tokenizer DIR``.

FILE is JSON ``{instance_id: [reply, ...]}``. A ``/generate`` request carries ``rid`` as swectl's agent loop
sends it (``<instance_id>#<sample>/<step>``); the answer is reply number ``step`` of that instance, tokenized
with the policy's tokenizer plus the end-of-turn token, in SGLang's response shape (logprobs 0.0).
Prints ``ready on http://HOST:PORT`` when listening (``--port 0`` picks a free port).
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

NOTHING_LEFT = "THOUGHT: nothing left to replay."


class Replayer:
    """Scripted replies per instance, returned as tokens in SGLang's /generate format."""

    def __init__(self, replies: dict[str, list[str]], tokenizer, eos: str, version: str) -> None:
        self.replies = replies
        self.tok = tokenizer
        self.eos = tokenizer.convert_tokens_to_ids(eos)
        self.version = version

    def answer(self, rid: str, input_ids: list[int], max_new: int) -> dict:
        started = time.monotonic()
        key, _, step = rid.rpartition("/")
        instance = key.rpartition("#")[0] or key
        script = self.replies.get(instance, [])
        n = int(step) if step.isdigit() else 0
        reply = script[n] if n < len(script) else NOTHING_LEFT
        ids = [*self.tok.encode(reply, add_special_tokens=False), self.eos]
        finish = {"type": "stop", "matched": self.eos}
        if len(ids) > max_new:
            ids, finish = ids[:max_new], {"type": "length", "length": max_new}
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(input_ids), "completion_tokens": len(ids),
                "cached_tokens": 0, "weight_version": self.version, "e2e_latency": time.monotonic() - started,
                "output_token_logprobs": [[0.0, t, None] for t in ids]}
        return {"text": self.tok.decode(ids, skip_special_tokens=True), "output_ids": ids, "meta_info": meta}


def build_app(replayer: Replayer) -> Starlette:
    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def generate(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
            ids = [int(t) for t in body["input_ids"]]
        except (ValueError, KeyError, TypeError) as exc:
            return JSONResponse({"error": {"message": f"bad request: {exc}"}}, status_code=400)
        max_new = int((body.get("sampling_params") or {}).get("max_new_tokens", 128))
        return JSONResponse(replayer.answer(str(body.get("rid") or ""), ids, max_new))

    async def model_info(request: Request) -> Response:
        return JSONResponse({"model_path": "replay", "is_generation": True})

    async def flush(request: Request) -> Response:
        return Response("Cache flushed.\n", status_code=200)

    return Starlette(routes=[
        Route("/health", health, methods=["GET"]), Route("/health_generate", health, methods=["GET"]),
        Route("/generate", generate, methods=["POST"]), Route("/get_model_info", model_info, methods=["GET"]),
        Route("/flush_cache", flush, methods=["GET", "POST"]),
    ])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m swectl.remote.programs.replay_server",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--replies", type=Path, required=True, help="JSON {instance_id: [reply, ...]}")
    parser.add_argument("--tokenizer", required=True, help="the policy's tokenizer folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--eos", default="<|im_end|>")
    parser.add_argument("--weight-version", default="replay")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    replayer = Replayer(json.loads(args.replies.read_text()), tok, args.eos, args.weight_version)
    sock = socket.create_server((args.host, args.port))
    # Accepted connections inherit it: without it a keep-alive client waits on every response for the delayed ACK
    # of the response's first segment (Nagle), as uvicorn writes headers and body apart (docs/results.md, "Figures
    # the code relies on").
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    server = uvicorn.Server(uvicorn.Config(build_app(replayer), log_level="warning", access_log=False,
                                           lifespan="off"))

    async def serve() -> None:
        async with anyio.create_task_group() as tg:
            async def announce() -> None:
                with anyio.fail_after(60):
                    while not server.started:  # noqa: ASYNC110 (uvicorn offers a flag, no event)
                        await anyio.sleep(0.01)
                host, port = sock.getsockname()[:2]
                print(f"ready on http://{host}:{port}", flush=True)

            tg.start_soon(announce)
            await server.serve(sockets=[sock])

    anyio.run(serve, backend="asyncio")


if __name__ == "__main__":
    main()
