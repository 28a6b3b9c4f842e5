"""Per-test function coverage: which project functions each pytest test calls.

Standalone, standard library only; copied into a task container and run with the project's python:

    python /tmp/func_coverage.py --root /testbed --out /tmp/cov.json -- <pytest args...>

It runs pytest in-process with a profile hook (``sys.setprofile`` and ``threading.setprofile``) that
records, for the test running at the time (its setup, call and teardown), every Python function called
whose file lies under ``--root`` and is not test code (``test_*.py``, ``*_test.py``, ``conftest.py``, files
under a ``tests``/``test`` directory; also hidden directories and site-/dist-packages). Lambdas,
comprehensions, module and class bodies are left out: they belong to a function that is recorded anyway.

Output (JSON): ``{"exit_code": int, "tests": {nodeid: {"outcome": str, "functions": [[file, qualname,
firstlineno], ...]}}, "collect_errors": [nodeid, ...]}`` with file relative to the root, qualname as
``code.co_qualname`` (``Class.method``, ``outer.<locals>.inner``), firstlineno as ``code.co_firstlineno``
(the first decorator line of a decorated function). Outcomes: passed, failed, skipped, error (setup or
teardown failed), xfailed, xpassed. On pythons before 3.11 qualnames come from parsing the file.

Imports resolve as under ``python -m pytest`` (the working directory comes first on ``sys.path``).
Only code run in this process is seen: do not pass ``-n`` (pytest-xdist) or run tests in subprocesses.
Exit status: pytest's, or 2 if pytest cannot be imported.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import threading
from collections.abc import Iterator
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    Entry = tuple[str, str, int]  # (root-relative file, qualname, firstlineno)

CO_OPTIMIZED = 0x0001  # set on function code objects, not on module or class bodies
TEST_DIRS = ("tests", "test")
SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")


def is_test_file(rel_path: str) -> bool:
    """Whether a root-relative path is test code (never reported)."""
    parts = rel_path.replace(os.sep, "/").split("/")
    name = parts[-1]
    if name == "conftest.py" or name.endswith("_test.py") or (name.startswith("test_") and name.endswith(".py")):
        return True
    return any(part in TEST_DIRS for part in parts[:-1])


def excluded_dir(rel_path: str) -> bool:
    parts = rel_path.replace(os.sep, "/").split("/")[:-1]
    return any(part in SKIP_DIRS or (part.startswith(".") and part not in (".", "..")) for part in parts)


def ast_qualnames(source: str) -> dict[int, str]:
    """{line: qualname} for every def in ``source``, keyed by the def line and the first decorator line."""
    out: dict[int, str] = {}

    def visit(stmts: list[ast.AST], prefix: str) -> None:
        for node in stmts:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = prefix + node.name
                out[node.lineno] = qualname
                if node.decorator_list:
                    out[node.decorator_list[0].lineno] = qualname
                visit(node.body, qualname + ".<locals>.")
            elif isinstance(node, ast.ClassDef):
                visit(node.body, prefix + node.name + ".")
            else:
                for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                    block = getattr(node, field, None)
                    if isinstance(block, list):
                        visit(block, prefix)

    visit(ast.parse(source).body, "")
    return out


class Recorder:
    """The profile hook: per code object, once, decide whether (and as what) it is reported."""

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        self.current: set[Entry] | None = None  # the set of functions of the test now running
        # id(code) -> (code, entry or None); the code is kept alive so that its id is never reused.
        self._codes: dict[int, tuple[CodeType, Entry | None]] = {}
        self._files: dict[str, str | None] = {}  # absolute file -> root-relative path or None
        self._qualnames: dict[str, dict[int, str]] = {}  # relative file -> {line: qualname} (pythons before 3.11)
        self._own = os.path.realpath(__file__)

    def profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or self.current is None:
            return
        code = frame.f_code
        cached = self._codes.get(id(code))
        if cached is None:
            cached = (code, self._entry(code))
            self._codes[id(code)] = cached
        if cached[1] is not None:
            self.current.add(cached[1])

    def _relative(self, filename: str) -> str | None:
        if filename not in self._files:
            path = os.path.realpath(filename)
            rel = None
            if path != self._own and path.endswith(".py") and path.startswith(self.root + os.sep):
                rel = os.path.relpath(path, self.root).replace(os.sep, "/")
                if is_test_file(rel) or excluded_dir(rel):
                    rel = None
            self._files[filename] = rel
        return self._files[filename]

    def _entry(self, code: CodeType) -> Entry | None:
        if not code.co_flags & CO_OPTIMIZED or code.co_name.startswith("<"):
            return None
        rel = self._relative(code.co_filename)
        if rel is None:
            return None
        qualname = getattr(code, "co_qualname", None) or self._ast_qualname(rel, code)
        return (rel, qualname, code.co_firstlineno)

    def _ast_qualname(self, rel: str, code: CodeType) -> str:
        if rel not in self._qualnames:
            try:
                with open(os.path.join(self.root, rel), encoding="utf-8") as f:
                    self._qualnames[rel] = ast_qualnames(f.read())
            except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
                self._qualnames[rel] = {}
        return self._qualnames[rel].get(code.co_firstlineno, code.co_name)


def report_outcome(report: Any, previous: str | None) -> str | None:
    """The test's outcome after one more phase report (setup, call, teardown)."""
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if xfail:
            return "xfailed" if report.outcome == "skipped" else "xpassed"
        return report.outcome
    if report.outcome == "failed":
        return previous if previous == "failed" else "error"
    if report.outcome == "skipped" and previous is None:
        return "xfailed" if xfail else "skipped"
    return previous


def make_plugin(recorder: Recorder, pytest: Any) -> Any:
    """A pytest plugin object that tells ``recorder`` which test runs and collects outcomes (pytest >= 3)."""

    class CoveragePlugin:
        def __init__(self) -> None:
            self.tests: dict[str, dict[str, Any]] = {}
            self.collect_errors: list[str] = []

        def _entry(self, nodeid: str) -> dict[str, Any]:
            return self.tests.setdefault(nodeid, {"outcome": None, "functions": set()})

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_protocol(self, item: Any, nextitem: Any) -> Iterator[None]:
            recorder.current = self._entry(item.nodeid)["functions"]
            yield
            recorder.current = None

        def pytest_runtest_logreport(self, report: Any) -> None:
            entry = self._entry(report.nodeid)
            entry["outcome"] = report_outcome(report, entry["outcome"])

        def pytest_collectreport(self, report: Any) -> None:
            if report.failed:
                self.collect_errors.append(report.nodeid)

        def result(self, exit_code: int) -> dict[str, Any]:
            tests = {
                nodeid: {"outcome": entry["outcome"] or "unknown", "functions": sorted(map(list, entry["functions"]))}
                for nodeid, entry in self.tests.items()
            }
            return {"exit_code": exit_code, "tests": tests, "collect_errors": self.collect_errors}

    return CoveragePlugin()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Per-test function coverage of a pytest run.")
    parser.add_argument("--root", required=True, help="project root; only functions in files under it count")
    parser.add_argument("--out", required=True, help="where to write the JSON report")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="-- then pytest's arguments")
    args = parser.parse_args(argv)
    if args.pytest_args and args.pytest_args[0] == "--":
        args.pytest_args = args.pytest_args[1:]
    return args


def run(root: str, pytest_args: list[str]) -> dict[str, Any]:
    """Run pytest in this process under the profile hook; returns the report dict."""
    import pytest

    recorder = Recorder(root)
    plugin = make_plugin(recorder, pytest)
    threading.setprofile(recorder.profile)
    sys.setprofile(recorder.profile)
    try:
        exit_code = pytest.main(list(pytest_args), plugins=[plugin])
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return plugin.result(int(exit_code))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import pytest  # noqa: F401
    except ImportError as exc:
        sys.stderr.write(f"func_coverage: cannot import pytest with {sys.executable}: {exc}\n")
        return 2
    # Import like `python -m pytest`: the working directory first, not this script's directory.
    if sys.path and os.path.realpath(sys.path[0] or ".") == os.path.dirname(os.path.realpath(__file__)):
        sys.path[0] = os.getcwd()
    else:
        sys.path.insert(0, os.getcwd())
    report = run(args.root, args.pytest_args)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, sort_keys=True)
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
