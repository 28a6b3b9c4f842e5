"""The agent protocol (docs/architecture.md 6.1), mini-swe-agent's: each model turn holds a THOUGHT and exactly one bash
code block; each command runs statelessly in the sandbox; the observation goes back through a template;
the episode ends when a command's output starts with the submission sentinel, or a limit is hit.

Templates are Jinja (StrictUndefined) and load from a mini-swe-agent YAML config (`rollout.agent_config`), so
existing configs port over: 1.x keeps them in its ``agent:`` section (``system_template``, ``instance_template``,
``action_observation_template``, ``format_error_template``, ``timeout_template``, ``action_regex``), 2.x moves the
observation and format-error templates and the action regex to ``model:`` (``observation_template``,
``format_error_template``, ``action_regex``). Bundled configs (swectl/agent/configs/) go by name. This module is
pure: no I/O beyond reading a config file.
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
# mini-swe-agent 2.x's text-based models read ```mswea_bash_command blocks unless the config sets model.action_regex
MSWEA_ACTION_REGEX = r"```mswea_bash_command\s*\n(.*?)\n```"
BUNDLED_AGENT_CONFIGS = Path(__file__).parent / "configs"


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


def platform_vars() -> dict[str, str]:
    """What mini-swe-agent's templates may name about the machine (``{{ system }}``, ``{{ release }}``,
    ``{{ machine }}``...: its environments pass ``platform.uname()`` of the machine that runs the agent). The host
    name reads "sandbox", so a prompt stays the same from one controller machine to the next."""
    import platform

    return {**platform.uname()._asdict(), "node": "sandbox"}


class Renderer:
    """Renders the protocol's templates (Jinja, StrictUndefined: a typo in a template is an error)."""

    def __init__(self, templates: AgentTemplates, limits: AgentLimits) -> None:
        import jinja2

        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
        self._t = {name: env.from_string(getattr(templates, name)) for name in (
            "system_template", "instance_template", "action_observation_template", "format_error_template",
            "timeout_template")}
        self._base = {**platform_vars(), "sentinel": SUBMIT_SENTINEL, "max_output_chars": templates.max_output_chars,
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
        # exception_info: mini-swe-agent 2.x's observations name an exception of the tool; commands here have none
        return self._render("action_observation_template",
                            output={"output": output, "returncode": returncode, "exception_info": ""})

    def format_error(self, actions: list[str]) -> str:
        error = f"expected exactly one bash block, found {len(actions)}"  # mini-swe-agent 2.x's {{ error }}
        return self._render("format_error_template", actions=actions, error=error)

    def timeout(self, action: str, output: str, timeout: float) -> str:
        return self._render("timeout_template", action=action, output=output, timeout=f"{timeout:g}")


_TEMPLATE_KEYS = set(AgentTemplates.__struct_fields__)
_LIMIT_KEYS = {"step_limit": "step_limit"}
# mini-swe-agent 2.x's ``model:`` keys and ours
_MODEL_KEYS = {"observation_template": "action_observation_template", "format_error_template": "format_error_template",
               "action_regex": "action_regex"}


def load_mini_swe_agent_config(path: Path) -> tuple[AgentTemplates, dict[str, Any]]:
    """Templates (and the limits it sets) from a mini-swe-agent YAML config, 1.x or 2.x layout (module docstring);
    other keys are ignored, but a file with none of the template keys is an error (probably not such a config).

    A 2.x config without ``model.action_regex`` is read as its text-based models read it: ```mswea_bash_command
    blocks where its prompts show them, ```bash blocks where they show only those. One whose prompts ask for tool
    calls is for tool-calling models: swectl's agent reads one fenced block from the reply, so that is an error
    saying what to use instead."""
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read the agent config: {exc}") from exc
    section = (doc or {}).get("agent", doc) if isinstance(doc, dict) else None
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: expected a mapping with an `agent:` section")
    model = doc.get("model") if isinstance(doc.get("model"), dict) else {}
    found = {k: v for k, v in section.items() if k in _TEMPLATE_KEYS}
    found.update({ours: model[theirs] for theirs, ours in _MODEL_KEYS.items() if theirs in model and ours not in found})
    if not found:
        raise ConfigError(f"{path}: the agent section has none of {sorted(_TEMPLATE_KEYS)}")
    for key, value in found.items():
        if key != "max_output_chars" and not isinstance(value, str):
            raise ConfigError(f"{path}: agent.{key} must be a string")
    if "action_regex" not in found and any(k in model for k in _MODEL_KEYS):  # the 2.x layout
        prompts = found.get("system_template", "") + found.get("instance_template", "")
        if "```mswea_bash_command" in prompts:
            found["action_regex"] = MSWEA_ACTION_REGEX
        elif "tool call" in prompts.lower() or "```bash" not in prompts:
            raise ConfigError(f"{path}: a config for tool-calling models (its prompts ask for bash tool calls, not a "
                              "```mswea_bash_command block); swectl's agent reads one fenced command from each reply: "
                              "use a text-based config (mini-swe-agent's swebench_backticks.yaml, say) or set "
                              "model.action_regex and prompts that ask for that block")
    try:
        re.compile(found.get("action_regex", ACTION_REGEX))
    except re.error as exc:
        raise ConfigError(f"{path}: action_regex does not compile: {exc}") from exc
    limits = {ours: section[theirs] for theirs, ours in _LIMIT_KEYS.items() if theirs in section}
    return msgspec.convert(found, AgentTemplates), limits


def bundled_agent_configs() -> list[str]:
    """The names of the agent configs that ship with swectl (swectl/agent/configs/NAME.yaml)."""
    return sorted(p.stem for p in BUNDLED_AGENT_CONFIGS.glob("*.yaml"))


def agent_config_path(name: str) -> Path:
    """A bundled agent config by name (``compact``), else the path ``name``; ConfigError if neither exists."""
    bundled = BUNDLED_AGENT_CONFIGS / f"{name}.yaml"
    if name and "/" not in name and bundled.is_file():
        return bundled
    path = Path(name).expanduser()
    if not path.is_file():
        raise ConfigError(f"rollout.agent_config {name!r}: no such file, and no bundled config of that name "
                          f"(bundled: {', '.join(bundled_agent_configs())})")
    return path


def agent_templates(name: str) -> AgentTemplates:
    """The templates of ``rollout.agent_config``: "" is the built-in prompt (this module's templates)."""
    if not name:
        return AgentTemplates()
    templates, _ = load_mini_swe_agent_config(agent_config_path(name))
    return templates
