"""SWE-bench's per-repo, per-version environment specifications, and the repo -> log parser mapping.

swebench 5.x expects every row to carry its own ``image``/``eval_script``/``log_parser``/``eval_type`` and no
longer ships the specifications classic rows (SWE-bench, SWE-bench Verified, SWE-Gym) need. swebench 4.1.0
still has them as pure data in ``swebench/harness/constants/python.py``; ``scripts/fetch_swebench_specs.sh``
extracts that one file into the venv and :func:`load_specs` reads it from there.

Where the table comes from, first match wins:

1. the ``path`` argument of :func:`load_specs`,
2. the file named by ``$SWECTL_SWEBENCH_SPECS``,
3. ``<venv>/share/swectl/swebench-4.1.0/constants_python.py`` (what the fetch script writes),
4. ``swebench.harness.constants.MAP_REPO_VERSION_TO_SPECS`` when the installed swebench still has it (4.x).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from swectl.errors import SpecError

SPECS_ENV = "SWECTL_SWEBENCH_SPECS"
SPECS_SWEBENCH_VERSION = "4.1.0"
SPECS_RELPATH = Path("share", "swectl", f"swebench-{SPECS_SWEBENCH_VERSION}", "constants_python.py")
SPECS_TABLE_NAME = "MAP_REPO_VERSION_TO_SPECS_PY"
FETCH_HINT = "run scripts/fetch_swebench_specs.sh (it extracts them from the swebench==4.1.0 wheel)"
_MODULE_NAME = "_swectl_swebench4_specs"

# repo -> key of swebench 5.x's PARSER_REGISTRY, read off swebench 4.1.0's MAP_REPO_TO_PARSER_PY (which maps
# repos to functions; in both versions the per-repo names are aliases of the pytest/django/sympy parsers).
REPO_LOG_PARSERS: dict[str, str] = {
    "astropy/astropy": "parse_log_astropy",
    "django/django": "parse_log_django",
    "marshmallow-code/marshmallow": "parse_log_marshmallow",
    "matplotlib/matplotlib": "parse_log_matplotlib",
    "mwaskom/seaborn": "parse_log_seaborn",
    "pallets/flask": "parse_log_flask",
    "psf/requests": "parse_log_requests",
    "pvlib/pvlib-python": "parse_log_pvlib",
    "pydata/xarray": "parse_log_xarray",
    "pydicom/pydicom": "parse_log_pydicom",
    "pylint-dev/astroid": "parse_log_astroid",
    "pylint-dev/pylint": "parse_log_pylint",
    "pytest-dev/pytest": "parse_log_pytest",
    "pyvista/pyvista": "parse_log_pyvista",
    "scikit-learn/scikit-learn": "parse_log_scikit",
    "sqlfluff/sqlfluff": "parse_log_sqlfluff",
    "sphinx-doc/sphinx": "parse_log_sphinx",
    "sympy/sympy": "parse_log_sympy",
}

RawTable = Mapping[str, Mapping[str, Mapping[str, Any]]]


class RepoSpec(msgspec.Struct, kw_only=True, frozen=True):
    """How one (repo, version) of SWE-bench is installed and tested. Empty string / list means "not set"."""

    repo: str
    version: str
    python: str = ""
    # Conda packages for `conda create`, or the literal "requirements.txt" / "environment.yml".
    packages: str = ""
    pip_packages: list[str] = []
    # Shell commands run in the repo before `install` (image build).
    pre_install: list[str] = []
    # Installs the repo into the env; the official eval script re-runs it before the tests.
    install: str = ""
    # Shell commands run at the start of the eval script (locale setup, exports of LANG/LC_ALL, ...).
    eval_commands: list[str] = []
    test_cmd: str = ""
    # environment.yml: `conda create` + `conda env update` instead of `conda env create`.
    no_use_env: bool = False
    execute_test_as_nonroot: bool = False
    nano_cpus: int | None = None
    # Keys of the source table swectl does not interpret, verbatim.
    extra: dict[str, Any] = {}


_KNOWN_KEYS = frozenset(RepoSpec.__struct_fields__) - {"repo", "version", "extra"}


def _version_key(version: str) -> tuple[tuple[int, int | str], ...]:
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"[.\-]", version))


class SpecTable(msgspec.Struct, frozen=True):
    """The raw specification table (repo -> version -> dict) and where it was loaded from."""

    table: dict[str, dict[str, dict[str, Any]]]
    source: str

    def repos(self) -> list[str]:
        return sorted(self.table)

    def versions(self, repo: str) -> list[str]:
        return sorted(self.table.get(repo, {}), key=_version_key)

    def has(self, repo: str, version: str) -> bool:
        return version in self.table.get(repo, {})

    def get(self, repo: str, version: str) -> RepoSpec:
        """The spec of ``repo`` at ``version``; SpecError naming the known repos / versions otherwise."""
        versions = self.table.get(repo)
        if versions is None:
            raise SpecError(
                f"no SWE-bench spec for repo {repo!r} in {self.source}; known repos: {', '.join(self.repos())}"
            )
        raw = versions.get(version)
        if raw is None:
            known = ", ".join(self.versions(repo))
            raise SpecError(f"no SWE-bench spec for {repo} version {version!r} in {self.source}; known: {known}")
        return _to_repo_spec(repo, version, raw)


def _to_repo_spec(repo: str, version: str, raw: Mapping[str, Any]) -> RepoSpec:
    known = {k: v for k, v in raw.items() if k in _KNOWN_KEYS}
    extra = {k: v for k, v in raw.items() if k not in _KNOWN_KEYS}
    try:
        return msgspec.convert({**known, "repo": repo, "version": version, "extra": extra}, RepoSpec)
    except msgspec.ValidationError as exc:
        raise SpecError(f"SWE-bench spec for {repo} {version} is not a Python-repo spec: {exc}") from exc


def log_parser_name(repo: str) -> str:
    """The swebench 5.x PARSER_REGISTRY key that parses test logs of a classic SWE-bench ``repo``."""
    try:
        return REPO_LOG_PARSERS[repo]
    except KeyError:
        raise SpecError(
            f"no log parser known for repo {repo!r}: the row must carry `log_parser` "
            f"(known repos: {', '.join(sorted(REPO_LOG_PARSERS))})"
        ) from None


def default_spec_paths() -> list[Path]:
    """Where the fetch script puts the specs: the running venv, then this checkout's .venv."""
    candidates = [Path(sys.prefix) / SPECS_RELPATH, Path(__file__).resolve().parents[2] / ".venv" / SPECS_RELPATH]
    return list(dict.fromkeys(candidates))


def load_specs(path: Path | None = None) -> SpecTable:
    """Load the SWE-bench specification table (see the module docstring for where it is looked for)."""
    if path is None and os.environ.get(SPECS_ENV):
        path = Path(os.environ[SPECS_ENV])
    if path is not None:
        return _load_file(path)
    for candidate in default_spec_paths():
        if candidate.is_file():
            return _load_file(candidate)
    installed = _installed_table()
    if installed is not None:
        return installed
    searched = ", ".join(str(p) for p in default_spec_paths())
    raise SpecError(
        f"SWE-bench specifications not found (looked in {searched}; ${SPECS_ENV} unset; the installed swebench "
        f"has no MAP_REPO_VERSION_TO_SPECS): {FETCH_HINT}"
    )


def _load_file(path: Path) -> SpecTable:
    path = path.expanduser().resolve()
    if not path.is_file():
        raise SpecError(f"SWE-bench specifications file {path} does not exist: {FETCH_HINT}")
    return _load_file_cached(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _load_file_cached(path: str, mtime_ns: int) -> SpecTable:
    del mtime_ns  # part of the cache key only: a re-fetched file is read again
    module_spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
    if module_spec is None or module_spec.loader is None:
        raise SpecError(f"cannot load {path} as Python: {FETCH_HINT}")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise SpecError(f"{path} failed to load ({exc!r}): {FETCH_HINT}") from exc
    return _as_table(getattr(module, SPECS_TABLE_NAME, None), path)


def _installed_table() -> SpecTable | None:
    try:
        constants = importlib.import_module("swebench.harness.constants")
    except ImportError:
        return None
    raw = getattr(constants, "MAP_REPO_VERSION_TO_SPECS", None)
    if raw is None:
        return None
    return _as_table(raw, f"installed {constants.__name__}.MAP_REPO_VERSION_TO_SPECS")


def _as_table(raw: object, source: str) -> SpecTable:
    if not isinstance(raw, Mapping) or not raw:
        raise SpecError(f"{source} defines no usable {SPECS_TABLE_NAME}: {FETCH_HINT}")
    table = {
        str(repo): {str(version): dict(spec) for version, spec in versions.items()} for repo, versions in raw.items()
    }
    return SpecTable(table=table, source=source)
