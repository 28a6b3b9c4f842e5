"""`just bench view`: does `swectl view` open a big run fast?

Writes a `swectl up` run folder of ``--episodes`` episodes (default 10,000: 100 steps x 25 tasks x 4 samples, each
with a traj.json of a few turns, patch.diff and meta.json, written with the product's own structs; each step's group
rewards in steps.jsonl), then measures:

* ``view_open_s_10k``: building the run's index from nothing (what `swectl view RUN` does before it serves), the
  episodes' rewards matched from steps.jsonl;
* ``view_refresh_ms``: bringing it up to date when nothing changed (what every API call does: the page polls);
* ``view_episodes_ms``: the episode list of one task through the HTTP API;
* ``view_episode_ms_p50`` / ``_p99``: one episode in full (turns, diff, verdict) through the HTTP API;
* ``view_weight_filter_s``: the first filter by weight version over every episode (it reads each traj.json once).

Goals (issue 42): open in under 2 s, an episode in under 200 ms, on this machine.
Run: ``.venv/bin/python benchmarks/view.py [--quick] [--episodes N] [--keep DIR]``.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import httpx
from common import Goal, host_meta, report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from view_runs import make_up_run, steps_row, write_episode  # noqa: E402  (the tests' run folders, the product's structs)

from swectl.view.app import build_app  # noqa: E402
from swectl.view.index import RunIndex  # noqa: E402

SUITE = "view"
TASKS = 25
SAMPLES = 4


def write_run(folder: Path, episodes: int) -> Path:
    run = make_up_run(folder, steps=1)
    steps = max(1, episodes // (TASKS * SAMPLES))
    observation = "collected 12 items\n" + "tests/test_calc.py ....F.......\n" * 40
    with (run / "metrics.jsonl").open("a") as f:
        for step in range(2, steps + 1):
            f.write(f'{{"step": {step}, "reward_mean": {random.random():.3f}, "loss": -0.01}}\n')
    with (run / "steps.jsonl").open("a") as f:
        for step in range(2, steps + 1):
            rewards: dict[str, list[float]] = {}
            for task in range(TASKS):
                for sample in range(SAMPLES):
                    resolved = random.random() < 0.4
                    write_episode(run / "episodes" / f"step_{step:06d}" / f"task-{task:03d}__{sample}",
                                  f"task-{task:03d}", sample, resolved=resolved, observation=observation,
                                  weight_version=str(step - 1))
                    rewards.setdefault(f"task-{task:03d}", []).append(float(resolved))
            f.write(steps_row(step, rewards))
    return run


async def api_timings(run: RunIndex, reps: int) -> tuple[list[float], float]:
    transport = httpx.ASGITransport(app=build_app([run]))
    ids = random.Random(0).sample(sorted(run.episodes), min(reps, len(run.episodes)))
    async with httpx.AsyncClient(transport=transport, base_url="http://view") as http:
        t0 = time.perf_counter()
        listed = await http.get("/api/runs/0/episodes", params={"instance_id": "task-007"})
        list_ms = (time.perf_counter() - t0) * 1000
        assert listed.status_code == 200 and listed.json()
        out = []
        for rel in ids:
            t0 = time.perf_counter()
            answer = await http.get("/api/runs/0/episode", params={"id": rel})
            out.append((time.perf_counter() - t0) * 1000)
            assert answer.status_code == 200, answer.text
    return out, list_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,000 episodes instead of 10,000")
    parser.add_argument("--episodes", type=int, default=None)
    parser.add_argument("--keep", type=Path, default=None, help="write the run here and keep it (to look at it)")
    args = parser.parse_args(argv)
    random.seed(0)
    n = args.episodes or (1_000 if args.quick else 10_000)
    work = Path(tempfile.mkdtemp(prefix="swectl-bench-view-"))
    folder = args.keep or work / "run"
    try:
        t0 = time.perf_counter()
        run_dir = write_run(folder, n)
        written_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        run = RunIndex(run_dir)
        open_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        run.refresh()
        refresh_ms = (time.perf_counter() - t0) * 1000
        episode_ms, list_ms = anyio.run(api_timings, run, 50)
        t0 = time.perf_counter()
        run.episode_rows(weight_version="7")
        weight_filter_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    suffix = "10k" if n == 10_000 else f"{n}"
    metrics = {f"view_open_s_{suffix}": round(open_s, 3), "view_refresh_ms": round(refresh_ms, 2),
               "view_episodes_ms": round(list_ms, 2),
               "view_episode_ms_p50": round(statistics.median(episode_ms), 2),
               "view_episode_ms_p99": round(sorted(episode_ms)[int(0.99 * (len(episode_ms) - 1))], 2),
               "view_weight_filter_s": round(weight_filter_s, 3)}
    meta = {"host": host_meta(), "quick": args.quick, "episodes": len(run.episodes), "write_s": round(written_s, 1)}
    goals = [Goal(f"view_open_s_{suffix}", "<=", 2.0, text="<= 2 s"),
             Goal("view_episode_ms_p50", "<=", 200.0, text="<= 200 ms")]
    report(SUITE, metrics, meta, goals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
