"""The sandbox seam: what agents and graders may do in an isolated environment.

Backends (Podman today; a namespace sandbox later) implement ``Sandbox`` and ``SandboxBackend`` and pass
the contract tests in tests/integration/test_sandbox_contract.py. A command's failure or timeout is an
``ExecResult``, never an exception; exceptions (swectl.errors.InfraError) mean the infrastructure broke.

What a sandbox covers: its own filesystem, process tree (pids limit), memory and CPU limits, and no
network unless configured. What it does not: a container is not a VM; kernel exploits and side channels
are out of scope.
"""

from __future__ import annotations

import shlex
from typing import Protocol

from swectl.schema import ExecResult, SandboxInfo, SandboxSpec

ELISION = "\n\n... [{n} bytes elided: output too long, showing the head and tail] ...\n\n"


class Sandbox(Protocol):
    id: str
    node: str

    async def exec(
        self, command: str, timeout: float, *, cwd: str | None = None, env: dict[str, str] | None = None
    ) -> ExecResult:
        """Run ``command`` with bash; on timeout the whole process group is killed inside the sandbox."""
        ...

    async def write_file(self, path: str, data: bytes, *, mode: int | None = None) -> None: ...
    async def read_file(self, path: str) -> bytes: ...
    async def diff(self, repo: str | None = None) -> bytes:
        """All changes of the git repository at ``repo`` against HEAD, binary-safe (``git diff --binary``)."""
        ...

    async def ping(self) -> None: ...
    async def destroy(self) -> None:
        """Remove the sandbox; idempotent; bounded in time even when the node is gone."""
        ...


class SandboxBackend(Protocol):
    name: str

    async def prepare(self) -> None: ...
    async def create(self, spec: SandboxSpec) -> Sandbox: ...
    async def list(self, labels: dict[str, str]) -> list[SandboxInfo]: ...
    async def remove(self, ids: list[str]) -> None: ...


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
