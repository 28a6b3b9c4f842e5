"""Throwaway "remote" SSH nodes on this machine, for tests and benchmarks only.

Each node is an OpenSSH ``sshd`` running inside its own Linux network namespace, reached from the
host over a veth pair, so swectl's ssh code path (connect, host key check, channels, podman in the
session, a node dying, a network cut) can be exercised for real without a second machine.

What it touches on the host (all of it needs root, and all of it is undone by :func:`stop_test_nodes`):

* network namespaces ``<prefix><K>`` (``ip netns add``; K = node index, from ``base_index`` up);
* veth pairs ``<prefix><K>-h`` (host side, ``10.200.K.1/24``) / ``<prefix><K>-n`` (namespace side,
  ``10.200.K.2/24``), and a fallback ``blackhole 10.200.K.0/24`` route with a high metric: while a
  node's network is cut (host veth down) that route keeps its packets on this machine instead of
  letting them follow the default route out to the real network;
* nodes reach each other as a fleet's do: each routes ``10.200.0.0/16`` through its host veth, and the host
  forwards between the host-side veths (``net.ipv4.conf.<veth>.forwarding = 1`` on those interfaces only;
  the interfaces go with the nodes). A cut node is cut from the other nodes too;
* ``/run/sshd``, sshd's privilege-separation directory (created if missing, never removed);
* a temp dir holding the per-node host keys, sshd configs, pid files and logs, the client key and a
  ``known_hosts`` file;
* for the CLI only: ``/run/swectl-testnodes/state.json``;
* with ``own_store``: a Podman store per node (graph root and run root in the node's temp dir, named by a
  ``storage.conf`` that sshd hands every session as ``CONTAINERS_STORAGE_CONF``), so a node lacks what this
  machine or another node holds, as a separate machine would. Podman's other state stays shared with this
  machine (``/run/libpod``, the lock segment): a store of its own under a tmp dir of its own would make the
  first podman call "refresh" and free every lock of the machine's containers. Teardown removes the store's
  containers and images, unmounts what podman left mounted under it, and deletes it. Without ``own_store``
  (the default) every node uses this machine's store.

sshd is started with ``nsenter --net=/run/netns/NAME`` rather than ``ip netns exec``: the latter
remounts /sys, after which podman inside the ssh session fails with "no cgroup mount found".
sshd daemonizes (no ``-D``), so nodes outlive the creating process (the CLI relies on it); its pid
comes from the PidFile. Every subprocess runs with a timeout. Traffic stays within 10.200.0.0/16.

CLI, for trying an example cluster file by hand::

    python -m swectl.testing.nodes up --count 2   # prints the [[nodes]] TOML
    python -m swectl.testing.nodes down
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"
SSH_PORT = 22
USER = "root"
STATE_DIR = Path("/run/swectl-testnodes")
STATE_FILE = STATE_DIR / "state.json"
FLEET_NET = "10.200.0.0/16"  # every test node's address; each node routes it through this host
# Metric of the guard route: above the connected route (metric 0), so it only matters while the link is down.
_GUARD_METRIC = "4242"
_CMD_TIMEOUT = 15.0
_START_TIMEOUT = 10.0
_PREFIX_RE = re.compile(r"[a-z][a-z0-9]*")

__all__ = [
    "TestNode",
    "TestNodes",
    "can_run_test_nodes",
    "start_test_nodes",
    "stop_test_nodes",
    "test_nodes",
]


def _run(
    args: list[str], *, check: bool = True, timeout: float = _CMD_TIMEOUT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        args, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, check=False, env=env
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)!r} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def _netns_exists(netns: str) -> bool:
    return netns in _run(["ip", "netns", "list"]).stdout.split()


def _link_exists(name: str) -> bool:
    return _run(["ip", "link", "show", "dev", name], check=False).returncode == 0


def _netns_pids(netns: str) -> list[int]:
    proc = _run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _kill_netns_processes(netns: str, *, timeout: float = 5.0) -> None:
    """SIGKILL every process in the namespace until none is left (they may fork meanwhile)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = _netns_pids(netns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in netns {netns} survive SIGKILL")
        time.sleep(0.02)


def _tail(path: str, limit: int = 4000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-limit:].strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class TestNode:
    """One sshd in its own network namespace. ``host:port`` is reachable from the host only."""

    __test__ = False  # not a pytest test class

    name: str
    host: str
    port: int
    netns: str
    sshd_pid: int  # the pid at start; see read_sshd_pid() after a restart
    index: int
    host_veth: str
    config_path: str
    pid_file: str
    log_path: str
    # The node's own Podman storage.conf (own_store); "" when the node uses this machine's store.
    storage_conf: str = ""

    @property
    def host_addr(self) -> str:
        """This machine's address on the node's veth, which the node reaches (a registry for nodes listens here)."""
        return f"10.200.{self.index}.1"

    def podman_env(self) -> dict[str, str]:
        """The environment for running ``podman`` on this machine against the node's store (this machine's own
        store when the node has none), with swectl's containers.conf."""
        from swectl.remote.nodes.podman import local_podman_env

        env = local_podman_env()
        if self.storage_conf:
            env["CONTAINERS_STORAGE_CONF"] = self.storage_conf
        return env

    def read_sshd_pid(self) -> int | None:
        """The pid in sshd's PidFile, or None when the file is missing or that process is gone."""
        try:
            pid = int(Path(self.pid_file).read_text().strip())
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (OSError, ValueError):
            return None
        return None if stat.rsplit(")", 1)[1].split()[0] == "Z" else pid  # a zombie is gone too

    def kill_sshd(self) -> None:
        """SIGKILL every process in the namespace (listener and per-connection children): the node dies.

        Returns once they are gone, so new connections are refused from then on.
        """
        _kill_netns_processes(self.netns)

    def restart_sshd(self) -> None:
        """Start sshd again with the same config and keys (killing whatever still runs in the namespace)."""
        _kill_netns_processes(self.netns)
        self._start_sshd()

    def cut_network(self) -> None:
        """Take the host-side veth down: packets vanish, established connections hang (no RST, no FIN).

        New connect() calls fail at once with EINVAL (the guard blackhole route) instead of timing out.
        """
        _run(["ip", "link", "set", "dev", self.host_veth, "down"])

    def restore_network(self) -> None:
        _run(["ip", "link", "set", "dev", self.host_veth, "up"])
        operstate = Path(f"/sys/class/net/{self.host_veth}/operstate")
        deadline = time.monotonic() + 5.0
        while operstate.read_text().strip() != "up":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.host_veth} did not come back up")
            time.sleep(0.02)

    def _start_sshd(self) -> int:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        Path(self.pid_file).unlink(missing_ok=True)
        out_path = self.log_path + ".out"
        with open(out_path, "ab") as out:
            argv = ["nsenter", f"--net=/run/netns/{self.netns}", SSHD, "-f", self.config_path]
            proc = subprocess.run(
                [*argv, "-E", self.log_path],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                timeout=_CMD_TIMEOUT,
                check=False,
            )
        if proc.returncode != 0:
            raise RuntimeError(
                f"sshd for {self.name} exited {proc.returncode}: {_tail(out_path)}\n{_tail(self.log_path)}"
            )
        deadline = time.monotonic() + _START_TIMEOUT
        while True:
            pid = self.read_sshd_pid()
            if pid is not None and _accepts_tcp(self.host, self.port):
                return pid
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"sshd for {self.name} not accepting on {self.host}:{self.port} after {_START_TIMEOUT}s"
                    f" (pid {pid}): {_tail(out_path)}\n{_tail(self.log_path)}"
                )
            time.sleep(0.05)


def _accepts_tcp(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class TestNodes:
    """A set of test nodes plus the client-side files needed to reach them."""

    __test__ = False  # not a pytest test class

    nodes: list[TestNode]
    key_path: str  # client private key (ed25519, no passphrase)
    known_hosts_path: str
    workdir: str

    def cluster_toml(self, *, local: bool = False, extra_node_fields: str = "") -> str:
        """``[[nodes]]`` tables for a cluster file; ``extra_node_fields`` lines go in each ssh table."""
        tables = ['[[nodes]]\nname = "local"\nkind = "local"\n'] if local else []
        extra = extra_node_fields.strip("\n")
        for node in self.nodes:
            lines = [
                "[[nodes]]",
                f"name = {json.dumps(node.name)}",
                'kind = "ssh"',
                f"host = {json.dumps(node.host)}",
                f"port = {node.port}",
                f"user = {json.dumps(USER)}",
                f"identity_file = {json.dumps(self.key_path)}",
                f"known_hosts = {json.dumps(self.known_hosts_path)}",
            ]
            if extra:
                lines.append(extra)
            tables.append("\n".join(lines) + "\n")
        return "\n".join(tables)


def can_run_test_nodes() -> str | None:
    """None if test nodes can be started here, else a human-readable reason why not."""
    if sys.platform != "linux":
        return "test nodes need Linux network namespaces"
    if os.geteuid() != 0:
        return "test nodes need root (network namespaces, veths, sshd)"
    if not os.access(SSHD, os.X_OK):
        return f"no OpenSSH server at {SSHD} (apt-get install openssh-server)"
    for tool in ("ip", "nsenter", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool!r} not found on PATH"
    return None


def _names(prefix: str, index: int) -> tuple[str, str, str]:
    name = f"{prefix}{index}"
    return name, f"{name}-h", f"{name}-n"


def _cleanup_node(netns: str, index: int) -> None:
    """Remove namespace, veth and guard route of one node, whatever state they are in. Idempotent."""
    host_veth = f"{netns}-h"
    if _netns_exists(netns):
        _kill_netns_processes(netns)
        _run(["ip", "netns", "del", netns], check=False)
    _run(["ip", "route", "del", "blackhole", f"10.200.{index}.0/24", "metric", _GUARD_METRIC], check=False)
    # Deleting the namespace destroys the veth pair only once nothing references the namespace any more;
    # orphaned TCP sockets (e.g. after a kill during a network cut) can pin it for minutes. Deleting the
    # host end removes the pair at once (the emptied namespace then goes away on its own).
    if _link_exists(host_veth):
        _run(["ip", "link", "del", "dev", host_veth], check=False)
    deadline = time.monotonic() + 5.0
    while _link_exists(host_veth) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _netns_exists(netns) or _link_exists(host_veth):
        raise RuntimeError(f"could not remove netns {netns} / veth {host_veth}")


def _keygen(path: Path, comment: str) -> str:
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])
    return path.with_name(path.name + ".pub").read_text().strip()


def _sshd_config(node_dir: Path, addr: str, authorized_keys: Path, storage_conf: str = "") -> str:
    # sshd takes the first SetEnv line only: every variable goes on it.
    setenv = "SetEnv SHLVL=1" + (f" CONTAINERS_STORAGE_CONF={storage_conf}" if storage_conf else "")
    return "\n".join(
        [
            f"Port {SSH_PORT}",
            f"ListenAddress {addr}",
            f"HostKey {node_dir / 'ssh_host_ed25519_key'}",
            f"AuthorizedKeysFile {authorized_keys}",
            f"PidFile {node_dir / 'sshd.pid'}",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "PermitRootLogin prohibit-password",
            "AllowStreamLocalForwarding yes",
            "MaxSessions 100",
            "MaxStartups 100:30:200",
            "LogLevel ERROR",
            "Subsystem sftp internal-sftp",
            # bash run by sshd sources ~/.bashrc when SHLVL < 2; on these machines that runs
            # `pyenv rehash`, whose lock file a killed session leaves behind, after which every
            # command waits 60 s for it. A node's commands get the plain sshd environment instead.
            setenv,
            "",
        ]
    )


STORE_DIR = "store"  # a node's own Podman store, in its folder of the temp dir (own_store)


def _make_store(node_dir: Path) -> str:
    """A Podman store of the node's own: its storage.conf (the path), on this machine's storage driver."""
    from swectl.remote.nodes.podman import local_podman_env

    driver = _run(["podman", "info", "--format", "{{.Store.GraphDriverName}}"], timeout=60, env=local_podman_env())
    store = node_dir / STORE_DIR
    (store / "graph").mkdir(parents=True)
    (store / "run").mkdir()
    conf = store / "storage.conf"
    conf.write_text(
        f'[storage]\ndriver = {json.dumps(driver.stdout.strip() or "overlay")}\n'
        f'graphroot = {json.dumps(str(store / "graph"))}\nrunroot = {json.dumps(str(store / "run"))}\n'
    )
    return str(conf)


def _remove_store(store: Path) -> None:
    """Remove a node's own store: its containers and images (through podman), then whatever podman left mounted
    under it (the overlay driver keeps its home mounted), then the files. Idempotent."""
    from swectl.remote.nodes.podman import local_podman_env

    conf = store / "storage.conf"
    if conf.exists():
        env = {**local_podman_env(), "CONTAINERS_STORAGE_CONF": str(conf)}
        for args in (["rm", "--all", "--force", "--time", "0"], ["rmi", "--all", "--force"]):
            try:
                _run(["podman", *args], check=False, timeout=120, env=env)
            except subprocess.TimeoutExpired:
                pass
    for mountpoint in sorted(_mounts_under(store), key=len, reverse=True):
        if _run(["umount", mountpoint], check=False).returncode != 0:
            _run(["umount", "-l", mountpoint], check=False)
    shutil.rmtree(store, ignore_errors=True)


def _mounts_under(folder: Path) -> list[str]:
    root = str(folder.resolve())
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == root or point.startswith(root + "/"):
            points.append(point)
    return points


def _create_node(
    prefix: str, index: int, workdir: Path, authorized_keys: Path, *, own_store: bool = False
) -> tuple[TestNode, str]:
    netns, host_veth, ns_veth = _names(prefix, index)
    host_addr, ns_addr = f"10.200.{index}.1", f"10.200.{index}.2"
    _cleanup_node(netns, index)  # leftovers of a crashed run with the same names
    clash = [
        line
        for line in _run(["ip", "-o", "-4", "addr", "show"]).stdout.splitlines()
        if f" 10.200.{index}." in line
    ]
    if clash:
        raise RuntimeError(f"10.200.{index}.0/24 is already in use on this host: {clash}")

    _run(["ip", "netns", "add", netns])
    _run(["ip", "link", "add", host_veth, "type", "veth", "peer", "name", ns_veth])
    _run(["ip", "link", "set", "dev", ns_veth, "netns", netns])
    _run(["ip", "addr", "add", f"{host_addr}/24", "dev", host_veth])
    _run(["ip", "link", "set", "dev", host_veth, "up"])
    _run(["ip", "-n", netns, "addr", "add", f"{ns_addr}/24", "dev", ns_veth])
    _run(["ip", "-n", netns, "link", "set", "dev", ns_veth, "up"])
    _run(["ip", "-n", netns, "link", "set", "dev", "lo", "up"])
    _run(["ip", "route", "add", "blackhole", f"10.200.{index}.0/24", "metric", _GUARD_METRIC])
    # A fleet's nodes reach each other: the other test nodes through this host, which forwards between the
    # nodes' veths (forwarding on these interfaces only; the machine's own setting is left alone)
    _run(["ip", "-n", netns, "route", "add", FLEET_NET, "via", host_addr])
    Path(f"/proc/sys/net/ipv4/conf/{host_veth}/forwarding").write_text("1\n")

    node_dir = workdir / netns
    node_dir.mkdir()
    host_pub = _keygen(node_dir / "ssh_host_ed25519_key", f"{netns}-host")
    storage_conf = _make_store(node_dir) if own_store else ""
    config = node_dir / "sshd_config"
    config.write_text(_sshd_config(node_dir, ns_addr, authorized_keys, storage_conf))
    node = TestNode(
        name=netns,
        host=ns_addr,
        port=SSH_PORT,
        netns=netns,
        sshd_pid=0,
        index=index,
        host_veth=host_veth,
        config_path=str(config),
        pid_file=str(node_dir / "sshd.pid"),
        log_path=str(node_dir / "sshd.log"),
        storage_conf=storage_conf,
    )
    pid = node._start_sshd()
    return dataclasses.replace(node, sshd_pid=pid), host_pub


def start_test_nodes(
    count: int = 2, *, prefix: str = "swt", base_index: int = 1, own_store: bool = False
) -> TestNodes:
    """Start ``count`` nodes named ``<prefix><K>`` at 10.200.K.2, K = base_index, base_index+1, ...

    ``own_store``: each node gets a Podman store of its own, empty at first (see the module docstring);
    otherwise they all use this machine's."""
    reason = can_run_test_nodes()
    if reason is not None:
        raise RuntimeError(reason)
    if count < 1 or base_index < 1 or base_index + count - 1 > 254:
        raise ValueError(f"node indexes {base_index}..{base_index + count - 1} must lie in 1..254")
    if not _PREFIX_RE.fullmatch(prefix) or len(f"{prefix}{base_index + count - 1}-h") > 15:
        raise ValueError(f"prefix {prefix!r}: lowercase alphanumeric, short enough for 15-char veth names")

    workdir = Path(tempfile.mkdtemp(prefix="swectl-testnodes-"))
    indexes = range(base_index, base_index + count)
    try:
        key_path = workdir / "client_ed25519"
        authorized_keys = workdir / "authorized_keys"
        authorized_keys.write_text(_keygen(key_path, "swectl-testnodes-client") + "\n")
        known_hosts = workdir / "known_hosts"
        nodes, lines = [], []
        for index in indexes:
            node, host_pub = _create_node(prefix, index, workdir, authorized_keys, own_store=own_store)
            nodes.append(node)
            host = node.host if node.port == 22 else f"[{node.host}]:{node.port}"
            lines.append(f"{host} {host_pub}\n")
        known_hosts.write_text("".join(lines))
    except BaseException:
        _stop([(_names(prefix, i)[0], i) for i in indexes], str(workdir))
        raise
    return TestNodes(
        nodes=nodes, key_path=str(key_path), known_hosts_path=str(known_hosts), workdir=str(workdir)
    )


def _stop(nodes: list[tuple[str, int]], workdir: str | None) -> None:
    errors = []
    for netns, index in nodes:
        try:
            _cleanup_node(netns, index)
            if workdir is not None:
                _remove_store(Path(workdir) / netns / STORE_DIR)  # once nothing in the node uses it any more
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            errors.append(str(exc))
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)
    if errors:
        raise RuntimeError("test node teardown incomplete: " + "; ".join(errors))


def stop_test_nodes(nodes: TestNodes) -> None:
    """Kill everything in the nodes' namespaces, delete namespaces, veths, guard routes and the temp dir.

    Idempotent; raises RuntimeError only if something could not be removed.
    """
    _stop([(node.netns, node.index) for node in nodes.nodes], nodes.workdir)


@contextmanager
def test_nodes(
    count: int = 2, *, prefix: str = "swt", base_index: int = 1, own_store: bool = False
) -> Iterator[TestNodes]:
    """``start_test_nodes`` ... ``stop_test_nodes``, even on error."""
    nodes = start_test_nodes(count, prefix=prefix, base_index=base_index, own_store=own_store)
    try:
        yield nodes
    finally:
        stop_test_nodes(nodes)


test_nodes.__test__ = False  # type: ignore[attr-defined]  # not a pytest test function


def _load_state() -> TestNodes | None:
    try:
        data = json.loads(STATE_FILE.read_text())
    except FileNotFoundError:
        return None
    return TestNodes(
        nodes=[TestNode(**n) for n in data["nodes"]],
        key_path=data["key_path"],
        known_hosts_path=data["known_hosts_path"],
        workdir=data["workdir"],
    )


def _down() -> bool:
    state = _load_state()
    if state is None:
        return False
    stop_test_nodes(state)
    STATE_FILE.unlink(missing_ok=True)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swectl.testing.nodes", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--count", type=int, default=2)
    parser.add_argument("--prefix", default="swt")
    parser.add_argument("--base-index", type=int, default=1)
    parser.add_argument("--own-store", action="store_true", help="a Podman store per node (empty at first)")
    args = parser.parse_args(argv)
    reason = can_run_test_nodes()
    if reason is not None:
        print(f"cannot run test nodes: {reason}", file=sys.stderr)
        return 1
    if args.action == "down":
        if not _down():
            indexes = range(args.base_index, args.base_index + args.count)
            _stop([(_names(args.prefix, i)[0], i) for i in indexes], None)
        print("test nodes down", file=sys.stderr)
        return 0
    _down()
    nodes = start_test_nodes(args.count, prefix=args.prefix, base_index=args.base_index, own_store=args.own_store)
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    STATE_FILE.write_text(json.dumps(dataclasses.asdict(nodes), indent=1))
    print(nodes.cluster_toml(local=True), end="")
    first = nodes.nodes[0]
    print(
        f"# try: ssh -i {nodes.key_path} -o UserKnownHostsFile={nodes.known_hosts_path} {USER}@{first.host}\n"
        f"# tear down: python -m swectl.testing.nodes down",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
