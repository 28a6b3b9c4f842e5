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

Two knobs make the load a harness's: ``--think-ms`` is each session's mean pause between its turns (seeded,
exponential: the commands a harness runs in its sandbox between model calls; 0 sends the next turn at once, which
measures the gateway saturated, a queue rather than its cost), and ``--client-procs`` runs the gateway's clients in
that many processes of their own (harnesses are processes of their own; 0: in the gateway's process, sharing its
event loop). The direct path pauses the same way.

Reported: p50 / p90 / p99 per request of each path, the p50 the gateway adds (goal <= 2 ms at 64 sessions, issue
58), and requests per second. Writes ``benchmarks/results/gateway.json`` under ``--label`` (default: the engine,
the sessions, and the knobs that are set).
"""

from __future__ import annotations

import argparse
import json
import random
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


async def _clients(url: str, model: str, keys: dict[int, str], turns: int, max_tokens: int, think_s: float,
                   seed: int) -> list[float]:
    """The harnesses' side: each session's turns as chat-completions requests with its key, pausing between them."""
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=len(keys) + 8, max_keepalive_connections=len(keys) + 8)

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one(s: int, key: str) -> None:
            for turn, pause in enumerate(_pauses(s, turns, think_s, seed)):
                await anyio.sleep(pause)
                body = {"model": model, "messages": _history(turn), "max_tokens": max_tokens}
                t0 = time.perf_counter()
                response = await client.post("/chat/completions", json=body,
                                             headers={"Authorization": f"Bearer {key}"})
                latencies.append(time.perf_counter() - t0)
                if response.status_code != 200:
                    raise RuntimeError(f"gateway answered {response.status_code}: {response.text[:500]}")

        async with anyio.create_task_group() as tg:
            for s, key in keys.items():
                tg.start_soon(one, s, key)
    return latencies


async def _through_gateway(gateway: Gateway, sessions: int, turns: int, max_tokens: int, think_s: float = 0.0,
                           seed: int = 0, client_procs: int = 0) -> list[float]:
    keys = {s: gateway.open_session(f"g{s}") for s in range(sessions)}
    if client_procs <= 0:
        latencies = await _clients(gateway.url, gateway.config.model, keys, turns, max_tokens, think_s, seed)
    else:
        latencies = []

        async def proc(part: dict[int, str]) -> None:
            job = json.dumps({"url": gateway.url, "model": gateway.config.model, "keys": part, "turns": turns,
                              "max_tokens": max_tokens, "think_s": think_s, "seed": seed})
            done = await anyio.run_process([sys.executable, __file__, "--client-job", job], check=False)
            if done.returncode != 0:
                raise RuntimeError(f"a client process exited {done.returncode}: {done.stderr.decode()[-2000:]}")
            latencies.extend(json.loads(done.stdout))

        async with anyio.create_task_group() as tg:
            for i in range(client_procs):
                tg.start_soon(proc, {s: k for s, k in keys.items() if s % client_procs == i})
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
                return scripted.setdefault(name, ScriptedEngine(replies, tokenizer))
        else:
            engines = Engines(EngineConfig(max_batch=max(args.sessions, 8), start_timeout_s=300), model=model,
                              log_dir=work)
            await tg.start(engines.run)
            engine_for = engines.route
        gateway = Gateway(GatewayConfig(max_tokens=args.max_tokens, context_tokens=32768), engine_for, tokenizer)
        await tg.start(gateway.run)
        out: dict[str, Any] = {"engine": args.engine, "sessions": args.sessions, "turns": args.turns,
                               "max_tokens": args.max_tokens, "think_ms": args.think_ms,
                               "client_procs": args.client_procs, "seed": args.seed}
        for _ in range(args.rounds):  # alternated, so the machine's drift hits both paths
            t0 = time.perf_counter()
            direct = await _direct(engine_for, tokenizer, args.sessions, args.turns, args.max_tokens,
                                   args.think_ms / 1000, args.seed)
            direct_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            through = await _through_gateway(gateway, args.sessions, args.turns, args.max_tokens, args.think_ms / 1000,
                                             args.seed, args.client_procs)
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


def _client_job(job: str) -> int:
    """One client process (``--client-job``): its sessions' requests; prints their latencies as JSON."""
    spec = json.loads(job)
    keys = {int(s): k for s, k in spec["keys"].items()}
    latencies = anyio.run(_clients, spec["url"], spec["model"], keys, spec["turns"], spec["max_tokens"],
                          spec["think_s"], spec["seed"])
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
                                    *([f"think_{args.think_ms:g}ms"] if args.think_ms else [])])
    previous[label] = result
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(previous, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
