"""Interpreters of the spec's Python version for instance images, where the node has one offline.

The base image (Debian bookworm) has Python 3.11 only, and neither its Debian mirror nor any other source an
offline node reaches (no conda channel, no python.org or GitHub download) has another. What a node may have is
a self-contained CPython installation: a prefix with ``bin/pythonX.Y`` and ``lib/pythonX.Y/``, as pyenv
builds them (``$PYENV_ROOT/versions/X.Y.Z``, ``~/.pyenv/versions/X.Y.Z``) or as listed in
``$SWECTL_PYTHONS`` (``os.pathsep``-separated prefixes, or folders holding prefixes named ``X.Y.Z``). The
newest patch release found for the spec's ``X.Y`` is copied into an image of its own, at the same path
(pyenv builds find their ``libpython`` by an absolute rpath), without its stdlib tests and without its
site-packages (machine-specific ``.pth`` files live there); the build checks it runs there (ssl, ctypes,
sqlite3, bz2, lzma, zlib, venv). Where the spec's X.Y is missing, the nearest newer X.Y' the node has stands in
(``nearest_newer_interpreter``: 3.6 for 3.5), with a warning and the image's ``swectl.python`` label saying which
ran. An interpreter that does not run in the base image is no interpreter: the row gets 3.11 and a warning. The
host runs that interpreter too, to resolve sdists' dependencies with pip (pip 26
runs on 3.9 and later; older versions get wheels and lone sdists, as for any target that is not the host's).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import msgspec

from swectl.images.builds import BuildStepError, ensure_image
from swectl.images.project import ImageBuildError

PYTHONS_ENV = "SWECTL_PYTHONS"
PYTHON_IMAGE = "localhost/swectl-python"
_VERSION_DIR = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")
# Modules the venv and pip need, with their shared libraries: the check that a copied interpreter runs.
_CHECK_MODULES = "ssl, ctypes, sqlite3, bz2, lzma, zlib, venv, ensurepip, hashlib, json"


class Interpreter(msgspec.Struct, frozen=True):
    """A self-contained CPython installation on the node: ``prefix``/bin/python``version``."""

    version: str  # X.Y
    full_version: str  # X.Y.Z
    prefix: str

    @property
    def executable(self) -> str:
        return f"{self.prefix}/bin/python{self.version}"


def search_roots() -> list[Path]:
    """Where interpreters are looked for: $SWECTL_PYTHONS, then pyenv's versions folder."""
    roots = [Path(p) for p in os.environ.get(PYTHONS_ENV, "").split(os.pathsep) if p]
    pyenv = os.environ.get("PYENV_ROOT") or os.path.join(os.path.expanduser("~"), ".pyenv")
    return [*roots, Path(pyenv) / "versions"]


def _interpreter(prefix: Path, version: str) -> Interpreter | None:
    match = _VERSION_DIR.match(prefix.name)
    if not match or f"{match.group(1)}.{match.group(2)}" != version:
        return None
    exe, landmark = prefix / "bin" / f"python{version}", prefix / "lib" / f"python{version}" / "os.py"
    if not exe.is_file() or not landmark.is_file():
        return None
    return Interpreter(version=version, full_version=prefix.name, prefix=str(prefix.resolve()))


def _installations() -> list[Path]:
    found: list[Path] = []
    for root in search_roots():
        found += [root] if _VERSION_DIR.match(root.name) else (sorted(root.iterdir()) if root.is_dir() else [])
    return found


def _full(interp: Interpreter) -> tuple[int, ...]:
    return tuple(int(p) for p in interp.full_version.split("."))


def find_interpreter(version: str) -> Interpreter | None:
    """The newest self-contained installation of Python ``version`` (X.Y) on the node, or None."""
    found = [i for i in (_interpreter(c, version) for c in _installations()) if i is not None]
    return max(found, key=_full, default=None)


def nearest_newer_interpreter(version: str) -> Interpreter | None:
    """Where the node has no Python ``version`` (X.Y): the installation of the lowest X.Y' above it in the same
    major version (its newest patch release), or None. A project that ran on 3.5 runs on 3.6 far more often than on
    the base image's 3.11 (Django 1.11, whose spec says 3.5: no 3.5 is reachable offline here)."""
    major, minor = (int(p) for p in version.split(".")[:2])
    found: list[Interpreter] = []
    for prefix in _installations():
        match = _VERSION_DIR.match(prefix.name)
        if match and int(match.group(1)) == major and int(match.group(2)) > minor:
            interp = _interpreter(prefix, f"{match.group(1)}.{match.group(2)}")
            found += [interp] if interp is not None else []
    if not found:
        return None
    lowest = min(_full(i)[:2] for i in found)
    return max((i for i in found if _full(i)[:2] == lowest), key=_full)


def _ignore(prefix: Path, version: str) -> Callable[[str, list[str]], list[str]]:
    """shutil.copytree's ignore: the stdlib's tests and GUI modules, everything in site-packages."""
    stdlib = prefix / "lib" / f"python{version}"

    def ignore(folder: str, names: list[str]) -> list[str]:
        here = Path(folder)
        if here == stdlib:
            return [n for n in names if n in ("test", "idlelib", "tkinter", "turtledemo")]
        if here == stdlib / "site-packages":
            return list(names)
        return []

    return ignore


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _content(interp: Interpreter, base_id: str) -> str:
    stat = Path(interp.executable).stat()
    recipe = msgspec.json.encode([base_id, interp, stat.st_size, stat.st_mtime_ns, _CHECK_MODULES])
    return hashlib.sha256(recipe).hexdigest()[:24]


def python_image_name(interp: Interpreter, base_id: str) -> str:
    """``localhost/swectl-python:X.Y.Z-<hash>``: the name of ``interp``'s image on the base image ``base_id``."""
    return f"{PYTHON_IMAGE}:{interp.full_version}-{_content(interp, base_id)[:12]}"


def python_image(interp: Interpreter, base: str, base_id: str, log: Path) -> str:
    """An image of ``base`` with ``interp`` copied in at its own path (cached by content); ImageBuildError when
    it does not build or does not run there."""
    content = _content(interp, base_id)
    image = python_image_name(interp, base_id)
    rel = Path("python") / interp.full_version

    def fill(ctx: Path) -> None:
        shutil.copytree(interp.prefix, ctx / rel, symlinks=True, ignore=_ignore(Path(interp.prefix), interp.version),
                        copy_function=_link)
        (ctx / "Containerfile").write_text("\n".join([
            f"FROM {base}",
            f"COPY {rel} {interp.prefix}",
            f"RUN {interp.executable} -c 'import {_CHECK_MODULES}'",
            f"LABEL swectl.image=python swectl.python={interp.full_version} swectl.content={content}",
            "",
        ]))

    try:
        ensure_image(image, content, fill, what=f"python {interp.full_version}", log=log, network=False,
                     timeout=1800)
    except BuildStepError as exc:
        if exc.step == "disk":
            raise
        raise ImageBuildError(f"python {interp.full_version} from {interp.prefix} does not run in {base}: "
                              f"{str(exc).splitlines()[0]}") from exc
    return image
