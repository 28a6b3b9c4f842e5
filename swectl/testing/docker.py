"""A private Docker daemon on this machine, for tests only (the ``docker`` sandbox backend's contract tests).

``start_private_docker()`` starts ``dockerd`` with everything of its own, so it neither meets nor changes the
host's Docker (if any) or firewall:

* socket ``unix:///run/swectl-test-docker/<id>/docker.sock``, pid file, exec root and its managed
  containerd under ``/run/swectl-test-docker/<id>/``; ``--config-file`` an empty daemon.json there;
* data root (images, containers, overlay2 layers) ``/var/lib/swectl-test-docker/<id>/``;
* ``--bridge none --iptables=false --ip-masq=false --ip-forward=false``: no docker0 bridge, no iptables
  rules, no sysctl change. Containers get ``--network none`` anyway.

``<id>`` is ``<pid>-<random>`` of the creating process, so concurrent test sessions get separate daemons.
``DockerDaemon.stop()`` removes the daemon's containers, stops it by its pid (SIGTERM, then SIGKILL) and
deletes both folders; folders left by a dead process (a killed session) are deleted at the next start
when nothing is mounted under them. Docker's image store is its own: ``load_from_podman`` copies images
from Podman (``podman save IMAGES | docker load``; the base image takes about 8 s).

Needs root and ``docker.io`` from Debian's apt (``scripts/setup.sh`` installs it but never starts dockerd).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from swectl.remote.nodes.podman import local_podman_env

DATA_ROOT = Path("/var/lib/swectl-test-docker")
RUN_ROOT = Path("/run/swectl-test-docker")
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
_CMD_TIMEOUT_S = 120.0


def docker_unavailable() -> str | None:
    """Why a test dockerd cannot be started here, or None."""
    missing = [tool for tool in ("dockerd", "docker") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed; run `bash scripts/setup.sh` (installs docker.io)"
    if os.geteuid() != 0:
        return "a private dockerd needs root"
    return None


@dataclass
class DockerDaemon:
    """A running private dockerd: ``host`` is its DOCKER_HOST."""

    host: str
    pid: int
    data_root: Path
    run_dir: Path

    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.host}

    def docker(
        self, *args: str, input: bytes | None = None, timeout: float = _CMD_TIMEOUT_S, check: bool = False
    ) -> subprocess.CompletedProcess[bytes]:
        """``docker *args`` against this daemon."""
        return subprocess.run(
            ["docker", *args], input=input, capture_output=True, env=self.env(), timeout=timeout, check=check
        )

    def image_id(self, image: str) -> str:
        out = self.docker("image", "inspect", "--format", "{{.Id}}", image)
        return out.stdout.decode().strip().removeprefix("sha256:") if out.returncode == 0 else ""

    def load_from_podman(self, images: list[str], timeout: float = 600) -> None:
        """Copy ``images`` from this machine's Podman store (``podman save -m ... | docker load``); images whose
        id already matches are skipped."""
        todo = []
        for image in images:
            wanted = _podman_id(image)
            if not wanted:
                raise RuntimeError(f"{image} is not in this machine's Podman store")
            if self.image_id(image) != wanted:
                todo.append(image)
        if not todo:
            return
        save = subprocess.Popen(
            ["podman", "save", "--multi-image-archive", *todo],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=local_podman_env(),
        )
        try:
            load = subprocess.run(
                ["docker", "load", "--quiet"], stdin=save.stdout, capture_output=True, env=self.env(), timeout=timeout
            )
        finally:
            assert save.stdout is not None
            save.stdout.close()
            try:
                save_err = save.communicate(timeout=30)[1]
            except subprocess.TimeoutExpired:
                save.kill()
                save_err = save.communicate()[1]
        if save.returncode != 0 or load.returncode != 0:
            raise RuntimeError(
                f"podman save {' '.join(todo)} | docker load failed: podman: {save_err.decode(errors='replace')} "
                f"docker: {load.stderr.decode(errors='replace')}"
            )
        for image in todo:
            if not self.image_id(image):
                raise RuntimeError(f"docker load did not bring {image} into the test daemon")

    def remove_containers(self, label: str | None = None) -> None:
        """Force-remove this daemon's containers (those with ``label``, a ``key=value``, when given)."""
        args = ["ps", "-a", "-q", "--no-trunc", *(["--filter", f"label={label}"] if label else [])]
        ids = self.docker(*args).stdout.decode().split()
        if ids:
            self.docker("rm", "--force", *ids)

    def stop(self) -> None:
        """Remove every container, stop the daemon by its pid and delete its folders. Idempotent."""
        if _alive(self.pid):
            try:
                self.remove_containers()
            except (OSError, subprocess.TimeoutExpired):
                pass
            _terminate(self.pid)
        _cleanup(self.data_root, self.run_dir)


def start_private_docker(timeout: float = START_TIMEOUT_S) -> DockerDaemon:
    """Start a private dockerd and wait until it answers; the caller stops it (``DockerDaemon.stop``)."""
    reason = docker_unavailable()
    if reason:
        raise RuntimeError(reason)
    _remove_stale()
    ident = f"{os.getpid()}-{secrets.token_hex(4)}"
    data_root, run_dir = DATA_ROOT / ident, RUN_ROOT / ident
    data_root.mkdir(parents=True, mode=0o700)
    run_dir.mkdir(parents=True, mode=0o700)
    (run_dir / "daemon.json").write_text("{}\n")
    host = f"unix://{run_dir / 'docker.sock'}"
    argv = [
        "dockerd", "--host", host, "--data-root", str(data_root), "--exec-root", str(run_dir / "exec"),
        "--pidfile", str(run_dir / "dockerd.pid"), "--config-file", str(run_dir / "daemon.json"),
        "--bridge", "none", "--iptables=false", "--ip-masq=false", "--ip-forward=false",
        "--userland-proxy=false", "--log-level", "warn",
    ]  # fmt: skip
    log_path = run_dir / "dockerd.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd="/"
        )
    daemon = DockerDaemon(host=host, pid=process.pid, data_root=data_root, run_dir=run_dir)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            daemon.stop()
            raise RuntimeError(f"dockerd exited {process.returncode} at start: {_tail(log_path)}")
        try:
            if daemon.docker("version", "--format", "{{.Server.Version}}", timeout=10).returncode == 0:
                return daemon
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() > deadline:
            tail = _tail(log_path)
            daemon.stop()
            raise RuntimeError(f"dockerd did not answer on {host} within {timeout:g}s: {tail}")
        time.sleep(0.2)


@contextmanager
def private_docker(images: Sequence[str] = ()) -> Iterator[DockerDaemon]:
    """A private dockerd with ``images`` loaded from Podman, stopped (and its folders deleted) on exit."""
    daemon = start_private_docker()
    try:
        daemon.load_from_podman(list(images))
        yield daemon
    finally:
        daemon.stop()


def _podman_id(image: str) -> str:
    out = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Id}}", image],
        capture_output=True, env=local_podman_env(), timeout=_CMD_TIMEOUT_S, check=False,
    )  # fmt: skip
    return out.stdout.decode().strip()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # our own child that exited and was not reaped yet
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == 0


def _terminate(pid: int) -> None:
    """SIGTERM (dockerd stops its containers and its containerd), then SIGKILL after STOP_TIMEOUT_S."""
    for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 10.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _alive(pid):
                return
            time.sleep(0.1)


def _mounted_under(path: Path) -> list[str]:
    prefix = str(path) + "/"
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f]
    return [point for point in points if point == str(path) or point.startswith(prefix)]


def _cleanup(data_root: Path, run_dir: Path) -> None:
    """Delete a stopped daemon's folders: unmount what it left mounted (a SIGKILLed dockerd) first."""
    for root in (run_dir, data_root):
        for point in sorted(_mounted_under(root), key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=30, check=False)
        if _mounted_under(root):
            continue  # never delete through a mount
        shutil.rmtree(root, ignore_errors=True)


def _remove_stale() -> None:
    """Folders of daemons whose test process is gone (killed sessions): stop what still runs, delete them."""
    for parent in (RUN_ROOT, DATA_ROOT):
        if not parent.is_dir():
            continue
        for folder in parent.iterdir():
            owner = folder.name.split("-", 1)[0]
            if not owner.isdigit() or _alive(int(owner)):
                continue
            pidfile = RUN_ROOT / folder.name / "dockerd.pid"
            try:
                pid = int(pidfile.read_text().strip())
            except (OSError, ValueError):
                pid = 0
            if pid and _alive(pid) and _is_dockerd(pid):
                _terminate(pid)
            _cleanup(DATA_ROOT / folder.name, RUN_ROOT / folder.name)


def _is_dockerd(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "dockerd"
    except OSError:
        return False


def _tail(path: Path, size: int = 3000) -> str:
    try:
        return path.read_bytes()[-size:].decode(errors="replace")
    except OSError:
        return ""
