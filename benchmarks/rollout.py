"""just bench rollout: episodes per minute and per-step controller overhead, with the replay policy.

1. Real episodes on one node: bundled tasks, real Podman sandboxes, the replay policy replaying gold-solving
   trajectories (so the engine is not the bottleneck), at concurrency 1, 8 and 32. Grading is off (see
   ``just bench grade``). Controller overhead per step = step wall time - engine time - sandbox time.
2. The controller alone: 1,000 concurrent simulated episodes on one core (engine and sandbox simulated
   in-process with small sleeps), 10 steps each: p99 per-step overhead.

Writes benchmarks/results/rollout.json with episodes_per_min_c1/c8/c32, controller_step_overhead_p99_ms_*
and controller_step_overhead_p99_ms_1000.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import uuid
from pathlib import Path

import anyio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from common import Goal, host_meta, percentile, report, run_each, summarize  # noqa: E402

from swectl.actors.env_pool import running_pool  # noqa: E402
from swectl.actors.grader import prepare_task  # noqa: E402
from swectl.agent.loop import EpisodeConfig, run_episode  # noqa: E402
from swectl.agent.protocol import AgentLimits  # noqa: E402
from swectl.config import load_config  # noqa: E402
from swectl.engine.wire import GenerateRequest, GenerateResult  # noqa: E402
from swectl.images.project import BUNDLED_TASKS  # noqa: E402
from swectl.model.tiny import ModelInitConfig, hf_tokenizer, train_tokenizer  # noqa: E402
from swectl.schema import ExecResult  # noqa: E402
from swectl.tasks.record import Task  # noqa: E402
from swectl.tasks.sources import load_tasks  # noqa: E402
from swectl.testing.replay import SUBMIT_REPLY, ReplayEngine, gold_replies  # noqa: E402

SUITE = "rollout"


def tokenizer():
    cfg = ModelInitConfig(vocab_size=2000)
    return hf_tokenizer(train_tokenizer(cfg), cfg)


def overheads_ms(episodes) -> list[float]:
    return [max(0.0, (s.wall_s - s.model_time_s - s.env_time_s) * 1000) for ep in episodes for s in ep.steps]


async def real_episodes(tasks: list[Task], concurrency: int, tok, out: Path) -> tuple[float, list]:
    config = load_config(None, ["env_pool.warm=0", f"nodes.0.max_running={max(64, concurrency)}",
                                f"nodes.0.max_starting={min(16, concurrency)}"])
    episodes = []
    async with running_pool(config, "b" + uuid.uuid4().hex[:10]) as pool:
        async def one(task: Task) -> None:
            async with pool.lease(task.image) as lease:
                if not await prepare_task(lease, task):
                    raise RuntimeError(f"{task.instance_id}: setup failed")
                engine = ReplayEngine(gold_replies(task.patch), tok)
                episodes.append(await run_episode(task, lease, engine, tok, EpisodeConfig()))

        elapsed = await run_each(one, tasks, concurrency)
    return elapsed, episodes


class SimWorkspace:
    """A sandbox simulated in-process: each command takes 1-5 ms."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    async def exec(self, command: str, timeout: float, *, cwd=None, env=None) -> ExecResult:
        await anyio.sleep(self._rng.uniform(0.001, 0.005))
        if command.startswith("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"):
            return ExecResult(output="COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n", exit_code=0, timed_out=False)
        return ExecResult(output="file_a.py\nfile_b.py\n" * 20, exit_code=0, timed_out=False)

    async def diff(self, repo=None) -> bytes:
        return b""


class SimEngine(ReplayEngine):
    """The replay policy with a simulated engine latency of 20-60 ms per turn."""

    def __init__(self, replies, tok, rng: random.Random) -> None:
        super().__init__(replies, tok)
        self._rng = rng

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        await anyio.sleep(self._rng.uniform(0.02, 0.06))
        return await super().generate(request)


async def simulated(n: int, steps: int, tok) -> tuple[float, list]:
    replies = [f"THOUGHT: step {i}, looking around.\n\n```bash\nls -la src/ && grep -rn foo src | head\n```"
               for i in range(steps - 1)] + [SUBMIT_REPLY]
    task = Task(instance_id="sim", repo="sim/sim", problem_statement="Fix the bug in foo. " * 20, FAIL_TO_PASS=["t"])
    cfg = EpisodeConfig(limits=AgentLimits(step_limit=steps + 1))
    episodes = []

    async def one(i: int) -> None:
        rng = random.Random(i)
        episodes.append(await run_episode(task, SimWorkspace(rng), SimEngine(replies, tok, rng), tok, cfg))

    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    return time.monotonic() - started, episodes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="concurrency 1 and 8 only, 200 simulated episodes")
    parser.add_argument("--episodes", type=int, default=32, help="real episodes per concurrency level")
    args = parser.parse_args(argv)
    tok = tokenizer()
    host = host_meta()
    all_tasks = sorted(load_tasks(BUNDLED_TASKS).tasks, key=lambda t: t.instance_id)
    metrics: dict[str, float] = {}
    meta: dict = {"host": host, "quick": args.quick}
    for c in (1, 8) if args.quick else (1, 8, 32):
        n = max(args.episodes, c) if c > 1 else min(8, args.episodes)
        tasks = [all_tasks[i % len(all_tasks)] for i in range(n)]
        elapsed, eps = anyio.run(real_episodes, tasks, c, tok, Path("/tmp"))
        ok = sum(e.exit_status == "Submitted" for e in eps)
        over = sorted(overheads_ms(eps))
        metrics[f"episodes_per_min_c{c}"] = round(len(eps) / elapsed * 60, 1)
        metrics[f"controller_step_overhead_p99_ms_c{c}"] = round(percentile(over, 99), 3)
        meta[f"c{c}"] = {"episodes": len(eps), "submitted": ok, "elapsed_s": round(elapsed, 2),
                         "overhead_ms": summarize(over), "episode_s": summarize([e.total_time_s for e in eps])}
        print(f"  concurrency {c}: {metrics[f'episodes_per_min_c{c}']} episodes/min ({ok}/{len(eps)} submitted)",
              file=sys.stderr)
    n_sim = 200 if args.quick else 1000
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # the simulated phase: the controller on one core
    elapsed, eps = anyio.run(simulated, n_sim, 10, tok)
    over = sorted(overheads_ms(eps))
    metrics[f"controller_step_overhead_p99_ms_{n_sim}"] = round(percentile(over, 99), 3)
    meta[f"sim{n_sim}"] = {"elapsed_s": round(elapsed, 2), "steps": len(over), "overhead_ms": summarize(over),
                           "submitted": sum(e.exit_status == "Submitted" for e in eps)}
    goals = [Goal(f"controller_step_overhead_p99_ms_{n_sim}", "<=", 5.0, text="< 5 ms (docs/architecture.md 13.2)")]
    report(SUITE, metrics, meta, goals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
