"""Real sshd test nodes (swectl.testing.nodes) reached with the real asyncssh client."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import asyncssh
import pytest

from swectl.remote.nodes.podman import bundled_containers_conf
from swectl.testing import nodes as tn

pytestmark = pytest.mark.integration
_reason = tn.can_run_test_nodes()
if _reason is not None:
    pytest.skip(_reason, allow_module_level=True)

# Indexes far from the default (1..) so that a run of this file never collides with other users of test nodes.
PREFIX = "swtt"
BASE = 241
CONTAINERS_CONF = bundled_containers_conf()


@pytest.fixture(scope="module")
def nodes() -> Iterator[tn.TestNodes]:
    with tn.test_nodes(2, prefix=PREFIX, base_index=BASE) as started:
        yield started


async def _connect(nodes: tn.TestNodes, node: tn.TestNode, **kwargs: object) -> asyncssh.SSHClientConnection:
    options: dict[str, object] = {
        "username": "root",
        "client_keys": [nodes.key_path],
        "known_hosts": nodes.known_hosts_path,
        "agent_path": None,
        "connect_timeout": 5,
        **kwargs,
    }
    return await asyncssh.connect(node.host, node.port, **options)


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=True).stdout


def test_echo_with_key_and_known_hosts(nodes: tn.TestNodes) -> None:
    async def main() -> None:
        for node in nodes.nodes:
            async with await _connect(nodes, node) as conn:
                result = await conn.run("echo ok", check=True, timeout=10)
                assert result.stdout == "ok\n"

    asyncio.run(main())


def test_commands_skip_the_login_shells_startup_files(nodes: tn.TestNodes) -> None:
    """bash under sshd sources ~/.bashrc when SHLVL < 2; on the dev and CI machines that runs `pyenv
    rehash`, whose stale lock made every command of a node wait 60 s. Nodes set SHLVL so bash skips it."""

    async def main() -> None:
        async with await _connect(nodes, nodes.nodes[0]) as conn:
            result = await conn.run("echo $SHLVL", check=True, timeout=10)
            assert int(result.stdout) >= 2

    asyncio.run(main())


def test_unknown_or_wrong_host_key_is_rejected(nodes: tn.TestNodes, tmp_path: Path) -> None:
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    first = nodes.nodes[0]
    # The second node's host key filed under the first node's address: a man in the middle.
    second_key = Path(nodes.known_hosts_path).read_text().splitlines()[1].split(" ", 1)[1]
    wrong = tmp_path / "wrong_known_hosts"
    wrong.write_text(f"{first.host} {second_key}\n")

    async def main() -> None:
        for known_hosts in (empty, wrong):
            with pytest.raises(asyncssh.HostKeyNotVerifiable):
                await _connect(nodes, first, known_hosts=str(known_hosts))

    asyncio.run(main())


def test_podman_works_in_session(nodes: tn.TestNodes) -> None:
    async def main() -> None:
        async with await _connect(nodes, nodes.nodes[0]) as conn:
            version = await conn.run("podman --version", check=True, timeout=20)
            assert version.stdout.startswith("podman version")
            ps = await conn.run(f"CONTAINERS_CONF={CONTAINERS_CONF} podman ps", timeout=30)
            assert ps.exit_status == 0, ps.stderr

    asyncio.run(main())


def test_twenty_concurrent_channels_on_one_connection(nodes: tn.TestNodes) -> None:
    async def main() -> None:
        async with await _connect(nodes, nodes.nodes[0]) as conn:
            results = await asyncio.gather(
                *(conn.run(f"sleep 0.3; echo {i}", check=True, timeout=20) for i in range(20))
            )
            assert [r.stdout for r in results] == [f"{i}\n" for i in range(20)]

    asyncio.run(main())


def test_kill_drops_connections_and_restart_brings_node_back(nodes: tn.TestNodes) -> None:
    node = nodes.nodes[1]
    old_pid = node.read_sshd_pid()
    assert old_pid == node.sshd_pid

    async def main() -> None:
        conn = await _connect(nodes, node)
        proc = await conn.create_process("echo started; sleep 60")
        assert await asyncio.wait_for(proc.stdout.readline(), 10) == "started\n"

        start = time.monotonic()
        node.kill_sshd()
        # The killed server's kernel closes the TCP socket (FIN): asyncssh sees it at once.
        with pytest.raises(asyncssh.ConnectionLost):
            await asyncio.wait_for(proc.stdout.read(), 5)
        await asyncio.wait_for(conn.wait_closed(), 5)
        assert time.monotonic() - start < 3
        with pytest.raises(ConnectionRefusedError):
            await _connect(nodes, node)

        node.restart_sshd()
        async with await _connect(nodes, node) as conn2:
            assert (await conn2.run("echo back", check=True, timeout=10)).stdout == "back\n"

    asyncio.run(main())
    new_pid = node.read_sshd_pid()
    assert new_pid is not None
    assert new_pid != old_pid


def test_cut_network_hangs_then_recovers(nodes: tn.TestNodes) -> None:
    node = nodes.nodes[0]

    async def main() -> None:
        async with await _connect(nodes, node) as conn:
            node.cut_network()
            try:
                task = asyncio.create_task(conn.run("echo through", check=True))
                await asyncio.sleep(1.0)
                assert not task.done()  # no RST, no error: the command just hangs
            finally:
                node.restore_network()
            # TCP retransmits and the same connection carries on.
            assert (await asyncio.wait_for(task, 15)).stdout == "through\n"

    asyncio.run(main())


def test_nodes_reach_each_other_as_a_fleet(nodes: tn.TestNodes) -> None:
    """A TCP server on one node answers a client on the other (what torchrun's rendezvous needs), and a cut
    node is unreachable from the other node as well."""
    a, b = nodes.nodes
    server = ("python3 -c \"import socket; s = socket.create_server(('{host}', 29411)); c = s.accept()[0]; "
              "c.sendall(b'hello from ' + socket.gethostname().encode() + b' {host}'); c.close()\"")
    client = ("python3 -c \"import socket; c = socket.create_connection(('{host}', 29411), timeout=3); "
              "print(c.recv(100).decode())\"")

    async def main() -> None:
        async with await _connect(nodes, a) as on_a, await _connect(nodes, b) as on_b:
            listening = asyncio.create_task(on_a.run(server.format(host=a.host), check=True, timeout=20))
            await asyncio.sleep(1.0)  # python's start-up on a
            got = await on_b.run(client.format(host=a.host), check=True, timeout=15)
            assert got.stdout.strip().endswith(a.host)
            await listening
            a.cut_network()
            try:
                refused = await on_b.run(client.format(host=a.host), timeout=15)
                assert refused.exit_status != 0  # a's network is cut: b cannot reach it either
            finally:
                a.restore_network()

    asyncio.run(main())


def test_teardown_is_complete_and_idempotent() -> None:
    prefix, base = "swtd", 244
    names = [f"{prefix}{base}", f"{prefix}{base + 1}"]
    crashed = tn.start_test_nodes(2, prefix=prefix, base_index=base)
    # A crashed run left these behind: starting again with the same names must clean up first.
    again = tn.start_test_nodes(2, prefix=prefix, base_index=base)
    assert Path(crashed.known_hosts_path).read_text() != Path(again.known_hosts_path).read_text()
    assert crashed.nodes[0].read_sshd_pid() is None  # the old sshd was killed
    tn.stop_test_nodes(crashed)  # removes the new nodes too (same names): teardown is by name
    tn.stop_test_nodes(again)  # idempotent
    for listing in (_ip("netns", "list"), _ip("link", "show"), _ip("route", "show")):
        for name in names:
            assert name not in listing
    for index in (base, base + 1):
        assert f"10.200.{index}." not in _ip("route", "show")
    assert not os.path.exists(crashed.workdir)
    assert not os.path.exists(again.workdir)


def test_cluster_toml(nodes: tn.TestNodes) -> None:
    parsed = tomllib.loads(nodes.cluster_toml(local=True, extra_node_fields='slots = 4\nlabels = ["x"]'))
    local, *ssh = parsed["nodes"]
    assert local == {"name": "local", "kind": "local"}
    assert [n["name"] for n in ssh] == [f"{PREFIX}{BASE}", f"{PREFIX}{BASE + 1}"]
    for entry, node in zip(ssh, nodes.nodes, strict=True):
        assert entry == {
            "name": node.name,
            "kind": "ssh",
            "host": node.host,
            "port": 22,
            "user": "root",
            "identity_file": nodes.key_path,
            "known_hosts": nodes.known_hosts_path,
            "slots": 4,
            "labels": ["x"],
        }
    assert [n["name"] for n in tomllib.loads(nodes.cluster_toml())["nodes"]] == [n.name for n in nodes.nodes]


def test_own_store_nodes_lack_what_this_machine_has_and_leave_no_store_behind() -> None:
    """``own_store``: every node's sessions get a Podman store of their own (empty), the others keep this machine's;
    teardown removes the store, its images and podman's mounts under it."""
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    started = tn.start_test_nodes(1, prefix="swto", base_index=247, own_store=True)
    store = Path(started.nodes[0].storage_conf).parent
    try:
        node = started.nodes[0]
        assert store.is_relative_to(started.workdir)

        async def main() -> None:
            async with await _connect(started, node) as conn:
                info = await conn.run(f"CONTAINERS_CONF={CONTAINERS_CONF} podman info --format "
                                      "'{{.Store.GraphRoot}} {{.Store.RunRoot}} {{.Store.ImageStore.Number}}'",
                                      check=True, timeout=60)
                assert info.stdout.split() == [str(store / "graph"), str(store / "run"), "0"]

        asyncio.run(main())
        # an image put into the node's store is there for the node only
        tar = subprocess.run(["tar", "-C", str(store), "-c", "storage.conf"], capture_output=True, check=True).stdout
        image = "localhost/swectl-own-store-test:1"
        subprocess.run(["podman", "import", "-", image], input=tar, env=node.podman_env(), check=True,
                       capture_output=True, timeout=60)
        assert subprocess.run(["podman", "image", "exists", image], env=node.podman_env(), timeout=60).returncode == 0
        assert subprocess.run(["podman", "image", "exists", image], env=env, timeout=60).returncode == 1
    finally:
        tn.stop_test_nodes(started)
    assert not store.exists()
    assert str(store) not in Path("/proc/self/mountinfo").read_text()
