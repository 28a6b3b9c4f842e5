"""What a CLI agent's episode is made of, without its process (actors/cli_agents.py): the command that runs it in the
sandbox (the gateway its only endpoint, nothing asked, no telemetry), Codex's provider config, the tools mount, and
how each ending maps onto swectl's outcomes (a limit is the policy's, a 5xx the infrastructure's)."""

from __future__ import annotations

import json
import shlex
import tomllib

import pytest

from swectl.actors.cli_agents import (
    GATEWAY_PORT,
    TOOLS_TARGET,
    CliAgentConfig,
    cli_command,
    codex_config,
    ending,
    tools_mounts,
)
from swectl.actors.gateway import SessionRecord
from swectl.gateway.ledger import Ledger


def _record(**flags: object) -> SessionRecord:
    ledger = Ledger()
    ledger.completion(ledger.prompt([1, 2]), [3], [-0.1], "1")
    return SessionRecord(name="t#0", ledger=ledger, stats=ledger.stats(), **flags)  # type: ignore[arg-type]


def test_codex_is_pointed_at_the_gateway_over_the_responses_api() -> None:
    config = tomllib.loads(codex_config("swectl-policy", f"http://127.0.0.1:{GATEWAY_PORT}"))
    provider = config["model_providers"][config["model_provider"]]
    assert config["model"] == "swectl-policy"
    assert provider["wire_api"] == "responses" and provider["env_key"] == "SWECTL_KEY"
    assert provider["base_url"] == f"http://127.0.0.1:{GATEWAY_PORT}/v1"
    command = cli_command(CliAgentConfig(kind="codex"), "sk-swectl-k", "/tmp/p.txt")
    assert f"{TOOLS_TARGET}/bin/codex exec --dangerously-bypass-approvals-and-sandbox" in command
    assert "SWECTL_KEY=sk-swectl-k" in command and "cd /testbed" in command


def test_claude_code_gets_the_gateway_its_limits_and_no_other_traffic() -> None:
    command = cli_command(CliAgentConfig(kind="claude-code", step_limit=7, max_tokens=64), "sk-swectl-k", "/tmp/p")
    words = shlex.split(command.split("exec env ", 1)[1])
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-") and "/bin/" not in w)
    assert env["ANTHROPIC_BASE_URL"] == f"http://127.0.0.1:{GATEWAY_PORT}"  # no /v1: the SDK adds it
    assert env["ANTHROPIC_API_KEY"] == "sk-swectl-k" and env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "64"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and env["HOME"].startswith("/tmp/")
    assert words[words.index("--max-turns") + 1] == "7" and "-p" in words


def test_only_cli_kinds_mount_the_tools() -> None:
    assert tools_mounts("") == [] and tools_mounts("mini-swe-agent") == []
    (mount,) = tools_mounts("codex", "/srv/tools")
    assert (mount.source, mount.target) == ("/srv/tools", TOOLS_TARGET)


@pytest.mark.parametrize(("kind", "code", "timed_out", "flags", "output", "want"), [
    ("codex", 0, False, {}, "", ("Submitted", "COMPLETED")),
    ("codex", 137, True, {}, "", ("TimeExceeded", "TRUNCATED")),
    ("codex", 1, False, {"limited": True}, "", ("LimitsExceeded", "TRUNCATED")),  # turns or context refused
    ("codex", 1, False, {"last_finish": "length"}, "", ("LimitsExceeded", "TRUNCATED")),  # response.incomplete
    ("claude-code", 1, False, {}, json.dumps({"type": "result", "subtype": "error_max_turns"}),
     ("LimitsExceeded", "TRUNCATED")),
    ("codex", 1, False, {"failed": True, "limited": True}, "", ("Aborted", "ABORTED")),  # the engine failed
    ("claude-code", 0, False, {"failed": True}, "", ("Aborted", "ABORTED")),
    ("codex", 2, False, {"last_finish": "stop"}, "", ("Aborted", "ABORTED")),  # a crash of the CLI's own
])
def test_endings(kind: str, code: int, timed_out: bool, flags: dict, output: str, want: tuple[str, str]) -> None:
    assert ending(kind, code, timed_out, _record(**flags), output) == want  # type: ignore[arg-type]
