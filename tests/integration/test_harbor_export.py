"""`swectl tasks export --harbor` run by Harbor itself (0.25.0, unmodified, .venv-harbor): `harbor lint` passes the
exported folders (but for the shared verifier every SWE task needs), and `harbor run` with Harbor's own podman
environment scores its oracle agent 1 and its no-op agent 0 on each exported task: two bundled SWE tasks (their
eval scripts and SWE-bench's rule in the exported verifier) and a bundled Harbor terminal task (its environment
pinned to the image swectl built)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.harbor_tools import harbor_python

pytestmark = [pytest.mark.integration]
# Harbor's podman environment: its container with an init (a stop then takes no 10 s) and no network.
OVERLAY = "services:\n  main:\n    init: true\n    network_mode: none\n"


def _harbor_env(home: Path) -> dict[str, str]:
    venv_bin = harbor_python().parent
    return {**os.environ, "HOME": str(home), "PATH": f"{venv_bin}:{os.environ['PATH']}",
            "CONTAINERS_CONF": str(REPO_ROOT / "remote" / "nodes" / "containers.conf"),
            "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


def _podman(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CONTAINERS_CONF": str(REPO_ROOT / "remote" / "nodes" / "containers.conf")}
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=300, env=env, check=False)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("harbor-export")
    swectl = [sys.executable, "-m", "swectl.cli.main", "tasks", "export", "--harbor", str(out)]
    for extra in (["--slice", "0:2"], ["--tasks", str(REPO_ROOT / "swectl/data/bundled/harbor"),
                                       "--instances", "log-error-counts"]):
        run = subprocess.run([*swectl, *extra], capture_output=True, text=True, timeout=600, check=False)
        assert run.returncode == 0, run.stdout + run.stderr
    return out


def test_harbor_lint_passes_the_exported_tasks(exported: Path, tmp_path: Path) -> None:
    folders = sorted(str(p) for p in exported.iterdir())
    assert len(folders) == 3
    run = subprocess.run([str(harbor_python().parent / "harbor"), "lint", "--ignore", "shared-verifier", *folders],
                         capture_output=True, text=True, timeout=120, env=_harbor_env(tmp_path), check=False)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize(("agent", "reward"), [("oracle", 1.0), ("nop", 0.0)])
def test_harbor_runs_the_exported_tasks(exported: Path, tmp_path: Path, agent: str, reward: float) -> None:
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(OVERLAY)
    jobs = tmp_path / "jobs"
    before = set(_podman("images", "--format", "{{.Repository}}").stdout.split())
    try:
        run = subprocess.run(
            [str(harbor_python().parent / "harbor"), "run", "-p", str(exported), "-a", agent, "-e", "podman",
             "-o", str(jobs), "-n", "2", "-y", "--no-delete", "--extra-docker-compose", str(overlay)],
            capture_output=True, text=True, timeout=600, env=_harbor_env(tmp_path), check=False, cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        trials = sorted(jobs.glob("*/*/result.json"))
        assert len(trials) == 3, (trials, run.stdout[-2000:])
        for path in trials:
            result = json.loads(path.read_text())
            assert result["exception_info"] is None, (path, result["exception_info"])
            assert result["verifier_result"]["rewards"]["reward"] == reward, (path, result["verifier_result"])
    finally:  # the images Harbor built (kept by --no-delete, which keeps podman-compose off the base images)
        built = set(_podman("images", "--format", "{{.Repository}}").stdout.split()) - before
        if built:
            _podman("rmi", "-f", *sorted(built))
