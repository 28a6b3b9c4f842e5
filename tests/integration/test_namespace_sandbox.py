"""What only the namespace backend has to prove: it leaks nothing (mounts, processes, cgroups, records, the
daemon's file descriptors) over many sandboxes, sandboxes end with their controller, limits are enforced
(not only visible), a full scratch layer fails the command and not the node, bad images get clear errors,
and the EnvPool runs on it unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from swectl.config import SandboxConfig, load_config
from swectl.errors import InfraError
from swectl.remote.nodes.namespace_sandbox import NamespaceBackend, daemon_socket
from swectl.remote.nodes.node import LocalNode
from swectl.remote.programs import nsbox

from .conftest import SESSION_ID, TEST_LABEL, create_sandbox, make_spec, new_backend
from .pools import running_pool

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

STATE_DIR = Path(SandboxConfig().ns_state_dir)


def daemon_pid() -> int:
    return nsbox.call(daemon_socket(str(STATE_DIR)), {"op": "ping"})["pid"]


def node_footprint() -> dict[str, object]:
    """What sandboxes could leave behind on this node, counted from outside."""
    pid = daemon_pid()
    cgroups = {}
    for controller, (_version, root) in nsbox.cgroup_mounts().items():
        group = Path(root) / nsbox.CGROUP_GROUP
        cgroups[controller] = sorted(p.name for p in group.iterdir() if p.is_dir()) if group.is_dir() else []
    children = subprocess.run(["ps", "--ppid", str(pid), "-o", "pid="], capture_output=True, text=True).stdout.split()
    return {
        "daemon_fds": len(os.listdir(f"/proc/{pid}/fd")),
        "daemon_children": len(children),
        "records": sorted(os.listdir(STATE_DIR / "boxes")),
        "cgroups": cgroups,
        # a sandbox's mounts live in its own mount namespace; one that leaked would show up here, under the
        # state dir (not all host mounts: Podman containers of other tests come and go)
        "host_mounts": [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
                        if str(STATE_DIR) in line],
    }


async def test_many_sandboxes_leave_nothing_behind() -> None:
    backend = await new_backend(kind="namespace")
    before = node_footprint()
    rounds, width = 125, 8  # 1000 sandboxes, 8 alive at a time
    with anyio.fail_after(300):
        for _ in range(rounds):
            boxes: list = []

            async def one(boxes: list = boxes) -> None:
                box = await backend.create(make_spec(pids_limit=64))
                boxes.append(box)
                result = await box.exec("echo x > /tmp/f; sleep 60 & echo started", 10)
                assert result.output == "started\n", result

            async with anyio.create_task_group() as tg:
                for _ in range(width):
                    tg.start_soon(one)
            async with anyio.create_task_group() as tg:
                for box in boxes:
                    tg.start_soon(box.destroy)
    assert node_footprint() == before


async def test_sandboxes_end_with_their_controller(tmp_path: Path) -> None:
    """A controller killed with SIGKILL: its sandboxes' channels close, the agents exit, the daemon cleans up."""
    label = f"dead-controller-{SESSION_ID}"
    script = textwrap.dedent(f"""
        import anyio
        from swectl.config import SandboxConfig
        from swectl.remote.nodes.namespace_sandbox import NamespaceBackend, daemon_socket
        from swectl.remote.nodes.node import LocalNode
        from swectl.schema import SandboxSpec

        async def main():
            backend = NamespaceBackend(LocalNode(), SandboxConfig())
            await backend.prepare()
            boxes = []  # held: a sandbox whose channel is garbage-collected ends
            for _ in range(3):
                boxes.append(box := await backend.create(SandboxSpec(image={SandboxConfig().image!r},
                                                       labels={{{TEST_LABEL!r}: {SESSION_ID!r}, "why": {label!r}}})))
                await box.exec("setsid nohup sleep 1000 >/dev/null 2>&1 < /dev/null &", 10)
            print("ready", flush=True)
            await anyio.sleep(600)

        anyio.run(main)
    """)
    controller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)  # noqa: ASYNC220
    backend = await new_backend(kind="namespace")
    try:
        with anyio.fail_after(60):
            assert (await anyio.to_thread.run_sync(controller.stdout.readline)).strip() == "ready"
        assert len(await backend.list({"why": label})) == 3
    finally:
        controller.send_signal(signal.SIGKILL)
        controller.wait()
    with anyio.fail_after(10):
        while await backend.list({"why": label}):  # noqa: ASYNC110 (state on the node)
            await anyio.sleep(0.1)


async def test_memory_limit_is_enforced_and_the_sandbox_survives() -> None:
    backend = await new_backend(kind="namespace")
    box = await create_sandbox(backend, make_spec(memory="128m"))
    try:
        hog = await box.exec("python3 -c 'x = bytearray(400 * 1024 * 1024); print(len(x))'", 60)
        assert hog.exit_code != 0 and "419430400" not in hog.output, hog
        assert (await box.exec("echo alive", 10)).output == "alive\n"
    finally:
        await box.destroy()


async def test_cpu_limit_is_enforced() -> None:
    backend = await new_backend(kind="namespace")
    box = await create_sandbox(backend, make_spec(cpus=0.25))
    try:
        # a busy loop for 2 s of wall time gets about a quarter of a core
        spin = "import time, os; end = time.time() + 2\nwhile time.time() < end: pass\nprint(os.times().user)"
        result = await box.exec(f"python3 -c '{spin}'", 30)
        assert result.exit_code == 0, result
        assert float(result.output) < 1.0, result.output
    finally:
        await box.destroy()


async def test_a_full_scratch_layer_fails_the_command_not_the_node() -> None:
    config = SandboxConfig(ns_scratch="tmpfs", ns_scratch_size="16m")
    backend = await new_backend(config, kind="namespace")
    box = await create_sandbox(backend, make_spec())
    other = await create_sandbox(backend, make_spec())
    try:
        full = await box.exec("head -c 64M /dev/zero > /tmp/big; echo rc=$?", 30)
        assert "No space left on device" in full.output and "rc=1" in full.output, full
        assert (await box.exec("rm /tmp/big; echo fine > /tmp/small; cat /tmp/small", 10)).output == "fine\n"
        assert (await other.exec("echo other", 10)).output == "other\n"
    finally:
        await box.destroy()
        await other.destroy()


async def test_missing_and_removed_images_get_clear_errors() -> None:
    backend = await new_backend(kind="namespace")
    with pytest.raises(InfraError, match="namespace backend takes images from the node's Podman store"):
        with anyio.fail_after(60):
            await backend.create(make_spec(f"localhost/swectl-missing-{SESSION_ID}:x"))
    # an image whose layers vanished after it was looked up (removed or rebuilt): a clear error, and the
    # next create looks the image up again
    spec = make_spec()
    await (await create_sandbox(backend, spec)).destroy()
    real = backend._roots[spec.image]
    backend._roots[spec.image] = type(real)(image_id=real.image_id, layers=["/nonexistent/diff"], env=real.env)
    with pytest.raises(InfraError, match="is gone"), anyio.fail_after(60):
        await backend.create(spec)
    await (await create_sandbox(backend, spec)).destroy()


async def test_a_node_without_support_is_told_why() -> None:
    backend = NamespaceBackend(LocalNode(), SandboxConfig())
    report = await backend.check()
    assert report["ok"], report
    assert set(report["limits"]) == {"memory", "pids", "cpu"}
    # the same check as an unprivileged user: refused with the reason
    out = subprocess.run(  # noqa: ASYNC221 (a quick local check)
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-S", "-I", "-c",
         nsbox.BOOTSTRAP, "check"],
        input=b"%d\n" % len(src := nsbox_source()) + src, capture_output=True, check=True,
    )  # fmt: skip
    report = json.loads(out.stdout)
    assert not report["ok"] and "not root" in report["problems"][0]


def nsbox_source() -> bytes:
    return Path(nsbox.__file__).read_bytes()


def test_concurrent_ensures_share_one_daemon(tmp_path: Path) -> None:
    """Two controllers (or two nodes on one host) starting the daemon at once: every `ensure` succeeds, they
    all get the same daemon, and exactly one of them started it (unserialized, one could fail binding)."""
    from swectl.remote.nodes.agent_client import agent_source

    state_dir = tmp_path / "ns"
    stdin = b"".join(b"%d\n" % len(blob) + blob for blob in (nsbox_source(), agent_source()))
    argv = [sys.executable, "-S", "-I", "-c", nsbox.BOOTSTRAP, "ensure", str(state_dir)]
    procs = [subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(8)]  # fmt: skip
    try:
        for proc in procs:  # all of them get their input (and start) before any is waited on
            proc.stdin.write(stdin)
            proc.stdin.close()
            proc.stdin = None  # (communicate would flush it)
        done = [proc.communicate(timeout=60) for proc in procs]
        assert [proc.returncode for proc in procs] == [0] * len(procs), [err.decode() for _out, err in done]
        replies = [json.loads(out) for out, _err in done]
        assert len({reply["socket"] for reply in replies}) == 1, replies
        assert len({reply["pid"] for reply in replies}) == 1, replies
        assert sum(reply["started"] for reply in replies) == 1, replies
    finally:
        for proc in procs:
            proc.kill()
        socket = daemon_socket(str(state_dir))
        if os.path.exists(socket):
            nsbox.call(socket, {"op": "retire"})


async def test_env_pool_runs_on_the_namespace_backend() -> None:
    run_id = f"ns-pool-{SESSION_ID}"
    config = load_config(None, ["sandbox.backend=namespace", "env_pool.warm=2"])
    async with running_pool(config, run_id) as pool:
        with anyio.fail_after(60):
            lease = await pool.acquire()
            result = await lease.exec("echo $((6 * 7))", 10)
            assert result.output == "42\n"
            await pool.wait_warm(2)
            await pool.release(lease)
        backend = await new_backend(kind="namespace")
        assert len(await backend.list({"swectl.run": run_id})) >= 2
    assert await backend.list({"swectl.run": run_id}) == []


# ------------------------------------------------------------------------------ rootfs tarballs (no Podman)


@pytest.fixture(scope="module")
def base_rootfs_tar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The base image as a rootfs tarball, the way a user makes one for a node without Podman."""
    from .conftest import BASE_IMAGE, podman

    out = tmp_path_factory.mktemp("rootfs") / "base.tar"
    created = podman("create", BASE_IMAGE, "true")
    assert created.returncode == 0, created.stderr
    cid = created.stdout.decode().strip()
    try:
        exported = podman("export", "-o", str(out), cid, timeout=300)
        assert exported.returncode == 0, exported.stderr
    finally:
        podman("rm", "-f", cid)
    yield out
    import hashlib
    import shutil

    unpacked = STATE_DIR / "rootfs" / hashlib.sha256(out.read_bytes()).hexdigest()
    shutil.rmtree(unpacked, ignore_errors=True)  # the node's rootfs cache keeps what it unpacked


async def test_a_rootfs_tarball_runs_without_the_podman_store(base_rootfs_tar: Path) -> None:
    image = f"rootfs-test-{SESSION_ID}"
    backend = await new_backend(SandboxConfig(ns_rootfs={image: str(base_rootfs_tar)}), kind="namespace")
    box = await create_sandbox(backend, make_spec(image, workdir="/srv"))
    try:
        result = await box.exec("python3 -c 'print(6 * 7)'; git --version | cut -d' ' -f1; pwd; echo $PATH", 30)
        assert result.output.splitlines()[:3] == ["42", "git", "/srv"], result
        assert "/usr/bin" in result.output
    finally:
        await box.destroy()
    assert backend._roots[image].image_id.startswith("sha256:")


def _tar(path: Path, members: list[tuple[str, str, str]]) -> Path:
    """A small tarball: (name, kind, payload) with kind file | dir | symlink | chr | hardlink."""
    import io
    import tarfile

    with tarfile.open(path, "w") as tar:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            data = None
            if kind == "file":
                data = payload.encode()
                info.size = len(data)
            elif kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, payload
            elif kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, payload
            elif kind == "chr":
                info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 1
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


@pytest.mark.parametrize(
    ("members", "named"),
    [
        pytest.param([("bin", "dir", ""), ("/etc/swectl-pwned", "file", "x")], "/etc/swectl-pwned", id="absolute"),
        pytest.param(
            [("bin", "dir", ""), ("bin/../../swectl-pwned", "file", "x")], "bin/../../swectl-pwned", id="dotdot"
        ),
        pytest.param([("bin", "dir", ""), ("bin/mem", "chr", "")], "bin/mem", id="device"),
        pytest.param(
            [("etc", "symlink", "/tmp"), ("etc/swectl-pwned", "file", "x")], "etc/swectl-pwned",
            id="through-a-symlink",
        ),
        pytest.param([("shadow", "hardlink", "/etc/shadow")], "shadow", id="hardlink-out"),
    ],
)
async def test_unsafe_rootfs_tarballs_are_refused_by_name(
    tmp_path: Path, members: list[tuple[str, str, str]], named: str
) -> None:
    image = f"unsafe-{uuid4_hex()}"
    tarball = _tar(tmp_path / "bad.tar", members)
    backend = await new_backend(SandboxConfig(ns_rootfs={image: str(tarball)}), kind="namespace")
    with pytest.raises(InfraError) as caught, anyio.fail_after(60):
        await backend.create(make_spec(image))
    assert repr(named) in str(caught.value), caught.value
    assert not await anyio.Path("/tmp/swectl-pwned").exists()
    assert not await anyio.Path("/etc/swectl-pwned").exists()
    assert not [p for p in (STATE_DIR / "rootfs").iterdir() if ".tmp-" in p.name]


async def test_a_truncated_rootfs_tarball_is_refused(base_rootfs_tar: Path, tmp_path: Path) -> None:
    image = f"truncated-{uuid4_hex()}"
    cut = tmp_path / "cut.tar"
    with base_rootfs_tar.open("rb") as f:
        cut.write_bytes(f.read(3_000_000))
    backend = await new_backend(SandboxConfig(ns_rootfs={image: str(cut)}), kind="namespace")
    with pytest.raises(InfraError, match="not a complete tar archive"), anyio.fail_after(60):
        await backend.create(make_spec(image))
    assert not [p for p in (STATE_DIR / "rootfs").iterdir() if ".tmp-" in p.name]


def uuid4_hex() -> str:
    import uuid

    return uuid.uuid4().hex[:12]


async def test_a_sandbox_has_its_own_identity_mapped_user_namespace() -> None:
    """Entered last: files and users keep their ids, root inside is uid 0, and ordinary work needs nothing
    more (chown, a server on port 80); but the sandbox's capabilities reach nothing outside that namespace."""
    backend = await new_backend(kind="namespace")
    box = await create_sandbox(backend, make_spec())
    try:
        script = (
            "readlink /proc/self/ns/user; cat /proc/self/uid_map | tr -s ' '; id -u; "
            "touch /tmp/f && chown 1000:1000 /tmp/f && stat -c %u:%g /tmp/f; "
            "python3 -c 'import socket; s = socket.socket(); s.bind((\"127.0.0.1\", 80)); print(\"bound\")'; "
            "grep CapEff /proc/self/status"
        )
        result = await box.exec(script, 30)
        lines = result.output.splitlines()
        assert lines[0] != os.readlink("/proc/self/ns/user"), result.output
        assert lines[1].split() == ["0", "0", "4294967295"], result.output
        assert lines[2:5] == ["0", "1000:1000", "bound"], result.output
    finally:
        await box.destroy()


async def test_a_killed_daemon_is_started_again_and_leaves_nothing_behind() -> None:
    """Issue 62: kill -9 of the nsbox daemon. The next sandbox starts the daemon again (one line in the log, no
    failed episode for it); the new daemon reclaims the sandbox the dead one left (its commands fail as an
    infrastructure error, never as the command's result), and nothing of it stays on the node."""
    backend = await new_backend(kind="namespace")
    before = {k: v for k, v in node_footprint().items() if k != "daemon_fds"}
    with anyio.fail_after(120):
        orphan = await backend.create(make_spec())
        assert (await orphan.exec("echo alive", 10)).output == "alive\n"
        killed = daemon_pid()
        os.kill(killed, signal.SIGKILL)
        revivals = backend.revivals
        fresh = await backend.create(make_spec())
        assert backend.revivals == revivals + 1 and daemon_pid() != killed
        assert (await fresh.exec("echo new", 10)).output == "new\n"
        for _ in range(20):  # reclaimed at the new daemon's start, or at its second look (LATE_RECLAIM_S)
            try:
                await orphan.exec("echo still here", 10)
            except InfraError:
                break
            await anyio.sleep(0.5)
        else:
            pytest.fail("the dead daemon's sandbox was never reclaimed")
        await orphan.destroy()
        await fresh.destroy()
    assert {k: v for k, v in node_footprint().items() if k != "daemon_fds"} == before


async def test_scratch_left_half_removed_is_removed_again() -> None:
    """The chaos test's leak: a killed daemon's `rm -rf` of a sandbox's scratch races with the new daemon's
    reclaim, and both can stop short, leaving ``ns-ID.removing`` with no record. The live daemon removes such
    folders again within ``TRASH_SWEEP_S``; one that still has its record (a cleanup under way) stays."""
    backend = await new_backend(kind="namespace")
    with anyio.fail_after(120):
        box = await backend.create(make_spec())  # the daemon runs
        await box.destroy()
        boxes = STATE_DIR / "boxes"
        left, kept = boxes / f"ns-{uuid4_hex()}.removing", boxes / f"ns-{uuid4_hex()}.removing"
        for folder in (left, kept):
            (folder / "upper" / "src").mkdir(parents=True)
            (folder / "upper" / "src" / "big.bin").write_bytes(b"x" * 4096)
        record = kept.with_name(kept.name.removesuffix(".removing") + ".json")
        record.write_text(json.dumps({"daemon": [daemon_pid(), nsbox._starttime(daemon_pid())]}))
        try:
            for _ in range(int(3 * nsbox.TRASH_SWEEP_S)):
                if not left.exists():
                    break
                await anyio.sleep(1)
            assert not left.exists(), "a half-removed scratch folder was never removed again"
            assert (kept / "upper" / "src" / "big.bin").exists()
        finally:
            record.unlink(missing_ok=True)
            for folder in (left, kept):
                shutil.rmtree(folder, ignore_errors=True)
