"""A Harbor environment class over `swectl serve`: `harbor run` with any of its agents, in swectl's sandboxes.

This file runs inside Harbor's own interpreter (Python >= 3.12, .venv-harbor), not swectl's: it uses the standard
library and Harbor alone, and talks to a running ``swectl serve`` (its fleet: the config's nodes, local namespace
sandboxes by default) over its HTTP API. Harbor loads it by import path::

    swectl serve --tasks TASKS_DIR --port 18090 &        # builds each Harbor task's image once, offline
    PYTHONPATH=<swectl checkout> SWECTL_SERVE_URL=http://127.0.0.1:18090 \\
        harbor run -p TASKS_DIR -a oracle -e swectl.serve.harbor_env:SwectlEnvironment

(``--ek url=...`` and ``--ek api_key_file=...`` work as well as $SWECTL_SERVE_URL and $SWECTL_SERVE_API_KEY.)

``start`` allocates a lease for the trial's task (its environment name is the task folder's name, which is the
instance id ``swectl serve --tasks`` gave it, so the lease runs the image swectl built for it; a task the service does
not know is an error that says so) and heartbeats it while the trial runs; ``exec`` is the service's ``/exec`` (a
login shell, the output whole, stderr merged into stdout); files travel as base64 through ``/exec`` in chunks
(directories as tar archives); ``stop`` closes the lease (its sandbox is removed). The sandboxes have no network
(the task's ``allow_internet = false`` is honoured; swectl's ``[sandbox] network`` decides otherwise).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import shlex
import tarfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities

CHUNK = 48 * 1024  # bytes of a file per /exec (its base64 stays below the kernel's 128 KiB limit on one argument)
DEFAULT_TIMEOUT_S = 3600.0  # a command Harbor gives no timeout
HEARTBEAT_S = 30.0
HTTP_SLACK_S = 60.0  # the HTTP call's bound beyond the command's own timeout


class SwectlEnvironment(BaseEnvironment):
    """Harbor's BaseEnvironment over a `swectl serve` lease."""

    def __init__(self, *args: Any, url: str | None = None, api_key_file: str | None = None, **kwargs: Any) -> None:
        self._url = (url or os.environ.get("SWECTL_SERVE_URL") or "http://127.0.0.1:18090").rstrip("/")
        key = Path(api_key_file).read_text().strip() if api_key_file else os.environ.get("SWECTL_SERVE_API_KEY", "")
        self._key = key
        self._lease = ""
        self._heartbeat: asyncio.Task | None = None
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> str:
        return "swectl"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    def _validate_definition(self) -> None:
        if not (self.environment_dir / "Dockerfile").is_file() and not self.task_env_config.docker_image:
            raise FileNotFoundError(f"{self.environment_dir}/Dockerfile: missing (swectl serve builds the task's "
                                    "image from it) and no docker_image")

    # ------------------------------------------------------------------ the service

    def _post_sync(self, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        request = urllib.request.Request(f"{self._url}{path}", data=json.dumps(body).encode(), headers=headers,
                                         method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"swectl serve {path}: HTTP {exc.code}: "
                                   f"{exc.read()[:2000].decode(errors='replace')}") from exc
        except urllib.error.URLError as exc:
            raise RuntimeError(f"swectl serve at {self._url} does not answer ({exc.reason}); start it with "
                                   "`swectl serve --tasks TASKS_DIR` and set SWECTL_SERVE_URL") from exc

    async def _post(self, path: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        return await asyncio.to_thread(self._post_sync, path, body, timeout)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self._post("/heartbeat", {"lease_id": self._lease}, timeout=30.0)
            except RuntimeError as exc:
                self.logger.warning(f"swectl lease heartbeat failed: {exc}")

    # ------------------------------------------------------------------ the lifecycle

    async def start(self, force_build: bool) -> None:
        body: dict[str, Any] = {"instance_id": self.environment_name}
        if self.task_env_config.docker_image:
            body["image"] = self.task_env_config.docker_image
        got = await self._post("/allocate", body, timeout=900.0)
        if not got.get("task_known") and not body.get("image"):
            await self._post("/close", {"lease_id": got["lease_id"]})
            raise RuntimeError(f"swectl serve does not know the task {self.environment_name!r}: start it with "
                                   "--tasks naming the folder that holds this task")
        self._lease = got["lease_id"]
        self._heartbeat = asyncio.create_task(self._beat())
        await self.exec("mkdir -p /logs/agent /logs/verifier /logs/artifacts")

    async def stop(self, delete: bool) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        if self._lease:
            lease, self._lease = self._lease, ""
            await self._post("/close", {"lease_id": lease}, timeout=120.0)

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        if not self._lease:
            raise RuntimeError("exec before start (no swectl lease)")
        timeout = float(timeout_sec) if timeout_sec else DEFAULT_TIMEOUT_S
        env = self._merge_env(env) if hasattr(self, "_merge_env") else env
        user = self._resolve_user(user) if hasattr(self, "_resolve_user") else user
        if user not in (None, "root", 0, "0"):
            command = f"runuser -u {shlex.quote(str(user))} -- bash -c {shlex.quote(command)}"
        body: dict[str, Any] = {"lease_id": self._lease, "command": command, "timeout": timeout,
                                "env": dict(env or {})}
        workdir = cwd or self.task_env_config.workdir
        if workdir:
            body["cwd"] = workdir
        got = await self._post("/exec", body, timeout=timeout + HTTP_SLACK_S)
        return ExecResult(stdout=got.get("output", ""), stderr="", return_code=int(got.get("returncode", -1)))

    # ------------------------------------------------------------------ files

    async def _checked(self, command: str, what: str) -> str:
        result = await self.exec(command, timeout_sec=600)
        if result.return_code != 0:
            raise RuntimeError(f"{what} failed (exit {result.return_code}): {(result.stdout or '')[-1000:]}")
        return result.stdout or ""

    async def _put(self, data: bytes, target: str) -> None:
        quoted = shlex.quote(target)
        await self._checked(f"mkdir -p \"$(dirname {quoted})\" && : > {quoted}", f"creating {target}")
        for start in range(0, len(data), CHUNK) or [0]:
            piece = base64.b64encode(data[start:start + CHUNK]).decode()
            await self._checked(f"printf %s {piece} | base64 -d >> {quoted}", f"writing {target}")

    async def _get(self, source: str) -> bytes:
        quoted = shlex.quote(source)
        size = int((await self._checked(f"stat -c %s {quoted}", f"reading {source}")).split()[-1])
        out = bytearray()
        for start in range(0, size, CHUNK):
            text = await self._checked(f"tail -c +{start + 1} {quoted} | head -c {CHUNK} | base64 -w0",
                                       f"reading {source}")
            out += base64.b64decode(text.strip().splitlines()[-1] if text.strip() else "")
        return bytes(out)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        await self._put(await asyncio.to_thread(Path(source_path).read_bytes), target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        data = await asyncio.to_thread(_pack, Path(source_dir))
        archive = f"/tmp/swectl-upload-{os.getpid()}.tar"
        await self._put(data, archive)
        q = shlex.quote(target_dir)
        await self._checked(f"mkdir -p {q} && tar -xf {archive} -C {q} --no-same-owner && rm -f {archive}",
                            f"unpacking into {target_dir}")

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self._get(source_path)
        await asyncio.to_thread(_write, Path(target_path), data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        archive = f"/tmp/swectl-download-{os.getpid()}.tar"
        await self._checked(f"tar -cf {archive} -C {shlex.quote(source_dir)} .", f"packing {source_dir}")
        data = await self._get(archive)
        await self._checked(f"rm -f {archive}", "removing the archive")
        await asyncio.to_thread(_unpack, data, Path(target_dir))


def _pack(folder: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(str(folder), arcname=".")
    return buf.getvalue()


def _write(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def _unpack(data: bytes, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(target, filter="data")
