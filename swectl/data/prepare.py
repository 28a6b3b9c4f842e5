"""`swectl data prepare`: turn a task source into the prompt file slime and miles read for SWE tasks.

Writes, under ``--out``:

- ``prompts.jsonl``: one line per task, what OpenClaw-RL's ``preprocess_swe_dataset.py`` writes (``{"text":
  problem_statement, "metadata": {"instance": <task row>, "data_source": NAME}}``), the instance being
  ``Task.row()`` with ``image`` and ``image_name`` set to the resolved image name (their rollout uses
  ``image_name`` verbatim, so no data source needs a Docker Hub name derived), plus the keys slime's and miles'
  SWE examples read: ``prompt`` (the problem statement), ``label`` (the instance id) and, in ``metadata``,
  ``instance_id``, ``image`` and ``workdir``;
- ``images.txt``: the sorted, unique image names the set needs, one per line (feed it to a pre-pull);
- ``problems.jsonl``: one ``RowProblem`` per line, only when rows were skipped.

SWE-bench Verified is an evaluation set and must never become training data: a source or data source whose name
says it is Verified is refused unless ``--allow-eval-set`` is given.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import msgspec

from swectl.errors import TaskDataError
from swectl.images.names import ImageResolver
from swectl.tasks.record import TESTBED, Task
from swectl.tasks.sources import RowProblem

PROMPTS_FILE = "prompts.jsonl"
IMAGES_FILE = "images.txt"
PROBLEMS_FILE = "problems.jsonl"
SHOWN_PROBLEMS = 5
# Names of evaluation sets, compared after lowercasing and writing "-" and spaces as "_".
EVAL_SET_MARKERS = ("swe_bench_verified", "swebench_verified")


class PrepareSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What `data prepare` wrote: counts of prompts and images, and where."""
    out_dir: str
    data_source: str
    prompts: int
    images: int
    problems: int
    prompts_path: str
    images_path: str
    problems_path: str = ""  # empty when there were no problems


class EvalSetError(TaskDataError):
    """The source is an evaluation set (SWE-bench Verified) and would become training prompts."""


def prepare(
    tasks: Sequence[Task],
    out_dir: str | os.PathLike[str],
    *,
    data_source: str,
    resolver: ImageResolver | None = None,
    problems: Sequence[RowProblem] = (),
) -> PrepareSummary:
    """Write prompts.jsonl, images.txt and (when there are problems) problems.jsonl under ``out_dir``."""
    resolver = resolver if resolver is not None else ImageResolver()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    encoder = msgspec.json.Encoder()
    lines: list[bytes] = []
    images: set[str] = set()
    for task in tasks:
        image = resolver.resolve(task)
        images.add(image)
        instance = {**task.row(), "image": image, "image_name": image}
        prompt = {"text": task.problem_statement, "prompt": task.problem_statement, "label": task.instance_id,
                  "metadata": {"instance": instance, "data_source": data_source, "instance_id": task.instance_id,
                               "image": image, "workdir": TESTBED}}
        lines.append(encoder.encode(prompt) + b"\n")
    prompts_path, images_path, problems_path = out / PROMPTS_FILE, out / IMAGES_FILE, out / PROBLEMS_FILE
    _write_atomic(prompts_path, b"".join(lines))
    _write_atomic(images_path, "".join(f"{name}\n" for name in sorted(images)).encode())
    if problems:
        _write_atomic(problems_path, b"".join(encoder.encode(p) + b"\n" for p in problems))
    else:
        problems_path.unlink(missing_ok=True)  # a stale list from an earlier run would mislead
    return PrepareSummary(
        out_dir=str(out),
        data_source=data_source,
        prompts=len(lines),
        images=len(images),
        problems=len(problems),
        prompts_path=str(prompts_path),
        images_path=str(images_path),
        problems_path=str(problems_path) if problems else "",
    )


def _write_atomic(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    partial.replace(path)


def is_eval_set(*names: str) -> bool:
    """Whether any of ``names`` (paths, dataset names, data source names) names SWE-bench Verified."""
    for name in names:
        squashed = re.sub(r"[-\s]+", "_", name.lower())
        if any(marker in squashed for marker in EVAL_SET_MARKERS):
            return True
    return False


def check_not_eval_set(source: str, data_source: str = "", *, allow: bool = False) -> None:
    """Raise EvalSetError when ``source`` (or the file it links to) or ``data_source`` is SWE-bench Verified."""
    if allow:
        return
    names = [source, data_source]
    path = Path(source)
    if path.exists():
        names.append(str(path.resolve()))
    if is_eval_set(*names):
        raise EvalSetError(
            f"{source}: this is SWE-bench Verified, an evaluation set; it must never become training prompts\n"
            "  hint: train on SWE-Gym, SWE-smith or swectl's own tasks; pass --allow-eval-set only to build "
            "prompts for evaluating on Verified"
        )
