"""The distributions of an instance image's venv, downloaded on the host into a shared, cached pool.

Every distribution comes from the host: ``pip download --only-binary :all: --python-version X.Y`` per stage,
for the venv's Python (3.11, or the spec's where the node has it: pythons.py), into a shared pool under
``cache_dir()/wheels``, each stage's file list cached. A stage that has a requirement without a wheel for it
is downloaded again with ``--prefer-binary`` (sdists where there is no wheel, dependencies still resolved),
and when that fails too, one requirement at a time (its wheel with dependencies, else its sdist with
dependencies, else its sdist alone, else dropped with a note). Sdists are built in the image, offline.

For a Python the host does not run (pip 26 itself needs 3.10 or later, so the target's interpreter cannot run
it), pip runs on the host's Python with two changes (``_PIP_FOR_TARGET``): environment markers see the
target's version (pip evaluates them for the interpreter it runs on, whatever ``--python-version`` says), and
``--prefer-binary`` is allowed with ``--python-version`` (pip refuses it because the sdists' metadata is then
built by the host's Python; a setup.py whose requirements depend on the running Python's version is rare).

Unpinned requirements resolve as of a date (pip's ``--uploaded-prior-to``), so that an image built today gets
the releases the official images got, not today's (pytest 9, November 2025, renders some parametrize ids
differently from the ids SWE-bench recorded). :func:`prior_to` says which date a row gets:

- ``official`` (the default): :data:`OFFICIAL_CUTOFF`, 2024-08-13, or the row's ``created_at`` when that is
  later (an environment cannot predate its task). Evidence: SWE-bench's containerized harness (the
  env / instance images) was released on 2024-06-27 (docs/20240627_docker in SWE-bench) and SWE-bench Verified,
  whose FAIL_TO_PASS / PASS_TO_PASS lists were checked by running the gold patches in those images, was
  published on 2024-08-13: the environments the dataset's test ids agree with were resolved between those
  dates, so the later one bounds them. A per-row date does worse here: a 2015 row resolved as of 2015 gets
  releases without Python 3.11 wheels, where the official image got the newest release for the spec's Python.
- ``created_at``: the row's creation date (the pull request's); ``env-commit``: the committer date of the
  row's ``environment_setup_commit`` in the clone; ``none``: no cut-off; any ISO 8601 date or datetime: that.

pip reads upload dates only from indexes that serve them (PyPI's JSON simple API does); the machine's pip
configuration (find-links folders, file:// extra indexes, constraints) has none and would let today's
releases in, so the downloads run with ``PIP_CONFIG_FILE=/dev/null`` and without ``PIP_*`` variables except
those that say how to reach an index (:func:`pip_env`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import msgspec

from swectl.images.clones import Testbed, commit_date
from swectl.images.project import ImageBuildError, cache_dir
from swectl.images.requirements import RUNNER_REQUIREMENTS, Stage, setup_py_install_requires
from swectl.tasks.record import Task

# Bump when the recipe changes in a way the content hash does not see (it sees every generated file).
RECIPE_VERSION = "4"
PYTHON_VERSION = "3.11"  # the base image's
# The host can resolve sdists (and their dependencies) for the image only when it runs the image's Python.
HOST_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
# The latest date at which the environments SWE-bench Verified was validated in can have been resolved (see
# the module docstring).
OFFICIAL_CUTOFF = "2024-08-13T00:00:00Z"
DATE_POLICIES = ("official", "created_at", "env-commit", "none")
# pip for another Python than the host's (argv[1]: its X.Y.Z): environment markers (``tomli; python_version <
# "3.11"``) see the target's version, and sdists may be downloaded with their dependencies for it.
_PIP_FOR_TARGET = """\
import sys
from pip._internal.cli import cmdoptions
from pip._vendor.packaging import markers
cmdoptions.check_dist_restriction = lambda options, check_target=False: None
full = sys.argv.pop(1)
_host = markers.default_environment
def _target():
    env = _host()
    env.update(python_version=".".join(full.split(".")[:2]), python_full_version=full)
    return env
markers.default_environment = _target
from pip._internal.cli.main import main
sys.exit(main())
"""
# PIP_* variables kept for the downloads: how to reach an index, not where else to look for files.
_PIP_ENV_KEPT = frozenset({"PIP_INDEX_URL", "PIP_CERT", "PIP_CLIENT_CERT", "PIP_PROXY", "PIP_TRUSTED_HOST",
                           "PIP_DEFAULT_TIMEOUT", "PIP_TIMEOUT", "PIP_RETRIES"})


class Target(msgspec.Struct, frozen=True):
    """What the downloads are for: the venv's Python (X.Y) and the upload cut-off ("": none)."""

    python: str = PYTHON_VERSION
    date: str = OFFICIAL_CUTOFF
    full_version: str = ""  # X.Y.Z of the target's interpreter, where known (environment markers)

    @property
    def is_host(self) -> bool:
        """Whether the host runs this Python (pip then runs unchanged)."""
        return self.python == HOST_PYTHON


class StageWheels(msgspec.Struct, frozen=True):
    """A stage's downloaded files (in the pool) and the requirement lines installed from them."""

    name: str
    install: list[str]
    files: list[str]
    notes: list[str] = []


DownloadMode = Literal["binary", "prefer-binary", "sdist-only"]


def _iso_utc(text: str) -> str:
    """``text`` (an ISO 8601 date or datetime; naive means UTC) as ``YYYY-MM-DDTHH:MM:SSZ``; ValueError if not."""
    value = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace(" ", "T"))
    value = value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)
    return value.strftime("%Y-%m-%dT%H:%M:%SZ")


def check_date_policy(policy: str) -> str:
    """``policy`` if it is one of :data:`DATE_POLICIES` or an ISO date; ImageBuildError naming them if not."""
    if policy in DATE_POLICIES:
        return policy
    try:
        _iso_utc(policy)
    except ValueError:
        raise ImageBuildError(f"uploaded-prior-to {policy!r}: not one of {', '.join(DATE_POLICIES)} and not an "
                              "ISO 8601 date (2024-08-13 or 2024-08-13T00:00:00Z)") from None
    return policy


def prior_to(policy: str, task: Task, clone: Path, notes: list[str]) -> str:
    """The date (``YYYY-MM-DDTHH:MM:SSZ``) as of which the row's unpinned requirements resolve; "" for none.
    A policy whose date the row lacks falls back to ``official``, with a note."""
    policy = check_date_policy(policy)
    if policy == "none":
        return ""
    created = _iso_utc(task.created_at) if re.match(r"^\d{4}-\d\d-\d\d", task.created_at) else ""
    if policy == "created_at" and created:
        return created
    if policy == "env-commit":
        date = commit_date(clone, task.environment_setup_commit) if task.environment_setup_commit else None
        if date:
            return _iso_utc(date)
    if policy not in DATE_POLICIES:
        return _iso_utc(policy)
    if policy != "official":
        notes.append(f"uploaded-prior-to {policy}: the row has no such date; using the official cut-off")
    return max(OFFICIAL_CUTOFF, created)


def pip_env() -> dict[str, str]:
    """The environment of the downloads: no pip configuration files, no ``PIP_*`` variables but those that say
    how to reach the index (find-links folders and local indexes carry no upload dates)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in _PIP_ENV_KEPT}
    return {**env, "PIP_CONFIG_FILE": os.devnull}


def _attempt(argv: list[str], log: Path, *, timeout: float = 1800) -> bool:
    """Run ``argv``, appending its output to ``log``; whether it succeeded. A run that was killed (a signal, or
    the timeout) says nothing about what resolves: it raises, so no stage is cached from it and the next build
    tries again."""
    killed = ""
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=timeout, env=pip_env())
        ok, output = proc.returncode == 0, (proc.stdout + proc.stderr).decode(errors="replace")
        if proc.returncode < 0:
            killed = f"was killed by signal {-proc.returncode}"
    except subprocess.TimeoutExpired as exc:
        ok, output = False, f"timed out after {timeout:g} s: {exc}\n"
        killed = f"timed out after {timeout:g} s"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a", encoding="utf-8") as f:
        f.write("$ " + shlex.join(argv) + "\n" + output + ("" if ok else "(failed)\n"))
    if killed:
        raise ImageBuildError(f"pip download {killed}; nothing was cached from it, so the next build tries again; "
                              f"log: {log}")
    return ok


def _pip_download(requirements: list[str], dest: Path, log: Path, mode: DownloadMode, target: Target) -> bool:
    """``pip download`` for the target's Python, of releases uploaded before its date.
    binary: wheels with dependencies; prefer-binary: sdists where there is no wheel, dependencies resolved;
    sdist-only: the distribution alone."""
    pip = [sys.executable, "-m", "pip"] if target.is_host else \
        [sys.executable, "-c", _PIP_FOR_TARGET, target.full_version or f"{target.python}.0"]
    argv = [*pip, "download", "--disable-pip-version-check", "--progress-bar", "off", "-q", "-d", str(dest),
            *(["--uploaded-prior-to", target.date] if target.date else [])]
    argv += {
        "binary": ["--only-binary", ":all:", "--python-version", target.python],
        "prefer-binary": ["--prefer-binary", *([] if target.is_host else ["--python-version", target.python])],
        "sdist-only": ["--no-deps", "--python-version", target.python],
    }[mode]
    return _attempt([*argv, *requirements], log)


def _sdists_note(dest: Path, python: str) -> str:
    sdists = sorted(p.name for p in dest.iterdir() if not p.name.endswith(".whl"))
    return f"built in the image from sdists (no py{python} wheel): {', '.join(sdists) or '(none)'}"


def _download_one(req: str, dest: Path, log: Path, notes: list[str], target: Target) -> bool:
    if _pip_download([req], dest, log, "binary", target):
        return True
    for mode in ("prefer-binary", "sdist-only"):
        if _pip_download([req], dest, log, mode, target):
            notes.append(f"{req}: built in the image from its sdist (no py{target.python} wheel)"
                         + (" without its dependencies" if mode == "sdist-only" else ""))
            return True
    notes.append(f"{req}: pip could not download it for py{target.python}; not installed")
    return False


def _download_stage(stage: Stage, dest: Path, log: Path, notes: list[str], target: Target) -> list[str]:
    """Download a stage (see the module docstring for the fallbacks); the requirements kept."""
    if _pip_download(stage.requirements, dest, log, "binary", target):
        return list(stage.requirements)
    if _pip_download(stage.requirements, dest, log, "prefer-binary", target):
        notes.append(f"stage {stage.name}: {_sdists_note(dest, target.python)}")
        return list(stage.requirements)
    return [req for req in stage.requirements if _download_one(req, dest, log, notes, target)]


def _download_project(project: str, dest: Path, log: Path, notes: list[str], target: Target,
                      declared: list[str] | None = None) -> None:
    """The project's dependencies resolved from its checkout; where pip cannot prepare its metadata on the host,
    those ``declared`` in setup.py (``setup_py_install_requires``), with a note."""
    if _pip_download([project], dest, log, "binary", target):
        return
    if _pip_download([project], dest, log, "prefer-binary", target):
        notes.append(f"project dependencies: {_sdists_note(dest, target.python)}")
        return
    if declared and (_pip_download(declared, dest, log, "binary", target)
                     or _pip_download(declared, dest, log, "prefer-binary", target)):
        notes.append("project dependencies: pip could not prepare the project's metadata on the host; downloaded "
                     f"what setup.py's install_requires names instead: {', '.join(declared)}")
        return
    notes.append("project dependencies: pip could not resolve them; `install` may fail offline")


def wheel_pool() -> Path:
    return cache_dir() / "wheels" / "pool"


def _into_pool(tmp: Path) -> list[str]:
    """Move downloaded files into the shared pool (same file name, same file: PyPI never replaces one)."""
    pool = wheel_pool()
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
    return stage if all((wheel_pool() / f).exists() for f in stage.files) else None


def _fetch(name: str, key: str, download: Callable[[Path, list[str]], list[str]]) -> StageWheels:
    """A stage's wheels from the cache, else downloaded by ``download(dest, notes) -> install list``."""
    cached = _cached_stage(key)
    if cached is not None:
        return cached
    # one folder per download (parallel builds may fetch the same stage at once: both land the same files)
    tmp = cache_dir() / "wheels" / "tmp" / f"{key}-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    notes: list[str] = []
    install = download(tmp, notes)
    stage = StageWheels(name=name, install=install, files=_into_pool(tmp), notes=notes)
    manifest = cache_dir() / "wheels" / "sets" / f"{key}.json"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    partial = manifest.with_name(f"{manifest.name}.{os.getpid()}-{threading.get_ident()}.part")
    partial.write_bytes(msgspec.json.encode(stage))
    partial.replace(manifest)  # a reader sees the whole list or none
    return stage


def cache_key(*parts: object) -> str:
    return hashlib.sha256(json.dumps([RECIPE_VERSION, platform.machine(), *parts]).encode()
                          ).hexdigest()[:20]


def fetch_stage(stage: Stage, log: Path, target: Target) -> StageWheels:
    """The stage's distributions for the target (its Python, uploaded before its date) in the pool (cached by
    both)."""
    fetched = _fetch(stage.name, cache_key("stage", stage.name, stage.requirements, target.python, target.date),
                     lambda dest, notes: _download_stage(stage, dest, log, notes, target))
    if stage.name == "runner" and fetched.install != list(RUNNER_REQUIREMENTS):
        raise ImageBuildError(f"could not download the test runner ({', '.join(RUNNER_REQUIREMENTS)}) for "
                              f"py{target.python}; log: {log}")
    return fetched


def fetch_project_dependencies(testbed: Testbed, extras: list[str], log: Path, target: Target,
                               edits: list[str] | None = None, edit: Callable[[Path], None] | None = None,
                               ) -> StageWheels:
    """The dependencies of the project at the base commit (with ``extras``), resolved from its checkout for
    the target, after ``edit(checkout)`` (the spec's pre_install ``edits``, which pin what setup.py asks for)."""

    def download(dest: Path, notes: list[str]) -> list[str]:
        checkout = testbed.get()
        if edit is not None:
            edit(checkout)
        project = str(checkout) + (f"[{','.join(extras)}]" if extras else "")
        _download_project(project, dest, log, notes, target, declared)
        testbed.clean()
        return []

    declared = setup_py_install_requires(testbed.clone, testbed.commit)
    key = cache_key("project", testbed.commit, extras, target.python, target.date, edits or [],
                    *([testbed.submodule_state] if testbed.submodule_state else []), *([declared] if declared else []))
    return _fetch("project", key, download)
