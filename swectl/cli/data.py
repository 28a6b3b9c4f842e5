"""`swectl data prepare`: a task source -> prompts.jsonl + images.txt for slime / miles (swectl/data/prepare.py);
`swectl data gold`: gold trajectories for SFT (swectl/eval/gold.py);
`swectl data judge`: labelled step verdicts from episodes, to train a process-reward judge (swectl/data/judge.py);
`swectl data atif`: episodes as ATIF trajectories, Harbor's interchange format (swectl/data/atif.py)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from swectl.cli.common import config_args, load_run_config, output_dir, say
from swectl.data.prepare import (
    SHOWN_PROBLEMS,
    PrepareSummary,
    check_not_eval_set,
    prepare,
)
from swectl.errors import TaskDataError
from swectl.images.names import PLACEHOLDERS, ImageResolver
from swectl.images.project import BUNDLED_TASKS
from swectl.tasks.record import Task
from swectl.tasks.sources import TASK_SOURCES, RowProblem, load_tasks

DATA_EPILOG = """\
examples:
  swectl data prepare tasks.jsonl --out data/train
  swectl data prepare SWE-Gym/SWE-Gym:train --out data/swe-gym --source-hint swe-gym
  swectl data prepare smith.parquet --out data/smith --image-map images.toml
  swectl data prepare tasks.jsonl --out data/mirror --image-template 'registry.local:5000/{official}'
"""
GOLD_EPILOG = """\
examples:
  swectl data gold --model runs/models/tiny-qwen3 --out data/gold
  swectl data gold --model runs/models/tiny-qwen3 --slice 0:4 --out data/gold-4
"""
JUDGE_EPILOG = """\
examples:
  swectl data judge runs/learn/eval-sft --tasks runs/learn/train.jsonl --out data/judge.jsonl
  swectl up --set train.algorithm='"sft"' --set train.data.sft_data='["data/judge.jsonl"]' --set train.model=...

labels: a malformed reply is bad; every well-formed step of a resolved episode is good; the last step of
an episode that submitted without resolving is bad; the other steps of unresolved episodes are left out.
"""


ATIF_EPILOG = """\
examples:
  swectl data atif runs/eval-model-1 --out atif/
  swectl data atif runs/up-1/episodes/step_000003 --out atif/ --model-name tiny
  python -m harbor.utils.trajectory_validator atif/calc-1__0.atif.json   # Harbor's own check
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``data`` (with ``data prepare``, ``data gold`` and ``data judge``) to a ``swectl`` sub-command parser;
    returns the ``data`` parser."""
    data = subparsers.add_parser("data", help="prepare task sets (prompt files and image lists for training), "
                                 "gold trajectories for SFT and judge data for process rewards")
    actions = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    prepare_parser = actions.add_parser(
        "prepare",
        help="load a task source and write prompts.jsonl + images.txt (+ problems.jsonl) for slime / miles",
        description="Load SWE tasks from a file or a Hugging Face dataset, normalise every row into swectl's\n"
        "Task schema, and write OUT/prompts.jsonl (one prompt per task), OUT/images.txt (the images\n"
        "the set needs) and, when rows were skipped, OUT/problems.jsonl.",
        epilog=DATA_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _prepare_arguments(prepare_parser)
    gold_parser = actions.add_parser(
        "gold",
        help="gold trajectories for SFT: act out each task's gold patch as an agent would, in real sandboxes, "
        "and keep the ones that resolve",
        description="Write each task's gold patch as agent turns (look at the code, one short edit command, run the\n"
        "failing tests, submit), play them through the real agent loop and Rollout actor in fresh sandboxes\n"
        "(tokenized with --model's tokenizer and chat template, as a model's episodes are), grade them, and\n"
        "keep the trajectories that resolve. Writes OUT/<instance_id>__0/traj.json per kept task, OUT/excluded/\n"
        "(gold trajectories that did not resolve), results.jsonl and summary.json. Exit 0 when at least one\n"
        "gold trajectory was kept, 1 when none was.",
        epilog=GOLD_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _gold_arguments(gold_parser)
    judge_parser = actions.add_parser(
        "judge",
        help="labelled step verdicts from recorded episodes, to train a judge model for [reward.prm]",
        description="Read the episodes of swectl runs (traj.json + meta.json: `swectl eval --model`, `swectl data\n"
        "gold`, a training run's episodes/), rebuild each step's judge prompt exactly as [reward.prm] asks it\n"
        "(the issue, the last steps, the step and its output), label the steps the outcome settles, and write\n"
        "OpenAI-messages JSONL whose answer is \\boxed{1} or \\boxed{-1} (train.data.sft_data reads it).",
        epilog=JUDGE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _judge_arguments(judge_parser)
    atif_parser = actions.add_parser(
        "atif",
        help="write recorded episodes as ATIF-v1.7 trajectories (Harbor's format), token ids and logprobs included",
        description="Write each episode (traj.json) of swectl runs as OUT/<episode folder>.atif.json, an ATIF-v1.7\n"
        "document (Harbor's Agent Trajectory Interchange Format): system and user steps, one agent step per model\n"
        "turn with its bash command as a tool call and the observation, and per step prompt_token_ids,\n"
        "completion_token_ids and logprobs exactly as the engine saw and emitted them. The loss mask and weight\n"
        "version are in the steps' extra; the grade and patch in the document's extra. train.data.sft_data reads\n"
        "ATIF files back (and Harbor's own), and `swectl view` opens a folder of them.",
        epilog=ATIF_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    atif_parser.add_argument("runs", nargs="+", metavar="RUN",
                             help="run folders (their <instance_id>__<n>/ episode folders), episode folders or "
                             "traj.json files")
    atif_parser.add_argument("--out", required=True, metavar="DIR", help="the folder to write the .atif.json files to")
    atif_parser.add_argument("--model-name", default=None, help="the model's name in the documents (agent.model_name)")
    atif_parser.add_argument("--tokenizer", default=None, metavar="DIR",
                             help="decode turns recorded by tokens only (an external harness's) with this model "
                             "folder's tokenizer")
    return data


def _judge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="run folders (their <instance_id>__<n>/ episode folders), episode folders or traj.json "
                        "files")
    parser.add_argument("--tasks", default=str(BUNDLED_TASKS),
                        help="the task set the episodes ran on, for the problem statements (default: the bundled "
                        "set); SWE-bench Verified is refused (an evaluation set is never training data)")
    parser.add_argument("--out", required=True, metavar="FILE", help="the JSONL file to write")
    parser.add_argument("--history-steps", type=int, default=4,
                        help="earlier steps in each prompt (reward.prm.history_steps, default 4)")
    parser.add_argument("--max-chars", type=int, default=2000,
                        help="characters kept of each reply and output (reward.prm.max_chars, default 2000)")


def _gold_arguments(parser: argparse.ArgumentParser) -> None:
    config_args(parser)
    parser.add_argument("--tasks", default=str(BUNDLED_TASKS),
                        help="task set: JSONL/JSON/parquet file or Hugging Face dataset name (default: the bundled "
                        "set)")
    parser.add_argument("--instances", nargs="+", default=[], metavar="ID", help="only these instance ids")
    parser.add_argument("--slice", default="", metavar="A:B",
                        help="only tasks[A:B] (after --instances), as Python slices: 0:8, -4:, :10, ::2")
    parser._negative_number_matcher = re.compile(r"^-\d+$|^-\d*\.\d+$|^-\d*:[-\d:]*$")  # `--slice -4:`
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="the model folder (e.g. from `swectl model init`) whose tokenizer and chat template "
                        "tokenize the trajectories")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder (created; must not hold a run)")
    parser.add_argument("--concurrency", type=int, default=4, help="episodes at once (default 4)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="grading timeout per task, seconds")
    parser.add_argument("--script", choices=("gold", "give-up", "recover", "attack"), action="append", default=None,
                        help="repeat it to run several scripts at once in one process, each into --out/SCRIPT, "
                        "sharing sandboxes and a grader that grades a patch once (recover ends with the gold patch; "
                        "give-up's empty patch is unresolved without a run, as the SWE-bench harness scores it). "
                        "gold (default): act out the gold patch, keep what resolves; give-up: a wrong teacher "
                        "that looks at the same code and submits no change, keep what does not resolve (SFT data "
                        "mixing right and wrong attempts, for train.data.sft_resolved_only = false; the learning "
                        "demo); "
                        "recover: the gold patch with a cut-off (malformed) copy of the first look and of the edit "
                        "before each, keep what resolves (SFT masks the malformed replies: the model learns to "
                        "recover from a slip); attack: a reward-hacking teacher that looks at the code, adds a root "
                        "pytest.ini loading a plugin that reports every failure as a pass, and submits, kept whatever "
                        "its grade (tampered under the grader's defences; benchmarks/hack.py measures whether the "
                        "grader holds under GRPO)")


def _prepare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        metavar="SOURCE",
        help="a .jsonl, .jsonl.gz, .json (array, or object with a 'rows'/'instances' list) or .parquet file, "
        "or a Hugging Face dataset name owner/name[:split]",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="stop at the first malformed row (exit 2) instead of skipping it and listing it in problems.jsonl",
    )
    parser.add_argument(
        "--split",
        default="test",
        metavar="S",
        help="split of a Hugging Face dataset (default: test; SWE-Gym and SWE-smith only have train); "
        "owner/name:split in SOURCE wins",
    )
    parser.add_argument(
        "--source-hint",
        choices=[s for s in TASK_SOURCES if s != "swectl-synth"],
        default=None,
        help="row style for rows that do not say it themselves; matters for images (SWE-Gym names) and for "
        "SWE-smith, whose patch is the bug and is reversed into the fix (default: detect per row)",
    )
    images = parser.add_mutually_exclusive_group()
    images.add_argument(
        "--image-template",
        metavar="T",
        help="image name for every task, with placeholders "
        + ", ".join(f"{{{p}}}" for p in PLACEHOLDERS)
        + " (e.g. 'registry.local:5000/{official}'); default: the official image of each task",
    )
    images.add_argument(
        "--image-map",
        metavar="FILE",
        help="JSON or TOML file mapping instance_id to image name; tasks it does not list get their official image",
    )
    parser.add_argument(
        "--data-source",
        metavar="NAME",
        default=None,
        help="data_source written into each prompt's metadata (the rollout picks its environment by it); "
        "default: the tasks' source (swe-bench, swe-gym, swe-smith, swectl-synth) when they share one, else swectl",
    )
    parser.add_argument(
        "--allow-eval-set",
        action="store_true",
        help="allow SWE-bench Verified as SOURCE (for evaluation prompts only; it must never be trained on)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``swectl data prepare``, ``gold``, ``judge`` or ``atif``."""
    if args.data_command == "atif":
        return _run_atif(args)
    if args.data_command == "gold":
        import anyio

        return anyio.run(gold, args)
    if args.data_command == "judge":
        return _run_judge(args)
    return _run_prepare(args)


def _run_atif(args: argparse.Namespace) -> int:
    """``swectl data atif``: 0 when every episode was written. Bad input raises (exit 2 through cli.main)."""
    from pathlib import Path

    from swectl.data.atif import export_runs

    decode = None
    if args.tokenizer:
        from swectl.model.tokenizer import load_tokenizer
        tok = load_tokenizer(args.tokenizer, "--tokenizer")
        decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    written = export_runs(args.runs, Path(args.out), model_name=args.model_name, decode=decode)
    say(f"wrote {len(written)} ATIF trajectories to {args.out}")
    return 0


def _run_judge(args: argparse.Namespace) -> int:
    """``swectl data judge``: 0 when labelled steps were written. Bad input raises (exit 2 through cli.main)."""
    from pathlib import Path

    import msgspec

    from swectl.data.judge import judge_examples, write_judge_data

    check_not_eval_set(args.tasks, "", allow=False)
    loaded = load_tasks(args.tasks)
    problems = {task.instance_id: task.problem_statement for task in loaded.tasks}
    examples, summary = judge_examples(args.runs, problems, history_steps=args.history_steps,
                                       max_chars=args.max_chars)
    for skipped in summary.skipped_episodes[:SHOWN_PROBLEMS]:
        say(f"skipped {skipped}")
    write_judge_data(examples, Path(args.out))
    print(msgspec.json.format(msgspec.json.encode(summary)).decode())
    say(f"{len(examples)} labelled steps ({summary.good} good, {summary.bad} bad: {summary.bad_malformed} malformed, "
        f"{summary.bad_submission} unresolved submissions; {summary.unlabelled} left out) from {summary.episodes} "
        f"episodes; wrote {args.out}")
    return 0


async def gold(args: argparse.Namespace) -> int:
    """``swectl data gold`` inside a running event loop (a recipe's phases await it): 0 when at least one gold
    trajectory was kept, 1 when none was."""
    import msgspec

    from swectl import logs
    from swectl.cli.eval import select_tasks
    from swectl.eval.gold import check_out_dir, make_scripted
    from swectl.logs import write_run_log
    from swectl.model.tokenizer import load_tokenizer

    config = load_run_config(args.config, args.overrides, args.config_overlay)
    tokenizer = load_tokenizer(args.model, "--model")
    from swectl.images.harbor import with_harbor_prepared

    loaded = with_harbor_prepared(load_tasks(args.tasks), say=say)  # Harbor tasks: images built, gold made
    for problem in loaded.problems[:SHOWN_PROBLEMS]:
        say(f"skipped row {problem}")
    if not loaded.tasks:
        raise TaskDataError(f"--tasks {args.tasks}: no usable task in it ({loaded.rows_read} rows, "
                            f"{len(loaded.problems)} malformed)")
    tasks = select_tasks(loaded.tasks, args.instances, args.slice)
    scripts = list(dict.fromkeys(args.script or ["gold"]))
    out = output_dir(args.out)
    outs = {script: out for script in scripts} if len(scripts) == 1 else {s: output_dir(str(out / s)) for s in scripts}
    for folder in outs.values():
        check_out_dir(folder)
        write_run_log(folder)
    # every sandbox is for one task image: warm base-image sandboxes would be wasted
    config = msgspec.structs.replace(config, env_pool=msgspec.structs.replace(config.env_pool, warm=0))
    summaries = await make_scripted(config, tasks, outs, tokenizer, tokenizer_path=args.model,
                                    concurrency=args.concurrency, grade_timeout_s=args.timeout,
                                    tasks_source=str(args.tasks), status=say)
    for script, summary in summaries.items():
        print(msgspec.json.format(msgspec.json.encode(summary)).decode(), file=logs.out())
        say(f"{summary.kept} of {summary.total} {script} trajectories kept, {len(summary.excluded)} excluded; "
            f"wrote {outs[script] / 'summary.json'}")
        for e in summary.excluded:
            say(f"excluded {e.instance_id} ({e.stage}): {e.reason}")
    return 0 if all(summary.kept for summary in summaries.values()) else 1


def _run_prepare(args: argparse.Namespace) -> int:
    """Run ``swectl data prepare``: 0 ok, 1 nothing could be loaded. Bad input raises: exit 2 through cli.main's
    one mapping (an eval set refused, a malformed row with --strict, an unwritable --out)."""
    check_not_eval_set(args.source, args.data_source or "", allow=args.allow_eval_set)
    resolver = ImageResolver.from_options(args.image_template, args.image_map)
    loaded = load_tasks(args.source, strict=args.strict, split=args.split, source_hint=args.source_hint)
    data_source = args.data_source or _default_data_source(loaded.tasks)
    summary = prepare(loaded.tasks, output_dir(args.out), data_source=data_source, resolver=resolver,
                      problems=loaded.problems)
    print(_format_summary(loaded.rows_read, summary, loaded.problems, args.source))
    if not loaded.tasks:
        print("swectl: no task could be loaded; nothing to train on", file=sys.stderr)
        return 1
    return 0


def _default_data_source(tasks: Sequence[Task]) -> str:
    sources = {task.source for task in tasks}
    return sources.pop() if len(sources) == 1 else "swectl"


def _format_summary(rows_read: int, summary: PrepareSummary, problems: Sequence[RowProblem], source: str) -> str:
    lines = [f"read {rows_read} rows from {source}: {summary.prompts} tasks kept, {summary.problems} problems"]
    lines += [f"  {problem}" for problem in problems[:SHOWN_PROBLEMS]]
    if len(problems) > SHOWN_PROBLEMS:
        lines.append(f"  ... and {len(problems) - SHOWN_PROBLEMS} more")
    if summary.problems_path:
        lines.append(f"all problems: {summary.problems_path}")
    lines.append(f"wrote {summary.prompts_path} ({summary.prompts} prompts, data_source {summary.data_source!r})")
    lines.append(f"wrote {summary.images_path} ({summary.images} images)")
    return "\n".join(lines)
