"""`just bench gateway`: the latency the gateway (actors/gateway.py) adds to a model call, at N concurrent sessions.

Each of ``--sessions`` sessions plays ``--turns`` turns of a mini-swe-agent-shaped conversation: a system and a user
message, then for each turn the assistant's reply and an observation, the whole history sent each time (as the
harness does). Three paths, on the same prompts and the same engine, alternated round by round:

- **direct**: the bench renders the history with the chat template and calls the engine's ``generate`` itself;
- **floor**: the same requests over HTTP to a server on the gateway's stack (uvicorn, Starlette, serve_http) that
  answers each with one fixed completion and does nothing else: what the clients and the HTTP stack cost;
- **gateway**: the same history as an OpenAI chat-completions request over HTTP to the gateway, with the session's
  key, which renders, samples, records the ledger and answers.

``--engine scripted`` (the default) puts swectl's scripted policy behind both (it answers at once), so the difference
is the gateway's own cost: HTTP, decoding, rendering the whole history, the ledger, the answer. ``--engine cpu``
runs the tiny model on the CPU engine, for the same comparison with real decoding.

Two knobs make the load a harness's: ``--think-ms`` is each session's mean pause between its turns (seeded,
exponential: the commands a harness runs in its sandbox between model calls; 0 sends the next turn at once, which
measures the gateway saturated, a queue rather than its cost), and ``--client-procs`` runs the gateway's clients in
that many processes of their own (harnesses are processes of their own; 0: in the gateway's process, sharing its
event loop). The direct path pauses the same way.

``--client`` picks the clients' HTTP: httpx (what the OpenAI SDK and LiteLLM send with; the default) or a minimal
raw HTTP/1.1 client, which leaves the client library's own cost out (httpx's is most of the floor here).

Reported: p50 / p90 / p99 per request of each path; ``added_p50_ms``, the p50 the gateway adds over the direct path
(goal <= 2 ms at 64 sessions, issue 58); ``floor_added_p50_ms``, the floor's over the direct path; and
``gateway_over_floor_p50_ms``, the gateway's own work over the floor; requests per second of each path.
Writes ``benchmarks/results/gateway.json`` under ``--label`` (default: the engine, the sessions, and the knobs that
are set).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swectl.actors.engines import Engines  # noqa: E402
from swectl.actors.gateway import Gateway, GatewayConfig  # noqa: E402
from swectl.agent.scripted import ScriptedEngine  # noqa: E402
from swectl.agent.trajectory import rendered_ids  # noqa: E402
from swectl.config import EngineConfig  # noqa: E402
from swectl.engine.wire import GenerateRequest, SamplingParams  # noqa: E402
from swectl.gateway.serving import serve_http  # noqa: E402
from swectl.model.tokenizer import load_tokenizer  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "gateway.json"
SYSTEM = "You are a helpful assistant that can interact with a computer shell to solve programming tasks."
TASK = ("<pr_description>\nConsider the following PR description:\nThe function returns the wrong value for empty "
        "input.\n</pr_description>\n" + "Follow the instructions: run one command per turn. " * 20)
REPLY = "THOUGHT: look at the code.\n\n```bash\ngrep -rn 'def ' src | head -20\n```"
OBSERVATION = "<returncode>0</returncode>\n<output>\n" + "src/module.py:12:def function(x):\n" * 10 + "</output>"


def _quantiles(values: list[float]) -> dict[str, float]:
    cut = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50_ms": round(statistics.median(values) * 1000, 3), "p90_ms": round(cut[89] * 1000, 3),
            "p99_ms": round(cut[98] * 1000, 3), "n": len(values)}


def _history(turn: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    for _ in range(turn):
        messages += [{"role": "assistant", "content": REPLY}, {"role": "user", "content": OBSERVATION}]
    return messages


def _pauses(session: int, turns: int, think_s: float, seed: int) -> list[float]:
    """The session's pauses before each turn (the first turn at once), seeded: the same on both paths."""
    draw = random.Random(seed * 100_003 + session)
    return [0.0] + [draw.expovariate(1 / think_s) if think_s > 0 else 0.0 for _ in range(turns - 1)]


async def _direct(engine_for: Any, tokenizer: Any, sessions: int, turns: int, max_tokens: int,
                  think_s: float = 0.0, seed: int = 0) -> list[float]:
    latencies: list[float] = []

    async def one(s: int) -> None:
        for turn, pause in enumerate(_pauses(s, turns, think_s, seed)):
            await anyio.sleep(pause)
            t0 = time.perf_counter()
            ids = rendered_ids(tokenizer.apply_chat_template(_history(turn), tokenize=True,
                                                             add_generation_prompt=True))
            await engine_for(f"d{s}").generate(GenerateRequest(input_ids=ids,
                                                               sampling_params=SamplingParams(max_new_tokens=max_tokens),
                                                               rid=f"d{s}/{turn}"))
            latencies.append(time.perf_counter() - t0)

    async with anyio.create_task_group() as tg:
        for s in range(sessions):
            tg.start_soon(one, s)
    return latencies


class _RawClient:
    """``--client raw``: a minimal HTTP/1.1 client, one keep-alive connection per session, that writes a request's
    bytes and reads the answer by its content-length. What a client pays for its own HTTP library (httpx: ~1.8 ms a
    request after an idle pause on these machines) is then left out of the paths it is used for."""

    def __init__(self, url: str) -> None:
        where = url.split("//", 1)[1]
        hostport, _, prefix = where.partition("/")
        self._host, port = hostport.rsplit(":", 1)
        self._port, self._prefix = int(port), f"/{prefix}".rstrip("/")
        self._stream: Any = None

    async def post(self, path: str, body: dict[str, Any], key: str) -> tuple[int, bytes]:
        if self._stream is None:
            self._stream = await anyio.connect_tcp(self._host, self._port)
            self._stream.extra(anyio.abc.SocketAttribute.raw_socket).setsockopt(socket.IPPROTO_TCP,
                                                                                 socket.TCP_NODELAY, 1)
        data = json.dumps(body).encode()
        await self._stream.send(f"POST {self._prefix}{path} HTTP/1.1\r\nHost: {self._host}\r\n"
                                f"Content-Type: application/json\r\nAuthorization: Bearer {key}\r\n"
                                f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        buffer = b""
        while b"\r\n\r\n" not in buffer:
            buffer += await self._stream.receive()
        head, rest = buffer.split(b"\r\n\r\n", 1)
        length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
        if length is None:
            raise RuntimeError(f"an answer without a content-length: {head[:300]!r}")
        while len(rest) < int(length.group(1)):
            rest += await self._stream.receive()
        return int(head.split(b" ", 2)[1]), rest

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()


async def _clients(url: str, model: str, keys: dict[int, str], turns: int, max_tokens: int, think_s: float,
                   seed: int, client: str = "httpx") -> list[float]:
    """The harnesses' side: each session's turns as chat-completions requests with its key, pausing between them,
    through httpx (as the OpenAI SDK and LiteLLM send them) or ``_RawClient``."""
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=len(keys) + 8, max_keepalive_connections=len(keys) + 8)

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as shared:
        async def one(s: int, key: str) -> None:
            raw = _RawClient(url) if client == "raw" else None
            try:
                for turn, pause in enumerate(_pauses(s, turns, think_s, seed)):
                    await anyio.sleep(pause)
                    body = {"model": model, "messages": _history(turn), "max_tokens": max_tokens}
                    t0 = time.perf_counter()
                    if raw is not None:
                        status, text = await raw.post("/chat/completions", body, key)
                    else:
                        response = await shared.post("/chat/completions", json=body,
                                                     headers={"Authorization": f"Bearer {key}"})
                        status, text = response.status_code, response.content
                    latencies.append(time.perf_counter() - t0)
                    if status != 200:
                        raise RuntimeError(f"{url} answered {status}: {text[:500]!r}")
            finally:
                if raw is not None:
                    await raw.aclose()

        async with anyio.create_task_group() as tg:
            for s, key in keys.items():
                tg.start_soon(one, s, key)
    return latencies


def _floor_app(model: str) -> Starlette:
    """The floor: the gateway's HTTP stack (uvicorn, Starlette, serve_http) answering every chat-completions request
    with one fixed completion the gateway's shape and size, doing nothing else. Its latency over the direct path
    is what the clients and the HTTP stack cost before the gateway does any work."""
    canned = json.dumps({"id": "chatcmpl-floor", "object": "chat.completion", "created": 0, "model": model,
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": REPLY}}],
                         "usage": {"prompt_tokens": 1755, "completion_tokens": 8, "total_tokens": 1763}}).encode()

    async def answer(request: Request) -> Response:
        await request.body()
        return Response(canned, media_type="application/json")

    return Starlette(routes=[Route("/v1/chat/completions", answer, methods=["POST"])])


async def _over_http(url: str, model: str, keys: dict[int, str], turns: int, max_tokens: int, think_s: float,
                     seed: int, client_procs: int, client: str) -> list[float]:
    """The sessions' requests to ``url``, from this process or from ``client_procs`` processes of their own."""
    if client_procs <= 0:
        return await _clients(url, model, keys, turns, max_tokens, think_s, seed, client)
    latencies: list[float] = []

    async def proc(part: dict[int, str]) -> None:
        job = json.dumps({"url": url, "model": model, "keys": part, "turns": turns, "max_tokens": max_tokens,
                          "think_s": think_s, "seed": seed, "client": client})
        done = await anyio.run_process([sys.executable, __file__, "--client-job", job], check=False)
        if done.returncode != 0:
            raise RuntimeError(f"a client process exited {done.returncode}: {done.stderr.decode()[-2000:]}")
        latencies.extend(json.loads(done.stdout))

    async with anyio.create_task_group() as tg:
        for i in range(client_procs):
            tg.start_soon(proc, {s: k for s, k in keys.items() if s % client_procs == i})
    return latencies


async def _through_gateway(gateway: Gateway, sessions: int, turns: int, max_tokens: int, think_s: float = 0.0,
                           seed: int = 0, client_procs: int = 0, client: str = "httpx") -> list[float]:
    keys = {s: gateway.open_session(f"g{s}") for s in range(sessions)}
    latencies = await _over_http(gateway.url, gateway.config.model, keys, turns, max_tokens, think_s, seed,
                                 client_procs, client)
    for key in keys.values():
        gateway.end_session(key)
    return latencies


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    model = args.model or str(work / "tiny")
    if not args.model:
        from swectl.model.tiny import ModelInitConfig, init_model

        init_model(Path(model), ModelInitConfig())
    tokenizer = load_tokenizer(model, "--model")
    async with anyio.create_task_group() as tg:
        if args.engine == "scripted":
            replies = [REPLY] * (args.turns * args.rounds + 1)
            scripted: dict[str, ScriptedEngine] = {}

            def engine_for(name: str) -> ScriptedEngine:  # one script per session (its replies in order)
                if name not in scripted:  # made once: a script tokenizes its replies
                    scripted[name] = ScriptedEngine(replies, tokenizer)
                return scripted[name]
        else:
            engines = Engines(EngineConfig(max_batch=max(args.sessions, 8), start_timeout_s=300), model=model,
                              log_dir=work)
            await tg.start(engines.run)
            engine_for = engines.route
        gateway = Gateway(GatewayConfig(max_tokens=args.max_tokens, context_tokens=32768), engine_for, tokenizer)
        await tg.start(gateway.run)
        floor_sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        floor_sock.bind(("127.0.0.1", 0))
        floor_sock.listen(4096)
        floor_url = f"http://127.0.0.1:{floor_sock.getsockname()[1]}/v1"
        await tg.start(serve_http, _floor_app(gateway.config.model), floor_sock)
        out: dict[str, Any] = {"engine": args.engine, "sessions": args.sessions, "turns": args.turns,
                               "max_tokens": args.max_tokens, "think_ms": args.think_ms,
                               "client_procs": args.client_procs, "client": args.client, "seed": args.seed}
        think_s = args.think_ms / 1000
        samples: dict[str, list[float]] = {"direct": [], "floor": [], "gateway": []}
        seconds = dict.fromkeys(samples, 0.0)
        floor_keys = {s: f"floor-{s}" for s in range(args.sessions)}
        for _ in range(args.rounds):  # alternated, so the machine's drift hits every path
            for path in samples:
                t0 = time.perf_counter()
                if path == "direct":
                    got = await _direct(engine_for, tokenizer, args.sessions, args.turns, args.max_tokens, think_s,
                                        args.seed)
                elif path == "floor":
                    got = await _over_http(floor_url, gateway.config.model, floor_keys, args.turns, args.max_tokens,
                                           think_s, args.seed, args.client_procs, args.client)
                else:
                    got = await _through_gateway(gateway, args.sessions, args.turns, args.max_tokens, think_s,
                                                 args.seed, args.client_procs, args.client)
                seconds[path] += time.perf_counter() - t0
                samples[path] += got
        tg.cancel_scope.cancel()
    for path, values in samples.items():
        out[path] = _quantiles(values)
    out["added_p50_ms"] = round(out["gateway"]["p50_ms"] - out["direct"]["p50_ms"], 3)
    out["floor_added_p50_ms"] = round(out["floor"]["p50_ms"] - out["direct"]["p50_ms"], 3)
    out["gateway_over_floor_p50_ms"] = round(out["gateway"]["p50_ms"] - out["floor"]["p50_ms"], 3)
    for path, values in samples.items():
        out[f"{path}_requests_per_s"] = round(len(values) / seconds[path], 1)
    out["prompt_tokens_last_turn"] = len(rendered_ids(tokenizer.apply_chat_template(
        _history(args.turns - 1), tokenize=True, add_generation_prompt=True)))
    return out


def _client_job(job: str) -> int:
    """One client process (``--client-job``): its sessions' requests; prints their latencies as JSON."""
    spec = json.loads(job)
    keys = {int(s): k for s, k in spec["keys"].items()}
    latencies = anyio.run(_clients, spec["url"], spec["model"], keys, spec["turns"], spec["max_tokens"],
                          spec["think_s"], spec["seed"], spec["client"])
    print(json.dumps(latencies))
    return 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--client-job":
        return _client_job(sys.argv[2])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("scripted", "cpu"), default="scripted")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--think-ms", type=float, default=0.0,
                        help="each session's mean pause between turns (seeded, exponential; 0: none)")
    parser.add_argument("--client-procs", type=int, default=0,
                        help="run the gateway's clients in this many processes (0: in the gateway's process)")
    parser.add_argument("--client", choices=("httpx", "raw"), default="httpx",
                        help="the clients' HTTP: httpx (the OpenAI SDK's and LiteLLM's) or a minimal raw HTTP/1.1 "
                             "client, which leaves the client library's own cost out")
    parser.add_argument("--seed", type=int, default=0, help="the pauses' seed")
    parser.add_argument("--label", default="", help="the results key (default: engine, sessions and knobs set)")
    parser.add_argument("--model", default="", help="a model folder (default: a fresh tiny model)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = anyio.run(measure, args)
    print(json.dumps(result, indent=1))
    previous = json.loads(args.results.read_text()) if args.results.exists() else {}
    label = args.label or "_".join([args.engine, f"{args.sessions}_sessions",
                                    *([f"{args.client_procs}_client_procs"] if args.client_procs else []),
                                    *([f"think_{args.think_ms:g}ms"] if args.think_ms else []),
                                    *([f"{args.client}_client"] if args.client != "httpx" else [])])
    previous[label] = result
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(previous, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
