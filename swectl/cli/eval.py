"""`swectl eval`: grade a task set (--gold, --empty, --predictions) or run an agent on it and grade
(--model, --endpoint, --openai-url). The drivers live in swectl/eval/."""

from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import msgspec

from swectl import logs
from swectl.cli.common import config_args, load_run_config, load_task_set, output_dir, say
from swectl.config import ClusterConfig, override_text
from swectl.errors import ConfigError, TaskDataError
from swectl.images.project import BUNDLED_TASKS
from swectl.logs import write_run_log
from swectl.tasks.record import Task

if TYPE_CHECKING:
    from swectl.eval.agents import RunSettings
    from swectl.images.names import ImageResolver

# [rollout] keys with a shorthand flag (--step-limit sets rollout.step_limit, ...)
ROLLOUT_FLAGS = ("samples", "step_limit", "max_tokens", "context", "temperature", "manage_context", "seed")


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
    agent = ev.add_argument_group(
        "agent runs (--model / --endpoint / --openai-url)",
        "The episode settings are the config's [rollout] section (--set rollout.KEY=VALUE); these flags are "
        "shorthands that override it.")
    agent.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder for --endpoint (default: --model)")
    agent.add_argument("--openai-model", metavar="NAME", help="model name sent to --openai-url")
    agent.add_argument("--samples", type=int, default=None, help="episodes per task (rollout.samples, default 1)")
    agent.add_argument("--step-limit", type=int, default=None,
                       help="model turns per episode (rollout.step_limit, default 30)")
    agent.add_argument("--max-tokens", type=int, default=None,
                       help="max new tokens per turn (rollout.max_tokens, default 512)")
    agent.add_argument("--context", type=int, default=None,
                       help="context budget in tokens (rollout.context, default 8192)")
    agent.add_argument("--temperature", type=float, default=None,
                       help="sampling temperature (rollout.temperature, default 0: greedy)")
    agent.add_argument("--seed", type=int, default=None, metavar="N",
                       help="seeded sampling (rollout.seed): every request's seed comes from N, the task, the "
                       "sample and the turn, so the same model gives the same episodes again (the CPU engine; "
                       "SGLang with --enable-deterministic-inference). Default: fresh randomness")
    agent.add_argument("--engines", type=int, default=None, metavar="N",
                       help="servers to launch per engine node with --model (default: engine.replicas of the "
                       "config, 1). Which nodes, which kind (cpu or sglang) and how: the [engine] section")
    agent.add_argument("--manage-context", action="store_true", default=None,
                       help="head+tail context management when a conversation outgrows --context (keeps system, "
                       "problem, the earliest ~30%% and latest ~70%% of turns; rollout.manage_context)")
    agent.add_argument("--harness", choices=["mini-swe-agent", "codex", "claude-code"], default="",  # or agent.harness
                       help="run an external agent harness, unmodified, instead of swectl's loop: its model calls "
                       "go through swectl's gateway to the engines of --model/--endpoint, its commands run in the "
                       "task's sandbox, and swectl grades the sandbox's diff (mini-swe-agent; codex and claude-code "
                       "run inside the sandbox, reaching only the gateway; all from `bash scripts/setup.sh "
                       "--with-harnesses`; docs/gateway.md, docs/cli-agents.md)")
    agent.add_argument("--harness-config", default="", metavar="NAME|FILE",
                       help="the harness's own config (default: agent.harness_config, mini-swe-agent's "
                       "swebench.yaml): a name it knows, a YAML file of its format, or `swectl` (swectl's prompt in "
                       "its format, for models whose chat template renders no tools); --step-limit sets its "
                       "agent.step_limit")
    agent.add_argument("--model-name", default="", help="model_name_or_path written to preds.jsonl")
    agent.add_argument("--fresh", action="store_true",
                       help="start over in an existing --out (deletes its earlier results); without it a rerun "
                       "resumes, and only when its settings match the recorded ones (run.json)")
    ev.add_argument("--instances", nargs="+", default=[], metavar="ID", help="only these instance ids")
    ev.add_argument("--slice", default="", metavar="A:B",
                    help="only tasks[A:B] (after --instances), as Python slices: 0:8, -4:, :10, ::2")
    # `--slice -1:` is a value, not an option (argparse only knows plain negative numbers).
    ev._negative_number_matcher = re.compile(r"^-\d+$|^-\d*\.\d+$|^-\d*:[-\d:]*$")
    ev.add_argument("--concurrency", type=int, default=4, help="tasks graded at once (default 4)")
    ev.add_argument("--timeout", type=float, default=1800.0, help="grading timeout per task, seconds")
    ev.add_argument("--out", type=Path, default=None, help="output dir (default runs/eval-<mode>-<time>)")
    ev.add_argument("--image-template", default=None, metavar="T",
                    help="image name template for private mirrors / local builds, e.g. "
                    "'registry.local/sweb.eval.x86_64.{id_docker}:latest' (placeholders: {instance_id}, "
                    "{id_docker}, {repo}, {repo_slug}, {version}, {official})")
    ev.add_argument("--image-map", default=None, metavar="FILE",
                    help="JSON/TOML mapping instance_id -> image (wins over the template and official names)")


def run(args: argparse.Namespace) -> int:
    return anyio.run(drive, args)


async def drive(args: argparse.Namespace) -> int:
    """`swectl eval` inside a running event loop (``run`` is this under ``anyio.run``; a recipe's phases await it)."""
    config = load_run_config(args.config, [*args.overrides, *rollout_overrides(args)], args.config_overlay)
    agent = bool(args.model or args.endpoint or args.openai_url)
    settings = _agent_settings(args, config) if agent else None
    if settings is not None and settings.mode != "openai":
        from swectl.eval.agents import tokenizer_knob
        from swectl.model.tokenizer import check_tokenizer_folder

        check_tokenizer_folder(settings.tokenizer, tokenizer_knob(settings))
    every = load_task_set(args.tasks)
    tasks = select_tasks(every, args.instances, args.slice)
    mode = ("gold" if args.gold else "empty" if args.empty else "predictions" if args.predictions
            else settings.mode if settings else "")
    jobs, model = ([], "") if settings else _patch_jobs(args, mode, every, tasks)
    out = output_dir(args.out or Path(config.out_dir) / f"eval-{mode}-{time.strftime('%Y%m%d-%H%M%S')}")
    write_run_log(out)  # what happens inside the run: restarts, node loss, retries, reaped orphans
    # Every sandbox of an eval run is for one task image: warm base-image sandboxes would be wasted.
    config = msgspec.structs.replace(config, env_pool=msgspec.structs.replace(config.env_pool, warm=0))
    from swectl.images.names import ImageResolver

    resolver = ImageResolver.from_options(args.image_template, args.image_map)
    if settings is not None:
        return await _eval_agent(args, config, settings, tasks, out, resolver)
    return await _eval_patches(args, config, mode, jobs, model, out, resolver)


def rollout_overrides(args: argparse.Namespace) -> list[str]:
    """The shorthand flags given, as ``rollout.KEY=VALUE`` overrides (applied after --set: the flags win)."""
    overrides = []
    for key in ROLLOUT_FLAGS:
        value = getattr(args, key, None)
        if value is not None:
            overrides.append(override_text(f"rollout.{key}", value))
    return overrides


def _agent_settings(args: argparse.Namespace, config: ClusterConfig) -> RunSettings:
    from swectl.eval.agents import RunSettings

    harness = {"harness": args.harness or config.agent.harness,
               "harness_config": args.harness_config or (config.agent.harness_config if config.agent.harness else "")}
    if harness["harness"] and args.openai_url:
        raise ConfigError("--harness runs through swectl's gateway, which needs token ids: give --model or "
                          "--endpoint, not --openai-url")
    if args.openai_url:
        if not args.openai_model:
            raise ConfigError("--openai-url needs --openai-model NAME (the model name the endpoint serves)")
        return RunSettings(mode="openai", model=args.openai_url, openai_model=args.openai_model,
                           model_name=args.model_name or args.openai_model, rollout=config.rollout)
    if args.endpoint:
        if not args.tokenizer:
            raise ConfigError("--endpoint needs --tokenizer DIR (token-in/token-out needs the model's tokenizer)")
        return RunSettings(mode="endpoint", model=args.endpoint, tokenizer=args.tokenizer,
                           model_name=args.model_name or args.endpoint, rollout=config.rollout, **harness)
    return RunSettings(mode="model", model=args.model, tokenizer=args.tokenizer or args.model,
                       model_name=args.model_name or args.model, rollout=config.rollout, **harness)


async def _eval_agent(args: argparse.Namespace, config: ClusterConfig, settings: RunSettings, tasks: list[Task],
                out: Path, resolver: ImageResolver) -> int:
    from swectl.eval.agents import eval_model

    if args.engines is not None:
        config = msgspec.structs.replace(config, engine=msgspec.structs.replace(config.engine, replicas=args.engines))
    say(f"{len(tasks)} tasks x {settings.rollout.samples} samples, concurrency {args.concurrency}, output {out}")
    summary = await eval_model(config, tasks, out, settings, concurrency=args.concurrency,
                               grade_timeout_s=args.timeout, resolver=resolver,
                               api_key=os.environ.get("OPENAI_API_KEY"), tasks_source=str(args.tasks),
                               fresh=args.fresh, status=say)
    print(msgspec.json.format(msgspec.json.encode(summary)).decode(), file=logs.out())
    say(f"wrote {out / 'summary.json'}, results.jsonl, preds.jsonl")
    return 0


def _patch_jobs(args: argparse.Namespace, mode: str, every: list[Task], tasks: list[Task]) -> tuple[list, str]:
    """What patch grading grades, and the predictions' model name; predictions that grade nothing are an error."""
    from swectl.eval.patches import load_predictions, patch_jobs

    predictions = load_predictions(args.predictions) if args.predictions else None
    jobs = patch_jobs(tasks, mode, predictions)  # type: ignore[arg-type]
    if predictions is None:
        return jobs, ""
    if not predictions:
        raise TaskDataError(f"{args.predictions}: no predictions in it")
    known = {t.instance_id for t in every}
    unknown = sorted(i for i in predictions if i not in known)
    if unknown:
        shown = ", ".join(unknown[:10]) + (f" (+{len(unknown) - 10} more)" if len(unknown) > 10 else "")
        message = (f"{len(unknown)} of {len(predictions)} predictions are for instances not in the task set "
                   f"{args.tasks}: {shown}")
        if not jobs:
            raise TaskDataError(f"{message}; nothing to grade. Did you forget --tasks (the task set the "
                                "predictions were made for)?")
        say(f"{message}; they are not graded")
    if not jobs:
        raise ConfigError(f"none of the {len(predictions)} predictions is for one of the {len(tasks)} selected "
                          "tasks (--instances / --slice)")
    return jobs, ", ".join(sorted({p.model_name_or_path for p in predictions.values() if p.model_name_or_path}))


async def _eval_patches(args: argparse.Namespace, config: ClusterConfig, mode: str, jobs: list, model: str, out: Path,
                  resolver: ImageResolver) -> int:
    from swectl.eval.patches import evaluate_patches, format_table, write_report

    say(f"grading {len(jobs)} tasks ({mode}), concurrency {args.concurrency}, output {out}")
    report = await evaluate_patches(config, jobs, mode, out, concurrency=args.concurrency,  # type: ignore[arg-type]
                                    timeout_s=args.timeout, resolver=resolver, model=model, tasks=str(args.tasks))
    print(format_table(report), file=logs.out())
    say(f"wrote {write_report(report, out)}")
    if mode == "predictions":
        return 0
    return 0 if report.expectations_met == report.total else 1


def parse_slice(text: str) -> slice:
    """``A:B`` or ``A:B:C`` as Python reads it (each part optional, negatives count from the end)."""
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        values = [int(p) if p.strip() else None for p in parts]
        if len(values) == 3 and values[2] == 0:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--slice {text!r}: expected START:STOP or START:STOP:STEP with integers, as in Python "
                          "(e.g. 0:8, -4:, :10, ::2; STEP not 0)") from None
    return slice(*values)


def select_tasks(tasks: list[Task], ids: list[str], slice_text: str) -> list[Task]:
    """``--instances`` then ``--slice``; selecting nothing is an error that says why."""
    selected = tasks
    if ids:
        known = {t.instance_id for t in tasks}
        missing = [i for i in ids if i not in known]
        if missing:
            raise ConfigError(f"--instances: unknown instance ids: {', '.join(missing[:10])}"
                              + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else "")
                              + f"; the task set has {len(tasks)} tasks")
        wanted = set(ids)
        selected = [t for t in tasks if t.instance_id in wanted]
    if slice_text:
        before = len(selected)
        selected = selected[parse_slice(slice_text)]
        if not selected:
            raise ConfigError(f"--slice {slice_text} selects none of the {before} tasks "
                              + ("given by --instances" if ids else "of the task set"))
    return selected
