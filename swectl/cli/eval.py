"""`swectl eval`: grade a task set (--gold, --empty, --predictions) or run an agent on it and grade
(--model, --endpoint, --openai-url). The drivers live in swectl/eval/."""

from __future__ import annotations

import argparse
from pathlib import Path

import anyio
import msgspec

from swectl.cli.common import config_args, say
from swectl.config import ClusterConfig, load_config
from swectl.images.project import BUNDLED_TASKS
from swectl.tasks.record import Task


def add_parser(sub: argparse._SubParsersAction) -> None:
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
    from swectl.engine.client import OpenAIChatClient
    from swectl.engine.wire import SamplingParams
    from swectl.eval.agents import eval_model
    from swectl.images.names import ImageResolver

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
    say(f"{len(tasks)} tasks x {args.samples} samples, concurrency {args.concurrency}, output {out}")
    resolver = ImageResolver.from_options(args.image_template, args.image_map)
    summary = anyio.run(lambda: eval_model(config, tasks, out, model=args.model or "", endpoint=args.endpoint or "",
                                           chat=chat, tokenizer_path=tokenizer, model_name=name, rollout=rollout,
                                           grade_timeout_s=args.timeout, resolver=resolver))
    print(msgspec.json.format(msgspec.json.encode(summary)).decode())
    say(f"wrote {out / 'summary.json'}, results.jsonl, preds.jsonl")
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


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    import time

    from swectl.eval.patches import evaluate_patches, format_table, load_predictions, write_report
    from swectl.tasks.sources import load_tasks

    loaded = load_tasks(args.tasks)
    for p in loaded.problems[:10]:
        say(f"skipped row {p.location}: {p.field}: {p.message}")
    tasks = _select(loaded.tasks, args.instances, args.slice)
    if args.model or args.endpoint or args.openai_url:
        return _eval_agent(args, config, tasks)
    mode = "gold" if args.gold else "empty" if args.empty else "predictions"
    predictions = load_predictions(args.predictions) if args.predictions else None
    out = args.out or Path(config.out_dir) / f"eval-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    config = msgspec.structs.replace(config, env_pool=msgspec.structs.replace(config.env_pool, warm=0))
    say(f"grading {len(tasks)} tasks ({mode}), concurrency {args.concurrency}, output {out}")
    from swectl.images.names import ImageResolver

    resolver = ImageResolver.from_options(args.image_template, args.image_map)
    report = anyio.run(lambda: evaluate_patches(config, tasks, mode, out, concurrency=args.concurrency,
                                                timeout_s=args.timeout, predictions=predictions,
                                                resolver=resolver))
    print(format_table(report))
    say(f"wrote {write_report(report, out)}")
    if mode == "predictions":
        return 0
    return 0 if report.expectations_met == report.total else 1
