"""Instance images for classic SWE-bench rows, built offline from a local clone of each task's repository.

Two layers, the official harness's env/instance split, on swectl's base image (Debian with python3.11, no conda):
an environment image per (repo, version) and dependency set (``localhost/swectl-env.<repo>-<version>:<hash>``:
the venv, its wheels, the conda shim), shared by every instance whose dependencies are the same, and a thin
instance image per task on it (``localhost/swectl-inst.<id>``: the testbed and the spec's install):

- ``/testbed`` is the task's repository at ``base_commit``, with its history up to there and nothing later
  (clones.py).
- ``/opt/venv`` is a virtual environment (first on PATH; its python a real binary) filled in stages: the test
  runner, the spec's ``packages``, the project's build requirements, the spec's ``pip_packages``
  (requirements.py); every distribution is downloaded on the host into a shared cached pool (wheels.py) and
  installed offline.
- pip stays offline in the image, ``/opt/miniconda3/bin/activate`` is a conda shim, and the spec's
  ``pre_install`` and ``install`` run at build time (recipe.py), so the official eval scripts run unchanged.
  Those scripts reinstall the project after applying the patch (the official harness does it with the network):
  where the gold or test patch declares a dependency (setup.py / setup.cfg / pyproject.toml / requirements), the
  wheels the patched project needs are carried in the wheel folder, not installed, so that reinstall finds them
  offline (pylint 2.10's gold adds appdirs).

Unpinned requirements resolve as of a date (wheels.py: ``uploaded_prior_to``, the ``official`` cut-off by
default), recorded in the label ``swectl.uploaded_prior_to``.

The spec's ``python``: the base image (Debian bookworm) has 3.11 only; another version comes from a
self-contained installation on the node (pythons.py: pyenv's, or ``$SWECTL_PYTHONS``), copied into an image of
its own under the instance image, and the wheels are downloaded for it. Where the node has none, the row runs
Python 3.11 with a warning (the build report, and the image's ``swectl.warnings`` label); ``swectl.python`` and
``swectl.spec_python`` say both. Pins that never got a build for the venv's Python are built from source or
dropped, with warnings. A venv on Python 3.6 first gets the newest pip for it (its bundled 18.1 cannot install
manylinux2014 wheels).

The spec's apt steps (recipe.py) run, with ``allow_network`` and a reachable Debian mirror, in an apt image
of their own (``localhost/swectl-apt:<hash>``, built with the network, shared by every row with the same
steps) that the instance image is built on; ``swectl.apt`` says whether they ran.

This module plans a build (the content hashes over everything that goes into each of the two images), writes
the build contexts and runs ``podman build --network none`` (the instance build gets the network only where
``allow_network`` runs other network steps); images carry the label ``swectl.content`` and are rebuilt only when
it changes. Builds of one environment image wait for each other (a file lock in the cache), so parallel builds
(``--jobs``, or two processes) of one (repo, version) build it once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import msgspec

from swectl.errors import ConfigError, SwectlError
from swectl.images.builds import BuildStepError, check_disk, ensure_image, podman_build
from swectl.images.clones import (
    Say,
    Testbed,
    ancestor_tags,
    find_clone,
    has_c_sources,
    list_tree,
    missing_files,
    resolve_commit,
)
from swectl.images.names import docker_id
from swectl.images.project import (
    DEFAULT_BASE,
    BuiltImage,
    ImageBuildError,
    cache_dir,
    image_id,
    image_label,
)
from swectl.images.pythons import find_interpreter, nearest_newer_interpreter, python_image, search_roots
from swectl.images.recipe import (
    WARNING_TAG,
    apt_containerfile,
    conda_shim,
    env_containerfile,
    install_deps_script,
    instance_containerfile,
    needs_network,
    setup_script,
    split_pre_install,
    stage_file,
)
from swectl.images.requirements import Requirements, Stage, spec_requirements
from swectl.images.wheels import (
    PYTHON_VERSION,
    StageWheels,
    Target,
    cache_key,
    check_date_policy,
    fetch_project_dependencies,
    fetch_stage,
    prior_to,
    wheel_pool,
)
from swectl.remote.nodes.podman import run_local_podman
from swectl.tasks.record import TESTBED, Task
from swectl.tasks.specs import RepoSpec, SpecTable

INSTANCE_PREFIX = "localhost/swectl-inst."
ENV_PREFIX = "localhost/swectl-env."
APT_IMAGE = "localhost/swectl-apt"
# Pythons whose ensurepip bundles a pip older than 19.3 (no manylinux2014): the venv's pip is upgraded first.
OLD_PIP_BELOW = (3, 7)

BuildStatus = Literal["built", "cached", "failed", "skipped"]
# The steps of a build, in order, as a failed outcome names them: the task's clone in the repo cache, its base
# commit, the spec for its version, the plan (Python, apt image, requirements, downloads), the disk check, then
# podman build's two RUN steps: the venv's dependencies (install-deps.sh) and the spec's pre_install / install
# (setup.sh); "disk" again when podman ran out of space.
BUILD_STEPS = ("spec", "clone", "base_commit", "plan", "disk", "podman_build", "install_deps", "setup")


class InstanceOutcome(msgspec.Struct, kw_only=True):
    """The outcome of building one task's image (``build_instance_images``)."""

    instance_id: str
    status: BuildStatus
    image: str = ""
    message: str = ""
    warnings: list[str] = []
    seconds: float = 0.0
    built: BuiltImage | None = None
    step: str = ""  # failed: the build step that failed (BUILD_STEPS)
    env: str = ""  # the environment image the instance image is built on
    env_built: bool = False  # whether this build made that environment image (else it was there)

    @property
    def ok(self) -> bool:
        return self.status in ("built", "cached")


def instance_image_name(task: Task) -> str:
    """``localhost/swectl-inst.<id>:latest`` with the id lowercased and ``__`` written ``_1776_``."""
    return f"{INSTANCE_PREFIX}{docker_id(task.instance_id)}:latest"


def env_image_name(task: Task, content: str) -> str:
    """``localhost/swectl-env.<owner>_1776_<name>-<version>:<content[:16]>``: one per (repo, version) and
    dependency set."""
    return f"{ENV_PREFIX}{docker_id(task.repo.replace('/', '__'))}-{task.version.lower()}:{content[:16]}"


def _label_value(text: str) -> str:
    """``text`` as a double-quoted Containerfile LABEL value (``$`` escaped: LABEL expands variables)."""
    return json.dumps(text).replace("$", "\\$")


def _label_line(labels: dict[str, str]) -> str:
    return "LABEL " + " ".join(f"{k}={_label_value(v)}" for k, v in labels.items()) + "\n"


def _env_label(task: Task, plan: _Plan) -> str:
    labels = {
        "swectl.image": "env", "swectl.repo": task.repo, "swectl.version": task.version,
        "swectl.content": plan.env_content, "swectl.uploaded_prior_to": plan.date or "none",
        "swectl.python": plan.python, "swectl.apt": plan.apt,
    }
    return _label_line(labels)


def _label(task: Task, plan: _Plan) -> str:
    labels = {
        "swectl.image": "instance", "swectl.instance": task.instance_id, "swectl.content": plan.content,
        "swectl.uploaded_prior_to": plan.date or "none", "swectl.python": plan.python,
        "swectl.spec_python": plan.spec_python or "unset", "swectl.apt": plan.apt,
        "swectl.warnings": json.dumps(plan.warnings), "swectl.env": plan.env_image,
    }
    return _label_line(labels)


class _Plan(msgspec.Struct, frozen=True):
    """Everything the two builds write into their contexts but the testbed and the wheels, and the content hashes
    of both images."""

    image: str
    commit: str
    stages: list[StageWheels]
    env_image: str
    env_files: dict[str, str]  # build-context path -> text, of the environment image
    env_content: str
    files: dict[str, str]  # build-context path -> text, of the instance image
    content: str
    warnings: list[str]
    date: str  # uploaded-prior-to of the downloads; "" for none
    python: str  # the venv's Python version (X.Y.Z of a copied interpreter, X.Y of the base image's)
    spec_python: str
    apt: str  # "ran" (in the apt image under this one), "skipped" or "none" (the spec has no apt steps)
    network: bool  # whether the build needs the network (allow_network and network steps left in setup.sh)


def _fetch_all(reqs: Requirements, testbed: Testbed, log: Path, target: Target, spec: RepoSpec,
               image: str, task: Task) -> list[StageWheels]:
    stages = [fetch_stage(stage, log, target) for stage in reqs.stages]
    if reqs.project_extras is not None:
        edits = _offline_pre_install(spec)

        def edit(checkout: Path) -> None:
            _run_pre_install(edits, checkout, image, log)

        stages.append(fetch_project_dependencies(testbed, reqs.project_extras, log, target, edits,
                                                 edit if edits else None))
        if (carried := _patch_dependencies(task, testbed, reqs.project_extras, log, target, stages)) is not None:
            stages.append(carried)
    return stages


# Files where a patch declares the project's dependencies.
_DEPENDENCY_FILE = re.compile(r"(?:^|/)(?:setup\.py|setup\.cfg|pyproject\.toml|requirements[^/]*\.txt)$")
_DIFF_PATH = re.compile(r"^\+\+\+ b/(\S+)", re.MULTILINE)


def dependency_patches(task: Task) -> list[str]:
    """The task's gold and test patches that edit a file declaring the project's dependencies."""
    return [p for p in (task.patch, task.test_patch)
            if p and any(_DEPENDENCY_FILE.search(path) for path in _DIFF_PATH.findall(p))]


def _patch_dependencies(task: Task, testbed: Testbed, extras: list[str], log: Path, target: Target,
                        stages: list[StageWheels]) -> StageWheels | None:
    """The distributions the project needs once the gold and test patches are applied, beyond the stages': carried
    in the image's wheel folder, not installed. The eval script reinstalls the project after the patch
    (``pip install -e .``, as the official one does with the network), so a dependency the fix adds (pylint 2.10's
    appdirs) installs from there offline. None when no patch edits a file that declares dependencies."""
    patches = dependency_patches(task)
    if not patches:
        return None

    def edit(checkout: Path) -> None:
        for patch in patches:
            subprocess.run(["patch", "--batch", "--forward", "-p1", "-s"], input=patch.encode(), cwd=checkout,
                           capture_output=True, timeout=120, check=False)

    key = hashlib.sha256("\0".join(patches).encode()).hexdigest()[:16]
    got = fetch_project_dependencies(testbed, extras, log, target, [f"swectl: the gold and test patches {key}"], edit)
    have = {f for stage in stages for f in stage.files}
    files = [f for f in got.files if f not in have]
    if not files:
        return None
    return StageWheels(name="patch_dependencies", install=[], files=files,
                       notes=[f"wheels carried for the dependencies the gold / test patch declares (not installed): "
                              f"{', '.join(files[:8])}"])


def _offline_pre_install(spec: RepoSpec) -> list[str]:
    """The pre_install lines the image runs offline (sed edits of setup.py, ...): the project's dependencies
    are resolved after them, as the image's ``install`` sees them."""
    _apt, other, _ = split_pre_install(spec.pre_install)
    return [step for step in other if not needs_network(step)]


def _run_pre_install(steps: list[str], checkout: Path, image: str, log: Path) -> None:
    """Run ``steps`` on ``checkout`` in a throwaway container of ``image`` (never on the host: they may write
    anywhere, /etc/locale.gen among them), mounted at the testbed; a failing step is ignored, as at build time
    it is a warning."""
    script = "\n".join(f"{{ {step}\n}} || true" for step in steps)
    run_local_podman("run", "--rm", "--network", "none", "-v", f"{checkout}:{TESTBED}", "-w", TESTBED, image,
                     "bash", "-c", script, timeout=600, check=False, log=log)


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".") if p.isdigit())


SUBSTITUTED_PYTHON = "python substituted: spec python"  # a build warning's start (tasks validate reads it)


def python_warning(spec: RepoSpec, why: str = "") -> str:
    """The warning for a row whose spec's Python the image does not get (it runs 3.11)."""
    where = ", ".join(str(r) for r in search_roots())
    why = why or (f"the base image and its Debian mirror have only python {PYTHON_VERSION}, and no installation "
                  f"of {spec.python} is in {where}")
    return f"spec python {spec.python} is not available offline on this node ({why}): the venv runs python " \
           f"{PYTHON_VERSION}"


def _python_base(spec: RepoSpec, base: str, base_id: str, log: Path, warnings: list[str]) -> tuple[str, str, str]:
    """The image to build on, the venv's interpreter in it and its version (X.Y.Z or X.Y): the spec's Python
    where the node has it (pythons.py), else the base image's python3 and a warning."""
    if not spec.python or spec.python == PYTHON_VERSION:
        return base, "python3", PYTHON_VERSION
    interp = find_interpreter(spec.python)
    if interp is None:  # the nearest newer Python the node has, where it is older than the base image's
        interp = nearest_newer_interpreter(spec.python)
        if interp is None or _version_tuple(interp.version) >= _version_tuple(PYTHON_VERSION):
            warnings.append(python_warning(spec))
            return base, "python3", PYTHON_VERSION
        warnings.append(f"{SUBSTITUTED_PYTHON} {spec.python} is not available offline on this node: the venv runs "
                        f"python {interp.full_version}, the nearest newer one found (in {interp.prefix})")
    try:
        return python_image(interp, base, base_id, log), interp.executable, interp.full_version
    except ImageBuildError as exc:
        if isinstance(exc, BuildStepError) and exc.step == "disk":
            raise
        warnings.append(python_warning(spec, str(exc)))
        return base, "python3", PYTHON_VERSION


def _apt_sources(base: str) -> list[tuple[str, str]]:
    """(mirror URL, suite) of each apt source in ``base`` (one-line and deb822 formats)."""
    out = run_local_podman("run", "--rm", "--network", "none", base, "sh", "-c",
                           "cat /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null", timeout=120,
                           check=False)
    text = out.stdout.decode(errors="replace")
    found = re.findall(r"^deb\s+(?:\[[^\]]*\]\s+)?(https?://\S+)\s+(\S+)", text, flags=re.MULTILINE)
    for block in re.split(r"\n\s*\n", text):
        uris = re.findall(r"^URIs:\s*(.+)$", block, flags=re.MULTILINE)
        suites = re.findall(r"^Suites:\s*(.+)$", block, flags=re.MULTILINE)
        if uris and suites:
            found += [(u, suites[0].split()[0]) for u in uris[0].split() if u.startswith("http")]
    return found


@functools.cache
def apt_mirror(base_id: str, base: str) -> str | None:
    """The first Debian mirror of ``base``'s apt sources that answers from this node (its Release file within
    5 s), or None. Cached per base image for the process."""
    for url, suite in _apt_sources(base):
        release = f"{url.rstrip('/')}/dists/{suite}/Release"
        try:
            with urllib.request.urlopen(release, timeout=5) as resp:
                if resp.status == 200 and resp.read(1):
                    return url
        except (urllib.error.URLError, OSError, ValueError):
            continue
    return None


def _apt_image(steps: list[str], base: str, base_id: str, log: Path, say: Say) -> str:
    """The image of ``base`` with the apt ``steps`` run, built with the network (cached by content)."""
    content = cache_key("apt", base_id, steps)
    image = f"{APT_IMAGE}:{content[:16]}"

    def fill(ctx: Path) -> None:
        (ctx / "Containerfile").write_text(apt_containerfile(base, steps)
                                           + f"LABEL swectl.image=apt swectl.content={content}\n")

    ensure_image(image, content, fill, what="the apt steps, with the network", log=log, network=True, say=say)
    return image


def _apt_base(spec: RepoSpec, base: str, base_id: str, allow_network: bool, log: Path, say: Say,
              warnings: list[str], packages: list[str]) -> tuple[str, str]:
    """The image to build on and ``swectl.apt``: the apt image when the spec has apt steps (or ``packages``: a
    compiler for C sources, the C libraries of a conda environment), allow_network is on and a Debian mirror
    answers; else ``base``, with a warning saying why the steps were skipped."""
    apt, _other, _ = split_pre_install(spec.pre_install)
    if packages:
        apt = [*apt, f"apt-get update && apt-get install -y --no-install-recommends {' '.join(packages)}"]
    if not apt:
        return base, "none"
    if not allow_network:
        if packages:
            warnings.append(f"the compiler and C libraries the project needs come from apt ({', '.join(packages)}): "
                            "not installed without --allow-network")
        return base, "skipped"  # setup_script warns about each of the spec's steps
    if apt_mirror(base_id, base) is None:
        warnings.append(f"no Debian mirror of {base}'s apt sources answers from this node: apt steps skipped")
        return base, "skipped"
    try:
        return _apt_image(apt, base, base_id, log, say), "ran"
    except BuildStepError as exc:
        if exc.step == "disk":
            raise
        warnings.append(f"the apt steps failed: {str(exc).splitlines()[0]}; building without them")
        return base, "skipped"


def _plan(task: Task, spec: RepoSpec, testbed: Testbed, base: str, allow_network: bool, log: Path,
          say: Say, date_policy: str) -> _Plan:
    base_id = image_id(base)
    if base_id is None:
        raise ImageBuildError(f"base image {base} is missing; run scripts/setup.sh")
    notes: list[str] = []
    date = prior_to(date_policy, task, testbed.clone, notes)
    with_python, python, python_version = _python_base(spec, base, base_id, log, notes)
    target = Target(python=".".join(python_version.split(".")[:2]), date=date,
                    full_version=python_version if python_version.count(".") == 2 else "")
    reqs = spec_requirements(task, spec, testbed.clone, testbed.commit)
    # the base image has no compiler (the official base image has build-essential): a project with C sources
    # gets one from apt, as the C libraries of its conda environment do
    toolchain = ["build-essential"] if has_c_sources(testbed.clone, testbed.commit, testbed.tree) else []
    build_on, apt = _apt_base(spec, with_python, image_id(with_python) or base_id, allow_network, log, say, notes,
                              [*toolchain, *reqs.apt])
    build_on_id = image_id(build_on) or base_id
    if _version_tuple(target.python) < OLD_PIP_BELOW:
        # its bundled pip (18.1 for 3.6) cannot install manylinux2014 wheels: the newest pip for it goes first
        reqs = msgspec.structs.replace(reqs, stages=[Stage(name="pip", requirements=["pip>=19.3"]), *reqs.stages])
    say(f"{task.instance_id}: wheels for {', '.join(s.name for s in reqs.stages)}"
        + (", project dependencies" if reqs.project_extras is not None else "")
        + f" for python {target.python}" + (f", uploaded before {date}" if date else ""))
    stages = _fetch_all(reqs, testbed, log, target, spec, base, task)
    setup, setup_warnings = setup_script(spec, allow_network=allow_network, apt_layer=apt == "ran")
    _apt_steps, other, _ = split_pre_install(spec.pre_install)
    network = allow_network and any(needs_network(step) for step in other)
    env_files = {
        "tools/install-deps.sh": install_deps_script(stages, python),
        "tools/conda-activate": conda_shim(),
        "Containerfile": env_containerfile(build_on),
        **{f"wheels/{stage_file(i, s.name)}": "".join(f"{r}\n" for r in s.install) for i, s in enumerate(stages)},
    }
    env_content = cache_key("env", msgspec.to_builtins(
        [build_on_id, env_files, [(s.name, s.files) for s in stages], date, python_version, apt]))
    env_image = env_image_name(task, env_content)
    files = {"tools/setup.sh": setup, "Containerfile": instance_containerfile(env_image)}
    recipe = [env_content, testbed.commit, testbed.tags, files, network]
    if testbed.submodule_state:  # only then: the images of repositories without submodules keep their hash
        recipe.append(testbed.submodule_state)
    content = cache_key("content", msgspec.to_builtins(recipe))
    warnings = [*notes, *reqs.notes, *(n for s in stages for n in s.notes),
                *setup_warnings]
    return _Plan(image=instance_image_name(task), commit=testbed.commit, stages=stages, env_image=env_image,
                 env_files=env_files, env_content=env_content, files=files, content=content, warnings=warnings,
                 date=date, python=python_version, spec_python=spec.python,
                 apt=apt, network=network)


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _write_files(ctx: Path, files: dict[str, str], label: str) -> None:
    for rel, text in files.items():
        (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
        (ctx / rel).write_text(text)
    with (ctx / "Containerfile").open("a") as f:
        f.write(label)


def _write_env_context(task: Task, plan: _Plan, ctx: Path) -> None:
    wheels = ctx / "wheels"
    wheels.mkdir(parents=True)
    for name in sorted({f for s in plan.stages for f in s.files}):
        _link(wheel_pool() / name, wheels / name)
    _write_files(ctx, plan.env_files, _env_label(task, plan))


def _ensure_env(task: Task, plan: _Plan, log: Path, say: Say) -> bool:
    """Build the plan's environment image unless an image of its content is there. Whether it was built."""
    return ensure_image(plan.env_image, plan.env_content, lambda ctx: _write_env_context(task, plan, ctx),
                        what=f"the environment of {task.repo} {task.version}", log=log, network=False,
                        say=lambda line: say(f"{task.instance_id}: {line}"))


class _Built(msgspec.Struct, frozen=True):
    """What ``_build`` made: the instance image, the warnings, and its environment image (whether made now)."""

    image: BuiltImage
    warnings: list[str]
    env: str
    env_built: bool = False


def _build(task: Task, spec: RepoSpec, repo_cache: Path, *, base: str, say: Say, force: bool,
           allow_network: bool, uploaded_prior_to: str, steps: list[str] | None = None) -> _Built:
    """Build one instance image, and its environment image first where it is missing (``force`` rebuilds the
    instance image only); ``steps`` gets each step's name (BUILD_STEPS) as it starts, so a failure can be
    placed."""
    steps = [] if steps is None else steps
    log = cache_dir() / "logs" / f"build-inst-{task.instance_id}.log"
    steps.append("clone")
    clone = find_clone(Path(repo_cache), task.repo)
    steps.append("base_commit")
    commit = resolve_commit(clone, task.base_commit)
    steps.append("clone")
    tree = list_tree(clone, commit)
    if lacking := missing_files(clone, commit, tree):
        raise ImageBuildError(
            f"the clone {clone} lacks {len(lacking)} file(s) of {task.repo} at {commit[:12]} "
            f"({', '.join(lacking[:3])}{', ...' if len(lacking) > 3 else ''}): a partial mirror that left large "
            "files out cannot make the testbed; clone the full repository into the repo cache")
    steps.append("plan")
    ctx = cache_dir() / "build" / f"inst-{task.instance_id}"
    shutil.rmtree(ctx, ignore_errors=True)
    testbed = Testbed(clone, commit, ancestor_tags(clone, commit), ctx / "testbed",
                      lambda line: say(f"{task.instance_id}: {line}"), repo_cache=Path(repo_cache), tree=tree)
    plan = _plan(task, spec, testbed, base, allow_network, log, say, uploaded_prior_to)
    for warning in plan.warnings:
        say(f"{task.instance_id}: warning: {warning}")
    if not force and image_label(plan.image, "swectl.content") == plan.content:
        shutil.rmtree(ctx, ignore_errors=True)
        say(f"{task.instance_id}: {plan.image} is up to date")
        return _Built(BuiltImage(plan.image, plan.content, plan.commit, cached=True),
                      [*plan.warnings, *testbed.warnings], plan.env_image)
    steps.append("podman_build")  # a BuildStepError names its own step (_outcome)
    env_built = _ensure_env(task, plan, log, say)
    testbed.get()
    _write_files(ctx, plan.files, _label(task, plan))
    steps.append("disk")
    check_disk(ctx)
    say(f"{task.instance_id}: building {plan.image} (log: {log})")
    previous = image_id(plan.image)
    steps.append("podman_build")
    output = podman_build(plan.image, ctx, log, network=plan.network)
    shutil.rmtree(ctx, ignore_errors=True)
    if previous and previous != image_id(plan.image):
        # the image this one replaces lost its name: remove it (not forced: a container using it keeps it)
        run_local_podman("rmi", previous, timeout=300, check=False)
    build_warnings = [line.strip() for line in output.splitlines() if line.startswith(WARNING_TAG)]
    for warning in build_warnings:
        say(f"{task.instance_id}: {warning}")
    return _Built(BuiltImage(plan.image, plan.content, plan.commit, cached=False),
                  [*plan.warnings, *testbed.warnings, *build_warnings], plan.env_image, env_built)


def build_instance_image(
    task: Task, spec: RepoSpec, repo_cache: Path, *, base: str = DEFAULT_BASE, say: Say = print,
    force: bool = False, allow_network: bool = False, uploaded_prior_to: str = "official",
) -> BuiltImage:
    """Build (or reuse, when its content label matches) the instance image of one classic SWE-bench task.
    ``uploaded_prior_to``: the date policy of the downloads (wheels.py: official, created_at, env-commit, none
    or an ISO date)."""
    return _build(task, spec, repo_cache, base=base, say=say, force=force, allow_network=allow_network,
                  uploaded_prior_to=check_date_policy(uploaded_prior_to)).image


def _skip_reason(task: Task) -> str:
    if task.image or task.eval_script:
        return "the row carries its own image / eval script"
    if not (task.test_patch and task.version and task.base_commit):
        return "not a classic SWE-bench row (needs test_patch, version and base_commit)"
    return ""


def _outcome(task: Task, specs: SpecTable, repo_cache: Path, *, base: str, say: Say, force: bool,
             allow_network: bool, uploaded_prior_to: str) -> InstanceOutcome:
    started = time.monotonic()
    skip = _skip_reason(task)
    if skip:
        return InstanceOutcome(instance_id=task.instance_id, status="skipped", message=skip)
    steps = ["spec"]
    try:
        spec = specs.get(task.repo, task.version)
        made = _build(task, spec, repo_cache, base=base, say=say, force=force, allow_network=allow_network,
                      uploaded_prior_to=uploaded_prior_to, steps=steps)
    except (SwectlError, OSError, subprocess.SubprocessError) as exc:
        step = exc.step if isinstance(exc, BuildStepError) else steps[-1]  # e.g. the disk, while planning
        say(f"{task.instance_id}: FAILED in {step}: {exc}")
        return InstanceOutcome(instance_id=task.instance_id, status="failed", message=str(exc),
                               seconds=round(time.monotonic() - started, 1), step=step)
    return InstanceOutcome(
        instance_id=task.instance_id, status="cached" if made.image.cached else "built", image=made.image.image,
        warnings=made.warnings, seconds=round(time.monotonic() - started, 1), built=made.image, env=made.env,
        env_built=made.env_built,
    )


def build_instance_images(
    tasks: Iterable[Task], specs: SpecTable, repo_cache: Path, *, base: str = DEFAULT_BASE, say: Say = print,
    force: bool = False, allow_network: bool = False, uploaded_prior_to: str = "official", jobs: int = 1,
) -> list[InstanceOutcome]:
    """Build every task's image, ``jobs`` at once, going on past failures; one outcome per task, in order."""
    if jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {jobs}")
    policy = check_date_policy(uploaded_prior_to)

    def one(task: Task) -> InstanceOutcome:
        return _outcome(task, specs, Path(repo_cache), base=base, say=say, force=force, allow_network=allow_network,
                        uploaded_prior_to=policy)

    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="image-build") as pool:
        return list(pool.map(one, tasks))


def build_one(task: Task, specs: SpecTable, repo_cache: Path, *, base: str = DEFAULT_BASE, say: Say = print,
              force: bool = False, allow_network: bool = False, uploaded_prior_to: str = "official") -> InstanceOutcome:
    """One task's image as an outcome (never raises for a build that fails: the outcome says in which step)."""
    return _outcome(task, specs, Path(repo_cache), base=base, say=say, force=force, allow_network=allow_network,
                    uploaded_prior_to=check_date_policy(uploaded_prior_to))


def remove_instance_image(image: str) -> bool:
    """Remove ``image``; podman removes with it the intermediate images of its build that nothing else uses
    (the dependency layers stay while another task's image shares them). Whether it was removed."""
    return run_local_podman("rmi", "-f", image, timeout=300, check=False).exit_code == 0


def _labelled(kind: str) -> list[tuple[str, str]]:
    """(name, swectl.instance label) of the images labelled ``swectl.image=kind``."""
    out = run_local_podman("images", "--filter", f"label=swectl.image={kind}", "--format",
                           '{{.Repository}}:{{.Tag}} {{index .Labels "swectl.instance"}}', timeout=60)
    return [(name, inst) for name, _, inst in (line.partition(" ") for line in out.stdout.decode().splitlines())
            if name and not name.startswith("<none>")]


def prune_instance_images(keep: set[str] | None = None, *, dry_run: bool = False) -> list[str]:
    """Remove the instance images (all of them, or those of instance ids not in ``keep``), then the environment,
    apt and Python images under them that no image is built on any more (podman refuses to remove an image with
    children, so the ones still in use stay). The names removed (or, with ``dry_run``, the instance images that
    would be)."""
    doomed = [name for name, inst in _labelled("instance") if keep is None or inst not in keep]
    if dry_run:
        return doomed
    removed = [name for name in doomed if remove_instance_image(name)]
    return removed + prune_unused_base_images()


BASE_KINDS = ("env", "apt", "python")  # the images under instance images; each kind is built on the next


def prune_unused_base_images(kinds: tuple[str, ...] = BASE_KINDS) -> list[str]:
    """Remove the environment, apt and Python images (those of ``kinds``) that no named image is built on any
    more, children first. The names removed."""
    removed: list[str] = []
    for kind in (k for k in BASE_KINDS if k in kinds):
        in_use = _ancestors_of_named_images()
        for name, _inst in _labelled(kind):
            if image_id(name) not in in_use and remove_base_image(name):
                removed.append(name)
    return removed


def remove_base_image(image: str) -> bool:
    """Remove an environment, apt or Python image, never forced: podman refuses one that a build in progress
    stands on (a build container uses it; its child has no name yet), which a forced removal would pull from
    under the build ("layer not known"). Whether it was removed."""
    return run_local_podman("rmi", image, timeout=300, check=False).exit_code == 0


def _all_images(tries: int = 3) -> list[dict]:
    """``podman images -a`` as JSON. An image removed while podman lists (a build finishing, another rmi) makes it
    exit 125 ("image not known"): listed again, up to ``tries`` times."""
    for attempt in range(tries):
        out = run_local_podman("images", "-a", "--format", "json", timeout=120, check=attempt == tries - 1)
        if out.exit_code == 0:
            return json.loads(out.stdout.decode() or "[]")
        time.sleep(0.5 * (attempt + 1))
    return []  # not reached: the last try raises


def _ancestors_of_named_images() -> set[str]:
    """The full ids of every image some named image is built on (its parent chain, itself excluded). podman
    would only untag a named parent, leaving its layers and losing the name the next build looks for."""
    images = _all_images()
    parent = {i["Id"]: i.get("ParentId") or "" for i in images}
    ancestors: set[str] = set()
    for image in images:
        if not (image.get("Names") or image.get("RepoTags")):  # podman 4 says Names, later ones RepoTags
            continue
        up = parent.get(image["Id"], "")
        while up and up not in ancestors:
            ancestors.add(up)
            up = parent.get(up, "")
    return ancestors


def write_image_map(results: Iterable[InstanceOutcome], path: Path) -> dict[str, str]:
    """Write ``{instance_id: image}`` of the images built or reused (JSON, for ``swectl eval --image-map``)."""
    mapping = {r.instance_id: r.image for r in results if r.ok and r.image}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(mapping, indent=2, sort_keys=True) + "\n")
    return mapping
