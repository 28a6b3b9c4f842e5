"""`swectl image push` and `swectl image sync` for real: two sshd test nodes with Podman stores of their own
(swectl.testing.nodes, ``own_store``), Debian's registry on this machine's end of the first node's veth
(swectl.testing.registry), small images built here (an environment image and thin instance images on it, labelled
as `swectl image build --repo-cache` labels them).

Covered: the nodes start without the images this machine has; push publishes the task set's images with their
environment image; sync makes every image present on both nodes, moving the environment layer once per node; a second
sync moves nothing; a registry that is down is one clear error per node, nothing recorded or left as present."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from swectl.testing import nodes as testnodes
from swectl.testing.registry import LocalRegistry, local_registry

from .conftest import REPO_ROOT, podman
from .images import build_env_and_instances, own_store_fleet

pytestmark = pytest.mark.integration
PREFIX = "swis"
BASE_INDEX = 220  # 10.200.220.0/24 and .221: away from other users of test nodes
TAG = uuid.uuid4().hex[:10]
ENV_IMAGE = f"localhost/swectl-synctest-env:{TAG}"
INSTANCES = [f"localhost/swectl-synctest-inst{i}:{TAG}" for i in range(4)]
ENV_BYTES = 300_000  # random, so the compressed layer is about this big


def swectl_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    exe = REPO_ROOT / ".venv" / "bin" / "swectl"
    argv = [str(exe)] if exe.exists() else [sys.executable, "-m", "swectl.cli.main"]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=timeout, check=False, cwd=REPO_ROOT)


def on_node(node: testnodes.TestNode, *args: str) -> subprocess.CompletedProcess[str]:
    """podman against the node's own store (from this machine, as the node's sessions see it)."""
    return subprocess.run(["podman", *args], capture_output=True, text=True, env=node.podman_env(), timeout=120,
                          check=False)


def _build_images(work: Path) -> None:
    build_env_and_instances(work, ENV_IMAGE, INSTANCES, ENV_BYTES, lambda i: f"instance {i}\n".encode() * 100)


def _tasks(path: Path, images: list[str]) -> Path:
    rows = [{"instance_id": f"o__r-{INSTANCES.index(image)}", "repo": "o/r", "base_commit": "abc",
             "problem_statement": "x", "image": image, "FAIL_TO_PASS": ["t"], "PASS_TO_PASS": [], "patch": "",
             "test_patch": ""} for image in images]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[testnodes.TestNodes]:
    with own_store_fleet(lambda: _build_images(tmp_path_factory.mktemp("images")), [*INSTANCES, ENV_IMAGE],
                         prefix=PREFIX, base_index=BASE_INDEX) as started:
        yield started


@pytest.fixture(scope="module")
def registry(fleet: testnodes.TestNodes) -> Iterator[LocalRegistry]:
    with local_registry(fleet.nodes[0].host_addr) as started:
        yield started


@pytest.fixture(scope="module")
def config(fleet: testnodes.TestNodes, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cluster") / "cluster.toml"
    path.write_text(fleet.cluster_toml(local=False))
    return path


@pytest.fixture(scope="module")
def first_sync(fleet: testnodes.TestNodes, registry: LocalRegistry, config: Path,
               tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Push three instance images (and their environment image), then sync them onto the two empty nodes."""
    for node in fleet.nodes:  # the nodes really lack what this machine has
        assert podman("image", "exists", INSTANCES[0]).returncode == 0
        assert on_node(node, "image", "exists", INSTANCES[0]).returncode == 1
        assert on_node(node, "images", "--quiet").stdout.strip() == ""
    tasks = _tasks(tmp_path_factory.mktemp("tasks") / "tasks.jsonl", INSTANCES[:3])
    push = swectl_cli("image", "push", "--registry", registry.url, "--tasks", str(tasks))
    assert push.returncode == 0, push.stdout + push.stderr
    assert "pushed 4/4 image(s)" in push.stderr
    with urllib.request.urlopen(f"{registry.url}/v2/_catalog", timeout=10) as response:
        catalog = json.load(response)["repositories"]
    assert sorted(catalog) == sorted(i.removeprefix("localhost/").split(":")[0] for i in [ENV_IMAGE, *INSTANCES[:3]])
    start = time.monotonic()
    done = swectl_cli("image", "sync", "--tasks", str(tasks), str(config), "--registry", registry.url, "--json")
    report = json.loads(done.stdout or "{}")
    report["_stderr"], report["_seconds"], report["_rc"] = done.stderr, time.monotonic() - start, done.returncode
    return report


def test_sync_pulls_every_image_onto_two_nodes_with_their_own_stores(first_sync: dict,
                                                                     fleet: testnodes.TestNodes) -> None:
    assert first_sync["_rc"] == 0, first_sync["_stderr"]
    for node, result in zip(fleet.nodes, first_sync["nodes"], strict=True):
        assert result["node"] == node.name and result["error"] == ""
        assert result["present_before"] == []
        assert sorted(p["image"] for p in result["pulls"] if p["ok"]) == sorted(INSTANCES[:3])
        for image in INSTANCES[:3]:
            assert on_node(node, "image", "exists", image).returncode == 0, image
        names = on_node(node, "images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
        assert sorted(names) == sorted(INSTANCES[:3]), names  # the registry's names are untagged again
        assert on_node(node, "image", "exists", INSTANCES[3]).returncode == 1
        # the environment layer moved once per node: bytes about one env layer plus three small instance layers
        moved = sum(p["bytes"] for p in result["pulls"])
        assert ENV_BYTES < moved < ENV_BYTES * 1.2, moved
    stderr = first_sync["_stderr"]
    assert f"{fleet.nodes[0].name}: 0/3 images present, 3 to pull" in stderr
    assert "[3/3] pulled" in stderr
    print(f"\nsync of 3 images onto 2 nodes: {first_sync['_seconds']:.1f}s")


def test_a_second_sync_moves_nothing(first_sync: dict, fleet: testnodes.TestNodes, registry: LocalRegistry,
                                     config: Path, tmp_path: Path) -> None:
    assert first_sync["_rc"] == 0, first_sync["_stderr"]
    tasks = _tasks(tmp_path / "tasks.jsonl", INSTANCES[:3])
    done = swectl_cli("image", "sync", "--tasks", str(tasks), str(config), "--registry", registry.url)
    assert done.returncode == 0, done.stdout + done.stderr
    table = done.stdout.splitlines()
    assert table[0].split()[:4] == ["node", "present", "before", "pulled"]
    for node in fleet.nodes:
        row = next(line.split() for line in table if line.startswith(node.name))
        assert row[1:5] == ["3/3", "0", "0", "0"], row


def test_a_registry_that_is_down_is_one_clear_error_per_node(first_sync: dict, fleet: testnodes.TestNodes,
                                                             config: Path, tmp_path: Path) -> None:
    with local_registry(fleet.nodes[0].host_addr) as doomed:
        url = doomed.url
    tasks = _tasks(tmp_path / "tasks.jsonl", [INSTANCES[3]])
    done = swectl_cli("image", "sync", "--tasks", str(tasks), str(config), "--registry", url, "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    for node, result in zip(fleet.nodes, report["nodes"], strict=True):
        assert f"registry {url} is unreachable from the node" in result["error"], result
        assert "connection refused" in result["error"]
        assert not any(p["ok"] for p in result["pulls"])
        assert on_node(node, "image", "exists", INSTANCES[3]).returncode == 1
    errors = [line for line in done.stderr.splitlines() if "unreachable from the node" in line]
    assert len(errors) == 2, done.stderr
