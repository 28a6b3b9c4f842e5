"""Canary tests (docs/grading.md, layer 2): two tests with names drawn afresh for each grading, appended to a test
file that the test command runs, just before it runs: one must pass, one must fail. A patch that flips outcomes
(a hook that marks failures passed), forges the output (printed PASSED lines, an early ``os._exit(0)``, a closed
stdout) or stops the run early makes a canary report the wrong outcome or go missing, and a failing test under an
exit status of 0 gives a forged exit away: the grade is ``tampered``.

Beside them go copies of the FAIL_TO_PASS tests under fresh names (``ListedCopy``): a copy that fails where its test
passed means something acted on the listed test by its name (a hook that flips only its report); the grader confirms
that in a fresh sandbox with each copy in its test's place (``confirming``), so a test that merely leaks state into a
second run of itself is not called tampering.

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


class ListedCopy(msgspec.Struct, frozen=True):
    """A copy of the FAIL_TO_PASS test ``func`` (a function of ``file``, or a method of the class reached through
    ``owner``, outermost first) planted in the same place under the fresh name ``name``: the test's name and 16
    random hex digits, so that runners which order a class's tests by name (unittest's loader) run the copy right
    after its test, and a copy whose subtests fail, which Django's runner prints with no outcome on its line, does
    not hide its test's line."""
    file: str
    owner: tuple[str, ...]
    func: str
    name: str


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
    # copies of FAIL_TO_PASS tests under fresh names, run beside them: one that fails where its test passes means
    # something acted on the listed test by its name (a hook that flips only its report)
    copies: tuple[ListedCopy, ...] = ()
    copies_replace: bool = False  # the confirmation run: each copy in place of its test (``confirming``)


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
    passing, failing = names or (fresh_name(), fresh_name())
    return Canaries(file=path, passing=passing, failing=failing, style=style, mimic=mimic_names(task, parser),
                    copies=plan_copies(task, parser, words))


def fresh_name() -> str:
    """A test name drawn afresh: ``test_`` and 16 random hex digits."""
    return f"test_{secrets.token_hex(8)}"


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
            parsed = django_case(case)
            if parsed:
                func, cls = parsed[2], parsed[1]
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


def django_case(case: str) -> tuple[str, str, str] | None:
    """(module, class, function) of a Django test as its runner names it: ``test_x (app.module.Class)``, or
    ``test_x (app.module.Class.test_x)`` from Django 4.1 on; None for a test listed by its docstring."""
    match = _DJANGO_CASE.match(case.strip())
    if not match:
        return None
    func, dotted = match.group(1), match.group(2).split(".")
    if dotted[-1] == func:
        dotted = dotted[:-1]
    if len(dotted) < 2:
        return None
    return ".".join(dotted[:-1]), dotted[-1], func


def _plain_test_name(name: str) -> bool:
    return name.startswith("test") and name.isidentifier() and not keyword.iskeyword(name)


def _runs_whole_file(path: str, words: list[str]) -> bool:
    """Whether the command runs every test of ``path`` (names it, or a folder above it; not ``path::test``)."""
    for w in words:
        w = w.removeprefix("./")
        if "::" not in w and (w == path or w in (".", "") or path.startswith(w.rstrip("/") + "/")):
            return True
    return False


def _copy_targets(task: Task, parser: str, words: list[str]) -> list[tuple[str, tuple[str, ...], str]]:
    """(file, owner classes, function) of the FAIL_TO_PASS tests that can be copied where the command runs them."""
    out: list[tuple[str, tuple[str, ...], str]] = []
    if parser in PYTEST_PARSERS:
        for case in task.FAIL_TO_PASS:
            parts = case.split("::")
            if len(parts) >= 2 and parts[0].endswith(".py") and _runs_whole_file(parts[0], words):
                out.append((parts[0], tuple(parts[1:-1]), parts[-1].split("[", 1)[0]))
    elif parser in DJANGO_PARSERS:
        files = {django_module(p): p for p in _test_patch_files(task)}
        for case in task.FAIL_TO_PASS:
            parsed = django_case(case)
            if parsed and parsed[0] in files and any(parsed[0] == w or parsed[0].startswith(w + ".") for w in words):
                out.append((files[parsed[0]], (parsed[1],), parsed[2]))
    elif parser in SYMPY_PARSERS:  # the run file whose test patch section names the function, else the one file run
        texts = {d.path: d.text for d in file_diffs(task.test_patch or "") if d.path in words}
        run = [w for w in words if w.endswith(".py")]
        for case in task.FAIL_TO_PASS:
            path = next((p for p, text in texts.items() if f"def {case}(" in text), None)
            if path is None and len(run) == 1:
                path = run[0]
            if path is not None:
                out.append((path, (), case))
    return [t for t in out if _plain_test_name(t[2]) and all(c.isidentifier() and not keyword.iskeyword(c)
                                                             for c in t[1])]


def plan_copies(task: Task, parser: str, words: list[str]) -> tuple[ListedCopy, ...]:
    """Up to MIMIC_LIMIT of the FAIL_TO_PASS tests, each to be copied under a fresh name (``ListedCopy``)."""
    targets = list(dict.fromkeys(_copy_targets(task, parser, words)))[:MIMIC_LIMIT]
    return tuple(ListedCopy(file=f, owner=o, func=fn, name=f"{fn}_{secrets.token_hex(8)}") for f, o, fn in targets)


# The copies: each FAIL_TO_PASS test's function, found where its runner finds it (the module's globals, or the class
# through its bases), made again under the fresh name (its code object renamed where Python can, 3.8 on; its
# attributes, marks and parameters kept; no docstring, so Django's runner names it by its name) and set beside it.
# A test that is not a plain function there (a staticmethod, a name built otherwise) is left uncopied. No f-strings:
# the file may run on Python 3.5.
_COPIES = """def {helper}(ns, plan, replace):
    import types
    for owner_path, func, new in plan:
        owner, raw = None, None
        try:
            for part in owner_path:
                owner = ns[part] if owner is None else getattr(owner, part)
            if owner is None:
                raw = ns[func]
            else:
                raw = next(vars(k)[func] for k in owner.__mro__ if func in vars(k))
        except (KeyError, AttributeError, StopIteration):
            continue
        if not isinstance(raw, types.FunctionType):
            continue
        code = raw.__code__
        if hasattr(code, "replace"):
            code = code.replace(co_name=new)
            if hasattr(code, "co_qualname"):
                code = code.replace(co_qualname=code.co_qualname.rsplit(".", 1)[0] + "." + new
                                    if "." in code.co_qualname else new)
        copy = types.FunctionType(code, raw.__globals__, new, raw.__defaults__, raw.__closure__)
        copy.__dict__.update(raw.__dict__)
        copy.__kwdefaults__ = raw.__kwdefaults__
        copy.__module__ = raw.__module__
        copy.__qualname__ = raw.__qualname__.rsplit(".", 1)[0] + "." + new if "." in raw.__qualname__ else new
        copy.__doc__ = None
        if not replace:
            if owner is None:
                ns[new] = copy
            else:
                setattr(owner, new, copy)
            continue
        # in the test's place: where it was in its module's or class's order (runners that collect in definition
        # order run the copy when the test would have run), the test itself gone
        space = ns if owner is None else dict(vars(owner))
        names = list(space)
        later = [n for n in names[names.index(func) + 1:] if not n.startswith("__")] if func in names else []
        if owner is None:
            if func in ns:
                del ns[func]
            ns[new] = copy
            for n in later:
                ns[n] = ns.pop(n)
        else:
            if func in vars(owner):
                delattr(owner, func)
            else:
                setattr(owner, func, None)  # inherited: hidden from the runner here
            setattr(owner, new, copy)
            for n in later:
                value = vars(owner)[n]
                delattr(owner, n)
                setattr(owner, n, value)


{helper}(globals(), {plan!r}, {replace!r})
del {helper}
"""


def copies_source(copies: list[ListedCopy], *, replace: bool = False) -> str:
    """The Python source appended to one file: the copies of its FAIL_TO_PASS tests under their fresh names
    (``replace``: each in place of its test, which is taken out of the runner's reach)."""
    plan = [(s.owner, s.func, s.name) for s in copies]
    return "\n\n" + _COPIES.format(helper=f"_{copies[0].name}_copies", plan=plan, replace=replace)


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
    """The eval script with steps that append the canaries to their file, and the FAIL_TO_PASS tests' copies to
    theirs, just before the start marker (after the test files are reset and the test patch is applied)."""
    lines = script.split("\n")
    start = marker_index(lines, START_TEST_OUTPUT)
    if start is None:
        raise ValueError("the eval script has no start marker: no place for canaries")
    steps = [_append_step(c.file, canary_source(c))]
    by_file: dict[str, list[ListedCopy]] = {}
    for one in c.copies:
        by_file.setdefault(one.file, []).append(one)
    steps += [_append_step(path, copies_source(group, replace=c.copies_replace)) for path, group in by_file.items()]
    return "\n".join([*lines[:start], *steps, *lines[start:]])


def _append_step(path: str, source: str) -> str:
    delimiter = heredoc_delimiter(source)
    return f"cat >> {shlex.quote(path)} <<'{delimiter}'\n{source}{delimiter}"


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


def confirming(c: Canaries) -> Canaries:
    """The canaries of the run that confirms a copy's offence: fresh canary names, the same copies, each planted
    in place of its test. A test that leaks state into a second run of itself (it passes first and fails after)
    fails beside itself, but passes in its own place; a test acted on by its name fails there too."""
    return msgspec.structs.replace(c, passing=fresh_name(), failing=fresh_name(), copies_replace=True)


def with_unittest_failures(status_map: dict[str, str], log: str) -> dict[str, str]:
    """The status map with every test that unittest's summary in ``log`` reports as ``FAIL:`` or ``ERROR:`` marked
    FAILED (subtests too). swebench's Django parser reads a bare ``ok`` line as the outcome of the last test line it
    saw; a test whose subtests failed prints no outcome on its own line, so when the next test's ``ok`` lands on a
    line of its own (stderr in between) the failed test reads PASSED. The runner's own summary says otherwise
    (django__django-13670's empty patch, 2026-12-08: its FAIL_TO_PASS test read PASSED from the canary's ``ok``)."""
    failed = _UNITTEST_FAILURE.findall(log)
    return {**status_map, **{key: "FAILED" for key in failed}} if failed else status_map


def failed_copies(copies: tuple[ListedCopy, ...], status_map: dict[str, str], log: str = "") -> list[str]:
    """The copies that failed in a run (in ``status_map`` or in unittest's failure summaries in ``log``)."""
    return sorted(key for key, outcome in with_unittest_failures(status_map, log).items() if outcome in FAILING
                  and any(one.name in key for one in copies))


_UNITTEST_FAILURE = re.compile(r"^(?:FAIL|ERROR): (\w+ \([\w.]+\))", re.MULTILINE)


def copy_offence(copies: tuple[ListedCopy, ...], status_map: dict[str, str], log: str = "") -> str:
    """A FAIL_TO_PASS test that passed while its copy under a fresh name failed (in ``status_map``, or in the
    ``FAIL:`` / ``ERROR:`` summaries of unittest's output in ``log``; "" when none did). A copy that is
    missing (a test its runner did not collect under the new name) says nothing. Asked of every run, resolved or
    not: a flipped test beside a copy whose failure hides the next test's line (Django's subtests) is unresolved
    by the rules, and still tampering."""
    # unittest's failure summaries too: a test whose subtests failed gets no outcome on its own line
    failures = with_unittest_failures(status_map, log)
    for one in copies:
        for key, outcome in failures.items():
            if one.name not in key or outcome not in FAILING:
                continue
            original = key.replace(one.name, one.func)
            if failures.get(original) in PASSING:
                return (f"{original} passed, but the same test copied under a fresh name ({one.name}) reported "
                        f"{outcome}: something acted on the listed test by its name")
    return ""
