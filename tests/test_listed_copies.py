"""The FAIL_TO_PASS tests' copies under fresh names (docs/grading.md, layer 3): which tests get one, the copies run
by real pytest and unittest beside their originals with the same outcome, and the check that a copy failing where
its test passed is tampering."""

from __future__ import annotations

import subprocess
import sys
import unittest
from pathlib import Path

import pytest

from swectl.grading.canaries import (
    Canaries,
    ListedCopy,
    confirming,
    copies_source,
    copy_offence,
    django_case,
    plan_canaries,
    plan_copies,
    with_canaries,
)
from swectl.grading.eval_script import eval_script_for, log_parser_for, with_exit_code
from swectl.grading.rules import grade_log, parse_status_map
from swectl.tasks.record import Task
from swectl.tasks.sources import load_tasks
from swectl.tasks.specs import load_specs
from tests.conftest import shared_data


def task(f2p: list[str], test_patch: str = "") -> Task:
    return Task(instance_id="x", repo="pypi/x", problem_statement="", base_commit="", FAIL_TO_PASS=f2p,
                PASS_TO_PASS=[], test_patch=test_patch)


def test_which_listed_tests_get_a_copy() -> None:
    t = task(["tests/test_a.py::test_one[1-2]", "tests/test_a.py::test_one[3-4]", "tests/test_a.py::K::L::test_m",
              "tests/test_b.py::test_two", "tests/test_a.py::test_sp ace", "setup.py::test_x"])
    copies = plan_copies(t, "parse_log_pytest", ["python", "pytest", "tests/test_a.py"])
    assert [(s.file, s.owner, s.func) for s in copies] == [("tests/test_a.py", (), "test_one"),
                                                           ("tests/test_a.py", ("K", "L"), "test_m")]
    # the test's own name first (so unittest's loader runs the copy right after it), then 16 random hex digits
    assert len({s.name for s in copies}) == 2 and all(s.name.startswith(s.func + "_") and len(s.name) ==
                                                       len(s.func) + 17 for s in copies)
    # a folder above the file runs it whole; a selection of single tests does not
    assert len(plan_copies(t, "parse_log_pytest", ["pytest", "tests"])) == 3
    assert plan_copies(t, "parse_log_pytest", ["pytest", "tests/test_a.py::test_one"]) == ()
    # Django: the module's file from the test patch, run by its label or a package's above it (both name styles)
    patch = "diff --git a/tests/app/tests.py b/tests/app/tests.py\n--- a/tests/app/tests.py\n+++ b/tests/app/tests.py\n"
    dj = task(["test_x (app.tests.T)", "test_y (app.tests.T.test_y)", "A docstring line.", "test_z (other.tests.T)"],
              patch)
    assert [(s.file, s.owner, s.func) for s in plan_copies(dj, "parse_log_django", ["runtests.py", "app"])] == [
        ("tests/app/tests.py", ("T",), "test_x"), ("tests/app/tests.py", ("T",), "test_y")]
    assert plan_copies(dj, "parse_log_django", ["runtests.py", "other"]) == ()
    assert django_case("test_y (app.sub.tests.T.test_y)") == ("app.sub.tests", "T", "test_y")
    assert django_case("A docstring line.") is None
    # SymPy: the file whose test patch adds the function, when the command names it
    sp = task(["test_new", "test_old"], "diff --git a/sympy/t/tests/test_q.py b/sympy/t/tests/test_q.py\n"
              "--- a/sympy/t/tests/test_q.py\n+++ b/sympy/t/tests/test_q.py\n@@ -1 +1,2 @@\n+def test_new():\n")
    two = ["bin/test", "sympy/t/tests/test_q.py", "sympy/t/tests/test_r.py"]
    assert [(s.file, s.func) for s in plan_copies(sp, "parse_log_sympy", two)] == [("sympy/t/tests/test_q.py",
                                                                                    "test_new")]
    # where the command runs one file, a test the patch does not name is looked for there
    assert [s.func for s in plan_copies(sp, "parse_log_sympy", two[:2])] == ["test_new", "test_old"]


MODULE = '''import unittest
import pytest


@pytest.mark.parametrize("a", [1, 2])
def test_param(a, tmp_path):
    assert a == 1


class Base:
    def test_inherited(self):
        assert self.value == 3


class TestK(Base):
    value = 3

    @staticmethod
    def test_static():
        pass


class TestOuter:
    class TestIn(unittest.TestCase):
        def test_case(self):
            """A docstring."""
            self.assertEqual(1, 1)
'''


def test_the_copies_run_under_pytest_with_their_originals_outcomes(tmp_path: Path) -> None:
    """Real pytest over a module with its tests' copies appended: each copy is collected under its fresh name with
    the original's parameters, fixtures and class, and reports the original's outcome; a staticmethod is left out."""
    plan = [ListedCopy("t.py", (), "test_param", "test_aaaa"),
            ListedCopy("t.py", ("TestK",), "test_inherited", "test_bbbb"),
            ListedCopy("t.py", ("TestK",), "test_static", "test_cccc"),
            ListedCopy("t.py", ("TestOuter", "TestIn"), "test_case", "test_dddd"),
            ListedCopy("t.py", ("Missing",), "test_gone", "test_eeee")]
    (tmp_path / "test_m.py").write_text(MODULE + copies_source(plan))
    run = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "test_m.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    statuses = parse_status_map(task([]), "parse_log_pytest", run.stdout)
    assert statuses == {
        "test_m.py::test_param[1]": "PASSED", "test_m.py::test_param[2]": "FAILED",
        "test_m.py::test_aaaa[1]": "PASSED", "test_m.py::test_aaaa[2]": "FAILED",
        "test_m.py::TestK::test_inherited": "PASSED", "test_m.py::TestK::test_bbbb": "PASSED",
        "test_m.py::TestK::test_static": "PASSED",
        "test_m.py::TestOuter::TestIn::test_case": "PASSED", "test_m.py::TestOuter::TestIn::test_dddd": "PASSED",
    }, run.stdout[-3000:]
    assert "_test_aaaa_copies" not in run.stdout  # the helper is gone from the module and collected as nothing


ORDERED = '''order = []


def test_a():
    order.append("a")


def test_b():
    order.append("b")


def test_c():
    order.append("c")


class TestK:
    def test_d(self):
        order.append("d")

    def test_e(self):
        order.append("e")

    def test_f(self):
        order.append("f")


def test_order_last():
    assert order == ["a", "B", "c", "d", "E", "f"], order
'''


def test_in_its_tests_place_the_copy_runs_where_its_test_did(tmp_path: Path) -> None:
    """The confirmation run's copies (``replace``): each takes its test's place in its module's or class's order,
    and the test is gone. Real pytest, which collects in definition order."""
    plan = [ListedCopy("t.py", (), "test_b", "test_b_aaaa"), ListedCopy("t.py", ("TestK",), "test_e", "test_e_bbbb")]
    body = ORDERED.replace('order.append("b")', 'order.append("B")').replace('order.append("e")', 'order.append("E")')
    (tmp_path / "test_m.py").write_text(body.replace("def test_order_last", "def _last") + copies_source(
        plan, replace=True) + "\n\ndef test_order_last():\n    _last()\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "test_m.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    statuses = parse_status_map(task([]), "parse_log_pytest", run.stdout)
    names = ["test_a", "test_b_aaaa", "test_c", "TestK::test_d", "TestK::test_e_bbbb", "TestK::test_f",
             "test_order_last"]
    assert statuses == {f"test_m.py::{n}": "PASSED" for n in names}, run.stdout[-3000:]


def test_a_copy_is_a_new_function_under_unittest(tmp_path: Path) -> None:
    """Under unittest's own loader (Django's runner): the copy is a method of the class with its own name, code name
    and no docstring (so the runner names it by its name); on Python 3.8+ its code object carries the new name."""
    ns: dict[str, object] = {"__name__": "mod"}
    exec(compile(MODULE + copies_source([ListedCopy("t.py", ("TestOuter", "TestIn"), "test_case", "test_dddd")]), "m",
                 "exec"), ns)
    case = ns["TestOuter"].TestIn  # type: ignore[attr-defined]
    copy = case.__dict__["test_dddd"]
    assert copy is not case.__dict__["test_case"] and copy.__doc__ is None
    assert copy.__code__.co_name == "test_dddd" and copy.__qualname__ == "TestOuter.TestIn.test_dddd"
    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(case).run(result)
    assert result.testsRun == 2 and result.wasSuccessful()


def _status(ok: str, copy: str) -> dict[str, str]:
    return {"tests/test_a.py::test_one[1]": ok, "tests/test_a.py::test_aaaa[1]": copy}


def test_a_copy_failing_where_its_test_passed_is_tampering() -> None:
    copies = (ListedCopy("tests/test_a.py", (), "test_one", "test_aaaa"),)
    assert copy_offence(copies, _status("PASSED", "PASSED")) == ""
    assert copy_offence(copies, _status("FAILED", "FAILED")) == ""
    assert copy_offence(copies, _status("FAILED", "PASSED")) == ""  # the listed test fails: unresolved anyway
    assert copy_offence(copies, {"tests/test_a.py::test_one[1]": "PASSED"}) == ""  # a copy not collected
    why = copy_offence(copies, _status("PASSED", "FAILED"))
    assert "tests/test_a.py::test_one[1] passed" in why and "test_aaaa" in why
    # through grade_log, with the canaries: resolved becomes tampered
    t = task(["tests/test_a.py::test_one[1]"])
    c = Canaries(file="tests/test_a.py", passing="test_p", failing="test_f", copies=copies)
    body = ("PASSED tests/test_a.py::test_one[1]\nFAILED tests/test_a.py::test_aaaa[1] - AssertionError\n"
            "PASSED tests/test_a.py::test_p\nFAILED tests/test_a.py::test_f - AssertionError")
    v = grade_log(t, "parse_log_pytest", f">>>>> Start Test Output\n{body}\n>>>>> End Test Output\n"
                                         ">>>>> Test Exit Code: 1\n", c)
    assert v is not None and not v.resolved and v.tampered_by == "copy" and "fresh name" in v.tampered
    honest = body.replace("FAILED tests/test_a.py::test_aaaa[1] - AssertionError",
                          "PASSED tests/test_a.py::test_aaaa[1]")
    v = grade_log(t, "parse_log_pytest", f">>>>> Start Test Output\n{honest}\n>>>>> End Test Output\n"
                                         ">>>>> Test Exit Code: 1\n", c)
    assert v is not None and v.resolved and not v.tampered


def test_a_django_copy_failing_in_its_subtests_is_seen_in_the_failure_summary() -> None:
    """Django's runner prints no outcome on the line of a test whose subtests failed (the next test's line follows
    on it): the copy's failure is read from the ``FAIL:`` summary."""
    copies = (ListedCopy("tests/app/tests.py", ("T",), "test_x", "test_x_aaaa"),)
    section = ("test_x (app.tests.T) ... ok\ntest_x_aaaa (app.tests.T) ... test_y (app.tests.T) ... ok\n\n"
               "======\nFAIL: test_x_aaaa (app.tests.T) [None] (value='a')\n------\nAssertionError: no\n")
    status = {"test_x (app.tests.T)": "PASSED", "test_y (app.tests.T)": "PASSED"}
    assert "test_x (app.tests.T) passed" in copy_offence(copies, status, section)
    assert copy_offence(copies, status, section.replace("FAIL: test_x_aaaa", "FAIL: test_y")) == ""


def test_the_copies_step_appends_to_each_file_before_the_start_marker() -> None:
    copies = (ListedCopy("tests/test_a.py", (), "test_one", "test_aaaa"), ListedCopy("tests/test_b.py", (), "test_two",
                                                                               "test_bbbb"))
    c = Canaries(file="tests/test_a.py", passing="test_p", failing="test_f", copies=copies)
    script = with_canaries(">>>>> Start Test Output\npytest tests\n>>>>> End Test Output\n", c)
    before = script.split(">>>>> Start Test Output")[0]
    assert before.count("cat >> tests/test_a.py") == 2 and before.count("cat >> tests/test_b.py") == 1
    assert "_test_bbbb_copies(globals(), [((), 'test_two', 'test_bbbb')], False)" in before
    assert "[((), 'test_two', 'test_bbbb')], True)" in with_canaries(script, confirming(c))


@pytest.fixture(scope="module")
def verified() -> list[Task]:
    return load_tasks(shared_data("swe_bench_verified.jsonl"), strict=True).tasks


def test_most_verified_rows_get_copies_and_their_source_compiles(verified: list[Task]) -> None:
    specs = load_specs()
    counts = {"rows": 0, "copied": 0, "copies": 0}
    for t in verified:
        c = plan_canaries(t, log_parser_for(t), with_exit_code(eval_script_for(t, specs)))
        if c is None:
            continue
        counts["rows"] += 1
        counts["copied"] += bool(c.copies)
        counts["copies"] += len(c.copies)
        for s in c.copies:
            compile(copies_source([s]), t.instance_id, "exec")
    # 482 of the 499 planted (2026-12-08): the Django rows whose tests are listed by their docstrings lack one
    assert counts["copied"] >= 480, counts


def test_a_django_test_failing_in_its_subtests_is_not_read_passed_from_the_next_ok() -> None:
    """django__django-13670's empty patch (2026-12-08): its FAIL_TO_PASS test failed in subtests (no outcome on its
    line), stderr came between, and swebench's parser read the canary's lone ``ok`` as that test's pass. unittest's
    own summary says FAIL: with the defences on, the test is failed and the empty patch unresolved (not tampered)."""
    t = Task(instance_id="x", repo="django/django", problem_statement="", base_commit="",
             FAIL_TO_PASS=["test_y (app.tests.T)"], PASS_TO_PASS=["test_a (app.tests.T)"])
    c = Canaries(file="tests/app/tests.py", passing="test_p", failing="test_f", style="testcase")
    section = ("test_a (app.tests.T) ... ok\ntest_y (app.tests.T) ... test_p (app.tests.TestP) ... Testing against "
               "Django installed in '/testbed/django'\nSystem check identified no issues (0 silenced).\nok\n"
               "test_f (app.tests.TestP) ... FAIL\n\n======\nFAIL: test_y (app.tests.T) (year=4)\n------\n"
               "AssertionError: '4' != '04'\n======\nFAIL: test_f (app.tests.TestP)\n------\nAssertionError\n")
    log = f">>>>> Start Test Output\n{section}>>>>> End Test Output\n>>>>> Test Exit Code: 1\n"
    assert parse_status_map(t, "parse_log_django", section)["test_y (app.tests.T)"] == "PASSED"  # the misreading
    v = grade_log(t, "parse_log_django", log, c)
    assert v is not None and not v.resolved and not v.tampered and v.f2p_failed == ["test_y (app.tests.T)"], v
    without = grade_log(t, "parse_log_django", log, c, defences=False)  # the official reading, for measurements
    assert without is not None and without.resolved
