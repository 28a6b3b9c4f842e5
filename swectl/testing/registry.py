"""A throwaway OCI image registry on this machine, for tests and benchmarks only.

Debian's ``docker-registry`` (the CNCF distribution registry, 2.8; ``scripts/setup.sh`` installs it and never starts
its service) serving plain HTTP on one address of this machine: pass an address the test nodes reach (a node's
``host_addr``, this machine's end of its veth) or ``127.0.0.1`` for this machine alone, never a wildcard. Its blobs go
to a temp dir of its own; :func:`stop_registry` kills it by its pid and deletes that dir. Deleting is enabled, so a
test can remove an image from it.

A registry that is down is simply one that was stopped (or a port nothing listens on).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from swectl.images.controller_registry import REGISTRY_BIN, registry_config

_START_TIMEOUT = 20.0

__all__ = ["LocalRegistry", "can_run_registry", "local_registry", "start_registry", "stop_registry"]


@dataclass(frozen=True)
class LocalRegistry:
    """A running registry: ``url`` (``http://host:port``) is what ``swectl image push|sync --registry`` take."""

    host: str
    port: int
    pid: int
    workdir: str
    log_path: str

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def log_tail(self, limit: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-limit:]
        except OSError:
            return ""


def can_run_registry() -> str | None:
    """None when a registry can be started here, else why not."""
    if not os.access(REGISTRY_BIN, os.X_OK):
        return f"no registry at {REGISTRY_BIN} (apt-get install docker-registry; scripts/setup.sh does)"
    return None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/", timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start_registry(host: str = "127.0.0.1", port: int = 0) -> LocalRegistry:
    """Start a registry listening on ``host:port`` only (``port`` 0: a free one) and wait until it answers."""
    reason = can_run_registry()
    if reason is not None:
        raise RuntimeError(reason)
    if ipaddress.ip_address(host).is_unspecified:
        raise ValueError(f"registry address {host}: listen on one address of this machine, not on every one")
    port = port or _free_port(host)
    workdir = Path(tempfile.mkdtemp(prefix="swectl-registry-"))
    (workdir / "storage").mkdir()
    config = workdir / "config.yml"
    config.write_text(registry_config(f"{host}:{port}", workdir / "storage", delete=True))
    log_path = workdir / "registry.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [REGISTRY_BIN, "serve", str(config)], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True,
        )
    registry = LocalRegistry(host=host, port=port, pid=proc.pid, workdir=str(workdir), log_path=str(log_path))
    deadline = time.monotonic() + _START_TIMEOUT
    while not _answers(registry.url):
        if proc.poll() is not None or time.monotonic() > deadline:
            state = f"exited {proc.returncode}" if proc.poll() is not None else f"no answer after {_START_TIMEOUT}s"
            tail = registry.log_tail()
            stop_registry(registry)
            raise RuntimeError(f"registry on {registry.address}: {state}: {tail}")
        time.sleep(0.05)
    return registry


def stop_registry(registry: LocalRegistry) -> None:
    """Kill the registry (by its pid) and delete its storage. Idempotent."""
    try:
        os.kill(registry.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            done, _status = os.waitpid(registry.pid, os.WNOHANG)
        except ChildProcessError:  # not our child (another process started it), or already reaped
            break
        if done:
            break
        time.sleep(0.02)
    shutil.rmtree(registry.workdir, ignore_errors=True)


@contextmanager
def local_registry(host: str = "127.0.0.1", port: int = 0) -> Iterator[LocalRegistry]:
    """``start_registry`` ... ``stop_registry``, even on error."""
    registry = start_registry(host, port)
    try:
        yield registry
    finally:
        stop_registry(registry)
