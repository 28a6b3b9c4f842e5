"""Project images: one image per (PyPI project, version), built offline from the pinned source distribution.

The image holds the sdist as a git repository at /testbed (one commit with a fixed author and date, so its
hash is the same on every machine) and pytest in /opt/venv, installed from wheels downloaded on the host:
the build itself runs with ``--network none``. Builds are cached by content: the image carries a
``swectl.content`` label (a hash of the base image id, the sdist, the runner wheels and the build recipe)
and is rebuilt only when that changes.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from collections.abc import Callable
from pathlib import Path

import msgspec

from swectl.errors import CommandError, SwectlError
from swectl.remote.nodes.podman import run_local_podman
from swectl.tasks.record import TESTBED

BUNDLED_DIR = Path(__file__).resolve().parents[1] / "data" / "bundled"
BUNDLED_PROJECTS = BUNDLED_DIR / "projects.toml"
BUNDLED_TASKS = BUNDLED_DIR / "tasks.jsonl"
DEFAULT_BASE = "localhost/swectl-base:bookworm"
VENV = "/opt/venv"
# In the base interpreter's site directory: makes the venv's packages importable by the base interpreter too.
VENV_PTH = "swectl-venv.pth"
# A login shell (`bash -lc`, as OpenClaw-RL's exec server and `swectl serve` run commands) reads /etc/profile,
# which on Debian resets root's PATH; this profile.d script puts the venv first again, as the official SWE-bench
# images' profile activates their conda env.
LOGIN_PATH_STEP = (f"RUN printf '%s\\n' 'PATH=\"{VENV}/bin:$PATH\"' > /etc/profile.d/00-swectl-venv.sh")
# Fixed identity and date for the project commit and for committing a task's setup patch.
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "swectl",
    "GIT_AUTHOR_EMAIL": "swectl@localhost",
    "GIT_COMMITTER_NAME": "swectl",
    "GIT_COMMITTER_EMAIL": "swectl@localhost",
    "GIT_AUTHOR_DATE": "2020-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2020-01-01T00:00:00+0000",
}
RECIPE_VERSION = "3"  # 3: the login-shell PATH step


class ImageBuildError(SwectlError):
    """An image could not be built; the message says which step failed and where its log is."""


class Project(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A project with its test suite: a pinned PyPI sdist (``sdist_sha256``) or a local git checkout (``git``,
    its HEAD commit is what gets built)."""

    name: str
    version: str
    tests: list[str]
    sources: list[str]
    sdist_sha256: str = ""
    git: str = ""
    pythonpath: str = "."

    def __post_init__(self) -> None:
        if bool(self.sdist_sha256) == bool(self.git):
            raise ValueError(f"project {self.name}: set exactly one of sdist_sha256 (PyPI) or git (a checkout)")

    @property
    def image(self) -> str:
        return f"localhost/swectl-proj.{self.name.lower()}:{self.version}"

    @property
    def repo(self) -> str:
        return f"pypi/{self.name}"

    def test_command(self, extra: str = "") -> str:
        """The test command run from TESTBED (results come from the ``-rA`` summary)."""
        tests = " ".join(self.tests)
        return f"PYTHONPATH={self.pythonpath} python -m pytest -rA --tb=short -p no:cacheprovider {extra}{tests}"


class Runner(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The test runner installed in every project image (its requirements)."""
    requirements: list[str]


class ProjectSet(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The bundled projects file: the runner and the projects."""
    runner: Runner
    project: list[Project]

    def get(self, name: str) -> Project:
        for p in self.project:
            if p.name == name:
                return p
        raise SwectlError(f"unknown project {name!r}; known: {', '.join(p.name for p in self.project)}")


def load_projects(path: Path = BUNDLED_PROJECTS) -> ProjectSet:
    try:
        return msgspec.convert(tomllib.loads(path.read_text()), ProjectSet)
    except (OSError, tomllib.TOMLDecodeError, msgspec.ValidationError, ValueError) as exc:
        raise SwectlError(f"{path}: {exc}") from exc


def cache_dir() -> Path:
    root = os.environ.get("SWECTL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "swectl")
    return Path(root)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _run(argv: list[str], what: str, log: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    proc = subprocess.run(argv, capture_output=True, env=env, cwd=cwd, timeout=1800)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as f:
        f.write(b"$ " + " ".join(argv).encode() + b"\n" + proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).decode(errors="replace")[-1500:]
        raise ImageBuildError(f"{what} failed (exit {proc.returncode}); log: {log}\n{tail}")
    return proc.stdout.decode(errors="replace")


def fetch_sdist(project: Project, log: Path) -> Path:
    """The pinned sdist from PyPI (cached; verified against the pinned sha256)."""
    dest = cache_dir() / "sdists"
    dest.mkdir(parents=True, exist_ok=True)
    for f in dest.glob(f"{project.name}-{project.version}.*"):
        if _sha256(f) == project.sdist_sha256:
            return f
    _run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", str(dest),
         f"{project.name}=={project.version}"],
        f"downloading the sdist of {project.name}=={project.version}", log,
    )
    for f in dest.glob(f"{project.name}-{project.version}.*"):
        digest = _sha256(f)
        if digest == project.sdist_sha256:
            return f
        raise ImageBuildError(
            f"{f.name}: sha256 {digest} does not match the pinned {project.sdist_sha256}; "
            "PyPI served different bytes for this version"
        )
    raise ImageBuildError(f"pip download gave no sdist for {project.name}=={project.version}")


def archive_checkout(project: Project, log: Path) -> tuple[Path, str]:
    """A tarball of the checkout's HEAD (one top-level folder, like an sdist) and the HEAD commit."""
    repo = Path(project.git).expanduser()
    if not (repo / ".git").exists() and not (repo / "HEAD").exists():
        raise ImageBuildError(f"project {project.name}: {repo} is not a git checkout")
    head = _run(["git", "-C", str(repo), "rev-parse", "HEAD"], f"reading HEAD of {repo}", log).strip()
    dest = cache_dir() / "checkouts" / f"{project.name}-{head[:12]}.tar"
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        _run(["git", "-C", str(repo), "archive", "--format=tar", f"--prefix={project.name}/", "-o", str(dest),
              "HEAD"], f"git archive of {repo}", log)
    return dest, head


def fetch_wheels(requirements: list[str], log: Path) -> Path:
    """Wheels of the test runner for the image's Python (3.11, like the host's), cached by requirements."""
    key = hashlib.sha256("\n".join(sorted(requirements)).encode()).hexdigest()[:16]
    dest = cache_dir() / "wheels" / key
    if not (dest / ".complete").exists():
        dest.mkdir(parents=True, exist_ok=True)
        _run(
            [sys.executable, "-m", "pip", "download", "--only-binary", ":all:", "--python-version", "3.11",
             "--no-deps", "-q", "-d", str(dest), *requirements],
            "downloading the test runner wheels", log,
        )
        (dest / ".complete").touch()
    return dest


def _extract_repo(sdist: Path, into: Path) -> str:
    """Unpack the sdist into ``into`` as a fresh git repository with one deterministic commit; its hash."""
    if into.exists():
        shutil.rmtree(into)
    into.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(into, filter="data")
    (top,) = list(into.iterdir())
    for item in top.iterdir():
        item.rename(into / item.name)
    top.rmdir()
    env = {**os.environ, **GIT_IDENTITY}
    git = ["git", "-c", "init.defaultBranch=main", "-c", "core.autocrlf=false"]
    subprocess.run([*git, "init", "-q"], cwd=into, check=True)
    subprocess.run([*git, "add", "-A", "-f", "."], cwd=into, check=True)
    subprocess.run([*git, "commit", "-q", "--no-gpg-sign", "-m", "sdist"], cwd=into, check=True, env=env)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=into, check=True, capture_output=True,
                          text=True).stdout.strip()


def drop_failed_layers(output: str) -> None:
    """A failed build leaves the images of the steps it committed, untagged; remove the last one (podman then
    removes its parents that nothing else uses), so failed tasks do not pile up gigabytes of layers."""
    committed = re.findall(r"^--> ([0-9a-f]{7,64})$", output, flags=re.MULTILINE)
    if committed:
        # not forced: a layer another image uses stays
        run_local_podman("rmi", committed[-1], timeout=300, check=False)


def make_venv(python: str = "python3", venv: str = VENV) -> str:
    """Shell commands (one line) that make ``venv`` with ``python``, keeping it for tools that re-exec
    ``sys.executable`` (tox --current-env links ``.tox/<env>/bin/python`` to it, virtualenv and nox re-run it):

    - ``--copies``: the venv's python is a real binary, so ``os.path.realpath(sys.executable)`` is still in
      the venv (its pyvenv.cfg beside it);
    - a link to it elsewhere (tox's) finds no pyvenv.cfg and runs as the base interpreter, so a ``.pth`` file
      in the base interpreter's site directory adds the venv's site-packages there (``site.addsitedir``:
      the venv's own ``.pth`` files, editable installs among them, are processed too). The venv itself does
      not see the base site directory (no system site packages), so nothing changes inside it.
    """
    base_site = "import site; print(site.getsitepackages()[0])"
    venv_site = "import sysconfig; print(sysconfig.get_path('purelib'))"
    return (f'base=$(command -v {python}) && "$base" -m venv --copies {venv} && '
            f'site_dir=$("$base" -c "{base_site}") && venv_site=$({venv}/bin/python -c "{venv_site}") && '
            f'mkdir -p "$site_dir" && '
            f'echo "import site; site.addsitedir(\'$venv_site\')" > "$site_dir/{VENV_PTH}"')


def _containerfile(base: str, project: Project, content: str, wheels: list[str], base_commit: str) -> str:
    return "\n".join([
        f"FROM {base}",
        "COPY wheels /opt/swectl-wheels",
        f"RUN {make_venv()} && {VENV}/bin/pip install -q --no-index --find-links /opt/swectl-wheels "
        + " ".join(wheels) + " && rm -rf /opt/swectl-wheels",
        f"COPY testbed {TESTBED}",
        f"RUN git config --system --add safe.directory '*' && git -C {TESTBED} status --short | head -5",
        f"WORKDIR {TESTBED}",
        f"ENV PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        LOGIN_PATH_STEP,
        f"LABEL swectl.image=project swectl.project={project.name} swectl.version={project.version} "
        f"swectl.content={content} swectl.base_commit={base_commit}",
        "",
    ])


def image_label(image: str, label: str) -> str | None:
    out = run_local_podman("image", "inspect", "--format", f"{{{{index .Labels \"{label}\"}}}}", image,
                           timeout=60, check=False)
    if out.exit_code != 0:
        return None
    return out.stdout.decode().strip() or None


def image_id(image: str) -> str | None:
    out = run_local_podman("image", "inspect", "--format", "{{.Id}}", image, timeout=60, check=False)
    return out.stdout.decode().strip() if out.exit_code == 0 else None


class BuiltImage(msgspec.Struct, frozen=True):
    """A built (or cached) project image: its name, content hash and base commit."""
    image: str
    content: str
    base_commit: str
    cached: bool


class _Inputs(msgspec.Struct, frozen=True):
    """What a project image is built from, and the content hash over it."""

    source: Path  # the sdist, or the tarball of the checkout's HEAD
    wheels_dir: Path
    wheels: list[str]
    content: str
    log: Path


def _inputs(project: Project, runner: Runner, base: str) -> _Inputs:
    log = cache_dir() / "logs" / f"build-{project.name}-{project.version}.log"
    base_id = image_id(base)
    if base_id is None:
        raise ImageBuildError(f"base image {base} is missing; run scripts/setup.sh")
    if project.git:
        source, head = archive_checkout(project, log)
    else:
        source, head = fetch_sdist(project, log), project.sdist_sha256
    wheels_dir = fetch_wheels(runner.requirements, log)
    wheels = sorted(p.name for p in wheels_dir.glob("*.whl"))
    recipe = msgspec.json.encode([RECIPE_VERSION, base_id, project, head, runner.requirements, wheels])
    return _Inputs(source, wheels_dir, wheels, hashlib.sha256(recipe).hexdigest()[:24], log)


def project_content(project: Project, runner: Runner, *, base: str = DEFAULT_BASE) -> str:
    """The content hash the project's image carries when it is up to date (no build)."""
    return _inputs(project, runner, base).content


def build_project_image(
    project: Project, runner: Runner, *, base: str = DEFAULT_BASE, say: Callable[[str], None] = print,
    force: bool = False,
) -> BuiltImage:
    """Build (or reuse) the image of one project version; returns its name and the commit at /testbed."""
    inputs = _inputs(project, runner, base)
    content = inputs.content
    up_to_date = not force and image_label(project.image, "swectl.content") == content
    if up_to_date and (base_commit := image_label(project.image, "swectl.base_commit")):
        return BuiltImage(project.image, content, base_commit, cached=True)
    ctx = cache_dir() / "build" / f"{project.name}-{project.version}"
    base_commit = _extract_repo(inputs.source, ctx / "testbed")
    if up_to_date:  # built before images carried the swectl.base_commit label
        return BuiltImage(project.image, content, base_commit, cached=True)
    say(f"building {project.image} (log: {inputs.log})")
    shutil.rmtree(ctx / "wheels", ignore_errors=True)
    shutil.copytree(inputs.wheels_dir, ctx / "wheels", ignore=shutil.ignore_patterns(".complete"))
    wheels = [f"/opt/swectl-wheels/{w}" for w in inputs.wheels]
    (ctx / "Containerfile").write_text(_containerfile(base, project, content, wheels, base_commit))
    try:
        out = run_local_podman("build", "--network", "none", "--pull=never", "--layers=false", "-q",
                               "-t", project.image, "-f", str(ctx / "Containerfile"), str(ctx),
                               timeout=1800, check=False, log=inputs.log)
    except CommandError as exc:
        raise ImageBuildError(f"podman build of {project.image} did not finish; log: {inputs.log}\n{exc}") from exc
    if out.exit_code != 0:
        tail = (out.stdout + out.stderr).decode(errors="replace")[-1500:]
        raise ImageBuildError(f"podman build of {project.image} failed (exit {out.exit_code}); log: {inputs.log}"
                              f"\n{tail}")
    return BuiltImage(project.image, content, base_commit, cached=False)


def prune_images(keep: set[str], *, dry_run: bool = False) -> list[str]:
    """Remove swectl-built project images whose name:content is not in ``keep`` (``image@content`` strings)."""
    out = run_local_podman("images", "--filter", "label=swectl.image=project", "--format",
                           "{{.Repository}}:{{.Tag}} {{index .Labels \"swectl.content\"}}", timeout=60)
    removed = []
    for line in out.stdout.decode().splitlines():
        name, _, content = line.partition(" ")
        if f"{name}@{content}" in keep:
            continue
        removed.append(name)
        if not dry_run:
            run_local_podman("rmi", "-f", name, timeout=120, check=False)
    return removed
