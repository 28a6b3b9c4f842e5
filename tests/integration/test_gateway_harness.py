"""mini-swe-agent v2 (PyPI 2.4.6, unmodified, in .venv-harness from `bash scripts/setup.sh --with-harnesses`) against
the gateway (actors/gateway.py) before the real CPU engine and the tiny model: its own `mini` command, its own
SWE-bench config (tool calls: a `bash` function), its litellm model pointed at the gateway by `api_base`, the
episode's key as its API key, its local environment in a scratch folder.

What it does, seen in this session (docs/gateway.md): it sends the whole history each turn, non-streaming, with
`tools` and `parallel_tool_calls`; a reply without a tool call is a format error, and that reply is left out of the
next request (only its error message goes back), so each such turn's rendering does not extend the last one and the
ledger branches. The tiny model writes no tool call: the run ends after three format errors in a row."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import anyio
import pytest

from swectl.actors.engines import Engines
from swectl.actors.gateway import Gateway, GatewayConfig
from swectl.actors.harness import default_mini, mini_env
from swectl.config import EngineConfig
from swectl.model.tokenizer import load_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


def _call(command: str) -> str:
    """A Qwen3 tool call of mini's `bash` tool, as a scripted policy writes it."""
    return f'<tool_call>\n{json.dumps({"name": "bash", "arguments": {"command": command}})}\n</tool_call>'


def _mini() -> Path:
    mini = Path(default_mini())
    if not mini.exists():
        pytest.fail(f"mini-swe-agent is not installed ({mini} is missing): run `bash scripts/setup.sh "
                    "--with-harnesses` (the test command does)")
    return mini


def _engine_and_gateway(model: Path, tmp_path: Path) -> tuple[Engines, Gateway]:
    """The real CPU engine serving the tiny model, and a gateway before it (32 tokens a turn) that waits out an
    engine outage as the product's do (the engines' wait_routable)."""
    engines = Engines(EngineConfig(health_interval_s=1.0, start_timeout_s=120), model=str(model), log_dir=tmp_path)
    return engines, Gateway(GatewayConfig(max_tokens=32), engines.route, load_tokenizer(str(model), "model"),
                            wait_routable=engines.wait_routable)


def _local_mini(mini: Path, gateway: Gateway, key: str, tmp_path: Path, traj: Path) -> tuple[dict[str, str], list[str]]:
    """mini's environment and command line: its own SWE-bench config, its local environment in a scratch folder,
    its litellm model at the gateway with the episode's key, 6 steps, the trajectory written to ``traj``."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    env = {**mini_env(tmp_path / "cfg"), "OPENAI_API_KEY": "", "HTTP_PROXY": "", "HTTPS_PROXY": ""}
    argv = [str(mini), "-c", "swebench.yaml", "-c", "environment.environment_class=local",
            "-c", f"environment.cwd={work}", "-c", f"model.model_kwargs.api_base={gateway.url}",
            "-c", f"model.model_kwargs.api_key={key}", "-c", "model.cost_tracking=ignore_errors",
            "-c", "agent.step_limit=6", "-m", "openai/swectl-policy", "-t", "print hello", "-y",
            "--exit-immediately", "-o", str(traj)]
    return env, argv


async def test_mini_swe_agent_runs_unmodified_through_the_gateway(model: Path, tmp_path: Path) -> None:
    mini = _mini()
    engines, gateway = _engine_and_gateway(model, tmp_path)
    traj = tmp_path / "mini.traj.json"
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(120):
            await tg.start(engines.run)
            await tg.start(gateway.run)
        key = gateway.open_session("mini#0")
        env, argv = _local_mini(mini, gateway, key, tmp_path, traj)
        with anyio.fail_after(300):
            done = await anyio.run_process(argv, env=env, cwd=tmp_path, check=False)
        output = (done.stdout + done.stderr).decode(errors="replace")
        assert done.returncode == 0, output[-3000:]
        record = gateway.end_session(key)
        stats = gateway.statistics()
        tg.cancel_scope.cancel()
    info = json.loads(traj.read_text())["info"]
    calls = info["model_stats"]["api_calls"]
    assert info["exit_status"] in ("RepeatedFormatError", "LimitsExceeded", "Submitted"), info["exit_status"]
    # every call it made was answered (no 4xx/5xx, no retries) and sampled once
    assert calls >= 1 and record.stats.turns == calls == stats.requests, (calls, record.stats, stats)
    assert stats.rejected == 0 and stats.engine_failures == 0 and stats.replayed == 0
    for branch in record.ledger.trained_branches():
        branch.check()
        assert branch.turns >= 1 and sum(branch.loss_mask) > 0
    if info["exit_status"] == "RepeatedFormatError":  # malformed replies are dropped from the next request
        assert record.stats.branches == calls - 1 and record.stats.drift_tokens > 0


async def test_an_engine_killed_between_turns_is_waited_out_and_nothing_untrue_is_recorded(model: Path,
                                                                                           tmp_path: Path) -> None:
    """mini-swe-agent, unmodified, through the gateway while its engine server is SIGKILLed after the first turn:
    the supervisor restarts it, the next turn meets the outage and the gateway asks it again of the new server once
    one is routable (no 503 reaches mini, so mini never retries), and mini ends as it would have. Every recorded
    token came from the engine (each trained branch checks out), and nothing reached the harness from the dead
    server. (Before the outage wait, the gateway answered 503 three times here and mini's own retry, 4 s or more
    apart, reached the new server.)"""
    import os
    import signal

    from swectl.testing import chaos

    mini = _mini()
    engines, gateway = _engine_and_gateway(model, tmp_path)
    traj = tmp_path / "mini.traj.json"
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(120):
            await tg.start(engines.run)
            await tg.start(gateway.run)
        first = chaos.Run(controller=os.getpid(), run_dir=tmp_path).engine_server()
        key = gateway.open_session("mini#0")
        env, argv = _local_mini(mini, gateway, key, tmp_path, traj)
        done: dict[str, object] = {}
        ended = anyio.Event()

        async def run_mini() -> None:
            done["process"] = await anyio.run_process(argv, env=env, cwd=tmp_path, check=False)
            ended.set()

        tg.start_soon(run_mini)
        with anyio.fail_after(120):  # mini saves its trajectory after each step: the first turn is answered
            while not traj.exists() and not ended.is_set():  # noqa: ASYNC110 (a file mini writes)
                await anyio.sleep(0.05)
        os.kill(first, signal.SIGKILL)
        with anyio.fail_after(420):
            await ended.wait()
        process = done["process"]
        output = (process.stdout + process.stderr).decode(errors="replace")  # type: ignore[attr-defined]
        assert process.returncode == 0, output[-3000:]  # type: ignore[attr-defined]
        record = gateway.end_session(key)
        second = chaos.Run(controller=os.getpid(), run_dir=tmp_path).engine_server()
        stats = gateway.statistics()
        tg.cancel_scope.cancel()
    # the dead server met a turn: the gateway asked it again itself; mini saw no 503 and asked each turn once
    assert stats.engine_retries >= 1 and stats.engine_failures == 0, stats
    assert stats.requests == record.stats.turns and not record.failed, (stats, record.stats)
    assert second != first  # the server was restarted, and the later turns were answered by the new one
    info = json.loads(traj.read_text())["info"]
    assert info["exit_status"] in ("RepeatedFormatError", "LimitsExceeded"), info["exit_status"]
    assert record.stats.turns >= 2, record.stats  # a turn was sampled after the restart
    for branch in record.ledger.trained_branches():
        branch.check()


async def test_mini_swe_agent_drives_a_swectl_sandbox_and_submits(model: Path, tmp_path: Path) -> None:
    """Its environment class by dotted path (swectl/gateway/harness/swectl_mini.py): the commands of a scripted
    policy's tool calls run in a real swectl sandbox through the gateway (/swectl/v1/exec, the episode's key), what
    they leave is in the sandbox, and the submission ends the run as mini's own environments do."""
    from swectl.agent.scripted import ScriptedEngine
    from swectl.config import load_config

    from .pools import running_pool

    mini = _mini()
    tokenizer = load_tokenizer(str(model), "model")

    script = ScriptedEngine([_call("echo hello > /tmp/made-by-mini && cat /tmp/made-by-mini && hostname"),
                             _call("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && echo the-patch")], tokenizer)
    gateway = Gateway(GatewayConfig(max_tokens=256), lambda key: script, tokenizer)
    traj = tmp_path / "mini.traj.json"
    async with running_pool(load_config(None, ["env_pool.warm=0"]), "gwh" + uuid.uuid4().hex[:8]) as pool, \
            anyio.create_task_group() as tg:
        with anyio.fail_after(60):
            await tg.start(gateway.run)
        lease = await pool.acquire()
        try:
            key = gateway.open_session("mini#sandbox", lease)
            env = mini_env(tmp_path / "cfg")
            argv = [str(mini), "-c", "swebench.yaml",
                    "-c", "environment.environment_class=swectl_mini.SwectlEnvironment",
                    "-c", f"environment.gateway_url={gateway.url}", "-c", f"environment.api_key={key}",
                    "-c", "environment.cwd=/tmp", "-c", f"model.model_kwargs.api_base={gateway.url}",
                    "-c", f"model.model_kwargs.api_key={key}", "-c", "model.cost_tracking=ignore_errors",
                    "-c", "agent.step_limit=5", "-m", "openai/swectl-policy", "-t", "make a file", "-y",
                    "--exit-immediately", "-o", str(traj)]
            with anyio.fail_after(300):
                done = await anyio.run_process(argv, env=env, cwd=tmp_path, check=False)
            output = (done.stdout + done.stderr).decode(errors="replace")
            assert done.returncode == 0, output[-3000:]
            made = await lease.exec("cat /tmp/made-by-mini; hostname", 30)
            record = gateway.end_session(key)
        finally:
            await pool.release(lease)
        tg.cancel_scope.cancel()
    info = json.loads(traj.read_text())["info"]
    assert info["exit_status"] == "Submitted" and info["submission"].strip() == "the-patch", info
    sandbox_host = made.output.split()[1]
    observations = [m["content"] for m in json.loads(traj.read_text())["messages"] if m["role"] == "tool"]
    assert made.output.split()[0] == "hello" and sandbox_host in observations[0], observations
    assert record.stats.turns == 2 and script.calls == 2


async def test_a_rollout_through_mini_swe_agent_is_graded_by_swectl(model: Path, tmp_path: Path) -> None:
    """The Rollout with mini-swe-agent as its engine (actors/harness.py): a bundled task's sandbox, the harness's own
    command and config, a scripted policy whose tool calls apply the task's gold patch and submit, then swectl's
    fresh-sandbox grader on the sandbox's diff: resolved. The same with a policy that submits no change:
    unresolved. mini's exit statuses map onto swectl's, and the ledger of each episode is kept."""
    from swectl.actors.grader import Grader, GraderConfig
    from swectl.actors.harness import MiniSweAgent, MiniSweAgentConfig
    from swectl.actors.rollout import Rollout, RolloutConfig
    from swectl.agent.scripted import ScriptedEngine
    from swectl.config import load_config
    from swectl.images.project import BUNDLED_TASKS
    from swectl.tasks.sources import load_tasks

    from .pools import running_pool

    _mini()
    tokenizer = load_tokenizer(str(model), "model")
    task = load_tasks(str(BUNDLED_TASKS)).tasks[0]

    apply = f"cat > /tmp/gold.patch <<'SWECTL_EOF'\n{task.patch}\nSWECTL_EOF\ngit apply /tmp/gold.patch && echo applied"
    submit = _call("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff")
    scripts = {0: ScriptedEngine([_call(apply), submit], tokenizer), 1: ScriptedEngine([submit], tokenizer)}
    gateway = Gateway(GatewayConfig(max_tokens=8192, context_tokens=65536),
                      lambda key: scripts[int(key.rsplit("#", 1)[1])], tokenizer)
    harness = MiniSweAgent(MiniSweAgentConfig(step_limit=6, timeout_s=300), gateway, tmp_path / "mini")
    config = load_config(None, ["env_pool.warm=0"])
    async with running_pool(config, "gwr" + uuid.uuid4().hex[:8]) as pool, anyio.create_task_group() as tg:
        with anyio.fail_after(60):
            await tg.start(gateway.run)
        rollout = Rollout(RolloutConfig(concurrency=2, samples_per_task=2), pool, Grader(GraderConfig(), pool),
                          lambda t, n: harness, None, tmp_path / "episodes")
        with anyio.fail_after(600):
            results = sorted(await rollout.collect([task]), key=lambda r: r.sample)
        tg.cancel_scope.cancel()
    gold, empty = results
    assert gold.outcome == "COMPLETED" and gold.exit_status == "Submitted" and gold.resolved, gold
    assert empty.outcome == "COMPLETED" and not empty.resolved and empty.grade is not None, empty
    assert harness.records[f"{task.instance_id}#0"].stats.turns == 2
    assert harness.records[f"{task.instance_id}#1"].stats.turns == 1


def test_swectl_eval_with_the_harness(model: Path, tmp_path: Path) -> None:
    """`swectl eval --harness mini-swe-agent --model M`: the engines, the gateway and the harness per episode, from
    the command line; the tiny model writes no tool call, so its episodes end FormatError and are graded (not
    aborted), and the summary records the harness."""
    import subprocess
    import sys

    _mini()
    out = tmp_path / "eval"
    done = subprocess.run([sys.executable, "-m", "swectl.cli.main", "eval", "--model", str(model), "--harness",
                           "mini-swe-agent", "--step-limit", "3", "--max-tokens", "16", "--slice", "0:1", "--out",
                           str(out), "--set", "env_pool.warm=0"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["harness"] == "mini-swe-agent"
    assert summary["finished"] == 1 and summary["infra_errors"] == 0
    assert set(summary["exit_status"]) <= {"FormatError", "LimitsExceeded"}, summary["exit_status"]
    assert list((out / "harness").glob("*/mini.traj.json"))  # mini's own record of the episode


def _swectl(*argv: str, timeout: float = 900) -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "swectl.cli.main", *argv], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr


HARNESS = ["--set", "agent.harness='mini-swe-agent'", "--set", "agent.harness_config='swectl'", "--set",
           "env_pool.warm=0"]


def test_scripted_teachers_act_through_mini_swe_agent_and_a_slip_is_a_branch(model: Path, tmp_path: Path) -> None:
    """`swectl data gold` with [agent] harness: mini's own process acts out the gold and recover scripts (swectl's
    prompt in mini's format, its text-based model) behind the gateway. The gold trajectories resolve with exactly the
    script's tokens; a recover slip (a malformed reply mini drops from its history) is a branch of the session, and
    SFT reads every branch back with the slip masked."""
    from swectl.data.trajectories import samples_from_runs
    from swectl.rl.batch import unpack_mask

    _mini()
    out = tmp_path / "sft"
    _swectl("data", "gold", "--model", str(model), "--script", "gold", "--script", "recover", "--slice", "0:2",
            "--out", str(out), "--set", "rollout.max_tokens=512", "--set", "rollout.step_limit=8", *HARNESS)
    for script in ("gold", "recover"):
        summary = json.loads((out / script / "summary.json").read_text())
        assert summary["kept"] == 2, summary["excluded"]
    recovered = [json.loads(p.read_text())["episode"] for p in (out / "recover").glob("*__0/traj.json")]
    for episode in recovered:
        errors = [s["format_error"] for s in episode["steps"]]
        assert any(errors) and len(episode["branches"]) >= sum(errors), (errors, len(episode["branches"]))
    assert list((out / "gold" / "harness").glob("*/mini.traj.json"))  # mini's own records, beside swectl's
    samples = samples_from_runs([out / "recover"])
    assert len(samples) == sum(1 + len(e["branches"]) for e in recovered)  # one per branch
    # a branch trains its well-formed turns only: one that holds nothing but a slip trains nothing
    well_formed = sum(any(not e["steps"][n]["format_error"] for n in t["turns"])
                      for e in recovered for t in [e["trajectory"], *e["branches"]])
    assert sum(bool(unpack_mask(s).any()) for s in samples) == well_formed > 0
    # the same episodes as ATIF (branches as embedded subagents): Harbor's validator passes them, and they read back
    # as the same trained tokens, branch by branch
    from swectl.data.atif import export_runs, samples_from_atif
    from swectl.model.tokenizer import load_tokenizer
    from swectl.rl.batch import unpack_tokens
    from tests.harbor_tools import harbor_validates

    tok = load_tokenizer(str(model), "model")
    written = export_runs([out / "recover"], tmp_path / "atif", decode=lambda ids: tok.decode(ids))
    for path in written:
        valid, said = harbor_validates(path)
        assert valid, said
    trained = lambda s: [int(t) for t, m in zip(unpack_tokens(s), unpack_mask(s), strict=True) if m]  # noqa: E731
    back = {s.uid: trained(s) for s in samples_from_atif(written)}
    assert back == {s.uid: trained(s) for s in samples}


def test_grpo_through_mini_swe_agent(model: Path, tmp_path: Path) -> None:
    """`swectl up` with [agent] harness (GRPO, synchronous, 2 steps): each episode is mini-swe-agent's own process,
    its turns sampled through the gateway and recorded token by token; the trainer takes them as samples, the
    weights update, step 2's turns are sampled by version 1, and the trainer's logprobs of the recorded tokens are
    the engine's (within 1e-4)."""
    _mini()
    sets = {"out_dir": repr(str(tmp_path)), "run_id": "'harness'", "train.model": repr(str(model)),
            "train.sampling.tasks_per_step": 2, "train.sampling.n_samples": 2,
            "train.sampling.dynamic_sampling": "false", "rollout.step_limit": 2, "rollout.max_tokens": 16,
            "train.concurrency": 4}
    argv = ["up", "--recipe", "train", "--steps", "2", *HARNESS]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    err = _swectl(*argv)
    run = tmp_path / "harness"
    assert "agent: mini-swe-agent (swectl) through the gateway" in err
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "loss" in m]
    assert [m["weight_version"] for m in trained] == [1, 2]
    assert all(m["samples"] >= 4 for m in trained)  # 2 tasks x 2 episodes, a branch or more each
    assert max(m["logprob_gap_max"] for m in trained) < 1e-4, [m["logprob_gap_max"] for m in trained]
    # the gateway's readings per step: every episode's turns, none rejected or failed
    assert all(m["gateway/turns"] >= 4 and m["gateway/rejected"] == m["gateway/engine_failures"] == 0
               for m in trained), [{k: v for k, v in m.items() if k.startswith("gateway/")} for m in trained]
    episodes = [json.loads(p.read_text())["episode"] for p in (run / "episodes" / "step_000002").glob("*/traj.json")]
    assert len(episodes) == 4
    for episode in episodes:
        versions = {v for t in [episode["trajectory"], *episode["branches"]] for v in t["weight_versions"]}
        assert versions == {"1"}, versions
    assert list((run / "episodes" / "step_000002" / "harness").glob("*/mini.traj.json"))


async def test_a_hung_harness_is_killed_at_its_time_limit(model: Path, tmp_path: Path) -> None:
    """mini forked from the warm interpreter (start_harness: the zygote) whose model never answers: the episode
    ends TimeExceeded at agent.timeout_s, mini's whole process group is killed, and the next episode runs."""
    from swectl.actors.harnesses import start_harness
    from swectl.agent.scripted import ScriptedEngine
    from swectl.config import AgentConfig, RolloutOptions, load_config
    from swectl.engine.wire import GenerateRequest

    from .pools import running_pool

    _mini()
    tokenizer = load_tokenizer(str(model), "model")

    class Hung:
        async def generate(self, request: GenerateRequest):
            await anyio.sleep_forever()

    script = ScriptedEngine([_call("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")], tokenizer)
    engines = {"hung#0": Hung(), "fine#0": script}
    agent = AgentConfig(harness="mini-swe-agent", timeout_s=20)
    async with running_pool(load_config(None, ["env_pool.warm=0"]), "gwz" + uuid.uuid4().hex[:8]) as pool, \
            anyio.create_task_group() as tg:
        with anyio.fail_after(600):
            harness = await start_harness(tg, agent, RolloutOptions(step_limit=3), lambda name: engines[name],
                                          tokenizer, tmp_path / "harness", temperature=0.0)
        from swectl.tasks.record import Task

        task = Task(instance_id="hung", repo="r", problem_statement="wait", FAIL_TO_PASS=[])
        lease = await pool.acquire()
        try:
            with anyio.fail_after(300):
                await lease.exec("mkdir -p /testbed && git -C /testbed init -q", 30)  # a repository to diff
                hung = await harness.run_episode(task, lease, "hung#0")
                left = _processes_in(tmp_path / "harness" / "hung#0")
                patient = harness.for_rollout(tmp_path / "harness", "")  # the same zygote, a longer limit
                patient.config = msgspec_replace(harness.config, timeout_s=300)
                fine = await patient.run_episode(msgspec_replace(task, instance_id="fine"), lease, "fine#0")
        finally:
            await pool.release(lease)
        tg.cancel_scope.cancel()
    assert hung.exit_status == "TimeExceeded" and hung.outcome == "TRUNCATED", hung.reason
    assert left == []  # mini's process group is gone (a forked mini runs in its episode's folder)
    assert fine.exit_status == "Submitted", fine.reason


def _processes_in(folder: Path) -> list[int]:
    """The processes whose working folder is ``folder``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and Path(proc / "cwd").resolve() == folder.resolve():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def msgspec_replace(struct, **changes):
    import msgspec

    return msgspec.structs.replace(struct, **changes)


def test_minis_zygote_imports_what_an_episode_would_before_it_forks(tmp_path: Path) -> None:
    """litellm and mini's model, agent and environment classes are imported once in the zygote, not by each forked
    episode (litellm alone took 4.5 CPU-s an episode: mini's episode p50 went 4.8 s -> 0.6-0.8 s in `bench
    cli_agents`, 2026-12-07), and nothing of them is missing from the harness's interpreter."""
    import subprocess

    from swectl.actors.harness import ZYGOTE

    python = _mini().parent / "python"
    done = subprocess.run([str(python), str(ZYGOTE)], input=b"", capture_output=True, env=mini_env(tmp_path),
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    ready = json.loads(done.stdout.splitlines()[0])
    assert ready == {"ready": True, "not_prewarmed": []}, ready
