"""remote/programs/func_coverage.py: run as the task factory runs it (a standalone script, its own process) on a tiny
project, and check which functions each test is reported to have called."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from swectl.remote.programs import func_coverage
from swectl.synth.mutate import find_functions

SCRIPT = Path(func_coverage.__file__)

MODULE = textwrap.dedent(
    """
    import functools
    import threading


    def add(a, b):
        return a + b


    def unused():
        return 0


    def square(x):
        return helper_squares([x])[0]


    def helper_squares(values):
        return [v * v for v in values]


    class Box:
        @functools.lru_cache(maxsize=None)
        def size(self):
            def inner():
                return 4
            return inner()


    def in_thread():
        out = []
        worker = threading.Thread(target=lambda: out.append(from_thread()))
        worker.start()
        worker.join()
        return out[0]


    def from_thread():
        return 7
    """
)

TESTS = textwrap.dedent(
    """
    import pytest

    from pkg.mod import Box, add, in_thread, square
    from tests.helpers import check


    def test_add():
        assert check(add(1, 2), 3)


    def test_square_fails():
        assert square(3) == 10


    def test_box():
        assert Box().size() == 4


    def test_thread():
        assert in_thread() == 7


    @pytest.mark.xfail
    def test_expected_failure():
        assert add(1, 1) == 3


    @pytest.fixture
    def broken():
        add(0, 0)
        raise RuntimeError("fixture exploded")


    def test_fixture_error(broken):
        pass


    def test_nothing():
        pass
    """
)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text(MODULE)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tmp_path / "tests" / "helpers.py").write_text("def check(a, b):\n    return a == b\n")
    (tmp_path / "tests" / "conftest.py").write_text("def conftest_helper():\n    return 1\n")
    (tmp_path / "tests" / "test_mod.py").write_text(TESTS)
    return tmp_path


def _run(root: Path, *pytest_args: str, python: tuple[str, ...] = (sys.executable,)) -> subprocess.CompletedProcess:
    out = root / "cov.json"
    cmd = [*python, str(SCRIPT), "--root", str(root), "--out", str(out), "--", *pytest_args]
    return subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)


def test_functions_per_test(project: Path) -> None:
    done = _run(project, "-q", "-p", "no:cacheprovider", "tests")
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads((project / "cov.json").read_text())
    assert report["exit_code"] == 1
    assert report["collect_errors"] == []
    tests = report["tests"]
    p = "tests/test_mod.py::"

    def functions(name: str) -> list[list[object]]:
        return tests[p + name]["functions"]

    def entry(qualname: str, first_line: str) -> list[object]:
        return ["pkg/mod.py", qualname, MODULE.splitlines().index(first_line) + 1]

    assert functions("test_add") == [entry("add", "def add(a, b):")]
    # The list comprehension belongs to helper_squares, which is listed anyway.
    assert functions("test_square_fails") == [
        entry("helper_squares", "def helper_squares(values):"),
        entry("square", "def square(x):"),
    ]
    # Decorated method: first line is the decorator's (co_firstlineno); nested functions are named like co_qualname.
    assert functions("test_box") == [
        entry("Box.size", "    @functools.lru_cache(maxsize=None)"),
        entry("Box.size.<locals>.inner", "        def inner():"),
    ]
    # Calls made in another thread count for the test that started it.
    assert functions("test_thread") == [
        entry("from_thread", "def from_thread():"),
        entry("in_thread", "def in_thread():"),
    ]
    assert functions("test_expected_failure") == [entry("add", "def add(a, b):")]
    # Fixture code runs inside the test's protocol, so its calls count too.
    assert functions("test_fixture_error") == [entry("add", "def add(a, b):")]
    assert functions("test_nothing") == []
    outcomes = {nodeid.removeprefix(p): info["outcome"] for nodeid, info in tests.items()}
    assert outcomes == {
        "test_add": "passed",
        "test_square_fails": "failed",
        "test_box": "passed",
        "test_thread": "passed",
        "test_expected_failure": "xfailed",
        "test_fixture_error": "error",
        "test_nothing": "passed",
    }
    # Never reported: test files, helpers under tests/, conftest.py, the unused function.
    everything = {tuple(f) for info in tests.values() for f in info["functions"]}
    assert {f[0] for f in everything} == {"pkg/mod.py"}
    assert not any(f[1] == "unused" for f in everything)


def test_lines_match_the_module(project: Path) -> None:
    _run(project, "-q", "-p", "no:cacheprovider", "tests")
    lines = (project / "pkg" / "mod.py").read_text().splitlines()
    for info in json.loads((project / "cov.json").read_text())["tests"].values():
        for _, qualname, firstlineno in info["functions"]:
            name = qualname.rsplit(".", 1)[-1]
            assert lines[firstlineno - 1].lstrip().startswith(("@", f"def {name}("))


def test_collection_error_is_reported(project: Path) -> None:
    (project / "tests" / "test_broken.py").write_text("import not_a_module_anywhere\n")
    done = _run(project, "-q", "-p", "no:cacheprovider", "tests/test_broken.py")
    assert done.returncode == 2, done.stdout + done.stderr
    report = json.loads((project / "cov.json").read_text())
    assert report == {"exit_code": 2, "tests": {}, "collect_errors": ["tests/test_broken.py"]}


def test_without_pytest_exits_2(project: Path) -> None:
    # -S: no site-packages, so pytest cannot be imported.
    done = _run(project, "-q", "tests", python=(sys.executable, "-S"))
    assert done.returncode == 2
    assert "cannot import pytest" in done.stderr
    assert not (project / "cov.json").exists()


def test_ast_qualnames_match_co_qualname() -> None:
    source = MODULE + "\nclass Outer:\n    class Inner:\n        def m(self):\n            pass\n"
    namespace: dict[str, object] = {}
    exec(compile(source, "mod.py", "exec"), namespace)
    table = func_coverage.ast_qualnames(source)
    size = namespace["Box"].size.__wrapped__.__code__  # type: ignore[attr-defined]
    method = namespace["Outer"].Inner.m.__code__  # type: ignore[attr-defined]
    for code in (namespace["add"].__code__, size, method):  # type: ignore[attr-defined]
        assert table[code.co_firstlineno] == code.co_qualname


@pytest.mark.parametrize(
    ("path", "is_test"),
    [
        ("pkg/mod.py", False),
        ("pkg/test_mod.py", True),
        ("pkg/mod_test.py", True),
        ("conftest.py", True),
        ("tests/helpers.py", True),
        ("src/pkg/test/util.py", True),
        ("src/pkg/testing.py", False),
        ("src/pkg/contest.py", False),
    ],
)
def test_is_test_file(path: str, is_test: bool) -> None:
    assert func_coverage.is_test_file(path) is is_test


def test_reported_names_are_what_the_mutator_finds(project: Path) -> None:
    _run(project, "-q", "-p", "no:cacheprovider", "tests")
    known = {(info.qualname, info.first_line) for info in find_functions(MODULE)}
    reported = {
        (f[1], f[2])
        for info in json.loads((project / "cov.json").read_text())["tests"].values()
        for f in info["functions"]
    }
    assert len(reported) == 7
    assert reported <= known
