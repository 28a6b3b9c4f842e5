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
    agent_config_path,
    agent_templates,
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


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_2x_config_takes_its_model_section_and_its_block(tmp_path: Path) -> None:
    """mini-swe-agent 2.x keeps the observation and format-error templates under model:, and its text-based models
    read ```mswea_bash_command blocks unless model.action_regex says otherwise."""
    cfg = _write(tmp_path / "backticks.yaml", (
        "agent:\n  system_template: |\n    Answer in a ```mswea_bash_command block.\n"
        "  instance_template: '{{task}}'\n"
        "model:\n  observation_template: 'rc={{output.returncode}}'\n  format_error_template: '{{error}}'\n"))
    templates, _ = load_mini_swe_agent_config(cfg)
    assert templates.action_observation_template == "rc={{output.returncode}}"
    assert parse_action("x\n```mswea_bash_command\nls -la\n```", templates) == "ls -la"
    with pytest.raises(FormatError):
        parse_action("x\n```bash\nls -la\n```", templates)
    xml = _write(tmp_path / "xml.yaml", "agent:\n  system_template: s\nmodel:\n  action_regex: '<cmd>(.*?)</cmd>'\n")
    assert parse_action("<cmd>pwd</cmd>", load_mini_swe_agent_config(xml)[0]) == "pwd"
    bad = _write(tmp_path / "bad.yaml", "agent:\n  system_template: s\nmodel:\n  action_regex: '(unclosed'\n")
    with pytest.raises(ConfigError, match="does not compile"):
        load_mini_swe_agent_config(bad)


def test_a_tool_calling_config_is_refused_with_what_to_use(tmp_path: Path) -> None:
    cfg = _write(tmp_path / "tools.yaml", (
        "agent:\n  system_template: |\n    Make one bash tool call per reply.\n  instance_template: '{{task}}'\n"
        "model:\n  observation_template: '{{output.output}}'\n"))
    with pytest.raises(ConfigError, match=r"tool-calling models.*text-based config"):
        load_mini_swe_agent_config(cfg)


def test_bundled_configs_go_by_name_and_a_missing_one_says_what_exists(tmp_path: Path) -> None:
    compact = agent_templates("compact")
    system = Renderer(compact, AgentLimits()).system()
    assert f"echo {SUBMIT_SENTINEL} && git add -A && git diff --cached" in system
    assert compact.action_regex == AgentTemplates().action_regex  # the same protocol, fewer words
    assert len(system) < len(Renderer(AgentTemplates(), AgentLimits()).system()) / 3
    assert agent_templates("") == AgentTemplates()
    mine = _write(tmp_path / "compact", "agent:\n  system_template: mine\n")  # a file of a bundled name's name
    assert agent_config_path(str(mine)) == mine and agent_templates(str(mine)).system_template == "mine"
    with pytest.raises(ConfigError, match=r"no such file.*bundled: compact"):
        agent_templates("nope")


def test_templates_can_name_the_machine_but_not_the_host() -> None:
    """mini-swe-agent's prompts may show {{ system }}, {{ release }}, {{ machine }}; the host name is fixed, so a
    prompt (and seeded episodes) do not change from one controller machine to the next."""
    templates = AgentTemplates(system_template="{{ system }} {{ machine }} on {{ node }}")
    text = Renderer(templates, AgentLimits()).system()
    assert text.endswith(" on sandbox") and "{{" not in text and not text.startswith(" ")
