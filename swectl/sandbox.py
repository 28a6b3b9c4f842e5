"""The sandbox seam: what agents and graders may do in an isolated environment.

Backends (Podman today; a namespace sandbox later) implement ``Sandbox`` and ``SandboxBackend`` and pass
the contract tests in tests/integration/test_sandbox_contract.py. The env pool (actors/env_pool.py) uses
nothing else: a backend covers one node and tells the pool how to prepare, probe and close it, and it
lists and removes sandboxes by the ``LABEL_*`` labels the pool puts on them. A command's failure or timeout is an
``ExecResult``, never an exception; exceptions (swectl.errors.InfraError) mean the infrastructure broke.

What a sandbox covers: its own filesystem, process tree (pids limit), memory and CPU limits, and no
network unless configured. What it does not: a container is not a VM; kernel exploits and side channels
are out of scope.
"""

from __future__ import annotations

import shlex
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import anyio.abc

from swectl.schema import ExecResult, SandboxInfo, SandboxSpec

if TYPE_CHECKING:
    from swectl.config import SandboxConfig

# Labels the env pool puts on every sandbox (SandboxSpec.labels); backends store them and filter by them.
LABEL_MANAGED = "swectl.managed"
LABEL_RUN = "swectl.run"
LABEL_NODE = "swectl.node"
LABEL_CONTROLLER = "swectl.controller"  # "<hostname>:<pid>" of the controller that created it

ELISION = "\n\n... [{n} bytes elided: output too long, showing the head and tail] ...\n\n"


class Sandbox(Protocol):
    """One started sandbox: exec, files, diff and teardown, whatever the backend."""
    id: str  # the backend's id: what ``SandboxBackend.list`` reports and ``remove`` takes
    name: str  # a short name for messages and lease ids
    node: str

    async def exec(
        self, command: str, timeout: float, *, cwd: str | None = None, env: dict[str, str] | None = None,
        output_limit: int | None = None,
    ) -> ExecResult:
        """Run ``command`` with bash; on timeout the whole process group is killed inside the sandbox. The
        output keeps the config's head and tail bytes (``sandbox.output_head_bytes``/``output_tail_bytes``), or
        ``output_limit`` bytes (half head, half tail) when given; ``elided_bytes`` says how many were cut."""
        ...

    async def write_file(self, path: str, data: bytes, *, mode: int | None = None) -> None: ...
    async def read_file(self, path: str) -> bytes: ...
    async def diff(self, repo: str | None = None) -> bytes:
        """All changes of the git repository at ``repo`` against HEAD, binary-safe (``git diff --binary``)."""
        ...

    async def ping(self) -> None: ...
    def forward_port(self, port: int, connect: Callable[[], Awaitable[anyio.abc.ByteStream]]
                     ) -> AbstractAsyncContextManager[None]:
        """While the block runs, connections to 127.0.0.1:``port`` inside the sandbox reach what ``connect`` opens
        on the controller's side (a CLI agent's way to the model gateway); nothing else of the outside does."""
        ...

    async def destroy(self) -> None:
        """Remove the sandbox; idempotent; bounded in time even when the node is gone."""
        ...

    async def break_transport(self) -> None:
        """Cut the controller's channel to the sandbox (its node was lost): every call blocked on it wakes up
        with an InfraError. Does not remove the sandbox; quick, and safe to call twice."""
        ...


class SandboxBackend(Protocol):
    """Sandboxes on one node. Every method raises InfraError (NodeLostError once the node is gone)."""

    name: str  # the node's name

    @property
    def prepared(self) -> bool:
        """Whether ``prepare()`` has succeeded once: a backend never prepared has created nothing."""
        ...

    @property
    def alive(self) -> bool:
        """False once the transport to the node is known to be gone (an SSH connection dropped)."""
        ...

    async def prepare(self) -> None:
        """(Re)connect to the node and (re)install what the backend needs there; idempotent."""
        ...

    async def probe(self) -> str:
        """Health check: reconnect if the connection dropped, ask the backend to answer; its version."""
        ...

    async def create(self, spec: SandboxSpec) -> Sandbox:
        """A started sandbox. A failed or cancelled create leaves nothing behind, or a labelled orphan."""
        ...

    async def list(self, labels: dict[str, str]) -> list[SandboxInfo]:
        """The sandboxes on the node carrying all of ``labels`` (any state, whoever created them)."""
        ...

    async def remove(self, ids: list[str]) -> None:
        """Force-remove sandboxes by id; missing ones are not an error (idempotent)."""
        ...

    async def aclose(self) -> None:
        """Close the connection to the node (sandboxes stay); idempotent."""
        ...

    def preloaded_images(self) -> set[str]:
        """Images its sandboxes start from without the node's image store (the namespace backend's rootfs
        tarballs, sandbox.ns_rootfs); empty for a backend whose images all come from the store."""
        ...


@runtime_checkable
class ForgetsImages(Protocol):
    """A backend that caches what it learned of an image (the namespace backend: its layer directories): the env
    pool tells it when it removed one from the node."""

    def forget_image(self, image: str) -> None: ...


def head_tail_limits(config: SandboxConfig, output_limit: int | None) -> tuple[int, int]:
    """The bytes of a command's output kept from its start and its end: the config's, or ``output_limit``
    split in halves."""
    if output_limit is None:
        return config.output_head_bytes, config.output_tail_bytes
    return output_limit - output_limit // 2, output_limit // 2


def format_output(head_tail: bytes, elided: int, head: int) -> str:
    """Decode merged output (never fails on non-UTF-8) and mark where bytes were elided."""
    if not elided:
        return head_tail.decode("utf-8", errors="replace")
    return (
        head_tail[:head].decode("utf-8", errors="replace")
        + ELISION.format(n=elided)
        + head_tail[head:].decode("utf-8", errors="replace")
    )


DIFF_FILE = "/tmp/.swectl-diff"


def diff_command(repo: str) -> str:
    """Shell that writes every change (tracked, untracked, binary) to DIFF_FILE without touching the
    repository's own index (a temporary index gets the ``git add -A``)."""
    q = shlex.quote(repo)
    return (
        f"cd {q} || exit 2; idx=$(mktemp); cp .git/index \"$idx\" 2>/dev/null || rm -f \"$idx\"; "
        f'base=$(git rev-parse -q --verify HEAD || git hash-object -t tree /dev/null) && '
        f'GIT_INDEX_FILE="$idx" git add -A . && '
        f'GIT_INDEX_FILE="$idx" git -c core.quotepath=false diff --cached --binary --no-color "$base" '
        f"> {DIFF_FILE}; rc=$?; rm -f \"$idx\"; exit $rc"
    )
