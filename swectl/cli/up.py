"""`swectl up`: run the main job on a cluster.

Training does not exist yet (tasks, grading, the agent loop and the trainer are the next issues). Until
then ``up`` runs the most complete part of the pipeline that exists: it starts the env pool on every
node, runs ``--episodes`` scripted sandbox episodes concurrently (set up a git repository, run its
tests, edit it, collect the diff: the shape of an agent episode), and reports timings and pool
statistics. It says so when it starts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import anyio
import msgspec

from swectl.actors.env_pool import EnvPool, new_run_id, running_pool
from swectl.cli.common import config_args
from swectl.config import ClusterConfig, load_config
from swectl.errors import InfraError
from swectl.logs import write_run_log

EPISODE_SCRIPT = r"""
set -e
mkdir -p /work/proj && cd /work/proj
git init -q
cat > calc.py <<'PY'
def add(a, b):
    return a - b
PY
cat > test_calc.py <<'PY'
from calc import add
assert add(2, 3) == 5, "add is broken"
print("tests pass")
PY
git add -A && git -c user.name=swectl -c user.email=swectl@localhost commit -qm base
python3 -B test_calc.py || echo "tests fail (expected before the fix)"
sed -i 's/a - b/a + b/' calc.py
python3 -B test_calc.py
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="run the main job on a cluster (today: the sandbox layer end to end)")
    config_args(up)
    up.add_argument("--episodes", type=int, default=8, help="scripted episodes to run (default 8)")
    up.add_argument("--concurrency", type=int, default=4, help="episodes at once (default 4)")


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    return anyio.run(lambda: run_up(config, episodes=args.episodes, concurrency=args.concurrency))


async def run_up(config: ClusterConfig, *, episodes: int, concurrency: int) -> int:
    run_id = config.run_id or new_run_id()
    out_dir = Path(config.out_dir) / run_id
    out_dir.mkdir(parents=True, exist_ok=True)
    write_run_log(out_dir)
    print(
        "swectl up: training is not implemented yet; running the sandbox layer end to end instead\n"
        f"  run {run_id}: {episodes} scripted episodes, concurrency {concurrency}, "
        f"nodes: {', '.join(n.name for n in config.sandbox_nodes())}"
    )
    results: list[dict] = []
    limiter = anyio.CapacityLimiter(concurrency)
    started = time.perf_counter()
    async with running_pool(config, run_id) as pool, anyio.create_task_group() as episodes_tg:
        for i in range(episodes):
            episodes_tg.start_soon(_episode, pool, i, limiter, results, name=f"episode {i}")
    elapsed = time.perf_counter() - started
    ok = sum(r["ok"] for r in results)
    stats = pool.statistics()
    summary = {
        "format_version": 1,
        "run_id": run_id,
        "episodes": episodes,
        "succeeded": ok,
        "elapsed_s": round(elapsed, 3),
        "episodes_per_min": round(episodes / elapsed * 60, 1),
        "results": sorted(results, key=lambda r: r["episode"]),
        "pool": msgspec.to_builtins(stats),
        "config": msgspec.to_builtins(config),
    }
    (out_dir / "up.json").write_text(json.dumps(summary, indent=2))
    print(
        f"  {ok}/{episodes} episodes succeeded in {elapsed:.1f}s ({summary['episodes_per_min']}/min); "
        f"warm hits {stats.warm_hits}, cold starts {stats.cold_starts}; wrote {out_dir / 'up.json'}"
    )
    return 0 if ok == episodes else 1


async def _episode(pool: EnvPool, index: int, limiter: anyio.CapacityLimiter, results: list[dict]) -> None:
    async with limiter:
        t0 = time.perf_counter()
        record: dict = {"episode": index, "ok": False}
        try:
            with anyio.fail_after(120):
                async with pool.lease() as lease:
                    record["node"] = lease.node
                    record["lease_ms"] = round((time.perf_counter() - t0) * 1000, 2)
                    result = await lease.exec(EPISODE_SCRIPT, 60)
                    diff = await lease.diff("/work/proj")
                    record["ok"] = result.exit_code == 0 and b"+    return a + b" in diff
                    record["exit_code"] = result.exit_code
                    record["diff_bytes"] = len(diff)
        except (InfraError, TimeoutError) as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
            print(f"  episode {index}: {record['error']}", file=sys.stderr)
        record["seconds"] = round(time.perf_counter() - t0, 3)
        results.append(record)
