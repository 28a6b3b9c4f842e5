"""Fault injection for a running `swectl up` on this machine: find the processes of a run by their
command lines under the controller's pid, break one the way a long run meets it, and count what a run left behind.

Faults (``FAULTS``), each a function of a ``Run`` that returns what it did (or raises ``NoTarget`` when the run
has nothing of that kind right now; the caller tries again a moment later):

- ``engine_kill``: SIGKILL of the inference server (the CPU engine);
- ``engine_supervisor_kill``: SIGKILL of the ``sh`` supervisor the server runs under;
- ``engine_stop``: SIGSTOP of the server (alive, silent) for ``STOP_S``, then SIGCONT if it still exists;
- ``trainer_kill``: SIGKILL of a trainer rank;
- ``nsbox_kill``: SIGKILL of the node's nsbox daemon (namespace sandboxes);
- ``sandbox_kill``: SIGKILL of one running sandbox's PID 1 (its exec agent: everything in it ends);
- ``disk_full``: the run's file system filled to its last 1% for ``DISK_FULL_S`` (only where the run folder is on
  a file system of its own: the soak mounts one; filling the machine's disk would hurt everything else on it);
- ``controller_kill``: SIGKILL of the controller itself (the caller resumes it with `swectl up --resume`);
- ``ssh_net_down``: one SSH test node's network cut for ``NET_DOWN_S`` (its host veth down: packets vanish,
  connections hang), then back (only in a run on test nodes, swectl/testing/nodes.py).

``footprint()`` is what a run can leave on this node: swectl processes, sandboxes and their records, mounts under
the namespace state folder, shared-memory segments, listening TCP ports, Podman containers.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from swectl.config import SandboxConfig
from swectl.errors import SwectlError
from swectl.remote.nodes.namespace_sandbox import daemon_socket
from swectl.remote.programs import nsbox

STOP_S = 30.0  # how long engine_stop keeps the server stopped (it is killed and restarted before, if found)
DISK_FULL_S = 30.0  # how long disk_full keeps the file system full
NET_DOWN_S = 20.0  # how long ssh_net_down keeps a node's network cut
SWECTL_PROGRAMS = ("swectl.remote.programs.cpu_engine", "swectl.remote.programs.trainer", "torch.distributed.run",
                   "swectl.cli.main")


class NoTarget(SwectlError):
    """The run has no process of that kind right now (e.g. no sandbox between episodes)."""


def processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state letter, command line) of every process on this machine."""
    out: dict[int, tuple[int, str, str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        out[int(stat.parent.name)] = (int(fields[1]), fields[0], cmdline)
    return out


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live process under ``root``."""
    table = processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, state, _) in table.items():
        if state != "Z":
            children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out[child] = table[child][2]
            todo.append(child)
    return out


def _program(controller: int, needle: str) -> list[int]:
    """The run's processes running ``needle`` (not the sh supervisors around them)."""
    return sorted(pid for pid, cmd in descendants(controller).items() if needle in cmd and not cmd.startswith("sh "))


def nsbox_daemon() -> int | None:
    """The pid of this version's nsbox daemon on this node (daemons of other versions serve no new sandbox), asked
    on its socket; None when none answers."""
    try:
        return int(nsbox.call(daemon_socket(SandboxConfig().ns_state_dir), {"op": "ping"}, timeout=5)["pid"])
    except (OSError, ValueError, KeyError):
        return None


@dataclass
class Run:
    """A run under test: its controller's pid (replaced after a resume), its folder, its own file system (if any)."""

    controller: int
    run_dir: Path
    disk: Path | None = None  # the mount point of the run's own file system (disk_full needs one)
    nodes: list = field(default_factory=list)  # the run's SSH test nodes (swectl.testing.nodes.TestNode)
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    background: list[threading.Thread] = field(default_factory=list)

    def engine_server(self) -> int:
        servers = _program(self.controller, "swectl.remote.programs.cpu_engine")
        if not servers:
            raise NoTarget("no engine server runs")
        return servers[0]

    def wait_background(self) -> None:
        for thread in self.background:
            thread.join()
        self.background.clear()


def _kill(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError as exc:
        raise NoTarget(f"pid {pid} exited before the fault") from exc


def engine_kill(run: Run) -> str:
    pid = run.engine_server()
    _kill(pid)
    return f"SIGKILL engine server pid {pid}"


def engine_supervisor_kill(run: Run) -> str:
    pid = run.engine_server()
    supervisor = processes().get(pid, (0, "", ""))[0]
    if supervisor <= 1:
        raise NoTarget("the engine server has no supervisor")
    _kill(supervisor)
    return f"SIGKILL engine supervisor pid {supervisor} (server pid {pid})"


def engine_stop(run: Run) -> str:
    pid = run.engine_server()
    _kill(pid, signal.SIGSTOP)

    def resume() -> None:
        time.sleep(STOP_S)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    thread = threading.Thread(target=resume, name="engine_stop resume", daemon=True)
    thread.start()
    run.background.append(thread)
    return f"SIGSTOP engine server pid {pid} for {STOP_S:.0f} s"


def trainer_kill(run: Run) -> str:
    ranks = sorted(pid for pid, cmd in descendants(run.controller).items()
                   if "-m swectl.remote.programs.trainer" in cmd and "torch.distributed.run" not in cmd
                   and not cmd.startswith("sh "))
    if not ranks:
        raise NoTarget("no trainer rank runs")
    pid = run.rng.choice(ranks)
    _kill(pid)
    return f"SIGKILL trainer rank pid {pid}"


def nsbox_kill(run: Run) -> str:
    pid = nsbox_daemon()
    if pid is None:
        raise NoTarget("no nsbox daemon runs")
    _kill(pid)
    return f"SIGKILL nsbox daemon pid {pid}"


def sandbox_kill(run: Run) -> str:
    daemon = nsbox_daemon()
    boxes = sorted(pid for pid, (ppid, state, _) in processes().items() if ppid == daemon and state != "Z")
    if daemon is None or not boxes:
        raise NoTarget("no sandbox runs")
    pid = run.rng.choice(boxes)
    _kill(pid)
    return f"SIGKILL sandbox PID 1 (host pid {pid})"


def disk_full(run: Run) -> str:
    if run.disk is None:
        raise NoTarget("the run has no file system of its own")
    filler = run.disk / "chaos-filler"
    usage = shutil.disk_usage(run.disk)
    size = usage.free - usage.total // 100
    if size <= 0:
        raise NoTarget("the file system is already full")
    subprocess.run(["fallocate", "-l", str(size), str(filler)], check=True)

    def release() -> None:
        time.sleep(DISK_FULL_S)
        filler.unlink(missing_ok=True)

    thread = threading.Thread(target=release, name="disk_full release", daemon=True)
    thread.start()
    run.background.append(thread)
    return f"filled {run.disk} to its last 1% ({size / 2**20:.0f} MiB) for {DISK_FULL_S:.0f} s"


def ssh_net_down(run: Run) -> str:
    if not run.nodes:
        raise NoTarget("the run has no SSH test node")
    node = run.rng.choice(run.nodes)
    node.cut_network()

    def restore() -> None:
        time.sleep(NET_DOWN_S)
        node.restore_network()

    thread = threading.Thread(target=restore, name="ssh_net_down restore", daemon=True)
    thread.start()
    run.background.append(thread)
    return f"network of node {node.name} cut for {NET_DOWN_S:.0f} s"


def controller_kill(run: Run) -> str:
    _kill(run.controller)
    return f"SIGKILL controller pid {run.controller}"


FAULTS: dict[str, Callable[[Run], str]] = {
    "engine_kill": engine_kill, "engine_supervisor_kill": engine_supervisor_kill, "engine_stop": engine_stop,
    "trainer_kill": trainer_kill, "nsbox_kill": nsbox_kill, "sandbox_kill": sandbox_kill, "disk_full": disk_full,
    "controller_kill": controller_kill, "ssh_net_down": ssh_net_down,
}


# ---------------------------------------------------------------------------------------------- what is left


def footprint(exclude: set[int] = frozenset()) -> dict[str, object]:  # type: ignore[assignment]
    """What runs can leave behind on this node, counted from outside (compare before and after)."""
    state_dir = SandboxConfig().ns_state_dir
    table = processes()
    daemon = nsbox_daemon()
    swectl_procs = sorted(f"{pid} {cmd[:120]}" for pid, (_, state, cmd) in table.items()
                          if state != "Z" and pid not in exclude and pid != os.getpid()
                          and any(program in cmd for program in SWECTL_PROGRAMS))
    boxes_dir = Path(state_dir) / "boxes"
    records = sorted(p.name for p in boxes_dir.iterdir()) if boxes_dir.is_dir() else []
    sandboxes = sum(1 for _, (ppid, state, _) in table.items() if daemon and ppid == daemon and state != "Z")
    mounts = [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if state_dir in line]
    shm = sorted(p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("swectl")) \
        if Path("/dev/shm").is_dir() else []
    containers: list[str] = []
    if shutil.which("podman"):
        out = subprocess.run(["podman", "ps", "-aq"], capture_output=True, text=True, check=False)
        containers = sorted(out.stdout.split())
    return {"processes": swectl_procs, "sandboxes": sandboxes, "sandbox_records": records, "mounts": len(mounts),
            "shm": shm, "listening_ports": listening_ports(), "containers": containers}


def listening_ports() -> list[int]:
    """TCP ports listening on this machine (IPv4 and IPv6), from /proc/net."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def leaks(before: dict[str, object], after: dict[str, object]) -> dict[str, object]:
    """What ``after`` holds that ``before`` did not (an empty dict: nothing left behind)."""
    out: dict[str, object] = {}
    for key, now in after.items():
        was = before.get(key)
        if isinstance(now, list):
            new = [x for x in now if x not in (was or [])]
            if new:
                out[key] = new
        elif isinstance(now, int) and isinstance(was, int) and now > was:
            out[key] = now - was
    return out
