"""``swectl eval --model DIR | --endpoint URL | --openai-url URL``: run the agent on a task set and grade its
patches.

Outputs in the run folder: ``run.json`` (the settings of the run: what answered and the ``[rollout]``
section), ``results.jsonl`` (one line per finished episode, appended as they finish), ``preds.jsonl``
(SWE-bench predictions: instance_id, model_name_or_path, model_patch), ``summary.json`` (an AgentSummary:
the shared RunReport plus counts by exit status and agent/* metrics) and per-episode artifacts
(``<instance_id>__<n>/traj.json``, ``patch.diff``, ``meta.json``).

A rerun into the same folder skips finished episodes, but only when its settings equal ``run.json``'s;
otherwise it refuses with the difference (``fresh=True`` deletes the old results first). A server that
cannot be connected to is an error at once; one that is not ready yet is waited for (engine.start_timeout_s),
saying what it waits for. Ctrl-C cancels the episodes; the env pool removes every container of the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import anyio
import anyio.abc
import msgspec

from swectl import logs
from swectl.actors.engines import Engines, engine_hosts
from swectl.actors.env_pool import running_pool
from swectl.actors.grader import Grader, GraderConfig
from swectl.actors.harnesses import harness_mounts, start_harness
from swectl.actors.rollout import EpisodeResult, Rollout, RolloutConfig
from swectl.agent.loop import episode_config
from swectl.agent.metrics import agent_metrics
from swectl.agent.protocol import agent_templates
from swectl.config import AgentConfig, ClusterConfig, RolloutOptions
from swectl.engine.client import OpenAIChatClient, SglangClient, models_path
from swectl.errors import ConfigError, EngineConnectError, EngineRejectedError, EngineUnavailableError, TaskDataError
from swectl.eval.progress import Progress
from swectl.eval.report import RunReport, resolve_rate
from swectl.images.names import ImageResolver
from swectl.model.tokenizer import load_tokenizer
from swectl.tasks.record import Task

SETTINGS_FILE = "run.json"
SETTINGS_FORMAT = 1
PROBE_TIMEOUT_S = 5.0  # one readiness check
SAY_EVERY_S = 15.0  # a status line while waiting for a server

Status = Callable[[str], None]


def _stderr(message: str) -> None:
    print(f"swectl: {message}", file=logs.err(), flush=True)


class RunSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What an agent run's results depend on; written to ``run.json``, compared on resume."""

    format_version: int = SETTINGS_FORMAT
    mode: Literal["model", "endpoint", "openai"]
    model: str  # the --model folder, the --endpoint URL or the --openai-url URL
    openai_model: str = ""  # the model name sent to --openai-url
    tokenizer: str = ""  # token-in/token-out runs: the tokenizer folder
    model_name: str  # model_name_or_path written to preds.jsonl and the summary
    rollout: RolloutOptions
    # an external agent harness, unmodified, instead of swectl's loop ("mini-swe-agent"; "": swectl's own), its
    # model calls through the gateway (actors/gateway.py), its config and step limit
    harness: str = ""
    harness_config: str = ""


class AgentSummary(RunReport, kw_only=True):
    """summary.json of an agent run: the shared RunReport (``total`` = tasks x samples, ``infra_errors`` =
    aborted episodes) plus what only agent runs have."""

    finished: int  # episodes with a result (this run and the ones it resumed)
    avg_steps: float
    exit_status: dict[str, int]
    grades_reused: int = 0  # verdicts given without a test run ([rollout] reuse_grades: empty or repeated patches)
    metrics: dict[str, float]
    settings: RunSettings


def read_results(out: Path) -> list[EpisodeResult]:
    """The finished episodes of an eval run folder (its results.jsonl, in the order they finished)."""
    path = out / "results.jsonl"
    if not path.exists():
        return []
    dec = msgspec.json.Decoder(EpisodeResult)
    results = []
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            results.append(dec.decode(line))
        except msgspec.DecodeError as exc:
            raise TaskDataError(f"{path}:{number}: not a result line ({exc}); start over with --fresh") from exc
    return results


def _flat(value: object, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        flat: dict[str, object] = {}
        for k, v in value.items():
            flat.update(_flat(v, f"{prefix}{k}."))
        return flat
    return {prefix.rstrip("."): value}


def settings_difference(recorded: RunSettings, now: RunSettings) -> list[str]:
    """``key: recorded -> now`` for every setting that differs."""
    old, new = _flat(msgspec.to_builtins(recorded)), _flat(msgspec.to_builtins(now))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(old.keys() | new.keys())
            if old.get(k) != new.get(k)]


def prepare_run_dir(out: Path, settings: RunSettings, *, fresh: bool = False) -> None:
    """Make ``out`` ready for this run: resume only when its recorded settings equal ``settings``;
    ``fresh`` deletes an earlier run's results first. Writes ``run.json``."""
    path = out / SETTINGS_FILE
    results = out / "results.jsonl"
    earlier = results.exists() and results.stat().st_size > 0  # a run that finished no episode: nothing to mix
    if earlier and fresh:
        _clear(out)
    elif earlier:
        hint = "rerun with --fresh to start over there, or pick another --out"
        if not path.exists():
            raise ConfigError(f"--out {out} holds results but no {SETTINGS_FILE} (its settings are unknown): {hint}")
        try:
            recorded = msgspec.json.decode(path.read_bytes(), type=RunSettings)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ConfigError(f"{path}: unreadable ({exc}): {hint}") from exc
        diff = settings_difference(recorded, settings)
        if diff:
            raise ConfigError(f"--out {out} was run with other settings (recorded -> now): "
                              + "; ".join(diff) + f". Resuming would mix them: {hint}")
    path.write_bytes(msgspec.json.format(msgspec.json.encode(settings)))


def _clear(out: Path) -> None:
    """Delete what an earlier agent run wrote into ``out`` (its episode folders, logs, results)."""
    for r in _done_lenient(out):
        artifacts = Path(r.artifacts)
        if r.artifacts and artifacts.parent.resolve() == out.resolve() and artifacts.is_dir():
            shutil.rmtree(artifacts)
    for name in ("engine-logs", "grade-logs"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in ("results.jsonl", "preds.jsonl", "summary.json", SETTINGS_FILE):
        (out / name).unlink(missing_ok=True)


def _done_lenient(out: Path) -> list[EpisodeResult]:
    try:
        return read_results(out)
    except TaskDataError:
        return []


def summarize(settings: RunSettings, tasks_source: str, total: int, results: list[EpisodeResult],
              elapsed: float) -> AgentSummary:
    statuses: dict[str, int] = {}
    for r in results:
        statuses[r.exit_status] = statuses.get(r.exit_status, 0) + 1
    aborted = sum(r.outcome == "ABORTED" for r in results)
    resolved = sum(r.resolved for r in results)
    return AgentSummary(
        mode=settings.mode, model=settings.model_name, tasks=tasks_source, total=total, resolved=resolved,
        infra_errors=aborted, resolve_rate=resolve_rate(resolved, len(results), aborted),
        elapsed_s=round(elapsed, 2), finished=len(results),
        avg_steps=round(sum(r.turns for r in results) / len(results), 2) if results else 0.0,
        exit_status=statuses, grades_reused=sum(bool(r.grade and r.grade.shortcut) for r in results),
        metrics={k: round(v, 4) for k, v in agent_metrics(results).items()},
        settings=settings,
    )


def tokenizer_knob(settings: RunSettings) -> str:
    """The flag that named the tokenizer folder."""
    return "--model" if settings.mode == "model" and settings.tokenizer == settings.model else "--tokenizer"


async def wait_endpoint(client: SglangClient | OpenAIChatClient, path: str, *, timeout_s: float,
                        status: Status = _stderr) -> None:
    """Return once ``GET path`` answers (any answer below 500 counts: the server is up). Nothing accepting the
    connection is an EngineConnectError at once; a server that is not ready is polled for ``timeout_s``
    (engine.start_timeout_s), with a status line when the wait begins and every SAY_EVERY_S."""
    url = client.base_url
    started = anyio.current_time()
    said_at: float | None = None
    while True:
        left = timeout_s - (anyio.current_time() - started)
        try:
            await client.probe(path, timeout_s=max(round(min(PROBE_TIMEOUT_S, left), 1), 0.1))
            if said_at is not None:
                status(f"{url} is ready after {anyio.current_time() - started:.0f} s")
            return
        except EngineRejectedError:
            return  # it speaks HTTP; the real requests report what it refuses
        except EngineConnectError as exc:
            raise EngineConnectError(url, f"cannot connect: {_os_reason(exc)}; is the server running at that "
                                     "address?") from None
        except EngineUnavailableError as exc:
            reason = str(exc).removeprefix(f"engine {url}: ")
        waited = anyio.current_time() - started
        if said_at is None or anyio.current_time() - said_at >= SAY_EVERY_S:
            said_at = anyio.current_time()
            status(f"waiting for {url} to answer GET {path} ({reason}); {waited:.0f} of {timeout_s:.0f} s "
                   "(engine.start_timeout_s)")
        if waited >= timeout_s:
            raise EngineUnavailableError(url, f"not ready after {timeout_s:.0f} s (engine.start_timeout_s); "
                                         f"last answer: {reason}")
        await anyio.sleep(1.0)


def _os_reason(exc: BaseException) -> str:
    """The innermost OS-level reason in an exception chain ("Connection refused"), else the outermost text."""
    reason, seen, e = str(exc), set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and (e.errno or e.strerror):  # errno < 0: a resolver error, with its own text
            reason = os.strerror(e.errno) if e.errno and e.errno > 0 else str(e.strerror or e)
        e = e.__cause__ or e.__context__
    return reason


def rollout_config(options: RolloutOptions, concurrency: int) -> RolloutConfig:
    """The Rollout actor's config from the ``[rollout]`` section."""
    seed = None if options.seed is None else f"eval:{options.seed}"
    return RolloutConfig(concurrency=concurrency, samples_per_task=options.samples,
                         episode=episode_config(options, temperature=options.temperature, seed=seed))


async def eval_model(
    config: ClusterConfig, tasks: list[Task], out: Path, settings: RunSettings, *, concurrency: int = 4,
    grade_timeout_s: float = 1800.0, resolver: ImageResolver | None = None, api_key: str | None = None,
    tasks_source: str = "", fresh: bool = False, status: Status = _stderr, progress: bool = True,
) -> AgentSummary:
    """Mode ``model``: token-in/token-out episodes on servers launched per ``config.engine`` on its nodes.
    ``endpoint``: the same against a running SGLang-API server. ``openai``: messages-only episodes on an
    OpenAI-compatible endpoint (evaluation only). Episode settings come from ``settings.rollout``."""
    prepare_run_dir(out, settings, fresh=fresh)
    previous = read_results(out)
    skip = {(r.instance_id, r.sample) for r in previous}
    rollout = rollout_config(settings.rollout, concurrency)
    total = len(tasks) * rollout.samples_per_task
    started = time.monotonic()
    results = list(previous)
    async with contextlib.AsyncExitStack() as stack:
        chat = None
        if settings.mode == "openai":
            chat = await stack.enter_async_context(OpenAIChatClient(settings.model, settings.openai_model,
                                                                    api_key=api_key))
            await wait_endpoint(chat, models_path(settings.model), timeout_s=config.engine.start_timeout_s,
                                status=status)
        elif settings.mode == "endpoint":
            async with SglangClient(settings.model, timeout_s=PROBE_TIMEOUT_S) as probe:
                await wait_endpoint(probe, "/health", timeout_s=config.engine.start_timeout_s, status=status)
        else:
            status(f"starting {config.engine.kind} engine servers for {settings.model} (up to "
                   f"{config.engine.start_timeout_s:.0f} s, engine.start_timeout_s)")
        tokenizer = None if chat else load_tokenizer(settings.tokenizer, tokenizer_knob(settings))
        res_f = stack.enter_context((out / "results.jsonl").open("ab"))
        preds_f = stack.enter_context((out / "preds.jsonl").open("a"))
        bar = Progress(total, "eval") if progress else None
        if bar:
            for r in previous:
                bar.resume(_label(r))

        def record(r: EpisodeResult) -> None:
            results.append(r)
            res_f.write(msgspec.json.encode(r) + b"\n")
            res_f.flush()
            patch = (Path(r.artifacts) / "patch.diff").read_text(errors="surrogateescape")
            preds_f.write(json.dumps({"instance_id": r.instance_id, "model_name_or_path": settings.model_name,
                                      "model_patch": patch}) + "\n")
            preds_f.flush()
            if bar:
                bar.advance(_label(r))

        # only --model uses nodes
        launching = engine_hosts(config.engine_nodes()) if settings.mode == "model" else contextlib.nullcontext([])
        agent = None if not settings.harness else AgentConfig(
            harness=settings.harness,  # type: ignore[arg-type]
            harness_config=settings.harness_config or config.agent.harness_config, timeout_s=config.agent.timeout_s,
            tools_dir=config.agent.tools_dir)
        mounts = harness_mounts(agent) if agent is not None else []
        async with (running_pool(config, mounts=mounts) as pool, launching as hosts,
                    anyio.create_task_group() as tg):
            if chat is None:
                engines = Engines(config.engine, model=settings.model if settings.mode == "model" else "",
                                  url=settings.model if settings.mode == "endpoint" else "", hosts=hosts,
                                  log_dir=out / "engine-logs")
                await tg.start(engines.run)

                def engine_for(t: Task, n: int):
                    return engines.route(f"{t.instance_id}#{n}")

                if agent is not None:
                    harness = await start_harness(tg, agent, settings.rollout, engines.route, tokenizer,
                                                  out / "harness", temperature=settings.rollout.temperature,
                                                  seed=None if settings.rollout.seed is None
                                                  else f"eval:{settings.rollout.seed}",
                                                  templates=agent_templates(settings.rollout.agent_config),
                                                  wait_routable=engines.wait_routable)

                    def engine_for(t: Task, n: int):
                        return harness
            else:

                def engine_for(t: Task, n: int):
                    return chat
            grader = Grader(GraderConfig(timeout_s=grade_timeout_s, concurrency=rollout.concurrency,
                                         reuse=settings.rollout.reuse_grades), pool,
                            resolver=resolver, log_dir=out / "grade-logs")
            ro = Rollout(rollout, pool, grader, engine_for, tokenizer, out, resolver=resolver,
                         engine_ready=engines.wait_routable if chat is None else None)
            await ro.collect(tasks, record, skip=skip)
            tg.cancel_scope.cancel("episodes done")
    summary = summarize(settings, tasks_source, total, results, time.monotonic() - started)
    (out / "summary.json").write_bytes(msgspec.json.format(msgspec.json.encode(summary)))
    return summary


def _label(r: EpisodeResult) -> str:
    if r.outcome == "ABORTED":
        return "aborted"
    return "resolved" if r.resolved else "failed"
