"""Instance images for classic SWE-bench rows, built offline from a local clone of each task's repository.

One image per task, on swectl's base image (Debian with python3.11, no conda):

- ``/testbed`` is the task's repository at ``base_commit``: a fresh git repository holding only the history up
  to that commit (and the tags on it), fetched from the clone in the repo cache. Later commits, which often
  contain the fix, are not in the image.
- ``/opt/venv`` is a virtual environment (first on PATH) filled in stages, each installed over the previous one
  (later pins win, as in SWE-bench's own environment setup): the test runner (pytest, setuptools, wheel); the
  spec's ``packages`` (a package list, or the repo's requirements.txt / environment.yml at the base commit);
  the project's ``build-system.requires`` (build isolation is off); the spec's ``pip_packages``. The
  dependencies of the project itself (with the extras its ``install`` command names) are downloaded too, for
  ``install`` to find offline.
- Every distribution comes from the host: ``pip download --only-binary :all: --python-version 3.11`` per stage,
  into a shared pool under ``cache_dir()/wheels``, each stage's file list cached. A stage that has a
  requirement without a py3.11 wheel is downloaded again with ``--prefer-binary`` (sdists where there is no
  wheel, dependencies still resolved; the host runs Python 3.11 like the image), and when that fails too, one
  requirement at a time (its wheel with dependencies, else its sdist alone, else dropped with a warning).
  Sdists are built in the image, offline; one that does not build is dropped with a warning.
- pip is offline for good (``PIP_NO_INDEX=1``, ``PIP_FIND_LINKS=/opt/swectl-wheels``, build isolation off)
  so the spec's ``install`` command runs unchanged at build time and again in the eval script, in a sandbox
  without network.
- ``/opt/miniconda3/bin/activate`` is a conda shim: sourcing it defines a ``conda`` shell function whose
  ``conda activate <env>`` activates ``/opt/venv`` and whose ``conda deactivate`` does nothing, so the
  official eval scripts (``source /opt/miniconda3/bin/activate; conda activate testbed``) run unchanged.

The spec's ``python`` is not honoured: every image runs the base image's Python 3.11, so pins that never got a
3.11 build are built from source or dropped, with warnings. Dependency layers come first in the Containerfile:
tasks of one spec with the same wheels share them through podman's layer cache.

The spec's ``pre_install`` lines that need the network (apt-get, wget, curl, conda, pip) are skipped with a
warning unless ``allow_network``; the others (sed edits of setup.py, ...) run, a failure being a warning. The
``install`` command must succeed. The build runs ``podman build --network none``; images carry the label
``swectl.content`` (a hash of everything that goes into them) and are rebuilt only when it changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal

import msgspec
import yaml
from packaging.requirements import InvalidRequirement, Requirement

from swectl.errors import SwectlError
from swectl.images.names import docker_id
from swectl.images.project import (
    DEFAULT_BASE,
    VENV,
    BuiltImage,
    ImageBuildError,
    cache_dir,
    image_id,
    image_label,
    podman_env,
)
from swectl.tasks.record import TESTBED, Task
from swectl.tasks.specs import RepoSpec, SpecTable

Say = Callable[[str], None]

INSTANCE_PREFIX = "localhost/swectl-inst."
# Bump when the recipe changes in a way the content hash does not see (it sees every generated file).
RECIPE_VERSION = "1"
PYTHON_VERSION = "3.11"
# The host can resolve sdists (and their dependencies) for the image only when it runs the image's Python.
HOST_IS_TARGET = f"{sys.version_info.major}.{sys.version_info.minor}" == PYTHON_VERSION
WHEELS = "/opt/swectl-wheels"
TOOLS = "/opt/swectl"
CONDA_ACTIVATE = "/opt/miniconda3/bin/activate"
RUNNER_REQUIREMENTS = ("pytest", "setuptools", "wheel")
WARNING_TAG = "swectl-warning:"
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
# A pre_install line that runs one of these needs the network.
_NETWORK_STEP = re.compile(r"(?:^|[\s;&|(`])(?:apt-get|apt|wget|curl|conda|pip3?|git\s+clone)(?=\s|$)")
_CONDA_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)=([^=<>!~].*)$")
_CONDA_ONLY = frozenset({"python", "pip"})
_INCLUDE = re.compile(r"^(?:-r|--requirement)(?:\s*=\s*|\s+)(\S+)$")
# The project itself as a pip target in an install command: `.`, `.[dev]`, `'.[dev,test]'`.
_PROJECT_TARGET = re.compile(r"""(?:^|\s)(['"]?)\.(?:\[([^\]\s'"]*)\])?\1(?=\s|;|&|$)""")
_BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Stage(msgspec.Struct, frozen=True):
    """Requirements installed together, over the stages before them."""

    name: str
    requirements: list[str]


class StageWheels(msgspec.Struct, frozen=True):
    """A stage's downloaded files (in the pool) and the requirement lines installed from them."""

    name: str
    install: list[str]
    files: list[str]
    notes: list[str] = []


class Requirements(msgspec.Struct, frozen=True):
    """The stages of the image's venv, the project's extras (None: ``install`` does not install the project)
    and notes on what was left out and why."""

    stages: list[Stage]
    project_extras: list[str] | None = None
    notes: list[str] = []


BuildStatus = Literal["built", "cached", "failed", "skipped"]


class InstanceOutcome(msgspec.Struct, kw_only=True):
    """The outcome of building one task's image (``build_instance_images``)."""

    instance_id: str
    status: BuildStatus
    image: str = ""
    message: str = ""
    warnings: list[str] = []
    seconds: float = 0.0
    built: BuiltImage | None = None

    @property
    def ok(self) -> bool:
        return self.status in ("built", "cached")


# --- names and clones --------------------------------------------------------------------------------------


def instance_image_name(task: Task) -> str:
    """``localhost/swectl-inst.<id>:latest`` with the id lowercased and ``__`` written ``_1776_``."""
    return f"{INSTANCE_PREFIX}{docker_id(task.instance_id)}:latest"


def _git(*args: str, input: bytes | None = None, check: bool = False) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}
    return subprocess.run(["git", *args], input=input, capture_output=True, env=env, timeout=1800, check=check)


def _is_git_repo(path: Path) -> bool:
    return path.is_dir() and _git("-C", str(path), "rev-parse", "--git-dir").returncode == 0


def clone_candidates(repo_cache: Path, repo: str) -> list[Path]:
    """Where a clone of ``owner/name`` may live in the repo cache, in the order they are tried."""
    owner, _, name = repo.partition("/")
    stems = [repo_cache / f"{owner}__{name}", repo_cache / owner / name, repo_cache / name]
    return [*stems, *(s.with_name(s.name + ".git") for s in stems)]


def find_clone(repo_cache: Path, repo: str) -> Path:
    """The clone (work tree or bare) of ``repo`` in ``repo_cache``: ``owner__name``, ``owner/name`` or ``name``
    (each also with a ``.git`` suffix)."""
    tried = clone_candidates(Path(repo_cache), repo)
    for path in tried:
        if _is_git_repo(path):
            return path
    listed = "\n  ".join(str(p) for p in tried)
    raise ImageBuildError(
        f"no git clone of {repo} in the repo cache {repo_cache}; tried:\n  {listed}\n"
        f"  hint: git clone https://github.com/{repo} {tried[0]}"
    )


def resolve_commit(clone: Path, commit: str) -> str:
    """The full hash of ``commit`` in ``clone``; ImageBuildError when the clone does not have it."""
    if not commit:
        raise ImageBuildError("the task has no base_commit")
    proc = _git("-C", str(clone), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    if proc.returncode != 0:
        raise ImageBuildError(
            f"commit {commit} is not in the clone {clone}\n"
            f"  hint: update it (git -C {clone} fetch --all --tags) or fetch the commit itself "
            f"(git -C {clone} fetch origin {commit})"
        )
    return proc.stdout.decode().strip()


def _read_at(clone: Path, commit: str, path: str) -> str | None:
    proc = _git("-C", str(clone), "cat-file", "blob", f"{commit}:{path}")
    return proc.stdout.decode(errors="replace") if proc.returncode == 0 else None


def _ancestor_tags(clone: Path, commit: str) -> list[str]:
    proc = _git("-C", str(clone), "for-each-ref", "--merged", commit, "--format=%(refname)", "refs/tags", check=True)
    return sorted(proc.stdout.decode().split())


def prepare_testbed(clone: Path, commit: str, into: Path, tags: list[str]) -> None:
    """A fresh repository at ``into`` holding ``commit`` (checked out on branch main), its history and ``tags``
    (tags on that history) and nothing else: no later commits, no remote pointing at the host."""
    if into.exists():
        shutil.rmtree(into)
    into.parent.mkdir(parents=True, exist_ok=True)
    _git("-c", "init.defaultBranch=main", "init", "-q", str(into), check=True)
    refspecs = "".join(f"+{t}:{t}\n" for t in tags).encode()
    fetch = _git("-C", str(into), "fetch", "-q", "--no-tags", "--stdin", str(clone.resolve()), commit, input=refspecs)
    if fetch.returncode != 0:
        raise ImageBuildError(f"fetching {commit} from {clone} failed: {fetch.stderr.decode(errors='replace')}")
    _git("-C", str(into), "-c", "core.autocrlf=false", "checkout", "-q", "-B", "main", commit, check=True)
    (into / ".git" / "FETCH_HEAD").unlink(missing_ok=True)


class _Testbed:
    """The build context's /testbed, checked out on first use (the project's dependencies are resolved from
    it; a cached image needs neither)."""

    def __init__(self, clone: Path, commit: str, tags: list[str], path: Path, say: Say) -> None:
        self.clone, self.commit, self.tags, self.path, self._say = clone, commit, tags, path, say
        self.ready = False

    def get(self) -> Path:
        if not self.ready:
            self._say(f"preparing {TESTBED} at {self.commit[:12]} ({len(self.tags)} tags)")
            prepare_testbed(self.clone, self.commit, self.path, self.tags)
            self.ready = True
        return self.path

    def clean(self) -> None:
        """Drop whatever resolving the project's dependencies wrote into the work tree (egg-info, build/)."""
        if self.ready:
            _git("-C", str(self.path), "clean", "-fdxq", check=True)


# --- requirements ------------------------------------------------------------------------------------------


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
    name = re.split(r"[\s<>=!~\[;]", spec, maxsplit=1)[0].lower()
    if name in _CONDA_ONLY:
        return None
    return _pip_requirement(spec, origin, notes)


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
    text = _read_at(clone, commit, path)
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


def environment_yml(text: str, origin: str, notes: list[str]) -> list[str]:
    """The requirements in a conda environment.yml: conda dependencies (as pip requirements) and its pip list."""
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        notes.append(f"{origin}: not valid YAML ({exc}); nothing taken from it")
        return []
    deps = doc.get("dependencies", []) if isinstance(doc, dict) else []
    out: list[str] = []
    for dep in deps if isinstance(deps, list) else []:
        if isinstance(dep, str):
            req = conda_to_pip(dep, origin, notes)
            out += [req] if req else []
        elif isinstance(dep, dict) and isinstance(dep.get("pip"), list):
            out += _pip_lines(map(str, dep["pip"]), origin, notes)
    return out


def _has_commit(clone: Path, commit: str) -> bool:
    return bool(commit) and _git("-C", str(clone), "cat-file", "-e", f"{commit}^{{commit}}").returncode == 0


def _repo_file_requirements(task: Task, spec: RepoSpec, clone: Path, commit: str, notes: list[str]) -> list[str]:
    """The requirements file / environment.yml the spec names, at the base commit (else at the environment
    setup commit, where SWE-bench reads it)."""
    kind = spec.packages
    paths = (REQS_PATHS if kind == "requirements.txt" else ENV_YML_PATHS).get(task.repo, (kind,))
    commits = [c for c in (commit, task.environment_setup_commit) if _has_commit(clone, c)]
    for at in commits:
        for path in paths:
            text = _read_at(clone, at, path)
            if text is None:
                continue
            if kind == "requirements.txt":
                return requirements_file(clone, at, path, notes)
            return environment_yml(text, path, notes)
    notes.append(f"spec packages {kind!r}: none of {', '.join(paths)} is in the repository; nothing installed")
    return []


def _build_requires(clone: Path, commit: str, notes: list[str]) -> list[str]:
    text = _read_at(clone, commit, "pyproject.toml")
    if text is None:
        return []
    try:
        requires = tomllib.loads(text).get("build-system", {}).get("requires", [])
    except tomllib.TOMLDecodeError as exc:
        notes.append(f"pyproject.toml: not valid TOML ({exc}); build requirements not taken")
        return []
    return _pip_lines(map(str, requires), "pyproject.toml build-system.requires", notes)


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
    if spec.packages in ("requirements.txt", "environment.yml"):
        packages = _repo_file_requirements(task, spec, clone, commit, notes)
    else:
        packages = [r for r in (conda_to_pip(p, "spec packages", notes) for p in shlex.split(spec.packages)) if r]
    stages = [
        Stage(name="runner", requirements=list(RUNNER_REQUIREMENTS)),
        Stage(name="packages", requirements=list(dict.fromkeys(packages))),
        Stage(name="build", requirements=_build_requires(clone, commit, notes)),
        Stage(name="pip_packages", requirements=_pip_lines(spec.pip_packages, "spec pip_packages", notes)),
    ]
    return Requirements(stages=[s for s in stages if s.requirements], project_extras=project_extras(spec.install),
                        notes=notes)


# --- wheels ------------------------------------------------------------------------------------------------


DownloadMode = Literal["binary", "prefer-binary", "sdist-only"]


def _attempt(argv: list[str], log: Path, *, timeout: float = 1800) -> bool:
    """Run ``argv``, appending its output to ``log``; whether it succeeded."""
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=timeout)
        ok, output = proc.returncode == 0, (proc.stdout + proc.stderr).decode(errors="replace")
    except subprocess.TimeoutExpired as exc:
        ok, output = False, f"timed out after {timeout:g} s: {exc}\n"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a", encoding="utf-8") as f:
        f.write("$ " + shlex.join(argv) + "\n" + output + ("" if ok else "(failed)\n"))
    return ok


def _pip_download(requirements: list[str], dest: Path, log: Path, mode: DownloadMode) -> bool:
    """``pip download`` for the image's Python. binary: wheels with dependencies; prefer-binary: sdists where
    there is no wheel, dependencies resolved (host Python only); sdist-only: the distribution alone."""
    argv = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--progress-bar", "off", "-q",
            "-d", str(dest)]
    argv += {
        "binary": ["--only-binary", ":all:", "--python-version", PYTHON_VERSION],
        "prefer-binary": ["--prefer-binary"],
        "sdist-only": ["--no-deps", "--python-version", PYTHON_VERSION],
    }[mode]
    return _attempt([*argv, *requirements], log)


def _sdists_note(dest: Path) -> str:
    sdists = sorted(p.name for p in dest.iterdir() if not p.name.endswith(".whl"))
    return f"built in the image from sdists (no py{PYTHON_VERSION} wheel): {', '.join(sdists) or '(none)'}"


def _download_one(req: str, dest: Path, log: Path, notes: list[str]) -> bool:
    if _pip_download([req], dest, log, "binary"):
        return True
    mode: DownloadMode = "prefer-binary" if HOST_IS_TARGET else "sdist-only"
    if _pip_download([req], dest, log, mode):
        notes.append(f"{req}: built in the image from its sdist (no py{PYTHON_VERSION} wheel)")
        return True
    notes.append(f"{req}: pip could not download it for py{PYTHON_VERSION}; not installed")
    return False


def _download_stage(stage: Stage, dest: Path, log: Path, notes: list[str]) -> list[str]:
    """Download a stage (see the module docstring for the fallbacks); the requirements kept."""
    if _pip_download(stage.requirements, dest, log, "binary"):
        return list(stage.requirements)
    if HOST_IS_TARGET and _pip_download(stage.requirements, dest, log, "prefer-binary"):
        notes.append(f"stage {stage.name}: {_sdists_note(dest)}")
        return list(stage.requirements)
    return [req for req in stage.requirements if _download_one(req, dest, log, notes)]


def _download_project(target: str, dest: Path, log: Path, notes: list[str]) -> None:
    if _pip_download([target], dest, log, "binary"):
        return
    if HOST_IS_TARGET and _pip_download([target], dest, log, "prefer-binary"):
        notes.append(f"project dependencies: {_sdists_note(dest)}")
        return
    notes.append("project dependencies: pip could not resolve them; `install` may fail offline")


def _pool() -> Path:
    return cache_dir() / "wheels" / "pool"


def _into_pool(tmp: Path) -> list[str]:
    """Move downloaded files into the shared pool (same file name, same file: PyPI never replaces one)."""
    pool = _pool()
    pool.mkdir(parents=True, exist_ok=True)
    names = sorted(p.name for p in tmp.iterdir() if p.is_file())
    for name in names:
        if not (pool / name).exists():
            os.replace(tmp / name, pool / name)
    shutil.rmtree(tmp, ignore_errors=True)
    return names


def _cached_stage(key: str) -> StageWheels | None:
    manifest = cache_dir() / "wheels" / "sets" / f"{key}.json"
    if not manifest.exists():
        return None
    stage = msgspec.json.decode(manifest.read_bytes(), type=StageWheels)
    return stage if all((_pool() / f).exists() for f in stage.files) else None


def _fetch(name: str, key: str, download: Callable[[Path, list[str]], list[str]]) -> StageWheels:
    """A stage's wheels from the cache, else downloaded by ``download(dest, notes) -> install list``."""
    cached = _cached_stage(key)
    if cached is not None:
        return cached
    tmp = cache_dir() / "wheels" / "tmp" / f"{key}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    notes: list[str] = []
    install = download(tmp, notes)
    stage = StageWheels(name=name, install=install, files=_into_pool(tmp), notes=notes)
    manifest = cache_dir() / "wheels" / "sets" / f"{key}.json"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_bytes(msgspec.json.encode(stage))
    return stage


def _key(*parts: object) -> str:
    return hashlib.sha256(json.dumps([RECIPE_VERSION, PYTHON_VERSION, platform.machine(), *parts]).encode()
                          ).hexdigest()[:20]


def fetch_stage(stage: Stage, log: Path) -> StageWheels:
    """The stage's distributions in the pool (cached by its requirements)."""
    fetched = _fetch(stage.name, _key("stage", stage.name, stage.requirements),
                     lambda dest, notes: _download_stage(stage, dest, log, notes))
    if stage.name == "runner" and fetched.install != list(RUNNER_REQUIREMENTS):
        raise ImageBuildError(f"could not download the test runner ({', '.join(RUNNER_REQUIREMENTS)}) for "
                              f"py{PYTHON_VERSION}; log: {log}")
    return fetched


def fetch_project_dependencies(testbed: _Testbed, extras: list[str], log: Path) -> StageWheels:
    """The dependencies of the project at the base commit (with ``extras``), resolved from its checkout."""

    def download(dest: Path, notes: list[str]) -> list[str]:
        target = str(testbed.get()) + (f"[{','.join(extras)}]" if extras else "")
        _download_project(target, dest, log, notes)
        testbed.clean()
        return []

    return _fetch("project", _key("project", testbed.commit, extras), download)


# --- generated files ---------------------------------------------------------------------------------------


def needs_network(step: str) -> bool:
    """Whether a pre_install line runs a command that needs the network (apt-get, wget, curl, conda, pip, ...)."""
    return bool(_NETWORK_STEP.search(step))


def conda_shim() -> str:
    return "\n".join([
        "# swectl: no conda in this image. `conda activate <env>` activates the venv (every env name is the",
        "# venv); `conda deactivate` does nothing; other conda commands fail.",
        "conda() {",
        '    case "${1:-}" in',
        f"        activate) . {VENV}/bin/activate ;;",
        "        deactivate) : ;;",
        '        *) echo "swectl conda shim: conda $* is not supported (no conda in this image)" >&2; return 1 ;;',
        "    esac",
        "}",
        f". {VENV}/bin/activate",
        "",
    ])


def stage_file(index: int, name: str) -> str:
    return f"swectl-stage-{index}-{name}.txt"


def install_deps_script(stages: list[StageWheels]) -> str:
    """Creates the venv and installs the stages in order: each all at once, else one requirement at a time
    (a requirement that does not install is a warning)."""
    lines = [
        "#!/bin/bash",
        "set -uo pipefail",
        f"python3 -m venv {VENV} || exit 1",
        "install_stage() {",
        f'    {VENV}/bin/pip install -r "$1" && return 0',
        '    echo "swectl: installing $1 together failed; installing its requirements one by one"',
        "    while IFS= read -r req; do",
        f'        {VENV}/bin/pip install "$req" || echo "{WARNING_TAG} could not install $req"',
        '    done < "$1"',
        "}",
    ]
    lines += [f"install_stage {WHEELS}/{stage_file(i, s.name)}" for i, s in enumerate(stages) if s.install]
    return "\n".join([*lines, ""])


def setup_script(spec: RepoSpec, *, allow_network: bool) -> tuple[str, list[str]]:
    """The script run in TESTBED at build time (pre_install, then install), and warnings about skipped steps."""
    warnings: list[str] = []
    lines = ["#!/bin/bash", "set -uo pipefail", f"cd {TESTBED}"]
    for step in spec.pre_install:
        if needs_network(step) and not allow_network:
            warnings.append(f"pre_install step skipped (needs the network; allow_network runs it): {step}")
            continue
        message = shlex.quote(f"{WARNING_TAG} pre_install step failed: {step}")
        lines.append(f"{{ {step}\n}} || echo {message}")
    if spec.install:
        failed = shlex.quote(f"swectl: the install command failed: {spec.install}")
        lines.append(f"{{ {spec.install}\n}} || {{ echo {failed}; exit 1; }}")
    lines += [f"git -C {TESTBED} status --short | head -20", ""]
    return "\n".join(lines), warnings


def containerfile_body(base: str) -> str:
    """Everything but the label. The dependency layers come first so that tasks of one spec share them."""
    env = {
        "PATH": f"{VENV}/bin:{_BASE_PATH}",
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": WHEELS,
        # pip reads PIP_NO_* booleans as the value of the option's *destination*: for --no-build-isolation
        # that is build_isolation, so "0" turns isolation OFF (checked with pip 23.0.1 in the base image).
        "PIP_NO_BUILD_ISOLATION": "0",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_PROGRESS_BAR": "off",
    }
    return "\n".join([
        f"FROM {base}",
        "ENV " + " ".join(f"{k}={v}" for k, v in env.items()),
        f"COPY wheels {WHEELS}",
        f"COPY tools/install-deps.sh tools/conda-activate {TOOLS}/",
        f"RUN bash {TOOLS}/install-deps.sh && mkdir -p {posixpath.dirname(CONDA_ACTIVATE)} "
        f"&& cp {TOOLS}/conda-activate {CONDA_ACTIVATE} && git config --system --add safe.directory '*'",
        f"COPY testbed {TESTBED}",
        f"COPY tools/setup.sh {TOOLS}/",
        f"WORKDIR {TESTBED}",
        f"RUN bash {TOOLS}/setup.sh",
        "",
    ])


def _label(task: Task, content: str) -> str:
    return (f"LABEL swectl.image=instance swectl.instance={json.dumps(task.instance_id)} "
            f"swectl.content={content}\n")


# --- building ----------------------------------------------------------------------------------------------


class _Plan(msgspec.Struct, frozen=True):
    """Everything one build writes into its context but the testbed, and the content hash of the image."""

    image: str
    commit: str
    stages: list[StageWheels]
    files: dict[str, str]  # build-context path -> text
    content: str
    warnings: list[str]


def _fetch_all(reqs: Requirements, testbed: _Testbed, log: Path) -> list[StageWheels]:
    stages = [fetch_stage(stage, log) for stage in reqs.stages]
    if reqs.project_extras is not None:
        stages.append(fetch_project_dependencies(testbed, reqs.project_extras, log))
    return stages


def _plan(task: Task, spec: RepoSpec, testbed: _Testbed, base: str, allow_network: bool, log: Path,
          say: Say) -> _Plan:
    base_id = image_id(base)
    if base_id is None:
        raise ImageBuildError(f"base image {base} is missing; run scripts/setup.sh")
    reqs = spec_requirements(task, spec, testbed.clone, testbed.commit)
    say(f"{task.instance_id}: wheels for {', '.join(s.name for s in reqs.stages)}"
        + (", project dependencies" if reqs.project_extras is not None else ""))
    stages = _fetch_all(reqs, testbed, log)
    setup, setup_warnings = setup_script(spec, allow_network=allow_network)
    files = {
        "tools/install-deps.sh": install_deps_script(stages),
        "tools/conda-activate": conda_shim(),
        "tools/setup.sh": setup,
        "Containerfile": containerfile_body(base),
        **{f"wheels/{stage_file(i, s.name)}": "".join(f"{r}\n" for r in s.install) for i, s in enumerate(stages)},
    }
    recipe = [base_id, testbed.commit, testbed.tags, files, [(s.name, s.files) for s in stages], allow_network]
    content = _key("content", msgspec.to_builtins(recipe))
    warnings = [*reqs.notes, *(n for s in stages for n in s.notes), *setup_warnings]
    return _Plan(image=instance_image_name(task), commit=testbed.commit, stages=stages, files=files,
                 content=content, warnings=warnings)


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _write_context(task: Task, plan: _Plan, ctx: Path, testbed: _Testbed) -> None:
    testbed.get()
    wheels = ctx / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    for name in sorted({f for s in plan.stages for f in s.files}):
        _link(_pool() / name, wheels / name)
    for rel, text in plan.files.items():
        (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
        (ctx / rel).write_text(text)
    with (ctx / "Containerfile").open("a") as f:
        f.write(_label(task, plan.content))


def _podman(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, env=podman_env(), timeout=300,
                          check=False)


def _podman_build(image: str, ctx: Path, log: Path, allow_network: bool) -> str:
    argv = ["podman", "build", "--pull=never", "-t", image, "-f", str(ctx / "Containerfile")]
    argv += [] if allow_network else ["--network", "none"]
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run([*argv, str(ctx)], capture_output=True, env=podman_env(), timeout=3600)
    except subprocess.TimeoutExpired as exc:
        raise ImageBuildError(f"podman build of {image} timed out; log: {log}") from exc
    output = (proc.stdout + proc.stderr).decode(errors="replace")
    with log.open("a", encoding="utf-8") as f:
        f.write("$ " + shlex.join([*argv, str(ctx)]) + "\n" + output)
    if proc.returncode != 0:
        _drop_failed_layers(output)
        raise ImageBuildError(f"podman build of {image} failed (exit {proc.returncode}); log: {log}; "
                              f"build context kept at {ctx}\n{output[-1500:]}")
    return output


def _drop_failed_layers(output: str) -> None:
    """A failed build leaves the images of the steps it committed, untagged; remove the last one (podman then
    removes its parents that nothing else uses), so failed tasks do not pile up gigabytes of layers."""
    committed = re.findall(r"^--> ([0-9a-f]{7,64})$", output, flags=re.MULTILINE)
    if committed:
        _podman("rmi", committed[-1])  # not forced: a layer another image uses stays


def _build(task: Task, spec: RepoSpec, repo_cache: Path, *, base: str, say: Say, force: bool,
           allow_network: bool) -> tuple[BuiltImage, list[str]]:
    log = cache_dir() / "logs" / f"build-inst-{task.instance_id}.log"
    clone = find_clone(Path(repo_cache), task.repo)
    commit = resolve_commit(clone, task.base_commit)
    ctx = cache_dir() / "build" / f"inst-{task.instance_id}"
    shutil.rmtree(ctx, ignore_errors=True)
    testbed = _Testbed(clone, commit, _ancestor_tags(clone, commit), ctx / "testbed",
                       lambda line: say(f"{task.instance_id}: {line}"))
    plan = _plan(task, spec, testbed, base, allow_network, log, say)
    for warning in plan.warnings:
        say(f"{task.instance_id}: warning: {warning}")
    if not force and image_label(plan.image, "swectl.content") == plan.content:
        shutil.rmtree(ctx, ignore_errors=True)
        say(f"{task.instance_id}: {plan.image} is up to date")
        return BuiltImage(plan.image, plan.content, plan.commit, cached=True), plan.warnings
    _write_context(task, plan, ctx, testbed)
    say(f"{task.instance_id}: building {plan.image} (log: {log})")
    output = _podman_build(plan.image, ctx, log, allow_network)
    shutil.rmtree(ctx, ignore_errors=True)
    build_warnings = [line.strip() for line in output.splitlines() if line.startswith(WARNING_TAG)]
    for warning in build_warnings:
        say(f"{task.instance_id}: {warning}")
    return BuiltImage(plan.image, plan.content, plan.commit, cached=False), [*plan.warnings, *build_warnings]


def build_instance_image(
    task: Task, spec: RepoSpec, repo_cache: Path, *, base: str = DEFAULT_BASE, say: Say = print,
    force: bool = False, allow_network: bool = False,
) -> BuiltImage:
    """Build (or reuse, when its content label matches) the instance image of one classic SWE-bench task."""
    return _build(task, spec, repo_cache, base=base, say=say, force=force, allow_network=allow_network)[0]


def _skip_reason(task: Task) -> str:
    if task.image or task.eval_script:
        return "the row carries its own image / eval script"
    if not (task.test_patch and task.version and task.base_commit):
        return "not a classic SWE-bench row (needs test_patch, version and base_commit)"
    return ""


def _outcome(task: Task, specs: SpecTable, repo_cache: Path, *, base: str, say: Say, force: bool,
             allow_network: bool) -> InstanceOutcome:
    started = time.monotonic()
    skip = _skip_reason(task)
    if skip:
        return InstanceOutcome(instance_id=task.instance_id, status="skipped", message=skip)
    try:
        spec = specs.get(task.repo, task.version)
        built, warnings = _build(task, spec, repo_cache, base=base, say=say, force=force,
                                 allow_network=allow_network)
    except (SwectlError, OSError, subprocess.SubprocessError) as exc:
        say(f"{task.instance_id}: FAILED: {exc}")
        return InstanceOutcome(instance_id=task.instance_id, status="failed", message=str(exc),
                               seconds=round(time.monotonic() - started, 1))
    return InstanceOutcome(
        instance_id=task.instance_id, status="cached" if built.cached else "built", image=built.image,
        warnings=warnings, seconds=round(time.monotonic() - started, 1), built=built,
    )


def build_instance_images(
    tasks: Iterable[Task], specs: SpecTable, repo_cache: Path, *, base: str = DEFAULT_BASE, say: Say = print,
    force: bool = False, allow_network: bool = False,
) -> list[InstanceOutcome]:
    """Build every task's image in turn, going on past failures; one outcome per task, in order."""
    return [
        _outcome(t, specs, Path(repo_cache), base=base, say=say, force=force, allow_network=allow_network)
        for t in tasks
    ]


def remove_instance_image(image: str) -> bool:
    """Remove ``image``; podman removes with it the intermediate images of its build that nothing else uses
    (the dependency layers stay while another task's image shares them). Whether it was removed."""
    return _podman("rmi", "-f", image).returncode == 0

def write_image_map(results: Iterable[InstanceOutcome], path: Path) -> dict[str, str]:
    """Write ``{instance_id: image}`` of the images built or reused (JSON, for ``swectl eval --image-map``)."""
    mapping = {r.instance_id: r.image for r in results if r.ok and r.image}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(mapping, indent=2, sort_keys=True) + "\n")
    return mapping
