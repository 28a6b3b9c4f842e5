"""Codex CLI and Claude Code (npm, pinned; .tools/cli-agents from `bash scripts/setup.sh --with-harnesses`), their
real processes unmodified, inside swectl's sandboxes (actors/cli_agents.py): each runs in a bundled task's sandbox in
/testbed, its model calls going to the gateway through the episode's forwarded port, its tools (shell commands)
running in the sandbox. A scripted policy behind the gateway writes Qwen3 tool calls of each CLI's own shell tool
(Codex: ``exec_command``; Claude Code: ``Bash``): one that applies the task's gold patch and then a text answer
resolves when swectl's grader runs the tests in a fresh sandbox; one that answers at once changes nothing and does
not resolve."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import anyio
import pytest

from swectl.actors.cli_agents import CliAgent, CliAgentConfig, default_tools_dir, tools_mounts
from swectl.actors.gateway import Gateway, GatewayConfig
from swectl.actors.grader import Grader, GraderConfig
from swectl.actors.rollout import Rollout, RolloutConfig
from swectl.agent.scripted import ScriptedEngine
from swectl.config import load_config
from swectl.images.project import BUNDLED_TASKS
from swectl.model.tokenizer import load_tokenizer
from swectl.tasks.sources import load_tasks

from .pools import running_pool
from .templates import QWEN3_STYLE_TEMPLATE

pytestmark = [pytest.mark.integration, pytest.mark.anyio]
SHELL_TOOL = {"codex": ("exec_command", "cmd"), "claude-code": ("Bash", "command")}


def _tools() -> None:
    for name in ("codex", "claude"):
        if not (Path(default_tools_dir()) / "bin" / name).exists():
            pytest.fail(f"the CLI agents are not installed ({default_tools_dir()}/bin/{name} is missing): run "
                        "`bash scripts/setup.sh --with-harnesses` (the test command does)")


class _HangsAfterFirstTurn(ScriptedEngine):
    """A scripted policy that answers its first turn and never the next."""

    async def generate(self, request):  # type: ignore[no-untyped-def]
        if self.calls:
            await anyio.sleep_forever()
        return await super().generate(request)


def _call(kind: str, command: str) -> str:
    """A Qwen3 tool call of the CLI's own shell tool, as a scripted policy writes it."""
    name, argument = SHELL_TOOL[kind]
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": {argument: command}})}\n</tool_call>'


@pytest.mark.parametrize("kind", ["codex", "claude-code"])
async def test_a_cli_agent_in_the_sandbox_is_graded_by_swectl(kind: str, model: Path, tmp_path: Path) -> None:
    _tools()
    tokenizer = load_tokenizer(str(model), "model")
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE  # the CLI's tools and tool calls rendered, as Qwen3's template does
    task = load_tasks(str(BUNDLED_TASKS)).tasks[0]
    apply = f"cat > /tmp/gold.patch <<'SWECTL_EOF'\n{task.patch}\nSWECTL_EOF\ngit apply /tmp/gold.patch && echo applied"
    done = "Done: the fix is applied."
    scripts = {0: ScriptedEngine([_call(kind, apply), done], tokenizer), 1: ScriptedEngine([done], tokenizer)}
    gateway = Gateway(GatewayConfig(max_tokens=8192, context_tokens=65536),
                      lambda key: scripts[int(key.rsplit("#", 1)[1])], tokenizer)
    agent = CliAgent(CliAgentConfig(kind=kind, step_limit=6, max_tokens=8192, timeout_s=300), gateway,  # type: ignore[arg-type]
                     tmp_path / "cli")
    config = load_config(None, ["env_pool.warm=0"])
    async with (running_pool(config, "cli" + uuid.uuid4().hex[:8], mounts=tools_mounts(kind)) as pool,
                anyio.create_task_group() as tg):
        with anyio.fail_after(60):
            await tg.start(gateway.run)
        rollout = Rollout(RolloutConfig(concurrency=2, samples_per_task=2), pool, Grader(GraderConfig(), pool),
                          lambda t, n: agent, None, tmp_path / "episodes")
        with anyio.fail_after(600):
            results = sorted(await rollout.collect([task]), key=lambda r: r.sample)
        tg.cancel_scope.cancel()
    gold, empty = results
    logs = {n: (tmp_path / "cli" / f"{task.instance_id}#{n}" / f"{kind}.log") for n in (0, 1)}
    shown = {n: p.read_text()[-2000:] if p.exists() else "(no log)" for n, p in logs.items()}
    assert gold.outcome == "COMPLETED" and gold.exit_status == "Submitted" and gold.resolved, (gold, shown[0])
    assert empty.outcome == "COMPLETED" and not empty.resolved and empty.grade is not None, (empty, shown[1])
    first, second = agent.records[f"{task.instance_id}#0"], agent.records[f"{task.instance_id}#1"]
    assert first.stats.turns == 2 and second.stats.turns == 1, (first.stats, second.stats)
    assert first.stats.branches == 0, first.stats  # the CLI sent its history back as it was sampled
    stats = gateway.statistics()
    assert stats.rejected == stats.engine_failures == 0, stats


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's tiny model, made with 65,536 positions: Codex's first prompt is about 12k of its tokens (vocab
    600), beyond the 8,192 of the default."""
    from swectl.cli.main import main

    out = tmp_path_factory.mktemp("long-model") / "tiny"
    assert main(["model", "init", "--out", str(out), "--vocab", "600", "--layers", "2", "--hidden", "64",
                 "--context", "65536", "--corpus-max-bytes", "300000"]) == 0
    return out


@pytest.mark.parametrize("kind", ["codex", "claude-code"])
def test_grpo_through_a_cli_agent(kind: str, long_model: Path, tmp_path: Path) -> None:
    """`swectl up` with ``agent.harness`` a CLI (GRPO, synchronous, 2 steps, the tiny model, whose own template
    renders no tools: its prompts fit its 8192 positions): the CLI's own process in each episode's sandbox, its turns
    sampled through the gateway and recorded token by token; the weights update, step 2's turns are sampled by
    version 1, and the trainer's logprobs of the recorded tokens are the engine's (within 1e-4). Learning is not
    asked of the tiny model."""
    import subprocess
    import sys

    _tools()
    sets = {"out_dir": repr(str(tmp_path)), "run_id": "'cli'", "train.model": repr(str(long_model)),
            "agent.harness": repr(kind), "env_pool.warm": 0, "rollout.context": 32768,
            "train.sampling.tasks_per_step": 2, "train.sampling.n_samples": 2,
            "train.sampling.dynamic_sampling": "false", "rollout.step_limit": 2, "rollout.max_tokens": 16,
            "train.concurrency": 4}
    argv = ["up", "--recipe", "train", "--steps", "2"]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    done = subprocess.run([sys.executable, "-m", "swectl.cli.main", *argv], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"agent: {kind} inside each sandbox through the gateway" in done.stderr
    run = tmp_path / "cli"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "loss" in m]
    assert [m["weight_version"] for m in trained] == [1, 2]
    assert all(m["samples"] >= 4 for m in trained)  # 2 tasks x 2 episodes
    assert max(m["logprob_gap_max"] for m in trained) < 1e-4, [m["logprob_gap_max"] for m in trained]
    assert all(m["gateway/turns"] >= 4 and m["gateway/engine_failures"] == 0 for m in trained), \
        [{k: v for k, v in m.items() if k.startswith("gateway/")} for m in trained]
    episodes = [json.loads(p.read_text())["episode"] for p in (run / "episodes" / "step_000002").glob("*/traj.json")]
    assert len(episodes) == 4 and all(e["outcome"] != "ABORTED" for e in episodes), \
        [(e["exit_status"], e["reason"]) for e in episodes]
    for episode in episodes:
        versions = {v for t in [episode["trajectory"], *episode["branches"]] for v in t["weight_versions"]}
        assert versions == {"1"}, versions


@pytest.mark.parametrize("kind", ["codex", "claude-code"])
async def test_a_cli_agent_cannot_reach_the_internet_and_a_hung_one_is_killed(kind: str, model: Path,
                                                                               tmp_path: Path) -> None:
    """Episode 0: the policy's command tries the internet (a name, an address, the node's own loopback ports): each
    fails, the CLI sends the failure back as the tool's result and goes on to its answer (Submitted). Episode 1: the
    policy's command never ends: the CLI is killed at ``[agent] timeout_s`` with its process group, the episode is
    TimeExceeded (TRUNCATED, graded), and the run goes on."""
    _tools()
    tokenizer = load_tokenizer(str(model), "model")
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    task = load_tasks(str(BUNDLED_TASKS)).tasks[0]
    probe = ("for target in example.org/80 1.1.1.1/443 10.0.2.2/80; do timeout 3 bash -c \"exec 3<>/dev/tcp/"
             "${target}\" 2>/dev/null && echo REACHED $target || echo REFUSED $target; done")
    scripts = {0: ScriptedEngine([_call(kind, probe), "No network here; done."], tokenizer),
               1: _HangsAfterFirstTurn([_call(kind, "echo started")], tokenizer)}
    gateway = Gateway(GatewayConfig(max_tokens=8192, context_tokens=65536),
                      lambda key: scripts[int(key.rsplit("#", 1)[1])], tokenizer)
    agent = CliAgent(CliAgentConfig(kind=kind, step_limit=6, max_tokens=8192, timeout_s=25), gateway,  # type: ignore[arg-type]
                     tmp_path / "cli")
    config = load_config(None, ["env_pool.warm=0"])
    async with (running_pool(config, "cln" + uuid.uuid4().hex[:8], mounts=tools_mounts(kind)) as pool,
                anyio.create_task_group() as tg):
        with anyio.fail_after(60):
            await tg.start(gateway.run)
        rollout = Rollout(RolloutConfig(concurrency=2, samples_per_task=2), pool, Grader(GraderConfig(), pool),
                          lambda t, n: agent, None, tmp_path / "episodes")
        with anyio.fail_after(300):
            results = sorted(await rollout.collect([task]), key=lambda r: r.sample)
        tg.cancel_scope.cancel()
    offline, hung = results
    assert offline.exit_status == "Submitted" and offline.outcome == "COMPLETED", offline
    record = agent.records[f"{task.instance_id}#0"]
    assert record.stats.turns == 2
    (branch,) = record.ledger.trained_branches()
    seen = tokenizer.decode(branch.token_ids)  # the second prompt carries the command's output as the CLI sent it
    for target in ("example.org/80", "1.1.1.1/443", "10.0.2.2/80"):
        assert f"REFUSED {target}" in seen and f"REACHED {target}" not in seen.replace("echo REACHED", ""), seen[-3000:]
    assert hung.exit_status == "TimeExceeded" and hung.outcome == "TRUNCATED" and hung.grade is not None, hung
    assert agent.records[f"{task.instance_id}#1"].stats.turns == 1  # the unanswered turn left no trace
