"""swectl.grading.eval_script: patch parsing, test directives, classic eval scripts for every SWE-bench Verified row,
and the exit-code recording transform (checked against swebench 5.x's own)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import msgspec
import pytest

from swectl.errors import SpecError
from swectl.grading import eval_script as es
from swectl.tasks.record import Task
from swectl.tasks.specs import SpecTable

ROOT = Path(__file__).resolve().parents[1]
FETCH = ROOT / "scripts" / "fetch_swebench_specs.sh"
VERIFIED_REPOS = {
    "astropy/astropy",
    "django/django",
    "matplotlib/matplotlib",
    "mwaskom/seaborn",
    "pallets/flask",
    "psf/requests",
    "pydata/xarray",
    "pylint-dev/pylint",
    "pytest-dev/pytest",
    "scikit-learn/scikit-learn",
    "sphinx-doc/sphinx",
    "sympy/sympy",
}
START = f": '{es.START_TEST_OUTPUT}'"
END = f": '{es.END_TEST_OUTPUT}'"
RECORD = "SWEBENCH_TEST_EXIT_CODE=$?"
ECHO = 'echo ">>>>> Test Exit Code: $SWEBENCH_TEST_EXIT_CODE"'
TASK_FIELDS = set(Task.__struct_fields__)


def _task(row: dict) -> Task:
    known = {k: v for k, v in row.items() if k in TASK_FIELDS}
    return Task(**known, extra={k: v for k, v in row.items() if k not in TASK_FIELDS})


def _small_task(**overrides: str) -> Task:
    fields = {
        "instance_id": "acme__widgets-1",
        "repo": "acme/widgets",
        "problem_statement": "",
        "FAIL_TO_PASS": ["t"],
        "base_commit": "abc123",
        "version": "1.0",
        "test_patch": PATCH_MIXED,
        **overrides,
    }
    return Task(**fields)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def verified(verified_path: Path) -> list[Task]:
    return [_task(json.loads(line)) for line in verified_path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def verified_scripts(verified: list[Task], specs: SpecTable) -> dict[str, tuple[Task, str]]:
    return {t.instance_id: (t, es.build_classic_eval_script(t, specs.get(t.repo, t.version))) for t in verified}


# --- patches and directives --------------------------------------------------------------------------------

PATCH_MIXED = """\
diff --git a/pkg/tests/test_mod.py b/pkg/tests/test_mod.py
--- a/pkg/tests/test_mod.py
+++ b/pkg/tests/test_mod.py
@@ -1,2 +1,3 @@
 import x
+--- a/not/a/header.py
 y = 1
diff --git a/pkg/tests/test_new.py b/pkg/tests/test_new.py
new file mode 100644
--- /dev/null
+++ b/pkg/tests/test_new.py
@@ -0,0 +1 @@
+def test_new(): pass
diff --git a/pkg/tests/data/expected.json b/pkg/tests/data/expected.json
--- a/pkg/tests/data/expected.json
+++ b/pkg/tests/data/expected.json
@@ -1 +1 @@
-{}
+{"a": 1}
diff --git a/pkg/tests/test_gone.py b/pkg/tests/test_gone.py
deleted file mode 100644
--- a/pkg/tests/test_gone.py
+++ /dev/null
@@ -1 +0,0 @@
-def test_gone(): pass
diff --git a/pkg/tests/old_name.py b/pkg/tests/new_name.py
similarity index 90%
rename from pkg/tests/old_name.py
rename to pkg/tests/new_name.py
diff --git a/pkg/tests/img.png b/pkg/tests/img.png
new file mode 100644
index 0000000..1111111
Binary files /dev/null and b/pkg/tests/img.png differ
diff --git a/pkg/tests/with space.py b/pkg/tests/with space.py
--- a/pkg/tests/with space.py\t
+++ b/pkg/tests/with space.py\t
@@ -1 +1 @@
-a
+b
"""


def test_test_files_of_lists_files_that_exist_before_the_patch() -> None:
    assert es.test_files_of(PATCH_MIXED) == [
        "pkg/tests/test_mod.py",
        "pkg/tests/data/expected.json",
        "pkg/tests/test_gone.py",
        "pkg/tests/old_name.py",
        "pkg/tests/with space.py",
    ]
    assert es.test_files_of("") == []


def test_touched_files_include_created_files_and_both_rename_sides() -> None:
    assert es.touched_files(PATCH_MIXED) == [
        "pkg/tests/test_mod.py",
        "pkg/tests/test_new.py",
        "pkg/tests/data/expected.json",
        "pkg/tests/test_gone.py",
        "pkg/tests/old_name.py",
        "pkg/tests/new_name.py",
        "pkg/tests/img.png",
        "pkg/tests/with space.py",
    ]


def test_directives_drop_data_files_and_keep_paths() -> None:
    assert es.test_directives(_small_task()) == [
        "pkg/tests/test_mod.py",
        "pkg/tests/test_new.py",
        "pkg/tests/test_gone.py",
        "pkg/tests/new_name.py",
        "pkg/tests/with space.py",
    ]


def test_django_directives_are_dotted_modules() -> None:
    patch = (
        "diff --git a/tests/model_fields/test_jsonfield.py b/tests/model_fields/test_jsonfield.py\n"
        "--- a/tests/model_fields/test_jsonfield.py\n+++ b/tests/model_fields/test_jsonfield.py\n@@ -1 +1 @@\n-a\n+b\n"
        "diff --git a/tests/fixtures/data.json b/tests/fixtures/data.json\n"
        "--- a/tests/fixtures/data.json\n+++ b/tests/fixtures/data.json\n@@ -1 +1 @@\n-a\n+b\n"
        "diff --git a/tests/i18n/sampleproject/templates/a.html b/tests/i18n/sampleproject/templates/a.html\n"
        "--- a/tests/i18n/sampleproject/templates/a.html\n+++ b/tests/i18n/sampleproject/templates/a.html\n"
    )
    task = _small_task(repo="django/django", test_patch=patch)
    assert es.test_directives(task) == ["model_fields.test_jsonfield", "i18n.sampleproject.templates.a.html"]


def test_heredoc_delimiter_avoids_the_text() -> None:
    assert es.heredoc_delimiter("plain") == es.HEREDOC_BASE
    clash = f"+{es.HEREDOC_BASE}\n+{es.HEREDOC_BASE}_1\n"
    assert es.heredoc_delimiter(clash) == f"{es.HEREDOC_BASE}_2"


# --- classic scripts for every Verified row ---------------------------------------------------------------


def test_verified_covers_every_repo(verified: list[Task]) -> None:
    assert {t.repo for t in verified} == VERIFIED_REPOS


def _check_layout(task: Task, script: str) -> None:
    lines = script.split("\n")
    assert lines[:5] == ["#!/bin/bash", "set -uxo pipefail", es.CONDA_ACTIVATE, "conda activate testbed", "cd /testbed"]
    assert script.endswith("\n")
    start, end = lines.index(START), lines.index(END)
    assert lines.count(START) == 1
    assert lines.count(END) == 1
    assert start < end
    assert end == start + 2  # exactly the test command between the markers
    assert lines[start + 1].startswith(("pytest ", "./tests/runtests.py ", "tox ", "PYTHONWARNINGS=", "bin/test "))
    assert f"git -c core.fileMode=false diff {task.base_commit}" in lines[:start]
    delimiter = es.heredoc_delimiter(task.test_patch)
    assert f"git apply -v - <<'{delimiter}'\n{task.test_patch}\n{delimiter}\n{START}\n" in script
    files = es.test_files_of(task.test_patch)
    if files:
        reset = f"git checkout {task.base_commit} " + " ".join(files)
        assert lines.index(reset) < lines.index(f"git apply -v - <<'{delimiter}'")
        assert lines[end + 1] == reset
        assert lines[end + 2] == ""
    assert RECORD not in script
    assert "Test Exit Code" not in script


def test_every_verified_script_has_the_official_layout(verified_scripts: dict[str, tuple[Task, str]]) -> None:
    for task, script in verified_scripts.values():
        _check_layout(task, script)


def test_install_and_eval_commands_come_from_the_spec(verified_scripts: dict, specs: SpecTable) -> None:
    task, script = verified_scripts["django__django-11099"]
    spec = specs.get(task.repo, task.version)
    lines = script.split("\n")
    assert lines[5 : 5 + len(spec.eval_commands)] == spec.eval_commands
    assert lines.index(spec.install) < lines.index(START)


def test_django_scripts_run_dotted_modules(verified_scripts: dict[str, tuple[Task, str]]) -> None:
    django = [(t, s) for t, s in verified_scripts.values() if t.repo == "django/django"]
    assert django
    for task, script in django:
        command = script.split("\n")[script.split("\n").index(START) + 1]
        directives = es.test_directives(task)
        # django-10097 only touches .txt fixtures: like the official harness, the whole suite runs.
        assert directives or task.instance_id == "django__django-10097"
        assert command.endswith(" ".join(directives))
        assert all("/" not in d for d in directives), task.instance_id
        assert not any(d.endswith(".py") for d in directives), task.instance_id


def test_sympy_and_pytest_style_scripts_run_paths(verified_scripts: dict[str, tuple[Task, str]]) -> None:
    _, script = verified_scripts["sympy__sympy-20590"]
    assert "bin/test -C --verbose sympy/core/tests/test_basic.py\n" in script
    _, script = verified_scripts["sphinx-doc__sphinx-8595"]
    assert "tox --current-env -epy39 -v -- tests/roots/test-ext-autodoc/target/empty_all.py " in script
    assert "git checkout b19bce971e82f2497d67fdacdeca8db08ae0ba56 \n" not in script  # only new files: no reset


def test_every_verified_script_is_valid_bash(verified_scripts: dict[str, tuple[Task, str]]) -> None:
    for task, script in verified_scripts.values():
        for variant in (script, es.with_exit_code(script)):
            done = subprocess.run(["bash", "-n"], input=variant, capture_output=True, text=True, check=False)
            assert done.returncode == 0, (task.instance_id, done.stderr)


# --- exit code ------------------------------------------------------------------------------------------


def test_exit_code_lines_once_ours_and_swebench5(verified_scripts: dict[str, tuple[Task, str]]) -> None:
    from swebench.harness.utils import parse_eval_script, record_test_exit_code

    for task, script in verified_scripts.values():
        ours = es.with_exit_code(script)
        theirs = "\n".join(["#!/bin/bash", "set -uxo pipefail", *record_test_exit_code(parse_eval_script(script))])
        assert ours.rstrip("\n") == theirs, task.instance_id
        assert es.with_exit_code(ours) == ours
        lines = ours.split("\n")
        end = lines.index(END)
        assert lines.count(RECORD) == 1
        assert lines.count(ECHO) == 1
        assert lines[end - 1] == RECORD
        assert lines[end + 1] == ECHO
        assert lines[end - 3] == START  # the test command's status, nothing in between


def test_exit_code_is_recorded_and_read_by_swebench5_grading() -> None:
    from swebench.harness.grading import parse_test_exit_code

    script = f"#!/bin/bash\nset -uxo pipefail\n{START}\n(exit 3)\n{END}\ntrue\n"
    done = subprocess.run(["bash", "-c", es.with_exit_code(script)], capture_output=True, text=True, check=False)
    assert done.returncode == 0
    assert parse_test_exit_code(done.stdout) == 3


def test_exit_code_ignores_markers_inside_heredocs() -> None:
    body = f"+{es.END_TEST_OUTPUT}\n+{es.END_TEST_OUTPUT}"
    script = f"#!/bin/bash\ncat <<'EOF_X' >/tmp/p\n{es.END_TEST_OUTPUT}\nEOF_X\n{START}\npytest\n{END}\n"
    out = es.with_exit_code(script + body).split("\n")
    assert out.index(RECORD) == out.index(END) - 1 == 6
    tabbed = f"cat <<-EOF\n\t{es.END_TEST_OUTPUT}\n\tEOF\n{END}\n"
    assert es.with_exit_code(tabbed).split("\n")[3:6] == [RECORD, END, ECHO]


def test_exit_code_with_echo_markers() -> None:
    script = (
        "#!/bin/bash\necho '>>>>> Start Test Output'\npytest\necho '>>>>> End Test Output'\ngit checkout -q HEAD -- t\n"
    )
    lines = es.with_exit_code(script).split("\n")
    assert lines[3:6] == [RECORD, "echo '>>>>> End Test Output'", ECHO]


def test_exit_code_leaves_scripts_without_end_marker() -> None:
    script = "#!/bin/bash\npytest\n"
    assert es.with_exit_code(script) == script


# --- eval_script_for / log_parser_for ---------------------------------------------------------------------


def test_row_script_wins_and_classic_is_built_otherwise(verified: list[Task], specs: SpecTable) -> None:
    task = verified[0]
    own = msgspec.structs.replace(task, eval_script="#!/bin/bash\necho own\n")
    assert es.eval_script_for(own, specs) == "#!/bin/bash\necho own\n"
    assert es.eval_script_for(task, specs) == es.build_classic_eval_script(task, specs.get(task.repo, task.version))
    assert es.eval_script_for(task, None) == es.eval_script_for(task, specs)  # loads the default table


def test_classic_without_what_it_needs_is_a_clear_error(specs: SpecTable) -> None:
    with pytest.raises(SpecError, match="no eval_script and no test_patch"):
        es.eval_script_for(_small_task(test_patch=""), specs)
    with pytest.raises(SpecError, match="no SWE-bench spec for repo 'acme/widgets'"):
        es.eval_script_for(_small_task(), specs)
    with pytest.raises(SpecError, match="without base_commit"):
        es.eval_script_for(_small_task(repo="django/django", version="3.0", base_commit=""), specs)


def test_log_parser_for() -> None:
    assert es.log_parser_for(_small_task(repo="django/django")) == "parse_log_django"
    assert es.log_parser_for(_small_task(log_parser="parse_log_gotest")) == "parse_log_gotest"
    with pytest.raises(SpecError):
        es.log_parser_for(_small_task())


def test_file_sections_keep_the_patch_text_exactly(verified: list[Task]) -> None:
    for task in verified:
        for patch in (task.patch, task.test_patch, task.patch.replace("\n", "\r\n")):
            sections = es.file_diffs("preamble\n" + patch)
            assert "".join(s.text for s in sections) == patch
            assert all(not s.path.endswith("\r") for s in sections)
