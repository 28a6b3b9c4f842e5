"""A `swectl serve` process for the integration tests and a plain HTTP client written from what swe-rl rollouts
send (JSON POSTs, answers with ``ok``); it shares no code with the server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from swectl.images.project import BUNDLED_TASKS
from tests.integration.conftest import REPO_ROOT, podman

START_TIMEOUT_S = 90
STOP_TIMEOUT_S = 60


class Service:
    """One `swectl serve` process on a free port; its URL is read from its status line."""

    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.run_id = f"serve-test-{uuid.uuid4().hex[:8]}"
        self.log = tmp / f"{self.run_id}.stderr"
        self.out = tmp / self.run_id  # the service's --out: swectl.log, eval-logs/
        argv = [sys.executable, "-m", "swectl.cli.main", "serve", "--port", "0", "--set", f"run_id='{self.run_id}'",
                "--set", "sandbox.backend='podman'",  # the tests count and kill the service's containers
                "--out", str(tmp / self.run_id), *args]
        with self.log.open("wb") as err:
            self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                         env={**os.environ, **(env or {})})
        self.url = self._wait_url()

    def _wait_url(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for line in self.log.read_text(errors="replace").splitlines():
                if "serving the fleet on " in line:
                    return line.split("serving the fleet on ", 1)[1].split()[0]
            if self.proc.poll() is not None:
                pytest.fail(f"swectl serve exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        pytest.fail(f"swectl serve did not start within {START_TIMEOUT_S}s:\n{self.log.read_text()[-3000:]}")

    def containers(self) -> list[str]:
        out = podman("ps", "-a", "-q", "--filter", f"label=swectl.run={self.run_id}")
        return out.stdout.decode().split()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.leftover = self.containers()  # what the service left behind (removed here, for the next tests)
        if self.leftover:
            podman("rm", "-f", "-t", "0", *self.leftover)
        return self.proc.returncode


class Client:
    """What a swe-rl rollout sends: JSON POSTs, answers with ``ok``."""

    def __init__(self, url: str, key: str | None = None, *, local_address: str | None = None) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        transport = httpx.HTTPTransport(local_address=local_address) if local_address else None
        self.http = httpx.Client(base_url=url, timeout=120, headers=headers, transport=transport)

    def post(self, path: str, body: object, *, headers: dict[str, str] | None = None) -> tuple[int, dict]:
        r = self.http.post(path, content=json.dumps(body), headers=headers)
        return r.status_code, r.json()

    def ok(self, path: str, body: object, **kwargs: object) -> dict:
        status, answer = self.post(path, body, **kwargs)  # type: ignore[arg-type]
        assert status == 200 and answer["ok"] is True, (path, status, answer)
        return answer

    def allocate(self, **body: str) -> str:
        return self.ok("/allocate", body)["lease_id"]

    def exec(self, lease: str, command: str, **extra: object) -> dict:
        return self.ok("/exec", {"lease_id": lease, "command": command, **extra})


def bundled_tasks(n: int) -> list[dict]:
    rows = [json.loads(line) for line in BUNDLED_TASKS.read_text().splitlines() if line.strip()]
    return rows[:n]
