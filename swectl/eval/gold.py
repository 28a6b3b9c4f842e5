"""``swectl data gold``: gold trajectories for supervised fine-tuning, made by acting out each task's gold patch
as an agent would (swectl.agent.gold) through the real Rollout actor: fresh sandboxes, the real agent loop, real
observations, grading, and a ``traj.json`` in exactly the format of model episodes.

Per task: ``gold_replies(task)`` is the script; a ``ScriptedEngine`` "generates" it turn by turn; the Rollout
runs and grades the episode as ``swectl eval --model`` does (the same actors, the same ``[rollout]`` limits).
A gold trajectory that does not resolve, or whose model tokens are not exactly the script, is reported and
moved to ``<out>/excluded/``, so the run folder holds only trajectories to learn from:
``swectl.data.trajectories.samples_from_runs([out])`` reads them.

``script="give-up"`` acts out ``give_up_replies`` instead (look at the code, submit no change): a wrong teacher's
trajectories for SFT data that mixes right and wrong attempts. Those are kept when they submitted exactly the script
and did not resolve (one that resolves means the task's tests pass with no change: excluded, stage ``grade``).
``script="attack"`` acts out ``attack_replies`` (look, then a root pytest.ini loading a plugin that flips failures
to passes, then submit): the reward-hacking teacher of benchmarks/hack.py, kept whatever its grade (tampered under
the grader's defences, resolved without them) when it submitted exactly the script.
``script="recover"`` acts out ``recover_replies`` (the gold replies, with a cut-off copy of the first look and of
the edit before each, which the loop rejects as malformed): kept like gold trajectories when they resolve; SFT
trains on the recoveries, not on the slips.

``make_scripted`` runs several scripts at once in one process (the first run's SFT data), each into its own folder,
sharing one sandbox pool and one grader that grades a patch once (see there).

With ``[agent] harness`` set (mini-swe-agent), the scripts are acted out by the harness itself, unmodified: each
scripted engine sits behind the gateway (actors/gateway.py), the harness's own process sends the turns, and the
trajectory is what the gateway recorded (its branches included: a slip mini drops from its history is a branch). The
scripts write swectl's protocol, so the harness's config must be ``agent.harness_config = "swectl"`` (swectl's
prompt in the harness's format).

Outputs in ``--out``: ``<instance_id>__0/`` per resolved task (``traj.json``, ``patch.diff``, ``meta.json``),
``excluded/`` (the ones that failed, for a look), ``results.jsonl`` (one EpisodeResult per episode),
``summary.json`` (a GoldSummary), ``grade-logs/`` and ``swectl.log``.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.abc
import msgspec

from swectl import logs
from swectl.actors.cli_agents import CLI_KINDS
from swectl.actors.env_pool import running_pool
from swectl.actors.grader import Grader, GraderConfig, GradeResult
from swectl.actors.harness import SWECTL_CONFIG
from swectl.actors.harnesses import Harness, start_harness
from swectl.actors.rollout import EpisodeResult, Rollout
from swectl.agent.gold import GoldScriptError, attack_replies, give_up_replies, gold_replies, recover_replies
from swectl.agent.protocol import agent_templates
from swectl.agent.scripted import ScriptedEngine, end_of_turn_id
from swectl.config import ClusterConfig
from swectl.data.trajectories import TRAJ_FILE, samples_from_runs
from swectl.errors import ConfigError
from swectl.eval.agents import rollout_config
from swectl.eval.progress import Progress
from swectl.images.names import ImageResolver
from swectl.rl.batch import unpack_mask
from swectl.rl.groups import span_turns, turn_spans
from swectl.tasks.record import Task

SUMMARY_FORMAT = 1
EXCLUDED_DIR = "excluded"

Status = Callable[[str], None]
Script = Literal["gold", "give-up", "recover", "attack"]
SCRIPTS: dict[str, Callable[[Task], list[str]]] = {"gold": gold_replies, "give-up": give_up_replies,
                                                   "recover": recover_replies, "attack": attack_replies}
# what a kept trajectory of each script was graded: resolved, unresolved, or whatever the grader said (attack: the
# reward-hacking teacher, kept as it was graded, tampered with the grader's defences and resolved without them)
WANTED: dict[str, Literal["resolved", "unresolved", "any"]] = {"gold": "resolved", "give-up": "unresolved",
                                                               "recover": "resolved", "attack": "any"}


def _stderr(message: str) -> None:
    print(f"swectl: {message}", file=logs.err(), flush=True)


class GoldExclusion(msgspec.Struct, frozen=True):
    """A task without a gold trajectory to learn from: at which stage it dropped out, and why."""

    instance_id: str
    stage: Literal["script", "episode", "grade", "tokens"]
    reason: str


class TokenStats(msgspec.Struct, frozen=True, kw_only=True):
    """Token lengths of the training samples of the kept trajectories (whole sequence, and the mask-1 part: the
    scripted replies). One sample per trajectory, or one per step where the episode recorded its prompts
    (``rollout.manage_context``: each step's prompt is what the engine saw)."""

    count: int = 0  # samples
    mean: float = 0.0
    median: float = 0.0
    min: int = 0
    max: int = 0
    mean_trained: float = 0.0  # mask-1 tokens per trajectory


class GoldSummary(msgspec.Struct, kw_only=True):
    """summary.json of a gold run: how many tasks got a resolved gold trajectory, and why the others did not."""

    format_version: int = SUMMARY_FORMAT
    tasks: str  # the task source (--tasks)
    tokenizer: str  # the --model folder whose tokenizer and chat template made the tokens
    total: int  # tasks selected
    scripted: int  # tasks whose gold patch could be written as agent commands
    resolved: int  # trajectories kept that resolve (tokens exactly the script); 0 for script "give-up"
    script: str = "gold"  # gold (the gold patch), give-up (look, then submit no change) or recover (gold with slips)
    kept: int = 0  # trajectories kept (gold: resolved; give-up: submitted the script and did not resolve)
    excluded: list[GoldExclusion]
    tokens: TokenStats
    elapsed_s: float


def check_out_dir(out: Path) -> None:
    """A gold run writes into a folder of its own: refuse one that holds an earlier run's results."""
    if (out / "results.jsonl").exists() or (out / "summary.json").exists():
        raise ConfigError(f"--out {out} holds an earlier run (results.jsonl / summary.json); pick another --out or "
                          "delete it")


async def make_gold(config: ClusterConfig, tasks: list[Task], out: Path, tokenizer: Any, *, tokenizer_path: str,
                    concurrency: int = 4, grade_timeout_s: float = 1800.0, resolver: ImageResolver | None = None,
                    tasks_source: str = "", status: Status = _stderr, progress: bool = True,
                    script: Script = "gold") -> GoldSummary:
    """Run every task's ``script`` (gold: the gold patch; give-up: look, then submit no change) through the Rollout
    actor (sandboxes per ``config``, episode limits from its ``[rollout]`` section, one sample per task), grade it,
    keep what resolves (give-up: what does not); writes summary.json."""
    summaries = await make_scripted(config, tasks, {script: out}, tokenizer, tokenizer_path=tokenizer_path,
                                    concurrency=concurrency, grade_timeout_s=grade_timeout_s, resolver=resolver,
                                    tasks_source=tasks_source, status=status, progress=progress)
    return summaries[script]


class _ScriptGrades:
    """The grader one script's rollout sees when several scripts share it: its grade logs are named after the script
    (``<instance>.<script>.rollout0.log``), so two scripts' gradings of one task keep a log each."""

    def __init__(self, grader: Grader, script: str) -> None:
        self._grader, self._script = grader, script

    async def grade(self, task: Task, patch: str, *, label: str = "", timeout_s: float | None = None) -> GradeResult:
        return await self._grader.grade(task, patch, label=f"{self._script}.{label}", timeout_s=timeout_s)


class _ScriptRun:
    """One script's episodes in its own ``out`` folder: the replies per task, the engines acting them out, the
    trajectories kept and the tasks excluded."""

    def __init__(self, script: Script, out: Path, tasks: list[Task], tokenizer: Any, max_tokens: int,
                 status: Status) -> None:
        if script not in SCRIPTS:
            raise ConfigError(f"unknown gold script {script!r} (choose from {', '.join(SCRIPTS)})")
        check_out_dir(out)
        self.script, self.out, self.tokenizer = script, out, tokenizer
        self.eot = end_of_turn_id(tokenizer)
        self.excluded: list[GoldExclusion] = []
        self.replies: dict[str, list[str]] = {}
        self.engines: dict[str, ScriptedEngine] = {}
        self.kept: list[Path] = []
        self.harness: Harness | None = None  # [agent] harness: it acts the script out through the gateway
        for task in tasks:
            try:
                self.replies[task.instance_id] = _fitting(SCRIPTS[script](task), tokenizer, max_tokens)
            except GoldScriptError as exc:
                why = str(exc).removeprefix(f"{task.instance_id}: ")
                self.excluded.append(GoldExclusion(task.instance_id, "script", why))
                status(f"no {script} script for {task.instance_id}: {why}")
        self.scripted = [t for t in tasks if t.instance_id in self.replies]

    def engine_for(self, task: Task, sample: int) -> ScriptedEngine | Harness:
        self.engines[task.instance_id] = ScriptedEngine(self.replies[task.instance_id], self.tokenizer,
                                                        eot_id=self.eot)
        return self.engines[task.instance_id] if self.harness is None else self.harness

    def record(self, r: EpisodeResult, results: Any, bar: Progress | None) -> None:
        why = _exclusion(r, self.engines[r.instance_id], want=WANTED[self.script])
        if why is None:
            self.kept.append(Path(r.artifacts) / TRAJ_FILE)
        else:
            self.excluded.append(why)
            _move_to_excluded(r, self.out)
        results.write(msgspec.json.encode(r) + b"\n")
        results.flush()
        if bar:
            bar.advance("kept" if why is None else f"excluded ({why.stage})")

    async def collect(self, pool: Any, grader: Grader, rollout: Any, resolver: ImageResolver | None,
                      progress: bool, *, shared: bool) -> None:
        bar = Progress(len(self.scripted), self.script) if progress and self.scripted else None
        grades = _ScriptGrades(grader, self.script) if shared else grader
        with (self.out / "results.jsonl").open("ab") as results:
            ro = Rollout(rollout, pool, grades, self.engine_for, self.tokenizer, self.out,  # type: ignore[arg-type]
                         resolver=resolver)
            await ro.collect(self.scripted, lambda r: self.record(r, results, bar))

    def summary(self, tasks: list[Task], tasks_source: str, tokenizer_path: str, elapsed_s: float) -> GoldSummary:
        order = {t.instance_id: n for n, t in enumerate(tasks)}
        summary = GoldSummary(
            tasks=tasks_source, tokenizer=tokenizer_path, total=len(tasks), scripted=len(self.scripted),
            resolved=len(self.kept) if WANTED[self.script] == "resolved" else 0, script=self.script,
            kept=len(self.kept),
            excluded=sorted(self.excluded, key=lambda e: order.get(e.instance_id, 0)),
            tokens=_token_stats(sorted(self.kept)), elapsed_s=round(elapsed_s, 2))
        (self.out / "summary.json").write_bytes(msgspec.json.format(msgspec.json.encode(summary)))
        return summary


async def make_scripted(config: ClusterConfig, tasks: list[Task], outs: dict[Script, Path], tokenizer: Any, *,
                        tokenizer_path: str, concurrency: int = 4, grade_timeout_s: float = 1800.0,
                        resolver: ImageResolver | None = None, tasks_source: str = "", status: Status = _stderr,
                        progress: bool = True) -> dict[Script, GoldSummary]:
    """``make_gold`` for several scripts at once, each into its own folder (``outs``), ``concurrency`` episodes of
    each at a time, on one sandbox pool with one grader. With several scripts the grader reuses verdicts as the agent
    runs do (``reuse_grades``): a patch identical to one already graded for the task gets that verdict (the recover
    script ends with the gold patch: graded once for both), and an empty patch (give-up) is unresolved without a run,
    as the SWE-bench harness scores it; their grade logs go to ``grade-logs/`` beside the folders, named after the
    script. One script alone grades every patch (give-up's check that the tests fail with no change runs). Writes
    each folder's summary.json; returns the summaries by script."""
    started = time.monotonic()
    rollout = msgspec.structs.replace(rollout_config(config.rollout, concurrency), samples_per_task=1)
    if config.agent.harness in CLI_KINDS:
        raise ConfigError(f"the scripted teachers write swectl's protocol (one ```bash block per reply), which "
                          f"{config.agent.harness} does not read (it calls its own tools): make SFT data with swectl's "
                          f"agent loop or mini-swe-agent")
    if config.agent.harness and config.agent.harness_config != SWECTL_CONFIG:
        raise ConfigError(f"the scripted teachers write swectl's protocol (one ```bash block per reply); through "
                          f"{config.agent.harness} they need agent.harness_config = \"{SWECTL_CONFIG}\" (swectl's "
                          f"prompt in its format), not {config.agent.harness_config!r}")
    runs = [_ScriptRun(script, out, tasks, tokenizer, rollout.episode.sampling.max_new_tokens, status)
            for script, out in outs.items()]
    busy = [run for run in runs if run.scripted]
    shared = len(runs) > 1  # one grader for several scripts: verdicts reused, logs beside the folders
    if busy:
        status(f"{' + '.join(f'{len(run.scripted)} {run.script}' for run in busy)} scripts, concurrency "
               f"{concurrency} each, output {', '.join(str(run.out) for run in busy)}")
        log_dir = (runs[0].out.parent if shared else runs[0].out) / "grade-logs"
        async with running_pool(config) as pool, anyio.create_task_group() as services:  # no CLI kind: no mounts
            grader = Grader(GraderConfig(timeout_s=grade_timeout_s, concurrency=concurrency * len(busy),
                                         reuse=shared),
                            pool, resolver=resolver, log_dir=log_dir)
            if config.agent.harness:
                await _start_harness(services, config, runs, tokenizer)
            async with anyio.create_task_group() as scripts:
                for run in busy:
                    scripts.start_soon(partial(run.collect, pool, grader, rollout, resolver, progress,
                                               shared=shared))
            services.cancel_scope.cancel("scripts done")
    elapsed = time.monotonic() - started
    return {run.script: run.summary(tasks, tasks_source, tokenizer_path, elapsed) for run in runs}


async def _start_harness(tg: anyio.abc.TaskGroup, config: ClusterConfig, runs: list[_ScriptRun], tokenizer: Any
                         ) -> None:
    """One gateway (in ``tg``) for every script run, each session answered by its run's scripted engine for the task
    (the session's name is ``<instance_id>#<sample>@<script>``), and each run's harness tagged with its script."""
    by_script = {run.script: run for run in runs}

    def engine_for(name: str) -> ScriptedEngine:
        key, _, script = name.rpartition("@")
        return by_script[script].engines[key.rpartition("#")[0]]

    harness = await start_harness(tg, config.agent, config.rollout, engine_for, tokenizer,
                                  runs[0].out.parent / "harness", temperature=0.0,
                                  templates=agent_templates(config.rollout.agent_config))
    for run in runs:
        run.harness = harness.for_rollout(run.out / "harness", run.script)


def _fitting(replies: list[str], tokenizer: Any, max_tokens: int) -> list[str]:
    """``replies``, unless one is longer than a turn may be (``rollout.max_tokens``, counting its end-of-turn
    token): the engine would cut it as it cuts a model's reply, and the script would go out of step."""
    for n, reply in enumerate(replies):
        length = len(tokenizer.encode(reply, add_special_tokens=False)) + 1
        if length > max_tokens:
            raise GoldScriptError(f"reply {n + 1} is {length} tokens, more than rollout.max_tokens ({max_tokens}); "
                                  f"raise it (--set rollout.max_tokens={length})")
    return replies


def _exclusion(r: EpisodeResult, engine: ScriptedEngine, *,
               want: Literal["resolved", "unresolved", "any"] = "resolved") -> GoldExclusion | None:
    """Why an episode's scripted trajectory is not kept, or None: it submitted, was graded as ``want`` says
    (resolved; unresolved; any: graded at all), and its model tokens are exactly the scripted replies (no template
    realignment, no reply cut by max_tokens)."""
    if r.outcome == "ABORTED" or r.exit_status != "Submitted":
        return GoldExclusion(r.instance_id, "episode", f"{r.exit_status}: {r.reason}".rstrip(": "))
    if want == "resolved" and not r.resolved:
        return GoldExclusion(r.instance_id, "grade", _grade_reason(r))
    if want == "any" and r.grade is None:
        return GoldExclusion(r.instance_id, "grade", "not graded")
    if want == "unresolved" and (r.grade is None or r.grade.status != "unresolved"):
        why = ("resolved with no change: the task's tests pass on the unchanged repository" if r.resolved
               else _grade_reason(r))
        return GoldExclusion(r.instance_id, "grade", why)
    episode = msgspec.json.decode((Path(r.artifacts) / TRAJ_FILE).read_bytes())["episode"]
    traj = episode["trajectory"]
    trained = _sampled_in_turn_order([traj, *episode.get("branches", [])])
    expected = [t for n in range(r.turns) for t in engine.reply_ids(n)]
    if trained != expected or traj.get("realignments"):
        return GoldExclusion(r.instance_id, "tokens", f"the trajectory's model tokens are not the script's "
                             f"({len(trained)} vs {len(expected)} tokens, {traj.get('realignments', 0)} realignments)")
    return None


def _sampled_in_turn_order(streams: list[dict[str, Any]]) -> list[int]:
    """The mask-1 tokens of an episode's token streams (its trajectory, and an external harness's other branches),
    turn by turn."""
    turns: list[tuple[int, list[int]]] = []
    for stream in streams:
        numbers = span_turns(stream["loss_mask"], stream.get("turns") or ())
        turns += [(n, stream["token_ids"][a:b])
                  for n, (a, b) in zip(numbers, turn_spans(stream["loss_mask"]), strict=True)]
    return [t for _, ids in sorted(turns, key=lambda x: x[0]) for t in ids]


def _grade_reason(r: EpisodeResult) -> str:
    g = r.grade
    if g is None:
        return "not graded"
    parts = [g.status + (f" ({g.reason})" if g.reason else "")]
    if g.f2p_failed:
        parts.append(f"{len(g.f2p_failed)} of {g.f2p_total} FAIL_TO_PASS tests fail")
    if g.p2p_failed:
        parts.append(f"{len(g.p2p_failed)} of {g.p2p_total} PASS_TO_PASS tests fail")
    if g.log_path:
        parts.append(f"log {g.log_path}")
    return "; ".join(parts)


def _move_to_excluded(r: EpisodeResult, out: Path) -> None:
    source = Path(r.artifacts)
    if not source.is_dir():
        return
    target = out / EXCLUDED_DIR / source.name
    target.parent.mkdir(exist_ok=True)
    shutil.rmtree(target, ignore_errors=True)
    shutil.move(str(source), str(target))
    r.artifacts = str(target)
    (target / "meta.json").write_bytes(msgspec.json.format(msgspec.json.encode(r)))


def _token_stats(paths: list[Path]) -> TokenStats:
    if not paths:
        return TokenStats()
    samples = samples_from_runs(paths)
    lengths = [s.length for s in samples]
    trained = [int(unpack_mask(s).sum()) for s in samples]
    return TokenStats(count=len(samples), mean=round(statistics.fmean(lengths), 1),
                      median=float(statistics.median(lengths)), min=min(lengths), max=max(lengths),
                      mean_trained=round(statistics.fmean(trained), 1))
