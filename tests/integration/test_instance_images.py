"""Instance images for classic SWE-bench rows, built with real podman and real pip: a tiny local repository
posing as psf/requests (its SWE-bench spec: ``pip install .``, ``pytest -rA``) is built into an image offline
and graded by the real Grader with the official-style eval script (conda shim included)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import pytest

from swectl.actors.env_pool import running_pool
from swectl.actors.grader import Grader, GraderConfig
from swectl.config import load_config
from swectl.grading.eval_script import build_classic_eval_script, with_exit_code
from swectl.images.clones import find_clone
from swectl.images.instance import (
    APT_IMAGE,
    ENV_PREFIX,
    SUBSTITUTED_PYTHON,
    _labelled,
    _version_tuple,
    apt_mirror,
    build_one,
    instance_image_name,
    prune_instance_images,
    remove_instance_image,
    write_image_map,
)
from swectl.images.instance import build_instance_image as _build_instance_image
from swectl.images.instance import build_instance_images as _build_instance_images
from swectl.images.names import ImageResolver
from swectl.images.project import DEFAULT_BASE, BuiltImage, ImageBuildError, image_id, image_label
from swectl.images.pythons import find_interpreter, nearest_newer_interpreter, python_image_name
from swectl.images.recipe import needs_network
from swectl.images.requirements import environment_yml, project_extras, requirements_file
from swectl.images.wheels import OFFICIAL_CUTOFF, PYTHON_VERSION, cache_key
from swectl.remote.nodes.podman import local_podman_env
from swectl.tasks.record import Task
from swectl.tasks.specs import load_specs

pytestmark = [pytest.mark.integration]

REPO = "psf/requests"
VERSION = "2.0"
GIT_ENV = {
    "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost", "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@localhost", "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1",
}
PYPROJECT = """\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "toyreq"
version = "0.1"

[project.optional-dependencies]
test = ["six"]

[tool.setuptools]
packages = ["toyreq"]
"""
BUGGY = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
FIXED = BUGGY.replace("a - b", "a + b")
TOX_INI = "[tox]\nenvlist = py\n\n[testenv]\ncommands = pytest -rA {posargs}\n"
TESTS = "from toyreq import add, mul\n\n\ndef test_existing():\n    assert mul(2, 3) == 6\n"
NEW_TEST = "\n\ndef test_fixed():\n    assert add(2, 3) == 5\n"
BUILT: list[str] = []  # images to remove at the end of the module


class Fake(msgspec.Struct):
    repo_cache: Path
    clone: Path
    task: Task
    future_commit: str
    built: BuiltImage
    build_s: float


def git(cwd: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True,
                          env={**os.environ, **GIT_ENV})
    return proc.stdout.strip()


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, env=local_podman_env(), timeout=timeout,
                          check=False)


def build_instance_image(task: Task, *args, **kwargs) -> BuiltImage:
    BUILT.append(instance_image_name(task))  # a failed build may have tagged nothing: removing is harmless
    built = _build_instance_image(task, *args, **kwargs)
    BUILT.append(image_label(built.image, "swectl.env") or "")
    return built


def removal_order(image: str) -> int:
    """Children before the images they are built on: instance, environment, apt."""
    return 2 if APT_IMAGE in image else 1 if image.startswith(ENV_PREFIX) else 0


def layers(image: str) -> list[str]:
    out = podman("image", "inspect", "--format", "{{json .RootFS.Layers}}", image)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def spec(**changes: object):
    return msgspec.structs.replace(load_specs().get(REPO, VERSION), **changes)


def make_repo(path: Path) -> tuple[Task, str]:
    """A repository whose first commit (tag v0.1) has the bug; a later commit (tag v0.2) fixes it and adds a
    test. Returns the task (base = first commit, gold/test patches = the later diff) and the later commit."""
    (path / "toyreq").mkdir(parents=True)
    (path / "tests").mkdir()
    (path / "pyproject.toml").write_text(PYPROJECT)
    (path / "README").write_text("toy\n")
    (path / "tox.ini").write_text(TOX_INI)
    (path / "toyreq" / "__init__.py").write_text(BUGGY)
    (path / "tests" / "test_toy.py").write_text(TESTS)
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "toy: first")
    git(path, "tag", "v0.1")
    base = git(path, "rev-parse", "HEAD")
    (path / "toyreq" / "__init__.py").write_text(FIXED)
    (path / "tests" / "test_toy.py").write_text(TESTS + NEW_TEST)
    gold = git(path, "diff", "--", "toyreq") + "\n"
    test_patch = git(path, "diff", "--", "tests") + "\n"
    git(path, "commit", "-q", "-am", "toy: fix add")
    git(path, "tag", "v0.2")
    task = Task(
        instance_id=f"psf__requests-{uuid.uuid4().int % 10**8}", repo=REPO, version=VERSION, base_commit=base,
        problem_statement="add() subtracts", patch=gold, test_patch=test_patch,
        FAIL_TO_PASS=["tests/test_toy.py::test_fixed"], PASS_TO_PASS=["tests/test_toy.py::test_existing"],
    )
    return task, git(path, "rev-parse", "HEAD")


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fake]:
    root = tmp_path_factory.mktemp("inst")
    interp = find_interpreter("3.9")  # the image of the node's interpreter is under all the others
    python = [python_image_name(interp, image_id(DEFAULT_BASE) or "")] if interp else []
    python = [image for image in python if image_id(image) is None]  # removed at the end if made here
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SWECTL_CACHE", str(root / "cache"))
        clone = root / "repos" / "psf__requests"
        task, future = make_repo(clone)
        started = time.monotonic()
        built = build_instance_image(task, spec(), root / "repos")
        yield Fake(repo_cache=root / "repos", clone=clone, task=task, future_commit=future, built=built,
                   build_s=time.monotonic() - started)
    built = [image for image in reversed(dict.fromkeys(BUILT)) if image]
    for image in sorted(built, key=removal_order) + python:  # children first: instance, env, apt, python
        remove_instance_image(image)


def in_image(image: str, script: str) -> subprocess.CompletedProcess[str]:
    return podman("run", "--rm", "--network", "none", image, "bash", "-c", script)


# ------------------------------------------------------------------------------------------------ the image


def test_image_is_built_with_label_and_base_commit(fake: Fake) -> None:
    print(f"first build: {fake.build_s:.1f} s")
    assert not fake.built.cached
    assert fake.built.image == instance_image_name(fake.task)
    assert fake.built.base_commit == fake.task.base_commit
    assert image_label(fake.built.image, "swectl.content") == fake.built.content
    assert image_label(fake.built.image, "swectl.instance") == fake.task.instance_id


def test_testbed_holds_history_only_up_to_base_commit(fake: Fake) -> None:
    r = in_image(fake.built.image, f"git rev-parse HEAD; git tag; git cat-file -e {fake.future_commit} "
                                   "&& echo FUTURE-PRESENT; git remote")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split()
    assert lines[0] == fake.task.base_commit
    assert lines[1:] == ["v0.1"]  # no future tag, no future commit, no remote


def test_conda_shim_activates_the_venv_under_set_u(fake: Fake) -> None:
    r = in_image(fake.built.image, "set -u; source /opt/miniconda3/bin/activate; conda deactivate; "
                                   "conda activate testbed; command -v python; python -c 'import toyreq, pytest'; "
                                   "env | grep -c '^PIP_NO_INDEX=1$'")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["/opt/venv/bin/python", "1"]


def test_the_en_us_utf8_locale_of_the_official_images_is_there_without_apt_steps(fake: Fake) -> None:
    """The official images have every locale; specs' eval commands export LANG=en_US.UTF-8 (django's, with no apt
    step of their own) and tests read UTF-8 files in text mode. The spec here has no apt step: the locale comes from
    the base image, and an eval script's locale-gen keeps it."""
    script = ("export LANG=en_US.UTF-8 LC_ALL=en_US.UTF-8; locale-gen >/dev/null 2>&1; "
              "python -c 'import locale; locale.setlocale(locale.LC_ALL, \"\"); print(locale.getpreferredencoding())'")
    r = in_image(fake.built.image, script)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["UTF-8"], r.stdout + r.stderr
    assert "setlocale" not in r.stderr, r.stderr  # bash: "warning: setlocale: LC_ALL: cannot change locale"


def test_unpinned_requirements_resolve_as_of_the_official_cutoff(fake: Fake) -> None:
    """The runner's unpinned pytest is the last release before 2024-08-13 (8.3.2, 2024-07-20), not today's."""
    assert image_label(fake.built.image, "swectl.uploaded_prior_to") == OFFICIAL_CUTOFF
    r = in_image(fake.built.image, "python -m pytest --version")
    assert r.returncode == 0, r.stderr
    assert (r.stdout + r.stderr).split() == ["pytest", "8.3.2"]


def test_spec_python_from_the_node_where_it_has_one(fake: Fake) -> None:
    """psf/requests 2.0 asks for 3.9: the venv runs the node's 3.9 (pyenv's on these machines), else 3.11 and
    a warning in the labels."""
    assert image_label(fake.built.image, "swectl.spec_python") == "3.9"
    interp = find_interpreter("3.9")
    r = in_image(fake.built.image, "python -c 'import platform; print(platform.python_version())'")
    assert r.returncode == 0, r.stderr
    warnings = json.loads(image_label(fake.built.image, "swectl.warnings") or "[]")
    if interp is None:
        assert image_label(fake.built.image, "swectl.python") == "3.11"
        assert r.stdout.startswith("3.11.")
        assert any(w.startswith("spec python 3.9 is not available offline") for w in warnings), warnings
    else:
        assert image_label(fake.built.image, "swectl.python") == interp.full_version == r.stdout.strip()
        assert not any("spec python" in w for w in warnings), warnings


def test_spec_python_the_node_lacks_is_3_11_and_a_warning(fake: Fake) -> None:
    """3.99: no installation of it and none newer below the base image's 3.11, so the venv runs 3.11."""
    variant = msgspec.structs.replace(fake.task, instance_id=fake.task.instance_id + "4")
    lines: list[str] = []
    built = build_instance_image(variant, spec(python="3.99"), fake.repo_cache, say=lines.append)
    assert image_label(built.image, "swectl.python") == "3.11"
    assert image_label(built.image, "swectl.spec_python") == "3.99"
    warnings = json.loads(image_label(built.image, "swectl.warnings") or "[]")
    assert any(w.startswith("spec python 3.99 is not available offline") and w.endswith("runs python 3.11")
               for w in warnings), warnings
    assert any("warning: spec python 3.99" in line for line in lines), lines


def test_spec_python_the_node_lacks_runs_the_nearest_newer_one(fake: Fake) -> None:
    """3.4 (no installation here): the lowest newer 3.x the node has stands in, with a warning that says so.
    The toy repo is pyproject-only, which 3.6's setuptools cannot install editable: no install step."""
    interp = nearest_newer_interpreter("3.4")
    if interp is None or _version_tuple(interp.version) >= _version_tuple(PYTHON_VERSION):
        pytest.skip(f"no Python between 3.4 and {PYTHON_VERSION} on this node")
    variant = msgspec.structs.replace(fake.task, instance_id=fake.task.instance_id + "6")
    built = build_instance_image(variant, spec(python="3.4", install="", pip_packages=[]), fake.repo_cache,
                                 say=lambda _: None)
    assert image_label(built.image, "swectl.python") == interp.full_version
    assert image_label(built.image, "swectl.spec_python") == "3.4"
    warnings = json.loads(image_label(built.image, "swectl.warnings") or "[]")
    assert any(w.startswith(f"{SUBSTITUTED_PYTHON} 3.4 ") and interp.full_version in w for w in warnings), warnings
    r = in_image(built.image, "python -c 'import platform; print(platform.python_version())'")
    assert r.stdout.strip() == interp.full_version, r.stderr
    env = image_label(built.image, "swectl.env") or ""
    remove_instance_image(built.image)
    remove_instance_image(env)


def test_python_3_6_from_the_node_gets_a_pip_that_takes_todays_wheels(fake: Fake) -> None:
    """3.6's bundled pip (18.1) cannot install manylinux2014 wheels: the venv's pip is upgraded first."""
    interp = find_interpreter("3.6")
    if interp is None:
        pytest.skip("no Python 3.6 installation on this node")
    had_python = image_id(python_image_name(interp, image_id(DEFAULT_BASE) or "")) is not None
    variant = msgspec.structs.replace(fake.task, instance_id=fake.task.instance_id + "5")
    built = build_instance_image(variant, spec(python="3.6", install="", pip_packages=["MarkupSafe==2.0.1"]),
                                 fake.repo_cache, say=lambda _: None)
    r = in_image(built.image, "python -c 'import platform, markupsafe, pytest, pip; "
                              "print(platform.python_version(), pip.__version__)'")
    assert r.returncode == 0, r.stderr
    python, pip = r.stdout.split()
    assert python == interp.full_version
    assert tuple(int(p) for p in pip.split(".")[:2]) >= (19, 3)
    env = image_label(built.image, "swectl.env") or ""
    remove_instance_image(built.image)
    remove_instance_image(env)
    if not had_python:
        remove_instance_image(python_image_name(interp, image_id(DEFAULT_BASE) or ""))


def test_tools_that_reexec_sys_executable_keep_the_venv(fake: Fake) -> None:
    """The venv's python is a real binary (re-exec by its real path stays in the venv), and a link to it
    elsewhere (what tox --current-env makes) still imports the venv's packages."""
    probe = "import pytest, toyreq, sys; print(sys.prefix)"
    reexec = ("import os, subprocess, sys; "
              f"sys.exit(subprocess.run([os.path.realpath(sys.executable), '-c', {probe!r}]).returncode)")
    script = (f"set -e; cd /; test ! -L /opt/venv/bin/python; python -c {shlex.quote(reexec)}; "
              'mkdir -p /tmp/env/bin; ln -s "$(command -v python)" /tmp/env/bin/python; '
              f"/tmp/env/bin/python -c {shlex.quote(probe)}")
    r = in_image(fake.built.image, script)
    assert r.returncode == 0, r.stdout + r.stderr
    venv, linked = r.stdout.split()
    assert venv == "/opt/venv" and linked != venv  # the link runs the base interpreter, venv packages seen


def test_second_build_is_cached(fake: Fake) -> None:
    started = time.monotonic()
    again = build_instance_image(fake.task, spec(), fake.repo_cache, say=lambda _: None)
    print(f"cached build: {time.monotonic() - started:.2f} s")
    assert again.cached
    assert again.content == fake.built.content
    assert again.image == fake.built.image


def test_instances_of_one_version_share_one_environment_image(fake: Fake) -> None:
    """The official harness's env/instance split: a second row of the same (repo, version) and dependencies
    is a thin layer on the first one's environment image, which is not built again."""
    twin = msgspec.structs.replace(fake.task, instance_id=fake.task.instance_id + "7")
    BUILT.append(instance_image_name(twin))
    lines: list[str] = []
    outcome = build_one(twin, load_specs(), fake.repo_cache, say=lines.append)
    env = image_label(fake.built.image, "swectl.env") or ""
    assert (outcome.status, outcome.env, outcome.env_built) == ("built", env, False), outcome
    assert env.startswith(f"{ENV_PREFIX}psf_1776_requests-2.0:"), env
    assert not any("building localhost/swectl-env." in line for line in lines), lines
    assert [image_label(env, k) for k in ("swectl.image", "swectl.repo", "swectl.version")] == ["env", REPO, VERSION]
    under, over = layers(env), layers(outcome.image)
    assert over[:len(under)] == under and len(over) > len(under)  # the instance image is the env image + layers
    print(f"instance layers on the environment image: {len(over) - len(under)}")


# ------------------------------------------------------------------------------------------------ grading


@pytest.mark.anyio
async def test_gold_resolves_and_empty_does_not(fake: Fake) -> None:
    config = load_config(None, ["env_pool.warm=0"])
    resolver = ImageResolver(mapping={fake.task.instance_id: fake.built.image})
    async with running_pool(config) as pool, anyio.create_task_group() as tg:
        grader = Grader(GraderConfig(timeout_s=300), pool, resolver=resolver, specs=load_specs())
        gold = await grader.grade(fake.task, fake.task.patch)
        empty = await grader.grade(fake.task, "")
        tg.cancel_scope.cancel()
    assert gold.status == "resolved", gold
    assert gold.canaries and gold.test_exit_code == 1  # the must-fail canary (docs/grading.md)
    assert empty.status == "unresolved", empty
    assert empty.f2p_failed == fake.task.FAIL_TO_PASS
    assert not empty.p2p_failed


# ------------------------------------------------------------------------------------------------ spec variants


def test_pins_without_py311_wheels_pre_install_and_extras(fake: Fake) -> None:
    """MarkupSafe 2.1.1 has no cp311 wheel: its sdist is built in the image, offline. The apt-get step is
    skipped with a warning, the sed steps run, and the extra that `install` names (`test`: six) is installed,
    as pinned by a sed step (the project's dependencies are resolved after the offline pre_install steps, as
    SWE-bench's sphinx specs pin setup.py's requirements)."""
    variant = msgspec.structs.replace(fake.task, instance_id=fake.task.instance_id + "1")
    changed = spec(
        python="3.11",
        pip_packages=["MarkupSafe==2.1.1"],
        pre_install=["apt-get update && apt-get install -y locales", "sed -i 's/toy/toy (pre_install ran)/' README",
                     """sed -i 's/"six"/"six==1.15.0"/' pyproject.toml"""],
        install="python -m pip install -e '.[test]'",
    )
    lines: list[str] = []
    built = build_instance_image(variant, changed, fake.repo_cache, say=lines.append)
    assert any("pre_install step skipped" in line and "apt-get" in line for line in lines), lines
    assert any("from sdists (no py3.11 wheel): MarkupSafe-2.1.1.tar.gz" in line for line in lines), lines
    r = in_image(built.image, "pip list 2>/dev/null | grep -iE '^(markupsafe|six|toyreq) '; head -1 README")
    assert r.returncode == 0, r.stderr
    listed = r.stdout.split()
    assert listed[:2] == ["MarkupSafe", "2.1.1"]
    assert "toyreq" in listed
    assert listed[listed.index("six") + 1] == "1.15.0"
    assert r.stdout.rstrip().endswith("toy (pre_install ran)")


def test_apt_steps_tox_current_env_and_eval_commands(fake: Fake) -> None:
    """With allow_network and a reachable Debian mirror the apt step runs (in the apt image: locales), the
    spec's eval_commands export the locale it generates, and `tox --current-env` runs the tests in the venv.
    The test command fails unless all three hold."""
    if apt_mirror(image_id(DEFAULT_BASE) or "", DEFAULT_BASE) is None:
        pytest.skip("no Debian mirror of the base image's apt sources answers from this node")
    apt = ["apt-get update && apt-get install -y --no-install-recommends locales"]
    variant = msgspec.structs.replace(fake.task, instance_id=fake.task.instance_id + "3")
    changed = spec(
        pre_install=[*apt, "echo 'en_US.UTF-8 UTF-8' > /etc/locale.gen", "locale-gen"],
        pip_packages=["tox", "tox-current-env"],
        eval_commands=["export LANG=en_US.UTF-8", "export LC_ALL=en_US.UTF-8"],
        test_cmd="python -c 'import locale; locale.setlocale(locale.LC_ALL, \"\")' && tox --current-env -epy --",
    )
    lines: list[str] = []
    started = time.monotonic()
    built = build_instance_image(variant, changed, fake.repo_cache, allow_network=True, say=lines.append)
    interp = find_interpreter("3.9")
    under = python_image_name(interp, image_id(DEFAULT_BASE) or "") if interp else DEFAULT_BASE
    BUILT.append(f"{APT_IMAGE}:{cache_key('apt', image_id(under), apt)[:16]}")
    print(f"build with the apt image: {time.monotonic() - started:.1f} s")
    assert image_label(built.image, "swectl.apt") == "ran"
    assert not any("pre_install step" in line for line in lines), lines
    script = with_exit_code(build_classic_eval_script(variant, changed))
    r = subprocess.run(["podman", "run", "--rm", "-i", "--network", "none", built.image, "bash", "-s"], input=script,
                       capture_output=True, text=True, env=local_podman_env(), timeout=600, check=False)
    out = r.stdout + r.stderr
    assert "PASSED tests/test_toy.py::test_existing" in out, out[-3000:]
    assert "FAILED tests/test_toy.py::test_fixed" in out, out[-3000:]  # the test patch, no gold patch


def test_failed_install_is_an_error_and_leaves_no_layers(fake: Fake) -> None:
    task = msgspec.structs.replace(fake.task, instance_id=fake.task.instance_id + "2")
    with pytest.raises(ImageBuildError, match="the install command failed") as info:
        build_instance_image(task, spec(install="python -m pip install . && false"), fake.repo_cache,
                             say=lambda _: None)
    log = Path(str(info.value).split("log: ", 1)[1].split(";", 1)[0]).read_text()
    fresh = [ln[4:] for ln, before in zip(log.splitlines()[1:], log.splitlines(), strict=False)
             if ln.startswith("--> ") and not before.startswith("--> Using cache")]
    assert fresh, log[-2000:]
    assert all(podman("image", "exists", layer).returncode != 0 for layer in fresh)


# ------------------------------------------------------------------------------------------------ errors


def test_a_build_that_would_not_fit_on_disk_stops_before_podman(fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    task = msgspec.structs.replace(fake.task, instance_id=fake.task.instance_id + "5")
    monkeypatch.setenv("SWECTL_BUILD_MIN_FREE", str(1 << 60))  # more than any disk has
    outcome = build_one(task, load_specs(), fake.repo_cache, say=lambda _: None)
    assert (outcome.status, outcome.step) == ("failed", "disk")
    assert "not enough disk for this build: it needs about" in outcome.message
    assert "GiB is; free some (swectl image prune --instances)" in outcome.message
    assert podman("image", "exists", instance_image_name(task)).returncode != 0


def podman_build_in_group(pgid: int) -> bool:
    """Whether a ``podman build`` runs in process group ``pgid``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != pgid:
                continue
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"podman") and b"build" in argv:
            return True
    return False


def test_a_build_killed_midway_leaves_no_image_and_builds_next_time(fake: Fake, tmp_path: Path) -> None:
    task = msgspec.structs.replace(fake.task, instance_id=fake.task.instance_id + "6")
    BUILT.append(instance_image_name(task))
    rows = tmp_path / "tasks.jsonl"
    rows.write_text(json.dumps(task.row()) + "\n")
    log = tmp_path / "build.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "swectl.cli.main", "image", "build", "--repo-cache",
                                 str(fake.repo_cache), "--tasks", str(rows), "--force"], stdout=out, stderr=out,
                                start_new_session=True)
    deadline = time.monotonic() + 300
    while b"building localhost/swectl-inst." not in log.read_bytes() or not podman_build_in_group(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.05)
    # podman build is under way (a fast machine builds the thin instance layer in about a second): freeze the
    # whole group at once, so that it cannot finish between the look and the kill, then kill it
    os.killpg(proc.pid, signal.SIGSTOP)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert podman("image", "exists", instance_image_name(task)).returncode != 0  # nothing half-built is named
    outcome = build_one(task, load_specs(), fake.repo_cache, say=lambda _: None)
    assert outcome.status == "built", outcome.message


def test_missing_base_commit_is_a_clear_error(fake: Fake) -> None:
    task = msgspec.structs.replace(fake.task, base_commit="f" * 40)
    with pytest.raises(ImageBuildError, match=r"commit f{40} is not in the clone .*psf__requests"):
        build_instance_image(task, spec(), fake.repo_cache)


def test_find_clone_layouts_and_error(fake: Fake, tmp_path: Path) -> None:
    assert find_clone(fake.repo_cache, REPO) == fake.repo_cache / "psf__requests"
    subprocess.run(["git", "clone", "-q", "--bare", str(fake.clone), str(tmp_path / "a" / "psf" / "requests")],
                   check=True)
    assert find_clone(tmp_path / "a", REPO) == tmp_path / "a" / "psf" / "requests"
    subprocess.run(["git", "clone", "-q", str(fake.clone), str(tmp_path / "b" / "requests")], check=True)
    assert find_clone(tmp_path / "b", REPO) == tmp_path / "b" / "requests"
    with pytest.raises(ImageBuildError) as info:
        find_clone(tmp_path / "none", REPO)
    for tried in ("none/psf__requests", "none/psf/requests", "none/requests"):
        assert tried in str(info.value)


def test_build_many_goes_on_past_failures_and_writes_the_map(fake: Fake, tmp_path: Path) -> None:
    broken = msgspec.structs.replace(fake.task, instance_id="psf__requests-0", base_commit="0" * 40)
    foreign = msgspec.structs.replace(fake.task, instance_id="other__x-1", image="example/img:1")
    results = _build_instance_images([broken, fake.task, foreign], load_specs(), fake.repo_cache,
                                     say=lambda _: None)
    assert [r.status for r in results] == ["failed", "cached", "skipped"]
    assert "is not in the clone" in results[0].message
    assert results[0].step == "base_commit"
    parallel = _build_instance_images([broken, fake.task, foreign], load_specs(), fake.repo_cache,
                                      say=lambda _: None, jobs=2)
    assert [(r.instance_id, r.status) for r in parallel] == [(r.instance_id, r.status) for r in results]
    mapping = write_image_map(results, tmp_path / "map.json")
    assert mapping == {fake.task.instance_id: fake.built.image}
    assert ImageResolver.from_options(map_file=tmp_path / "map.json").resolve(fake.task) == fake.built.image


def test_prune_removes_instance_images_not_kept_and_leaves_images_in_use(fake: Fake) -> None:
    under = image_label(fake.built.image, "swectl.python")
    variant = msgspec.structs.replace(fake.task, instance_id=fake.task.instance_id + "9")
    built = build_instance_image(variant, spec(), fake.repo_cache, say=lambda _: None)
    others = {inst for _name, inst in _labelled("instance")} - {variant.instance_id}  # other runs' images stay
    assert prune_instance_images(others, dry_run=True) == [built.image]
    assert podman("image", "exists", built.image).returncode == 0  # a dry run removes nothing
    removed = prune_instance_images(others)
    assert built.image in removed
    assert podman("image", "exists", built.image).returncode != 0
    assert podman("image", "exists", fake.built.image).returncode == 0
    assert podman("image", "exists", image_label(fake.built.image, "swectl.env") or "-").returncode == 0  # in use
    interp = find_interpreter("3.9")
    if interp and under == interp.full_version:  # its Python image is in use: podman keeps it
        assert podman("image", "exists", python_image_name(interp, image_id(DEFAULT_BASE) or "")).returncode == 0


def test_prune_removes_an_environment_image_with_its_last_instance(fake: Fake) -> None:
    variant = msgspec.structs.replace(fake.task, instance_id=fake.task.instance_id + "8")
    built = build_instance_image(variant, spec(pip_packages=["six"]), fake.repo_cache, say=lambda _: None)
    env = image_label(built.image, "swectl.env") or ""
    assert env.startswith(ENV_PREFIX) and env != image_label(fake.built.image, "swectl.env")
    others = {inst for _name, inst in _labelled("instance")} - {variant.instance_id}
    removed = prune_instance_images(others)
    assert built.image in removed and env in removed
    assert podman("image", "exists", env).returncode != 0
    assert podman("image", "exists", fake.built.image).returncode == 0


# ------------------------------------------------------------------------------------------------ requirements


def test_requirement_files_are_read_at_the_commit(tmp_path: Path) -> None:
    repo = tmp_path / "r"
    (repo / "requirements").mkdir(parents=True)
    (repo / "requirements" / "dev.txt").write_text(
        "# dev\n-r base.txt\npytest>=7  # runner\n-e .\ngit+https://example.com/x.git\nfoo @ https://x/foo.whl\n"
    )
    (repo / "requirements" / "base.txt").write_text("click==8.1.3\n--index-url https://x\nJinja2\\\n>=3\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "r")
    notes: list[str] = []
    reqs = requirements_file(repo, git(repo, "rev-parse", "HEAD"), "requirements/dev.txt", notes)
    assert reqs == ["click==8.1.3", "Jinja2>=3", "pytest>=7"]
    assert len(notes) == 4  # --index-url, -e ., the git+ URL and the URL requirement


def test_project_extras_of_install_commands() -> None:
    assert project_extras("python -m pip install -e .") == []
    assert project_extras("python -m pip install -e '.[dev,test]' --verbose") == ["dev", "test"]
    assert project_extras('python -m pip install --no-build-isolation -e ".[dev]"') == ["dev"]
    assert project_extras("python setup.py build; python setup.py install") == []
    assert project_extras("") is None


def test_environment_yml_and_network_steps() -> None:
    notes: list[str] = []
    text = "dependencies:\n  - python=3.9\n  - numpy=1.21\n  - conda-forge::scipy>=1.5\n  - pip\n" \
           "  - pip:\n    - pytest-cov\n    - -e .\n"
    assert environment_yml(text, "environment.yml", notes) == ["numpy==1.21", "scipy>=1.5", "pytest-cov"]
    assert len(notes) == 1
    assert needs_network("apt-get update && apt-get install -y locales")
    assert needs_network('wget -O "$QHULL_TAR" "$QHULL_URL"')
    assert not needs_network("sed -i 's/pytest/pytest -rA/' tox.ini")
    assert not needs_network('mkdir -p "$QHULL_BUILD_DIR"')
