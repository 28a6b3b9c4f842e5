"""A run's ``swectl.log`` gets what happens inside the run: `swectl up` reaps a dead controller's container at
start, and says so in ``<out_dir>/<run_id>/swectl.log`` (not on the terminal without -v)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from swectl.cli.main import main
from swectl.sandbox import LABEL_CONTROLLER, LABEL_MANAGED, LABEL_NODE, LABEL_RUN

from .conftest import BASE_IMAGE, SESSION_ID, TEST_LABEL, podman

pytestmark = [pytest.mark.integration]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_reaped_orphans_are_in_the_run_log(tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    labels = {LABEL_MANAGED: "1", LABEL_NODE: "local", LABEL_RUN: "dead-run",
              LABEL_CONTROLLER: f"{socket.gethostname()}:{_dead_pid()}", TEST_LABEL: SESSION_ID}
    orphan = podman("run", "-d", *[f"--label={k}={v}" for k, v in labels.items()], BASE_IMAGE,
                    "sleep", "300").stdout.decode().strip()
    assert orphan
    code = main(["up", "--recipe", "train", "--steps", "1", "--set", f"out_dir={str(tmp_path)!r}",
                 "--set", "run_id='logged'",
                 "--set", "sandbox.backend='podman'",  # the orphan is a podman container
                 "--set", "env_pool.warm=0", "--set", f"train.model={str(model)!r}",
                 "--set", "train.sampling.n_samples=2",
                 "--set", "train.sampling.tasks_per_step=1", "--set", "train.sampling.dynamic_sampling=false",
                 "--set", "rollout.step_limit=1", "--set", "rollout.max_tokens=16"])
    assert code == 0
    log = (tmp_path / "logged" / "swectl.log").read_text()
    assert re.search(r" INFO swectl\.actors\.env_pool: reaped \d+ orphan container\(s\) on node local", log), log
    err = capsys.readouterr().err
    assert "orphan container" not in err  # info reaches the terminal only with -v
    assert podman("ps", "-a", "-q", "--filter", f"id={orphan}").stdout.decode().strip() == ""
