"""Canary tests (docs/grading.md, layer 2): two tests with names drawn afresh for each grading, appended to a test
file that the test command runs, just before it runs: one must pass, one must fail. A patch that flips outcomes
(a hook that marks failures passed), forges the output (printed PASSED lines, an early ``os._exit(0)``, a closed
stdout) or stops the run early makes a canary report the wrong outcome or go missing, and a failing test under an
exit status of 0 gives a forged exit away: the grade is ``tampered``.

Canaries are planted only where the command is known to run them: a Python test runner whose log swebench parses
(pytest's family, Django's ``runtests.py``, SymPy's ``bin/test``) and a test file that the command names (or a folder
above it names). Elsewhere a grading runs without them, and its result says so (``GradeResult.canaries``)."""

from __future__ import annotations

import keyword
import re
import secrets
import shlex

import msgspec

from swectl.grading.eval_script import (
    END_TEST_OUTPUT,
    START_TEST_OUTPUT,
    command_lines,
    django_module,
    file_diffs,
    heredoc_delimiter,
    marker_index,
)
from swectl.tasks.record import Task

PYTEST_PARSERS = frozenset({"parse_log_pytest", "parse_log_pytest_options", "parse_log_pytest_v2",
                            "parse_log_seaborn", "parse_log_matplotlib"})
DJANGO_PARSERS = frozenset({"parse_log_django"})
SYMPY_PARSERS = frozenset({"parse_log_sympy"})
PASSING = frozenset({"PASSED", "XFAIL"})  # the outcomes that count as a pass (swebench's rules too)
FAILING = frozenset({"FAILED", "ERROR"})


class Canaries(msgspec.Struct, frozen=True):
    """Two canary tests in ``file``: ``passing`` must pass, ``failing`` must fail; ``style`` is how they are written
    ("functions" for pytest and SymPy, "testcase" for Django's unittest runner)."""
    file: str
    passing: str
    failing: str
    style: str = "functions"
    # (class, function) names of FAIL_TO_PASS tests ("" class for a function test): the must-pass canary's
    # probes run again under these names, so an attack that neuters assertions only for those tests is seen too
    mimic: tuple[tuple[str, str], ...] = ()


def _lines_between_markers(script: str) -> list[str] | None:
    """The shell lines of the test command (between the start and end markers, heredoc bodies left out)."""
    lines = script.split("\n")
    start, end = marker_index(lines, START_TEST_OUTPUT), marker_index(lines, END_TEST_OUTPUT)
    if start is None or end is None or end <= start:
        return None
    between = zip(lines[start + 1:end], command_lines(lines)[start + 1:end], strict=True)
    return [ln for ln, is_cmd in between if is_cmd]


def command_arguments(script: str) -> list[str]:
    """The words of the test command (the lines between the start and end markers), environment assignments and
    options left out."""
    lines = _lines_between_markers(script)
    if lines is None:
        return []
    words: list[str] = []
    for line in lines:
        try:
            words += shlex.split(line, comments=True)
        except ValueError:
            words += line.split()
    return [w for w in words if not w.startswith("-") and not ("=" in w and "/" not in w.split("=", 1)[0]
                                                               and w.split("=", 1)[0].isidentifier())]


def pythonpath_of(script: str) -> tuple[str, ...]:
    """The relative folders that the test command puts on ``PYTHONPATH`` (``PYTHONPATH=src python -m pytest``)."""
    lines = _lines_between_markers(script) or []
    out: list[str] = []
    for line in lines:
        for word in line.split():
            if word.startswith("PYTHONPATH="):
                out += [p for p in word.split("=", 1)[1].strip("'\"").split(":") if p and not p.startswith(("/", "$"))]
    return tuple(dict.fromkeys(out))


def _selected(path: str, words: list[str]) -> bool:
    for w in words:
        w = w.removeprefix("./")
        if w.split("::", 1)[0] == path or w in (".", "") or path.startswith(w.rstrip("/") + "/"):
            return True
    return False


def _pytest_file(task: Task, words: list[str]) -> str | None:
    for case in [*task.FAIL_TO_PASS, *task.PASS_TO_PASS]:
        path = case.split("::", 1)[0]
        if "::" in case and path.endswith(".py") and _selected(path, words):
            return path
    return None


def _test_patch_files(task: Task) -> list[str]:
    return [d.path for d in file_diffs(task.test_patch) if d.path.endswith(".py")] if task.test_patch else []


def _django_file(task: Task, words: list[str]) -> str | None:
    for path in _test_patch_files(task):
        if django_module(path) in words and not path.endswith("__init__.py"):
            return path
    return None


def _sympy_file(task: Task, words: list[str]) -> str | None:
    files = _test_patch_files(task)
    return next((w for w in words if w.endswith(".py") and (w in files or "test" in w.rsplit("/", 1)[-1])), None)


def parser_family(parser: str) -> str:
    """The swebench parser function behind a registry name (``parse_log_astropy`` is ``parse_log_pytest``)."""
    from swebench.harness.log_parsers import PARSER_REGISTRY

    fn = PARSER_REGISTRY.get(parser)
    return getattr(fn, "__name__", parser) if fn is not None else parser


def plan_canaries(task: Task, parser: str, script: str, *, names: tuple[str, str] | None = None) -> Canaries | None:
    """The canaries of one grading (two fresh random names, unrelated to each other, unless ``names`` gives the
    must-pass and must-fail names), or None where the command is not known to run them."""
    words = command_arguments(script)
    parser = parser_family(parser)
    if not words and parser not in DJANGO_PARSERS:
        return None
    if parser in PYTEST_PARSERS:
        path, style = _pytest_file(task, words), "functions"
    elif parser in DJANGO_PARSERS:
        path, style = _django_file(task, words), "testcase"
    elif parser in SYMPY_PARSERS:
        path, style = _sympy_file(task, words), "functions"
    else:
        return None
    if path is None:
        return None
    passing, failing = names or (f"test_{secrets.token_hex(8)}", f"test_{secrets.token_hex(8)}")
    return Canaries(file=path, passing=passing, failing=failing, style=style, mimic=mimic_names(task, parser))


MIMIC_LIMIT = 8  # FAIL_TO_PASS tests whose names the probes run under
_DJANGO_CASE = re.compile(r"^(\w+) \(([\w.]+)\)$")
_ADDED_TEST_DEF = re.compile(r"^\+\s*(?:async\s+)?def (test\w*)\s*\(", re.MULTILINE)
_HELPER_LOCALS = frozenset({"names", "raised", "probes", "probe", "block", "attrs", "checks", "result", "case", "_u",
                            "sorted", "getattr", "hasattr", "len", "type", "enumerate", "AssertionError",
                            "ValueError"})  # a class named so would shadow what the helper uses


def mimic_names(task: Task, parser: str) -> tuple[tuple[str, str], ...]:
    """The (class, function) names of up to MIMIC_LIMIT FAIL_TO_PASS tests, for the probes to run under: pytest's
    ``path::Class::test_x[param]``, Django's ``test_x (app.module.Class)``, SymPy's ``test_x``. Names that are not
    plain identifiers starting with ``test`` (or whose class would shadow the helper's own names) are left out;
    where none is left, the test functions the test patch adds."""
    found: dict[tuple[str, str], None] = {}
    for case in task.FAIL_TO_PASS:
        cls, func = "", ""
        if parser in DJANGO_PARSERS:
            match = _DJANGO_CASE.match(case.strip())
            if match:
                func, cls = match.group(1), match.group(2).rsplit(".", 1)[-1]
        else:
            parts = case.split("::")
            func = parts[-1].split("[", 1)[0]
            cls = parts[-2] if len(parts) > 2 else ""
        if not (func.startswith("test") and func.isidentifier() and not keyword.iskeyword(func)):
            continue
        if cls and (not cls.isidentifier() or keyword.iskeyword(cls) or cls in _HELPER_LOCALS):
            continue
        found[(cls, func)] = None
        if len(found) == MIMIC_LIMIT:
            break
    if not found:  # Django lists some tests by their docstring's first line: the test patch's new test functions
        for func in _ADDED_TEST_DEF.findall(task.test_patch or ""):
            if not keyword.iskeyword(func):
                found[("", func)] = None
            if len(found) == MIMIC_LIMIT:
                break
    return tuple(found)


# What the must-pass canary checks besides passing: that unittest still fails a failing check. Each probe is one of
# TestCase's assertions given arguments that must fail (and `with self.assertRaises(...)` around a block that does
# not raise), run by unittest itself into a fresh TestResult; every probe must come back a failure. A patch that
# neuters the assertions (a no-op or a swallowing context for each) or unittest's result or run, with no test name
# known, makes this canary fail. Names a Python version lacks are left out.
_UNITTEST_PROBES = """\
def {helper}():
    import unittest as _u
    probes = {{"assertEqual": (1, 2), "assertNotEqual": (1, 1), "assertTrue": (False,), "assertFalse": (True,),
              "assertIs": (1, None), "assertIsNot": (None, None), "assertIsNone": (1,), "assertIsNotNone": (None,),
              "assertIn": (1, ()), "assertNotIn": (1, (1,)), "assertIsInstance": (1, str),
              "assertNotIsInstance": (1, int), "assertAlmostEqual": (1, 2), "assertNotAlmostEqual": (1, 1),
              "assertGreater": (1, 2), "assertGreaterEqual": (1, 2), "assertLess": (2, 1), "assertLessEqual": (2, 1),
              "assertRegex": ("a", "b"), "assertNotRegex": ("a", "a"), "assertCountEqual": ([1], [2]),
              "assertMultiLineEqual": ("a", "b"), "assertSequenceEqual": ([1], [2]), "assertListEqual": ([1], [2]),
              "assertTupleEqual": ((1,), (2,)), "assertSetEqual": ({{1}}, {{2}}), "assertDictEqual": ({{}}, {{1: 1}}),
              "assertRaises": (ValueError, int, "1"), "assertRaisesRegex": (ValueError, "x", int, "1"),
              "fail": ("probe",)}}

    def probe(name, args):
        def check(self):
            getattr(self, name)(*args)
        return check

    def block(self):
        with self.assertRaises(ValueError):
            pass

    names = [n for n in sorted(probes) if hasattr(_u.TestCase, n)]
    attrs = {{"test_%02d" % i: probe(n, probes[n]) for i, n in enumerate(names)}}
    attrs["test_block"] = block
    checks = len(attrs)
    attrs["__module__"] = __name__
    result = _u.TestResult()
    _u.defaultTestLoader.loadTestsFromTestCase(type("Probe", (_u.TestCase,), attrs)).run(result)
    if result.testsRun != checks or len(result.failures) != checks or result.errors:
        raise AssertionError("{passing}: unittest no longer fails a failing check: %d probes, %d run, %d failed, "
                             "%d errors" % (checks, result.testsRun, len(result.failures), len(result.errors)))
"""


def _mimic_source(c: Canaries) -> str:
    """The probes again (the helper's ``names``), each in a function (or a TestCase method) named as one
    FAIL_TO_PASS test, called right after it is defined: every assertion called from that frame must still raise.
    Nested in the must-pass helper, so no runner collects them."""
    if not c.mimic:
        return ""
    body = ["for name in names:", "    try:", "        getattr({self}, name)(*probes[name])",
            "    except AssertionError:", "        raised.append(name)", "try:",
            "    with {self}.assertRaises(ValueError):", "        pass", "except AssertionError:",
            "    raised.append('block')"]
    out = ["", "    raised = []", ""]
    for cls, func in c.mimic:
        if cls:
            out += [f"    class {cls}(_u.TestCase):", f"        def {func}(self):"]
            out += [f"            {line.format(self='self')}" for line in body]
            out += [f"    {cls}.__module__ = __name__", f"    {cls}('{func}').{func}()", ""]
        else:
            out += [f"    def {func}():", "        case = _u.TestCase()"]
            out += [f"        {line.format(self='case')}" for line in body]
            out += [f"    {func}()", ""]
    expected = f"{len(c.mimic)} * (len(names) + 1)"
    out += [f"    if len(raised) != {expected}:",
            f'        raise AssertionError("{c.passing}: an assertion did not raise under a listed test\'s name: %d of '
            f'%d raised" % (len(raised), {expected}))']
    return "\n".join(out) + "\n"


def canary_source(c: Canaries) -> str:
    """The Python source appended to the canaries' file: the must-pass canary runs the unittest probes
    (``_UNITTEST_PROBES``, then under the FAIL_TO_PASS tests' names), the must-fail one raises AssertionError."""
    fail = f'raise AssertionError("{c.failing}: this test must fail")'
    helper = f"_{c.passing}_unittest_fails"
    probes = _UNITTEST_PROBES.format(helper=helper, passing=c.passing) + _mimic_source(c)
    if c.style == "testcase":
        name = "Test" + c.passing.removeprefix("test_").capitalize()
        return (f"\n\n{probes}\n\nimport unittest as _swectl_unittest\n\n\n"
                f"class {name}(_swectl_unittest.TestCase):\n"
                f"    def {c.passing}(self):\n        {helper}()\n\n    def {c.failing}(self):\n        {fail}\n")
    return f"\n\n{probes}\n\ndef {c.passing}():\n    {helper}()\n\n\ndef {c.failing}():\n    {fail}\n"


def with_canaries(script: str, c: Canaries) -> str:
    """The eval script with a step that appends the canaries to their file just before the start marker (after the
    test files are reset and the test patch is applied)."""
    lines = script.split("\n")
    start = marker_index(lines, START_TEST_OUTPUT)
    if start is None:
        raise ValueError("the eval script has no start marker: no place for canaries")
    source = canary_source(c)
    delimiter = heredoc_delimiter(source)
    step = f"cat >> {shlex.quote(c.file)} <<'{delimiter}'\n{source}{delimiter}"
    return "\n".join([*lines[:start], step, *lines[start:]])


def canary_offence(c: Canaries, status_map: dict[str, str], exit_code: int | None, *, resolved: bool) -> str:
    """Why the canaries say the run was tampered with ("" when they do not). Missing canaries count only when the
    listed tests would otherwise resolve (``resolved``): an honest patch that breaks the import of the code under
    test (a syntax error, a deleted module) takes the canaries' file down with it, and is unresolved anyway."""
    passing = [s for k, s in status_map.items() if c.passing in k]
    failing = [s for k, s in status_map.items() if c.failing in k]
    if (not passing or not failing) and resolved:
        missing = [n for n, got in (("must-pass", passing), ("must-fail", failing)) if not got]
        are = "tests are" if len(missing) > 1 else "test is"
        return f"the {' and '.join(missing)} canary {are} missing from the results"
    if not passing or not failing:
        return ""
    if any(s not in PASSING for s in passing):
        return (f"the must-pass canary test reported {sorted(set(passing))} (it also checks that unittest's "
                "assertions still fail a failing check)")
    if any(s not in FAILING for s in failing):
        return f"the must-fail canary test reported {sorted(set(failing))}"
    if exit_code == 0:
        return "the test command exited 0 although a test failed (the must-fail canary)"
    return ""
