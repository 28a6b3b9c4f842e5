"""`swectl image sync` and `image push` logic against scripted nodes and a scripted registry (httpx MockTransport),
from a registry and from the controller (what is pushed, in which order, what the nodes lack, images the controller
lacks, failed pushes, names left by a stopped sync); the controller's registry (its binary, its port kept, one sync
per cache), the byte-counting relay and the sweep of stopped pulls' downloads, for real on this machine.

The real thing (sshd test nodes with their own Podman stores, Debian's registry) is tests/integration/
test_image_sync.py and test_image_sync_controller.py; here the rules are checked exactly: what is pulled where, how
many at once, bytes, faults."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import anyio
import httpx
import msgspec
import pytest

from swectl.errors import ConfigError, NodeConnectError, NodeLostError
from swectl.images import controller_registry as ctlreg
from swectl.images.from_controller import leftovers, sync_from_controller
from swectl.images.registry import Registry, RegistryError, image_path, normal_name, parse_registry
from swectl.images.relay import ByteRelay
from swectl.images.sync import SyncOptions, SyncTarget, format_report, human_bytes, sync_images
from swectl.remote.nodes.docker_sandbox import docker_bytes
from swectl.remote.nodes.node import LocalNode
from swectl.remote.nodes.podman import PodmanCli
from swectl.remote.nodes.pull_folders import PULL_SCRIPT, SWEEP_SCRIPT
from swectl.schema import CommandOutput

REG = Registry(host="10.9.0.1:5000", plain_http=True)


def _digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _config(diff_ids: list[str]) -> str:
    return json.dumps({"rootfs": {"diff_ids": diff_ids}})


class FakeRegistry:
    """Images as layers (diff id, stored size); serves v2 manifests and configs for them."""

    def __init__(self, images: dict[str, list[tuple[str, int]]]) -> None:
        self.images = {normal_name(k): v for k, v in images.items()}
        self.down = False

    def handler(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        for name, layers in self.images.items():
            repo, _, tag = image_path(name).rpartition(":")
            config = _config([d for d, _ in layers])
            if path == f"/v2/{repo}/manifests/{tag}":
                manifest = {"schemaVersion": 2, "config": {"digest": _digest(config), "size": len(config)},
                            "layers": [{"digest": _digest("z" + d), "size": s} for d, s in layers]}
                return httpx.Response(200, json=manifest)
            if path == f"/v2/{repo}/blobs/{_digest(config)}":
                return httpx.Response(200, content=config.encode())
        return httpx.Response(404, json={"errors": [{"code": "MANIFEST_UNKNOWN"}]})

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handler))


class Fleet:
    """Concurrency bookkeeping shared by the fake nodes."""

    def __init__(self) -> None:
        self.pulling = 0
        self.max_pulling = 0
        self.events: list[tuple[str, str]] = []  # ("pushed", image) and ("pull NODE", image), in order


class FakeNode:
    """A node whose `podman` keeps a store of image name -> diff ids, and pulls from a FakeRegistry."""

    def __init__(self, name: str, registry: FakeRegistry, fleet: Fleet, *, have: Sequence[str] = (),
                 pull_s: float = 0.01) -> None:
        self.name = name
        self.registry = registry
        self.fleet = fleet
        self.store: dict[str, list[str]] = {}
        for image in have:
            self.store[normal_name(image)] = [d for d, _ in registry.images[normal_name(image)]]
        self.pull_s = pull_s
        self.pulls: list[str] = []
        self.pulling = 0
        self.max_pulling = 0
        self.fetching: list[set[str]] = []  # the lacking layers of each pull in flight
        self.overlaps = 0  # pulls that fetched a layer another pull in flight was fetching
        self.unreachable = False
        self.pull_error = ""
        self.free_kb = 100 << 20
        self.lost_after: int | None = None  # pulls that work before the node is lost
        self.sweeps = 0  # sweeps of stopped pulls' downloads
        self.removed: list[str] = []  # rmi's names

    @property
    def alive(self) -> bool:
        return True

    async def connect(self) -> None:
        if self.unreachable:
            raise NodeConnectError(self.name, "connection refused")

    def _layers(self) -> set[str]:
        return {d for layers in self.store.values() for d in layers}

    async def run(self, argv: Sequence[str], *, input: bytes | None = None) -> CommandOutput:
        await self.connect()
        args = list(argv)
        if args[:2] == ["sh", "-c"] and args[3:4] == ["swectl-pull"]:  # a pull in a temporary folder of its own
            args = args[4:]
        elif args[:2] == ["sh", "-c"] and args[3:4] == ["swectl-sweep"]:
            self.sweeps += 1
            return CommandOutput(exit_code=0, stdout=b"0 0\n", stderr=b"")
        if args[:2] == ["df", "-Pk"]:
            table = f"Filesystem 1024-blocks Used Available Capacity Mounted on\n/dev/x 1 1 {self.free_kb} 1% /\n"
            return CommandOutput(exit_code=0, stdout=table.encode(), stderr=b"")
        assert args[0] == "podman", args
        match args[1:]:
            case ["images", "--no-trunc", "--format", _]:
                lines = [f"{name} {_digest(_config(layers))}" for name, layers in self.store.items()]
                return CommandOutput(exit_code=0, stdout="\n".join(lines).encode(), stderr=b"")
            case ["image", "inspect", "--format", _, *ids]:
                by_id = {_digest(_config(layers)): layers for layers in self.store.values()}
                layers = [d for i in ids for d in by_id[i]]
                return CommandOutput(exit_code=0, stdout="\n".join(layers).encode(), stderr=b"")
            case ["info", "--format", "{{.Store.GraphRoot}}"]:
                return CommandOutput(exit_code=0, stdout=b"/var/lib/containers/storage\n", stderr=b"")
            case ["pull", "--tls-verify=false", ref]:
                return await self._pull(ref)
            case ["tag", ref, name]:
                self.store[name] = self.store[ref]
                return CommandOutput(exit_code=0, stdout=b"", stderr=b"")
            case ["untag", _name, ref]:
                del self.store[ref]
                return CommandOutput(exit_code=0, stdout=b"", stderr=b"")
            case ["rmi", *names]:
                self.removed += names
                for name in names:
                    del self.store[normal_name(name)]
                return CommandOutput(exit_code=0, stdout=b"", stderr=b"")
        raise AssertionError(f"unexpected podman call {args}")

    async def _pull(self, ref: str) -> CommandOutput:
        self.pulls.append(ref)
        if self.lost_after is not None and len(self.pulls) > self.lost_after:
            raise NodeLostError(self.name, "connection failed during `podman pull`: connection lost")
        if self.pull_error:
            await anyio.sleep(self.pull_s)
            return CommandOutput(exit_code=125, stdout=b"", stderr=self.pull_error.encode())
        name = "localhost/" + ref.split("/", 1)[1]
        if name not in self.registry.images:
            return CommandOutput(exit_code=125, stdout=b"", stderr=b"Error: reading manifest: manifest unknown")
        self.fleet.events.append((f"pull {self.name}", name))
        lacking = {d for d, _ in self.registry.images[name]} - self._layers()
        if any(lacking & other for other in self.fetching):
            self.overlaps += 1
        self.fetching.append(lacking)
        self.pulling += 1
        self.fleet.pulling += 1
        self.max_pulling = max(self.max_pulling, self.pulling)
        self.fleet.max_pulling = max(self.fleet.max_pulling, self.fleet.pulling)
        try:
            await anyio.sleep(self.pull_s)
        finally:
            self.pulling -= 1
            self.fleet.pulling -= 1
            self.fetching.remove(lacking)
        self.store[normal_name(ref)] = [d for d, _ in self.registry.images[name]]
        return CommandOutput(exit_code=0, stdout=b"", stderr=b"")

    async def spawn(self, argv: Sequence[str]) -> None:
        raise NotImplementedError

    async def open_unix(self, path: str) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        return None


ENV = [("d-base", 1000), ("d-env", 5000)]
IMAGES = {"localhost/env:1": ENV, **{f"localhost/inst{i}:latest": [*ENV, (f"d-inst{i}", 100 + i)] for i in range(4)}}


def _targets(nodes: list[FakeNode]) -> list[SyncTarget]:
    return [SyncTarget(n.name, PodmanCli(n, "system")) for n in nodes]  # type: ignore[arg-type]


def _sync(registry: FakeRegistry, nodes: list[FakeNode], images: Sequence[str] = tuple(IMAGES), **options: object):
    lines: list[str] = []

    async def main():
        async with registry.client() as client:
            return await sync_images(_targets(nodes), images, REG, options=SyncOptions(**options), say=lines.append,
                                     client=client)

    return anyio.run(main), lines


@pytest.mark.parametrize(("url", "host", "prefix", "plain"), [
    ("http://10.0.0.5:5000", "10.0.0.5:5000", "", True),
    ("http://10.0.0.5:5000/", "10.0.0.5:5000", "", True),
    ("https://reg.example:443/team/swe", "reg.example:443", "team/swe", False),
    ("reg.example", "reg.example", "", False),
])
def test_registry_urls(url: str, host: str, prefix: str, plain: bool) -> None:
    assert parse_registry(url) == Registry(host=host, prefix=prefix, plain_http=plain)


@pytest.mark.parametrize("url", ["ftp://x", "http://", "http://a b", "http://reg:5000/Upper", ""])
def test_bad_registry_urls_name_the_flag(url: str) -> None:
    with pytest.raises(ConfigError, match="--registry"):
        parse_registry(url)


def test_names_in_the_registry() -> None:
    assert REG.ref("localhost/swectl-inst.x:latest") == "10.9.0.1:5000/swectl-inst.x:latest"
    official = "swebench/sweb.eval.x86_64.a_1776_b-1:latest"
    assert REG.ref(official) == f"10.9.0.1:5000/{official}"
    assert REG.ref("localhost/env") == "10.9.0.1:5000/env:latest"
    prefixed = Registry(host="r:1", prefix="fleet")
    assert prefixed.ref("docker.io/swebench/x:v1") == "r:1/fleet/swebench/x:v1"
    assert prefixed.tls_args() == [] and REG.tls_args() == ["--tls-verify=false"]
    assert REG.url == "http://10.9.0.1:5000"


def test_two_empty_nodes_get_every_image_each_shared_layer_once() -> None:
    registry, fleet = FakeRegistry(IMAGES), Fleet()
    nodes = [FakeNode(f"n{i}", registry, fleet) for i in range(2)]
    report, lines = _sync(registry, nodes, per_node=2, total=3)
    assert report.ok, format_report(report)
    for node, result in zip(nodes, report.nodes, strict=True):
        assert sorted(node.pulls) == sorted(REG.ref(i) for i in IMAGES)  # one pull per (node, image)
        assert set(IMAGES) <= set(node.store) and not any(REG.host in n for n in node.store)  # registry names untagged
        assert node.max_pulling <= 2 and node.overlaps == 0
        assert result.present_before == [] and sorted(result.pulled) == sorted(IMAGES)
        # the env layers once, then each instance image's own layer
        assert result.bytes == 6000 + sum(100 + i for i in range(4))
    assert fleet.max_pulling <= 3
    assert any("[5/5] pulled" in line and "eta 0s" in line for line in lines)
    table = format_report(report)
    assert table.splitlines()[0].split() == ["node", "present", "before", "pulled", "failed", "bytes", "seconds"]
    assert "0/5" in table and "6.4 KB" in table


def test_second_sync_moves_nothing() -> None:
    registry, fleet = FakeRegistry(IMAGES), Fleet()
    nodes = [FakeNode("n0", registry, fleet, have=["localhost/env:1", "localhost/inst0:latest"])]
    first, _ = _sync(registry, nodes)
    assert sorted(first.nodes[0].present_before) == ["localhost/env:1", "localhost/inst0:latest"]
    assert len(nodes[0].pulls) == 3 and first.nodes[0].bytes == sum(100 + i for i in range(1, 4))
    second, lines = _sync(registry, nodes)
    assert second.ok and len(nodes[0].pulls) == 3
    assert second.nodes[0].pulls == [] and len(second.nodes[0].present_before) == 5
    assert "n0: 5/5 images present, 0 to pull" in lines


def test_one_pull_at_a_time_per_node_and_across_the_fleet() -> None:
    registry, fleet = FakeRegistry(IMAGES), Fleet()
    nodes = [FakeNode(f"n{i}", registry, fleet, have=["localhost/env:1"]) for i in range(3)]
    report, _ = _sync(registry, nodes, per_node=4, total=1)
    assert report.ok and fleet.max_pulling == 1


def test_layers_unknown_still_pulls_without_bytes() -> None:
    registry, fleet = FakeRegistry(IMAGES), Fleet()
    nodes = [FakeNode("n0", registry, fleet)]
    registry.down = True  # the controller cannot read manifests; the node still reaches the registry
    report, lines = _sync(registry, nodes)
    assert report.ok and report.nodes[0].bytes is None
    assert any(line.startswith("layer sizes unknown") for line in lines)
    assert "  -  " in format_report(report)


def test_registry_down_is_one_clear_error_per_node_and_nothing_present() -> None:
    registry, fleet = FakeRegistry(IMAGES), Fleet()
    nodes = [FakeNode(f"n{i}", registry, fleet) for i in range(2)]
    for node in nodes:
        node.pull_error = ('time="x" level=warning msg="Failed, retrying in 1s ... (1/3)"\nError: initializing source '
                           'docker://10.9.0.1:5000/env:1: pinging container registry 10.9.0.1:5000: Get '
                           '"http://10.9.0.1:5000/v2/": dial tcp 10.9.0.1:5000: connect: connection refused')
    report, lines = _sync(registry, nodes, per_node=2)
    assert not report.ok
    for node, result in zip(nodes, report.nodes, strict=True):
        assert node.store == {} and result.pulled == [] and len(result.failed) == 5
        assert "registry http://10.9.0.1:5000 is unreachable from the node" in result.error
        assert "connection refused" in result.error
        assert len(node.pulls) == 1  # the node stopped at the first sign
    errors = [line for line in format_report(report).splitlines() if "ERROR" in line or "unreachable" in line]
    assert len(errors) == 2, errors
    assert sum("unreachable" in line for line in lines) == 2


def test_an_image_the_registry_lacks_is_listed_and_the_rest_goes_on() -> None:
    registry, fleet = FakeRegistry(IMAGES), Fleet()
    nodes = [FakeNode("n0", registry, fleet)]
    report, lines = _sync(registry, nodes, images=[*IMAGES, "localhost/nowhere:1"])
    assert not report.ok and list(report.not_in_registry) == ["localhost/nowhere:1"]
    assert sorted(report.nodes[0].pulled) == sorted(IMAGES) and report.nodes[0].error == ""
    assert REG.ref("localhost/nowhere:1") not in nodes[0].pulls
    assert any("has no image nowhere:1" in line for line in lines)


def test_an_unreachable_node_is_one_error_and_the_others_finish() -> None:
    registry, fleet = FakeRegistry(IMAGES), Fleet()
    nodes = [FakeNode(f"n{i}", registry, fleet) for i in range(2)]
    nodes[0].unreachable = True
    report, _ = _sync(registry, nodes)
    assert "connection refused" in report.nodes[0].error and report.nodes[0].pulls == []
    assert report.nodes[1].ok and sorted(report.nodes[1].pulled) == sorted(IMAGES)


def test_a_pull_past_its_time_bound_fails_and_leaves_nothing() -> None:
    registry, fleet = FakeRegistry(IMAGES), Fleet()
    nodes = [FakeNode("n0", registry, fleet, pull_s=5.0)]
    start = time.monotonic()
    report, _ = _sync(registry, nodes, images=["localhost/env:1"], pull_timeout_s=0.2)
    assert time.monotonic() - start < 3
    (pull,) = report.nodes[0].pulls
    assert not pull.ok and "more than 0.2s" in pull.error and nodes[0].store == {}


def test_the_report_is_json() -> None:
    registry, fleet = FakeRegistry(IMAGES), Fleet()
    report, _ = _sync(registry, [FakeNode("n0", registry, fleet)])
    data = json.loads(msgspec.json.encode(report))
    assert data["format_version"] == 1 and data["nodes"][0]["node"] == "n0"
    assert human_bytes(1234567) == "1.2 MB" and human_bytes(None) == "-"


def test_task_images_follow_the_resolver_once_each() -> None:
    from swectl.images.names import ImageResolver
    from swectl.images.push import task_images
    from swectl.tasks.record import Task

    tasks = [Task(instance_id=f"o__r-{i}", repo="o/r", problem_statement="x", FAIL_TO_PASS=["t"]) for i in range(3)]
    mapped = ImageResolver(mapping={"o__r-0": "localhost/a:1", "o__r-1": "localhost/a:1"})
    assert task_images(tasks, mapped) == ["localhost/a:1", "docker.io/swebench/sweb.eval.x86_64.o_1776_r-2:latest"]


@pytest.mark.parametrize(("args", "message"), [
    (["--registry", "ftp://x"], "--registry 'ftp://x'"),
    (["--registry", "http://r:5000", "--per-node", "0"], "--per-node / --jobs"),
])
def test_sync_cli_refuses_bad_options(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from swectl.cli.main import main

    assert main(["image", "sync", "--tasks", "unused.jsonl", *args]) == 2
    assert message in capsys.readouterr().err


def test_an_image_rebuilt_since_is_pulled_again() -> None:
    registry, fleet = FakeRegistry(IMAGES), Fleet()
    node = FakeNode("n0", registry, fleet, have=list(IMAGES))
    node.store["localhost/inst2:latest"] = ["d-base", "d-env", "d-old-inst2"]  # the same name, another image
    report, lines = _sync(registry, [node])
    assert report.ok and report.nodes[0].pulled == ["localhost/inst2:latest"] and len(node.pulls) == 1
    assert node.store["localhost/inst2:latest"] == ["d-base", "d-env", "d-inst2"]
    assert report.nodes[0].bytes == 102
    assert "n0: 1 image(s) differ from the registry's and are pulled again: localhost/inst2:latest" in lines


def test_a_pull_that_would_fill_the_disk_does_not_start() -> None:
    big = {"localhost/big:1": [("d-big", 400_000_000)], "localhost/small:1": [("d-small", 1000)]}
    registry, fleet = FakeRegistry(big), Fleet()
    node = FakeNode("n0", registry, fleet)
    node.free_kb = int(3.0e9 / 1024)  # 3 GB free; the big image needs about 1.2 GB of the 1 GB spare
    report, _ = _sync(registry, [node], images=list(big))
    (failed,) = report.nodes[0].failed
    assert failed.image == "localhost/big:1" and "not enough disk on the node: about 1.2 GB needed" in failed.error
    assert report.nodes[0].pulled == ["localhost/small:1"] and len(node.pulls) == 1


def test_a_node_lost_midway_is_one_error_and_the_others_finish() -> None:
    registry, fleet = FakeRegistry(IMAGES), Fleet()
    nodes = [FakeNode(f"n{i}", registry, fleet) for i in range(2)]
    nodes[0].lost_after = 2
    report, lines = _sync(registry, nodes, per_node=1)
    lost = report.nodes[0]
    assert "connection lost" in lost.error and len(lost.pulled) == 2
    assert {p.error for p in lost.failed} == {"not pulled: the node was lost"} and len(lost.failed) == 3
    assert report.nodes[1].ok
    assert sum("connection lost" in line for line in lines) == 1


# --- from the controller -------------------------------------------------------------------------------------------

INSTANCE_IMAGES = [i for i in IMAGES if "inst" in i]


class FakeController(FakeNode):
    """The controller's podman: holds every image of IMAGES (instance images labelled with their environment image);
    ``podman push`` puts an image into the FakeRegistry (or fails for the images of ``refuse``)."""

    def __init__(self, registry: FakeRegistry, fleet: Fleet) -> None:
        super().__init__("controller", registry, fleet)
        self.catalog = dict(IMAGES)
        for name, layers in self.catalog.items():
            self.store[normal_name(name)] = [d for d, _ in layers]
        self.pushed: list[str] = []
        self.refuse: set[str] = set()
        self.push_s = 0.0

    async def run(self, argv: Sequence[str], *, input: bytes | None = None) -> CommandOutput:
        args = list(argv)
        if args[:2] == ["sh", "-c"] and args[3:4] == ["swectl-pull"]:
            args = args[4:]
        match args[1:]:
            case ["image", "inspect", "--format", fmt, *names] if "swectl.env" in fmt:
                labels = ["localhost/env:1" if "inst" in n else "" for n in names]
                return CommandOutput(exit_code=0, stdout="\n".join(labels).encode() + b"\n", stderr=b"")
            case ["push", "--tls-verify=false", image, _ref]:
                if image in self.refuse:
                    return CommandOutput(exit_code=125, stdout=b"", stderr=b"Error: writing blob: disk quota exceeded")
                await anyio.sleep(self.push_s)
                self.pushed.append(image)
                self.registry.images[normal_name(image)] = self.catalog[image]
                self.fleet.events.append(("pushed", normal_name(image)))
                return CommandOutput(exit_code=0, stdout=b"", stderr=b"")
        return await super().run(argv, input=input)


class FakeRunning:
    """What the controller's registry gives a sync (controller_registry.RunningRegistry), without a process."""

    registry = REG
    port = 5000
    pid = 4242
    exit_code = None

    def log_tail(self, limit: int = 2000) -> str:
        return ""


def _from_controller(registry: FakeRegistry, nodes: list[FakeNode], controller: FakeController,
                     images: Sequence[str] = tuple(INSTANCE_IMAGES), overlap: bool = True):
    lines: list[str] = []
    starts: list[Path] = []

    @contextlib.asynccontextmanager
    async def start(folder: Path) -> AsyncIterator[FakeRunning]:
        starts.append(folder)
        yield FakeRunning()

    async def main():
        async with registry.client() as client:
            return await sync_from_controller(
                _targets(nodes), images, controller=PodmanCli(controller, "system"),  # type: ignore[arg-type]
                cache=Path("/tmp"), say=lines.append, start_registry=start, client=client,  # type: ignore[arg-type]
                overlap=overlap)

    return anyio.run(main), lines, starts


def test_from_the_controller_only_what_the_nodes_lack_is_sent_environment_image_first() -> None:
    registry, fleet = FakeRegistry({}), Fleet()
    controller = FakeController(registry, fleet)
    nodes = [FakeNode("n0", FakeRegistry(IMAGES), fleet, have=["localhost/env:1", "localhost/inst0:latest"]),
             FakeNode("n1", registry, fleet)]
    nodes[0].registry = registry
    report, lines, starts = _from_controller(registry, nodes, controller)
    assert report.ok, format_report(report)
    assert starts == [Path("/tmp")]
    assert controller.pushed[0] == "localhost/env:1" and sorted(controller.pushed[1:]) == sorted(INSTANCE_IMAGES)
    first, second = report.nodes
    assert first.present_before == ["localhost/inst0:latest"] and sorted(first.pulled) == sorted(INSTANCE_IMAGES[1:])
    assert second.present_before == [] and sorted(second.pulled) == sorted(INSTANCE_IMAGES)
    assert first.bytes == sum(100 + i for i in range(1, 4)) and second.bytes == 6000 + sum(100 + i for i in range(4))
    assert any("controller: [1/5] pushed localhost/env:1" in line for line in lines)


def test_from_the_controller_a_node_pulls_each_image_once_its_push_ended_not_after_every_push() -> None:
    registry, fleet = FakeRegistry({}), Fleet()
    controller = FakeController(registry, fleet)
    controller.push_s = 0.05
    nodes = [FakeNode(f"n{i}", registry, fleet, pull_s=0.01) for i in range(2)]
    report, _, _ = _from_controller(registry, nodes, controller)
    assert report.ok, format_report(report)
    order = fleet.events
    pushed_at = {image: order.index(("pushed", image)) for image in IMAGES}
    for node in nodes:
        pulls = [(i, image) for i, (what, image) in enumerate(order) if what == f"pull {node.name}"]
        assert sorted(image for _, image in pulls) == sorted(INSTANCE_IMAGES)
        assert all(i > pushed_at[image] for i, image in pulls)  # never before its push ended
        assert pulls[0][0] < pushed_at[controller.pushed[-1]]  # the first began while pushes went on
    assert report.nodes[0].bytes == report.nodes[1].bytes == 6000 + sum(100 + i for i in range(4))


def test_from_the_controller_without_overlap_every_push_comes_before_the_pulls() -> None:
    registry, fleet = FakeRegistry({}), Fleet()
    controller = FakeController(registry, fleet)
    controller.push_s = 0.02
    report, _, _ = _from_controller(registry, [FakeNode("n0", registry, fleet)], controller, overlap=False)
    assert report.ok, format_report(report)
    kinds = [what for what, _ in fleet.events]
    assert kinds == ["pushed"] * 5 + ["pull n0"] * 4


def test_from_the_controller_nothing_lacking_starts_no_registry() -> None:
    registry, fleet = FakeRegistry({}), Fleet()
    controller = FakeController(registry, fleet)
    nodes = [FakeNode("n0", FakeRegistry(IMAGES), fleet, have=INSTANCE_IMAGES)]
    report, lines, starts = _from_controller(registry, nodes, controller)
    assert report.ok and starts == [] and controller.pushed == [] and nodes[0].pulls == []
    assert report.nodes[0].present_before == INSTANCE_IMAGES and report.nodes[0].sent_bytes == 0
    assert "nothing to send: every node holds every image of the set that the controller has" in lines


def test_from_the_controller_an_image_already_in_its_registry_is_not_pushed_again() -> None:
    registry, fleet = FakeRegistry({k: v for k, v in IMAGES.items() if k in ("localhost/env:1", INSTANCE_IMAGES[0])}),\
        Fleet()
    controller = FakeController(registry, fleet)
    report, lines, _ = _from_controller(registry, [FakeNode("n0", registry, fleet)], controller)
    assert report.ok and sorted(controller.pushed) == sorted(INSTANCE_IMAGES[1:])
    assert sum("is in its registry already" in line for line in lines) == 2


def test_from_the_controller_an_image_it_lacks_is_listed_where_a_node_lacks_it() -> None:
    registry, fleet = FakeRegistry({}), Fleet()
    controller = FakeController(registry, fleet)
    elsewhere = {**IMAGES, "localhost/nowhere:1": [("d-nowhere", 10)]}
    nodes = [FakeNode("n0", FakeRegistry(elsewhere), fleet, have=["localhost/nowhere:1"]),
             FakeNode("n1", registry, fleet)]
    nodes[0].registry = registry
    report, _, _ = _from_controller(registry, nodes, controller, images=[*INSTANCE_IMAGES, "localhost/nowhere:1"])
    assert not report.ok and list(report.not_in_registry) == ["localhost/nowhere:1"]
    holder, lacker = report.nodes
    assert holder.ok and "localhost/nowhere:1" in holder.present_before
    (failed,) = lacker.failed
    assert failed.image == "localhost/nowhere:1" and failed.error.startswith("not sent: not on the controller")
    assert sorted(lacker.pulled) == sorted(INSTANCE_IMAGES)


def test_from_the_controller_a_failed_push_fails_that_image_where_it_is_lacking() -> None:
    registry, fleet = FakeRegistry({}), Fleet()
    controller = FakeController(registry, fleet)
    controller.refuse = {INSTANCE_IMAGES[2]}
    nodes = [FakeNode("n0", registry, fleet)]
    report, lines, _ = _from_controller(registry, nodes, controller)
    (failed,) = report.nodes[0].failed
    assert failed.image == INSTANCE_IMAGES[2] and "disk quota exceeded" in failed.error
    assert REG.ref(INSTANCE_IMAGES[2]) not in nodes[0].pulls and len(report.nodes[0].pulled) == 3
    assert any("FAILED to push" in line for line in lines)


def test_from_the_controller_names_a_stopped_sync_pulled_by_are_removed() -> None:
    registry, fleet = FakeRegistry({}), Fleet()
    controller = FakeController(registry, fleet)
    node = FakeNode("n0", registry, fleet)
    node.store["127.0.0.1:4242/inst1:latest"] = [d for d, _ in IMAGES["localhost/inst1:latest"]]
    node.store["127.0.0.1:4242/other:latest"] = ["d-other"]  # not of the set: left alone
    assert leftovers(dict.fromkeys(node.store, "sha256:x"), INSTANCE_IMAGES) == ["127.0.0.1:4242/inst1:latest"]
    report, lines, _ = _from_controller(registry, [node], controller)
    assert report.ok and node.removed == ["127.0.0.1:4242/inst1:latest"]
    assert "127.0.0.1:4242/other:latest" in node.store
    assert any("removed 1 name(s) a stopped sync had pulled by" in line for line in lines)


def test_the_controller_registry_needs_its_binary(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(ctlreg, "REGISTRY_BIN", str(tmp_path / "no-such-registry"))

    async def main() -> None:
        async with ctlreg.controller_registry(tmp_path / "cache"):
            raise AssertionError("started without its binary")

    with pytest.raises(RegistryError, match="apt-get install docker-registry"):
        anyio.run(main)


@pytest.mark.skipif(ctlreg.missing_registry() is not None, reason="no docker-registry (apt-get install it)")
def test_the_controller_registry_keeps_its_port_and_serves_one_sync_per_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"

    async def main() -> tuple[int, int, int]:
        async with ctlreg.controller_registry(cache) as running:
            async with httpx.AsyncClient() as client:
                assert (await client.get(f"{running.registry.url}/v2/")).status_code == 200
            with pytest.raises(RegistryError, match=f"pid {os.getpid()}"):
                async with ctlreg.controller_registry(cache):
                    raise AssertionError("a second registry on the same cache")
            first, pid = running.port, running.pid
        assert running.exit_code is not None  # stopped with the block
        async with ctlreg.controller_registry(cache) as again:
            return first, again.port, pid

    first, second, pid = anyio.run(main)
    assert first == second == int((cache / "port").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.skipif(ctlreg.missing_registry() is not None, reason="no docker-registry (apt-get install it)")
def test_a_saved_port_taken_before_the_registry_binds_it_is_given_up_for_a_free_one(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (cache / "port").write_text(f"{port}\n")
        monkeypatch.setattr(ctlreg, "_port_is_free", lambda _port: True)  # taken after the check, before the bind

        async def main() -> int:
            async with ctlreg.controller_registry(cache) as running:
                async with httpx.AsyncClient() as client:
                    assert (await client.get(f"{running.registry.url}/v2/")).status_code == 200
                return running.port

        served = anyio.run(main)
    assert served != port and int((cache / "port").read_text()) == served
    assert "address already in use" in (cache / "registry.log").read_text()


def test_the_relay_counts_the_bytes_each_way(tmp_path: Path) -> None:
    async def upstream(stream) -> None:
        async with stream:
            request = await stream.receive()
            await stream.send(b"x" * 200_000 + request[:1])

    async def main() -> tuple[bytes, object]:
        async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener, \
                anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, upstream)
            port = listener.extra(anyio.abc.SocketAttribute.local_port)
            relay = ByteRelay(str(tmp_path / "r.sock"), "127.0.0.1", port)
            await tg.start(relay.run)
            got = b""
            async with await anyio.connect_unix(relay.path) as client:
                await client.send(b"GET")
                with contextlib.suppress(anyio.EndOfStream):
                    while len(got) < 200_001:
                        got += await client.receive()
            tg.cancel_scope.cancel()
        return got, relay.statistics()

    got, stats = anyio.run(main)
    assert got == b"x" * 200_000 + b"G"
    assert (stats.connections, stats.sent, stats.received, stats.refused) == (1, 200_001, 3, 0)


def test_a_stopped_pull_leaves_a_download_that_the_next_sweep_removes(tmp_path: Path) -> None:
    """The pull wrapper and the sweep in a real shell: a live pull's folder is kept, a killed one's removed."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    pull = subprocess.Popen(["sh", "-c", PULL_SCRIPT, "swectl-pull", "sh", "-c",
                             'head -c 300000 /dev/zero > "$TMPDIR/blob"; exec sleep 30'], env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not list(tmp_path.glob("swectl-pull.*/blob")) and time.monotonic() < deadline:
            time.sleep(0.02)
        sweep = ["sh", "-c", SWEEP_SCRIPT, "swectl-sweep", str(tmp_path)]
        assert subprocess.run(sweep, capture_output=True, text=True, timeout=30).stdout.split() == ["0", "0"]
        os.kill(pull.pid, signal.SIGKILL)  # the wrapper first: its podman (here: sleep) still holds the lock
        pull.wait(timeout=10)
        assert subprocess.run(sweep, capture_output=True, text=True, timeout=30).stdout.split() == ["0", "0"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pull.pid, signal.SIGKILL)
    time.sleep(0.1)
    count, kb = subprocess.run(sweep, capture_output=True, text=True, timeout=30).stdout.split()
    assert count == "1" and int(kb) >= 290 and list(tmp_path.glob("swectl-pull.*")) == []
    done = anyio.run(_pull_in_local_shell, tmp_path)
    assert done.exit_code == 3 and done.stdout.decode().startswith(str(tmp_path / "swectl-pull."))
    assert list(tmp_path.glob("swectl-pull.*")) == []  # removed when the pull ends


async def _pull_in_local_shell(tmp_path: Path) -> CommandOutput:
    return await LocalNode().run(["env", f"TMPDIR={tmp_path}", "sh", "-c", PULL_SCRIPT, "swectl-pull",
                                  "sh", "-c", 'echo "$TMPDIR"; exit 3'])


def test_sync_cli_takes_a_registry_or_the_controller_not_both(capsys: pytest.CaptureFixture[str]) -> None:
    from swectl.cli.main import main

    with pytest.raises(SystemExit) as stop:
        main(["image", "sync", "--tasks", "t.jsonl", "--registry", "http://r:5000", "--from-controller"])
    assert stop.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(("size", "expected"), [("0B", 0), ("512kB", 512_000), ("1.234GB", 1_234_000_000),
                                                ("12MB", 12_000_000), (" 2TB ", 2 * 10**12)])
def test_docker_sizes_are_decimal_units(size: str, expected: int) -> None:
    assert docker_bytes(size) == expected


@pytest.mark.parametrize("size", ["", "12", "1.2 GiB", "N/A"])
def test_what_is_not_a_docker_size_is_refused(size: str) -> None:
    with pytest.raises(ValueError, match="not a docker size"):
        docker_bytes(size)
