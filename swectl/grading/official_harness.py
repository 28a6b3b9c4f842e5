"""Grade with the official SWE-bench harness (swebench 5.x ``run_instance``) through Podman's
Docker-compatible API, to cross-check swectl's grader (tests) and to time it (``just bench grade``).

The harness knows nothing of swectl's ``setup_patch``: for tasks that carry one, a task image is made by
applying and committing the setup patch in a container of the project image and ``podman commit``-ing it.
The harness runs in a subprocess (its log folder is relative to the working directory, and it calls the
``docker`` CLI to stop containers: a shim on PATH forwards that to podman).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import msgspec

from swectl.grading.eval_script import eval_script_for, log_parser_for
from swectl.images.project import GIT_IDENTITY
from swectl.remote.nodes.podman import local_podman_env, run_local_podman
from swectl.tasks.record import TESTBED, Task

WORKER = r"""
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
from swebench.harness.run_evaluation import run_instance, _docker_client
from swebench.harness.utils import make_test_spec
req = json.load(open(sys.argv[1]))
client = _docker_client()
def one(job):
    i, inst, pred = job
    t0 = time.monotonic()
    res = run_instance(make_test_spec(inst), pred, client, f"{req['run_id']}-{i}", timeout=req["timeout"])
    report = None if res is None else res[1][inst["instance_id"]]
    return i, {"report": report, "seconds": time.monotonic() - t0}
jobs = list(zip(range(len(req["instances"])), req["instances"], req["predictions"]))
with ThreadPoolExecutor(req["workers"]) as ex:
    out = dict(ex.map(one, jobs))
json.dump([out[i] for i in range(len(jobs))], open(sys.argv[2], "w"))
"""


class OfficialVerdict(msgspec.Struct, frozen=True):
    """The official SWE-bench harness's verdict on one instance."""
    instance_id: str
    resolved: bool
    error: bool  # the harness raised (patch did not apply, timeout, ...): no report written
    seconds: float


@contextmanager
def podman_docker_socket() -> Iterator[str]:
    """``podman system service`` on a private unix socket; yields a DOCKER_HOST url."""
    tmp = Path(tempfile.mkdtemp(prefix="swectl-podman-api-"))
    sock = tmp / "podman.sock"
    proc = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{sock}"], env=local_podman_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("podman system service did not start")
            time.sleep(0.05)
        yield f"unix://{sock}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def _podman(*args: str, input: bytes | None = None) -> str:
    return run_local_podman(*args, input=input, timeout=600).stdout.decode()


def task_image(task: Task) -> str:
    """The image the harness sees: the project image with the setup patch committed (made once, cached)."""
    if not task.setup_patch:
        return task.image
    name = f"localhost/swectl-task.{task.instance_id.lower()}:latest"
    if run_local_podman("image", "exists", name, check=False).exit_code == 0:
        return name
    cid = _podman("run", "-d", "--network", "none", task.image, "sleep", "infinity").strip()
    try:
        env = [a for k, v in GIT_IDENTITY.items() for a in ("-e", f"{k}={v}")]
        _podman("exec", "-i", *env, "-w", TESTBED, cid, "bash", "-c",
                "cat > /tmp/setup.diff && git apply /tmp/setup.diff && git add -A && "
                "git commit -q --no-gpg-sign -m 'swectl: task setup' && rm /tmp/setup.diff",
                input=task.setup_patch.encode())
        _podman("commit", "-q", cid, name)
    finally:
        _podman("rm", "-f", "-t", "0", cid)
    return name


def _shim_dir(tmp: Path) -> Path:
    shim = tmp / "bin"
    shim.mkdir(exist_ok=True)
    (shim / "docker").write_text('#!/bin/sh\nexec podman "$@"\n')
    (shim / "docker").chmod(0o755)
    return shim


def grade_official(jobs: list[tuple[Task, str]], *, timeout_s: int = 1800, workers: int = 1,
                   run_id: str = "swectl-crosscheck", images: Mapping[str, str] | None = None,
                   specs: object | None = None) -> list[OfficialVerdict]:
    """Each (task, patch) graded by swebench's own ``run_instance`` (``workers`` at once, timed per job),
    in the order given. ``images``: instance_id -> image for classic SWE-bench rows (instance images built by
    ``swectl image build --repo-cache``), whose eval script comes from ``specs`` (the SWE-bench 4.1.0 specs)."""
    images = images or {}
    instances, predictions = [], []
    for t, patch in jobs:
        instances.append({
            "instance_id": t.instance_id, "image": images.get(t.instance_id) or task_image(t), "repo": t.repo,
            "version": t.version, "FAIL_TO_PASS": t.FAIL_TO_PASS, "PASS_TO_PASS": t.PASS_TO_PASS,
            "log_parser": log_parser_for(t), "eval_type": t.eval_type, "eval_script": eval_script_for(t, specs),
        })
        predictions.append({"instance_id": t.instance_id, "model_name_or_path": "swectl", "model_patch": patch})
    tmp = Path(tempfile.mkdtemp(prefix="swectl-harness-"))
    try:
        (tmp / "req.json").write_text(json.dumps({"instances": instances, "predictions": predictions,
                                                  "run_id": run_id, "timeout": timeout_s,
                                                  "workers": workers}))
        with podman_docker_socket() as docker_host:
            env = {**local_podman_env(), "DOCKER_HOST": docker_host,
                   "PATH": f"{_shim_dir(tmp)}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
            proc = subprocess.run([sys.executable, "-c", WORKER, "req.json", "out.json"], cwd=tmp, env=env,
                                  capture_output=True, timeout=timeout_s * max(1, len(jobs)) + 300)
        if proc.returncode != 0:
            raise RuntimeError(f"the swebench harness failed: {proc.stderr.decode(errors='replace')[-2000:]}")
        out = json.loads((tmp / "out.json").read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [
        OfficialVerdict(t.instance_id, resolved=bool(v["report"] and v["report"]["resolved"]),
                        error=v["report"] is None, seconds=round(v["seconds"], 3))
        for (t, _), v in zip(jobs, out, strict=True)
    ]
