"""The Podman backend's exec agent on a socket: no relay process per sandbox, nothing in the sandbox can reach the
agent's socket, the commands keep the image's umask, and a node that refuses the socket falls back to the relay."""

from __future__ import annotations

import os

import anyio
import pytest

from swectl.config import SandboxConfig
from swectl.errors import SandboxLostError
from swectl.remote.nodes.agent_client import AGENT_SOCKET
from swectl.remote.nodes.node import LocalNode
from swectl.remote.nodes.podman import bundled_containers_conf
from swectl.remote.nodes.podman_sandbox import ContainerSandbox, PodmanBackend

from .conftest import apodman, make_spec

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


def relay_processes(cid: str) -> list[str]:
    """`podman exec -i <cid>` processes on this machine (the relay the socket channel does without)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"exec" in argv and b"-i" in argv and cid.encode() in argv:
            found.append(pid)
    return found


async def new_backend(*, socket_channel: bool = True) -> PodmanBackend:
    backend = PodmanBackend(LocalNode(), SandboxConfig(), str(bundled_containers_conf()))
    backend.socket_channel = socket_channel
    await backend.prepare()
    return backend


async def test_agent_on_socket_has_no_relay_and_no_reachable_socket() -> None:
    backend = await new_backend()
    box = await backend.create(make_spec())
    try:
        assert isinstance(box, ContainerSandbox) and box.uses_agent
        assert backend.socket_channel, "the socket channel fell back to the relay on this machine"
        assert relay_processes(box.id) == []
        # The agent removed its socket once connected: a command in the sandbox finds nothing to connect to.
        probe = await box.exec(f"test -e {AGENT_SOCKET} && echo present || echo gone; umask", 30)
        assert probe.output.split() == ["gone", "0022"]  # and the commands keep the image's umask
        assert (await box.exec("echo hello", 30)).output == "hello\n"
    finally:
        await box.destroy()
        await backend.aclose()


async def test_relay_is_the_fallback() -> None:
    backend = await new_backend(socket_channel=False)
    box = await backend.create(make_spec())
    try:
        assert box.uses_agent
        assert len(relay_processes(box.id)) == 1
        assert (await box.exec("echo hello", 30)).output == "hello\n"
    finally:
        await box.destroy()
        await backend.aclose()
    assert relay_processes(box.id) == []


async def test_container_killed_under_the_socket_is_lost() -> None:
    backend = await new_backend()
    box = await backend.create(make_spec())
    try:
        assert relay_processes(box.id) == []
        killed = await apodman("kill", box.id)
        assert killed.returncode == 0, killed.stderr
        with anyio.fail_after(30), pytest.raises(SandboxLostError):
            await box.exec("echo never", 10)
    finally:
        await box.destroy()
        await backend.aclose()
