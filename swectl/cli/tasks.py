"""`swectl tasks synth`: SWE-smith-style tasks from real projects (swectl/synth/)."""

from __future__ import annotations

import argparse
from pathlib import Path

import anyio
import msgspec

from swectl.cli.common import config_args, say
from swectl.config import load_config
from swectl.images.project import BUNDLED_PROJECTS, build_project_image, load_projects
from swectl.tasks.record import Task


def add_parser(sub: argparse._SubParsersAction) -> None:
    tasks = sub.add_parser("tasks", help="make task sets")
    tsub = tasks.add_subparsers(dest="tasks_command", required=True, metavar="ACTION")
    synth = tsub.add_parser(
        "synth",
        help="synthesise SWE-smith-style tasks from real projects: mutate covered functions, keep mutants that "
        "break 1..N tests",
    )
    config_args(synth)
    synth.add_argument("--projects", type=Path, default=BUNDLED_PROJECTS, help="projects file (TOML)")
    synth.add_argument("--only", action="append", default=[], metavar="NAME", help="only this project")
    synth.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same tasks)")
    synth.add_argument("--max-tasks", type=int, default=10, help="tasks kept per project (default 10)")
    synth.add_argument("--max-candidates", type=int, default=80, help="mutants tried per project (default 80)")
    synth.add_argument("--per-function", type=int, default=3, help="mutants sampled per function (default 3)")
    synth.add_argument("--max-fail", type=int, default=30, help="keep a mutant if 1..N tests fail (default 30)")
    synth.add_argument("--concurrency", type=int, default=2, help="sandboxes running mutants at once")
    synth.add_argument("--out", type=Path, default=Path("tasks.jsonl"), help="output JSONL (default tasks.jsonl)")


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    from swectl.synth.factory import SynthConfig, synth_project

    projects = load_projects(args.projects)
    chosen = [p for p in projects.project if not args.only or p.name in args.only]
    cfg = SynthConfig(seed=args.seed, max_tasks=args.max_tasks, max_candidates=args.max_candidates,
                      per_function=args.per_function, max_fail=args.max_fail, concurrency=args.concurrency)
    built = {p.name: build_project_image(p, projects.runner, say=say) for p in chosen}
    config = msgspec.structs.replace(config, env_pool=msgspec.structs.replace(config.env_pool, warm=0))

    async def main() -> list[Task]:
        from swectl.actors.env_pool import running_pool

        out: list[Task] = []
        async with running_pool(config) as pool:
            for p in chosen:
                tasks, _stats = await synth_project(pool, p, built[p.name], cfg, say=say)
                out.extend(tasks)
        return out

    tasks = anyio.run(main)
    tasks.sort(key=lambda t: t.instance_id)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(b"".join(msgspec.json.encode(t.row()) + b"\n" for t in tasks))
    say(f"wrote {len(tasks)} tasks to {args.out}")
    return 0 if tasks else 1


