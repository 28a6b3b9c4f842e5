"""The sandbox contract (swectl/sandbox.py), checked against every backend: real podman containers, real
namespace sandboxes and real docker containers on a private dockerd (the ``backend_kind`` parameter of the
``backend`` fixture).

``podman-api`` is Podman with ``sandbox.podman_api``: the same containers, made and removed through the node's
Podman API service (``test_api_makes_the_container_the_cli_makes`` compares them with ``podman inspect``).

On Podman and Docker most tests run twice through the ``image`` parameter: ``agent`` (the base image;
commands go through the in-sandbox exec agent) and ``plain`` (an image without python3; one ``podman exec``
or ``docker exec`` per command). A namespace sandbox always has its agent, so it runs the ``agent`` variant
only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from typing import Any

import anyio
import anyio.abc
import pytest

from swectl.config import SandboxConfig
from swectl.errors import CommandError, InfraError, SandboxLostError
from swectl.remote.nodes.namespace_sandbox import NamespaceSandbox
from swectl.sandbox import ELISION
from swectl.schema import ExecResult, Mount

from .conftest import (
    CPU_QUOTA,
    SESSION_ID,
    SPEC_ENV,
    SPEC_WORKDIR,
    STARTED_MARK,
    TEST_LABEL,
    Backend,
    Sandbox,
    apodman,
    backend_object,
    create_sandbox,
    engine_cli,
    kill_from_outside,
    make_spec,
    new_backend,
    wait_for_file,
)

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

# Every wait in these tests is bounded: a hung sandbox fails the test instead of hanging the run.
BOUND_S = 30.0

# Bugs found in library code; the tests they break are strict xfails on the affected exec path.


def images(plain_bug: str | None = None) -> pytest.MarkDecorator:
    """Run a test on both exec paths; ``plain_bug`` marks the no-python path as a known library bug."""
    plain = (
        "plain" if plain_bug is None else pytest.param("plain", marks=pytest.mark.xfail(strict=True, reason=plain_bug))
    )
    return pytest.mark.parametrize("image", ["agent", plain], indirect=True)


async def run(box: Sandbox, command: str, seconds: float = 20, **kwargs: object) -> ExecResult:
    """``box.exec(command, seconds)``, failing the test if the call itself does not return in time."""
    with anyio.fail_after(seconds + BOUND_S):
        return await box.exec(command, seconds, **kwargs)  # type: ignore[arg-type]


async def ok(box: Sandbox, command: str, seconds: float = 20, **kwargs: object) -> str:
    """Run a helper command that must succeed; return its output."""
    result = await run(box, command, seconds, **kwargs)
    assert result.exit_code == 0, (command, result)
    assert not result.timed_out, (command, result)
    return result.output


async def processes(box: Sandbox) -> list[str]:
    """Command lines of the processes alive in the sandbox (zombies excluded)."""
    out = await ok(box, "ps -e -o stat= -o args=")
    rows = [line.strip().split(None, 1) for line in out.splitlines() if line.strip()]
    return [row[1] if len(row) > 1 else "" for row in rows if not row[0].startswith("Z")]


# ---------------------------------------------------------------------------------------------- exec


async def test_exec_merges_stdout_and_stderr_and_returns_exit_code(sandbox: Sandbox) -> None:
    result = await run(sandbox, "echo out; echo err >&2; echo out2; exit 3")
    assert result.output == "out\nerr\nout2\n"
    assert result.exit_code == 3
    assert not result.timed_out
    assert result.elided_bytes == 0

    assert (await run(sandbox, "true")).exit_code == 0
    assert (await run(sandbox, "false")).exit_code == 1
    killed = await run(sandbox, "echo before; kill -TERM $$; echo after")
    assert (killed.output, killed.exit_code, killed.timed_out) == ("before\n", 128 + 15, False)
    with anyio.fail_after(BOUND_S):
        await sandbox.ping()


async def test_exec_runs_bash(sandbox: Sandbox) -> None:
    """Sandbox.exec documents "Run ``command`` with bash": bash syntax must work on both paths."""
    result = await run(sandbox, 'if [[ -n "$BASH_VERSION" ]]; then echo bash; fi; arr=(a b); echo ${arr[1]}')
    assert (result.output, result.exit_code) == ("bash\nb\n", 0)


async def test_cwd_and_env_are_honored(sandbox: Sandbox) -> None:
    assert await ok(sandbox, "pwd", cwd="/tmp") == "/tmp\n"
    assert await ok(sandbox, "pwd", cwd="/usr/share") == "/usr/share\n"

    tricky = "two words; $(touch /tmp/pwned) 'quoted' \"dq\" \\ *"
    env = {"FOO": "bar baz", "TRICKY": tricky}
    out = await ok(sandbox, 'printf "%s|%s|%s" "$FOO" "$TRICKY" "$SWECTL_SPEC_VAR"', env=env)
    assert out == f"bar baz|{tricky}|{SPEC_ENV['SWECTL_SPEC_VAR']}"
    assert await ok(sandbox, "test -e /tmp/pwned && echo injected || echo clean") == "clean\n"
    # The environment of one call does not leak into the next.
    assert await ok(sandbox, 'printf "%s" "${FOO-unset}"') == "unset"


async def test_spec_workdir_is_the_default_cwd(sandbox: Sandbox) -> None:
    assert await ok(sandbox, "pwd") == f"{SPEC_WORKDIR}\n"
    await ok(sandbox, "touch here.txt")
    assert await ok(sandbox, f"ls {SPEC_WORKDIR}") == "here.txt\n"


@pytest.mark.parametrize("command", ["sleep 60", "sleep 60 & (sleep 60; true) & wait"], ids=["single", "with-children"])
async def test_timeout_kills_the_command_inside_the_sandbox(sandbox: Sandbox, command: str) -> None:
    started = anyio.current_time()
    with anyio.fail_after(1 + 8):
        result = await sandbox.exec(f"echo started; {command}", 1)
    assert result.timed_out
    assert result.exit_code != 0
    assert result.output == "started\n"
    assert anyio.current_time() - started >= 1

    assert "sleep 60" not in await processes(sandbox)
    # The same sandbox keeps working, and no output of the killed command bleeds into the next one.
    assert await ok(sandbox, "echo alive") == "alive\n"


async def test_endless_output_returns_promptly_truncated(sandbox: Sandbox) -> None:
    head = tail = SandboxConfig().output_head_bytes
    with anyio.fail_after(1 + 8):
        result = await sandbox.exec("yes", 1)
    assert result.timed_out
    assert result.elided_bytes > 0
    marker = ELISION.format(n=result.elided_bytes)
    assert result.output.startswith("y\n" * (head // 2) + marker)
    rest = result.output[len("y\n" * (head // 2) + marker) :]
    assert len(rest) == tail
    assert set(rest) <= {"y", "\n"}
    assert "yes" not in await processes(sandbox)
    assert await ok(sandbox, "echo alive") == "alive\n"


async def test_huge_output_is_cut_to_head_and_tail(sandbox: Sandbox) -> None:
    config = SandboxConfig()
    head, tail = config.output_head_bytes, config.output_tail_bytes
    size = 50_000_000
    result = await run(sandbox, f"printf HEAD; head -c {size} /dev/zero | tr '\\0' a; printf TAIL", 60)
    assert result.exit_code == 0
    assert not result.timed_out
    total = size + 8
    assert result.elided_bytes == total - head - tail
    expected = "HEAD" + "a" * (head - 4) + ELISION.format(n=total - head - tail) + "a" * (tail - 4) + "TAIL"
    assert result.output == expected


@pytest.fixture
async def small_output_sandbox(image: str, backend_kind: str):  # type: ignore[no-untyped-def]
    backend = await new_backend(SandboxConfig(output_head_bytes=100, output_tail_bytes=40), backend_kind)
    box = await create_sandbox(backend, make_spec(image))
    try:
        yield box
    finally:
        await box.destroy()


async def test_output_limits_follow_the_config(small_output_sandbox: Sandbox) -> None:
    data = "".join(f"{i}\n" for i in range(1, 20_001))
    result = await run(small_output_sandbox, "seq 1 20000")
    elided = len(data) - 140
    assert result.elided_bytes == elided
    assert result.output == data[:100] + ELISION.format(n=elided) + data[-40:]
    # Output that fits is returned whole, without a marker.
    fits = await run(small_output_sandbox, "seq 1 30")
    assert (fits.output, fits.elided_bytes) == ("".join(f"{i}\n" for i in range(1, 31)), 0)


async def test_non_utf8_output_is_decoded_with_replacement(sandbox: Sandbox) -> None:
    result = await run(sandbox, r"printf 'ok\377\376\200end\n'")
    assert result.output == "ok\ufffd\ufffd\ufffdend\n"
    noise = await run(sandbox, "head -c 200000 /dev/urandom")
    assert noise.exit_code == 0
    assert noise.elided_bytes == 200_000 - 20_000
    assert ELISION.format(n=noise.elided_bytes) in noise.output


# --------------------------------------------------------------------------------------------- files


async def test_write_and_read_a_20mb_file(sandbox: Sandbox) -> None:
    """20 MiB is ten times ARG_MAX: this only works if file data never travels in argv."""
    data = os.urandom(20 * 1024 * 1024)
    with anyio.fail_after(60):
        await sandbox.write_file("/tmp/big.bin", data)
    assert await ok(sandbox, "sha256sum < /tmp/big.bin") == f"{hashlib.sha256(data).hexdigest()}  -\n"
    with anyio.fail_after(60):
        assert await sandbox.read_file("/tmp/big.bin") == data


async def test_write_file_creates_directories_and_applies_mode(sandbox: Sandbox) -> None:
    path = f"{SPEC_WORKDIR}/new/nested/dir/script.sh"
    with anyio.fail_after(BOUND_S):
        await sandbox.write_file(path, b"#!/bin/sh\necho hi from script\n", mode=0o755)
        assert await sandbox.read_file(path) == b"#!/bin/sh\necho hi from script\n"
    assert await ok(sandbox, f"stat -c %a {path}") == "755\n"
    assert await ok(sandbox, "./new/nested/dir/script.sh") == "hi from script\n"

    with anyio.fail_after(BOUND_S):
        await sandbox.write_file("/tmp/secret", b"s3cret", mode=0o600)
        # Overwriting with shorter data truncates; without a mode the existing mode stays.
        await sandbox.write_file(path, b"#!/bin/sh\n")
        assert await sandbox.read_file(path) == b"#!/bin/sh\n"
        await sandbox.write_file("/tmp/empty", b"")
        assert await sandbox.read_file("/tmp/empty") == b""
    assert await ok(sandbox, f"stat -c %a /tmp/secret {path}") == "600\n755\n"
    assert await ok(sandbox, "stat -c %s /tmp/empty") == "0\n"


async def test_write_file_mode_zero_is_applied(sandbox: Sandbox) -> None:
    with anyio.fail_after(BOUND_S):
        await sandbox.write_file("/tmp/locked", b"x", mode=0)
    assert await ok(sandbox, "stat -c %a /tmp/locked") == "0\n"


async def test_file_paths_are_not_interpreted_by_a_shell(sandbox: Sandbox) -> None:
    path = "/tmp/we ird $(touch pwned-1)/it's; a `touch pwned-2` *.txt"
    with anyio.fail_after(BOUND_S):
        await sandbox.write_file(path, b"payload")
        assert await sandbox.read_file(path) == b"payload"
    assert await ok(sandbox, f"cat {shlex.quote(path)}") == "payload"
    assert await ok(sandbox, "find / -xdev -name 'pwned-*' | wc -l") == "0\n"


# ---------------------------------------------------------------------------------------------- diff

REPO_SETUP = """set -e
git init -q .
printf 'line1\\nline2\\n' > keep.txt
printf 'to be modified\\n' > mod.txt
printf 'to be deleted\\n' > del.txt
printf '#!/bin/sh\\necho run\\n' > run.sh
mkdir sub && printf 'nested\\n' > sub/nested.txt
git add -A
git -c user.name=Test -c user.email=test@example.com commit -q -m initial
git clone -q . /tmp/clone
"""

REPO_CHANGES = """set -e
printf 'modified line\\n' >> mod.txt
rm del.txt
printf 'brand new\\n' > untracked.txt
mkdir -p 'new dir/deeper' && printf 'spaced\\n' > 'new dir/deeper/with space.txt'
chmod +x run.sh
"""

REPO_STATE = "git status --porcelain --untracked-files=all; echo '-- staged:'; git diff --cached --name-only"

# The tree of a worktree (content, names and modes), computed with a throwaway index.
TREE = "export GIT_INDEX_FILE=$(mktemp -u) && git add -A && git write-tree && rm -f $GIT_INDEX_FILE"


async def test_diff_captures_all_changes_and_applies_to_a_fresh_clone(sandbox: Sandbox) -> None:
    await ok(sandbox, REPO_SETUP)  # a repository in the workdir, and a clone of its first commit
    with anyio.fail_after(60):
        assert await sandbox.diff() == b""  # a clean repository has no changes

    await ok(sandbox, REPO_CHANGES)
    blob = bytes(range(256)) * 8 + os.urandom(4096) + b"\0\0\xff"
    with anyio.fail_after(BOUND_S):
        await sandbox.write_file(f"{SPEC_WORKDIR}/data/blob.bin", blob)
    state_before = await ok(sandbox, REPO_STATE)
    assert "?? untracked.txt\n" in state_before
    assert state_before.endswith("-- staged:\n")

    with anyio.fail_after(60):
        patch = await sandbox.diff()

    for expected in (
        b"diff --git a/mod.txt b/mod.txt",
        b"+modified line",
        b"diff --git a/del.txt b/del.txt\ndeleted file mode 100644",
        b"diff --git a/untracked.txt b/untracked.txt\nnew file mode 100644",
        b"new dir/deeper/with space.txt",
        b"diff --git a/data/blob.bin b/data/blob.bin\nnew file mode 100644",
        b"GIT binary patch",
        b"diff --git a/run.sh b/run.sh\nold mode 100644\nnew mode 100755",
    ):
        assert expected in patch, expected
    assert b"keep.txt" not in patch
    assert b"nested.txt" not in patch

    # The repository's own index and worktree are untouched.
    assert await ok(sandbox, REPO_STATE) == state_before

    # The patch applies cleanly to the clone of the original commit and reproduces the changed tree.
    with anyio.fail_after(BOUND_S):
        await sandbox.write_file("/tmp/changes.patch", patch)
    compare = (
        "set -e; cd /tmp/clone; git apply --check /tmp/changes.patch; git apply /tmp/changes.patch; "
        f"diff -r -x .git {SPEC_WORKDIR} /tmp/clone && echo same; ({TREE}); (cd {SPEC_WORKDIR} && {TREE})"
    )
    same, tree_clone, tree_repo = (await ok(sandbox, compare)).split()
    assert same == "same"
    assert tree_clone == tree_repo


# ----------------------------------------------------------------------------------------- lifecycle


async def test_destroy_is_idempotent_and_removes_the_container(backend: Backend, sandbox: Sandbox) -> None:
    engine = engine_cli(backend)  # podman or docker itself; None for namespace sandboxes
    with anyio.fail_after(BOUND_S):
        assert sandbox.id in [info.id for info in await backend.list({TEST_LABEL: SESSION_ID})]
    if engine is not None:
        assert (await engine("ps", "-a", "-q", "--filter", f"id={sandbox.id}")).stdout.strip()
    with anyio.fail_after(BOUND_S):
        await sandbox.destroy()
        await sandbox.destroy()
    if engine is not None:
        assert (await engine("ps", "-a", "-q", "--filter", f"id={sandbox.id}")).stdout.strip() == b""
    with anyio.fail_after(BOUND_S):
        assert sandbox.id not in [info.id for info in await backend.list({TEST_LABEL: SESSION_ID})]
        with pytest.raises(SandboxLostError):
            await sandbox.exec("echo hi", 5)


async def test_labels_from_the_spec_are_on_the_container(backend: Backend) -> None:
    run_label = f"contract-{SESSION_ID}"
    with anyio.fail_after(BOUND_S):
        box = await backend.create(make_spec(labels={"swectl.run": run_label, "team": "contract"}))
    try:
        with anyio.fail_after(BOUND_S):
            listed = await backend.list({"swectl.run": run_label})
            assert await backend.list({"swectl.run": run_label + "-other"}) == []
        assert [info.id for info in listed] == [box.id]
        info = listed[0]
        expected = {"swectl.run": run_label, "team": "contract", TEST_LABEL: SESSION_ID}
        assert info.labels.items() >= expected.items()
        assert info.name == box.name
        assert info.state == "running"
    finally:
        await box.destroy()


async def test_backend_prepare_probe_and_close(backend_kind: str) -> None:
    backend = backend_object(backend_kind)
    assert not backend.prepared
    assert backend.alive
    with anyio.fail_after(BOUND_S):
        await backend.prepare()
        assert backend.prepared
        assert (await backend.probe()).strip()
        await backend.aclose()
        await backend.aclose()


@pytest.mark.parametrize("image", ["agent"], indirect=True)  # the plain path holds no channel to break
async def test_break_transport_wakes_a_blocked_call(sandbox: Sandbox) -> None:
    outcome: ExecResult | Exception
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:

            async def blocked() -> None:
                nonlocal outcome
                try:
                    outcome = await sandbox.exec(f"touch {STARTED_MARK}; sleep 30", 60)
                except InfraError as exc:
                    outcome = exc

            tg.start_soon(blocked)
            await wait_for_file(sandbox)  # the command runs: the call is blocked on the transport
            await sandbox.break_transport()
            await sandbox.break_transport()
    assert isinstance(outcome, InfraError), outcome


# ---------------------------------------------------------------------------------- isolation, limits


async def test_no_network_by_default(sandbox: Sandbox) -> None:
    assert await ok(sandbox, "ls /sys/class/net") == "lo\n"
    assert await ok(sandbox, "cat /sys/class/net/*/operstate") in ("unknown\n", "up\n")
    # no route at all (Podman, Docker), or every address routed into lo (namespace sandboxes): nothing leaves
    assert await ok(sandbox, "tail -n +2 /proc/net/route | cut -f1 | sort -u | grep -vx lo | wc -l") == "0\n"
    tcp = await run(sandbox, "timeout 3 bash -c 'exec 3<>/dev/tcp/10.0.2.2/80' && echo connected")
    assert tcp.exit_code != 0
    assert "connected" not in tcp.output
    if sandbox.uses_agent:
        py = "import socket; socket.create_connection(('10.0.2.2', 80), timeout=2)"
        result = await run(sandbox, f'python3 -c "{py}"')
        assert result.exit_code != 0
        assert "Network is unreachable" in result.output or "Error" in result.output


async def test_without_network_a_connect_off_the_sandbox_times_out(sandbox: Sandbox) -> None:
    """As in the official (networked) containers, where an unroutable address never answers: requests'
    tests expect a ConnectTimeout from 10.255.255.1, not "Network is unreachable". And a name lookup fails
    at once (resolv.conf names 127.0.0.1) instead of waiting out a nameserver. Namespace sandboxes only:
    a Podman or Docker container without a network has no route, and no capability to add one."""
    if not isinstance(sandbox, NamespaceSandbox):
        pytest.skip("a container without a network has no route: a connect fails at once there")
    py = (
        "import socket\n"
        "try:\n"
        "    socket.create_connection(('10.255.255.1', 80), timeout=1)\n"
        "except OSError as e:\n"
        "    print(type(e).__name__)\n"
    )
    assert await ok(sandbox, f"python3 -c {shlex.quote(py)}") == "TimeoutError\n"
    lookup = await run(sandbox, "timeout 4 getent hosts example.org; echo rc=$?")
    assert lookup.output.strip().endswith("rc=2"), lookup  # not found; 124 would be the lookup hanging


async def test_mounts_are_read_only_folders_of_the_node(backend: Backend, tmp_path: Any) -> None:
    """A spec's mounts (a CLI agent's tools folder) are there, readable and executable, and cannot be written."""
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "hello").write_text("#!/bin/sh\necho hello from the node\n")
    (tools / "hello").chmod(0o755)
    box = await create_sandbox(backend, make_spec(mounts=[Mount(str(tools), "/opt/swectl-tools")]))
    try:
        assert await ok(box, "/opt/swectl-tools/hello") == "hello from the node\n"
        write = await run(box, "touch /opt/swectl-tools/x 2>&1; echo rc=$?")
        assert "rc=0" not in write.output and "Read-only" in write.output, write
        assert not (tools / "x").exists()
    finally:
        await box.destroy()


@pytest.mark.parametrize("image", ["agent"], indirect=True)
async def test_forward_port_reaches_the_controller_and_nothing_else(sandbox: Sandbox) -> None:
    """``forward_port``: 127.0.0.1:PORT inside a sandbox without a network reaches a server of the controller's, byte
    for byte and both ways, while the block runs; afterwards nothing listens there, and other addresses stay
    unreachable throughout."""
    seen: list[bytes] = []

    async def echo(stream: Any) -> None:
        async with stream:
            data = await stream.receive()
            seen.append(data)
            await stream.send(b"upper:" + data.upper())

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def connect() -> Any:
        return await anyio.connect_tcp("127.0.0.1", port)

    talk = "exec 3<>/dev/tcp/127.0.0.1/18080 && printf 'ping\\n' >&3 && head -c 11 <&3"
    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, echo)
        with anyio.fail_after(BOUND_S):
            async with sandbox.forward_port(18080, connect):
                assert await ok(sandbox, talk) == "upper:PING\n"
                again = await run(sandbox, talk)  # a second connection through the same relay
                assert again.output == "upper:PING\n", again
                out = await run(sandbox, "timeout 3 bash -c 'exec 3<>/dev/tcp/10.0.2.2/80' && echo connected")
                assert "connected" not in out.output
            closed = await run(sandbox, "timeout 3 bash -c 'exec 3<>/dev/tcp/127.0.0.1/18080' && echo connected")
            assert "connected" not in closed.output, closed
        tg.cancel_scope.cancel()
    assert seen == [b"ping\n", b"ping\n"]


async def test_localhost_resolves_without_network(sandbox: Sandbox) -> None:
    """As in any container: ``localhost`` resolves (/etc/hosts), so a test server bound to ``localhost``
    (django's live server) starts with no network. The base image has no /etc/hosts of its own."""
    out = await ok(sandbox, "getent hosts localhost")
    assert out.startswith(("127.0.0.1", "::1")), out
    if sandbox.uses_agent:
        py = "import socket; s = socket.socket(); s.bind(('localhost', 0)); s.listen(); print('bound')"
        assert await ok(sandbox, f'python3 -c "{py}"') == "bound\n"


BOMB = ":(){ :|:& };:"  # the classic: its shell returns at once and leaves the bomb running
BOMB_BLOCKING = "trap '' TERM; :(){ :|:; };:"  # blocks until killed, and ignores SIGTERM


@pytest.mark.parametrize(
    ("image", "bomb"),
    [
        pytest.param("agent", BOMB, id="agent-classic"),
        pytest.param("plain", BOMB, id="plain-classic"),
        pytest.param("agent", BOMB_BLOCKING, id="agent-blocking"),
        pytest.param("plain", BOMB_BLOCKING, id="plain-blocking"),
    ],
    indirect=["image"],
)
async def test_fork_bomb_is_held_by_the_pids_limit(backend: Backend, image: str, bomb: str) -> None:
    box = await create_sandbox(backend, make_spec(image, pids_limit=64))
    try:
        pids_max = "cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max"
        assert await ok(box, pids_max) == "64\n"
        with anyio.fail_after(3 + 15):
            result = await box.exec(f"bash -c {shlex.quote(bomb)}", 3)
        if bomb == BOMB_BLOCKING:
            assert result.timed_out, result
            assert "Resource temporarily unavailable" in result.output  # bash's "fork: retry: ..."
        # Right after the call nothing of the bomb is left, and the sandbox works.
        after = await run(box, "ps -e -o stat= -o args= | grep -v '^Z' | grep -c '[:]|:'; echo alive")
        assert after.output == "0\nalive\n", after
    finally:
        await box.destroy()


@images()
async def test_background_children_do_not_outlive_the_command(sandbox: Sandbox) -> None:
    """A child still holding the command's output when the shell exits is killed (after a short grace),
    so a command cannot leave processes behind that hold the pids limit or the output pipe."""
    with anyio.fail_after(10 + 8):
        result = await sandbox.exec("sleep 77 & echo started", 10)
    assert (result.output, result.exit_code, result.timed_out) == ("started\n", 0, False)
    assert result.duration_s < 9  # the grace, not the 10 s timeout nor the 77 s child (5.2 s seen at load 5)
    assert "sleep 77" not in await processes(sandbox)


async def test_zero_cpus_means_no_cpu_limit(backend: Backend) -> None:
    """cpus = 0 (sandbox.grading_cpus = 0: gradings as the official harness runs them): no CPU quota at all."""
    with anyio.fail_after(BOUND_S):
        box = await backend.create(make_spec(cpus=0))
    try:
        cpu = await run(box, CPU_QUOTA)
        if cpu.exit_code == 0:
            assert cpu.output.split()[0] in ("max", "-1"), cpu.output
        else:  # the cgroup is not visible inside this container: ask podman or docker
            engine = engine_cli(backend)
            assert engine is not None, cpu
            inspect = await engine("inspect", "--format", "{{.HostConfig.NanoCpus}} {{.HostConfig.CpuQuota}}", box.id)
            assert inspect.stdout.decode().split() in (["0", "0"], ["0", "-1"]), inspect.stdout
    finally:
        await box.destroy()


async def test_memory_and_cpu_limits_from_the_spec_are_applied(backend: Backend) -> None:
    with anyio.fail_after(BOUND_S):
        box = await backend.create(make_spec(memory="300m", cpus=0.5))
    try:
        v1, v2 = "/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory.max"
        memory = await run(box, f"cat {v1} 2>/dev/null || cat {v2}")
        if memory.exit_code == 0:
            assert memory.output == f"{300 * 1024 * 1024}\n"
        else:  # the cgroup is not visible inside this container: ask podman or docker
            engine = engine_cli(backend)
            assert engine is not None, memory
            inspect = await engine("inspect", "--format", "{{.HostConfig.Memory}}", box.id)
            assert inspect.stdout.decode().strip() == str(300 * 1024 * 1024)
        cpu = await run(box, "cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us /sys/fs/cgroup/cpu/cpu.cfs_period_us")
        if cpu.exit_code == 0:
            quota, period = map(int, cpu.output.split())
            assert quota / period == pytest.approx(0.5)
    finally:
        await box.destroy()


# -------------------------------------------------------------------------------------------- faults


async def test_killed_container_raises_sandbox_lost(sandbox: Sandbox) -> None:
    assert await ok(sandbox, "echo alive") == "alive\n"
    await kill_from_outside(sandbox)
    with anyio.fail_after(10), pytest.raises(SandboxLostError):
        await sandbox.exec("echo hi", 30)


async def test_every_operation_on_a_killed_container_raises_sandbox_lost(sandbox: Sandbox) -> None:
    await ok(sandbox, "echo x > /tmp/f")
    await kill_from_outside(sandbox)
    with anyio.fail_after(10):
        with pytest.raises(SandboxLostError):
            await sandbox.ping()
        with pytest.raises(SandboxLostError):
            await sandbox.read_file("/tmp/f")
        with pytest.raises(SandboxLostError):
            await sandbox.write_file("/tmp/g", b"data")
        with pytest.raises(SandboxLostError):
            await sandbox.exec("echo hi", 30)


async def test_container_killed_during_a_command_raises_sandbox_lost(sandbox: Sandbox) -> None:
    async def kill_soon() -> None:
        await wait_for_file(sandbox)
        await kill_from_outside(sandbox)

    outcome: ExecResult | Exception
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_soon)
            try:
                outcome = await sandbox.exec(f"touch {STARTED_MARK}; sleep 30", 60)
            except SandboxLostError as exc:
                outcome = exc
    assert isinstance(outcome, SandboxLostError), outcome


@pytest.mark.parametrize("backend_kind", ["podman", "podman-api", "docker"])  # the `exec -i` start step of containers
async def test_nopython_sandbox_starts_reliably(backend: Backend, nopython_image: str) -> None:
    """Repeats the start step of create() (a `podman exec -i` or `docker exec -i` that finds no python3) on one
    container.

    Regression test: podman 4.3 drops the output of an `exec -i` process that exits while its input is
    still being written; the start script used to answer NOPY and exit at once, which lost the answer
    about one start in four (create() then raised SandboxLostError).
    """
    box = await create_sandbox(backend, make_spec(nopython_image))
    try:
        attempts = 10  # with a 1-in-4 loss, all 10 succeed with probability 0.75**10 = 6%
        for attempt in range(1, attempts + 1):
            try:
                with anyio.fail_after(BOUND_S):
                    await box.start()
            except SandboxLostError as exc:
                raise AssertionError(f"start {attempt} of {attempts} lost the agent's answer") from exc
            assert not box.uses_agent
    finally:
        await box.destroy()


async def test_an_old_python_first_on_path_does_not_stop_the_agent(backend: Backend, old_python_image: str) -> None:
    """A project environment first on PATH whose python3 cannot run the agent (Django 3.0's SWE-bench environment
    is Python 3.6): the agent runs on the image's /usr/bin/python3 and the commands still see the project's PATH."""
    box = await create_sandbox(backend, make_spec(old_python_image, workdir=SPEC_WORKDIR))
    try:
        assert box.uses_agent
        assert await ok(box, "command -v python3; python3 --version || true") == \
            "/opt/venv/bin/python3\nPython 3.6.15\n"
    finally:
        await box.destroy()


@pytest.mark.parametrize("backend_kind", ["namespace"])
async def test_namespace_sandbox_needs_no_python_in_the_image(backend: Backend, nopython_image: str) -> None:
    """The namespace backend's agent runs on the node's interpreter: an image without python3 still gets it."""
    box = await create_sandbox(backend, make_spec(nopython_image, workdir=SPEC_WORKDIR))
    try:
        assert box.uses_agent
        assert await ok(box, "command -v python3 || echo none; pwd") == f"none\n{SPEC_WORKDIR}\n"
        await box.write_file("/tmp/x", b"\x00\xff")
        assert await box.read_file("/tmp/x") == b"\x00\xff"
    finally:
        await box.destroy()


async def test_missing_image_raises_command_error(backend: Backend) -> None:
    image = f"localhost/swectl-test-missing-{SESSION_ID}:latest"
    run_label = f"missing-{SESSION_ID}"
    with anyio.fail_after(60), pytest.raises(CommandError) as caught:
        await backend.create(make_spec(image, labels={"swectl.run": run_label}))
    assert isinstance(caught.value, InfraError)
    assert image in str(caught.value)
    with anyio.fail_after(BOUND_S):
        assert await backend.list({"swectl.run": run_label}) == []


async def test_sandboxes_destroyed_together_are_removed_in_a_few_podman_calls(backend: Backend) -> None:
    run_label = f"burst-{SESSION_ID}"
    boxes = []
    with anyio.fail_after(120):
        for _ in range(12):
            boxes.append(await create_sandbox(backend, make_spec(labels={"swectl.run": run_label})))
    calls: list[list[str]] = []
    real_remove = backend.remove

    async def counted(ids: list[str]) -> None:  # the real removal, counted
        calls.append(list(ids))
        await real_remove(ids)

    backend.remove = counted  # type: ignore[method-assign]
    try:
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for box in boxes:
                    tg.start_soon(box.destroy)
    finally:
        del backend.remove
    assert sorted(i for ids in calls for i in ids) == sorted(b.id for b in boxes)  # each exactly once
    assert len(calls) < len(boxes) / 2, calls
    with anyio.fail_after(BOUND_S):
        assert await backend.list({"swectl.run": run_label}) == []


def _as_run_makes_it(inspect: dict[str, Any]) -> dict[str, Any]:
    """What `podman inspect` says about a container that the way it was created decides (ids, times and paths
    left out, and CreateCommand: the API service records none)."""
    config, host = inspect["Config"], inspect["HostConfig"]
    return {
        "Path": inspect["Path"], "Args": inspect["Args"], "ImageName": inspect["ImageName"],
        "OCIRuntime": inspect["OCIRuntime"], "EffectiveCaps": inspect["EffectiveCaps"],
        "BoundingCaps": inspect["BoundingCaps"],
        "Env": sorted(e for e in config["Env"] if not e.startswith("HOSTNAME=")), "Labels": config["Labels"],
        "WorkingDir": config["WorkingDir"], "StopTimeout": config["StopTimeout"], "Entrypoint": config["Entrypoint"],
        "Cmd": config["Cmd"], "StopSignal": config["StopSignal"], "Tty": config["Tty"],
        "sdNotifyMode": config.get("sdNotifyMode"), "Umask": config.get("Umask"),
        "Annotations": {k: v for k, v in config["Annotations"].items() if not k.endswith(".Created")},
        **{key: host[key] for key in (
            "Init", "Memory", "MemorySwap", "PidsLimit", "CpuQuota", "CpuPeriod", "CpuShares", "NetworkMode",
            "Ulimits", "CapAdd", "CapDrop", "SecurityOpt", "Privileged", "ReadonlyRootfs", "ShmSize",
            "IpcMode", "PidMode", "UTSMode", "UsernsMode", "CgroupMode", "CgroupParent", "AutoRemove",
            "RestartPolicy", "Devices", "Binds", "Tmpfs",
        )},
        "LogConfig": {k: v for k, v in host["LogConfig"].items() if k != "Path"},  # the path names the container
    }  # fmt: skip


@pytest.mark.parametrize("backend_kind", ["podman-api"])
async def test_api_makes_the_container_the_cli_makes(backend: Backend) -> None:
    """A sandbox made through the Podman API service is the container `podman run` makes from the same spec:
    init, entrypoint, limits, network, env, labels, workdir, stop timeout, ulimits and capabilities agree."""
    cli = await new_backend(kind="podman")
    spec = make_spec(workdir=SPEC_WORKDIR, env=SPEC_ENV, memory="300m", cpus=0.5, pids_limit=100,
                     labels={"team": "parity"})  # fmt: skip
    boxes: list[Sandbox] = []
    try:
        for made_by in (cli, backend):
            boxes.append(await create_sandbox(made_by, spec))
        inspected = []
        for box in boxes:
            out = await apodman("inspect", box.id)
            assert out.returncode == 0, out.stderr
            inspected.append(_as_run_makes_it(json.loads(out.stdout)[0]))
        by_cli, by_api = inspected
        assert by_api == by_cli
        assert by_api["Init"] is True and by_api["NetworkMode"] == "none" and by_api["StopTimeout"] == 0
        assert (by_api["Memory"], by_api["PidsLimit"], by_api["CpuQuota"]) == (300 * 1024 * 1024, 100, 50_000)
    finally:
        with anyio.fail_after(BOUND_S):
            for box in boxes:
                await box.destroy()
            await cli.aclose()
