"""`swectl data prepare`: a task source -> prompts.jsonl + images.txt for slime / miles (swectl/data/prepare.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from swectl.cli.common import output_dir
from swectl.data.prepare import (
    SHOWN_PROBLEMS,
    PrepareSummary,
    check_not_eval_set,
    prepare,
)
from swectl.images.names import PLACEHOLDERS, ImageResolver
from swectl.tasks.record import Task
from swectl.tasks.sources import TASK_SOURCES, RowProblem, load_tasks

DATA_EPILOG = """\
examples:
  swectl data prepare tasks.jsonl --out data/train
  swectl data prepare SWE-Gym/SWE-Gym:train --out data/swe-gym --source-hint swe-gym
  swectl data prepare smith.parquet --out data/smith --image-map images.toml
  swectl data prepare tasks.jsonl --out data/mirror --image-template 'registry.local:5000/{official}'
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``data`` (with ``data prepare``) to a ``swectl`` sub-command parser; returns the ``data`` parser."""
    data = subparsers.add_parser("data", help="prepare task sets (prompt files and image lists for training)")
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
    return data


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
