"""``swectl eval --model DIR | --endpoint URL``: run the agent on a task set and grade its patches.

Outputs in the run folder: ``results.jsonl`` (one line per finished episode, appended as they finish),
``preds.jsonl`` (SWE-bench predictions: instance_id, model_name_or_path, model_patch), ``summary.json``
(resolve_rate, avg_steps, counts by exit status, timings, agent/* metrics) and per-episode artifacts
(``<instance_id>__<n>/traj.json``, ``patch.diff``, ``meta.json``). A rerun with the same output folder skips
finished episodes. Ctrl-C cancels the episodes; the env pool removes every container of the run.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import anyio
import msgspec

from swectl.actors.engines import Engines, engine_hosts
from swectl.actors.env_pool import running_pool
from swectl.actors.grader import Grader, GraderConfig
from swectl.actors.rollout import EpisodeResult, Rollout, RolloutConfig
from swectl.agent.metrics import agent_metrics
from swectl.config import ClusterConfig
from swectl.engine.client import OpenAIChatClient
from swectl.eval.progress import Progress
from swectl.images.names import ImageResolver
from swectl.tasks.record import Task


class EvalSummary(msgspec.Struct, kw_only=True):
    format_version: int = 1
    model: str
    total: int
    finished: int
    resolved: int
    aborted: int
    resolve_rate: float  # resolved / episodes that were not aborted
    avg_steps: float
    exit_status: dict[str, int]
    elapsed_s: float
    metrics: dict[str, float]


def _done(out: Path) -> list[EpisodeResult]:
    path = out / "results.jsonl"
    if not path.exists():
        return []
    dec = msgspec.json.Decoder(EpisodeResult)
    return [dec.decode(line) for line in path.read_bytes().splitlines() if line.strip()]


def summarize(model: str, total: int, results: list[EpisodeResult], elapsed: float) -> EvalSummary:
    statuses: dict[str, int] = {}
    for r in results:
        statuses[r.exit_status] = statuses.get(r.exit_status, 0) + 1
    aborted = sum(r.outcome == "ABORTED" for r in results)
    graded = len(results) - aborted
    resolved = sum(r.resolved for r in results)
    return EvalSummary(
        model=model, total=total, finished=len(results), resolved=resolved, aborted=aborted,
        resolve_rate=round(resolved / graded, 4) if graded else 0.0,
        avg_steps=round(sum(r.turns for r in results) / len(results), 2) if results else 0.0,
        exit_status=statuses, elapsed_s=round(elapsed, 2),
        metrics={k: round(v, 4) for k, v in agent_metrics(results).items()},
    )


async def eval_model(
    config: ClusterConfig, tasks: list[Task], out: Path, *, tokenizer_path: str, model_name: str,
    rollout: RolloutConfig, model: str = "", endpoint: str = "", chat: OpenAIChatClient | None = None,
    grade_timeout_s: float = 1800.0, resolver: ImageResolver | None = None, progress: bool = True,
) -> EvalSummary:
    """With ``model``: token-in/token-out episodes on servers launched per ``config.engine`` on its nodes.
    With ``endpoint``: the same against a running SGLang-API server. With ``chat``: messages-only episodes
    on an OpenAI-compatible endpoint (evaluation only)."""
    if sum(map(bool, (model, endpoint, chat))) != 1:
        raise ValueError("eval_model needs exactly one of model, endpoint, chat")
    tokenizer = None
    if chat is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    previous = _done(out)
    skip = {(r.instance_id, r.sample) for r in previous}
    total = len(tasks) * rollout.samples_per_task
    bar = Progress(total, "eval") if progress else None
    if bar:
        for r in previous:
            bar.resume(_label(r))
    started = time.monotonic()
    results = list(previous)
    with (out / "results.jsonl").open("ab") as res_f, (out / "preds.jsonl").open("a") as preds_f:

        def record(r: EpisodeResult) -> None:
            results.append(r)
            res_f.write(msgspec.json.encode(r) + b"\n")
            res_f.flush()
            patch = (Path(r.artifacts) / "patch.diff").read_text(errors="surrogateescape")
            preds_f.write(json.dumps({"instance_id": r.instance_id, "model_name_or_path": model_name,
                                      "model_patch": patch}) + "\n")
            preds_f.flush()
            if bar:
                bar.advance(_label(r))

        # only --model uses nodes
        launching = engine_hosts(config.engine_nodes()) if model else contextlib.nullcontext([])
        async with running_pool(config) as pool, launching as hosts, anyio.create_task_group() as tg:
            if chat is None:
                engines = Engines(config.engine, model=model, url=endpoint, hosts=hosts,
                                  log_dir=out / "engine-logs")
                await tg.start(engines.run)

                def engine_for(t: Task, n: int):
                    return engines.route(f"{t.instance_id}#{n}")
            else:
                assert chat is not None

                def engine_for(t: Task, n: int):
                    return chat
            grader = Grader(GraderConfig(timeout_s=grade_timeout_s, concurrency=rollout.concurrency), pool,
                            resolver=resolver, log_dir=out / "grade-logs")
            await tg.start(grader.run, name="grader")
            ro = Rollout(rollout, pool, grader, engine_for, tokenizer, out, resolver=resolver)
            await tg.start(ro.run, name="rollout")
            await ro.collect(tasks, record, skip=skip)
            tg.cancel_scope.cancel("episodes done")
    summary = summarize(model_name, total, results, time.monotonic() - started)
    (out / "summary.json").write_bytes(msgspec.json.format(msgspec.json.encode(summary)))
    return summary


def _label(r: EpisodeResult) -> str:
    if r.outcome == "ABORTED":
        return "aborted"
    return "resolved" if r.resolved else "failed"
