"""`just bench engine`: the CPU engine's generation throughput under an agent-like load, against its older
scheduler, in one run.

The load is what `swectl eval` and the GRPO rollouts put on the engine: C clients (the episode concurrency, 8),
each running episodes of T turns. A turn sends the whole context so far (at first the prompt of one of 4 tasks,
900-1,300 tokens, so that episodes share it as the samples of a task do),
samples 48-192 new tokens (temperature 1; EOS ignored so lengths are the load's, not the random model's), then
"runs the command" (a think time of 0.1-1.0 s, when the client sends nothing) and appends an observation of
50-150 tokens. Every configuration gets the same seeded load, on the learn demo's model shape (`swectl model
init`: 4 layers, hidden 128, vocab 8192; random weights), one engine process with one thread.

Configurations, each adding one thing to the one before:
* ``baseline``: static batching (a request that arrives while a batch decodes waits for the whole batch to end),
  transformers' DynamicCache (every decode step copies the whole KV cache to append one position), every prompt
  read in full: the engine before this benchmark existed;
* ``in_place``: the in-place KV cache (remote/programs/kv_cache.py);
* ``continuous``: continuous batching (requests join a running batch between steps);
* ``prefix``: the prefix store (a next turn reuses the KV of the turn before; the samples of a task share the
  first prompt's);
* ``default``: the lean decode forward (remote/programs/lean_decode.py): the engine's defaults.

Metrics: generated tokens per second over the run (``engine_tokens_per_s_<config>``), request latency p50
(``engine_request_p50_s_<config>``), the server's mean rows per decode step, ``engine_speedup_vs_baseline``
(default over baseline tokens per second) and ``engine_speedup_lean_decode`` (default over prefix).
Writes benchmarks/results/engine.json.

Run: ``.venv/bin/python benchmarks/engine.py [--quick] [--model DIR]``.
"""

from __future__ import annotations

import argparse
import random
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from common import Progress, host_meta, report, summarize  # noqa: E402
from engine_kinds import VARIANTS, eval_rate, measure_kind  # noqa: E402

from swectl.engine.client import SglangClient  # noqa: E402
from swectl.engine.wire import GenerateRequest, GenerateResult, SamplingParams  # noqa: E402
from swectl.testing.cpu_engines import start_cpu_engine  # noqa: E402

SUITE = "engine"
CONFIGS = {
    "baseline": ["--batching", "static", "--kv-cache", "concat", "--prefix-cache-mb", "0", "--decode", "transformers"],
    "in_place": ["--batching", "static", "--kv-cache", "in-place", "--prefix-cache-mb", "0",
                 "--decode", "transformers"],
    "continuous": ["--batching", "continuous", "--kv-cache", "in-place", "--prefix-cache-mb", "0",
                   "--decode", "transformers"],
    "prefix": ["--decode", "transformers"],  # continuous batching, the in-place cache and the prefix store
    "default": [],  # and the lean decode forward: the engine's defaults
}
START_TIMEOUT_S = 180.0


def tiny_model(folder: Path, say: Progress) -> Path:
    """The learn demo's model shape (``swectl model init``), made once into ``folder``."""
    if not (folder / "config.json").exists():
        say(f"swectl model init --out {folder}")
        subprocess.run([sys.executable, "-m", "swectl.cli.main", "model", "init", "--out", str(folder), "--seed", "0"],
                       check=True, stdout=subprocess.DEVNULL)
    return folder


async def server_state(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10) as http:
        return (await http.get(f"{url}/get_server_info")).json()["internal_states"][0]


async def load(generate_for: Callable[[int], Callable[[GenerateRequest], Awaitable[GenerateResult]]], *, clients: int,
               episodes: int, turns: int, vocab: int, seed: int) -> dict[str, Any]:
    """Run the agent-like load, client ``i`` sending through ``generate_for(i)``; the generated token count, the wall
    time and each request's latency."""
    latencies: list[float] = []
    generated = 0
    task_rng = random.Random(seed)
    tasks = [[task_rng.randrange(3, vocab) for _ in range(task_rng.randint(900, 1300))] for _ in range(4)]

    async def client_loop(index: int) -> None:
        nonlocal generated
        generate = generate_for(index)
        rng = random.Random(seed * 1000 + index)
        for episode in range(episodes):
            context = list(tasks[(index + episode) % len(tasks)])
            for _ in range(turns):
                request = GenerateRequest(input_ids=context, sampling_params=SamplingParams(
                    max_new_tokens=rng.randint(48, 192), temperature=1.0, ignore_eos=True,
                    sampling_seed=rng.randrange(1 << 30)))
                started = time.monotonic()
                result = await generate(request)
                latencies.append(time.monotonic() - started)
                generated += len(result.output_ids)
                await anyio.sleep(rng.uniform(0.1, 1.0))
                observation = [rng.randrange(3, vocab) for _ in range(rng.randint(50, 150))]
                context = [*context, *result.output_ids, *observation]

    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        for index in range(clients):
            tg.start_soon(client_loop, index)
    return {"generated": generated, "wall_s": time.monotonic() - started, "latencies": latencies}


async def load_on(url: str, **kwargs: Any) -> dict[str, Any]:
    """The load against one CPU engine at ``url``, every client through one SglangClient."""
    async with SglangClient(url, timeout_s=600) as client:
        return await load(lambda _: client.generate, **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one episode per client instead of two")
    parser.add_argument("--model", type=Path, default=None,
                        help="a causal-LM folder (default: the learn demo's shape, made once under runs/)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, from {', '.join(CONFIGS)} (the speedup needs baseline and default); "
                        "'' skips this part")
    parser.add_argument("--kinds", default=",".join(VARIANTS),
                        help=f"engine kinds to compare side by side ({', '.join(VARIANTS)}); '' skips this part")
    parser.add_argument("--loads", default="1,8,32", help="client counts of the kinds' comparison")
    parser.add_argument("--eval-tasks", type=int, default=4,
                        help="bundled tasks of the episodes-per-minute reading per kind, 2 episodes each, all at once "
                        "(at most 4; 0 skips it)")
    args = parser.parse_args(argv)
    say = Progress(SUITE)
    work = REPO / "runs" / "bench-engine"
    work.mkdir(parents=True, exist_ok=True)
    model = args.model or tiny_model(work / "model", say)
    vocab = int(re.search(r'"vocab_size":\s*(\d+)', (model / "config.json").read_text()).group(1))
    episodes = 1 if args.quick else 2
    metrics: dict[str, Any] = {}
    details: dict[str, Any] = {}
    chosen = [name.strip() for name in args.configs.split(",") if name.strip()]
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not 0 <= args.eval_tasks <= 4:
        parser.error("--eval-tasks: 0 to 4 (2 episodes a task, all at once at concurrency 8)")
    if any(k not in VARIANTS for k in kinds):
        parser.error(f"--kinds: choose from {', '.join(VARIANTS)} (got {args.kinds})")
    unknown = [name for name in chosen if name not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {', '.join(unknown)} (choose from {', '.join(CONFIGS)})")
    for name in chosen:
        flags = CONFIGS[name]
        say(f"{name}: {' '.join(flags) or 'the defaults'}; "
            f"{args.clients} clients x {episodes} episodes x {args.turns} turns")
        server = start_cpu_engine(model, work / f"{name}.log", "--threads", "1", *flags, cwd=REPO,
                                  timeout_s=START_TIMEOUT_S)
        try:
            run = anyio.run(partial(load_on, server.url, clients=args.clients, episodes=episodes,
                                    turns=args.turns, vocab=vocab, seed=args.seed))
            state = anyio.run(server_state, server.url)
        finally:
            server.stop()
        tokens_per_s = run["generated"] / run["wall_s"]
        latency = summarize(run["latencies"])
        metrics[f"engine_tokens_per_s_{name}"] = round(tokens_per_s, 1)
        metrics[f"engine_request_p50_s_{name}"] = round(latency["p50"], 3)
        metrics[f"engine_mean_decode_batch_{name}"] = state.get("mean_decode_batch")
        details[name] = {"flags": flags, "generated_tokens": run["generated"], "wall_s": round(run["wall_s"], 1),
                         "request_latency_s": latency, "server": state}
        say(f"{name}: {tokens_per_s:.0f} tokens/s, request p50 {latency['p50']:.2f} s, "
            f"mean decode batch {state.get('mean_decode_batch')}, model seconds {state.get('model_seconds')}")
    if {"baseline", "default"} <= set(chosen):
        metrics["engine_speedup_vs_baseline"] = round(
            metrics["engine_tokens_per_s_default"] / metrics["engine_tokens_per_s_baseline"], 2)
    if {"prefix", "default"} <= set(chosen):  # the lean decode forward alone
        metrics["engine_speedup_lean_decode"] = round(
            metrics["engine_tokens_per_s_default"] / metrics["engine_tokens_per_s_prefix"], 2)
    kinds_details = compare_kinds(args, model, work, vocab, episodes, metrics, say)
    meta = {**host_meta(), "quick": args.quick, "model": str(model), "clients": args.clients,
            "episodes_per_client": episodes, "turns": args.turns, "seed": args.seed, "configs": details,
            "kinds": kinds_details}
    report(SUITE, metrics, meta, [])
    return 0


def compare_kinds(args: argparse.Namespace, model: Path, work: Path, vocab: int, episodes: int,
                  metrics: dict[str, Any], say: Progress) -> dict[str, Any]:
    """The engine kinds side by side (benchmarks/engine_kinds.py); keys ``<kind>_tokens_per_s_c<C>`` and so on."""
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    loads = [int(c) for c in args.loads.split(",") if c.strip()]
    details: dict[str, Any] = {}
    for kind in kinds:
        say(f"kind {kind}: loads {loads} clients x {episodes} episodes x {args.turns} turns")
        got = anyio.run(partial(measure_kind, kind, model, work / "kinds", loads=loads, vocab=vocab, seed=args.seed,
                                turns=args.turns, episodes=episodes, load=load, say=say))
        for clients, row in got["loads"].items():
            metrics[f"{kind}_tokens_per_s_c{clients}"] = row["tokens_per_s"]
            metrics[f"{kind}_request_p50_s_c{clients}"] = row["request_p50_s"]
        for key in ("startup_s", "ttft_s", "weight_sync_s", "rss_mb"):
            metrics[f"{kind}_{key}"] = got[key]
        if args.eval_tasks:
            got["eval"] = eval_rate(kind, model, work / "kinds", tasks=args.eval_tasks, say=say)
            metrics[f"{kind}_episodes_per_min"] = got["eval"]["episodes_per_min"]
        details[kind] = got
    for clients in loads:
        if f"vllm_tokens_per_s_c{clients}" in metrics and f"cpu_tokens_per_s_c{clients}" in metrics:
            metrics[f"vllm_over_cpu_c{clients}"] = round(
                metrics[f"vllm_tokens_per_s_c{clients}"] / metrics[f"cpu_tokens_per_s_c{clients}"], 2)
    return details


if __name__ == "__main__":
    raise SystemExit(main())
