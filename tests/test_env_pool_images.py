"""The env pool's image logic (actors/env_pool.py) against fake nodes and fake image stores, fast: leases go to the node
that holds their image, a burst of leases for a missing image makes one pull and every lease waits for it (the wait
reported per lease, in the statistics and as env/ metrics), a failed pull fails its waiters and is not retried at
once, and the disk budget removes the least recently leased images, never one in use, pending, or sandbox.image.
The same with real SSH nodes, Podman stores and a registry: tests/integration/test_image_placement.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from swectl.actors.env_pool import EnvPool
from swectl.actors.metrics import EnvReadings
from swectl.config import EnvPoolConfig, LocalNodeConfig, SandboxConfig
from swectl.errors import InfraError
from swectl.images.presence import image_key
from swectl.images.store import ImagePullError
from swectl.schema import ExecResult, SandboxInfo, SandboxSpec

pytestmark = pytest.mark.anyio
BASE = "localhost/base:1"
MB = 1_000_000


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FakeSandbox:
    def __init__(self, node: FakeBackend, spec: SandboxSpec, n: int) -> None:
        self.id = self.name = f"{node.name}-{n}"
        self.node = node.name
        self.image = spec.image
        self._backend = node

    async def exec(self, command: str, timeout: float, **_: object) -> ExecResult:
        return ExecResult(output="", exit_code=0, timed_out=False)

    async def ping(self) -> None:
        pass

    async def destroy(self) -> None:
        self._backend.live.pop(self.id, None)

    async def break_transport(self) -> None:
        pass


class FakeBackend:
    """A node that starts sandboxes of any image its store holds (and fails like podman otherwise)."""

    def __init__(self, name: str, store: FakeStore) -> None:
        self.name = name
        self.store = store
        self.live: dict[str, FakeSandbox] = {}
        self._n = 0

    prepared = True
    alive = True

    async def prepare(self) -> None:
        pass

    async def probe(self) -> str:
        return "fake"

    async def create(self, spec: SandboxSpec) -> FakeSandbox:
        if image_key(spec.image) not in self.store.images:
            raise InfraError(f"{self.name}: image {spec.image} not known")
        self._n += 1
        sandbox = FakeSandbox(self, spec, self._n)
        self.live[sandbox.id] = sandbox
        return sandbox

    async def list(self, labels: dict[str, str]) -> list[SandboxInfo]:
        return []

    async def remove(self, ids: list[str]) -> None:
        for i in ids:
            self.live.pop(i, None)

    async def aclose(self) -> None:
        pass

    def preloaded_images(self) -> set[str]:
        return set()


class FakeStore:
    """A node's image store: images -> bytes; pulls take ``pull_s`` and come from ``registry`` (image -> bytes)."""

    def __init__(self, images: dict[str, int], registry: dict[str, int], pull_s: float = 0.2) -> None:
        self.images = {image_key(k): v for k, v in images.items()}
        self.registry = {image_key(k): v for k, v in registry.items()}
        self.pull_s = pull_s
        self.pulled: list[str] = []
        self.removed: list[str] = []
        self.in_use_by_others: set[str] = set()

    async def names(self) -> dict[str, str]:
        return {k: f"sha256:{i}" for i, k in enumerate(self.images)}

    async def exists(self, image: str) -> bool:
        return image_key(image) in self.images

    async def pull(self, image: str) -> None:
        await anyio.sleep(self.pull_s)
        key = image_key(image)
        if key not in self.registry:
            raise ImagePullError(f"pulling {key} failed: manifest unknown")
        self.pulled.append(key)
        self.images[key] = self.registry[key]

    async def remove(self, image: str) -> str:
        key = image_key(image)
        if key in self.in_use_by_others:
            return "image is in use by a container"
        self.images.pop(key, None)
        self.removed.append(key)
        return ""

    async def disk_bytes(self) -> int:
        return sum(self.images.values())


@asynccontextmanager
async def pool_on(stores: dict[str, FakeStore], *, budget_gb: dict[str, float] | None = None,
                  warm: int = 0) -> AsyncIterator[EnvPool]:
    nodes = [(LocalNodeConfig(name=name, max_running=16, max_starting=4,
                              image_disk_gb=(budget_gb or {}).get(name, 0.0)), FakeBackend(name, store))
             for name, store in stores.items()]
    pool = EnvPool(EnvPoolConfig(warm=warm, health_interval_s=60.0, start_retries=0, image_pull_timeout_s=5.0),
                   SandboxConfig(image=BASE, backend="podman"), nodes, run_id="t", image_stores=stores)
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(10):
            await tg.start(pool.run)
        yield pool
        tg.cancel_scope.cancel()


async def test_leases_go_to_the_node_that_holds_their_image_without_a_pull() -> None:
    stores = {"a": FakeStore({BASE: MB}, {}), "b": FakeStore({BASE: MB, "localhost/x:1": MB}, {})}
    async with pool_on(stores) as pool:
        with anyio.fail_after(10):
            leases = [await pool.acquire("localhost/x:1") for _ in range(5)]
        assert {lease.node for lease in leases} == {"b"}
        assert all(lease.image_wait_s == 0 for lease in leases)
        stats = pool.statistics()
        assert stats.image_pulls == 0 and stats.image_waits == 0
        assert [n.images for n in stats.nodes] == [1, 2]
        # the base image is on both: the least loaded node gets it
        with anyio.fail_after(10):
            assert (await pool.acquire(BASE)).node == "a"


async def test_a_burst_of_leases_for_a_missing_image_makes_one_pull_and_every_lease_waits_for_it() -> None:
    registry = {"localhost/y:1": MB}
    stores = {"a": FakeStore({BASE: MB}, registry, pull_s=0.5), "b": FakeStore({BASE: MB}, registry, pull_s=0.5)}
    leases = []
    async with pool_on(stores) as pool:
        readings = EnvReadings(pool.statistics)

        async def one() -> None:
            leases.append(await pool.acquire("localhost/y:1"))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for _ in range(8):  # more than max_starting (4): the rest wait for a start slot on that node
                    tg.start_soon(one)
        assert sorted(stores["a"].pulled + stores["b"].pulled) == ["localhost/y:1"]
        assert len({lease.node for lease in leases}) == 1
        assert all(0.4 < lease.image_wait_s < 5 for lease in leases), [lease.image_wait_s for lease in leases]
        stats = pool.statistics()
        assert (stats.image_pulls, stats.image_waits) == (1, 8)
        assert stats.image_wait_s == pytest.approx(sum(lease.image_wait_s for lease in leases))
        values = readings.step_values()
        assert values["env/image_pulls"] == 1 and values["env/image_waits"] == 8
        assert values["env/image_wait_s"] == pytest.approx(stats.image_wait_s)
        assert readings.step_values()["env/image_waits"] == 0  # the next step: only what moved since


async def test_a_failed_pull_fails_every_waiting_lease_and_is_not_tried_again_at_once() -> None:
    stores = {"a": FakeStore({BASE: MB}, {})}
    async with pool_on(stores) as pool:
        errors: list[Exception] = []

        async def one() -> None:
            try:
                await pool.acquire("localhost/nowhere:1")
            except ImagePullError as exc:
                errors.append(exc)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(one)
            assert len(errors) == 3 and all("manifest unknown" in str(e) for e in errors)
            with pytest.raises(ImagePullError, match="failed less than"):
                await pool.acquire("localhost/nowhere:1")
        assert pool.statistics().image_pull_failures == 1


async def test_the_disk_budget_removes_least_recently_leased_images_never_one_in_use_or_the_pool_image() -> None:
    images = {BASE: 4 * MB, "localhost/foreign:1": MB, "localhost/old:1": 2 * MB, "localhost/older:1": 2 * MB,
              "localhost/used:1": 2 * MB}
    store = FakeStore(images, {"localhost/new:1": 2 * MB, "localhost/big:1": 5 * MB}, pull_s=0.05)
    store.in_use_by_others.add("localhost/foreign:1")  # a container the pool does not know of uses it: it stays

    async def removed(count: int) -> list[str]:
        with anyio.fail_after(10):
            while True:
                if len(store.removed) >= count:
                    break
                await anyio.sleep(0.01)
        await anyio.sleep(0.1)  # and nothing more goes
        return store.removed

    # at the start the node holds 11 MB against a budget of 9: images never leased go first (by name)
    async with pool_on({"a": store}, budget_gb={"a": 0.009}) as pool:
        assert await removed(1) == ["localhost/old:1"]
        with anyio.fail_after(10):
            held = await pool.acquire("localhost/used:1")  # in use from now on
            await pool.release(await pool.acquire("localhost/older:1"))  # leased and given back
            fresh = await pool.acquire("localhost/new:1")  # pulled: 11 MB again
        assert await removed(2) == ["localhost/old:1", "localhost/older:1"]
        stats = pool.statistics()
        assert stats.images_evicted == 2 and stats.image_pulls == 1
        assert stats.nodes[0].image_disk_gb == pytest.approx(0.009) and stats.nodes[0].image_disk_budget_gb == 0.009
        # given back, used and new may go (least recently leased first); big is pending, BASE is sandbox.image
        await pool.release(held)
        await pool.release(fresh)
        with anyio.fail_after(10):
            big = await pool.acquire("localhost/big:1")
        assert (await removed(4))[2:] == ["localhost/used:1", "localhost/new:1"]
        assert sorted(store.images) == sorted(image_key(i) for i in (BASE, "localhost/foreign:1", "localhost/big:1"))
        assert pool.statistics().nodes[0].image_disk_gb == pytest.approx(0.010)  # over, and all of it in use
        await pool.release(big)
