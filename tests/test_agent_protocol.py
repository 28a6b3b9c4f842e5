"""The mini-swe-agent protocol: action parsing, submission, templates (ours and loaded from YAML)."""

from __future__ import annotations

from pathlib import Path

import pytest

from swectl.agent.protocol import (
    SUBMIT_SENTINEL,
    AgentLimits,
    AgentTemplates,
    FormatError,
    Renderer,
    load_mini_swe_agent_config,
    parse_action,
    submission,
)
from swectl.errors import ConfigError


def test_exactly_one_bash_block() -> None:
    assert parse_action("THOUGHT: look\n\n```bash\nls -la\n```\n") == "ls -la"
    assert parse_action("T\n```bash\ncat <<'EOF' > a.py\nx = 1\nEOF\n```") == "cat <<'EOF' > a.py\nx = 1\nEOF"
    with pytest.raises(FormatError) as none:
        parse_action("I will just think.")
    assert none.value.actions == []
    with pytest.raises(FormatError) as two:
        parse_action("```bash\nls\n```\nand\n```bash\npwd\n```")
    assert two.value.actions == ["ls", "pwd"]
    with pytest.raises(FormatError):
        parse_action("```python\nprint(1)\n```")


def test_submission_sentinel_must_lead_the_output() -> None:
    patch = "diff --git a/x b/x\n--- a/x\n+++ b/x\n"
    assert submission(f"{SUBMIT_SENTINEL}\n{patch}") == patch
    assert submission(f"\n  {SUBMIT_SENTINEL}\n") == ""
    assert submission(f"building...\n{SUBMIT_SENTINEL}\n{patch}") is None
    assert submission("nothing") is None


def test_templates_render() -> None:
    r = Renderer(AgentTemplates(), AgentLimits())
    assert SUBMIT_SENTINEL in r.system()
    assert "fix the bug" in r.instance("fix the bug")
    assert r.observation("hello\n", 0).startswith("<returncode>0</returncode>\n<output>\nhello\n</output>")
    long = r.observation("a" * 6000 + "b" * 6000, 1)
    assert "<warning>" in long
    assert "a" * 5000 in long
    assert "b" * 5000 in long
    assert "a" * 6000 not in long
    assert "contained 2" in r.format_error(["ls", "pwd"])
    assert "30 seconds" in r.timeout("sleep 99", "", 30.0)


def test_typo_in_template_is_a_config_error() -> None:
    r = Renderer(AgentTemplates(instance_template="{{ taks }}"), AgentLimits())
    with pytest.raises(ConfigError, match="instance_template"):
        r.instance("x")


def test_loads_a_mini_swe_agent_yaml(tmp_path: Path) -> None:
    cfg = tmp_path / "swebench.yaml"
    cfg.write_text(
        "agent:\n"
        "  system_template: |\n    You are a helpful assistant.\n"
        "  instance_template: |\n    Please solve this issue: {{task}}\n"
        "  step_limit: 250\n"
        "  cost_limit: 3.0\n"
        "environment:\n  timeout: 60\n"
    )
    templates, limits = load_mini_swe_agent_config(cfg)
    assert templates.system_template == "You are a helpful assistant.\n"
    assert templates.format_error_template == AgentTemplates().format_error_template  # not set: ours
    assert limits == {"step_limit": 250}
    assert Renderer(templates, AgentLimits()).instance("it breaks") == "Please solve this issue: it breaks\n"
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name: x\n")
    with pytest.raises(ConfigError, match="none of"):
        load_mini_swe_agent_config(bad)
