"""The env pool's image placement and disk budget for real: two sshd test nodes with Podman stores of their own
(swectl.testing.nodes, ``own_store``), Debian's registry on this machine's end of the first node's veth
(swectl.testing.registry, ``env_pool.registry``), tiny images built here (a 3 MB root of sh, sleep, cat and timeout
with their libraries, and thin images on it), Podman sandboxes over SSH.

Covered: leases of an image go to the node that holds it, with no pull; a burst of leases for an image no node
has makes exactly one pull (on one node) and every lease reports its wait; under a small disk budget the images not
in use go, least recently leased first, while the image of a held lease stays and its sandbox keeps working;
`swectl nodes check` reports the images' disk and the budget."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from swectl.actors.env_pool import EnvPool, Lease
from swectl.cli.nodes import check_nodes, format_reports
from swectl.config import ClusterConfig, decode_config
from swectl.images.push import push_image
from swectl.images.registry import parse_registry
from swectl.testing import nodes as testnodes
from swectl.testing.registry import LocalRegistry, local_registry

from .conftest import podman
from .images import build_thin_images, own_store_fleet
from .pools import running_pool
from .test_image_sync import on_node

pytestmark = [pytest.mark.integration, pytest.mark.anyio]
PREFIX = "swip"
BASE_INDEX = 224  # 10.200.224.0/24 and .225: away from other users of test nodes
TAG = uuid.uuid4().hex[:10]
BASE = f"localhost/swectl-placetest-base:{TAG}"
IMAGES = {name: f"localhost/swectl-placetest-{name}:{TAG}" for name in ("held", "burst", "kept", "gone", "last")}
ROOT_FILES = ("/bin/sh", "/bin/sleep", "/bin/cat", "/usr/bin/timeout")  # what a Podman sandbox without python needs
LEASE_TIMEOUT_S = 60.0


def _tiny_root(root: Path) -> None:
    """sh, sleep, cat and timeout with the libraries they load (ldd), as regular files at the paths they use."""
    files = set(ROOT_FILES)
    for binary in ROOT_FILES:
        out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True, timeout=30).stdout
        files |= {part for line in out.splitlines() for part in line.split() if part.startswith("/")}
    for path in files:
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(path).resolve(), target)


def _build_images(work: Path) -> None:
    _tiny_root(work / "root")
    tar = subprocess.run(["tar", "-C", str(work / "root"), "-c", "."], capture_output=True, check=True,
                         timeout=60).stdout
    done = podman("import", "-", BASE, input=tar)
    assert done.returncode == 0, done.stderr
    build_thin_images(work, BASE, IMAGES)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[testnodes.TestNodes]:
    with own_store_fleet(lambda: _build_images(tmp_path_factory.mktemp("images")), [*IMAGES.values(), BASE],
                         prefix=PREFIX, base_index=BASE_INDEX) as started:
        yield started


@pytest.fixture(scope="module")
def registry(fleet: testnodes.TestNodes) -> Iterator[LocalRegistry]:
    with local_registry(fleet.nodes[0].host_addr) as started:
        target = parse_registry(started.url)
        for image in [BASE, *IMAGES.values()]:
            pushed = push_image(image, target, timeout=120)
            assert pushed.ok, pushed.error
        yield started


def config(fleet: testnodes.TestNodes, registry: LocalRegistry, *, nodes: list[str] | None = None,
           budget_gb: float = 0.0) -> ClusterConfig:
    doc: dict[str, Any] = tomllib.loads(fleet.cluster_toml(local=False,
                                                           extra_node_fields=f"image_disk_gb = {budget_gb}"))
    doc["env_pool"] = {"warm": 0, "health_interval_s": 1.0, "registry": registry.url, "nodes": nodes or [],
                       "image_pull_timeout_s": 60.0}
    doc["sandbox"] = {"backend": "podman", "image": BASE}
    return decode_config(doc)


def holds(node: testnodes.TestNode, image: str) -> bool:
    return on_node(node, "image", "exists", image).returncode == 0


def pull_onto(node: testnodes.TestNode, registry: LocalRegistry, image: str) -> None:
    """``image`` into the node's store from the registry, under its own name (as `swectl image sync` leaves it)."""
    ref = parse_registry(registry.url).ref(image)
    for args in (["pull", "--tls-verify=false", ref], ["tag", ref, image], ["untag", image, ref]):
        done = on_node(node, *args)
        assert done.returncode == 0, done.stderr


async def acquire_many(pool: EnvPool, image: str, count: int) -> list[Lease]:
    got: list[Lease] = []

    async def one() -> None:
        got.append(await pool.acquire(image))

    with anyio.fail_after(LEASE_TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            for _ in range(count):
                tg.start_soon(one)
    return got


async def burst_with_one_pull(pool: EnvPool, image: str, count: int) -> tuple[list[Lease], float]:
    """``count`` leases at once of ``image``, which no node holds: they make one pull, each reports its wait, and the
    first one's sandbox runs (``/own`` says "image burst"). The leases, and the seconds they took."""
    start = anyio.current_time()
    leases = await acquire_many(pool, image, count)
    seconds = anyio.current_time() - start
    stats = pool.statistics()
    assert (stats.image_pulls, stats.image_waits, stats.image_pull_failures) == (1, count, 0), stats
    assert all(0 < lease.image_wait_s <= seconds for lease in leases)
    assert await own_file(leases[0]) == "image burst"
    return leases, seconds


async def own_file(lease: Lease) -> str:
    result = await lease.exec("cat /own", 30)
    assert result.exit_code == 0, result.output
    return result.output.strip()


async def test_leases_go_to_the_node_that_holds_their_image(fleet: testnodes.TestNodes,
                                                            registry: LocalRegistry) -> None:
    first, second = fleet.nodes
    pull_onto(second, registry, IMAGES["kept"])
    assert not holds(first, IMAGES["kept"])
    async with running_pool(config(fleet, registry), "t" + uuid.uuid4().hex[:12]) as pool:
        leases = await acquire_many(pool, IMAGES["kept"], 4)
        assert {lease.node for lease in leases} == {second.name}
        assert [await own_file(lease) for lease in leases[:1]] == ["image kept"]
        stats = pool.statistics()
        assert (stats.image_pulls, stats.image_waits) == (0, 0)
        assert all(lease.image_wait_s == 0 for lease in leases)
        for lease in leases:
            await pool.release(lease)
    assert not holds(first, IMAGES["kept"])


async def test_a_burst_of_leases_for_a_missing_image_makes_one_pull(fleet: testnodes.TestNodes,
                                                                    registry: LocalRegistry) -> None:
    image = IMAGES["burst"]
    assert not any(holds(node, image) for node in fleet.nodes)
    async with running_pool(config(fleet, registry), "t" + uuid.uuid4().hex[:12]) as pool:
        leases, seconds = await burst_with_one_pull(pool, image, 6)
        assert len({lease.node for lease in leases}) == 1
        for lease in leases:
            await pool.release(lease)
    assert [holds(node, image) for node in fleet.nodes].count(True) == 1
    print(f"\n6 leases of one missing image: 1 pull, {seconds:.1f}s in all, "
          f"waits {min(x.image_wait_s for x in leases):.2f}-{max(x.image_wait_s for x in leases):.2f}s")


async def test_a_small_disk_budget_removes_images_not_in_use_and_never_the_held_one(
        fleet: testnodes.TestNodes, registry: LocalRegistry) -> None:
    node = fleet.nodes[0]
    pull_onto(node, registry, IMAGES["kept"])  # not leased by this pool: the first to go
    cfg = config(fleet, registry, nodes=[node.name], budget_gb=0.001)  # 1 MB: every image is over it
    async with running_pool(cfg, "t" + uuid.uuid4().hex[:12]) as pool:
        await wait_for(lambda: not holds(node, IMAGES["kept"]), "the image not leased to go at the start")
        with anyio.fail_after(LEASE_TIMEOUT_S):
            held = await pool.acquire(IMAGES["held"])
            await pool.release(await pool.acquire(IMAGES["gone"]))
            last = await pool.acquire(IMAGES["last"])  # its pull puts the node over the budget again
        await wait_for(lambda: not holds(node, IMAGES["gone"]), "the image leased and given back to go")
        assert holds(node, IMAGES["held"]) and holds(node, IMAGES["last"])
        assert await own_file(held) == "image held"  # the held lease's sandbox still works
        stats = pool.statistics()
        assert stats.images_evicted >= 2 and stats.image_pulls == 3, stats
        (mine,) = stats.nodes
        assert mine.image_disk_budget_gb == 0.001 and mine.image_disk_gb is not None and mine.image_disk_gb > 0.001
        await pool.release(held)
        await pool.release(last)
    reports = await check_nodes(cfg, timeout_s=60)
    shown = format_reports(reports)
    report = next(r for r in reports if r.node == node.name)
    assert report.image_disk_budget_gb == 0.001 and report.image_disk_gb is not None and report.image_disk_gb > 0
    assert f"images take {report.image_disk_gb:g} GB (budget 0.001 GB)" in shown, shown


async def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``predicate`` (it runs podman: in a thread) until true, or fail naming ``what``."""
    try:
        with anyio.fail_after(timeout):
            while True:
                if await anyio.to_thread.run_sync(predicate):
                    return
                await anyio.sleep(0.2)
    except TimeoutError:
        pytest.fail(f"{what}: not within {timeout:g}s")
