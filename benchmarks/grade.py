"""just bench grade: seconds per graded task and tasks graded per minute on one node, next to the swebench harness.

Grades the gold patches of bundled tasks with swectl's Grader at concurrency 1, 4 and 8 (fresh sandbox per
task, setup patch, apply ladder, eval script, swebench parser) on each sandbox backend (``sandbox.backend``
podman, then namespace), then the same tasks with the official swebench 5.x harness (``run_instance``) through
Podman's Docker-compatible API, sequentially. Writes benchmarks/results/grade.json with grade_p50_s,
grades_per_min_c1/c4/c8 (podman), the same with an ``ns_`` prefix (namespace: ns_grade_p50_s, ...),
ns_grade_speedup (grade_p50_s / ns_grade_p50_s) and swebench_grade_p50_s.

The grader's defences (docs/grading.md: patch policy, runner sections, canaries) are measured on the first backend
at concurrency 1, rounds with and without them alternated: defended_grade_p50_s, undefended_grade_p50_s and
defences_overhead (their ratio minus 1; goal <= 0.10). ``--only-defences`` measures that alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import anyio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from common import Goal, host_meta, percentile, report, summarize  # noqa: E402

from swectl.actors.env_pool import running_pool  # noqa: E402
from swectl.actors.grader import Grader, GraderConfig  # noqa: E402
from swectl.config import load_config  # noqa: E402
from swectl.grading.official_harness import grade_official, task_image  # noqa: E402
from swectl.images.project import BUNDLED_TASKS  # noqa: E402
from swectl.tasks.record import Task  # noqa: E402
from swectl.tasks.sources import load_tasks  # noqa: E402

SUITE = "grade"
BACKENDS = {"podman": "", "namespace": "ns_"}  # sandbox.backend -> prefix of its metric keys and meta sections


def pick(tasks: list[Task], n: int) -> list[Task]:
    """n tasks spread over the projects (round robin by repo, in id order)."""
    by_repo: dict[str, list[Task]] = {}
    for t in sorted(tasks, key=lambda t: t.instance_id):
        by_repo.setdefault(t.repo, []).append(t)
    out: list[Task] = []
    while len(out) < n and any(by_repo.values()):
        for repo in sorted(by_repo):
            if by_repo[repo] and len(out) < n:
                out.append(by_repo[repo].pop(0))
    return out


async def grade_all(
    tasks: list[Task], concurrency: int, backend: str = "podman", defences: bool = True
) -> tuple[float, list[float], list[str]]:
    config = load_config(None, ["env_pool.warm=0", f"sandbox.backend={backend}"])
    durations: list[float] = []
    statuses: list[str] = []
    async with running_pool(config) as pool:
        grader = Grader(GraderConfig(concurrency=concurrency, defences=defences), pool)
        started = time.monotonic()

        async def one(task: Task) -> None:
            r = await grader.grade(task, task.patch)
            durations.append(r.duration_s)
            statuses.append(r.status)

        async with anyio.create_task_group() as tg:
            for t in tasks:
                tg.start_soon(one, t)
        elapsed = time.monotonic() - started
    return elapsed, durations, statuses


def measure_defences(tasks: list[Task], backend: str, rounds: int, metrics: dict[str, float], meta: dict) -> None:
    """Seconds per grade with the defences and without, rounds alternated and their order swapped each round (so the
    host's drift and a first round's warm-up hit both)."""
    secs: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for defences in ((True, False) if r % 2 == 0 else (False, True)):  # neither always goes first
            _, durations, statuses = anyio.run(grade_all, tasks, 1, backend, defences)
            assert statuses.count("resolved") == len(tasks), statuses  # gold resolves either way
            secs[defences] += durations
    on, off = (round(percentile(sorted(secs[d]), 50), 3) for d in (True, False))
    metrics.update(defended_grade_p50_s=on, undefended_grade_p50_s=off, defences_overhead=round(on / off - 1, 3))
    meta["defences"] = {"backend": backend, "rounds": rounds, "with": summarize(secs[True]),
                        "without": summarize(secs[False])}
    print(f"  defences on {backend}: {on:.3f} s a grade against {off:.3f} s without", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=str(BUNDLED_TASKS), help="task set (default: bundled)")
    parser.add_argument("-n", type=int, default=16, help="tasks per measurement (default 16)")
    parser.add_argument("--quick", action="store_true", help="8 tasks, skip concurrency 4")
    parser.add_argument("--no-swebench", action="store_true", help="skip the swebench harness baseline")
    parser.add_argument("--only-defences", action="store_true",
                        help="measure only the defences' cost (with and without, alternated)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each for the defences' cost (default 4)")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help=f"sandbox backends to grade on, comma-separated (default: {','.join(BACKENDS)})")
    args = parser.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if unknown := sorted(set(backends) - set(BACKENDS)):
        parser.error(f"--backends: unknown {', '.join(unknown)} (known: {', '.join(BACKENDS)})")
    n = 8 if args.quick else args.n
    tasks = pick(load_tasks(args.tasks).tasks, n)
    host = host_meta()
    print(f"grading {len(tasks)} gold patches; load {host['loadavg_start']}", file=sys.stderr)
    metrics: dict[str, float] = {}
    meta: dict = {"tasks": [t.instance_id for t in tasks], "host": host, "backends": backends,
                  "quick": args.quick or args.only_defences}
    measure_defences(tasks, backends[0], args.rounds, metrics, meta)
    for backend in backends if not args.only_defences else []:
        p = BACKENDS[backend]
        for c in (1, 4, 8):
            if args.quick and c == 4:
                continue
            elapsed, durations, statuses = anyio.run(grade_all, tasks, c, backend)
            metrics[f"{p}grades_per_min_c{c}"] = round(len(tasks) / elapsed * 60, 2)
            meta[f"{p}c{c}"] = {"elapsed_s": round(elapsed, 2), "per_task_s": summarize(durations),
                                "statuses": {s: statuses.count(s) for s in set(statuses)}}
            if c == 1:
                metrics[f"{p}grade_p50_s"] = round(percentile(sorted(durations), 50), 3)
            print(f"  {backend}, concurrency {c}: {metrics[f'{p}grades_per_min_c{c}']}/min", file=sys.stderr)
    if metrics.get("grade_p50_s") and metrics.get("ns_grade_p50_s"):
        metrics["ns_grade_speedup"] = round(metrics["grade_p50_s"] / metrics["ns_grade_p50_s"], 2)
    if not args.no_swebench and not args.only_defences:
        for t in tasks:
            task_image(t)  # made once, outside the timing
        verdicts = grade_official([(t, t.patch) for t in tasks])
        secs = sorted(v.seconds for v in verdicts)
        metrics["swebench_grade_p50_s"] = round(percentile(secs, 50), 3)
        for p in (BACKENDS[b] for b in backends):
            metrics[f"{p}speedup_vs_swebench"] = round(metrics["swebench_grade_p50_s"] / metrics[f"{p}grade_p50_s"], 2)
        meta["swebench"] = {"per_task_s": summarize(secs),
                            "resolved": sum(v.resolved for v in verdicts), "n": len(verdicts)}
    goals = [Goal(f"{BACKENDS[b]}grades_per_min_c8", ">=", metrics.get(f"{BACKENDS[b]}grades_per_min_c1", 0.0),
                  text=f">= {BACKENDS[b]}grades_per_min_c1 (concurrency helps)")
             for b in (backends if not args.only_defences else [])]
    goals.append(Goal("defences_overhead", "<=", 0.10, text="<= 0.10 (the defences cost at most 10% a grade)"))
    report(SUITE, metrics, meta, goals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
