"""The patch policy (docs/grading.md, layer 1): what of a submitted diff the grader applies, drops or refuses.

The grader sees only the diff. Edits to the test suite are dropped (the eval script runs the task's own tests, as
before). Edits that configure the test runner or the interpreter's start-up, forge its inputs (bytecode, compiled
modules, git metadata, symlinks) or shadow a module the runner imports have no place in a fix: the grade is
``tampered`` (no reward, counted). Each rule was checked against the gold patches of the 500 SWE-bench Verified rows
(tests/test_patch_policy.py): none of them trips it.

A Harbor task's patch (``review_harbor_patch``) is reviewed by a narrower policy: its verifier is the task's own
``tests/test.sh``, run from ``/tests`` (outside the work folder the patch edits), so a Makefile, a tests folder, a
symlink or a compiled file may be the task itself. What stays ``tampered``: git metadata, interpreter start-up hooks,
a new top-level module shadowing the test runner (pytest and its plugins), pytest's own configuration at the root
of the work folder, and added lines that reach into pytest (its plugin hooks, ``PYTEST_*``, ``report.outcome``).

Three files mix runner settings with project metadata (``setup.cfg``, ``tox.ini``, ``pyproject.toml``): an honest fix
may add a dependency there. They are applied, and the grader compares their runner sections before and after
(swectl.grading.runner_config); a change there is ``tampered``.
"""

from __future__ import annotations

import re
import sys

import msgspec

from swectl.grading.eval_script import FileDiff, file_diffs
from swectl.grading.rules import is_test_path

# Files whose only job is to configure or drive the test run.
RUNNER_FILES = frozenset({"pytest.ini", ".pytest.ini", "noxfile.py", "Makefile", "makefile", "GNUmakefile",
                          "runtests.py", "setup_test.py"})
RUNNER_SCRIPTS = frozenset({"bin/test", "bin/runtests", "run_tests.sh", "runtests.sh"})
# Files that mix runner settings with project metadata: applied, their runner sections compared after applying.
MIXED_CONFIG_FILES = frozenset({"setup.cfg", "tox.ini", "pyproject.toml"})
STARTUP_FILES = frozenset({"sitecustomize.py", "usercustomize.py"})
FORGED_SUFFIXES = (".pth", ".pyc", ".pyo", ".so", ".pyd", ".dll", ".dylib")
GIT_METADATA = frozenset({".gitattributes", ".gitmodules"})
# Modules the test runners import, besides the standard library: a new top-level module of that name shadows them.
RUNNER_MODULES = frozenset({"pytest", "_pytest", "pluggy", "py", "iniconfig", "packaging", "exceptiongroup", "tomli",
                            "colorama", "nose", "nose2", "tox", "coverage", "xdist", "hypothesis", "django",
                            "sympy", "setuptools", "pkg_resources", "distutils", "pip", "_distutils_hack"})
SOURCE_ROOTS = ("src", "lib")
# Added lines (outside the test suite) that reach into the runner, its outcome or its output. No gold patch of the
# 500 Verified rows adds any of them.
SUSPICIOUS_TOKENS = (
    "PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD", "pytest11", "pytest_runtest_",
    "pytest_collection", "pytest_report_", "pytest_terminal_summary", "pytest_sessionfinish", "pytest_configure",
    "pytest_load_initial_conftests", "pytest_cmdline", "pytest_plugin_registered", "pluginmanager",
    "report.outcome", "os._exit", "sys.stdout.close", "sys.__stdout__", "os.dup2", "atexit", "SkipTest",
    "pytest.skip", "skipTest", "pytest.xfail", "sitecustomize", "usercustomize", "gc.get_objects",
    "sys.settrace", "sys.setprofile", "PYTHONSTARTUP",
)
_SYMLINK_MODE = re.compile(r"^(new file mode|new mode) 120000\s*$", re.M)
_PLAIN_NEW_NAME = re.compile(r"^\+\+\+ (?:b/)?([^\t\n]+)", re.M)


class PolicyVerdict(msgspec.Struct, frozen=True):
    """What the grader does with a patch: applies ``patch``, reports the dropped test files, and grades it
    ``tampered`` when ``tampered`` is not empty; ``check_configs`` are the mixed config files to compare after
    applying."""
    patch: str
    dropped: list[str] = []
    tampered: list[str] = []  # "path: why" per offending file or line
    check_configs: list[str] = []
    # (the module's top in the repository, "path: why"): created files that shadow a module unless the repository
    # had that top before (the grader asks git in the sandbox)
    shadows: list[tuple[str, str]] = []

    @property
    def is_tampered(self) -> bool:
        return bool(self.tampered)


def module_shadows(path: str, pythonpath: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """The module a created file would shadow, and the repository path of that module's top (its file or package
    folder), when the file sits at the top of the repository or of a source root (``src``, ``lib``, a
    ``PYTHONPATH`` folder of the test command). It shadows only if the repository did not have that top before:
    pytest's own repository creating ``src/_pytest/new.py`` adds to its package (the grader checks in the sandbox)."""
    for root in sorted({"", *SOURCE_ROOTS, *(p.strip("/") for p in pythonpath)}):
        if root and not path.startswith(root + "/"):
            continue
        rest = path[len(root) + 1:] if root else path
        head, _, below = rest.partition("/")
        if not below and not head.endswith(".py"):
            continue
        name = head.removesuffix(".py") if not below else head
        if name in RUNNER_MODULES or name in sys.stdlib_module_names or name.startswith("pytest_"):
            return name, f"{root}/{head}" if root else head
    return None


def path_offence(path: str) -> str:
    """Why a path may not be in a fix ("" when it may); shadowing modules are ``module_shadows``'s."""
    parts = path.split("/")
    name = parts[-1]
    if ".git" in parts or name in GIT_METADATA:
        return "edits git metadata"
    if "__pycache__" in parts or name.endswith(FORGED_SUFFIXES):
        return "adds or edits a compiled module or a .pth start-up file"
    if name in STARTUP_FILES:
        return "adds or edits an interpreter start-up hook"
    if name in RUNNER_FILES or path in RUNNER_SCRIPTS:
        return "edits the test runner's configuration or scripts"
    return ""


def _added_lines(text: str) -> list[str]:
    return [ln[1:] for ln in text.split("\n") if ln.startswith("+") and not ln.startswith("+++")]


def content_offence(text: str) -> str:
    """Why a file section's added lines may not be in a fix ("" when they may)."""
    for line in _added_lines(text):
        for token in SUSPICIOUS_TOKENS:
            if token in line:
                return f"adds a line that reaches into the test run ({token!r})"
    return ""


def _section_offences(f: FileDiff) -> list[str]:
    found = []
    for path in dict.fromkeys(p for p in (f.old, f.new, f.path) if p):
        if why := path_offence(path):
            found.append(f"{path}: {why}")
    if _SYMLINK_MODE.search(f.text):
        found.append(f"{f.path}: creates a symbolic link")
    if "GIT binary patch" in f.text and f.path.endswith((".py", ".cfg", ".ini", ".toml", ".txt", ".sh")):
        found.append(f"{f.path}: a text file sent as a binary patch (its lines cannot be read)")
    if why := content_offence(f.text):
        found.append(f"{f.path}: {why}")
    return found


def review_patch(patch: str, extra_test_files: frozenset[str] = frozenset(), *,
                 pythonpath: tuple[str, ...] = ()) -> PolicyVerdict:
    """Apply the policy to a patch: drop its test edits, list what makes it ``tampered`` and the mixed config files
    it edits. ``pythonpath``: folders the test command puts on ``PYTHONPATH`` (new modules there shadow too). A
    patch without git headers (plain ``diff -u``) is kept whole (the eval script's reset of the test files holds)
    and reviewed by its ``+++`` names and added lines."""
    files = file_diffs(patch)
    if not files:
        names = _PLAIN_NEW_NAME.findall(patch)
        tampered = [f"{n}: {why}" for n in names if n != "/dev/null" and (why := path_offence(n))]
        if why := content_offence(patch):
            tampered.append(f"(plain diff): {why}")
        mixed = [n for n in names if n.rsplit("/", 1)[-1] in MIXED_CONFIG_FILES]
        return PolicyVerdict(patch, tampered=tampered, check_configs=mixed)
    kept: list[FileDiff] = []
    dropped: list[str] = []
    tampered = []
    shadows: list[tuple[str, str]] = []
    for f in files:
        if is_test_path(f.path) or (f.old is not None and is_test_path(f.old)) or f.path in extra_test_files:
            dropped.append(f.path)
            continue
        kept.append(f)
        tampered += _section_offences(f)
        if f.old is None and (shadowed := module_shadows(f.path, pythonpath)):
            shadows.append((shadowed[1], f"{f.path}: creates a module that shadows {shadowed[0]!r}"))
    mixed = [f.path for f in kept if f.path.rsplit("/", 1)[-1] in MIXED_CONFIG_FILES]
    return PolicyVerdict("".join(f.text for f in kept), dropped=dropped, tampered=tampered, check_configs=mixed,
                         shadows=list(dict.fromkeys(shadows)))


# The pytest-facing part of SUSPICIOUS_TOKENS: what a Harbor verifier that runs pytest can be reached through.
HARBOR_TOKENS = tuple(t for t in SUSPICIOUS_TOKENS if "pytest" in t.lower() or t in (
    "report.outcome", "pluginmanager", "sitecustomize", "usercustomize", "PYTHONSTARTUP"))
HARBOR_RUNNER_FILES = frozenset({"pytest.ini", ".pytest.ini", "conftest.py"})


def review_harbor_patch(patch: str) -> PolicyVerdict:
    """The policy for a Harbor task's patch of its work folder: nothing dropped; ``tampered`` for git metadata,
    start-up hooks, runner shadows, pytest configuration at the root and lines that reach into pytest."""
    tampered: list[str] = []
    shadows: list[tuple[str, str]] = []
    for f in file_diffs(patch):
        for path in dict.fromkeys(p for p in (f.old, f.new, f.path) if p):
            parts = path.split("/")
            if ".git" in parts or parts[-1] in GIT_METADATA:
                tampered.append(f"{path}: edits git metadata")
            elif parts[-1] in STARTUP_FILES or parts[-1].endswith(".pth"):
                tampered.append(f"{path}: adds or edits an interpreter start-up hook")
            elif path in HARBOR_RUNNER_FILES:
                tampered.append(f"{path}: configures pytest at the root of the work folder")
        for line in _added_lines(f.text):
            if token := next((t for t in HARBOR_TOKENS if t in line), None):
                tampered.append(f"{f.path}: adds a line that reaches into the test run ({token!r})")
                break
        head = f.path.split("/", 1)[0].removesuffix(".py")
        if f.old is None and (head in RUNNER_MODULES - set(sys.stdlib_module_names) or head.startswith("pytest")):
            shadows.append((f.path.split("/", 1)[0], f"{f.path}: creates a module that shadows {head!r}"))
    if not file_diffs(patch) and patch.strip():
        tampered.append("(plain diff): a Harbor task's patch must be a git diff of its work folder")
    return PolicyVerdict(patch, tampered=tampered, shadows=list(dict.fromkeys(shadows)))
