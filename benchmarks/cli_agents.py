"""`just bench cli_agents`: episodes per minute through Codex CLI and Claude Code inside swectl's sandboxes against
swectl's own agent loop, the same scripted policy on the same tasks (issue 59).

Each task's gold script (swectl/agent/gold.py: look at the code, apply the gold patch, run the failing tests,
submit) is acted out three ways on one EnvPool of namespace sandboxes (the default backend), ``--concurrency``
episodes at a time, interleaved by round so the machine's drift hits each alike:

- **loop**: swectl's own agent loop, a ScriptedEngine giving the replies token by token (as `swectl data gold`);
- **mini**: mini-swe-agent v2's own process on the controller (actors/harness.py, its commands in the sandbox
  through the gateway's exec route), swectl's prompt in its format (``harness_config = "swectl"``), the same replies
  as the loop through a real Gateway (issue 58's "episodes per minute, mini against swectl's own loop");
- **codex** / **claude-code**: the CLI's own process in the task's sandbox (actors/cli_agents.py), its model calls
  through a real Gateway to a ScriptedEngine whose replies are Qwen3 tool calls of the CLI's shell tool with the same
  commands (the submit command becomes a text answer), the Qwen3-style template rendering the CLI's tools.

Episodes are not graded (``RolloutConfig.grade = False``: grading is the same for all three and timed in
`just bench grade`); each is checked to have run its script to the end (Submitted, the turns the script has). Reported
per way: episodes per minute, the episode's own time (p50), the first prompt's tokens; and each harness's rate over
the loop's. Writes ``benchmarks/results/cli_agents.json``.

Run: ``.venv/bin/python benchmarks/cli_agents.py [--tasks 4] [--rounds 2] [--concurrency 2]``. Needs the CLIs
(``bash scripts/setup.sh --with-harnesses``) and the bundled images.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import msgspec
from common import Progress, host_meta, report, summarize

from swectl.actors.cli_agents import CLI_KINDS, CliAgent, CliAgentConfig, tools_mounts
from swectl.actors.env_pool import running_pool
from swectl.actors.gateway import Gateway, GatewayConfig
from swectl.actors.grader import Grader, GraderConfig
from swectl.actors.harness import start_mini
from swectl.actors.rollout import Rollout, RolloutConfig
from swectl.agent.gold import gold_replies
from swectl.agent.protocol import SUBMIT_SENTINEL, agent_templates, parse_action
from swectl.agent.scripted import ScriptedEngine
from swectl.config import AgentConfig, load_config
from swectl.eval.agents import rollout_config
from swectl.images.project import BUNDLED_TASKS
from swectl.model.tokenizer import load_tokenizer
from swectl.tasks.record import Task
from swectl.tasks.sources import load_tasks

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))
from templates import QWEN3_STYLE_TEMPLATE  # noqa: E402  (the tests' Qwen3-style template: one copy)

SHELL_TOOL = {"codex": ("exec_command", "cmd"), "claude-code": ("Bash", "command")}
WAYS = ("loop", "mini", *CLI_KINDS)


def cli_script(kind: str, replies: list[str]) -> list[str]:
    """The gold script's commands as tool calls of the CLI's shell tool; the submit command becomes a text answer."""
    name, argument = SHELL_TOOL[kind]
    out = []
    for reply in replies:
        command = parse_action(reply)
        if command.startswith(f"echo {SUBMIT_SENTINEL}"):
            break
        out.append(f'<tool_call>\n{json.dumps({"name": name, "arguments": {argument: command}})}\n</tool_call>')
    return [*out, "Done: the fix is applied and the failing tests pass."]


async def measure(args: argparse.Namespace, model: Path, progress: Progress) -> dict[str, Any]:
    tokenizer = load_tokenizer(str(model), "model")
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    tasks = load_tasks(str(BUNDLED_TASKS)).tasks[: args.tasks]
    gold = {t.instance_id: gold_replies(t) for t in tasks}
    config = load_config(None, ["env_pool.warm=0"])
    scripts: dict[str, ScriptedEngine] = {}
    gateway = Gateway(GatewayConfig(max_tokens=16384, context_tokens=131072),
                      lambda name: scripts[name.rpartition("@")[0]], tokenizer)
    work = Path(args.work) / uuid.uuid4().hex[:8]
    agents = {kind: CliAgent(CliAgentConfig(kind=kind, step_limit=20, max_tokens=16384, timeout_s=600), gateway,  # type: ignore[arg-type]
                             work / kind, tag=kind) for kind in CLI_KINDS}
    loop_cfg = rollout_config(msgspec.structs.replace(config.rollout, max_tokens=16384, context=131072),
                              args.concurrency)
    seconds: dict[str, list[float]] = {w: [] for w in WAYS}
    episode_s: dict[str, list[float]] = {w: [] for w in WAYS}
    prompts: dict[str, list[int]] = {w: [] for w in WAYS if w != "loop"}
    mounts = tools_mounts("codex")
    async with running_pool(config, "bcli" + uuid.uuid4().hex[:6], mounts=mounts) as pool, \
            anyio.create_task_group() as tg:
        await tg.start(gateway.run)
        grader = Grader(GraderConfig(), pool)
        options = msgspec.structs.replace(config.rollout, step_limit=20)
        harnesses: dict[str, Any] = dict(agents)
        harnesses["mini"] = (await start_mini(tg, AgentConfig(harness="mini-swe-agent", harness_config="swectl"),
                                              options, gateway, work / "mini",
                                              templates=agent_templates(config.rollout.agent_config))
                             ).for_rollout(work / "mini", "mini")
        for round_ in range(args.rounds):
            for way in WAYS:
                def engine_for(task: Task, n: int, way: str = way) -> Any:
                    key = f"{task.instance_id}#{n}"
                    if way == "loop":
                        return ScriptedEngine(gold[task.instance_id], tokenizer)
                    script = gold[task.instance_id] if way == "mini" else cli_script(way, gold[task.instance_id])
                    scripts[key] = ScriptedEngine(script, tokenizer)
                    return harnesses[way]

                cfg = RolloutConfig(concurrency=args.concurrency, samples_per_task=1, grade=False,
                                    episode=loop_cfg.episode)
                rollout = Rollout(cfg, pool, grader, engine_for, tokenizer, work / f"{way}-{round_}")
                start = time.monotonic()
                results = await rollout.collect(tasks)
                elapsed = time.monotonic() - start
                bad = [(r.instance_id, r.exit_status, r.reason) for r in results if r.exit_status != "Submitted"]
                if bad:
                    raise RuntimeError(f"{way}: episodes did not run their script: {bad}")
                seconds[way].append(elapsed)
                episode_s[way] += [r.total_time_s for r in results if r.total_time_s]
                if way != "loop":
                    for t in tasks:
                        record = harnesses[way].records[f"{t.instance_id}#0"]
                        prompts[way].append(record.ledger.trained_branches()[0].loss_mask.index(1))
                        want = gold[t.instance_id] if way == "mini" else cli_script(way, gold[t.instance_id])
                        if record.stats.turns != len(want):
                            raise RuntimeError(f"{way}: {t.instance_id} took {record.stats.turns} turns")
                progress(f"round {round_ + 1}/{args.rounds} {way}: {len(results)} episodes in {elapsed:.1f} s")
        tg.cancel_scope.cancel()
    n = len(tasks)
    metrics: dict[str, Any] = {}
    for way in WAYS:
        metrics[f"{way.replace('-', '_')}_episodes_per_min"] = round(60 * n * args.rounds / sum(seconds[way]), 2)
        metrics[f"{way.replace('-', '_')}_episode_p50_s"] = summarize(episode_s[way])["p50"]
    for kind in WAYS[1:]:
        k = kind.replace("-", "_")
        metrics[f"{k}_vs_loop"] = round(metrics[f"{k}_episodes_per_min"] / metrics["loop_episodes_per_min"], 3)
        metrics[f"{k}_first_prompt_tokens_p50"] = summarize(prompts[kind])["p50"]
    return {"metrics": metrics, "seconds": seconds, "episode_s": {w: summarize(v) for w, v in episode_s.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=4, help="bundled tasks (the first N)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every way, interleaved")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--model", default="", help="a tiny model folder for its tokenizer (default: made here)")
    parser.add_argument("--work", default="/tmp/swectl-bench-cli", help="episode folders")
    args = parser.parse_args()
    progress = Progress("cli_agents")
    model = Path(args.model) if args.model else Path(args.work) / "tiny"
    if not model.exists():
        from swectl.cli.main import main as swectl

        swectl(["model", "init", "--out", str(model), "--vocab", "600", "--layers", "2", "--hidden", "64",
                "--corpus-max-bytes", "300000"])
    meta = host_meta()
    out = anyio.run(measure, args, model, progress)
    meta |= {"tasks": args.tasks, "rounds": args.rounds, "concurrency": args.concurrency, "graded": False,
             "seconds_per_round": out["seconds"], "episode_s": out["episode_s"]}
    report("cli_agents", out["metrics"], meta, [])  # the issue sets no number: the ratios are reported
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
