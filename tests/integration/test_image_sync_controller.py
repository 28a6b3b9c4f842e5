"""`swectl image sync` from the controller, for real: two sshd test nodes with Podman stores of their own
(swectl.testing.nodes, ``own_store``) beside the local node, the controller's own registry (Debian's docker-registry
on 127.0.0.1, reached by each node through its SSH connection), small images built here (an environment image of
random bytes and thin instance images on it, labelled as `swectl image build --repo-cache` labels them).

Covered: a sync onto two empty nodes makes every image present (the environment layer sent once per node, the bytes
the controller sent counted), the local node needs nothing, a second sync moves nothing and starts no registry; a
sync stopped by Ctrl-C while pushing, then run again, pushes only what its cache lacks; a sync killed with SIGKILL
while pulling leaves no registry running and, run again, sends less than a whole transfer; a node lost during the
sync is one error while the other finishes; the controller's registry killed during the sync is one clear error, with
nothing half-written taken as present. Each test wipes the nodes' stores first."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from swectl.testing import nodes as testnodes

from .conftest import REPO_ROOT, podman
from .images import build_env_and_instances, own_store_fleet

pytestmark = pytest.mark.integration
PREFIX = "swic"
BASE_INDEX = 226  # 10.200.226.0/24 and .227: away from other users of test nodes
TAG = uuid.uuid4().hex[:10]
ENV_IMAGE = f"localhost/swectl-ctltest-env:{TAG}"
INSTANCES = [f"localhost/swectl-ctltest-inst{i}:{TAG}" for i in range(6)]
ENV_BYTES = 8_000_000  # random, so the compressed layer is this big
INSTANCE_BYTES = 400_000
STOP_WAIT_S = 60.0


def swectl_argv() -> list[str]:
    exe = REPO_ROOT / ".venv" / "bin" / "swectl"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "swectl.cli.main"]


def on_node(node: testnodes.TestNode, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, env=node.podman_env(), timeout=120,
                          check=False)


def node_images(node: testnodes.TestNode) -> list[str]:
    return sorted(on_node(node, "images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split())


def registry_pids(cache: Path) -> list[int]:
    """Processes serving the cache's registry (its config file on their command line)."""
    needle = str(cache / "config.yml").encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


class Sync:
    """`swectl image sync` running in the background; its stderr lines as they come."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([*swectl_argv(), "image", "sync", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
        self.lines: list[str] = []
        self.stdout: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(self.proc.stderr, self.lines), daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stdout, self.stdout), daemon=True)]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float = STOP_WAIT_S) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if text in line:
                    return line
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        self.proc.kill()
        raise AssertionError(f"no {text!r} in the sync's output:\n" + "\n".join(self.lines))

    def finish(self, timeout: float = STOP_WAIT_S) -> tuple[int, str, str]:
        """Exit status, stdout, stderr."""
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.proc.kill()
        for reader in self._readers:
            reader.join(timeout=10)
        return self.proc.returncode, "\n".join(self.stdout), "\n".join(self.lines)


def run_sync(*args: str) -> tuple[int, dict, str, float]:
    """A sync to its end: exit status, its JSON report, stderr, seconds."""
    start = time.monotonic()
    rc, stdout, stderr = Sync(*args, "--json").finish(timeout=180)
    return rc, json.loads(stdout or "{}"), stderr, time.monotonic() - start


def _build_images(work: Path) -> None:
    build_env_and_instances(work, ENV_IMAGE, INSTANCES, ENV_BYTES, lambda _: os.urandom(INSTANCE_BYTES))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[testnodes.TestNodes]:
    with own_store_fleet(lambda: _build_images(tmp_path_factory.mktemp("images")), [*INSTANCES, ENV_IMAGE],
                         prefix=PREFIX, base_index=BASE_INDEX) as started:
        yield started


@pytest.fixture(scope="module")
def config(fleet: testnodes.TestNodes, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cluster") / "cluster.toml"
    path.write_text(fleet.cluster_toml(local=True))  # the local node shares this machine's store
    return path


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rows = [{"instance_id": f"o__r-{i}", "repo": "o/r", "base_commit": "abc", "problem_statement": "x",
             "image": image, "FAIL_TO_PASS": ["t"], "PASS_TO_PASS": [], "patch": "", "test_patch": ""}
            for i, image in enumerate(INSTANCES)]
    path = tmp_path_factory.mktemp("tasks") / "tasks.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache") / "image-cache"


def wipe(fleet: testnodes.TestNodes) -> None:
    for node in fleet.nodes:
        on_node(node, "rmi", "--all", "--force")
        assert node_images(node) == []


def by_node(report: dict) -> dict[str, dict]:
    return {n["node"]: n for n in report["nodes"]}


@pytest.fixture(scope="module")
def first_sync(fleet: testnodes.TestNodes, config: Path, tasks: Path, cache: Path) -> dict:
    """The six images onto the two empty nodes, from the controller (no --registry)."""
    for node in fleet.nodes:  # the nodes really lack what this machine has
        assert podman("image", "exists", INSTANCES[0]).returncode == 0
        assert node_images(node) == []
    rc, report, stderr, seconds = run_sync("--tasks", str(tasks), str(config), "--cache", str(cache))
    report["_rc"], report["_stderr"], report["_seconds"] = rc, stderr, seconds
    return report


def test_a_sync_from_the_controller_fills_two_empty_nodes(first_sync: dict, fleet: testnodes.TestNodes,
                                                          cache: Path) -> None:
    assert first_sync["_rc"] == 0, first_sync["_stderr"]
    nodes = by_node(first_sync)
    local = nodes["local"]
    assert len(local["present_before"]) == 6 and local["pulls"] == []  # shares the controller's store
    whole = ENV_BYTES + len(INSTANCES) * INSTANCE_BYTES
    for node in fleet.nodes:
        result = nodes[node.name]
        assert result["error"] == "" and result["present_before"] == []
        assert sorted(p["image"] for p in result["pulls"] if p["ok"]) == sorted(INSTANCES)
        assert node_images(node) == sorted(INSTANCES)  # under the tasks' names, the forwarded registry's untagged
        # the environment layer went once to each node: what the controller sent is about one whole set
        assert whole < result["sent_bytes"] < whole * 1.25, result["sent_bytes"]
    stderr = first_sync["_stderr"]
    pushes = [line for line in stderr.splitlines() if "to its registry in" in line]
    assert len(pushes) == 7 and "swectl-ctltest-env" in pushes[0], pushes  # the environment image first
    assert registry_pids(cache) == []  # stopped with the sync
    print(f"\nsync from the controller of 6 images onto 2 nodes: {first_sync['_seconds']:.1f}s, sent "
          + ", ".join(f"{nodes[n.name]['sent_bytes']} B" for n in fleet.nodes))


def test_a_second_sync_moves_nothing_and_starts_no_registry(first_sync: dict, config: Path, tasks: Path,
                                                            cache: Path) -> None:
    assert first_sync["_rc"] == 0, first_sync["_stderr"]
    rc, report, stderr, seconds = run_sync("--tasks", str(tasks), str(config), "--from-controller",
                                           "--cache", str(cache))
    assert rc == 0, stderr
    assert "nothing to send" in stderr and "its registry (pid" not in stderr
    for result in report["nodes"]:
        assert len(result["present_before"]) == 6 and result["pulls"] == [], result
        assert result["sent_bytes"] == 0
    print(f"\nsecond sync: {seconds:.1f}s")


def test_a_sync_stopped_by_ctrl_c_while_pushing_then_run_again_pushes_only_what_its_cache_lacks(
        first_sync: dict, fleet: testnodes.TestNodes, config: Path, tasks: Path, tmp_path: Path) -> None:
    assert first_sync["_rc"] == 0, first_sync["_stderr"]
    wipe(fleet)
    fresh = tmp_path / "image-cache"
    sync = Sync("--tasks", str(tasks), str(config), "--cache", str(fresh))
    sync.wait_for("[1/7] pushed")  # the environment image is in the cache
    sync.proc.send_signal(signal.SIGINT)
    rc, _, stderr = sync.finish()
    assert rc == 130, stderr
    assert "interrupted; no image is half there on any node" in stderr
    assert registry_pids(fresh) == []
    rc, _, stderr, seconds = run_sync("--tasks", str(tasks), str(config), "--cache", str(fresh))
    assert rc == 0, stderr
    assert f"{ENV_IMAGE} is in its registry already" in stderr
    for node in fleet.nodes:
        assert node_images(node) == sorted(INSTANCES)
    print(f"\nrun again after Ctrl-C while pushing: {seconds:.1f}s")


def test_a_sync_killed_while_pulling_then_run_again_sends_less_than_a_whole_transfer(
        first_sync: dict, fleet: testnodes.TestNodes, config: Path, tasks: Path, cache: Path) -> None:
    assert first_sync["_rc"] == 0, first_sync["_stderr"]
    wipe(fleet)
    sync = Sync("--tasks", str(tasks), str(config), "--cache", str(cache), "--per-node", "1")
    sync.wait_for("[1/6] pulled")
    sync.proc.kill()
    sync.finish()
    killed = sync.proc.pid
    deadline = time.monotonic() + 5  # the registry dies with the controller (parent-death signal)
    while registry_pids(cache) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert registry_pids(cache) == []
    everything = {node.name: node_images(node) for node in fleet.nodes}
    held = {name: [i for i in images if i in INSTANCES] for name, images in everything.items()}
    assert any(len(images) < len(INSTANCES) for images in held.values()), held  # stopped midway
    for images in everything.values():
        # under the tasks' names only whole images; a pull that ended after the kill leaves its image under the
        # forwarded registry's name, which the next sync removes
        assert all(i in INSTANCES or i.startswith("127.0.0.1:") for i in images), images
    rc, report, stderr, seconds = run_sync("--tasks", str(tasks), str(config), "--cache", str(cache))
    assert rc == 0, stderr
    again, first = by_node(report), by_node(first_sync)
    for node in fleet.nodes:
        assert node_images(node) == sorted(INSTANCES)
        assert sorted(again[node.name]["present_before"]) == held[node.name]
        assert again[node.name]["sent_bytes"] < first[node.name]["sent_bytes"]
    assert list(Path(tempfile.gettempdir()).glob(f"swectl-relay-{killed}-*")) == []  # the killed sync's, removed
    print(f"\nrun again after SIGKILL while pulling: {seconds:.1f}s; held before {everything}, sent "
          + ", ".join(f"{again[n.name]['sent_bytes']} B (first sync {first[n.name]['sent_bytes']} B)"
                      for n in fleet.nodes))


def test_a_node_lost_during_the_sync_is_one_error_and_the_other_finishes(
        first_sync: dict, fleet: testnodes.TestNodes, config: Path, tasks: Path, cache: Path) -> None:
    assert first_sync["_rc"] == 0, first_sync["_stderr"]
    wipe(fleet)
    doomed, other = fleet.nodes
    sync = Sync("--tasks", str(tasks), str(config), "--cache", str(cache), "--per-node", "1", "--json")
    try:
        sync.wait_for(f"{doomed.name}: [1/6] pulled")
        doomed.kill_sshd()
        rc, stdout, stderr = sync.finish()
        assert rc == 1, stderr
        nodes = by_node(json.loads(stdout))
        assert nodes[other.name]["error"] == "" and len([p for p in nodes[other.name]["pulls"] if p["ok"]]) == 6
        assert nodes[doomed.name]["error"] != "", nodes[doomed.name]
        assert node_images(other) == sorted(INSTANCES)
        # what the lost node holds under the tasks' names is only what the report says it pulled
        pulled = sorted(p["image"] for p in nodes[doomed.name]["pulls"] if p["ok"])
        assert set(node_images(doomed)) <= set(pulled) and len(pulled) < 6
    finally:
        doomed.restart_sshd()
    rc, _, stderr, _ = run_sync("--tasks", str(tasks), str(config), "--cache", str(cache))
    assert rc == 0, stderr
    assert node_images(doomed) == sorted(INSTANCES)
    swept = [line for line in stderr.splitlines() if "download(s) of stopped pulls" in line]
    print(f"\nnode lost: {nodes[doomed.name]['error']}; then {swept or 'no stopped download to remove'}")


def test_the_controller_registry_killed_during_the_sync_is_one_clear_error(
        first_sync: dict, fleet: testnodes.TestNodes, config: Path, tasks: Path, cache: Path) -> None:
    assert first_sync["_rc"] == 0, first_sync["_stderr"]
    wipe(fleet)
    sync = Sync("--tasks", str(tasks), str(config), "--cache", str(cache), "--per-node", "1", "--json")
    started = sync.wait_for("controller: its registry (pid ")
    pid = int(started.split("(pid ", 1)[1].split(")", 1)[0])
    sync.wait_for("[1/6] pulled")
    os.kill(pid, signal.SIGKILL)
    rc, stdout, stderr = sync.finish()
    assert rc == 1, stderr
    report = json.loads(stdout)
    assert report["error"].startswith("the controller's registry stopped during the sync (exit -9)"), report["error"]
    assert "ERROR the controller's registry stopped" not in stdout  # the JSON report, not the table
    nodes = by_node(report)
    for node in fleet.nodes:
        pulled = {p["image"] for p in nodes[node.name]["pulls"] if p["ok"]}
        assert set(node_images(node)) == pulled and len(pulled) < 6  # nothing half-written taken as present
    rc, _, stderr, _ = run_sync("--tasks", str(tasks), str(config), "--cache", str(cache))
    assert rc == 0, stderr
    for node in fleet.nodes:
        assert node_images(node) == sorted(INSTANCES)
