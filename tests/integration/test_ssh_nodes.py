"""EnvPool and `swectl nodes check` over real SSH: two sshd nodes in network namespaces on this machine.

Both nodes run podman against this machine's container store, so containers are told apart by their
``swectl.node`` label. Nodes are killed, restarted and cut off from the network here; every test puts
them back in a ``finally`` block so that one failure does not cascade into the next test.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tomllib
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import pytest

from swectl.actors.env_pool import EnvPool, Lease
from swectl.config import ClusterConfig, SshNodeConfig, decode_config
from swectl.errors import InfraError, NodeConnectError, NodeLostError
from swectl.remote.nodes.backends import make_backends
from swectl.remote.nodes.podman import bundled_containers_conf
from swectl.remote.nodes.podman_sandbox import PodmanBackend
from swectl.remote.nodes.ssh import SshNode
from swectl.sandbox import LABEL_NODE, LABEL_RUN
from swectl.testing import nodes as testnodes

from .conftest import STARTED_MARK, wait_for_file
from .pools import running_pool

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

REPO_ROOT = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = bundled_containers_conf()
PREFIX = "swp"
BASE_INDEX = 200  # 10.200.200.0/24 and up: away from other users of test nodes
CREATE_TIMEOUT_S = 60.0
HEALTH_INTERVAL_S = 0.5
# Notice a dead connection fast: keepalives every second, two missed ones drop it.
FAST_NODE_FIELDS = "connect_timeout_s = 3\nkeepalive_interval_s = 1\nkeepalive_count_max = 2"



# ---------------------------------------------------------------------------------------------- fixtures


def podman(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    return subprocess.run(["podman", *args], capture_output=True, text=True, env=env, timeout=timeout, check=False)


def remove_labelled(key: str, value: str) -> None:
    ids = podman("ps", "-a", "-q", "--no-trunc", "--filter", f"label={key}={value}").stdout.split()
    if ids:
        podman("rm", "--force", "--ignore", "--time", "0", *ids)


@pytest.fixture(scope="module")
def nodes() -> Iterator[testnodes.TestNodes]:
    reason = testnodes.can_run_test_nodes()
    if reason is not None:
        pytest.skip(reason)
    with testnodes.test_nodes(2, prefix=PREFIX, base_index=BASE_INDEX) as started:
        try:
            yield started
        finally:
            for node in started.nodes:
                remove_labelled(LABEL_NODE, node.name)


@pytest.fixture
def run_id() -> Iterator[str]:
    rid = "t" + uuid.uuid4().hex[:16]
    yield rid
    remove_labelled(LABEL_RUN, rid)


def ssh_document(tn: testnodes.TestNodes, *, extra: str = FAST_NODE_FIELDS, **env_pool: Any) -> dict[str, Any]:
    doc = tomllib.loads(tn.cluster_toml(local=False, extra_node_fields=extra))
    doc["env_pool"] = {"warm": 0, "health_interval_s": HEALTH_INTERVAL_S, **env_pool}
    doc["sandbox"] = {"backend": "podman"}  # the tests look at containers; namespace: its own test below
    return doc


def ssh_config(tn: testnodes.TestNodes, *, extra: str = FAST_NODE_FIELDS, **env_pool: Any) -> ClusterConfig:
    return decode_config(ssh_document(tn, extra=extra, **env_pool))


# ---------------------------------------------------------------------------------------------- helpers


def leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [exc]


async def pool_start_errors(cfg: ClusterConfig, run_id: str) -> list[BaseException]:
    """Start a pool that is expected not to start; the errors it raised, ungrouped."""
    try:
        async with running_pool(cfg, run_id):
            pass
    except Exception as exc:
        return leaves(exc)
    pytest.fail("the pool started although no node is usable")


async def acquire(pool: EnvPool, timeout: float = CREATE_TIMEOUT_S) -> Lease:
    with anyio.fail_after(timeout):
        return await pool.acquire()


async def acquire_many(pool: EnvPool, count: int, timeout: float = 2 * CREATE_TIMEOUT_S) -> list[Lease]:
    """``count`` leases acquired concurrently."""
    got: list[Lease] = []

    async def one() -> None:
        got.append(await pool.acquire())

    with anyio.fail_after(timeout):
        async with anyio.create_task_group() as tg:
            for _ in range(count):
                tg.start_soon(one)
    return got


async def release(pool: EnvPool, lease: Lease) -> None:
    with anyio.fail_after(60):
        await pool.release(lease)


async def wait_until(predicate: Callable[[], bool | Awaitable[bool]], timeout: float, what: str) -> float:
    """Poll ``predicate`` until true; returns the seconds it took."""
    started = anyio.current_time()
    try:
        with anyio.fail_after(timeout):
            while True:
                value = predicate()
                if inspect.isawaitable(value):
                    value = await value
                if value:
                    return anyio.current_time() - started
                await anyio.sleep(0.05)
    except TimeoutError:
        pytest.fail(f"{what}: not within {timeout}s")


def node_stats(pool: EnvPool, name: str):
    (found,) = [n for n in pool.statistics().nodes if n.name == name]
    return found


async def containers(**labels: str) -> list[str]:
    args = ["podman", "ps", "-a", "-q", "--no-trunc"]
    for key, value in labels.items():
        args += ["--filter", f"label={key}={value}"]
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    with anyio.fail_after(60):
        out = await anyio.run_process(args, env=env, check=False)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    return out.stdout.decode().split()


def on_node(run_id: str, node: str) -> dict[str, str]:
    return {LABEL_RUN: run_id, LABEL_NODE: node}


def bring_back(node: testnodes.TestNode) -> None:
    """Undo whatever a test did to a node: network up, sshd running."""
    node.restore_network()
    if node.read_sshd_pid() is None:
        node.restart_sshd()


# ---------------------------------------------------------------------------------------------- pool over ssh


async def test_sandboxes_spread_over_both_ssh_nodes(nodes: testnodes.TestNodes, run_id: str) -> None:
    a, b = nodes.nodes
    async with running_pool(ssh_config(nodes), run_id) as pool:
        assert all(n.healthy for n in pool.statistics().nodes)
        leases = [await acquire(pool) for _ in range(4)]  # one at a time: least-loaded placement alternates
        by_node = {name: [lease for lease in leases if lease.node == name] for name in (a.name, b.name)}
        assert [len(by_node[a.name]), len(by_node[b.name])] == [2, 2]
        assert {n.name: n.leased for n in pool.statistics().nodes} == {a.name: 2, b.name: 2}
        for node in (a, b):
            ids = {lease.sandbox.id for lease in by_node[node.name]}
            assert set(await containers(**on_node(run_id, node.name))) == ids

        for lease in (by_node[a.name][0], by_node[b.name][0]):
            with anyio.fail_after(60):
                result = await lease.exec("echo $((6 * 7)); echo err >&2; exit 5", 20)
                assert (result.exit_code, result.output) == (5, "42\nerr\n")
                init = "git init -q /repo && git -C /repo -c user.email=t@t -c user.name=t commit -q --allow-empty -m 0"
                assert (await lease.exec(init, 30)).exit_code == 0
                data = bytes(range(256)) * 64
                await lease.write_file("/repo/blob.bin", data)
                await lease.write_file("/repo/hello.txt", b"hello over ssh\n", mode=0o755)
                assert await lease.read_file("/repo/blob.bin") == data
                mode = await lease.exec("stat -c %a /repo/hello.txt", 10)
                assert mode.output.strip() == "755"
                patch = await lease.diff("/repo")
            assert b"+hello over ssh" in patch
            assert b"blob.bin" in patch
            assert b"GIT binary patch" in patch

        for lease in leases:
            await release(pool, lease)
        assert await containers(**{LABEL_RUN: run_id}) == []


def known_hosts_line(tn: testnodes.TestNodes, node: testnodes.TestNode) -> str:
    lines = Path(tn.known_hosts_path).read_text().splitlines()
    return next(line for line in lines if line.startswith(node.host + " "))


async def test_unknown_host_key_is_rejected(nodes: testnodes.TestNodes, run_id: str, tmp_path: Path) -> None:
    a, b = nodes.nodes
    b_line = known_hosts_line(nodes, b)
    only_b = tmp_path / "known_hosts_without_a"
    only_b.write_text(b_line + "\n")
    impostor = tmp_path / "known_hosts_wrong_key_for_a"  # b's key filed under a's address
    impostor.write_text(f"{a.host} {b_line.split(' ', 1)[1]}\n")

    doc = ssh_document(nodes, nodes=[a.name])
    for table in doc["nodes"]:
        table["known_hosts"] = str(only_b)
    cfg = decode_config(doc)
    errors = await pool_start_errors(cfg, run_id)
    infra = [e for e in errors if isinstance(e, InfraError)]
    assert infra, f"expected an InfraError, got {errors!r}"
    assert "host key" in str(infra[0]), str(infra[0])
    assert a.name in str(infra[0])

    node_cfg = cfg.node(a.name)
    assert isinstance(node_cfg, SshNodeConfig)
    for known_hosts, message in [
        (only_b, "host key"),
        (impostor, "host key"),
        (tmp_path / "missing_known_hosts", "does not exist"),
    ]:
        node = SshNode(msgspec.structs.replace(node_cfg, known_hosts=str(known_hosts)))
        try:
            with pytest.raises(NodeConnectError, match=message) as caught:
                with anyio.fail_after(20):
                    await node.connect()
            assert "hint" in str(caught.value)
            assert not node.alive
        finally:
            await node.aclose()

    good = SshNode(msgspec.structs.replace(node_cfg, known_hosts=nodes.known_hosts_path))
    try:
        with anyio.fail_after(20):
            await good.connect()
            out = await good.run(["echo", "verified"])
        assert out.stdout == b"verified\n"
        assert good.alive
    finally:
        await good.aclose()


@pytest.mark.parametrize("socket_channel", [True, False], ids=["agent-socket", "agent-relay"])
async def test_channel_cap_opens_more_connections(nodes: testnodes.TestNodes, run_id: str,
                                                  socket_channel: bool) -> None:
    a = nodes.nodes[0]
    cfg = ssh_config(nodes, extra=FAST_NODE_FIELDS + "\nmax_channels_per_connection = 2", nodes=[a.name])
    backends = make_backends(cfg)
    ((_, backend),) = backends
    assert isinstance(backend, PodmanBackend) and isinstance(backend.node, SshNode)
    backend.socket_channel = socket_channel
    async with running_pool(cfg, run_id, backends=backends) as pool:
        leases = await acquire_many(pool, 5)
        assert {lease.node for lease in leases} == {a.name}
        assert backend.socket_channel is socket_channel  # the socket worked over SSH (no fallback)
        stats = backend.node.statistics()
        if socket_channel:
            # the agents are reached on forwarded sockets, which are not sessions: the 5 sandboxes hold none (a
            # health probe of the pool may hold one meanwhile), so the session cap is shown by commands at once
            # (5 sessions, 2 per connection -> at least 3 connections)
            assert stats["channels"] < 5, stats
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    for _ in range(5):
                        tg.start_soon(backend.node.run, ["sleep", "1"])
                    await anyio.sleep(0.5)
                    stats = backend.node.statistics()
                    assert stats["channels"] >= 5, stats
            assert stats["connections"] >= 3, stats
        else:
            # each live sandbox holds its exec agent's relay session; 2 per connection -> at least 3 connections
            assert stats["connections"] >= 3, stats
            assert stats["channels"] >= 5, stats

        results: dict[int, str] = {}

        async def run(i: int, lease: Lease) -> None:
            results[i] = (await lease.exec(f"echo sandbox-{i}", 20)).output

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i, lease in enumerate(leases):
                    tg.start_soon(run, i, lease)
        assert results == {i: f"sandbox-{i}\n" for i in range(5)}
        for lease in leases:
            await release(pool, lease)


async def test_node_death_and_rejoin(nodes: testnodes.TestNodes, run_id: str) -> None:
    a, b = nodes.nodes
    cfg = ssh_config(nodes, health_timeout_s=5)
    try:
        async with running_pool(cfg, run_id) as pool:
            leases = [await acquire(pool) for _ in range(4)]
            on_a = [lease for lease in leases if lease.node == a.name]
            on_b = [lease for lease in leases if lease.node == b.name]
            assert (len(on_a), len(on_b)) == (2, 2)
            dead_ids = {lease.sandbox.id for lease in on_a}

            await anyio.to_thread.run_sync(a.kill_sshd)
            with anyio.fail_after(15):
                for lease in on_a:
                    with pytest.raises(NodeLostError) as caught:
                        await lease.exec("true", 10)
                    assert caught.value.node == a.name
            await wait_until(lambda: not node_stats(pool, a.name).healthy, 10, f"{a.name} marked unhealthy")
            stats = pool.statistics()
            assert stats.leases_failed == 2
            assert node_stats(pool, a.name).leased == 0
            assert node_stats(pool, b.name).leased == 2

            with anyio.fail_after(30):
                for lease in on_b:
                    assert (await lease.exec("echo still here", 10)).output == "still here\n"
            newcomer = await acquire(pool)
            assert newcomer.node == b.name
            with anyio.fail_after(30):
                assert (await newcomer.exec("true", 10)).exit_code == 0

            for lease in on_a:  # the node is down: releasing is bounded and harmless
                await release(pool, lease)
            # nobody could remove them while the node was down
            assert dead_ids <= set(await containers(**on_node(run_id, a.name)))

            await anyio.to_thread.run_sync(a.restart_sshd)
            took = await wait_until(lambda: node_stats(pool, a.name).healthy, 10, f"{a.name} healthy again")
            assert took < 3 * HEALTH_INTERVAL_S + 3, f"rejoin took {took:.1f}s"
            await wait_until(
                lambda: _no_containers(on_node(run_id, a.name)), 20, f"dead leases' containers reaped on {a.name}"
            )
            assert pool.statistics().orphans_reaped >= 2

            more = [await acquire(pool) for _ in range(2)]
            rejoined = [lease for lease in more if lease.node == a.name]
            assert rejoined, f"no new lease on {a.name} after it rejoined"
            with anyio.fail_after(30):
                for lease in rejoined:
                    assert (await lease.exec("echo back", 10)).output == "back\n"
            for lease in [*on_b, newcomer, *more]:
                await release(pool, lease)
        assert await containers(**{LABEL_RUN: run_id}) == []
    finally:
        bring_back(a)


async def test_node_down_at_start_joins_later(nodes: testnodes.TestNodes, run_id: str) -> None:
    a, b = nodes.nodes
    cfg = ssh_config(nodes, health_timeout_s=5)
    try:
        await anyio.to_thread.run_sync(a.kill_sshd)
        async with running_pool(cfg, run_id) as pool:
            assert not node_stats(pool, a.name).healthy
            assert node_stats(pool, b.name).healthy
            lease = await acquire(pool)
            assert lease.node == b.name
            await anyio.to_thread.run_sync(a.restart_sshd)
            await wait_until(lambda: node_stats(pool, a.name).healthy, 10, f"{a.name} joining after start")
            late = await acquire(pool)
            assert late.node == a.name  # the least-loaded node
            with anyio.fail_after(30):
                assert (await late.exec("echo joined", 10)).output == "joined\n"
            await release(pool, lease)
            await release(pool, late)
    finally:
        bring_back(a)


async def _no_containers(labels: dict[str, str]) -> bool:
    return not await containers(**labels)


async def test_network_cut_fails_inflight_exec(nodes: testnodes.TestNodes, run_id: str) -> None:
    a, b = nodes.nodes
    health_timeout = 3.0  # small, with some room for a busy 2-CPU machine at the initial probe
    cfg = ssh_config(nodes, health_timeout_s=health_timeout)
    try:
        async with running_pool(cfg, run_id) as pool:
            leases = [await acquire(pool) for _ in range(2)]
            (la,) = [lease for lease in leases if lease.node == a.name]
            (lb,) = [lease for lease in leases if lease.node == b.name]

            outcome: dict[str, Any] = {}
            finished = anyio.Event()

            async def inflight() -> None:
                try:
                    outcome["result"] = await la.exec(f"touch {STARTED_MARK}; sleep 30", 60)
                except InfraError as exc:
                    outcome["error"] = exc
                outcome["at"] = anyio.current_time()
                finished.set()

            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(inflight)
                    await wait_for_file(la.sandbox.id)  # the command is running in the sandbox
                    assert not finished.is_set()
                    await anyio.to_thread.run_sync(a.cut_network)
                    cut_at = anyio.current_time()
                    took = await wait_until(
                        lambda: not node_stats(pool, a.name).healthy,
                        HEALTH_INTERVAL_S + health_timeout + 3,
                        f"health probe failing {a.name}",
                    )
                    assert took <= HEALTH_INTERVAL_S + health_timeout + 1.5
                    await finished.wait()
            assert "error" in outcome, f"exec returned {outcome.get('result')!r} on a cut node"
            assert outcome["at"] - cut_at < 10, f"the in-flight exec failed only after {outcome['at'] - cut_at:.1f}s"
            assert isinstance(outcome["error"], NodeLostError), repr(outcome["error"])

            with anyio.fail_after(30):
                assert (await lb.exec("echo unaffected", 10)).output == "unaffected\n"

            await anyio.to_thread.run_sync(a.restore_network)
            await wait_until(lambda: node_stats(pool, a.name).healthy, 20, f"{a.name} healthy after restore")
            await release(pool, la)
            await release(pool, lb)
        # a was reachable again at exit, so the exit cleanup removed everything of the run
        assert await containers(**{LABEL_RUN: run_id}) == []
    finally:
        bring_back(a)


# ---------------------------------------------------------------------------------------------- swectl nodes check


def swectl_cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = REPO_ROOT / ".venv" / "bin" / "swectl"
    argv = [str(exe)] if exe.exists() else [sys.executable, "-m", "swectl.cli.main"]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=240, check=False, cwd=REPO_ROOT)


def test_nodes_check_healthy(nodes: testnodes.TestNodes, tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(nodes.cluster_toml(local=False))
    done = swectl_cli("nodes", "check", str(path))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for node in nodes.nodes:
        line = rf"^{node.name}\s+ok\s.*namespace sandboxes: yes  engines: cpu yes\b"
        assert re.search(line, done.stdout, re.MULTILINE), output
    assert "PROBLEM" not in output
    assert "hint" not in output


def test_nodes_check_wrong_port(nodes: testnodes.TestNodes, tmp_path: Path) -> None:
    a, b = nodes.nodes
    text = nodes.cluster_toml(local=False)
    wrong = text.replace(f'host = "{b.host}"\nport = {b.port}\n', f'host = "{b.host}"\nport = 2222\n')
    assert wrong != text
    path = tmp_path / "cluster.toml"
    path.write_text(wrong)
    done = swectl_cli("nodes", "check", str(path))
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert re.search(rf"^{a.name}\s+ok\s", done.stdout, re.MULTILINE), output
    assert re.search(rf"^{b.name}\s+PROBLEM\s", done.stdout, re.MULTILINE), output
    problem = [line for line in done.stdout.splitlines() if line.strip().startswith("-")]
    assert problem, output
    assert b.name in problem[0], output
    assert "2222" in problem[0], output
    assert "hint:" in problem[0], output


# ---------------------------------------------------------------------------------------------- namespace backend


async def test_namespace_sandboxes_over_ssh(nodes: testnodes.TestNodes, run_id: str, tmp_path: Path) -> None:
    """The namespace backend on SSH nodes: the daemon is started over the node channel and each sandbox's
    channel is one `attach` process's pipe, handed to the daemon. Killing a sandbox on the node is noticed,
    and releasing every lease leaves nothing on the node."""
    from swectl.remote.nodes.namespace_sandbox import daemon_socket
    from swectl.remote.programs import nsbox

    state_dir = tmp_path / "ns"
    socket = daemon_socket(str(state_dir))
    doc = ssh_document(nodes)
    doc["sandbox"] = {"backend": "namespace", "ns_state_dir": str(state_dir)}
    try:
        async with running_pool(decode_config(doc), run_id) as pool:
            leases = [await acquire(pool) for _ in range(2)]
            assert {lease.node for lease in leases} == {n.name for n in nodes.nodes}
            for lease in leases:
                with anyio.fail_after(60):
                    result = await lease.exec("echo $((6 * 7)) $(hostname); cat /proc/1/cmdline | head -c 6", 20)
                    assert result.output.startswith(f"42 {lease.sandbox.id}\n"), result
                    await lease.write_file("/tmp/blob", bytes(range(256)) * 64)
                    assert await lease.read_file("/tmp/blob") == bytes(range(256)) * 64
            listed = nsbox.call(socket, {"op": "list"})
            assert sorted(box["id"] for box in listed["sandboxes"]) == sorted(lease.sandbox.id for lease in leases)
            victim = next(box for box in listed["sandboxes"] if box["id"] == leases[0].sandbox.id)
            os.kill(victim["pid"], 9)
            with pytest.raises(InfraError), anyio.fail_after(20):
                await leases[0].exec("echo never", 10)
            for lease in leases:
                await release(pool, lease)
        listed = nsbox.call(socket, {"op": "list"})
        assert listed["sandboxes"] == []
    finally:
        if await anyio.Path(socket).exists():
            nsbox.call(socket, {"op": "retire"})


async def test_a_killed_daemon_on_ssh_nodes_is_started_again(nodes: testnodes.TestNodes, tmp_path: Path) -> None:
    """Issue 62 on SSH nodes: with the node's nsbox daemon killed, a sandbox launch (its `attach` process finds no
    daemon and says so in the channel) and a call (`nsbox call` exits DAEMON_GONE_EXIT) each start it again over
    the node channel, once, and go on; neither fails as if it were the command's result."""
    from swectl.remote.nodes.namespace_sandbox import NamespaceBackend, daemon_socket
    from swectl.remote.programs import nsbox
    from swectl.schema import SandboxSpec

    state_dir = tmp_path / "ns"
    socket = daemon_socket(str(state_dir))
    doc = ssh_document(nodes)
    doc["sandbox"] = {"backend": "namespace", "ns_state_dir": str(state_dir)}
    [(_, backend), *_] = make_backends(decode_config(doc))
    assert isinstance(backend, NamespaceBackend)
    spec = SandboxSpec(image=decode_config(doc).sandbox.image, labels={"swectl.test": "ssh-revive"})
    try:
        with anyio.fail_after(180):
            await backend.prepare()
            first = await backend.create(spec)
            assert (await first.exec("echo up", 10)).output == "up\n"
            os.kill(nsbox.call(socket, {"op": "ping"})["pid"], 9)
            second = await backend.create(spec)  # the launch finds no daemon, starts it, launches again
            assert backend.revivals == 1
            assert (await second.exec("echo again", 10)).output == "again\n"
            os.kill(nsbox.call(socket, {"op": "ping"})["pid"], 9)
            assert [box.id for box in await backend.list({"swectl.test": "ssh-revive"})] == []  # a call revives
            assert backend.revivals == 2  # (the new daemon reclaimed what the killed one left: nothing is listed)
            with pytest.raises(InfraError):
                await second.exec("echo reclaimed", 10)
            for box in (first, second):
                await box.destroy()
    finally:
        await backend.aclose()
        if await anyio.Path(socket).exists():
            nsbox.call(socket, {"op": "retire"})


async def test_podman_api_over_ssh(nodes: testnodes.TestNodes, run_id: str) -> None:
    """``sandbox.podman_api`` on SSH nodes: lifecycle through each node's Podman API service, reached over a
    socket forwarded by the SSH connection; commands still through the exec agent."""
    doc = ssh_document(nodes)
    doc["sandbox"] = {"backend": "podman", "podman_api": True}
    async with running_pool(decode_config(doc), run_id) as pool:
        leases = [await acquire(pool) for _ in range(2)]
        assert {lease.node for lease in leases} == {n.name for n in nodes.nodes}
        for lease in leases:
            with anyio.fail_after(60):
                result = await lease.exec("echo $((6 * 7))", 20)
            assert result.output == "42\n"
            assert set(await containers(**on_node(run_id, lease.node))) == {lease.sandbox.id}
        for lease in leases:
            await release(pool, lease)
    assert await containers(**{LABEL_RUN: run_id}) == []


@pytest.mark.parametrize("backend", ["podman", "namespace"])
async def test_a_mount_and_a_forwarded_port_on_ssh_nodes(nodes: testnodes.TestNodes, run_id: str, tmp_path: Path,
                                                          backend: str) -> None:
    """What a CLI agent needs, on SSH nodes: the pool's mounts are in the node's sandbox read-only, and a port
    forwarded into it reaches a server of the controller's through the node's sshd (remote unix forwarding into the
    sandbox's /tmp) while the block runs, and nothing afterwards."""
    from swectl.schema import Mount

    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "VERSION").write_text("tools 1\n")
    doc = ssh_document(nodes)
    doc["sandbox"] = {"backend": backend, "ns_state_dir": str(tmp_path / "ns")}

    async def upper(stream: Any) -> None:
        async with stream:
            await stream.send((await stream.receive()).upper())

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    talk = "exec 3<>/dev/tcp/127.0.0.1/18081 && printf 'over ssh\\n' >&3 && head -c 9 <&3"
    async with (anyio.create_task_group() as tg,
                running_pool(decode_config(doc), run_id, mounts=[Mount(str(tools), "/opt/swectl-tools")]) as pool):
        tg.start_soon(listener.serve, upper)
        lease = await acquire(pool)
        with anyio.fail_after(60):
            assert (await lease.exec("cat /opt/swectl-tools/VERSION", 10)).output == "tools 1\n"
            assert (await lease.exec("touch /opt/swectl-tools/x", 10)).exit_code != 0
            async with lease.forward_port(18081, lambda: anyio.connect_tcp("127.0.0.1", port)):
                result = await lease.exec(talk, 10)
                assert result.output == "OVER SSH\n", result
            after = await lease.exec("timeout 3 bash -c 'exec 3<>/dev/tcp/127.0.0.1/18081' && echo connected", 10)
            assert "connected" not in after.output
        await release(pool, lease)
        tg.cancel_scope.cancel()
