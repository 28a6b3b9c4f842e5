"""Fixtures for integration tests against real podman containers and namespace sandboxes on this machine.

Every sandbox a test creates carries the label ``swectl.test=<session id>``; a session-scoped finalizer
force-removes every container and namespace sandbox with that label, so nothing is left behind even when a
test fails. The whole directory is skipped (with the reason) when podman or the base image is missing.

``backend`` (and so ``sandbox``) is parametrised over the sandbox backends: ``podman``, ``namespace`` and
``docker``, and ``podman-api`` (Podman with ``sandbox.podman_api``: lifecycle through the node's Podman API
service, which the backend starts on this machine if none runs, and which stays running). Docker sandboxes
run on a private dockerd (swectl/testing/docker.py) that the session-scoped ``docker_daemon`` fixture starts
the first time a docker backend is wanted, loads with the base and no-python images from Podman, and stops
(with its containers and folders) at the end of the session.
Fault injection goes through ``kill_from_outside`` and ``wait_for_file``, which know each backend.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import msgspec
import pytest

from swectl.config import DEFAULT_IMAGE, SandboxConfig
from swectl.remote.nodes.docker_sandbox import DockerBackend, DockerSandbox
from swectl.remote.nodes.namespace_sandbox import NamespaceBackend, NamespaceSandbox
from swectl.remote.nodes.node import LocalNode
from swectl.remote.nodes.podman import bundled_containers_conf
from swectl.remote.nodes.podman_sandbox import PodmanBackend, PodmanSandbox
from swectl.schema import SandboxSpec
from swectl.testing.docker import DockerDaemon, docker_unavailable, start_private_docker

Backend = PodmanBackend | NamespaceBackend | DockerBackend
Sandbox = PodmanSandbox | NamespaceSandbox | DockerSandbox
BACKEND_KINDS = ("podman", "podman-api", "namespace", "docker")

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
CONTAINERS_CONF = bundled_containers_conf()
BASE_IMAGE = DEFAULT_IMAGE
NOPY_IMAGE = "localhost/swectl-test-nopy:latest"
OLDPY_IMAGE = "localhost/swectl-test-oldpy:latest"
# what the session's dockerd holds from the start; a test that empties its image store loads these back
DOCKER_SESSION_IMAGES = (BASE_IMAGE, NOPY_IMAGE, OLDPY_IMAGE)
TEST_LABEL = "swectl.test"
SESSION_ID = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
SPEC_WORKDIR = "/srv"  # exists in the image: podman does not create a --workdir that is missing
SPEC_ENV = {"SWECTL_SPEC_VAR": "from the spec"}


def podman(*args: str, input: bytes | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The podman CLI with swectl's containers.conf (runc fails on rlimits without it here)."""
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    return subprocess.run(["podman", *args], input=input, capture_output=True, env=env, timeout=timeout, check=False)


def _unavailable() -> str | None:
    setup = "run `bash scripts/setup.sh` to install podman and build the base image"
    if shutil.which("podman") is None:
        return f"podman is not installed; {setup}"
    try:
        out = podman("image", "exists", BASE_IMAGE, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"podman does not work ({exc}); {setup}"
    if out.returncode != 0:
        return f"base image {BASE_IMAGE} is missing; {setup}"
    return None


UNAVAILABLE = _unavailable()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every test of this directory, with the reason, when podman or the base image is missing.

    The no-python image exercises Podman's `podman exec` fallback; a namespace sandbox has no such path
    (its agent needs no python3 in the image), so those combinations are not collected."""
    kept = [item for item in items if not _namespace_plain(item)]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if _namespace_plain(item)])
        items[:] = kept
    if UNAVAILABLE is None:
        return
    skip = pytest.mark.skip(reason=UNAVAILABLE)
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


def _namespace_plain(item: pytest.Item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("backend_kind") == "namespace" and params.get("image") == "plain"


def session_labels(**extra: str) -> dict[str, str]:
    """Labels for a container of this test session (the cleanup finalizer removes it)."""
    return {TEST_LABEL: SESSION_ID, **extra}


def make_spec(image: str = BASE_IMAGE, **kwargs: object) -> SandboxSpec:
    """A SandboxSpec that always carries this session's cleanup label."""
    labels = session_labels(**kwargs.pop("labels", {}))  # type: ignore[arg-type]
    return SandboxSpec(image=image, labels=labels, **kwargs)  # type: ignore[arg-type]


async def apodman(*args: str) -> subprocess.CompletedProcess[bytes]:
    """`podman(...)` for async tests."""
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    with anyio.fail_after(120):
        return await anyio.run_process(["podman", *args], env=env, check=False)


_DOCKER: DockerDaemon | None = None  # this session's private dockerd, once the docker_daemon fixture started it


async def adocker(*args: str) -> subprocess.CompletedProcess[bytes]:
    """The docker CLI against this session's private dockerd, for async tests."""
    assert _DOCKER is not None, "the docker_daemon fixture has not started the test dockerd"
    with anyio.fail_after(120):
        return await anyio.run_process(["docker", *args], env=_DOCKER.env(), check=False)


def engine_cli(backend: Backend) -> Callable[..., Awaitable[subprocess.CompletedProcess[bytes]]] | None:
    """`apodman` or `adocker` for a container backend's own engine; None for a namespace backend."""
    if isinstance(backend, DockerBackend):
        return adocker
    if isinstance(backend, PodmanBackend):
        return apodman
    return None


# a sandbox's CPU quota, from inside: cgroup v2 "QUOTA PERIOD" ("max ..." = none), or v1's quota (-1 = none)
CPU_QUOTA = "cat /sys/fs/cgroup/cpu.max 2>/dev/null || cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us"
STARTED_MARK = "/tmp/swectl-test-started"  # a command under test creates it once it runs (see wait_for_file)


async def host_pid(box: NamespaceSandbox) -> int:
    """The host pid of a namespace sandbox's PID 1 (its exec agent), from the node's daemon."""
    pids = await box._backend.host_pids()
    return pids[box.id]


async def file_exists(box: Sandbox | str, path: str) -> bool:
    """Whether ``path`` exists inside the sandbox (or the Podman container of that id), looked at from outside
    it (not through its agent)."""
    if isinstance(box, str):
        return (await apodman("exec", box, "test", "-e", path)).returncode == 0
    if isinstance(box, NamespaceSandbox):
        return await anyio.Path(f"/proc/{await host_pid(box)}/root{path}").exists()
    cli = adocker if isinstance(box, DockerSandbox) else apodman
    return (await cli("exec", box.id, "test", "-e", path)).returncode == 0


async def wait_for_file(box: Sandbox | str, path: str = STARTED_MARK, timeout_s: float = 30) -> None:
    """Wait (bounded) until ``path`` exists in the sandbox: a test's command creates it when it has started,
    so fault injection begins on that event instead of after a guessed sleep."""
    with anyio.fail_after(timeout_s):
        while not await file_exists(box, path):  # noqa: ASYNC110 (in the sandbox)
            await anyio.sleep(0.1)


async def kill_from_outside(box: Sandbox) -> None:
    """Kill the sandbox the way a node would (OOM killer, an operator): `podman kill`, `docker kill`, or
    SIGKILL to the namespace's PID 1 from the host."""
    if isinstance(box, NamespaceSandbox):
        os.kill(await host_pid(box), 9)
        return
    killed = await (adocker if isinstance(box, DockerSandbox) else apodman)("kill", box.id)
    assert killed.returncode == 0, killed.stderr


def session_containers() -> list[str]:
    out = podman("ps", "-a", "-q", "--no-trunc", "--filter", f"label={TEST_LABEL}={SESSION_ID}")
    return out.stdout.decode().split()


async def _remove_session_namespace_sandboxes() -> None:
    backend = NamespaceBackend(LocalNode(), SandboxConfig())
    await backend.prepare()
    boxes = await backend.list({TEST_LABEL: SESSION_ID})
    await backend.remove([box.id for box in boxes])


@pytest.fixture(scope="session", autouse=True)
def _remove_session_containers() -> Iterator[None]:
    yield
    if UNAVAILABLE is not None:
        return
    ids = session_containers()
    if ids:
        podman("rm", "-f", "-t", "0", *ids)
    anyio.run(_remove_session_namespace_sandboxes)


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny policy folder from `swectl model init` (2 layers, hidden 64, vocab 600), made once per session."""
    from swectl.cli.main import main

    out = tmp_path_factory.mktemp("model") / "tiny"
    assert main(["model", "init", "--out", str(out), "--vocab", "600", "--layers", "2", "--hidden", "64",
                 "--corpus-max-bytes", "300000"]) == 0
    return out


def derived_test_image(name: str, containerfile_body: str) -> str:
    """A test image ``FROM`` the base image plus ``containerfile_body``, built once (kept by podman between runs)."""
    if podman("image", "exists", name).returncode == 0:
        return name
    with tempfile.TemporaryDirectory(prefix="swectl-test-image-") as context:
        (Path(context) / "Containerfile").write_text(f"FROM {BASE_IMAGE}\n{containerfile_body}")
        out = podman("build", "--network", "none", "-t", name, context, timeout=300)
    if out.returncode != 0:
        pytest.fail(f"building {name} failed: {out.stderr.decode(errors='replace')}")
    return name


@pytest.fixture(scope="session")
def nopython_image() -> str:
    """An image like the base image but without python3 (exercises the `podman exec` fallback)."""
    return derived_test_image(NOPY_IMAGE, "RUN rm -f /usr/bin/python3*\n")


@pytest.fixture(scope="session")
def old_python_image() -> str:
    """The base image with a project environment first on PATH whose python3 cannot run the exec agent (as Django
    3.0's SWE-bench environment puts Python 3.6 in /opt/venv/bin): this one prints a version and exits 1."""
    return derived_test_image(OLDPY_IMAGE, (
        "RUN mkdir -p /opt/venv/bin && printf '#!/bin/sh\\necho Python 3.6.15\\nexit 1\\n' "
        "> /opt/venv/bin/python3 && chmod +x /opt/venv/bin/python3\n"
        "ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"))


@pytest.fixture(params=["agent", "plain"])
def image(request: pytest.FixtureRequest) -> str:
    """The base image (exec agent path) and the no-python image (`podman exec` fallback path)."""
    if request.param == "agent":
        return BASE_IMAGE
    return request.getfixturevalue("nopython_image")


@pytest.fixture(scope="session")
def docker_daemon(nopython_image: str, old_python_image: str) -> Iterator[DockerDaemon]:
    """This session's private dockerd with the base and no-python images; started on first use, stopped
    (containers removed, its folders deleted) when the session ends."""
    global _DOCKER
    reason = docker_unavailable()
    if reason is not None:
        pytest.skip(f"docker backend: {reason}")
    daemon = start_private_docker()
    try:
        assert (nopython_image, old_python_image) == DOCKER_SESSION_IMAGES[1:]
        daemon.load_from_podman(list(DOCKER_SESSION_IMAGES))
        _DOCKER = daemon
        yield daemon
    finally:
        _DOCKER = None
        daemon.stop()


def backend_object(kind: str, config: SandboxConfig | None = None) -> Backend:
    """A backend of ``kind`` on this machine, not prepared (docker: pointed at the session's dockerd)."""
    config = config or SandboxConfig()
    if kind == "docker":
        assert _DOCKER is not None, "request the docker_daemon fixture (or backend_kind) first"
        return DockerBackend(LocalNode(), msgspec.structs.replace(config, docker_host=_DOCKER.host))
    if kind == "podman-api":
        return PodmanBackend(LocalNode(), msgspec.structs.replace(config, podman_api=True), containers_conf="bundled")
    cls = NamespaceBackend if kind == "namespace" else PodmanBackend
    return cls(LocalNode(), config, containers_conf="bundled")


async def new_backend(config: SandboxConfig | None = None, kind: str = "podman") -> Backend:
    backend = backend_object(kind, config)
    with anyio.fail_after(60):
        await backend.prepare()
    return backend


async def create_sandbox(backend: Backend, spec: SandboxSpec) -> Sandbox:
    with anyio.fail_after(60):
        return await backend.create(spec)


@pytest.fixture(params=BACKEND_KINDS)
def backend_kind(request: pytest.FixtureRequest) -> str:
    if request.param == "docker":
        request.getfixturevalue("docker_daemon")
    return request.param


@pytest.fixture
async def backend(backend_kind: str, request: pytest.FixtureRequest) -> Backend:
    if backend_kind == "docker":  # also where a test parametrizes backend_kind itself (the fixture above is skipped)
        request.getfixturevalue("docker_daemon")
    return await new_backend(kind=backend_kind)


@pytest.fixture
async def sandbox(backend: Backend, image: str) -> AsyncIterator[Sandbox]:
    """A fresh sandbox per test (both exec paths), with a workdir and env from the spec."""
    box = await create_sandbox(backend, make_spec(image, workdir=SPEC_WORKDIR, env=SPEC_ENV))
    try:  # a namespace sandbox runs its agent on the node's python: no image needs python3
        assert box.uses_agent == (image == BASE_IMAGE or isinstance(box, NamespaceSandbox))
        yield box
    finally:
        await box.destroy()
