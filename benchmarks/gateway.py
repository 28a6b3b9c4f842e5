"""`just bench gateway`: the latency the gateway (actors/gateway.py) adds to a model call, at N concurrent sessions.

Each of ``--sessions`` sessions plays ``--turns`` turns of a mini-swe-agent-shaped conversation: a system and a user
message, then for each turn the assistant's reply and an observation, the whole history sent each time (as the
harness does). Two paths, on the same prompts and the same engine:

- **direct**: the bench renders the history with the chat template and calls the engine's ``generate`` itself;
- **gateway**: the same history as an OpenAI chat-completions request over HTTP to the gateway, with the session's
  key, which renders, samples, records the ledger and answers.

``--engine scripted`` (the default) puts swectl's scripted policy behind both (it answers at once), so the difference
is the gateway's own cost: HTTP, decoding, rendering the whole history, the ledger, the answer. ``--engine cpu``
runs the tiny model on the CPU engine, for the same comparison with real decoding.

Reported: p50 / p90 / p99 per request of each path, the p50 the gateway adds (goal <= 2 ms at 64 sessions, issue
58), and requests per second. Writes ``benchmarks/results/gateway.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swectl.actors.engines import Engines  # noqa: E402
from swectl.actors.gateway import Gateway, GatewayConfig  # noqa: E402
from swectl.agent.scripted import ScriptedEngine  # noqa: E402
from swectl.agent.trajectory import rendered_ids  # noqa: E402
from swectl.config import EngineConfig  # noqa: E402
from swectl.engine.wire import GenerateRequest, SamplingParams  # noqa: E402
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


async def _direct(engine_for: Any, tokenizer: Any, sessions: int, turns: int, max_tokens: int) -> list[float]:
    latencies: list[float] = []

    async def one(s: int) -> None:
        for turn in range(turns):
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


async def _through_gateway(gateway: Gateway, sessions: int, turns: int, max_tokens: int) -> list[float]:
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=sessions + 8, max_keepalive_connections=sessions + 8)

    async with httpx.AsyncClient(base_url=gateway.url, timeout=600, limits=limits) as client:
        async def one(s: int) -> None:
            key = gateway.open_session(f"g{s}")
            for turn in range(turns):
                body = {"model": gateway.config.model, "messages": _history(turn), "max_tokens": max_tokens}
                t0 = time.perf_counter()
                response = await client.post("/chat/completions", json=body,
                                             headers={"Authorization": f"Bearer {key}"})
                latencies.append(time.perf_counter() - t0)
                if response.status_code != 200:
                    raise RuntimeError(f"gateway answered {response.status_code}: {response.text[:500]}")
            gateway.end_session(key)

        async with anyio.create_task_group() as tg:
            for s in range(sessions):
                tg.start_soon(one, s)
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
                return scripted.setdefault(name, ScriptedEngine(replies, tokenizer))
        else:
            engines = Engines(EngineConfig(max_batch=max(args.sessions, 8), start_timeout_s=300), model=model,
                              log_dir=work)
            await tg.start(engines.run)
            engine_for = engines.route
        gateway = Gateway(GatewayConfig(max_tokens=args.max_tokens, context_tokens=32768), engine_for, tokenizer)
        await tg.start(gateway.run)
        out: dict[str, Any] = {"engine": args.engine, "sessions": args.sessions, "turns": args.turns,
                               "max_tokens": args.max_tokens}
        for _ in range(args.rounds):  # alternated, so the machine's drift hits both paths
            t0 = time.perf_counter()
            direct = await _direct(engine_for, tokenizer, args.sessions, args.turns, args.max_tokens)
            direct_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            through = await _through_gateway(gateway, args.sessions, args.turns, args.max_tokens)
            through_s = time.perf_counter() - t0
            out.setdefault("direct", []).extend(direct)
            out.setdefault("gateway", []).extend(through)
            out.setdefault("direct_s", 0.0)
            out["direct_s"] += direct_s
            out.setdefault("gateway_s", 0.0)
            out["gateway_s"] += through_s
        tg.cancel_scope.cancel()
    direct, through = out.pop("direct"), out.pop("gateway")
    out["direct"] = _quantiles(direct)
    out["gateway"] = _quantiles(through)
    out["added_p50_ms"] = round(out["gateway"]["p50_ms"] - out["direct"]["p50_ms"], 3)
    out["direct_requests_per_s"] = round(len(direct) / out.pop("direct_s"), 1)
    out["gateway_requests_per_s"] = round(len(through) / out.pop("gateway_s"), 1)
    out["prompt_tokens_last_turn"] = len(rendered_ids(tokenizer.apply_chat_template(
        _history(args.turns - 1), tokenize=True, add_generation_prompt=True)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("scripted", "cpu"), default="scripted")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="", help="a model folder (default: a fresh tiny model)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = anyio.run(measure, args)
    print(json.dumps(result, indent=1))
    previous = json.loads(args.results.read_text()) if args.results.exists() else {}
    previous[args.engine] = result
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(previous, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
