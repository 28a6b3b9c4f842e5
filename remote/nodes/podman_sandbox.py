"""Podman sandboxes on one node (local or over SSH): the first SandboxBackend.

A sandbox is a container idling under catatonit (``--init``, so orphaned processes are reaped and count
against the pids limit only while alive). Commands go through the exec agent (remote/programs/exec_agent.py),
started once per sandbox: one command then costs about the price of spawning bash instead of a podman process.
The agent listens on a unix socket in the container's own /dev/shm, started by one short ``podman exec``; the
controller connects through the container's root as the node sees it (``/proc/PID/root``, the pid from podman's
pidfile; over SSH a forwarded stream), and the agent removes the socket once connected. Nothing runs between
them. Where the node refuses that (a non-root SSH user, an engine without a pidfile: Docker), the agent speaks
through one long-lived ``podman exec -i`` instead, a relay process that costs CPU even while idle, which adds up
over many sandboxes (docs/results.md, "Figures the code relies on"). Images without python3 fall back to one
``podman exec ... timeout -k`` per command. Timeouts always kill inside the sandbox; the controller's
own wait is ``timeout + exec_grace_s`` and, when it expires, the sandbox is declared lost.

Covered: filesystem, pids, memory and CPU limits, no network by default (``--network none``).
Not covered: what the container runtime does not isolate (kernel, devices podman exposes by default).

``ContainerBackend`` and ``ContainerSandbox`` hold all of this for any ContainerCli; the Docker backend
(remote/nodes/docker_sandbox.py) is the same code over ``docker``.
"""

from __future__ import annotations

import logging
import secrets

import anyio

from swectl.config import SandboxConfig
from swectl.errors import InfraError, SandboxError, SandboxLostError
from swectl.remote.nodes.agent_client import (
    AGENT_SOCKET,
    LISTENING,
    NO_PYTHON,
    AgentClient,
    agent_command,
    listen_command,
)
from swectl.remote.nodes.agent_sandbox import AgentSandbox, RemovalBatcher, translate_lost
from swectl.remote.nodes.node import Node, NodeProcess
from swectl.remote.nodes.podman import ContainerCli, PodmanCli
from swectl.remote.nodes.podman_api import PodmanApi
from swectl.remote.programs.exec_agent import HeadTail
from swectl.sandbox import format_output, head_tail_limits
from swectl.schema import ExecResult, SandboxInfo, SandboxSpec

PODMAN_FAILURE_CODES = PodmanCli.exec_failure_codes
# The no-python path: `timeout` leads its own process group; once it returns, whatever the command left
# running in that group (background jobs, a fork bomb) is killed too, as the exec agent does.
PLAIN_EXEC_SCRIPT = """exec 2>&1
if [ -x /bin/bash ]; then shell=/bin/bash; else shell=/bin/sh; fi
timeout -k 2 "$1s" "$shell" -c "$2" </dev/null &
pid=$!
wait "$pid" 2>/dev/null; rc=$?
for _ in 1 2 3 4 5; do kill -9 "-$pid" 2>/dev/null || break; done
exit "$rc"
"""
REMOVE_CONCURRENCY = 2  # `podman rm` processes at once per node (each removes a batch)
SOCKET_CONNECT_S = 20.0  # from the agent's start to its socket answering (python's start-up, on a loaded node)
log = logging.getLogger(__name__)


class ContainerBackend:
    """Creates, lists and removes swectl's containers on one node through ``self.cli``; removals are batched
    (RemovalBatcher)."""

    def __init__(self, node: Node, config: SandboxConfig, cli: ContainerCli) -> None:
        self.name = node.name
        self.node = node
        self.cli = cli
        self.config = config
        self._removals = RemovalBatcher(lambda ids: self.remove(ids), node.name, REMOVE_CONCURRENCY)
        # Exec agents on a socket (no relay process per sandbox) until the node shows it cannot do that.
        self.socket_channel = True

    own_cgroup_limits = False  # the container engine enforces the sandbox's limits, not swectl

    def preloaded_images(self) -> set[str]:
        return set()  # every image comes from the node's container store

    def no_socket_channel(self, why: str) -> bool:
        """From now on this node's exec agents speak through a relay process (``<cli> exec -i``), said once."""
        if self.socket_channel:
            self.socket_channel = False
            log.warning("node %s: exec agents cannot be reached on a socket (%s); each sandbox keeps a `%s exec -i` "
                        "relay process instead (about 3 ms of CPU per second each while idle)", self.name, why,
                        self.cli.binary)
        return False

    def _sandbox(self, cid: str, name: str, spec: SandboxSpec) -> ContainerSandbox:
        return ContainerSandbox(self, cid, name, spec)

    @property
    def prepared(self) -> bool:
        return self.cli.ready

    @property
    def alive(self) -> bool:
        return self.node.alive

    async def prepare(self) -> None:
        await self.node.connect()
        await self.cli.prepare()

    async def probe(self) -> str:
        await self.node.connect()
        return await self.cli.version()

    async def create(self, spec: SandboxSpec) -> ContainerSandbox:
        name = f"swectl-{secrets.token_hex(6)}"
        try:
            with translate_lost(self.node, f"creating a sandbox from {spec.image}"):
                cid = await self.cli.create(spec, name)
        except BaseException:
            # Cancelled or failed mid-`podman run`: the container may exist without our knowing its id.
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.config.destroy_timeout_s):
                try:
                    await self.cli.remove([name])
                except InfraError:
                    pass
            raise
        sandbox = self._sandbox(cid, name, spec)
        try:
            with translate_lost(self.node, f"starting the exec agent in {name}"):
                await sandbox.start()
        except BaseException:
            await sandbox.destroy()
            raise
        return sandbox

    async def list(self, labels: dict[str, str]) -> list[SandboxInfo]:
        with translate_lost(self.node, "listing containers"):
            return await self.cli.list_containers(labels)

    async def remove(self, ids: list[str]) -> None:
        with translate_lost(self.node, "removing containers"):
            await self.cli.remove(ids)

    async def remove_one(self, cid: str) -> None:
        """Remove one container in the next batch; raises the batch's InfraError."""
        await self._removals.remove_one(cid)

    async def aclose(self) -> None:
        await self.node.aclose()


class PodmanBackend(ContainerBackend):
    """Podman containers on one node, with swectl's containers.conf. Lifecycle goes through the podman CLI, or
    with ``sandbox.podman_api`` through the node's Podman API service (remote/nodes/podman_api.py)."""

    def __init__(self, node: Node, config: SandboxConfig, containers_conf: str = "bundled") -> None:
        self.podman = PodmanApi(node, containers_conf) if config.podman_api else PodmanCli(node, containers_conf)
        super().__init__(node, config, self.podman)

    def _sandbox(self, cid: str, name: str, spec: SandboxSpec) -> PodmanSandbox:
        return PodmanSandbox(self, cid, name, spec)

    async def aclose(self) -> None:
        if isinstance(self.podman, PodmanApi):
            self.podman.close()
        await super().aclose()


class ContainerSandbox(AgentSandbox):
    """A container as a Sandbox, driven through the exec agent (or one `<cli> exec` per command)."""

    def __init__(self, backend: ContainerBackend, cid: str, name: str, spec: SandboxSpec) -> None:
        super().__init__(backend.node, backend.config, cid, name, spec)
        self._backend = backend
        self._cli = backend.cli

    async def start(self) -> None:
        if self._backend.socket_channel and await self._start_on_socket():
            return
        await self._start_agent(await self._backend.node.spawn(self._cli.argv("exec", "-i", self.id,
                                                                               *agent_command())))

    async def _start_agent(self, channel: NodeProcess) -> None:
        """Send the agent its source over ``channel`` and wait for its hello; without python3 there the sandbox
        keeps the plain path."""
        client = AgentClient(channel, f"sandbox {self.name} on {self.node}")
        try:
            with anyio.fail_after(self._config.start_timeout_s):
                has_python = await client.start()
        except BaseException:
            await client.aclose()
            raise
        if has_python:
            self._agent = client
        else:
            await client.aclose()

    async def _start_on_socket(self) -> bool:
        """The agent listening on a socket in the container (one short `exec`), reached from the node through the
        container's root (/proc/PID/root): no relay process for the sandbox's life. False (nothing started) when
        the node does not allow it; the caller then starts the agent behind a `podman exec -i` relay."""
        node = self._backend.node
        pidfile = await self._cli.pidfile(self.id)
        if pidfile is None:
            return self._backend.no_socket_channel("the engine does not say where a container's pid is")
        read = await node.run(["cat", pidfile])
        pid = read.stdout.decode(errors="replace").strip()
        if read.exit_code != 0 or not pid.isdigit():
            return self._backend.no_socket_channel(f"cannot read {pidfile}: {read.stderr.decode(errors='replace')}")
        started = await self._cli.run("exec", self.id, *listen_command(), check=False)
        if started.stdout == NO_PYTHON:
            return True  # the plain path (one `podman exec` per command), as the relay path would find
        if started.stdout != LISTENING:
            raise SandboxError(f"sandbox {self.name}: the exec agent did not start (exit {started.exit_code}): "
                               f"{(started.stdout + started.stderr).decode(errors='replace')[-500:]}")
        path = f"/proc/{pid}/root{AGENT_SOCKET}"
        channel = None
        with anyio.move_on_after(SOCKET_CONNECT_S):
            while channel is None:
                try:
                    channel = await node.open_unix(path)
                except PermissionError as exc:
                    return self._backend.no_socket_channel(f"{path}: {exc}")
                except ConnectionError:
                    await anyio.sleep(0.005)  # the agent's python is starting
        if channel is None:
            return self._backend.no_socket_channel(f"nothing answered at {path} within {SOCKET_CONNECT_S:g}s")
        await self._start_agent(channel)
        return True

    async def host_root(self) -> str:
        """``/proc/PID/root`` of the container's init, its pid as the engine reports it (``inspect``)."""
        out = await self._cli.run("inspect", "--format", "{{.State.Pid}}", self.id, check=False)
        pid = out.stdout.decode(errors="replace").strip()
        if out.exit_code != 0 or not pid.isdigit() or pid == "0":
            raise SandboxError(f"sandbox {self.name}: its engine does not say its pid (exit {out.exit_code}): "
                               f"{(out.stdout + out.stderr).decode(errors='replace')[-300:]}")
        return f"/proc/{pid}/root"

    async def exec(
        self, command: str, timeout: float, *, cwd: str | None = None, env: dict[str, str] | None = None,
        output_limit: int | None = None,
    ) -> ExecResult:
        if self._agent is not None:
            return await super().exec(command, timeout, cwd=cwd, env=env, output_limit=output_limit)
        self._check_alive()
        with self._guard(timeout, "exec"):
            return await self._plain_exec(command, timeout, cwd, env, output_limit)

    async def write_file(self, path: str, data: bytes, *, mode: int | None = None) -> None:
        if self._agent is not None:
            return await super().write_file(path, data, mode=mode)
        self._check_alive()
        with self._guard(60 + len(data) / 5e6, "write_file"):
            await self._plain_write(path, data, mode)

    async def read_file(self, path: str) -> bytes:
        if self._agent is not None:
            return await super().read_file(path)
        self._check_alive()
        with self._guard(600, "read_file"):
            return await self._plain_read(path)

    async def ping(self) -> None:
        if self._agent is not None:
            return await super().ping()
        self._check_alive()
        with self._guard(5, "ping"):
            result = await self._plain_exec("true", 5, None, None)
            if result.exit_code != 0:
                await self._raise_if_gone("ping failed")
                raise SandboxError(f"sandbox {self.name}: ping failed: {result.output[-500:]}")

    async def _remove(self) -> None:
        await self._backend.remove_one(self.id)

    # ------------------------------------------------------------------ the no-python path

    async def _plain_exec(
        self, command: str, timeout: float, cwd: str | None, env: dict[str, str] | None,
        output_limit: int | None = None,
    ) -> ExecResult:
        args = ["exec", "-w", cwd or self.spec.workdir]
        for key, value in sorted((env or {}).items()):
            args += ["-e", f"{key}={value}"]
        args += [self.id, "sh", "-c", PLAIN_EXEC_SCRIPT, "sh", f"{timeout}", command]
        head, tail = head_tail_limits(self._config, output_limit)
        buffer = HeadTail(head, tail)
        started = anyio.current_time()
        process = await self._backend.node.spawn(self._cli.argv(*args))
        try:
            await process.close_input()
            while chunk := await process.receive():
                buffer.feed(chunk)
            code = await process.wait()
        finally:
            await process.aclose()
        elapsed = anyio.current_time() - started
        timed_out = code in (124, 137) and elapsed >= timeout
        if not timed_out and code in self._cli.exec_failure_codes:
            await self._raise_if_gone(f"{self._cli.binary} exec exited {code}")
        return ExecResult(
            output=format_output(buffer.output(), buffer.elided, head),
            exit_code=137 if timed_out else code,
            timed_out=timed_out,
            elided_bytes=buffer.elided,
            duration_s=elapsed,
        )

    async def _plain_write(self, path: str, data: bytes, mode: int | None) -> None:
        script = 'mkdir -p "$(dirname "$1")" && cat > "$1"' + (f' && chmod {mode:o} "$1"' if mode is not None else "")
        out = await self._cli.run(
            "exec", "-i", self.id, "sh", "-c", script, "sh", path, input=data, check=False
        )
        if out.exit_code != 0:
            await self._raise_if_gone(f"writing {path} failed")
            raise SandboxError(f"sandbox {self.name}: writing {path} failed: {out.stderr.decode(errors='replace')}")

    async def _plain_read(self, path: str) -> bytes:
        out = await self._cli.run("exec", self.id, "cat", path, check=False)
        if out.exit_code != 0:
            await self._raise_if_gone(f"reading {path} failed")
            raise SandboxError(f"sandbox {self.name}: reading {path} failed: {out.stderr.decode(errors='replace')}")
        return out.stdout

    async def _raise_if_gone(self, what: str) -> None:
        """On the plain path the engine's exit code cannot tell a dead container from a failing command."""
        out = await self._cli.run(
            "container", "inspect", "--format", "{{.State.Running}}", self.id, check=False
        )
        if out.stdout.strip() != b"true":
            raise SandboxLostError(f"sandbox {self.name}: container is gone ({what})")


class PodmanSandbox(ContainerSandbox):
    """A podman container as a Sandbox, driven through the exec agent (or `podman exec`)."""
