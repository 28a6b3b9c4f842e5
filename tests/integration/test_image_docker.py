"""A Docker node's images through the env pool, for real: the session's private dockerd (``docker_daemon``, with the
no-python image loaded), Debian's registry on 127.0.0.1 (dockerd reaches a loopback registry over plain HTTP without
being told), and thin images built here on the no-python image, pushed to the registry and never loaded into the
dockerd.

Covered: a burst of leases for an image the dockerd lacks makes one pull from the registry, every lease reports its
wait, and the image stays under its task name (the registry's name is dropped); an image the registry lacks is a
pull error that names the registry, and the pool goes on; under a small disk budget (docker's ``system df`` units)
an image not in use goes while the held lease's image stays and its sandbox keeps working; `swectl image sync`'s
pulls fill the dockerd from the registry under the tasks' names, and a second sync moves nothing; a sync from the
controller (no registry: the controller's own, pushed to as the dockerd pulls) fills the dockerd the same way, and a
second one sends nothing."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from swectl.config import ClusterConfig, decode_config
from swectl.images.push import push_image
from swectl.images.registry import parse_registry
from swectl.images.store import ImagePullError
from swectl.testing.docker import DockerDaemon
from swectl.testing.registry import LocalRegistry, local_registry

from .conftest import DOCKER_SESSION_IMAGES, NOPY_IMAGE, podman
from .images import build_thin_images
from .pools import running_pool
from .test_image_placement import burst_with_one_pull, own_file, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.anyio]
TAG = uuid.uuid4().hex[:10]
IMAGES = {name: f"localhost/swectl-dockimg-{name}:{TAG}" for name in ("burst", "held", "kept", "gone")}
LEASE_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def thin_images(tmp_path_factory: pytest.TempPathFactory, docker_daemon: DockerDaemon) -> Iterator[None]:
    work = tmp_path_factory.mktemp("dockimg")
    try:
        build_thin_images(work, NOPY_IMAGE, IMAGES)
        yield
    finally:
        podman("rmi", "-f", *IMAGES.values())
        docker_daemon.docker("rmi", "-f", *IMAGES.values())


@pytest.fixture(scope="module")
def registry(thin_images: None) -> Iterator[LocalRegistry]:
    with local_registry("127.0.0.1") as started:
        target = parse_registry(started.url)
        for image in IMAGES.values():
            pushed = push_image(image, target, timeout=120)
            assert pushed.ok, pushed.error
        yield started


def config(daemon: DockerDaemon, registry: LocalRegistry, budget_gb: float = 0.0) -> ClusterConfig:
    return decode_config({
        "nodes": [{"kind": "local", "name": "local", "image_disk_gb": budget_gb}],
        "sandbox": {"backend": "docker", "docker_host": daemon.host, "image": NOPY_IMAGE},
        "env_pool": {"warm": 0, "health_interval_s": 1.0, "registry": registry.url, "image_pull_timeout_s": 60.0},
    })


def holds(daemon: DockerDaemon, image: str) -> bool:
    return daemon.docker("image", "inspect", image).returncode == 0


def pull_into(daemon: DockerDaemon, registry: LocalRegistry, image: str) -> None:
    ref = parse_registry(registry.url).ref(image)
    for args in (["pull", ref], ["tag", ref, image], ["rmi", ref]):
        done = daemon.docker(*args)
        assert done.returncode == 0, done.stderr


async def test_a_burst_of_leases_for_an_image_the_dockerd_lacks_makes_one_pull(
        docker_daemon: DockerDaemon, registry: LocalRegistry) -> None:
    image = IMAGES["burst"]
    assert not holds(docker_daemon, image)
    async with running_pool(config(docker_daemon, registry), "t" + uuid.uuid4().hex[:12]) as pool:
        leases, _ = await burst_with_one_pull(pool, image, 4)
        for lease in leases:
            await pool.release(lease)
        with anyio.fail_after(LEASE_TIMEOUT_S):  # present now: the next lease waits for nothing
            again = await pool.acquire(image)
        assert again.image_wait_s == 0 and pool.statistics().image_pulls == 1
        await pool.release(again)
    assert holds(docker_daemon, image)
    ref = parse_registry(registry.url).ref(image)
    assert not holds(docker_daemon, ref), "the registry's name of the image should be dropped after the pull"


async def test_an_image_the_registry_lacks_is_a_pull_error_naming_it(docker_daemon: DockerDaemon,
                                                                     registry: LocalRegistry) -> None:
    missing = f"localhost/swectl-dockimg-nowhere:{TAG}"
    async with running_pool(config(docker_daemon, registry), "t" + uuid.uuid4().hex[:12]) as pool:
        with anyio.fail_after(LEASE_TIMEOUT_S), pytest.raises(ImagePullError) as caught:
            await pool.acquire(missing)
        assert f"not in {registry.url}" in str(caught.value), caught.value
        assert not holds(docker_daemon, missing)
        with anyio.fail_after(LEASE_TIMEOUT_S):  # the pool goes on
            lease = await pool.acquire(NOPY_IMAGE)
        await pool.release(lease)


async def test_image_sync_fills_the_dockerd_from_the_registry_and_a_second_sync_moves_nothing(
        docker_daemon: DockerDaemon, registry: LocalRegistry) -> None:
    from swectl.images.sync import SyncTarget, sync_images
    from swectl.remote.nodes.docker_sandbox import DockerCli
    from swectl.remote.nodes.node import LocalNode

    wanted = [IMAGES["kept"], IMAGES["gone"]]
    assert not any(holds(docker_daemon, image) for image in wanted)
    target = SyncTarget("local", DockerCli(LocalNode("local"), docker_daemon.host))
    try:
        first = await sync_images([target], wanted, parse_registry(registry.url), say=lambda _: None)
        assert first.ok, first
        (node,) = first.nodes
        assert sorted(node.pulled) == sorted(wanted) and not node.present_before
        assert all(holds(docker_daemon, image) for image in wanted)  # under the task's name
        refs = [parse_registry(registry.url).ref(image) for image in wanted]
        assert not any(holds(docker_daemon, ref) for ref in refs)  # the registry's name is dropped
        second = await sync_images([target], wanted, parse_registry(registry.url), say=lambda _: None)
        (node,) = second.nodes
        assert second.ok and not node.pulled and sorted(node.present_before) == sorted(wanted)
    finally:
        docker_daemon.docker("rmi", "-f", *wanted)


async def test_image_sync_from_the_controller_fills_the_dockerd_and_a_second_sync_sends_nothing(
        docker_daemon: DockerDaemon, thin_images: None, tmp_path: Path) -> None:
    from swectl.images.from_controller import sync_from_controller
    from swectl.images.sync import SyncTarget
    from swectl.remote.nodes.docker_sandbox import DockerCli
    from swectl.remote.nodes.node import LocalNode
    from swectl.remote.nodes.podman import PodmanCli

    wanted = [IMAGES["kept"], IMAGES["gone"]]
    docker_daemon.docker("rmi", "-f", *wanted)
    assert not any(holds(docker_daemon, image) for image in wanted)
    target = SyncTarget("docker", DockerCli(LocalNode("docker"), docker_daemon.host))
    controller = PodmanCli(LocalNode("controller"))
    lines: list[str] = []
    try:
        with anyio.fail_after(300):
            first = await sync_from_controller([target], wanted, controller=controller, cache=tmp_path / "cache",
                                               say=lines.append)
        assert first.ok, "\n".join(lines)
        (node,) = first.nodes
        assert sorted(node.pulled) == sorted(wanted) and not node.present_before
        assert all(holds(docker_daemon, image) for image in wanted)  # under the tasks' names
        names = docker_daemon.docker("images", "--format", "{{.Repository}}:{{.Tag}}").stdout.decode().split()
        assert not [n for n in names if n.startswith("127.0.0.1:")], names  # the controller registry's name dropped
        assert sum("to its registry in" in line for line in lines) >= len(wanted), lines
        with anyio.fail_after(120):
            second = await sync_from_controller([target], wanted, controller=controller, cache=tmp_path / "cache",
                                                say=lines.append)
        (node,) = second.nodes
        assert second.ok and not node.pulls and sorted(node.present_before) == sorted(wanted)
        assert "nothing to send: every node holds every image of the set that the controller has" in lines
    finally:
        docker_daemon.docker("rmi", "-f", *wanted)


async def test_a_small_disk_budget_removes_images_not_in_use_and_never_the_held_one(
        docker_daemon: DockerDaemon, registry: LocalRegistry) -> None:
    pull_into(docker_daemon, registry, IMAGES["kept"])  # not leased by this pool: the first to go
    cfg = config(docker_daemon, registry, budget_gb=0.001)  # 1 MB: the no-python image alone is over it
    try:
        await _budget_run(docker_daemon, cfg)
    finally:  # the budget removes the session dockerd's own images too: the other docker tests need them
        await anyio.to_thread.run_sync(docker_daemon.load_from_podman, list(DOCKER_SESSION_IMAGES))


async def _budget_run(docker_daemon: DockerDaemon, cfg: ClusterConfig) -> None:
    async with running_pool(cfg, "t" + uuid.uuid4().hex[:12]) as pool:
        await wait_for(lambda: not holds(docker_daemon, IMAGES["kept"]), "the image not leased to go at the start")
        with anyio.fail_after(LEASE_TIMEOUT_S):
            held = await pool.acquire(IMAGES["held"])
            await pool.release(await pool.acquire(IMAGES["gone"]))
            await pool.release(await pool.acquire(IMAGES["burst"]))  # present or pulled: a lease after "gone"
        await wait_for(lambda: not holds(docker_daemon, IMAGES["gone"]), "the image leased and given back to go")
        assert holds(docker_daemon, IMAGES["held"]) and holds(docker_daemon, NOPY_IMAGE)
        assert await own_file(held) == "image held"
        stats = pool.statistics()
        assert stats.images_evicted >= 2, stats
        (mine,) = stats.nodes
        assert mine.image_disk_budget_gb == 0.001 and mine.image_disk_gb is not None and mine.image_disk_gb > 0.001
        await pool.release(held)
