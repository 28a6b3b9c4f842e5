"""What goes into an instance image's venv: a SWE-bench spec's requirements, read at the task's base commit.

The venv is filled in stages, each installed over the previous one (later pins win, as in SWE-bench's own
environment setup): the test runner (pytest, setuptools, wheel); the spec's ``packages`` (a package list, or
the repo's requirements.txt / environment.yml at the base commit); the project's ``build-system.requires``
and setup.cfg's ``setup_requires`` (build isolation is off); the spec's ``pip_packages``. The extras with which
the spec's ``install`` installs the project are noted, for its dependencies to be downloaded too. What pip
cannot take (URLs, pip options, invalid lines) is left out with a note.
"""

from __future__ import annotations

import ast
import configparser
import posixpath
import re
import shlex
import tomllib
from collections.abc import Iterable
from pathlib import Path

import msgspec
import yaml
from packaging.requirements import InvalidRequirement, Requirement

from swectl.images.clones import has_commit, read_at
from swectl.tasks.record import Task
from swectl.tasks.specs import RepoSpec

RUNNER_REQUIREMENTS = ("pytest", "setuptools", "wheel")
# Where SWE-bench's harness reads a repo's requirements when its spec says "requirements.txt" /
# "environment.yml" (swebench 4.1.0 constants); other repos: the file at the repository root.
REQS_PATHS: dict[str, tuple[str, ...]] = {
    "dbt-labs/dbt-core": ("dev-requirements.txt", "dev_requirements.txt"),
    "django/django": ("tests/requirements/py3.txt",),
    "matplotlib/matplotlib": ("requirements/dev/dev-requirements.txt", "requirements/testing/travis_all.txt"),
    "pallets/flask": ("requirements/dev.txt",),
    "pylint-dev/pylint": ("requirements_test.txt",),
    "pyvista/pyvista": ("requirements_test.txt", "requirements.txt"),
    "sqlfluff/sqlfluff": ("requirements_dev.txt",),
    "sympy/sympy": ("requirements-dev.txt", "requirements-test.txt"),
}
ENV_YML_PATHS: dict[str, tuple[str, ...]] = {
    "matplotlib/matplotlib": ("environment.yml",),
    "pydata/xarray": ("ci/requirements/environment.yml", "environment.yml"),
}
_CONDA_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)=([^=<>!~].*)$")
_CONDA_ONLY = frozenset({"python", "pip"})
# conda-forge packages that are C libraries (no PyPI distribution of that name installs them): the Debian packages
# that provide them, installed in the apt image when the build may use the network. cfgrib (xarray's rows) raises
# RuntimeError, not ImportError, without libeccodes, so the whole test module fails to collect.
_CONDA_C_LIBRARIES = {
    "eccodes": ("libeccodes-dev",), "hdf5": ("libhdf5-dev",), "libnetcdf": ("libnetcdf-dev",),
    "geos": ("libgeos-dev",), "proj": ("libproj-dev", "proj-bin"), "gdal": ("libgdal-dev",),
    "qhull": ("libqhull-dev",),
}
# conda-forge packages whose PyPI distribution needs a C library that conda brings along as a dependency (conda's
# cfgrib pulls in eccodes; pip's only the Python bindings): pip installs them, apt the library.
_CONDA_NEEDS_C_LIBRARY = {"cfgrib": ("libeccodes-dev",), "python-eccodes": ("libeccodes-dev",)}
# conda-forge packages whose PyPI distribution has another name. PyPI's "iris" is a placeholder whose import
# raises "Ambiguous 'iris' package" (it broke the test collection of every xarray row: all tests failed).
_CONDA_TO_PYPI = {"iris": "scitools-iris", "pytables": "tables", "matplotlib-base": "matplotlib", "pyqt": "pyqt5"}
_INCLUDE = re.compile(r"^(?:-r|--requirement)(?:\s*=\s*|\s+)(\S+)$")
# The project itself as a pip target in an install command: `.`, `.[dev]`, `'.[dev,test]'`.
_PROJECT_TARGET = re.compile(r"""(?:^|\s)(['"]?)\.(?:\[([^\]\s'"]*)\])?\1(?=\s|;|&|$)""")


class Stage(msgspec.Struct, frozen=True):
    """Requirements installed together, over the stages before them."""

    name: str
    requirements: list[str]


class Requirements(msgspec.Struct, frozen=True):
    """The stages of the image's venv, the project's extras (None: ``install`` does not install the project)
    and notes on what was left out and why."""

    stages: list[Stage]
    project_extras: list[str] | None = None
    notes: list[str] = []
    apt: list[str] = []  # Debian packages for the C libraries a conda environment.yml names (_CONDA_C_LIBRARIES)


def _pip_requirement(text: str, origin: str, notes: list[str]) -> str | None:
    """``text`` when pip can download it by name (a PEP 508 requirement without a URL); else None and a note."""
    try:
        req = Requirement(text)
    except InvalidRequirement:
        notes.append(f"{origin}: skipped {text!r}: not a requirement pip can download by name")
        return None
    if req.url:
        notes.append(f"{origin}: skipped {text!r}: URL requirements are not downloaded")
        return None
    return text


def _pip_lines(lines: Iterable[str], origin: str, notes: list[str]) -> list[str]:
    out: list[str] = []
    for line in lines:
        if line.startswith("-"):
            notes.append(f"{origin}: skipped {line!r}: pip options are not carried over")
            continue
        req = _pip_requirement(line, origin, notes)
        out += [req] if req else []
    return out


def conda_to_pip(spec: str, origin: str, notes: list[str]) -> str | None:
    """A conda package spec as a pip requirement (``name=1.2`` -> ``name==1.2``); None for python/pip."""
    spec = spec.split("::", 1)[-1].strip()
    match = _CONDA_PIN.match(spec)
    if match:
        version = match.group(2).split("=", 1)[0]  # drop a conda build string: name=1.2=py39_0
        spec = f"{match.group(1)}=={version}"
    name = conda_name(spec)
    if name in _CONDA_ONLY:
        return None
    if name in _CONDA_TO_PYPI:
        spec = _CONDA_TO_PYPI[name] + spec[len(name):]
    return _pip_requirement(spec, origin, notes)


# Conda's channels stopped building some packages for an old Python before a major release that PyPI still
# ships for it: a conda environment of that Python (what the official images have) gets the last build before
# the major, while pip resolving by date gets the new one. Cython 3 has cp36 wheels on PyPI, but no conda build
# for Python 3.6, and scikit-learn 0.2x does not compile with it (binary_tree.pxi: "Cannot assign type 'double'
# to 'ITYPE_t'"). Applied to the unpinned packages of a spec's conda package list.
CONDA_ERA_CAPS: dict[str, dict[str, str]] = {"3.6": {"cython": "<3"}}


def conda_era_caps(requirements: list[str], python: str, notes: list[str]) -> list[str]:
    """``requirements`` (from a conda package list) with the caps of ``CONDA_ERA_CAPS`` for ``python`` added to
    the unpinned ones it names, each with a note."""
    caps = CONDA_ERA_CAPS.get(".".join(python.split(".")[:2]), {})
    out = []
    for req in requirements:
        name = conda_name(req)
        if name in caps and req.strip().lower() == name:
            notes.append(f"spec packages: {name} capped {caps[name]} for python {python} (conda has no newer build "
                         "for it; pip by date would take one)")
            req = f"{req}{caps[name]}"
        out.append(req)
    return out


def _logical_lines(text: str) -> list[str]:
    """Requirements-file lines: comments dropped, backslash continuations joined, blanks removed."""
    joined = re.sub(r"\\\r?\n", "", text)
    lines = (re.sub(r"(^|\s)#.*$", "", line).strip() for line in joined.splitlines())
    return [line for line in lines if line]


def requirements_file(clone: Path, commit: str, path: str, notes: list[str], seen: set[str] | None = None) -> list[str]:
    """The requirements in ``path`` at ``commit`` (``-r`` includes followed); what pip cannot take is noted."""
    seen = seen if seen is not None else set()
    if path in seen:
        return []
    seen.add(path)
    text = read_at(clone, commit, path)
    if text is None:
        notes.append(f"{path}: not in the repository at {commit[:12]}")
        return []
    out: list[str] = []
    for line in _logical_lines(text):
        include = _INCLUDE.match(line)
        if include:
            target = posixpath.normpath(posixpath.join(posixpath.dirname(path), include.group(1)))
            out += requirements_file(clone, commit, target, notes, seen)
        else:
            out += _pip_lines([line], path, notes)
    return out


def conda_name(spec: str) -> str:
    """The package name of a conda spec (``conda-forge::eccodes>=2.1`` -> ``eccodes``), lowercased."""
    return re.split(r"[\s<>=!~\[;]", spec.split("::", 1)[-1].strip(), maxsplit=1)[0].lower()


def conda_c_libraries(text: str) -> list[str]:
    """The Debian packages for the C libraries an environment.yml's conda dependencies name (in order, once)."""
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        return []
    deps = doc.get("dependencies", []) if isinstance(doc, dict) else []
    names = [conda_name(d) for d in deps if isinstance(d, str)] if isinstance(deps, list) else []
    return list(dict.fromkeys(p for n in names
                              for p in _CONDA_C_LIBRARIES.get(n, ()) + _CONDA_NEEDS_C_LIBRARY.get(n, ())))


def environment_yml(text: str, origin: str, notes: list[str]) -> list[str]:
    """The requirements in a conda environment.yml: conda dependencies (as pip requirements; C libraries left to
    ``conda_c_libraries``) and its pip list."""
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        notes.append(f"{origin}: not valid YAML ({exc}); nothing taken from it")
        return []
    deps = doc.get("dependencies", []) if isinstance(doc, dict) else []
    out: list[str] = []
    for dep in deps if isinstance(deps, list) else []:
        if isinstance(dep, str) and conda_name(dep) in _CONDA_C_LIBRARIES:
            continue  # a C library: from apt (conda_c_libraries)
        if isinstance(dep, str):
            req = conda_to_pip(dep, origin, notes)
            out += [req] if req else []
        elif isinstance(dep, dict) and isinstance(dep.get("pip"), list):
            out += _pip_lines(map(str, dep["pip"]), origin, notes)
    return out


def _repo_file_requirements(task: Task, spec: RepoSpec, clone: Path, commit: str,
                            notes: list[str]) -> tuple[list[str], list[str]]:
    """The requirements file / environment.yml the spec names, read where the official harness reads it: at the
    row's environment setup commit (the same commit for every row of a (repo, version), so its rows share one
    environment), else at the base commit; and the Debian packages of the C libraries an environment.yml names."""
    kind = spec.packages
    paths = (REQS_PATHS if kind == "requirements.txt" else ENV_YML_PATHS).get(task.repo, (kind,))
    commits = [c for c in dict.fromkeys((task.environment_setup_commit, commit)) if c and has_commit(clone, c)]
    setup = task.environment_setup_commit
    if setup and setup != commit and setup not in commits:
        notes.append(f"the clone lacks the environment setup commit {setup[:12]}: {kind} read at the base commit, "
                     f"so rows of {task.repo} {task.version} may not share one environment")
    for at in commits:
        for path in paths:
            text = read_at(clone, at, path)
            if text is None:
                continue
            if kind == "requirements.txt":
                return requirements_file(clone, at, path, notes), []
            return environment_yml(text, path, notes), conda_c_libraries(text)
    notes.append(f"spec packages {kind!r}: none of {', '.join(paths)} is in the repository; nothing installed")
    return [], []


def _setup_requires(clone: Path, commit: str, notes: list[str]) -> list[str]:
    """setup.cfg's ``[options] setup_requires`` (setuptools fetches them itself, which offline it cannot)."""
    text = read_at(clone, commit, "setup.cfg")
    if text is None:
        return []
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(text)
    except configparser.Error as exc:
        notes.append(f"setup.cfg: not readable ({exc}); setup_requires not taken")
        return []
    lines = parser.get("options", "setup_requires", fallback="").replace(";", "\n;").splitlines()
    joined: list[str] = []
    for line in (ln.strip() for ln in lines):
        if line.startswith(";") and joined:
            joined[-1] += line  # a marker continued on its own line
        elif line:
            joined.append(line)
    return _pip_lines(joined, "setup.cfg setup_requires", notes)


def _setup_py_tree(clone: Path, commit: str, keyword: str, notes: list[str]) -> ast.Module | None:
    """setup.py's syntax tree at ``commit`` when it mentions ``keyword``; None when it does not, is missing, or
    does not parse (with a note)."""
    text = read_at(clone, commit, "setup.py")
    if text is None or keyword not in text:
        return None
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError) as exc:
        notes.append(f"setup.py: not parsable ({exc}); its {keyword} not taken")
        return None


def _setup_py_requires(clone: Path, commit: str, notes: list[str]) -> list[str]:
    """The literal ``setup_requires`` of setup.py, read (never run) from its syntax tree: ``setup_requires = [...]``,
    ``setup_requires.extend([...])`` / ``.append(...)`` / ``+= [...]`` and ``setup(setup_requires=[...])``.
    astropy 3.x adds ``cython`` and ``jinja2`` this way when built from a git checkout."""
    tree = _setup_py_tree(clone, commit, "setup_requires", notes)
    if tree is None:
        return []

    def strings(node: ast.AST | None) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.List | ast.Tuple):
            return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        return []

    def named(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id == "setup_requires"

    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(named(t) for t in node.targets):
            found += strings(node.value)
        elif isinstance(node, ast.AugAssign) and named(node.target):
            found += strings(node.value)
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and named(func.value) and func.attr in ("extend", "append"):
                found += [x for arg in node.args for x in strings(arg)]
            found += [x for kw in node.keywords if kw.arg == "setup_requires" for x in strings(kw.value)]
    return _pip_lines(dict.fromkeys(found), "setup.py setup_requires", notes)


_LEADING_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def setup_py_install_requires(clone: Path, commit: str) -> list[str]:
    """The distributions setup.py's ``setup(install_requires=[...])`` names, read (never run) from its syntax tree:
    literal entries as written; an entry built from a string (``'numpy>={}'.format(NUMPY_MIN_VERSION)``,
    ``'scipy>=' + V``) by the name it starts with, unversioned. For a project whose metadata cannot be prepared on
    the host (scikit-learn 0.2x: its setup.py needs numpy and an old setuptools to say what it requires), so its
    dependencies are still downloaded (as of the image's date) for the offline install."""
    tree = _setup_py_tree(clone, commit, "install_requires", [])
    if tree is None:
        return []

    def leading(node: ast.AST) -> str:
        """The requirement, or the name a string expression starts with."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        inner = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else \
            node.left if isinstance(node, ast.BinOp) else \
            node.values[0] if isinstance(node, ast.JoinedStr) and node.values else None
        if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
            match = _LEADING_NAME.match(inner.value)
            return match.group(1) if match else ""
        return ""

    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "install_requires" and isinstance(kw.value, ast.List | ast.Tuple):
                    found += [x for x in map(leading, kw.value.elts) if x]
    return _pip_lines(dict.fromkeys(found), "setup.py install_requires", [])


def _build_requires(clone: Path, commit: str, notes: list[str], pinned: frozenset[str] = frozenset()) -> list[str]:
    """pyproject.toml's ``build-system.requires`` and setup.cfg's and setup.py's ``setup_requires`` (build isolation
    is off). setup.py's leave out the packages in ``pinned`` (the spec's pip_packages pin them, and a newer one
    installed first drags newer dependencies in: astropy 1.3's ``jinja2>=2.7`` against the spec's jinja2==2.10)."""
    text = read_at(clone, commit, "pyproject.toml")
    requires: list[object] = []
    if text is not None:
        try:
            requires = tomllib.loads(text).get("build-system", {}).get("requires", [])
        except tomllib.TOMLDecodeError as exc:
            notes.append(f"pyproject.toml: not valid TOML ({exc}); build requirements not taken")
    found = _pip_lines(map(str, requires), "pyproject.toml build-system.requires", notes)
    from_setup_py = [r for r in _setup_py_requires(clone, commit, notes) if conda_name(r) not in pinned]
    return list(dict.fromkeys([*found, *_setup_requires(clone, commit, notes), *from_setup_py]))


def project_extras(install: str) -> list[str] | None:
    """The extras with which ``install`` installs the project (``pip install -e .[dev]`` -> ["dev"]; a
    ``setup.py`` command -> []); None when it does not install the project."""
    extras: list[str] = []
    found = "setup.py" in install
    for match in _PROJECT_TARGET.finditer(install):
        found = True
        extras += [e.strip() for e in (match.group(2) or "").split(",") if e.strip()]
    return list(dict.fromkeys(extras)) if found else None


def spec_requirements(task: Task, spec: RepoSpec, clone: Path, commit: str) -> Requirements:
    """The stages of the venv: test runner, the spec's packages, build requirements, the spec's pip_packages."""
    notes: list[str] = []
    apt: list[str] = []
    if spec.packages in ("requirements.txt", "environment.yml"):
        packages, apt = _repo_file_requirements(task, spec, clone, commit, notes)
    else:
        packages = [r for r in (conda_to_pip(p, "spec packages", notes) for p in shlex.split(spec.packages)) if r]
        packages = conda_era_caps(packages, spec.python, notes)
    stages = [
        Stage(name="runner", requirements=list(RUNNER_REQUIREMENTS)),
        Stage(name="packages", requirements=list(dict.fromkeys(packages))),
        Stage(name="build", requirements=_build_requires(
            clone, commit, notes, pinned=frozenset(conda_name(p) for p in spec.pip_packages))),
        Stage(name="pip_packages", requirements=_pip_lines(spec.pip_packages, "spec pip_packages", notes)),
    ]
    return Requirements(stages=[s for s in stages if s.requirements], project_extras=project_extras(spec.install),
                        notes=notes, apt=apt)
