"""swectl.synth.statement: failing tests parsed from REAL pytest logs (written by running pytest on small
test files), and the issue-style problem statements written from them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from swectl.synth.statement import FailingTest, failures_from_pytest_log, leaks, write_problem_statement

TESTS = textwrap.dedent(
    """
    import pytest


    def add_one(x):
        return x + 1


    def explode(value):
        raise ValueError(f"bad value: {value!r}")


    def test_ok():
        assert add_one(1) == 2


    def test_compare():
        assert add_one(1) == 3


    def test_exception_deep():
        explode(42)


    @pytest.mark.parametrize("text", ["a b", "x[1] - y", "ok"])
    def test_param(text):
        assert text == "ok", "custom message"


    class TestGroup:
        def test_method(self):
            assert [1, 2, 3] == [1, 2, 4]

        class TestInner:
            def test_deep(self):
                pytest.fail("deep failure")


    @pytest.fixture
    def broken():
        raise RuntimeError("fixture exploded")


    def test_fixture_error(broken):
        pass


    def test_chained():
        try:
            {}["k"]
        except KeyError as exc:
            raise TypeError("converted") from exc


    def test_output():
        print("ERROR this captured line is not a summary line")
        assert 0, "long " + "x" * 600
    """
)


def _pytest_log(directory: Path, *extra: str) -> str:
    cmd = [sys.executable, "-m", "pytest", "-rA", "--tb=short", "-p", "no:cacheprovider", *extra, "tests"]
    done = subprocess.run(cmd, cwd=directory, capture_output=True, text=True, timeout=120)
    assert done.returncode in (1, 2), done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("proj")
    (root / "tests").mkdir()
    (root / "tests" / "test_sample.py").write_text(TESTS)
    return root


@pytest.fixture(scope="module")
def log(project: Path) -> str:
    return _pytest_log(project)


def _by_id(failures: list[FailingTest]) -> dict[str, str]:
    return {f.test_id: f.message for f in failures}


def test_ids_of_failures_and_errors(log: str) -> None:
    ids = [f.test_id for f in failures_from_pytest_log(log)]
    p = "tests/test_sample.py::"
    assert sorted(ids) == sorted(
        p + name
        for name in [
            "test_compare",
            "test_exception_deep",
            "test_param[a b]",
            "test_param[x[1] - y]",
            "TestGroup::test_method",
            "TestGroup::TestInner::test_deep",
            "test_fixture_error",
            "test_chained",
            "test_output",
        ]
    )


def test_messages_come_from_the_e_lines(log: str) -> None:
    messages = _by_id(failures_from_pytest_log(log))
    p = "tests/test_sample.py::"
    assert messages[p + "test_compare"] == "assert 2 == 3\n +  where 2 = add_one(1)"
    assert messages[p + "test_exception_deep"] == "ValueError: bad value: 42"
    assert messages[p + "test_param[x[1] - y]"].startswith("AssertionError: custom message\nassert 'x[1] - y' == 'ok'")
    assert messages[p + "test_param[a b]"].startswith("AssertionError: custom message\nassert 'a b' == 'ok'")
    assert messages[p + "TestGroup::test_method"].startswith("assert [1, 2, 3] == [1, 2, 4]")
    assert messages[p + "TestGroup::TestInner::test_deep"] == "Failed: deep failure"
    assert messages[p + "test_fixture_error"] == "RuntimeError: fixture exploded"
    # A chained exception: the last one is what the test died of.
    assert messages[p + "test_chained"] == "TypeError: converted"
    long = messages[p + "test_output"]
    assert long.startswith("AssertionError: long xxx")
    assert long.endswith("...")
    assert len(long) <= 400


def test_colored_log_parses_the_same(project: Path, log: str) -> None:
    colored = _pytest_log(project, "--color=yes")
    assert "\x1b[" in colored
    assert failures_from_pytest_log(colored) == failures_from_pytest_log(log)


def test_collection_error_and_teardown_error(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_broken.py").write_text("import not_a_module_anywhere\n\ndef test_x():\n    pass\n")
    failures = failures_from_pytest_log(_pytest_log(tmp_path))
    assert failures == [
        FailingTest("tests/test_broken.py", "ModuleNotFoundError: No module named 'not_a_module_anywhere'")
    ]

    (tmp_path / "tests" / "test_broken.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.fixture
            def resource():
                yield 1
                raise OSError("teardown failed")

            def test_uses(resource):
                pass
            """
        )
    )
    assert failures_from_pytest_log(_pytest_log(tmp_path)) == [
        FailingTest("tests/test_broken.py::test_uses", "OSError: teardown failed")
    ]


def test_summary_message_is_the_fallback() -> None:
    log = textwrap.dedent(
        """
        =========================== short test summary info ============================
        FAILED tests/test_a.py::test_one - AssertionError: from the summary
        FAILED tests/test_a.py::test_two
        PASSED tests/test_a.py::test_three
        ========================= 2 failed, 1 passed in 0.01s =========================
        """
    )
    assert failures_from_pytest_log(log) == [
        FailingTest("tests/test_a.py::test_one", "AssertionError: from the summary"),
        FailingTest("tests/test_a.py::test_two", ""),
    ]
    assert failures_from_pytest_log("no pytest here\n") == []


# ---------------------------------------------------------------------------------------------- statements

FAILING = [
    FailingTest("tests/test_text.py::test_plural[box]", "assert 'boxs' == 'boxes'"),
    FailingTest("tests/test_text.py::TestCase::test_empty", "ValueError: empty word"),
    FailingTest("tests/test_text.py::test_no_message", ""),
    FailingTest("tests/test_text.py::test_fourth", "assert 1 == 2"),
]


def test_statement_reports_tests_command_messages_and_expectation() -> None:
    statement = write_problem_statement("inflect", FAILING, seed=0)
    lines = statement.splitlines()
    assert lines[0]
    assert not lines[0].startswith(" ")
    assert "inflect" in statement
    command = (
        "python -m pytest 'tests/test_text.py::test_plural[box]' tests/test_text.py::TestCase::test_empty "
        "tests/test_text.py::test_no_message"
    )
    assert command in statement
    assert "assert 'boxs' == 'boxes'" in statement
    assert "ValueError: empty word" in statement
    assert "test_fourth" not in statement
    assert "assert 1 == 2" not in statement
    assert "1 more test fails as well" in statement
    assert "pass" in lines[-1]


def test_statement_is_deterministic_and_varies_with_seed() -> None:
    assert write_problem_statement("inflect", FAILING, seed=5) == write_problem_statement("inflect", FAILING, seed=5)
    variants = {write_problem_statement("inflect", FAILING, seed=seed) for seed in range(12)}
    assert len(variants) >= 4
    titles = {v.splitlines()[0] for v in variants}
    assert len(titles) >= 2


def test_statement_max_tests_and_single_test() -> None:
    everything = write_problem_statement("inflect", FAILING, seed=1, max_tests=10)
    assert all(f.test_id in everything for f in FAILING)
    assert "more test" not in everything
    one = write_problem_statement("inflect", FAILING[:1], seed=1)
    assert "python -m pytest 'tests/test_text.py::test_plural[box]'\n" in one
    with pytest.raises(ValueError):
        write_problem_statement("inflect", [], seed=1)


def test_statement_never_mentions_mutations() -> None:
    for seed in range(10):
        statement = write_problem_statement("inflect", FAILING, seed=seed).lower()
        for word in ("mutat", "diff --git", "@@", "+++", "flip", "off_by_one", "remove_statement"):
            assert word not in statement


def test_leaks() -> None:
    statement = write_problem_statement("inflect", FAILING, seed=2)
    assert leaks(statement, ["    assert 'boxs' ==   'boxes'"])  # whitespace runs do not matter
    assert leaks("see: return word + 's' here", ["        return word + 's'"])
    assert not leaks(statement, ["return word + 'es'", "if n <= 1:"])
    # Lone keywords and punctuation would match any text: ignored.
    assert not leaks("a (b) else: c, return, or continue", [")", "else:", "    ", "", "return", "continue"])
    assert leaks("it fails at x[1:] today", ["x[1:]"])
