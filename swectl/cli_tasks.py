"""CLI handlers for task sets: ``swectl image``, ``swectl tasks synth`` and ``swectl eval`` (validation and
predictions grading). swectl/cli.py wires them in."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import anyio
import msgspec

from swectl.config import ClusterConfig
from swectl.project_images import (
    BUNDLED_PROJECTS,
    BUNDLED_TASKS,
    build_project_image,
    load_projects,
    project_content,
    prune_images,
)
from swectl.tasks import Task


def _say(msg: str) -> None:
    print(f"swectl: {msg}", file=sys.stderr, flush=True)


def add_image_commands(sub: argparse._SubParsersAction) -> None:
    image = sub.add_parser("image", help="build, list and prune the images task sets run in")
    isub = image.add_subparsers(dest="image_command", required=True, metavar="ACTION")
    build = isub.add_parser(
        "build", help="build project images offline (pinned sdists; cached by content: unchanged inputs are reused)"
    )
    build.add_argument("--projects", type=Path, default=BUNDLED_PROJECTS,
                       help=f"projects file (TOML; default: the bundled set, {BUNDLED_PROJECTS.name})")
    build.add_argument("--only", action="append", default=[], metavar="NAME",
                       help="build only this project (with --repo-cache: only this instance id)")
    build.add_argument("--force", action="store_true", help="rebuild even when the content hash matches")
    build.add_argument("--repo-cache", type=Path, default=None, metavar="DIR",
                       help="build instance images for the classic SWE-bench rows of --tasks from local clones in DIR "
                       "(DIR/owner__name, DIR/owner/name or DIR/name), offline, with the SWE-bench 4.1.0 specs")
    build.add_argument("--tasks", default=None, metavar="SOURCE", help="task set for --repo-cache (file or HF name)")
    build.add_argument("--image-map", type=Path, default=None, metavar="FILE",
                       help="with --repo-cache: write instance_id -> image JSON for `swectl eval --image-map`")
    build.add_argument("--allow-network", action="store_true",
                       help="with --repo-cache: let builds use the network (runs the specs' apt/pip pre-install steps)")
    prune = isub.add_parser("prune", help="remove swectl project images that no projects file describes any more")
    prune.add_argument("--projects", type=Path, default=BUNDLED_PROJECTS, help="projects whose images to keep")
    prune.add_argument("--all", action="store_true", help="remove every swectl project image")
    prune.add_argument("--dry-run", action="store_true", help="only list what would be removed")


def run_image_command(args: argparse.Namespace) -> int:
    if args.image_command == "build" and args.repo_cache is not None:
        return _build_instance_images(args)
    projects = load_projects(args.projects)
    if args.image_command == "build":
        chosen = [p for p in projects.project if not args.only or p.name in args.only]
        for i, p in enumerate(chosen, 1):
            built = build_project_image(p, projects.runner, force=args.force, say=_say)
            state = "cached" if built.cached else "built"
            _say(f"[{i}/{len(chosen)}] {built.image} {state} (content {built.content}, "
                 f"commit {built.base_commit[:10]})")
        return 0
    keep: set[str] = set()
    if not args.all:
        for p in projects.project:
            keep.add(f"{p.image}@{project_content(p, projects.runner)}")
    removed = prune_images(keep, dry_run=args.dry_run)
    _say(("would remove" if args.dry_run else "removed") + f" {len(removed)} image(s): {', '.join(removed) or '-'}")
    return 0


def _build_instance_images(args: argparse.Namespace) -> int:
    from swectl.instance_images import build_instance_images, write_image_map
    from swectl.swebench_specs import load_specs
    from swectl.task_sources import load_tasks

    if not args.tasks:
        raise SystemExit("swectl: --repo-cache needs --tasks SOURCE (the rows whose images to build)")
    tasks = load_tasks(args.tasks).tasks
    if args.only:
        tasks = [t for t in tasks if t.instance_id in set(args.only)]
    outcomes = build_instance_images(tasks, load_specs(), args.repo_cache, say=_say, force=args.force,
                                     allow_network=args.allow_network)
    for o in outcomes:
        _say(f"{o.instance_id}: {o.status} {o.image} {o.message}".rstrip())
    if args.image_map:
        write_image_map(outcomes, args.image_map)
        _say(f"wrote {args.image_map}")
    failed = [o for o in outcomes if o.status == "failed"]
    _say(f"{len(outcomes) - len(failed)}/{len(outcomes)} instance images ready")
    return 1 if failed else 0


def add_tasks_commands(sub: argparse._SubParsersAction, config_args) -> None:
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


def run_tasks_command(args: argparse.Namespace, config: ClusterConfig) -> int:
    from swectl.synth.factory import SynthConfig, synth_project

    projects = load_projects(args.projects)
    chosen = [p for p in projects.project if not args.only or p.name in args.only]
    cfg = SynthConfig(seed=args.seed, max_tasks=args.max_tasks, max_candidates=args.max_candidates,
                      per_function=args.per_function, max_fail=args.max_fail, concurrency=args.concurrency)
    built = {p.name: build_project_image(p, projects.runner, say=_say) for p in chosen}
    config = msgspec.structs.replace(config, env_pool=msgspec.structs.replace(config.env_pool, warm=0))

    async def main() -> list[Task]:
        from swectl.runtime import running_pool

        out: list[Task] = []
        async with running_pool(config) as pool:
            for p in chosen:
                tasks, _stats = await synth_project(pool, p, built[p.name], cfg, say=_say)
                out.extend(tasks)
        return out

    tasks = anyio.run(main)
    tasks.sort(key=lambda t: t.instance_id)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(b"".join(msgspec.json.encode(t.row()) + b"\n" for t in tasks))
    _say(f"wrote {len(tasks)} tasks to {args.out}")
    return 0 if tasks else 1


def add_eval_command(sub: argparse._SubParsersAction, config_args) -> None:
    ev = sub.add_parser(
        "eval",
        help="grade a task set: --gold / --empty validate the tasks (no model), --predictions grades a "
        "SWE-bench predictions file",
        description="Grade patches for a task set in fresh sandboxes and write report.json. With --gold every "
        "task must resolve; with --empty none may (exit 1 otherwise).",
    )
    config_args(ev)
    ev.add_argument("--tasks", default=str(BUNDLED_TASKS),
                    help="task set: JSONL/JSON/parquet file or Hugging Face dataset name (default: the bundled set)")
    what = ev.add_mutually_exclusive_group(required=True)
    what.add_argument("--gold", action="store_true", help="grade each task's gold patch (must resolve)")
    what.add_argument("--empty", action="store_true", help="grade the empty patch (must not resolve)")
    what.add_argument("--predictions", type=Path, metavar="FILE",
                      help="SWE-bench predictions ({instance_id, model_name_or_path, model_patch}; JSON or JSONL)")
    what.add_argument("--model", metavar="DIR",
                      help="run the agent with this HF model folder (e.g. from `swectl model init`) on servers "
                      "swectl launches: the CPU engine on this machine by default; the config's [engine] section "
                      "picks the kind (cpu, sglang) and the nodes (the folder must exist there)")
    what.add_argument("--endpoint", metavar="URL",
                      help="run the agent against a running SGLang-API server (token-in/token-out; needs --tokenizer)")
    what.add_argument("--openai-url", metavar="URL",
                      help="run the agent against any OpenAI-compatible chat endpoint (messages only; needs "
                      "--openai-model; the key comes from $OPENAI_API_KEY when set)")
    agent = ev.add_argument_group("agent runs (--model / --endpoint)")
    agent.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder for --endpoint (default: --model)")
    agent.add_argument("--openai-model", metavar="NAME", help="model name sent to --openai-url")
    agent.add_argument("--samples", type=int, default=1, help="episodes per task (default 1)")
    agent.add_argument("--step-limit", type=int, default=30, help="model turns per episode (default 30)")
    agent.add_argument("--max-tokens", type=int, default=512, help="max new tokens per turn (default 512)")
    agent.add_argument("--context", type=int, default=8192, help="context budget in tokens (default 8192)")
    agent.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    agent.add_argument("--engines", type=int, default=None, metavar="N",
                       help="servers to launch per engine node with --model (default: engine.replicas of the "
                       "config, 1). Which nodes, which kind (cpu or sglang) and how: the [engine] section")
    agent.add_argument("--manage-context", action="store_true",
                       help="head+tail context management when a conversation outgrows --context (keeps system, "
                       "problem, the earliest ~30%% and latest ~70%% of turns)")
    agent.add_argument("--model-name", default="", help="model_name_or_path written to preds.jsonl")
    ev.add_argument("--instances", nargs="+", default=[], metavar="ID", help="only these instance ids")
    ev.add_argument("--slice", default="", metavar="A:B", help="only tasks[A:B] (after --instances)")
    ev.add_argument("--concurrency", type=int, default=4, help="tasks graded at once (default 4)")
    ev.add_argument("--timeout", type=float, default=1800.0, help="grading timeout per task, seconds")
    ev.add_argument("--out", type=Path, default=None, help="output dir (default runs/eval-<mode>-<time>)")
    ev.add_argument("--image-template", default=None, metavar="T",
                    help="image name template for private mirrors / local builds, e.g. "
                    "'registry.local/sweb.eval.x86_64.{id_docker}:latest' (placeholders: {instance_id}, "
                    "{id_docker}, {repo}, {repo_slug}, {version}, {official})")
    ev.add_argument("--image-map", default=None, metavar="FILE",
                    help="JSON/TOML mapping instance_id -> image (wins over the template and official names)")


def _eval_agent(args: argparse.Namespace, config: ClusterConfig, tasks: list[Task]) -> int:
    import os
    import time

    from swectl.actors.rollout import RolloutConfig
    from swectl.agent.loop import EpisodeConfig
    from swectl.agent.protocol import AgentLimits
    from swectl.engine_client import OpenAIChatClient
    from swectl.eval_model import eval_model
    from swectl.images import ImageResolver
    from swectl.schema_engine import SamplingParams

    tokenizer = args.tokenizer or args.model or ""
    chat = None
    if args.openai_url:
        if not args.openai_model:
            raise SystemExit("swectl: --openai-url needs --openai-model NAME")
        chat = OpenAIChatClient(args.openai_url, args.openai_model, api_key=os.environ.get("OPENAI_API_KEY"))
    elif not tokenizer:
        raise SystemExit("swectl: --endpoint needs --tokenizer DIR (token-in/token-out needs the model's tokenizer)")
    if args.engines is not None:
        config = msgspec.structs.replace(config, engine=msgspec.structs.replace(config.engine, replicas=args.engines))
    rollout = RolloutConfig(concurrency=args.concurrency, samples_per_task=args.samples, episode=EpisodeConfig(
        manage_context=args.manage_context,
        limits=AgentLimits(step_limit=args.step_limit, max_context_tokens=args.context),
        sampling=SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature)))
    out = args.out or Path(config.out_dir) / f"eval-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    name = args.model_name or args.model or args.endpoint or args.openai_model
    config = msgspec.structs.replace(config, env_pool=msgspec.structs.replace(config.env_pool, warm=0))
    _say(f"{len(tasks)} tasks x {args.samples} samples, concurrency {args.concurrency}, output {out}")
    resolver = ImageResolver.from_options(args.image_template, args.image_map)
    summary = anyio.run(lambda: eval_model(config, tasks, out, model=args.model or "", endpoint=args.endpoint or "",
                                           chat=chat, tokenizer_path=tokenizer, model_name=name, rollout=rollout,
                                           grade_timeout_s=args.timeout, resolver=resolver))
    print(msgspec.json.format(msgspec.json.encode(summary)).decode())
    _say(f"wrote {out / 'summary.json'}, results.jsonl, preds.jsonl")
    return 0


def _select(tasks: list[Task], ids: list[str], slice_: str) -> list[Task]:
    if ids:
        known = {t.instance_id for t in tasks}
        missing = [i for i in ids if i not in known]
        if missing:
            raise SystemExit(f"swectl: unknown instance ids: {', '.join(missing[:10])}")
        tasks = [t for t in tasks if t.instance_id in set(ids)]
    if slice_:
        a, _, b = slice_.partition(":")
        tasks = tasks[slice(int(a) if a else None, int(b) if b else None)]
    return tasks


def run_eval_command(args: argparse.Namespace, config: ClusterConfig) -> int:
    import time

    from swectl.evaluate import evaluate_patches, format_table, load_predictions, write_report
    from swectl.task_sources import load_tasks

    loaded = load_tasks(args.tasks)
    for p in loaded.problems[:10]:
        _say(f"skipped row {p.location}: {p.field}: {p.message}")
    tasks = _select(loaded.tasks, args.instances, args.slice)
    if args.model or args.endpoint or args.openai_url:
        return _eval_agent(args, config, tasks)
    mode = "gold" if args.gold else "empty" if args.empty else "predictions"
    predictions = load_predictions(args.predictions) if args.predictions else None
    out = args.out or Path(config.out_dir) / f"eval-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    config = msgspec.structs.replace(config, env_pool=msgspec.structs.replace(config.env_pool, warm=0))
    _say(f"grading {len(tasks)} tasks ({mode}), concurrency {args.concurrency}, output {out}")
    from swectl.images import ImageResolver

    resolver = ImageResolver.from_options(args.image_template, args.image_map)
    report = anyio.run(lambda: evaluate_patches(config, tasks, mode, out, concurrency=args.concurrency,
                                                timeout_s=args.timeout, predictions=predictions,
                                                resolver=resolver))
    print(format_table(report))
    _say(f"wrote {write_report(report, out)}")
    if mode == "predictions":
        return 0
    return 0 if report.expectations_met == report.total else 1
