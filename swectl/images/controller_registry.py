"""The controller's own registry, for `swectl image sync` without ``--registry``: Debian's ``docker-registry`` (the
CNCF distribution registry) serving plain HTTP on ``127.0.0.1`` of the controller only, for as long as the sync runs.
The nodes reach it through their SSH connection (remote/nodes/ssh.py ``forward_to_local_path``), never over a network.

Its blobs live in a cache folder (``--cache``, default ``runs/image-cache``) that outlives the sync: a later sync
pushes only the layers it lacks. Three files beside the storage:

- ``port``: the port it listened on. A later sync listens there again while the port is free, because podman
  remembers which blobs a registry holds by its host and port (its blob info cache): pushed to the same storage on
  another port, every layer is compressed and sent again (docs/results.md, "Figures the code relies on"). A port
  taken between that check and the registry's bind ("address already in use") is given up for a new free one, up to
  PORT_TRIES times.
- ``lock``: one sync per folder at a time (``flock``; released when the process ends, even on SIGKILL); a second one
  is refused with the first's pid.
- ``registry.log``: what the registry said (warnings and errors only).

The registry runs as ``setpriv --pdeathsig KILL docker-registry serve CONFIG``: it dies with the controller, even when
the controller is killed with SIGKILL. A missing ``docker-registry`` is one RegistryError naming the apt package.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.abc
import httpx

from swectl.images.registry import Registry, RegistryError

REGISTRY_BIN = "/usr/bin/docker-registry"
APT_PACKAGE = "docker-registry"
START_TIMEOUT_S = 20.0
PORT_TRIES = 3  # registry starts whose port was taken under them, each on a new free port
STOP_GRACE_S = 5.0
STORAGE = "storage"


def registry_config(addr: str, storage: Path, *, delete: bool = False) -> str:
    """The registry's config (YAML; JSON is YAML too): plain HTTP on ``addr``, blobs under ``storage``, warnings
    and errors logged, no access log; ``delete``: images may be deleted through the API."""
    return json.dumps({
        "version": 0.1,
        "log": {"level": "warn", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": delete}},
        "http": {"addr": addr},
    }, indent=1) + "\n"


def missing_registry() -> str | None:
    """Why the controller cannot run its registry (the binary is missing), or None."""
    if os.access(REGISTRY_BIN, os.X_OK):
        return None
    return (f"the controller's registry needs {REGISTRY_BIN}: apt-get install {APT_PACKAGE} (scripts/setup.sh "
            "installs it and never starts its service), or give --registry URL, a registry the nodes reach")


class RunningRegistry:
    """The controller's registry while it runs: ``registry`` is how this machine reaches it."""

    def __init__(self, folder: Path, port: int, process: anyio.abc.Process, log_start: int = 0) -> None:
        self.folder = folder
        self.port = port
        self.registry = Registry(host=f"127.0.0.1:{port}", plain_http=True)
        self._process = process
        self._log_start = log_start  # where this start's lines begin in registry.log (it keeps earlier starts')

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def exit_code(self) -> int | None:
        """None while it runs."""
        return self._process.returncode

    def log_tail(self, limit: int = 2000) -> str:
        try:
            return (self.folder / "registry.log").read_text(errors="replace")[-limit:].strip()
        except OSError:
            return ""

    def port_was_taken(self) -> bool:
        """Whether this start's log says its port was in use (another process bound it after choose_port)."""
        try:
            with (self.folder / "registry.log").open("rb") as log:
                log.seek(self._log_start)
                return b"address already in use" in log.read()
        except OSError:
            return False

    async def stop(self) -> None:
        """TERM, then KILL after STOP_GRACE_S; shielded, each wait bounded."""
        process = self._process
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                process.terminate()
                with anyio.move_on_after(STOP_GRACE_S):
                    await process.wait()
            if process.returncode is None:
                process.kill()
                with anyio.move_on_after(STOP_GRACE_S):
                    await process.wait()
            with anyio.move_on_after(STOP_GRACE_S):
                await process.aclose()


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the registry binds (Go sets it)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def choose_port(folder: Path, *, fresh: bool = False) -> int:
    """The port the folder's registry listened on last time when it is free now (and not ``fresh``), else a free one
    (remembered)."""
    saved = folder / "port"
    with contextlib.suppress(OSError, ValueError):
        port = int(saved.read_text().strip())
        if not fresh and 0 < port < 65536 and _port_is_free(port):
            return port
    port = _free_port()
    saved.write_text(f"{port}\n")
    return port


@contextlib.contextmanager
def _locked(folder: Path):
    path = folder / "lock"
    with path.open("a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "?"
            raise RegistryError(f"another `swectl image sync` (pid {holder}) uses the cache {folder}: wait for it to "
                                "end, or give this one another --cache") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


async def _wait_ready(running: RunningRegistry) -> None:
    url = f"{running.registry.url}/v2/"
    async with httpx.AsyncClient(timeout=1.0) as client:
        while True:
            if running.exit_code is not None:
                raise RegistryError(f"the controller's registry exited {running.exit_code} at start: "
                                    f"{running.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url)).status_code == 200:
                    return
            await anyio.sleep(0.05)


def _prepare(folder: Path, *, fresh_port: bool = False) -> tuple[int, Path]:
    """The port and the config file of the folder's registry (written now)."""
    (folder / STORAGE).mkdir(exist_ok=True)
    port = choose_port(folder, fresh=fresh_port)
    config = folder / "config.yml"
    config.write_text(registry_config(f"127.0.0.1:{port}", (folder / STORAGE).resolve()))
    return port, config


@contextlib.asynccontextmanager
async def controller_registry(folder: Path) -> AsyncIterator[RunningRegistry]:
    """Run the controller's registry on the cache ``folder`` (see the module docstring) until the block ends; its
    exit stops it (TERM, then KILL after STOP_GRACE_S). RegistryError when it cannot start."""
    reason = missing_registry()
    if reason is not None:
        raise RegistryError(reason)
    folder.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 (a folder, at once)
    with _locked(folder):
        for attempt in range(1, PORT_TRIES + 1):
            running = await _start(folder, fresh_port=attempt > 1)
            try:
                with anyio.fail_after(START_TIMEOUT_S):
                    await _wait_ready(running)
                break
            except BaseException as exc:
                await running.stop()
                if isinstance(exc, TimeoutError):
                    raise RegistryError(f"the controller's registry did not answer on {running.registry.url} "
                                        f"within {START_TIMEOUT_S:g}s: {running.log_tail()}") from None
                if not (isinstance(exc, RegistryError) and running.port_was_taken()) or attempt == PORT_TRIES:
                    raise
        try:
            yield running
        finally:
            await running.stop()


async def _start(folder: Path, *, fresh_port: bool) -> RunningRegistry:
    port, config = _prepare(folder, fresh_port=fresh_port)
    setpriv = shutil.which("setpriv")
    argv = [*([setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []), REGISTRY_BIN, "serve", str(config)]
    with (folder / "registry.log").open("ab") as log:
        start = log.tell()
        process = await anyio.open_process(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    return RunningRegistry(folder, port, process, start)
