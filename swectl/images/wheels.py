"""The distributions of an instance image's venv, downloaded on the host into a shared, cached pool.

Every distribution comes from the host: ``pip download --only-binary :all: --python-version 3.11`` per
stage, into a shared pool under ``cache_dir()/wheels``, each stage's file list cached. A stage that has a
requirement without a py3.11 wheel is downloaded again with ``--prefer-binary`` (sdists where there is no
wheel, dependencies still resolved; the host runs Python 3.11 like the image), and when that fails too, one
requirement at a time (its wheel with dependencies, else its sdist alone, else dropped with a note). Sdists
are built in the image, offline.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import msgspec

from swectl.images.clones import Testbed
from swectl.images.project import ImageBuildError, cache_dir
from swectl.images.requirements import RUNNER_REQUIREMENTS, Stage

# Bump when the recipe changes in a way the content hash does not see (it sees every generated file).
RECIPE_VERSION = "1"
PYTHON_VERSION = "3.11"
# The host can resolve sdists (and their dependencies) for the image only when it runs the image's Python.
HOST_IS_TARGET = f"{sys.version_info.major}.{sys.version_info.minor}" == PYTHON_VERSION


class StageWheels(msgspec.Struct, frozen=True):
    """A stage's downloaded files (in the pool) and the requirement lines installed from them."""

    name: str
    install: list[str]
    files: list[str]
    notes: list[str] = []


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


def cache_key(*parts: object) -> str:
    return hashlib.sha256(json.dumps([RECIPE_VERSION, PYTHON_VERSION, platform.machine(), *parts]).encode()
                          ).hexdigest()[:20]


def fetch_stage(stage: Stage, log: Path) -> StageWheels:
    """The stage's distributions in the pool (cached by its requirements)."""
    fetched = _fetch(stage.name, cache_key("stage", stage.name, stage.requirements),
                     lambda dest, notes: _download_stage(stage, dest, log, notes))
    if stage.name == "runner" and fetched.install != list(RUNNER_REQUIREMENTS):
        raise ImageBuildError(f"could not download the test runner ({', '.join(RUNNER_REQUIREMENTS)}) for "
                              f"py{PYTHON_VERSION}; log: {log}")
    return fetched


def fetch_project_dependencies(testbed: Testbed, extras: list[str], log: Path) -> StageWheels:
    """The dependencies of the project at the base commit (with ``extras``), resolved from its checkout."""

    def download(dest: Path, notes: list[str]) -> list[str]:
        target = str(testbed.get()) + (f"[{','.join(extras)}]" if extras else "")
        _download_project(target, dest, log, notes)
        testbed.clean()
        return []

    return _fetch("project", cache_key("project", testbed.commit, extras), download)
