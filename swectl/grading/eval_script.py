"""Eval scripts: the bash script the grader runs in a task's sandbox after the agent's patch is in place.

Rows that carry their environment (SWE-bench 5.x, SWE-smith, the task factory) bring their own script. Classic
SWE-bench rows do not; for them :func:`build_classic_eval_script` writes the script SWE-bench's harness runs for
Python repos in its official images (conda env ``testbed``, repo at ``/testbed``): print the repo state, re-run
the install step, reset the test files, apply the test patch, run the test command between the start and end
markers, reset the test files again.

The test command's own exit status is recorded by :func:`with_exit_code`, which the grader applies to every
script (ours and the rows'), the way swebench 5.x's ``make_test_spec`` does; built scripts therefore do not
contain those lines themselves, so either transform inserts them exactly once.
"""

from __future__ import annotations

import re
import shlex

import msgspec

from swectl.errors import SpecError
from swectl.tasks.record import TESTBED, Task
from swectl.tasks.specs import RepoSpec, SpecTable, load_specs, log_parser_name

START_TEST_OUTPUT = ">>>>> Start Test Output"
END_TEST_OUTPUT = ">>>>> End Test Output"
TEST_EXIT_CODE = ">>>>> Test Exit Code"
TEST_EXIT_CODE_VAR = "SWEBENCH_TEST_EXIT_CODE"
CONDA_ENV = "testbed"
CONDA_ACTIVATE = "source /opt/miniconda3/bin/activate"
SCRIPT_HEADER = ("#!/bin/bash", "set -uxo pipefail")

# Paths ending in these are not handed to the test runner (data files, fixtures, configs). "csv" has no dot on
# purpose: SWE-bench's harness matches it as a plain suffix and we select the same tests.
NON_TEST_SUFFIXES = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml", ".toml")
DJANGO_RUNNER = "tests/runtests.py"
HEREDOC_BASE = "SWECTL_TEST_PATCH_EOF"

_RECORD_LINE = f"{TEST_EXIT_CODE_VAR}=$?"
_ECHO_LINE = f'echo "{TEST_EXIT_CODE}: ${TEST_EXIT_CODE_VAR}"'
_HEREDOC_START = re.compile(r"(?<!<)<<(?!<)(-?)\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\2")


class FileDiff(msgspec.Struct, frozen=True):
    """One file section of a git diff. ``old``/``new`` are None for a created/deleted file."""

    # The b/ side of the `diff --git` header: what SWE-bench's harness uses as a test directive.
    path: str
    old: str | None
    new: str | None
    text: str = ""  # the section exactly as in the patch (header to the next header), line endings kept


# --- patches --------------------------------------------------------------------------------------


def _strip_prefix(name: str, prefix: str) -> str | None:
    name = name.split("\t", 1)[0]  # git appends a tab to ---/+++ names that contain spaces
    if name == "/dev/null":
        return None
    return name[len(prefix) :] if name.startswith(prefix) else name


def _header_paths(header: str) -> tuple[str, str]:
    """a/ and b/ paths of ``diff --git a/X b/Y`` (X == Y unless renamed; the last " b/" splits otherwise)."""
    rest = header[len("diff --git ") :]
    half = (len(rest) - 1) // 2
    if rest.startswith("a/") and rest[half] == " " and rest[2:half] == rest[half + 3 :]:
        return rest[2:half], rest[half + 3 :]
    cut = rest.rfind(" b/")
    if cut < 0:
        return rest.removeprefix("a/"), rest.removeprefix("a/")
    return rest[:cut].removeprefix("a/"), rest[cut + 3 :]


def _parse_section(lines: list[str], text: str) -> FileDiff:
    old, new = _header_paths(lines[0])
    path: str = new
    created = deleted = False
    for line in lines[1:]:
        if line.startswith(("@@ ", "GIT binary patch", "Binary files ")):
            break
        if line.startswith("new file mode"):
            created = True
        elif line.startswith("deleted file mode"):
            deleted = True
        elif line.startswith("rename from "):
            old = line[len("rename from ") :]
        elif line.startswith("rename to "):
            new = line[len("rename to ") :]
        elif line.startswith("--- "):
            old = _strip_prefix(line[4:], "a/") or ""
            created = created or not old
        elif line.startswith("+++ "):
            new = _strip_prefix(line[4:], "b/") or ""
            deleted = deleted or not new
    return FileDiff(path=path, old=None if created else old, new=None if deleted else new, text=text)


def file_diffs(patch: str) -> list[FileDiff]:
    """The file sections of a git diff, in order; text before the first header belongs to none. Hunk lines never
    start with "diff --git" (they have a prefix). Lines end at "\n"; the "\r" of CRLF patches is not part of
    the parsed names, but stays in ``text``: the sections' texts joined give the patch from its first header."""
    sections: list[list[str]] = []
    for line in patch.split("\n"):
        if line.startswith("diff --git "):
            sections.append([line])
        elif sections:
            sections[-1].append(line)
    out = []
    for i, section in enumerate(sections):
        text = "\n".join(section) + ("" if i == len(sections) - 1 else "\n")
        out.append(_parse_section([line.removesuffix("\r") for line in section], text))
    return out


def test_files_of(test_patch: str) -> list[str]:
    """Files the test patch changes that exist before it: what the eval script resets with `git checkout <base>`
    (files it creates are left out, as SWE-bench's harness does: checking them out would fail)."""
    return list(dict.fromkeys(d.old for d in file_diffs(test_patch) if d.old is not None))


def touched_files(patch: str) -> list[str]:
    """Every path a patch reads or writes: old and new sides, created and deleted files included."""
    paths = (p for d in file_diffs(patch) for p in (d.old, d.new) if p is not None)
    return list(dict.fromkeys(paths))


def _is_django_runner(task: Task, spec: RepoSpec | None) -> bool:
    return task.repo == "django/django" or (spec is not None and DJANGO_RUNNER in spec.test_cmd)


def django_module(path: str) -> str:
    return path.removesuffix(".py").removeprefix("tests/").replace("/", ".")


def test_directives(task: Task, spec: RepoSpec | None = None) -> list[str]:
    """Arguments for the test command: the test patch's files minus data files; dotted modules for django."""
    paths = [d.path for d in file_diffs(task.test_patch) if not d.path.endswith(NON_TEST_SUFFIXES)]
    if _is_django_runner(task, spec):
        return [django_module(p) for p in paths]
    return paths


# --- the classic script ---------------------------------------------------------------------------------


def heredoc_delimiter(text: str, base: str = HEREDOC_BASE) -> str:
    """A heredoc delimiter that does not occur anywhere in ``text``."""
    delimiter, n = base, 0
    while delimiter in text:
        n += 1
        delimiter = f"{base}_{n}"
    return delimiter


def _reset_tests(base_commit: str, files: list[str]) -> list[str]:
    if not files:
        return []  # `git checkout <commit>` without paths would move HEAD
    return [f"git checkout {base_commit} {' '.join(shlex.quote(f) for f in files)}"]


def _apply_test_patch(test_patch: str) -> str:
    delimiter = heredoc_delimiter(test_patch)
    return f"git apply -v - <<'{delimiter}'\n{test_patch}\n{delimiter}"


def _test_command(task: Task, spec: RepoSpec) -> str:
    if not spec.test_cmd:
        raise SpecError(f"{task.instance_id}: the spec of {spec.repo} {spec.version} has no test_cmd")
    return " ".join([spec.test_cmd, *(shlex.quote(d) for d in test_directives(task, spec))])


def _require_classic_fields(task: Task) -> None:
    missing = [name for name in ("base_commit", "test_patch") if not getattr(task, name)]
    if missing:
        raise SpecError(f"{task.instance_id}: cannot build a classic eval script without {', '.join(missing)}")


def build_classic_eval_script(task: Task, spec: RepoSpec) -> str:
    """SWE-bench's eval script for a classic Python-repo row, as run in its official images."""
    _require_classic_fields(task)
    reset = _reset_tests(task.base_commit, test_files_of(task.test_patch))
    activate = [CONDA_ACTIVATE, f"conda activate {CONDA_ENV}"]
    lines = [
        *SCRIPT_HEADER,
        *activate,
        f"cd {TESTBED}",
        *spec.eval_commands,
        f"git config --global --add safe.directory {TESTBED}",
        f"cd {TESTBED}",
        "git status",
        "git show",
        f"git -c core.fileMode=false diff {task.base_commit}",
        *activate,
        *([spec.install] if spec.install else []),
        *reset,
        _apply_test_patch(task.test_patch),
        f": '{START_TEST_OUTPUT}'",
        _test_command(task, spec),
        f": '{END_TEST_OUTPUT}'",
        *reset,
    ]
    return "\n".join(lines) + "\n"


def eval_script_for(task: Task, specs: SpecTable | None = None) -> str:
    """The row's own eval script if it has one, else the classic build (specs loaded on demand when None)."""
    if task.eval_script:
        return task.eval_script
    if not (task.test_patch and task.version):
        raise SpecError(
            f"{task.instance_id}: the row has no eval_script and no test_patch/version to build the classic one from"
        )
    table = specs if specs is not None else load_specs()
    return build_classic_eval_script(task, table.get(task.repo, task.version))


def log_parser_for(task: Task) -> str:
    """The swebench 5.x PARSER_REGISTRY key for the task's test log."""
    return task.log_parser or log_parser_name(task.repo)


# --- exit code ------------------------------------------------------------------------------------------


def command_lines(lines: list[str]) -> list[bool]:
    """For each line: True when it is a shell line, False when it is the body (or end) of a heredoc."""
    out: list[bool] = []
    pending: list[tuple[str, bool]] = []  # heredocs opened on the current command line, in order
    for line in lines:
        if pending:
            delimiter, strip_tabs = pending[0]
            out.append(False)
            if (line.lstrip("\t") if strip_tabs else line) == delimiter:
                pending.pop(0)
            continue
        out.append(True)
        pending = [(m.group(3), m.group(1) == "-") for m in _HEREDOC_START.finditer(line)]
    return out


def marker_index(lines: list[str], marker: str) -> int | None:
    """The index of the first shell line (not a heredoc's body) that holds ``marker``; None when none does."""
    for i, (line, is_command) in enumerate(zip(lines, command_lines(lines), strict=True)):
        if is_command and marker in line:
            return i
    return None


def _already_recorded(lines: list[str], end: int) -> bool:
    return end > 0 and lines[end - 1] == _RECORD_LINE and _ECHO_LINE in lines[end + 1 : end + 2]


def with_exit_code(script: str) -> str:
    """Record the test command's exit status: ``SWEBENCH_TEST_EXIT_CODE=$?`` just before the end marker and
    ``echo ">>>>> Test Exit Code: N"`` just after it (outside the parsed region). Idempotent; a script without an
    end marker is returned unchanged (grading then trusts the log alone)."""
    lines = script.split("\n")
    end = marker_index(lines, END_TEST_OUTPUT)
    if end is None or _already_recorded(lines, end):
        return script
    return "\n".join([*lines[:end], _RECORD_LINE, lines[end], _ECHO_LINE, *lines[end + 1 :]])
