"""Escape attempts from inside a sandbox, on every backend: each must fail for the agent.

Each test plays one attempt as the agent would (bash as root in the sandbox) and then checks from the
host that nothing happened. The table in the issue note lists them: host files (read, write), host
processes (see, signal), the network and the host's loopback, device nodes and host disks, remounting and
unmounting, the sandbox's own cgroup limits, kernel modules, and a process outliving its sandbox.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from .conftest import Backend, Sandbox, create_sandbox, make_spec

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

BOUND_S = 30.0


@pytest.fixture
async def box(backend: Backend) -> AsyncIterator[Sandbox]:
    sandbox = await create_sandbox(backend, make_spec(pids_limit=128))
    try:
        yield sandbox
    finally:
        await sandbox.destroy()


async def attempt(box: Sandbox, command: str, seconds: float = 20) -> tuple[int, str]:
    with anyio.fail_after(seconds + BOUND_S):
        result = await box.exec(command, seconds)
    return result.exit_code, result.output


async def test_host_files_cannot_be_read(box: Sandbox, tmp_path: Path) -> None:
    secret = f"swectl-secret-{uuid.uuid4().hex}"
    host_file = Path("/tmp") / f"swectl-escape-{uuid.uuid4().hex}"
    host_file.write_text(secret)
    try:
        code, out = await attempt(box, f"cat {host_file}; cat /proc/1/root{host_file}; cat /proc/self/root{host_file}")
        assert code != 0 and secret not in out
        # nothing of the host's tree is reachable: no podman store, no old root left mounted
        _, out = await attempt(box, "ls -d /var/lib/containers/storage /.swectl-oldroot /work 2>&1; "
                                       f"grep -rl {secret} /tmp /proc/1/root/tmp 2>/dev/null; true")  # fmt: skip
        assert secret not in out and "No such file" in out
        assert "/var/lib/containers/storage\n" not in out
    finally:
        host_file.unlink()


async def test_host_files_cannot_be_written(box: Sandbox) -> None:
    name = f"/tmp/swectl-escape-write-{uuid.uuid4().hex}"
    code, _ = await attempt(box, f"echo pwned > {name} && echo pwned > /proc/1/root{name}.2; ls {name}")
    assert code == 0  # the sandbox's own /tmp takes the write ...
    assert not await anyio.Path(name).exists()  # ... the host's does not
    assert not await anyio.Path(name + ".2").exists()
    code, out = await attempt(box, "echo b > /proc/sysrq-trigger; echo 1 > /proc/sys/vm/drop_caches; "
                                   "echo x > /sys/kernel/uevent_helper")  # fmt: skip
    assert code != 0
    assert ("Read-only file system" in out) or ("Permission denied" in out), out


async def test_host_processes_are_invisible_and_cannot_be_signalled(box: Sandbox) -> None:
    marker = f"{uuid.uuid4().int % 10_000}.{uuid.uuid4().int % 1000:03d}7"
    host = subprocess.Popen(["sleep", marker])  # noqa: ASYNC220 (returns at once)
    try:
        _, out = await attempt(box, f"ps -eo args | grep -c '^sleep {marker}'; kill -9 {host.pid}; echo rc=$?")
        assert out.splitlines()[0] == "0", out  # not in the sandbox's process list
        assert "rc=0" not in out  # the host pid means nothing (or not the sleeper) inside
        assert host.poll() is None  # the host process lives
    finally:
        host.kill()
        host.wait()


async def test_the_network_and_the_hosts_loopback_are_unreachable(box: Sandbox) -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    try:
        _, out = await attempt(
            box, f"timeout 5 bash -c 'exec 3<>/dev/tcp/127.0.0.1/{port}' && echo connected; "
                 "timeout 5 bash -c 'exec 3<>/dev/tcp/10.0.2.2/80' && echo connected; "
                 "timeout 5 bash -c 'exec 3<>/dev/tcp/1.1.1.1/53' && echo connected; true",
        )  # fmt: skip
        assert "connected" not in out, out
    finally:
        await listener.aclose()


async def test_device_nodes_and_host_disks_are_out_of_reach(box: Sandbox) -> None:
    root_dev = os.stat("/").st_dev
    major, minor = os.major(root_dev), os.minor(root_dev)
    _, out = await attempt(
        box, f"mknod /tmp/disk b {major} {minor} && echo made; mknod /tmp/mem c 1 1 && echo made; "
             "mkdir -p /mnt/host; mount /dev/vda /mnt/host && echo mounted; "
             f"mount -t ext4 /tmp/disk /mnt/host && echo mounted; ls /dev",
    )  # fmt: skip
    assert "made" not in out and "mounted" not in out, out
    devices = set(out.split()) & {"vda", "sda", "nvme0n1", "mem", "kmsg", "port"}
    assert not devices, out


async def test_mounts_cannot_be_changed(box: Sandbox) -> None:
    _, out = await attempt(
        box, "mount -t tmpfs none /mnt && echo changed; mount -o remount,rw /sys && echo changed; "
             "umount /proc && echo changed; umount -l /sys && echo changed; "
             "mount --bind / /mnt && echo changed; true",
    )  # fmt: skip
    assert "changed" not in out, out


async def test_own_cgroup_limits_cannot_be_raised(box: Sandbox) -> None:
    _, out = await attempt(
        box, "for f in /sys/fs/cgroup/pids/pids.max /sys/fs/cgroup/pids.max; do "
             "[ -e $f ] && { echo max > $f && echo raised; cat $f; }; done; "
             "mkdir /sys/fs/cgroup/pids/escape && echo made; true",
    )  # fmt: skip
    assert "raised" not in out and "made" not in out, out
    assert "128" in out  # the limit is still the spec's


async def test_kernel_modules_cannot_be_loaded(box: Sandbox) -> None:
    # CAP_SYS_MODULE is out of the bounding set, so no process in the sandbox can ever hold it ...
    code, out = await attempt(box, "grep CapBnd /proc/self/status")
    assert not int(out.split()[1], 16) & (1 << 16), out
    # ... and finit_module(2) checks it before it looks at the (invalid) file descriptor. A kernel built
    # without module support (this machine's) answers ENOSYS to everyone.
    script = (
        "import ctypes, ctypes.util, os; libc = ctypes.CDLL(None, use_errno=True); "
        "nr = {'x86_64': 313, 'aarch64': 273}[os.uname().machine]; "
        "r = libc.syscall(nr, -1, b'', 0); print(r, os.strerror(ctypes.get_errno()))"
    )
    code, out = await attempt(box, f'python3 -c "{script}"')
    assert code == 0, out
    assert out.startswith("-1 ") and ("Operation not permitted" in out or "Function not implemented" in out), out


async def test_no_process_outlives_its_sandbox(backend: Backend) -> None:
    box = await create_sandbox(backend, make_spec())
    marker = f"{uuid.uuid4().int % 100_000}.{uuid.uuid4().int % 1000:03d}3"
    try:
        # setsid leaves the command's process group (the agent's kill) and nohup ignores SIGHUP
        code, _ = await attempt(box, f"setsid nohup sleep {marker} >/dev/null 2>&1 < /dev/null & sleep 0.2; true")
        assert code == 0
        assert _host_processes_with(f"sleep {marker}"), "the escapee did not start"
    finally:
        await box.destroy()
    with anyio.fail_after(10):
        while _host_processes_with(f"sleep {marker}"):  # noqa: ASYNC110 (a process on the host)
            await anyio.sleep(0.1)


def _host_processes_with(args: str) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,stat=,args="], capture_output=True, text=True, check=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if line.split(None, 2)[2:] == [args]
            and not line.split()[1].startswith("Z")]  # fmt: skip


async def test_the_agents_channel_and_memory_are_out_of_reach(box: Sandbox) -> None:
    """Commands run as the agent's user; the agent is not dumpable, so its /proc files need CAP_SYS_PTRACE:
    a command cannot write forged replies into the controller's channel or read the agent's binary."""
    _, out = await attempt(
        box, "agent=$PPID; "
             "printf 'XXXX' >> /proc/$agent/fd/1 && echo wrote; head -c 4 /proc/$agent/exe >/dev/null && echo read; "
             "cat /proc/$agent/environ >/dev/null && echo environ; true",
    )  # fmt: skip
    for leak in ("wrote", "read", "environ"):
        assert leak not in out.split(), out
    assert (await box.exec("echo still fine", 10)).output == "still fine\n"  # no forged bytes in the channel
