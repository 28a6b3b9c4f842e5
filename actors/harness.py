"""An external agent harness, run unmodified for one episode at a time: mini-swe-agent v2 (issue 58).

For an episode, the Rollout leases the task's sandbox as for its own agent loop and hands it to
``MiniSweAgent.run_episode``, which:

1. opens a gateway session with the lease (actors/gateway.py): the session's key is the harness's API key, and its
   commands run in the lease (swectl/gateway/harness/swectl_mini.py, loaded by dotted path);
2. runs mini's own `mini` command with the user's config (its SWE-bench config by default) on the task's problem
   statement, in /testbed, its model pointed at the gateway;
3. bounded by ``timeout_s``: a harness that hangs is killed, and the episode ends TimeExceeded;
4. takes the sandbox's diff as the patch to grade (what the repository holds, as for swectl's own loop, whatever
   the harness printed), and ends the session: its ledger holds the episode's tokens.

mini's exit statuses map onto swectl's: Submitted (COMPLETED); LimitsExceeded, TimeExceeded, and
RepeatedFormatError as FormatError (TRUNCATED). A harness that crashed, or whose commands failed because the
sandbox or the engine did (the gateway answered 5xx), is Aborted: an infrastructure failure, never scored, and
nothing is trained from it as if it were a submission.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import anyio
import msgspec

from swectl.actors.env_pool import Lease
from swectl.actors.gateway import Gateway, SessionRecord
from swectl.agent.loop import Episode
from swectl.agent.trajectory import Message, Trajectory
from swectl.tasks.record import TESTBED, Task

_log = logging.getLogger(__name__)
HARNESS_DIR = Path(__file__).resolve().parents[1] / "swectl" / "gateway" / "harness"
REPO = Path(__file__).resolve().parents[1]
# mini's exit statuses -> swectl's (anything else: the harness stopped on an error)
EXIT_STATUSES = {"Submitted": ("Submitted", "COMPLETED"), "LimitsExceeded": ("LimitsExceeded", "TRUNCATED"),
                 "TimeExceeded": ("TimeExceeded", "TRUNCATED"), "RepeatedFormatError": ("FormatError", "TRUNCATED")}


def default_mini() -> str:
    """mini-swe-agent's command in .venv-harness (scripts/setup_harnesses.sh), or $SWECTL_HARNESS_VENV's."""
    venv = Path(os.environ.get("SWECTL_HARNESS_VENV", REPO / ".venv-harness"))
    return str(venv / "bin" / "mini")


def mini_env(home: Path) -> dict[str, str]:
    """The environment mini runs in: swectl's environment class importable, nothing asked (its setup prompt), no
    network (litellm's local cost map), its global config in ``home``."""
    path = os.pathsep.join(p for p in (str(HARNESS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "MSWEA_CONFIGURED": "true",
            "MSWEA_GLOBAL_CONFIG_DIR": str(home), "MSWEA_SILENT_STARTUP": "1"}


class MiniSweAgentConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How mini-swe-agent is run for each episode."""

    executable: str = ""  # its `mini` command ("": .venv-harness/bin/mini)
    config: str = "swebench.yaml"  # its config (a name it knows, or a YAML file of its format)
    step_limit: int = 0  # agent.step_limit (0: the config's)
    timeout_s: float = 1800.0  # the whole episode at most
    overrides: list[str] = []  # more `-c KEY=VALUE` for it


class MiniSweAgent:
    """Runs mini-swe-agent for one episode through ``gateway`` (``run_episode``); the ledgers of ended sessions are
    kept by episode key in ``records``."""

    def __init__(self, config: MiniSweAgentConfig, gateway: Gateway, work_dir: Path) -> None:
        self.config = config
        self._gateway = gateway
        self._work = work_dir
        self.records: dict[str, SessionRecord] = {}

    def argv(self, task: Task, key: str, traj: Path) -> list[str]:
        cfg, url = self.config, self._gateway.url
        argv = [cfg.executable or default_mini(), "-c", cfg.config,
                "-c", "environment.environment_class=swectl_mini.SwectlEnvironment",
                "-c", f"environment.gateway_url={url}", "-c", f"environment.api_key={key}",
                "-c", f"environment.cwd={TESTBED}", "-c", f"model.model_kwargs.api_base={url}",
                "-c", f"model.model_kwargs.api_key={key}", "-c", "model.cost_tracking=ignore_errors"]
        if cfg.step_limit:
            argv += ["-c", f"agent.step_limit={cfg.step_limit}"]
        for override in cfg.overrides:
            argv += ["-c", override]
        return [*argv, "-m", f"openai/{self._gateway.config.model}", "-t", task.problem_statement, "-y",
                "--exit-immediately", "-o", str(traj)]

    async def run_episode(self, task: Task, lease: Lease, key: str) -> Episode:
        """One episode of ``task`` in ``lease`` (already prepared); the Episode to grade (its patch: the diff)."""
        folder = self._work / key.replace("/", "_")
        await anyio.Path(folder).mkdir(parents=True, exist_ok=True)
        traj = folder / "mini.traj.json"
        session = self._gateway.open_session(key, lease)
        t0 = time.monotonic()
        returncode: int | None = None
        try:
            with anyio.move_on_after(self.config.timeout_s) as scope:  # a hung harness is killed
                done = await anyio.run_process(self.argv(task, session, traj), input=b"",
                                               env=mini_env(folder / "home"), cwd=folder, check=False)
                returncode = done.returncode
                await anyio.Path(folder / "mini.log").write_bytes(done.stdout + done.stderr)
            timed_out = scope.cancelled_caught
            info = await _read_info(traj)
        finally:
            record = self._gateway.end_session(session)
            self.records[key] = record
        elapsed = time.monotonic() - t0
        status = "TimeExceeded" if timed_out else str(info.get("exit_status", ""))
        messages = [Message(m.get("role", ""), _text(m.get("content"))) for m in info.get("messages", [])]
        if status not in EXIT_STATUSES or (not timed_out and returncode != 0):
            reason = (f"mini-swe-agent ended with {status or 'no exit status'} (exit {returncode}; log: "
                      f"{folder / 'mini.log'})")
            return Episode(instance_id=task.instance_id, exit_status="Aborted", outcome="ABORTED", reason=reason,
                           total_time_s=elapsed, trajectory=Trajectory(messages=messages))
        exit_status, outcome = EXIT_STATUSES[status]
        patch = (await lease.diff(TESTBED)).decode("utf-8", errors="surrogateescape")
        return Episode(instance_id=task.instance_id, exit_status=exit_status, outcome=outcome,  # type: ignore[arg-type]
                       reason="" if outcome == "COMPLETED" else f"mini-swe-agent: {status}", patch=patch,
                       submitted=str(info.get("submission", "")), total_time_s=elapsed,
                       trajectory=Trajectory(messages=messages))


async def _read_info(traj: Path) -> dict:
    """mini's trajectory file: its ``info`` (exit status, submission) with its ``messages``; {} when missing."""
    try:
        data = json.loads(await anyio.Path(traj).read_bytes())
    except (OSError, ValueError):
        return {}
    info = dict(data.get("info") or {})
    info["messages"] = data.get("messages") or []
    return info


def _text(content: object) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)
