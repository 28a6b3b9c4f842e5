"""A task's repository: its clone in the repo cache, its base commit, and the testbed made from it.

The testbed (``/testbed`` in an instance image) is a fresh git repository holding only the history up to the
task's ``base_commit`` (and the tags on it), fetched from the clone: later commits, which often contain the
fix, are not in the image, and no remote points at the host.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from swectl.images.project import ImageBuildError
from swectl.tasks.record import TESTBED

Say = Callable[[str], None]


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


def missing_files(clone: Path, commit: str) -> list[str]:
    """The paths of ``commit``'s tree whose contents the clone lacks (a partial mirror that left large files
    out); empty for a whole clone. Submodule entries are not files of the clone and are not checked."""
    tree = _git("-C", str(clone), "ls-tree", "-r", "-z", commit, check=True).stdout.split(b"\0")
    blobs: dict[str, str] = {}
    for entry in filter(None, tree):
        meta, _, path = entry.partition(b"\t")
        _mode, kind, sha = meta.split()
        if kind == b"blob":
            blobs.setdefault(sha.decode(), path.decode(errors="replace"))
    check = _git("-C", str(clone), "cat-file", "--batch-check", input="".join(f"{s}\n" for s in blobs).encode())
    gone = [line.split()[0] for line in check.stdout.decode().splitlines() if line.endswith(" missing")]
    return [blobs[sha] for sha in gone if sha in blobs]


C_SOURCE_SUFFIXES = (".c", ".cc", ".cpp", ".cxx", ".pyx", ".f", ".f90")
# Folders whose sources are not built with the project (sphinx's test roots hold .pyx fixtures).
_NOT_BUILT = frozenset({"test", "tests", "testing", "doc", "docs", "examples"})


def has_c_sources(clone: Path, commit: str) -> bool:
    """Whether ``commit``'s tree has C, C++, Cython or Fortran sources outside tests, docs and examples (building
    the project needs a compiler)."""
    names = _git("-C", str(clone), "ls-tree", "-r", "-z", "--name-only", commit).stdout.split(b"\0")
    for name in (n.decode(errors="replace") for n in names if n):
        parts = name.lower().split("/")
        if parts[-1].endswith(C_SOURCE_SUFFIXES) and not _NOT_BUILT.intersection(parts[:-1]):
            return True
    return False


def read_at(clone: Path, commit: str, path: str) -> str | None:
    proc = _git("-C", str(clone), "cat-file", "blob", f"{commit}:{path}")
    return proc.stdout.decode(errors="replace") if proc.returncode == 0 else None


def commit_date(clone: Path, commit: str) -> str | None:
    """The committer date of ``commit`` in ``clone`` (ISO 8601), or None when the clone does not have it."""
    proc = _git("-C", str(clone), "show", "-s", "--format=%cI", commit)
    return (proc.stdout.decode().strip() or None) if proc.returncode == 0 else None


def ancestor_tags(clone: Path, commit: str) -> list[str]:
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


def has_commit(clone: Path, commit: str) -> bool:
    return bool(commit) and _git("-C", str(clone), "cat-file", "-e", f"{commit}^{{commit}}").returncode == 0


class Testbed:
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
        """Drop whatever resolving the project's dependencies wrote into or changed in the work tree (egg-info,
        build/, pre_install edits)."""
        if self.ready:
            _git("-C", str(self.path), "reset", "-q", "--hard", check=True)
            _git("-C", str(self.path), "clean", "-fdxq", check=True)
