"""Harbor (PyPI `harbor` 0.25.0, unmodified, in .venv-harbor from `bash scripts/setup.sh --with-harnesses`) as the
tests and `benchmarks/harbor.py` run it: its interpreter and CLI, `harbor run` on a folder of tasks with its podman
environment or swectl's class, the trials' results, and a `swectl serve` for swectl's class to talk to."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec

REPO_ROOT = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = REPO_ROOT / "remote" / "nodes" / "containers.conf"
BUNDLED_HARBOR = REPO_ROOT / "swectl" / "data" / "bundled" / "harbor"
SWECTL_ENV = "swectl.serve.harbor_env:SwectlEnvironment"
# Harbor's podman environment: its container with an init (a stop then takes no 10 s) and no network.
PODMAN_OVERLAY = "services:\n  main:\n    init: true\n    network_mode: none\n"


class Trial(msgspec.Struct, frozen=True, kw_only=True):
    """One Harbor trial as its result.json tells it."""
    task: str
    reward: float | None
    exception: str
    seconds: float  # started_at to finished_at


def harbor_python() -> Path:
    """Harbor's interpreter; an AssertionError saying how to install it when it is not there (never a skip: CI
    installs it)."""
    venv = Path(os.environ.get("SWECTL_HARBOR_VENV", REPO_ROOT / ".venv-harbor"))
    python = venv / "bin" / "python"
    assert python.is_file(), f"{python} is missing: run `bash scripts/setup.sh --with-harnesses` (installs Harbor)"
    return python


def harbor_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment Harbor runs with: its venv's bin first (podman-compose), a HOME of its own, swectl's
    containers.conf, litellm's bundled cost map (no download), and swectl importable (its environment class)."""
    return {**os.environ, "HOME": str(home), "PATH": f"{harbor_python().parent}:{os.environ['PATH']}",
            "CONTAINERS_CONF": str(CONTAINERS_CONF), "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "PYTHONPATH": str(REPO_ROOT), **extra}


def run_harbor(*args: str, home: Path, timeout: float = 900, **extra_env: str) -> subprocess.CompletedProcess:
    """``harbor ARGS`` (its own CLI), output captured."""
    return subprocess.run([str(harbor_python().parent / "harbor"), *args], capture_output=True, text=True,
                          timeout=timeout, env=harbor_env(home, **extra_env), cwd=home, check=False)


def harbor_trials(tasks: Path, agent: str, jobs: Path, *, home: Path, environment: str = "podman", n: int = 2,
                  serve_url: str = "") -> tuple[list[Trial], subprocess.CompletedProcess]:
    """``harbor run -p TASKS -a AGENT`` with its podman environment (the no-network overlay, ``--no-delete``: its
    podman-compose would remove every localhost image it ran FROM) or swectl's class (``environment="swectl"``,
    against ``serve_url``); the trials of that job."""
    before = set(jobs.glob("*/*/result.json"))
    args = ["run", "-p", str(tasks), "-a", agent, "-o", str(jobs), "-n", str(n), "-y"]
    extra: dict[str, str] = {}
    if environment == "swectl":
        args += ["-e", SWECTL_ENV]
        extra["SWECTL_SERVE_URL"] = serve_url
    else:
        overlay = home / "podman-overlay.yaml"
        overlay.write_text(PODMAN_OVERLAY)
        args += ["-e", environment, "--no-delete", "--extra-docker-compose", str(overlay)]
    run = run_harbor(*args, home=home, **extra)
    trials = [_trial(p) for p in sorted(set(jobs.glob("*/*/result.json")) - before)]
    return trials, run


def _trial(path: Path) -> Trial:
    result = json.loads(path.read_text())
    rewards = (result.get("verifier_result") or {}).get("rewards") or {}
    info = result.get("exception_info") or {}
    started, finished = (dt.datetime.fromisoformat(result[k].replace("Z", "+00:00"))
                         for k in ("started_at", "finished_at"))
    return Trial(task=str(result.get("task_name", path.parent.name)), reward=rewards.get("reward"),
                 exception=str(info.get("exception_type", "")) if info else "",
                 seconds=(finished - started).total_seconds())


def podman_repositories() -> set[str]:
    """The repository names of this machine's podman images (swectl's containers.conf)."""
    out = subprocess.run(["podman", "images", "--format", "{{.Repository}}"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}, check=True)
    return set(out.stdout.split())


@contextlib.contextmanager
def removing_new_images() -> Iterator[None]:
    """Remove, afterwards, the podman images that appeared meanwhile: the ones Harbor's podman environment builds
    per trial and keeps under ``--no-delete``."""
    before = podman_repositories()
    try:
        yield
    finally:
        if built := sorted(podman_repositories() - before):
            subprocess.run(["podman", "rmi", "-f", *built], capture_output=True, timeout=300, check=False,
                           env={**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)})


def export_bundled(out: Path) -> None:
    """`swectl tasks export --harbor OUT` of two bundled SWE tasks and the bundled terminal task log-error-counts
    (what the export tests and `benchmarks/harbor.py` run Harbor on)."""
    swectl = [sys.executable, "-m", "swectl.cli.main", "tasks", "export", "--harbor", str(out)]
    for extra in (["--slice", "0:2"], ["--tasks", str(BUNDLED_HARBOR), "--instances", "log-error-counts"]):
        run = subprocess.run([*swectl, *extra], capture_output=True, text=True, timeout=900, check=False)
        assert run.returncode == 0, run.stdout + run.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def swectl_serving(tasks: Path, out: Path, *, start_timeout_s: float = 600) -> Iterator[str]:
    """A `swectl serve --tasks TASKS` subprocess on a free loopback port (its URL), stopped with SIGTERM (every
    sandbox removed) afterwards."""
    port = free_port()
    log = out / "serve.log"
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    with log.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "swectl.cli.main", "serve", "--tasks", str(tasks), "--port",
                                 str(port), "--out", str(out / "serve")], stdout=sink, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"swectl serve exited {proc.returncode}: {log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"swectl serve did not answer in {start_timeout_s:g} s") from None
                time.sleep(0.3)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
