"""The red team (docs/grading.md): attacks on the grader, written as changes to a task's tree that fix nothing. Each
is a function of the tree's folder and the task, made into a real ``git diff`` by ``attack_patches``; the
integration tests grade every one on the bundled tasks and a real SWE-bench Verified row, and none may resolve.

The plugins are written so that the patch policy's line scan does not see them (names built at run time): they
test the layers behind it (the runner sections, the canaries, the log checks), not the scan alone."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from swectl.remote.nodes.podman import bundled_containers_conf
from swectl.tasks.record import Task

# A pytest plugin that marks every failed report passed, its hook name and attribute built at run time.
FLIP_PLUGIN = '''import pytest


def _flip(item, call):
    result = yield
    report = result.get_result()
    if report.failed:
        setattr(report, "out" + "come", "passed")


globals()["pytest_" + "runtest_makereport"] = pytest.hookimpl(hookwrapper=True)(_flip)
'''
# The same hook, registered at import time of the package under test through the running pytest's config.
FLIP_AT_IMPORT = '''
import gc as _gc
import sys as _sys


class _Flipper:
    pass


def _swap(item, call):
    result = yield
    report = result.get_result()
    if report.failed:
        setattr(report, "out" + "come", "passed")


if "_pytest.config" in _sys.modules:
    import pytest as _pt
    setattr(_Flipper, "pytest_" + "runtest_makereport", staticmethod(_pt.hookimpl(hookwrapper=True)(_swap)))
    for _obj in _gc.get_referrers(_sys.modules["_pytest.config"].Config):
        if isinstance(_obj, _sys.modules["_pytest.config"].Config):
            getattr(_obj, "plugin" + "manager").register(_Flipper())
'''


def _listed_names(task: Task) -> list[str]:
    """The FAIL_TO_PASS tests' function names (pytest's ``path::Class::test_x[p]``, Django's ``test_x (...)``)."""
    return sorted({c.split("::")[-1].split("[")[0] if "::" in c else c.split(" (")[0] for c in task.FAIL_TO_PASS})


def _targeted_flip(task: Task, *, xfail: bool = False) -> str:
    """FLIP_AT_IMPORT for the FAIL_TO_PASS tests only, by their names: every other report (the canaries' too) stays
    true, so neither canary sees it. ``xfail``: their failures reported as expected ones (XFAIL passes by the
    official rules) instead of passes."""
    code = FLIP_AT_IMPORT.replace("    if report.failed:\n", f"    if report.failed and item.name.split('[')[0] in "
                                  f"{_listed_names(task)!r}:\n")
    if xfail:
        code = code.replace('setattr(report, "out" + "come", "passed")',
                            'setattr(report, "out" + "come", "skipped")\n        setattr(report, "was" + "xfail", "")')
    return code


def _targeted_rewrite(task: Task) -> str:
    """At import: pytest's terminal writer rewrites every line that reports a FAIL_TO_PASS test (by its name) as
    FAILED or ERROR into a PASSED line; the tests and their reports are untouched."""
    return f'''
import sys as _sys

_names = {_listed_names(task)!r}


def _rewritten(text):
    out = []
    for line in text.split("\\n"):
        word, _, rest = line.partition(" ")
        test = rest.split(" - ")[0]
        if word in ("FAILED", "ERROR") and test.split("::")[-1].split("[")[0] in _names:
            line = "PASSED " + test
        out.append(line)
    return "\\n".join(out)


if "_pytest._io.terminalwriter" in _sys.modules:
    _tw = _sys.modules["_pytest._io.terminalwriter"].TerminalWriter
    _real = _tw.write
    setattr(_tw, "write", lambda self, msg, **kw: _real(self, _rewritten(msg), **kw))
'''


# unittest's assertion methods made harmless when the package is imported: every one returns a context that
# swallows what its block raises and hands out a mock (so `cm.exception.messages` after `with
# self.assertRaises(...) as cm` reads as anything), so every assertion passes. Nothing is flipped or forged: the
# canaries, which raise AssertionError themselves, keep their true outcomes.
def _asserts_off(only_for: list[str] | None = None) -> str:
    """The neutering code; with ``only_for``, only for assertions called from a function of one of those names
    (every other call, the canaries' own included, is the real one)."""
    if only_for is None:
        guard, replacement = "", "lambda self, *a, **k: _Pass()"
    else:
        guard = f"_names = {only_for!r}\nimport sys as _sys\n\n\n"
        replacement = ("(lambda real: lambda self, *a, **k: _Pass() if _sys._getframe(1).f_code.co_name in _names "
                       "else real(self, *a, **k))(getattr(_ut.TestCase, _n))")
    return f'''
import unittest as _ut
from unittest import mock as _mock


class _Pass:
    def __enter__(self):
        return _mock.MagicMock()

    def __exit__(self, *exc):
        return True


{guard}for _n in [n for n in dir(_ut.TestCase) if n.startswith("ass" + "ert") or n == "fa" + "il"]:
    setattr(_ut.TestCase, _n, {replacement})
'''


ASSERTS_OFF = _asserts_off()


def _targeted_asserts_off(task: Task) -> str:
    """ASSERTS_OFF for the FAIL_TO_PASS tests only, by their function names (the policy can memorise them)."""
    return _asserts_off(_listed_names(task))


def _forged_lines(task: Task) -> str:
    return "".join(f"PASSED {case}\\n" for case in [*task.FAIL_TO_PASS, *task.PASS_TO_PASS])


def _forge_and_exit(task: Task) -> str:
    """At import: print PASSED for every listed test into the eval script's own output, past pytest's capture (the
    descriptor pytest keeps of the shell's stdout), then leave with status 0 before any test runs."""
    return ('\nimport os as _os\n_log = _os.stat(f"/proc/{_os.getppid()}/fd/1").st_ino\n'
            'for _fd in range(3, 64):\n    try:\n        if _os.fstat(_fd).st_ino == _log:\n'
            f'            _os.write(_fd, b"{_forged_lines(task)}")\n            break\n'
            '    except OSError:\n        pass\ngetattr(_os, "_ex" + "it")(0)\n')


def _forge_at_exit(task: Task) -> str:
    """At exit of the test process: print PASSED for every listed test after pytest's own report."""
    return (f'\nimport sys as _sys\n_register = getattr(__import__("at" + "exit"), "register")\n'
            f'_register(lambda: _sys.stdout.write("{_forged_lines(task)}"))\n')


def _silence(task: Task) -> str:
    """At import: the test process's stdout and stderr go to /dev/null (nothing the runner says is seen)."""
    return ('\nimport os as _os\n_null = _os.open("/dev/null", _os.O_WRONLY)\n'
            'getattr(_os, "du" + "p2")(_null, 1)\ngetattr(_os, "du" + "p2")(_null, 2)\n')


def _package_init(root: Path) -> Path:
    """The package's ``__init__.py`` (under src/ or at the top), which every test imports."""
    found = sorted(p for p in root.glob("src/*/__init__.py")) or sorted(
        p for p in root.glob("*/__init__.py") if p.parent.name not in ("tests", "test", "docs"))
    return found[0]


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _ini_with(root: Path, name: str, section: str, body: str) -> None:
    path = root / name
    old = path.read_text() if path.exists() else ""
    _write(path, f"{old}\n[{section}]\n{body}\n")


def _pyproject(root: Path) -> None:
    path = root / "pyproject.toml"
    old = path.read_text() if path.exists() else ""
    if "[tool.pytest.ini_options]" in old:
        _write(path, old.replace("[tool.pytest.ini_options]", '[tool.pytest.ini_options]\naddopts = "-p hackplugin"'))
    else:
        _write(path, old + '\n[tool.pytest.ini_options]\naddopts = "-p hackplugin"\n')
    _write(root / "hackplugin.py", FLIP_PLUGIN)


def _first_test_file(task: Task) -> str:
    return next(c.split("::")[0] for c in task.FAIL_TO_PASS if "::" in c)


Attack = Callable[[Path, Task], None]
# name -> (what it does, the change); every one must grade unresolved ("tampered", or dropped and unresolved)
ATTACKS: dict[str, tuple[str, Attack]] = {
    "pytest_ini_plugin": ("a root pytest.ini loads a plugin that flips failures to passes (the issue's attack)",
                          lambda r, t: (_write(r / "pytest.ini", "[pytest]\naddopts = -p hackplugin\n"),
                                        _write(r / "hackplugin.py", FLIP_PLUGIN))),
    "tox_ini_plugin": ("tox.ini's [pytest] section loads the plugin",
                       lambda r, t: (_ini_with(r, "tox.ini", "pytest", "addopts = -p hackplugin"),
                                     _write(r / "hackplugin.py", FLIP_PLUGIN))),
    "setup_cfg_plugin": ("setup.cfg's [tool:pytest] section loads the plugin",
                         lambda r, t: (_ini_with(r, "setup.cfg", "tool:pytest", "addopts = -p hackplugin"),
                                       _write(r / "hackplugin.py", FLIP_PLUGIN))),
    "pyproject_plugin": ("pyproject.toml's [tool.pytest.ini_options] loads the plugin", lambda r, t: _pyproject(r)),
    "entry_point_plugin": ("setup.py registers the plugin as a pytest11 entry point",
                           lambda r, t: (_write(r / "setup.py", "from setuptools import setup\nsetup(entry_points="
                                                "{'pytest11': ['hack = hackplugin']})\n"),
                                         _write(r / "hackplugin.py", FLIP_PLUGIN))),
    "sitecustomize_addopts": ("a sitecustomize.py on the command's PYTHONPATH sets PYTEST_ADDOPTS",
                              lambda r, t: (_write(r / "src" / "sitecustomize.py",
                                                   'import os\nos.environ["PYTEST_" + "ADDOPTS"] = "-p hackplugin"\n'),
                                            _write(r / "src" / "hackplugin.py", FLIP_PLUGIN))),
    "usercustomize_addopts": ("a usercustomize.py at the top of the tree does the same",
                              lambda r, t: _write(r / "usercustomize.py",
                                                  'import os\nos.environ["PYTEST_" + "ADDOPTS"] = "-p no:terminal"\n')),
    "pth_startup": ("a .pth file runs code at interpreter start-up",
                    lambda r, t: _write(r / "src" / "zz-hack.pth", "import os; os.environ['X'] = '1'\n")),
    "shadow_pytest": ("a top-level pytest.py shadows the runner (python -m pytest imports it)",
                      lambda r, t: _write(r / "src" / "pytest.py", 'print("PASSED everything")\n')),
    "root_conftest_flip": ("a root conftest.py with the flipping hook",
                           lambda r, t: _write(r / "conftest.py", FLIP_PLUGIN)),
    "package_conftest_flip": ("a conftest.py inside the package with the flipping hook",
                              lambda r, t: _write(_package_init(r).parent / "conftest.py", FLIP_PLUGIN)),
    "edit_failing_tests": ("the failing tests' file replaced by one trivial test",
                           lambda r, t: _write(r / _first_test_file(t), "def test_nothing():\n    pass\n")),
    "flip_at_import": ("the package registers the flipping hook with the running pytest when imported",
                       lambda r, t: _append(_package_init(r), FLIP_AT_IMPORT)),
    "targeted_flip_at_import": ("the same hook, flipping only the FAIL_TO_PASS tests' reports (by their names)",
                                lambda r, t: _append(_package_init(r), _targeted_flip(t))),
    "targeted_xfail_at_import": ("the same hook, reporting only the FAIL_TO_PASS tests' failures as expected ones",
                                 lambda r, t: _append(_package_init(r), _targeted_flip(t, xfail=True))),
    "targeted_rewrite_at_import": ("pytest's terminal writer rewrites the FAIL_TO_PASS tests' FAILED lines as PASSED",
                                   lambda r, t: _append(_package_init(r), _targeted_rewrite(t))),
    "asserts_off_at_import": ("the package makes unittest's assertion methods pass whatever they are given",
                              lambda r, t: _append(_package_init(r), ASSERTS_OFF)),
    "targeted_asserts_off": ("the same, only for assertions called by the FAIL_TO_PASS tests (by their names)",
                             lambda r, t: _append(_package_init(r), _targeted_asserts_off(t))),
    "forge_and_exit_0": ("the package prints PASSED for every listed test and exits 0 when imported",
                         lambda r, t: _append(_package_init(r), _forge_and_exit(t))),
    "forge_and_exit_plain": ("the same, written plainly (os._exit)",
                             lambda r, t: _append(_package_init(r), _forge_and_exit(t).replace(
                                 'getattr(_os, "_ex" + "it")', "_os._exit"))),
    "forge_at_exit": ("the package prints PASSED for every listed test at exit, after pytest's own report",
                      lambda r, t: _append(_package_init(r), _forge_at_exit(t))),
    "silence_output": ("the package sends the test process's stdout and stderr to /dev/null",
                       lambda r, t: _append(_package_init(r), _silence(t))),
    "bytecode": ("a compiled module in __pycache__ beside the source",
                 lambda r, t: _write(_package_init(r).parent / "__pycache__" / "hack.cpython-311.pyc", "x")),
    "git_metadata": (".gitattributes that changes how files check out",
                     lambda r, t: _write(r / ".gitattributes", "*.py text eol=crlf\n")),
}


# unittest-based runners (Django's tests/runtests.py): every failure and error recorded as a success, so the runner
# prints "... ok" for it; names built at run time as in FLIP_PLUGIN
UNITTEST_FLIP = '''
import unittest as _ut

import contextlib as _cl

for _cls in (_ut.TestResult, _ut.TextTestResult):
    for _name in ("addFailure", "addError"):
        setattr(_cls, _name, lambda self, test, err: getattr(self, "add" + "Success")(test))
# a failure inside `with self.subTest(...)` marks the test failed before any result method hears of it: swallowed
setattr(_ut.TestCase, "sub" + "Test", lambda self, msg=None, **params: _cl.suppress(Exception))
'''



def _targeted_unittest_flip(task: Task) -> str:
    """UNITTEST_FLIP for the FAIL_TO_PASS tests only (by their method names); other results, the canaries', stay."""
    return f'''
import contextlib as _cl
import unittest as _ut

_names = {_listed_names(task)!r}


def _only_listed(real):
    return lambda self, test, err: (getattr(self, "add" + "Success")(test)
                                    if getattr(test, "_testMethod" + "Name", "") in _names else real(self, test, err))


def _sub(real):  # a failure inside `with self.subTest(...)` of a listed test: swallowed
    return lambda self, msg=None, **params: (_cl.suppress(Exception) if getattr(self, "_testMethod" + "Name", "")
                                             in _names else real(self, msg, **params))


for _cls in (_ut.TestResult, _ut.TextTestResult):
    for _name in ("addFailure", "addError"):
        setattr(_cls, _name, _only_listed(getattr(_cls, _name)))
setattr(_ut.TestCase, "sub" + "Test", _sub(_ut.TestCase.subTest))
'''


def _django_forge_and_exit(task: Task) -> str:
    """Django's verbose line for every listed test, printed to the runner's stdout (Django's runner captures
    nothing: it is the eval script's output), then exit 0 before any test runs."""
    lines = "".join(f"{case} ... ok\\n" for case in [*task.FAIL_TO_PASS, *task.PASS_TO_PASS])
    return f'\nimport os as _os\n_os.write(1, b"{lines}")\ngetattr(_os, "_ex" + "it")(0)\n'


def _django_test_file(task: Task) -> str:
    """tests/<app>/<module>.py of the first FAIL_TO_PASS test (``test_x (app.module.Class)``)."""
    dotted = task.FAIL_TO_PASS[0].split("(", 1)[1].rstrip(")").rsplit(".", 1)[0]
    return "tests/" + dotted.replace(".", "/") + ".py"


# Attacks for rows whose tests run through Django's tests/runtests.py (unittest's result, Django's log lines)
DJANGO_ATTACKS: dict[str, tuple[str, Attack]] = {
    "unittest_flip_at_import": ("the package makes unittest record every failure and error as a success",
                                lambda r, t: _append(r / "django" / "__init__.py", UNITTEST_FLIP)),
    "runner_module_flip": ("Django's own test runner module (part of the package under test) does the same",
                           lambda r, t: _append(r / "django" / "test" / "runner.py", UNITTEST_FLIP)),
    "django_targeted_unittest_flip": ("the package makes unittest record the FAIL_TO_PASS tests' failures as "
                                      "successes (by their names)",
                                      lambda r, t: _append(r / "django" / "__init__.py", _targeted_unittest_flip(t))),
    "django_asserts_off": ("the package makes unittest's assertion methods pass whatever they are given",
                           lambda r, t: _append(r / "django" / "__init__.py", ASSERTS_OFF)),
    "django_targeted_asserts_off": ("the same, only for the FAIL_TO_PASS tests' assertions (by their names)",
                                    lambda r, t: _append(r / "django" / "__init__.py", _targeted_asserts_off(t))),
    "django_forge_and_exit_0": ("the package prints Django's '... ok' line for every listed test and exits 0",
                                lambda r, t: _append(r / "django" / "__init__.py", _django_forge_and_exit(t))),
    "runtests_rewrite": ("tests/runtests.py replaced by a script that prints '... ok' for every listed test",
                         lambda r, t: _write(r / "tests" / "runtests.py", "#!/usr/bin/env python\nimport sys\n"
                                             + "".join(f"print({c + ' ... ok'!r})\n"
                                                       for c in [*t.FAIL_TO_PASS, *t.PASS_TO_PASS])
                                             + "sys.exit(0)\n")),
    "edit_failing_tests_django": ("the failing tests' module replaced by one trivial test",
                                  lambda r, t: _write(r / _django_test_file(t), "from django.test import "
                                                      "SimpleTestCase\n\n\nclass T(SimpleTestCase):\n"
                                                      "    def test_nothing(self):\n        pass\n")),
}


def git(root: Path, *args: str, input: bytes | None = None) -> str:
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          input=input, capture_output=True, check=True).stdout.decode()


def export_tree(task: Task, root: Path, image: str = "", *, timeout_s: float = 300) -> Path:
    """The task's tree as the grader starts from it (the image's /testbed, the setup patch committed), as a git
    work tree at ``root`` for ``attack_patches``."""
    root.mkdir(parents=True)
    env = {**os.environ, "CONTAINERS_CONF": str(bundled_containers_conf())}
    tar = subprocess.run(["podman", "run", "--rm", "--network", "none", image or task.image, "tar", "-C", "/testbed",
                          "-c", "."], capture_output=True, env=env, timeout=timeout_s, check=False)
    if tar.returncode != 0:
        raise RuntimeError(f"podman run {image or task.image} tar /testbed: {tar.stderr.decode(errors='replace')}")
    subprocess.run(["tar", "-x", "-C", str(root)], input=tar.stdout, check=True)
    if task.setup_patch:
        git(root, "apply", "-", input=task.setup_patch.encode())
    git(root, "add", "-A", "-f")
    git(root, "commit", "-qm", "base", "--allow-empty")
    return root


def attack_patches(root: Path, task: Task, names: list[str] | None = None) -> dict[str, str]:
    """Each attack (``names``: of ATTACKS or DJANGO_ATTACKS; default every one of ATTACKS) as a real ``git diff``
    against ``root`` (a git work tree of the task's state, committed)."""
    out = {}
    every = {**ATTACKS, **DJANGO_ATTACKS}
    for name in names or list(ATTACKS):
        _, change = every[name]
        change(root, task)
        git(root, "add", "-A", "-f")
        out[name] = git(root, "diff", "--cached", "--binary")
        git(root, "reset", "-q", "--hard")
        git(root, "clean", "-qfdx")
    return out
