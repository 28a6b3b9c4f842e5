"""A task's repository: its clone in the repo cache, its base commit, and the testbed made from it.

The testbed (``/testbed`` in an instance image) is a fresh git repository holding only the history up to the
task's ``base_commit`` (and the tags on it), fetched from the clone: later commits, which often contain the
fix, are not in the image, and no remote points at the host.

Git submodules (astropy up to 3.x keeps ``astropy_helpers`` as one, and its ``setup.py`` needs it) are checked
out at the commit the base commit pins, from the submodule repository's own clone in the same repo cache; their
remote is the URL ``.gitmodules`` names. The official images get them over the network while installing; an
offline build has only the repo cache.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class TreeEntry:
    """One entry of a commit's tree, recursively listed: ``kind`` is ``blob`` (a file), or ``commit`` (a
    submodule's gitlink)."""

    kind: str
    sha: str
    path: str


def list_tree(clone: Path, commit: str) -> list[TreeEntry]:
    """Every entry of ``commit``'s tree (``git ls-tree -r``): one walk that the checks below can share."""
    tree = _git("-C", str(clone), "ls-tree", "-r", "-z", commit, check=True).stdout.split(b"\0")
    out = []
    for entry in filter(None, tree):
        meta, _, path = entry.partition(b"\t")
        _mode, kind, sha = meta.split()
        out.append(TreeEntry(kind.decode(), sha.decode(), path.decode(errors="replace")))
    return out


def missing_files(clone: Path, commit: str, tree: list[TreeEntry] | None = None) -> list[str]:
    """The paths of ``commit``'s tree whose contents the clone lacks (a partial mirror that left large files
    out); empty for a whole clone. Submodule entries are not files of the clone and are not checked. ``tree`` is
    the commit's :func:`list_tree` when the caller has it."""
    blobs: dict[str, str] = {}
    for entry in list_tree(clone, commit) if tree is None else tree:
        if entry.kind == "blob":
            blobs.setdefault(entry.sha, entry.path)
    check = _git("-C", str(clone), "cat-file", "--batch-check", input="".join(f"{s}\n" for s in blobs).encode())
    gone = [line.split()[0] for line in check.stdout.decode().splitlines() if line.endswith(" missing")]
    return [blobs[sha] for sha in gone if sha in blobs]


C_SOURCE_SUFFIXES = (".c", ".cc", ".cpp", ".cxx", ".pyx", ".f", ".f90")
# Folders whose sources are not built with the project (sphinx's test roots hold .pyx fixtures).
_NOT_BUILT = frozenset({"test", "tests", "testing", "doc", "docs", "examples"})


def has_c_sources(clone: Path, commit: str, tree: list[TreeEntry] | None = None) -> bool:
    """Whether ``commit``'s tree has C, C++, Cython or Fortran sources outside tests, docs and examples (building
    the project needs a compiler)."""
    for entry in list_tree(clone, commit) if tree is None else tree:
        parts = entry.path.lower().split("/")
        if entry.kind == "blob" and parts[-1].endswith(C_SOURCE_SUFFIXES) and not _NOT_BUILT.intersection(parts[:-1]):
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


@dataclass(frozen=True)
class Submodule:
    """One git submodule of a commit: its name and path in ``.gitmodules``, its URL, the commit pinned."""

    name: str
    path: str
    url: str
    commit: str  # the commit the superproject pins

    @property
    def repo(self) -> str | None:
        """``owner/name`` when the URL is a GitHub one (how the repo cache names clones), else None."""
        found = re.match(r"^(?:https?://|git://|ssh://git@|git@)github\.com[/:]([^/]+)/([^/]+?)(?:\.git)?/?$", self.url)
        return f"{found[1]}/{found[2]}" if found else None


def submodules(clone: Path, commit: str, tree: list[TreeEntry] | None = None) -> list[Submodule]:
    """The submodules of ``commit``: each gitlink of its tree with the name and URL ``.gitmodules`` gives it."""
    config = _git("-C", str(clone), "config", "--blob", f"{commit}:.gitmodules", "--list")
    if config.returncode != 0:
        return []
    names: dict[str, dict[str, str]] = {}
    for line in config.stdout.decode(errors="replace").splitlines():
        key, _, value = line.partition("=")
        found = re.match(r"^submodule\.(.+)\.(path|url)$", key)
        if found:
            names.setdefault(found[1], {})[found[2]] = value
    by_path = {v["path"]: (name, v.get("url", "")) for name, v in names.items() if "path" in v}
    out = []
    for entry in list_tree(clone, commit) if tree is None else tree:
        if entry.kind == "commit" and entry.path in by_path:
            name, url = by_path[entry.path]
            out.append(Submodule(name, entry.path, url, entry.sha))
    return out


def submodule_sources(clone: Path, commit: str, repo_cache: Path,
                      tree: list[TreeEntry] | None = None) -> list[tuple[Submodule, Path | None]]:
    """``commit``'s submodules, each with the clone in ``repo_cache`` that has its pinned commit (or None)."""
    out: list[tuple[Submodule, Path | None]] = []
    for sub in submodules(clone, commit, tree):
        source = None
        if sub.repo:
            try:
                source = find_clone(repo_cache, sub.repo)
            except ImageBuildError:
                source = None
        out.append((sub, source if source is not None and has_commit(source, sub.commit) else None))
    return out


def check_out_submodules(into: Path, sources: list[tuple[Submodule, Path | None]], repo_cache: Path,
                         say: Say) -> list[str]:
    """Check out the testbed ``into``'s submodules from their clones (``submodule_sources``). Returns a warning for
    each one that cannot be (no clone of it in ``repo_cache``, or the clone lacks the pinned commit): the testbed
    then has an empty folder there, as a plain ``git clone`` leaves it."""
    warnings = []
    for sub, source in sources:
        if source is None:
            where = clone_candidates(repo_cache, sub.repo)[0] if sub.repo else f"{repo_cache}/<owner>__<name>"
            warnings.append(f"submodule {sub.path} ({sub.url} at {sub.commit[:12]}) is not in the repo cache; its "
                            f"folder stays empty (hint: git clone {sub.url} {where})")
            continue
        say(f"submodule {sub.path} at {sub.commit[:12]} from {source}")
        _git("-C", str(into), "config", f"submodule.{sub.name}.url", str(source.resolve()), check=True)
        update = _git("-C", str(into), "-c", "protocol.file.allow=always", "submodule", "update", "--init",
                      "--no-recommend-shallow", "--", sub.path)
        if update.returncode != 0:
            raise ImageBuildError(f"checking out submodule {sub.path} from {source} failed: "
                                  f"{update.stderr.decode(errors='replace').strip()}")
        # no remote points at the host: the superproject and the submodule name the URL .gitmodules gives
        _git("-C", str(into), "config", f"submodule.{sub.name}.url", sub.url, check=True)
        _git("-C", str(into / sub.path), "remote", "set-url", "origin", sub.url, check=True)
    return warnings


def prepare_testbed(clone: Path, commit: str, into: Path, tags: list[str]) -> None:
    """A fresh repository at ``into`` holding ``commit`` (checked out on branch main), its history and ``tags``
    (tags on that history) and nothing else: no later commits, no remote pointing at the host. Submodules are
    left to :func:`check_out_submodules`."""
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

    def __init__(self, clone: Path, commit: str, tags: list[str], path: Path, say: Say,
                 repo_cache: Path | None = None, tree: list[TreeEntry] | None = None) -> None:
        self.clone, self.commit, self.tags, self.path, self._say = clone, commit, tags, path, say
        self.repo_cache = repo_cache
        self._listed = tree  # the commit's list_tree, when the caller has it already
        self.ready = False
        self.warnings: list[str] = []

    def get(self) -> Path:
        if not self.ready:
            self._say(f"preparing {TESTBED} at {self.commit[:12]} ({len(self.tags)} tags)")
            prepare_testbed(self.clone, self.commit, self.path, self.tags)
            if self.repo_cache is not None:
                self.warnings = check_out_submodules(self.path, self.submodule_sources, self.repo_cache, self._say)
                for warning in self.warnings:
                    self._say(f"warning: {warning}")
            self.ready = True
        return self.path

    @functools.cached_property
    def submodule_sources(self) -> list[tuple[Submodule, Path | None]]:
        """The commit's submodules with their clones in the repo cache (looked up once per testbed)."""
        return [] if self.repo_cache is None else submodule_sources(self.clone, self.commit, self.repo_cache,
                                                                    self.tree)

    @functools.cached_property
    def tree(self) -> list[TreeEntry]:
        """The commit's tree, listed once for every check of it (missing files, C sources, submodules)."""
        return self._listed if self._listed is not None else list_tree(self.clone, self.commit)

    @property
    def submodule_state(self) -> list[tuple[str, str, bool]]:
        """(path, pinned commit, whether the repo cache has it) per submodule: part of the cache keys of what is
        built from the checkout (empty for a repository without submodules, so those keys stay as they were)."""
        return [(sub.path, sub.commit, source is not None) for sub, source in self.submodule_sources]

    def clean(self) -> None:
        """Drop whatever resolving the project's dependencies wrote into or changed in the work tree (egg-info,
        build/, pre_install edits)."""
        if self.ready:
            _git("-C", str(self.path), "reset", "-q", "--hard", check=True)
            _git("-C", str(self.path), "clean", "-fdxq", check=True)
            _git("-C", str(self.path), "submodule", "foreach", "--quiet", "--recursive",
                 "git reset -q --hard && git clean -fdxq", check=True)
