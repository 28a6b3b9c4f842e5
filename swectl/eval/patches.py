"""Grade a set of patches for a task set: ``swectl eval --gold`` / ``--empty`` (validation, no model) and
``swectl eval --predictions FILE`` (a SWE-bench predictions file). Writes ``report.json`` and prints a table.

Validation expectations: the gold patch must resolve every task and the empty patch must resolve none.
A grading error is reported as an error with its reason, never folded into resolved/unresolved.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Literal, NamedTuple

import anyio
import msgspec

from swectl.actors.env_pool import running_pool
from swectl.actors.grader import Grader, GraderConfig, GradeResult
from swectl.config import ClusterConfig
from swectl.errors import TaskDataError
from swectl.eval.progress import Progress
from swectl.eval.report import RunReport, resolve_rate
from swectl.images.names import ImageResolver
from swectl.tasks.record import Task
from swectl.tasks.sources import RowProblem, jsonl_lines

PatchMode = Literal["gold", "empty", "predictions"]


class PatchJob(NamedTuple):
    """One patch to grade for one task."""

    """One patch to grade for one task."""
    task: Task
    patch: str


class Prediction(msgspec.Struct, frozen=True):
    """One row of a SWE-bench predictions file."""

    """One line of a SWE-bench predictions file."""
    instance_id: str
    model_patch: str | None = None
    model_name_or_path: str = ""


def load_predictions(path: Path) -> dict[str, Prediction]:
    """SWE-bench predictions: a JSON list, a JSON object keyed by instance id, or JSONL (errors name the line)."""
    rows: list[tuple[str, object]] = []
    if path.suffix == ".jsonl":
        for location, _, row in jsonl_lines(path):
            if isinstance(row, RowProblem):
                raise TaskDataError(f"{location}: {row.message}")
            rows.append((location, row))
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise TaskDataError(f"{path}: cannot read predictions: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise TaskDataError(f"{path}: predictions are not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TaskDataError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg} (column {exc.colno}); "
                                "a .jsonl file holds one prediction per line") from exc
        items = list(data.values()) if isinstance(data, dict) else data
        if not isinstance(items, list):
            raise TaskDataError(f"{path}: expected a JSON list of predictions or an object keyed by instance_id")
        rows = [(f"{path}[{i}]", row) for i, row in enumerate(items)]
    out: dict[str, Prediction] = {}
    for where, row in rows:
        try:
            pred = msgspec.convert(row, Prediction)
        except msgspec.ValidationError as exc:
            raise TaskDataError(f"{where}: {exc} (a prediction needs instance_id and model_patch)") from exc
        out[pred.instance_id] = pred
    return out


def patch_jobs(tasks: list[Task], mode: PatchMode, predictions: dict[str, Prediction] | None) -> list[PatchJob]:
    """What a run grades: each task with its patch (with predictions: only the tasks that have one)."""
    return [PatchJob(t, p) for t in tasks if (p := _patch_for(t, mode, predictions)) is not None]


class InstanceReport(msgspec.Struct, kw_only=True):
    """The grading outcome of one instance in an eval run."""
    instance_id: str
    status: str
    expected: str = ""  # "resolved" / "unresolved" for validation modes
    ok: bool = True
    reason: str = ""
    detail: str = ""
    infra: bool = False
    apply_method: str = ""
    f2p_failed: int = 0
    p2p_failed: int = 0
    seconds: float = 0.0
    node: str = ""
    log: str = ""


class PatchReport(RunReport, kw_only=True):
    """report.json of patch grading: the shared RunReport plus per-instance detail."""

    unresolved: int
    errors: int  # no verdict from the tests: patch did not apply, grading timed out, ... (infra ones included)
    expectations_met: int  # gold / empty: instances that came out as expected
    grade_p50_s: float
    error_reasons: dict[str, int]
    resolved_ids: list[str]
    unresolved_ids: list[str]
    error_ids: list[str]
    instances: list[InstanceReport]
    # graded "tampered" (docs/grading.md): the patch broke a defence of the grader; scored as not resolved
    tampered: int = 0
    tampered_ids: list[str] = msgspec.field(default_factory=list)


def _patch_for(task: Task, mode: PatchMode, predictions: dict[str, Prediction] | None) -> str | None:
    if mode == "gold":
        return task.patch
    if mode == "empty":
        return ""
    assert predictions is not None
    pred = predictions.get(task.instance_id)
    return None if pred is None else (pred.model_patch or "")


def _instance(result: GradeResult, mode: PatchMode) -> InstanceReport:
    expected = {"gold": "resolved", "empty": "unresolved"}.get(mode, "")
    ok = result.status == expected if expected else True
    return InstanceReport(
        instance_id=result.instance_id, status=result.status, expected=expected, ok=ok, reason=result.reason,
        detail=result.detail[:2000], infra=result.infra, apply_method=result.apply_method,
        f2p_failed=len(result.f2p_failed), p2p_failed=len(result.p2p_failed), seconds=result.duration_s,
        node=result.node, log=result.log_path,
    )


def build_report(mode: PatchMode, instances: list[InstanceReport], elapsed: float, *, model: str = "",
                 tasks: str = "") -> PatchReport:
    instances = sorted(instances, key=lambda r: r.instance_id)
    statuses = ("resolved", "unresolved", "tampered", "error")
    by = {s: [r.instance_id for r in instances if r.status == s] for s in statuses}
    reasons: dict[str, int] = {}
    for r in instances:
        if r.status == "error":
            reasons[r.reason] = reasons.get(r.reason, 0) + 1
    secs = sorted(r.seconds for r in instances)
    infra = sum(r.infra for r in instances)
    return PatchReport(
        mode=mode, model=model, tasks=tasks, total=len(instances), resolved=len(by["resolved"]),
        unresolved=len(by["unresolved"]), errors=len(by["error"]), infra_errors=infra,
        resolve_rate=resolve_rate(len(by["resolved"]), len(instances), infra),
        expectations_met=sum(r.ok for r in instances), grade_p50_s=secs[len(secs) // 2] if secs else 0.0,
        elapsed_s=round(elapsed, 2), error_reasons=reasons, resolved_ids=by["resolved"],
        unresolved_ids=by["unresolved"], error_ids=by["error"], instances=instances, tampered=len(by["tampered"]),
        tampered_ids=by["tampered"],
    )


def format_table(report: PatchReport) -> str:
    lines = [f"{'instance':<48} {'status':<11} {'expected':<11} {'secs':>6}  note"]
    for r in report.instances:
        note = r.reason or ("" if r.ok else "MISMATCH")
        if r.f2p_failed or r.p2p_failed:
            note += f" f2p_failed={r.f2p_failed} p2p_failed={r.p2p_failed}"
        lines.append(f"{r.instance_id:<48} {r.status:<11} {r.expected or '-':<11} {r.seconds:>6.1f}  {note}")
    lines.append(
        f"{report.mode}: {report.resolved}/{report.total} resolved ({report.resolve_rate:.0%}), "
        f"{report.unresolved} unresolved, {report.tampered} tampered, {report.errors} errors "
        f"({report.infra_errors} infra)"
        + (f", expectations met {report.expectations_met}/{report.total}" if report.mode != "predictions" else "")
        + f"; grade p50 {report.grade_p50_s:.1f}s, {report.elapsed_s:.0f}s total"
    )
    return "\n".join(lines)


async def evaluate_patches(
    config: ClusterConfig, jobs: list[PatchJob], mode: PatchMode, out_dir: Path, *, concurrency: int = 4,
    timeout_s: float = 1800.0, resolver: ImageResolver | None = None, specs: object | None = None,
    model: str = "", tasks: str = "", progress: bool = True,
) -> PatchReport:
    """Grade each job's patch in a fresh sandbox (``concurrency`` at once); logs go to ``out_dir/logs``."""
    bar = Progress(len(jobs), f"eval --{mode}") if progress else None
    instances: list[InstanceReport] = []
    started = time.monotonic()
    async with running_pool(config) as pool:
        grader = Grader(GraderConfig(timeout_s=timeout_s, concurrency=concurrency), pool, resolver=resolver,
                        specs=specs, log_dir=out_dir / "logs")

        async def one(task: Task, patch: str) -> None:
            result = await grader.grade(task, patch, label=mode)
            instances.append(_instance(result, mode))
            if bar:
                bar.advance(result.status)

        async with anyio.create_task_group() as grading:
            for task, patch in jobs:
                grading.start_soon(one, task, patch, name=f"grade {task.instance_id}")
    return build_report(mode, instances, time.monotonic() - started, model=model, tasks=tasks)


def write_report(report: PatchReport, out_dir: Path) -> Path:
    path = out_dir / "report.json"
    path.write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    return path
