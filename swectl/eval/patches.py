"""Grade a set of patches for a task set: ``swectl eval --gold`` / ``--empty`` (validation, no model) and
``swectl eval --predictions FILE`` (a SWE-bench predictions file). Writes ``report.json`` and prints a table.

Validation expectations: the gold patch must resolve every task and the empty patch must resolve none.
A grading error is reported as an error with its reason, never folded into resolved/unresolved.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Literal

import anyio
import msgspec

from swectl.actors.env_pool import running_pool
from swectl.actors.grader import Grader, GraderConfig, GradeResult
from swectl.config import ClusterConfig
from swectl.errors import TaskDataError
from swectl.eval.progress import Progress
from swectl.images.names import ImageResolver
from swectl.tasks.record import Task

Mode = Literal["gold", "empty", "predictions"]


class Prediction(msgspec.Struct, frozen=True):
    instance_id: str
    model_patch: str | None = None
    model_name_or_path: str = ""


def load_predictions(path: Path) -> dict[str, Prediction]:
    """SWE-bench predictions: a JSON list, a JSON object keyed by instance id, or JSONL."""
    text = path.read_text()
    try:
        if path.suffix == ".jsonl":
            rows = [(f"{path}:{i}", json.loads(line)) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
        else:
            data = json.loads(text)
            items = data.values() if isinstance(data, dict) else data
            rows = [(f"{path}[{i}]", row) for i, row in enumerate(items)]
    except json.JSONDecodeError as exc:
        raise TaskDataError(f"{path}: not valid JSON/JSONL: {exc}") from exc
    out: dict[str, Prediction] = {}
    for where, row in rows:
        try:
            pred = msgspec.convert(row, Prediction)
        except msgspec.ValidationError as exc:
            raise TaskDataError(f"{where}: {exc} (a prediction needs instance_id and model_patch)") from exc
        out[pred.instance_id] = pred
    return out


class InstanceReport(msgspec.Struct, kw_only=True):
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


class EvalReport(msgspec.Struct, kw_only=True):
    format_version: int = 1
    mode: str
    total: int
    resolved: int
    unresolved: int
    errors: int
    infra_errors: int
    resolve_rate: float
    expectations_met: int
    grade_p50_s: float
    elapsed_s: float
    error_reasons: dict[str, int]
    resolved_ids: list[str]
    unresolved_ids: list[str]
    error_ids: list[str]
    instances: list[InstanceReport]


def _patch_for(task: Task, mode: Mode, predictions: dict[str, Prediction] | None) -> str | None:
    if mode == "gold":
        return task.patch
    if mode == "empty":
        return ""
    assert predictions is not None
    pred = predictions.get(task.instance_id)
    return None if pred is None else (pred.model_patch or "")


def _instance(result: GradeResult, mode: Mode) -> InstanceReport:
    expected = {"gold": "resolved", "empty": "unresolved"}.get(mode, "")
    ok = result.status == expected if expected else True
    return InstanceReport(
        instance_id=result.instance_id, status=result.status, expected=expected, ok=ok, reason=result.reason,
        detail=result.detail[:2000], infra=result.infra, apply_method=result.apply_method,
        f2p_failed=len(result.f2p_failed), p2p_failed=len(result.p2p_failed), seconds=result.duration_s,
        node=result.node, log=result.log_path,
    )


def build_report(mode: Mode, instances: list[InstanceReport], elapsed: float) -> EvalReport:
    instances = sorted(instances, key=lambda r: r.instance_id)
    by = {s: [r.instance_id for r in instances if r.status == s] for s in ("resolved", "unresolved", "error")}
    reasons: dict[str, int] = {}
    for r in instances:
        if r.status == "error":
            reasons[r.reason] = reasons.get(r.reason, 0) + 1
    secs = sorted(r.seconds for r in instances)
    return EvalReport(
        mode=mode, total=len(instances), resolved=len(by["resolved"]), unresolved=len(by["unresolved"]),
        errors=len(by["error"]), infra_errors=sum(r.infra for r in instances),
        resolve_rate=round(len(by["resolved"]) / len(instances), 4) if instances else 0.0,
        expectations_met=sum(r.ok for r in instances), grade_p50_s=secs[len(secs) // 2] if secs else 0.0,
        elapsed_s=round(elapsed, 2), error_reasons=reasons, resolved_ids=by["resolved"],
        unresolved_ids=by["unresolved"], error_ids=by["error"], instances=instances,
    )


def format_table(report: EvalReport) -> str:
    lines = [f"{'instance':<48} {'status':<11} {'expected':<11} {'secs':>6}  note"]
    for r in report.instances:
        note = r.reason or ("" if r.ok else "MISMATCH")
        if r.f2p_failed or r.p2p_failed:
            note += f" f2p_failed={r.f2p_failed} p2p_failed={r.p2p_failed}"
        lines.append(f"{r.instance_id:<48} {r.status:<11} {r.expected or '-':<11} {r.seconds:>6.1f}  {note}")
    lines.append(
        f"{report.mode}: {report.resolved}/{report.total} resolved ({report.resolve_rate:.0%}), "
        f"{report.unresolved} unresolved, {report.errors} errors ({report.infra_errors} infra)"
        + (f", expectations met {report.expectations_met}/{report.total}" if report.mode != "predictions" else "")
        + f"; grade p50 {report.grade_p50_s:.1f}s, {report.elapsed_s:.0f}s total"
    )
    return "\n".join(lines)


async def evaluate_patches(
    config: ClusterConfig, tasks: list[Task], mode: Mode, out_dir: Path, *, concurrency: int = 4,
    timeout_s: float = 1800.0, predictions: dict[str, Prediction] | None = None,
    resolver: ImageResolver | None = None, specs: object | None = None, progress: bool = True,
) -> EvalReport:
    jobs = [(t, p) for t in tasks if (p := _patch_for(t, mode, predictions)) is not None]
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

        async with anyio.create_task_group() as tg:
            await tg.start(grader.run, name="grader")
            async with anyio.create_task_group() as jobs_tg:
                for task, patch in jobs:
                    jobs_tg.start_soon(one, task, patch, name=f"grade {task.instance_id}")
            tg.cancel_scope.cancel("gradings done")
    return build_report(mode, instances, time.monotonic() - started)


def write_report(report: EvalReport, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.json"
    path.write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    return path
