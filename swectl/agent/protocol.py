"""The agent protocol (docs/architecture.md 6.1), mini-swe-agent's: each model turn holds a THOUGHT and exactly one bash
code block; each command runs statelessly in the sandbox; the observation goes back through a template;
the episode ends when a command's output starts with the submission sentinel, or a limit is hit.

Templates are Jinja (StrictUndefined) and load from a mini-swe-agent YAML config (its ``agent:`` section:
``system_template``, ``instance_template``, ``action_observation_template``, ``format_error_template``,
``timeout_template``, ``step_limit``), so existing configs port over. This module is pure: no I/O beyond
reading a config file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import msgspec

from swectl.errors import ConfigError, SwectlError

SUBMIT_SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

ExitStatus = Literal[
    "Submitted",  # the agent submitted (COMPLETED)
    "LimitsExceeded",  # step limit (TRUNCATED)
    "TimeExceeded",  # episode wall time (TRUNCATED)
    "ContextExceeded",  # the next prompt would not fit the context budget (TRUNCATED)
    "FormatError",  # too many consecutive turns without exactly one bash block (TRUNCATED)
    "Aborted",  # infrastructure failed: engine or sandbox (ABORTED, never a reward)
]

SYSTEM_TEMPLATE = """\
You are a software engineer working in a Linux shell on a real repository.
Every reply has two parts: a THOUGHT paragraph explaining your reasoning, then EXACTLY ONE bash code block
with the one command to run next, like this:

THOUGHT: I should look at the files first.

```bash
ls -la
```

Each command runs in a fresh shell (cd and exported variables do not persist; chain with && instead).
Commands must not be interactive. When you are done, submit with this command and nothing else:

```bash
echo {{ sentinel }} && git add -A && git diff --cached
```
"""

INSTANCE_TEMPLATE = """\
<pr_description>
{{ task }}
</pr_description>

The repository is at {{ workdir }}. Change the non-test source files so that the problem described above is
fixed. Do not edit the tests. Work step by step: find the relevant code, reproduce the problem, fix it,
check the fix, then submit.
"""

ACTION_OBSERVATION_TEMPLATE = """\
<returncode>{{ output.returncode }}</returncode>
{% if output.output | length < max_output_chars -%}
<output>
{{ output.output -}}
</output>
{%- else -%}
<warning>The output was too long ({{ output.output | length }} characters); showing its head and tail.
Use head, tail, grep or sed -n to see less at a time.</warning>
<output_head>
{{ output.output[: max_output_chars // 2] }}
</output_head>
<output_tail>
{{ output.output[- (max_output_chars // 2):] }}
</output_tail>
{%- endif %}
"""

FORMAT_ERROR_TEMPLATE = """\
Your reply must contain EXACTLY ONE bash code block (```bash ... ```); it contained {{ actions | length }}.
Reply again with a THOUGHT and one bash code block. To submit, run: echo {{ sentinel }} && git add -A && \
git diff --cached
"""

TIMEOUT_TEMPLATE = """\
The command timed out after {{ timeout }} seconds and was killed:
{{ action }}
{% if output %}Output before the timeout:
{{ output }}
{% endif %}Run something faster, or run long jobs in the background with their output redirected to a file.
"""

ACTION_REGEX = r"```bash\s*\n(.*?)\n```"


class AgentLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """When an episode stops: steps, wall time, context tokens, format errors in a row, command time."""
    step_limit: int = 50  # model turns
    wall_time_s: float = 1800.0  # whole episode
    max_context_tokens: int = 32768
    max_format_errors: int = 3  # consecutive
    command_timeout_s: float = 60.0  # one command, killed inside the sandbox


class AgentTemplates(msgspec.Struct, frozen=True, kw_only=True):
    """The prompts and observation formats of mini-swe-agent's protocol, and the action regex."""
    system_template: str = SYSTEM_TEMPLATE
    instance_template: str = INSTANCE_TEMPLATE
    action_observation_template: str = ACTION_OBSERVATION_TEMPLATE
    format_error_template: str = FORMAT_ERROR_TEMPLATE
    timeout_template: str = TIMEOUT_TEMPLATE
    action_regex: str = ACTION_REGEX
    max_output_chars: int = 10_000


class FormatError(SwectlError):
    """The reply did not hold exactly one bash block; ``actions`` are the blocks it did hold."""

    def __init__(self, actions: list[str]) -> None:
        super().__init__(f"expected exactly one bash block, found {len(actions)}")
        self.actions = actions


def parse_action(reply: str, templates: AgentTemplates | None = None) -> str:
    """The one bash command in a model reply; FormatError unless there is exactly one."""
    regex = (templates or AgentTemplates()).action_regex
    actions = re.findall(regex, reply, re.DOTALL)
    if len(actions) != 1:
        raise FormatError([a.strip() for a in actions])
    return actions[0].strip()


def submission(output: str) -> str | None:
    """If a command's output starts with the sentinel line, what follows it (the submitted patch)."""
    lines = output.lstrip().split("\n", 1)
    if lines[0].strip() != SUBMIT_SENTINEL:
        return None
    return lines[1] if len(lines) > 1 else ""


class Renderer:
    """Renders the protocol's templates (Jinja, StrictUndefined: a typo in a template is an error)."""

    def __init__(self, templates: AgentTemplates, limits: AgentLimits) -> None:
        import jinja2

        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
        self._t = {name: env.from_string(getattr(templates, name)) for name in (
            "system_template", "instance_template", "action_observation_template", "format_error_template",
            "timeout_template")}
        self._base = {"sentinel": SUBMIT_SENTINEL, "max_output_chars": templates.max_output_chars,
                      "step_limit": limits.step_limit}

    def _render(self, name: str, **values: Any) -> str:
        import jinja2

        try:
            return self._t[name].render(**self._base, **values)
        except jinja2.UndefinedError as exc:
            raise ConfigError(f"agent.{name}: {exc}") from exc

    def system(self, **values: Any) -> str:
        return self._render("system_template", **values)

    def instance(self, task: str, workdir: str = "/testbed", **values: Any) -> str:
        return self._render("instance_template", task=task, workdir=workdir, **values)

    def observation(self, output: str, returncode: int) -> str:
        return self._render("action_observation_template", output={"output": output, "returncode": returncode})

    def format_error(self, actions: list[str]) -> str:
        return self._render("format_error_template", actions=actions)

    def timeout(self, action: str, output: str, timeout: float) -> str:
        return self._render("timeout_template", action=action, output=output, timeout=f"{timeout:g}")


_TEMPLATE_KEYS = set(AgentTemplates.__struct_fields__)
_LIMIT_KEYS = {"step_limit": "step_limit"}


def load_mini_swe_agent_config(path: Path) -> tuple[AgentTemplates, dict[str, Any]]:
    """Templates (and the limits it sets) from a mini-swe-agent YAML config; other keys are ignored, but an
    ``agent:`` section with none of the template keys is an error (probably not such a config)."""
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read the agent config: {exc}") from exc
    section = (doc or {}).get("agent", doc) if isinstance(doc, dict) else None
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: expected a mapping with an `agent:` section")
    found = {k: v for k, v in section.items() if k in _TEMPLATE_KEYS}
    if not found:
        raise ConfigError(f"{path}: the agent section has none of {sorted(_TEMPLATE_KEYS)}")
    for key, value in found.items():
        if key != "max_output_chars" and not isinstance(value, str):
            raise ConfigError(f"{path}: agent.{key} must be a string")
    limits = {ours: section[theirs] for theirs, ours in _LIMIT_KEYS.items() if theirs in section}
    return msgspec.convert(found, AgentTemplates), limits
